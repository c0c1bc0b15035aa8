"""A learner's attention part alone, in this process: two sequences prefilled into a small paged
cache, then one decode step each, against a plain reference, and against the usual mistakes."""
import torch

from tplab.layers.metadata import build_metadata
from tplab.exercises.layer_probes import returned

H, H_KV, D, BLOCK, BLOCKS = 4, 2, 8, 4, 4
TABLES = [[2, 0], [3]]                             # sequence 0: 5 tokens then 6; sequence 1: 3 then 4
STEPS = [([5, 3], [5, 3]), ([1, 1], [6, 4])]       # (query_lens, context_lens) of the prefill, the decode


def _reference(q, k, v, step, *, causal=True, tiled=False, scale=D ** -0.5, new_only=False) -> torch.Tensor:
    """Plain attention for one step: each sequence's new queries over its keys so far (over this step's keys
    only, when ``new_only``: the cache ignored), (T, H * D)."""
    rep = (lambda t: t.repeat(H // H_KV, 1, 1)) if tiled else (lambda t: t.repeat_interleave(H // H_KV, 0))
    out = []
    for qb, kb, vb, ql, c in zip(q, k, v, *step):                      # per sequence
        lo = c - ql if new_only else 0                                 # the first key attended
        s = qb[c - ql:c].transpose(0, 1) @ rep(kb[lo:c].transpose(0, 1)).transpose(1, 2) * scale   # (H, Lq, Lk)
        if causal:
            s = s.masked_fill(torch.arange(lo, c)[None, :] > torch.arange(c - ql, c)[:, None], float("-inf"))
        out.append((s.softmax(-1) @ rep(vb[lo:c].transpose(0, 1))).transpose(0, 1).flatten(1))   # (Lq, H * D)
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
    outs = []
    for query_lens, context_lens in STEPS:
        meta = build_metadata(query_lens, context_lens, TABLES, BLOCK, torch.device("cpu"))
        pick = lambda xs: torch.cat([x[c - ql:c] for x, ql, c in zip(xs, query_lens, context_lens)])
        with torch.no_grad():
            out = attn(pick(q), pick(k), pick(v), cache, meta)
        outs.append(returned(out, "the (T, H * D) output; the cache is written in place"))
    return {"q": q, "k": k, "v": v, "outs": outs, "cache": cache}


def diagnose(res) -> tuple[bool, str]:
    for cache, x, what in zip(res["cache"], "kv", ("keys", "values")):
        flat = cache.flatten(0, 1)                                       # (slots, H_kv, D)
        for b, table in enumerate(TABLES):
            slots = torch.cat([torch.arange(blk * BLOCK, (blk + 1) * BLOCK) for blk in table])[:len(res[x][b])]
            if not torch.allclose(flat[slots], res[x][b]):
                return False, (f"the {x.upper()} cache does not hold sequence {b}'s {what} at the slots of its blocks "
                               f"{table}: write {x} (T, H_kv, D) to meta.slot_mapping, as they are (later steps read "
                               "them back from there)")
    data = res["q"], res["k"], res["v"]
    ref = [_reference(*data, step) for step in STEPS]
    mistakes = [
        ([_reference(*data, step, causal=False) for step in STEPS],
         "the prefill's queries see later keys: apply meta.visible[b], the (Lq, Lk) causal mask"),
        ([_reference(*data, step, tiled=True) for step in STEPS],
         f"query head h reads KV head h % {H_KV}: it must read KV head h // (H / H_kv) (repeat_interleave, "
         "not repeat; or enable_gqa=True)"),
        ([_reference(*data, step, scale=1.0) for step in STEPS], "the scores are not scaled by 1 / sqrt(head_dim)"),
        ([_reference(*data, step, new_only=True) for step in STEPS],
         "attends only to this step's new keys, not to the cached ones: after writing k, v into the cache, read "
         "sequence b's keys and values back from it at meta.seq_kv_slots(b) (its cached tokens, then this "
         "step's), and attend to all of them"),
    ]
    for step, (out, want) in enumerate(zip(res["outs"], ref)):
        what = ("prefill", "decode")[step]
        if out.shape != want.shape:
            return False, f"{what}: returned shape {tuple(out.shape)}, expected (T, H * D) = {tuple(want.shape)}"
        if out.dtype != want.dtype:
            return False, (f"{what}: returned {out.dtype}, but the engine runs attention in {want.dtype} (the dtype "
                           "of q, k, v and the cache, the model's): keep q's dtype (or cast with .to(q.dtype))")
        if torch.allclose(out, want, atol=1e-5):
            continue
        for rows, why in mistakes:
            if torch.allclose(out, rows[step], atol=1e-5):
                return False, f"{what}: {why}"
        return False, f"{what}: the output differs from attention over the cached keys by up to " \
                      f"{float((out - want).abs().max()):.1e}"
    return True, ""
