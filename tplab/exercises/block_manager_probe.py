"""A learner's block manager alone: a scripted run of admissions, appends and frees with shared
prefixes, ending with every sequence freed, the same script as tplab's ``BlockManager`` runs, compared step by
step on what must agree whatever the free-list order: table lengths, cached tokens, which sequences share
blocks, blocks in use, prefix-cache hits, and whether a sequence fits."""
from traceback import format_exception

from tplab.engine.block_manager import BlockManager, chain_hash
from tplab.engine.sampling import SamplingParams
from tplab.engine.sequence import Sequence
from tplab.exercises import learner_line

PREFIX = list(range(100, 108))                      # two full blocks of 4, shared by several prompts


def _seq(i, tokens):
    return Sequence(i, list(tokens), len(tokens), SamplingParams())


def _snapshot(bm, live, what):
    tables = {s.seq_id: list(s.block_table) for s in live}
    shared = {(a.seq_id, b.seq_id): len(set(a.block_table) & set(b.block_table))
              for i, a in enumerate(live) for b in live[i + 1:]}
    held = {blk for t in tables.values() for blk in t}
    holders = {blk: [s.seq_id for s in live if blk in s.block_table] for blk in held}
    refs = getattr(bm, "ref_counts", None)          # the given base's; keys with "_" only help word a mistake
    return {"step": what, "lengths": {k: len(t) for k, t in tables.items()},
            "cached": {s.seq_id: s.num_cached_tokens for s in live}, "shared": shared,
            "distinct_held": len(held), "used": bm.num_used_blocks, "hits": bm.prefix_cache_hit_blocks,
            "_undercounted": sorted(b for b in held if refs is not None and refs[b] < len(holders[b])),
            "_cached_blocks": len(getattr(bm, "hash_to_block_id", {})),
            "_unheld": {b: refs[b] for b in range(len(refs)) if refs[b] > 0 and b not in held} if refs else {},
            "_freed_held": {b: holders[b] for b in sorted(held & set(bm.free_block_ids))}}


def _hash_keys(bm, seq) -> str:
    """How ``bm`` keys seq's full blocks: "none" registered, "unchained" (a block's own tokens only), or "chained"."""
    keys = set(bm.hash_to_block_id)
    if not keys:
        return "none"
    blocks = [tuple(seq.token_ids[i * bm.block_size:(i + 1) * bm.block_size]) for i in range(len(seq) // bm.block_size)]
    own = {hash(t) for t in blocks} | {chain_hash(None, t) for t in blocks[1:]}
    return "unchained" if keys & own else "chained"


def run(impl) -> list[dict]:
    """The script, on ``impl(num_blocks=8, block_size=4, enable_prefix_caching=True)``; a step that raises
    ends it (a stub's NotImplementedError propagates)."""
    snaps = []
    try:
        _script(impl(8, 4, True), snaps)
    except NotImplementedError:
        raise
    except Exception as e:
        snaps.append({"step": "the next step",
                      "error": f"{type(e).__name__}: {e}{learner_line(impl, ''.join(format_exception(e)))}"})
    return snaps


def _script(bm, snaps: list) -> None:
    live = []

    def admit(seq, what):
        fits = bm.can_allocate(seq)
        snaps.append({"step": f"can_allocate before {what}", "fits": fits, "_keys": _hash_keys(bm, live[0] if live
                                                                                               else seq)})
        if fits is not None:
            bm.allocate(seq, fits)
            live.append(seq)
        snaps.append(_snapshot(bm, live, what))

    def free(seq, what):
        bm.free(seq)
        live.remove(seq)
        snaps.append(_snapshot(bm, live, what) | {"emptied": (len(seq.block_table), seq.num_cached_tokens)})
    a, b, c = _seq(0, PREFIX + [1, 2]), _seq(1, PREFIX + [3]), _seq(2, [7, 7, 7, 7, 7, 7])
    admit(a, "allocate(A): 10 tokens")
    admit(b, "allocate(B): the same 8-token prefix + 1")
    admit(c, "allocate(C): 6 other tokens")
    for t in range(3):                                              # A grows to 13 tokens: fills, then starts a block
        a.token_ids.append(200 + t)
        snaps.append({"step": f"can_append(A) at {len(a)} tokens", "fits": bm.can_append(a)})
        bm.may_append(a)
        snaps.append(_snapshot(bm, live, f"may_append(A) at {len(a)} tokens"))
    free(a, "free(A)")
    admit(_seq(3, PREFIX + [9]), "allocate(D): the prefix again, B still holds it")
    free(b, "free(B)")
    free(c, "free(C)")
    admit(_seq(4, a.token_ids[:12] + [5]), "allocate(E): A's first 3 blocks, freed but still cached")
    admit(_seq(5, list(range(300, 320))), "allocate(F): 20 tokens, more than the free blocks")
    admit(_seq(6, PREFIX), "allocate(G): the 8-token prefix alone, D still holds it")
    for seq in list(live):                                          # the end: every block back on the free list
        free(seq, f"free({'ABCDEFG'[seq.seq_id]}) at the end")


WHY = {"lengths": "block_table needs one block per block_size tokens",
       "cached": "num_cached_tokens is the tokens in the blocks shared from the cache",
       "shared": "two sequences share exactly their cached prefix blocks, no other block",
       "distinct_held": "blocks held by the sequences alive", "used": "num_used_blocks: blocks not on the free "
       "list (a block goes back when its last user frees it)", "hits": "prefix_cache_hit_blocks counts the blocks "
       "shared from the cache", "fits": "can_allocate: None when there is no room, else how many of the prompt's "
       "blocks the prefix cache holds; can_append: whether there is room for the next token"}
KEYS = {"none": "allocate(A) registered none of its full blocks, so B finds no prefix in the cache: when "
                "enable_prefix_caching is on, call self.register(block, seq, i) for each full block computed now",
        "unchained": "A's blocks are keyed by the hash of their own tokens only: a block's key must chain on the "
                     "block before it (two prompts share block i only if every token before it agrees too). "
                     "Register with self.register(block, seq, i), which keys it by hash_full_blocks(seq)[i]"}

FORGOT_ON_FREE = ("free(A) dropped {n} block(s) from the prefix cache (hash_to_block_id held {before} after A's "
                  "appends, {after} after free(A)): a freed block keeps its hash and goes back on the free list still "
                  "cached, so a later prompt (E) can share it; only take_free_block forgets it, when the block is "
                  "handed out again")
NOT_REGISTERED = ("A's third block filled up in may_append (A grew from 10 to 12 tokens), so E, which starts with A's "
                  "12 tokens, should find all 3 of A's blocks in the prefix cache; it finds {got}. When may_append "
                  "completes a block (len(seq) % block_size == 0), hash it (chained on the block before) and "
                  "register it in the cache, as allocate does for a prompt's full blocks")


def _named(got: dict, want: dict) -> str | None:
    """The usual mistakes a step shows, in words, or None."""
    step, name = want["step"], want["step"].split(":")[0]
    if got.get("_undercounted") and step.startswith("allocate("):
        return (f"after {step}: block(s) {got['_undercounted']} are shared by more sequences than their ref_counts "
                "say: a block shared from the cache gets one more user, ref_counts[block] += 1")
    if got.get("_freed_held") and step.startswith("free("):
        held = ", ".join(f"block {b} by {'ABCDEFG'[s[0]]}" for b, s in got["_freed_held"].items())
        return (f"after {name}, a block still held went back on the free list ({held}; a prefix shared by a cache "
                "hit): one user less each (ref_counts[block] -= 1), back on the free list only when that reaches 0")
    if got.get("_unheld") and step.startswith("free("):
        return (f"after {name}, block(s) {list(got['_unheld'])} are held by no sequence, but their ref_counts are "
                f"{list(got['_unheld'].values())} and they are off the free list: every free takes one user off each "
                "of its blocks (ref_counts[block] -= 1), and a block goes back on the free list when that reaches 0")
    if step.startswith("free(") and got.get("emptied") != want["emptied"]:
        return (f"after {name}, the sequence still has {got['emptied'][0]} blocks in its block_table and "
                f"num_cached_tokens {got['emptied'][1]}: it holds none any more (a preempted one is allocated again), "
                "so empty them: seq.block_table, seq.num_cached_tokens = [], 0")
    if got.get("_freed_held") and step.startswith("allocate("):
        return (f"after {name}, block(s) {list(got['_freed_held'])} are shared from the cache but still on the free "
                "list, where take_free_block hands them out again: a cached block nobody held (ref_count 0) comes "
                "off it when shared (free_block_ids.remove(block))")
    if step.startswith("can_allocate before allocate(B)") and got.get("fits") == 0 and got.get("_keys") in KEYS:
        return f"after {step}: fits is 0, expected {want['fits']}. " + KEYS[got["_keys"]]
    if step.startswith("allocate(G)") and got.get("cached", {}).get(6) == len(PREFIX):
        return (f"after {step}: cached is {len(PREFIX)}, all of G's tokens; can_allocate found 1 block. Share exactly "
                "the first num_cached_blocks: the block with a prompt's last token is always computed again, for the "
                "logits of the next token")
    if step.startswith("may_append") and got.get("lengths") != want["lengths"]:
        return (f"after {step}: A holds {got['lengths'].get(0)} blocks, it needs {want['lengths'][0]}: take a "
                "block only when the newest token starts one, len(seq.block_table) < blocks_needed(len(seq))")
    return None


def diagnose(snaps: list[dict]) -> tuple[bool, str]:
    expected = run(BlockManager)
    for got, want in zip(snaps, expected):
        if "error" in got:
            return False, f"{want['step']} raised {got['error']}"
        why = _named(got, want)
        if why:
            return False, why
        for key, value in want.items():
            if key != "step" and not key.startswith("_") and got.get(key) != value:
                if want["step"].startswith("can_allocate before allocate(E)") and isinstance(got.get(key), int) \
                        and isinstance(value, int) and got[key] < value:
                    return False, f"after {want['step']}: fits is {got[key]}, expected {value}. " \
                                  + (_forgot_on_free(snaps) or NOT_REGISTERED.format(got=got[key]))
                return False, f"after {want['step']}: {key} is {got.get(key)}, expected {value} ({WHY[key]})"
    return True, ""


def _forgot_on_free(snaps: list[dict]) -> str | None:
    """The words for a ``free`` that removes a freed block's hash from the prefix cache, or None."""
    steps = {snap["step"]: snap for snap in snaps}
    before, after = (steps.get(step, {}).get("_cached_blocks") for step in ("may_append(A) at 13 tokens", "free(A)"))
    if before is None or after is None or after >= before:
        return None
    return FORGOT_ON_FREE.format(n=before - after, before=before, after=after)
