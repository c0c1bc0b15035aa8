"""A learner's attention part alone, in this process: two sequences prefilled into a small paged cache in two
chunks (the second attends over cached keys too, as a prompt whose prefix was cached does), then one decode step
each, against a plain reference, and against the usual mistakes."""
import re
from traceback import format_exception

import torch
import torch.nn.functional as F

from tplab.layers.metadata import build_metadata
from tplab.exercises import learner_line
from tplab.exercises.layer_probes import NamedMistake, returned

H, H_KV, D, BLOCK, BLOCKS = 4, 2, 8, 4, 4
TABLES = [[2, 0], [3, 1]]                          # sequence 0: 3 tokens, 5, then 6; sequence 1: 2, 7, then 8
STEPS = [([3, 2], [3, 2]), ([2, 5], [5, 7]), ([1, 1], [6, 8])]   # (query_lens, context_lens) of each step
STEP_NAMES = ("prefill", "the prompt's second chunk (after cached keys)", "decode")


MASKS = {"causal": lambda key, query: key <= query, "none": lambda key, query: key >= 0,
         "inverted": lambda key, query: key > query, "strict": lambda key, query: key < query}   # True: may attend


def _reference(q, k, v, step, *, mask="causal", tiled=False, scale=D ** -0.5, new_only=False,
               top_left=False, whole_blocks=False) -> torch.Tensor:
    """Plain attention for one step: each sequence's new queries over its keys so far (over this step's keys
    only, when ``new_only``: the cache ignored; over every slot of its blocks, zeros where none is written yet,
    when ``whole_blocks``), (T, H * D); ``mask``: which keys a query sees (``MASKS``), with the queries counted
    from 0, not from their positions, where ``top_left`` (SDPA's ``is_causal``)."""
    rep = (lambda t: t.repeat(H // H_KV, 1, 1)) if tiled else (lambda t: t.repeat_interleave(H // H_KV, 0))
    out = []
    for b, (qb, kb, vb, ql, c) in enumerate(zip(q, k, v, *step)):      # per sequence
        lo = c - ql if new_only else 0                                 # the first key attended
        keys, values = kb[lo:c], vb[lo:c]                              # (Lk, H_kv, D)
        if whole_blocks:
            keys, values = (F.pad(x, (0, 0, 0, 0, 0, len(TABLES[b]) * BLOCK - c)) for x in (keys, values))
        s = qb[c - ql:c].transpose(0, 1) @ rep(keys.transpose(0, 1)).transpose(1, 2) * scale   # (H, Lq, Lk)
        queries = torch.arange(ql) if top_left else torch.arange(c - ql, c)
        s = s.masked_fill(~MASKS[mask](torch.arange(lo, lo + len(keys))[None, :], queries[:, None]), float("-inf"))
        out.append((s.softmax(-1) @ rep(values.transpose(0, 1))).transpose(0, 1).flatten(1))   # (Lq, H * D)
    return torch.cat(out)


def run(impl) -> dict:
    """Run ``impl`` on the two steps; the outputs per step, the cache, and the reference pieces."""
    gen = torch.Generator().manual_seed(0)
    total = STEPS[-1][1]
    q = [torch.randn(n, H, D, generator=gen) for n in total]            # every token of each sequence
    k = [torch.randn(n, H_KV, D, generator=gen) for n in total]
    v = [torch.randn(n, H_KV, D, generator=gen) for n in total]
    attn = impl(H, H_KV, D)
    cache = (torch.zeros(BLOCKS, BLOCK, H_KV, D), torch.zeros(BLOCKS, BLOCK, H_KV, D))
    outs, error = [], None
    for query_lens, context_lens in STEPS:
        meta = build_metadata(query_lens, context_lens, TABLES, BLOCK, torch.device("cpu"))
        pick = lambda xs: torch.cat([x[c - ql:c] for x, ql, c in zip(xs, query_lens, context_lens)])
        try:
            with torch.no_grad():
                out = attn(pick(q), pick(k), pick(v), cache, meta)
        except (RuntimeError, IndexError) as e:   # named in diagnose, after the cache of the steps before it
            if isinstance(e, (NotImplementedError, NamedMistake)):
                raise
            error = e
            break
        outs.append(returned(out, "the (T, H * D) output; the cache is written in place"))
    return {"q": q, "k": k, "v": v, "outs": outs, "cache": cache, "error": error, "impl": impl}


def _cache_problem(res) -> str | None:
    """What is wrong with the cache after the steps that ran, or None."""
    written = STEPS[len(res["outs"]) - 1][1] if res["outs"] else [0] * len(TABLES)   # each sequence's tokens so far
    if res["outs"] and not any(bool(c.any()) for c in res["cache"]):
        return ("the cache is still all zeros after the prefill: write into kv_cache's own storage, in place "
                "(kv_cache[0].view(-1, H_kv, D)[meta.slot_mapping] = k), not into a copy (.clone(), torch.cat, "
                "index_copy without its _)")
    for cache, x, what in zip(res["cache"], "kv", ("keys", "values")):
        flat = cache.flatten(0, 1)                                       # (slots, H_kv, D)
        for b, table in enumerate(TABLES):
            slots = torch.cat([torch.arange(blk * BLOCK, (blk + 1) * BLOCK) for blk in table])[:written[b]]
            want = res[x][b][:written[b]]
            if torch.allclose(flat[slots], want):
                continue
            where = f"the {x.upper()} cache does not hold sequence {b}'s {what} at the slots of its blocks {table}"
            shift = next((s for s in (1, -1) if 0 <= int(slots.min()) + s and int(slots.max()) + s < len(flat)
                          and torch.allclose(flat[slots + s], want)), None)
            if shift:
                return (f"{where}: they are {abs(shift)} slot {('later', 'earlier')[shift < 0]}; write them at "
                        "meta.slot_mapping as it is (slot = block * block_size + offset, already counted)")
            if torch.allclose(flat[slots], res["vk"[x == "v"]][b][:written[b]]):
                return f"{where}: it holds the {('values', 'keys')[x == 'v']}; k goes to kv_cache[0], v to kv_cache[1]"
            return (f"{where}: write {x} (T, H_kv, D) to meta.slot_mapping, as they are (later steps read them "
                    "back from there)")
    return None


def _error_problem(res) -> str | None:
    """The error a step raised, in words when it is a usual mistake of the cache write or of GQA; else None."""
    error, step = res["error"], len(res["outs"])
    what = STEP_NAMES[step]
    text = str(error)
    said = f"{what}: raised {type(error).__name__}: {text}{learner_line(res['impl'], ''.join(format_exception(error)))}"
    sizes = re.search(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\)", text)
    if sizes and {int(sizes[1]), int(sizes[2])} == {H, H_KV}:
        return (f"{said}. The queries have H = {H} heads, the keys and values H_kv = {H_KV}: each KV head serves "
                f"H / H_kv = {H // H_KV} query heads (enable_gqa=True in F.scaled_dot_product_attention, or "
                "repeat_interleave over the heads of the keys and values read from the cache, dim 0 of (H_kv, Lk, D))")
    keys = _keys_read(sizes, step)
    if keys:
        return f"{said}. {keys}"
    blocks = re.search(r"indexing result of shape \[\d+, (\d+), \d+, \d+\]", text)
    if (blocks and int(blocks[1]) == BLOCK) or f"for dimension 0 with size {BLOCKS}" in text:
        return (f"{said}. A slot counts token rows, not blocks: view each cache (num_blocks, block_size, H_kv, D) "
                "as (num_blocks * block_size, H_kv, D) (kv_cache[0].view(-1, H_kv, D)), then index it with the slots")
    if f"for dimension 0 with size {BLOCKS * BLOCK}" in text:
        return f"{said}. A slot past the cache's last: write at meta.slot_mapping as it is, no + 1"
    return None


def _keys_read(sizes, step: int) -> str | None:
    """When a mask of (Lq, Lk) met scores over more keys than a sequence has: which keys were read, in words."""
    if not sizes:
        return None
    query_lens, context_lens = STEPS[step]
    got = {int(sizes[1]), int(sizes[2])}
    for b, lk in enumerate(context_lens):
        read = {}                                              # a number of keys -> what reads that many
        read.setdefault(len(TABLES[b]) * BLOCK, []).append(f"every slot of sequence {b}'s blocks ({len(TABLES[b])} x "
                                                           f"{BLOCK}, also the ones it has not filled)")
        read.setdefault(sum(context_lens), []).append("every sequence's keys (meta.kv_slots, all of them packed)")
        read.setdefault(BLOCKS * BLOCK, []).append("the whole cache")
        many = next((n for n in got if n != lk and n in read), None)
        if lk in got and many is not None:
            return (f"Sequence {b} has {lk} keys so far (meta.visible[b] is (Lq, Lk) = ({query_lens[b]}, {lk})), but "
                    f"{many} were read: {' or '.join(read[many])}. Read exactly its keys: meta.seq_kv_slots(b)")
    return None


def diagnose(res) -> tuple[bool, str]:
    why = _cache_problem(res)
    if why:
        return False, why
    if res["error"] is not None:
        why = _error_problem(res)
        if why is None:
            raise res["error"]                       # check_part words it, with the line and its hints
        return False, why
    data = res["q"], res["k"], res["v"]
    ref = [_reference(*data, step) for step in STEPS]
    mistakes = [
        ([_reference(*data, step, mask="none") for step in STEPS],
         "the prefill's queries see later keys: apply meta.visible[b], the (Lq, Lk) causal mask"),
        ([_reference(*data, step, mask="inverted") for step in STEPS],
         "the mask is inverted: meta.visible[b] is True where a query may attend, as SDPA's boolean attn_mask "
         "wants it (to fill scores with -inf, fill where ~visible)"),
        ([_reference(*data, step, mask="strict") for step in STEPS],
         "a query does not see its own key: the query at position i sees keys j <= i (meta.visible[b])"),
        ([_reference(*data, step, top_left=True) for step in STEPS],
         "the queries are lined up with the first keys, not the last: is_causal=True in "
         "F.scaled_dot_product_attention lets query i see keys 0..i (the mask's top left), right only where every "
         "key is new (Lq = Lk); after cached keys (a prompt's later chunk, a decode) pass attn_mask=meta.visible[b], "
         "where query i sees keys up to Lk - Lq + i"),
        ([_reference(*data, step, tiled=True) for step in STEPS],
         f"query head h reads KV head h % {H_KV}: it must read KV head h // (H / H_kv) (repeat_interleave, "
         "not repeat; or enable_gqa=True)"),
        ([_reference(*data, step, scale=1.0) for step in STEPS], "the scores are not scaled by 1 / sqrt(head_dim)"),
        ([_reference(*data, step, scale=1.0 / D) for step in STEPS],
         "the scores are scaled by 1 / head_dim: the scale is 1 / sqrt(head_dim) (self.scale)"),
        ([_reference(*data, step, scale=D ** 0.5) for step in STEPS],
         "the scores are multiplied by sqrt(head_dim): divide by it, the scale is head_dim ** -0.5 (self.scale)"),
        ([_reference(*data, step, mask="none", whole_blocks=True) for step in STEPS],
         "reads every slot of the sequence's blocks, also the ones it has not filled (zeros), and drops the mask: "
         "read exactly its keys, meta.seq_kv_slots(b), and apply meta.visible[b], the (Lq, Lk) causal mask"),
        ([_reference(*data, step, new_only=True) for step in STEPS],
         "attends only to this step's new keys, not to the cached ones: after writing k, v into the cache, read "
         "sequence b's keys and values back from it at meta.seq_kv_slots(b) (its cached tokens, then this "
         "step's), and attend to all of them"),
    ]
    for step, (out, want) in enumerate(zip(res["outs"], ref)):
        what = STEP_NAMES[step]
        if out.shape != want.shape:
            return False, f"{what}: returned shape {tuple(out.shape)}, expected (T, H * D) = {tuple(want.shape)}"
        if out.dtype != want.dtype:
            return False, (f"{what}: returned {out.dtype}, but the engine runs attention in {want.dtype} (the dtype "
                           "of q, k, v and the cache, the model's): keep q's dtype (or cast with .to(q.dtype))")
        if torch.allclose(out, want, atol=1e-5):
            continue
        for rows, why in mistakes:
            if torch.allclose(out.nan_to_num(0.0), rows[step].nan_to_num(0.0), atol=1e-5):   # a row seeing no key
                return False, f"{what}: {why}"
        return False, f"{what}: the output differs from attention over the cached keys by up to " \
                      f"{float((out - want).abs().max()):.1e}"
    return True, ""
