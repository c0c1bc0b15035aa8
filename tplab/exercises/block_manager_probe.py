"""A learner's block manager alone: a scripted run of admissions, appends and frees with shared
prefixes, the same script as tplab's ``BlockManager`` runs, compared step by step on what must
agree whatever the free-list order: table lengths, cached tokens, which sequences share blocks,
blocks in use, prefix-cache hits, and whether a sequence fits."""
from tplab.engine.block_manager import BlockManager
from tplab.engine.sampling import SamplingParams
from tplab.engine.sequence import Sequence

PREFIX = list(range(100, 108))                      # two full blocks of 4, shared by several prompts


def _seq(i, tokens):
    return Sequence(i, list(tokens), len(tokens), SamplingParams())


def _snapshot(bm, live, what):
    tables = {s.seq_id: list(s.block_table) for s in live}
    shared = {(a.seq_id, b.seq_id): len(set(a.block_table) & set(b.block_table))
              for i, a in enumerate(live) for b in live[i + 1:]}
    held = {blk for t in tables.values() for blk in t}
    return {"step": what, "lengths": {k: len(t) for k, t in tables.items()},
            "cached": {s.seq_id: s.num_cached_tokens for s in live}, "shared": shared,
            "distinct_held": len(held), "used": bm.num_used_blocks, "hits": bm.prefix_cache_hit_blocks}


def run(impl) -> list[dict]:
    """The script, on ``impl(num_blocks=8, block_size=4, enable_prefix_caching=True)``; a step that raises
    ends it (a stub's NotImplementedError propagates)."""
    snaps = []
    try:
        _script(impl(8, 4, True), snaps)
    except NotImplementedError:
        raise
    except Exception as e:
        snaps.append({"step": "the next step", "error": f"{type(e).__name__}: {e}"})
    return snaps


def _script(bm, snaps: list) -> None:
    live = []

    def admit(seq, what):
        fits = bm.can_allocate(seq)
        snaps.append({"step": f"can_allocate before {what}", "fits": fits})
        if fits is not None:
            bm.allocate(seq, fits)
            live.append(seq)
        snaps.append(_snapshot(bm, live, what))

    def free(seq, what):
        bm.free(seq)
        live.remove(seq)
        snaps.append(_snapshot(bm, live, what))
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


WHY = {"lengths": "block_table needs one block per block_size tokens",
       "cached": "num_cached_tokens is the tokens in the blocks shared from the cache",
       "shared": "two sequences share exactly their cached prefix blocks, no other block",
       "distinct_held": "blocks held by the sequences alive", "used": "num_used_blocks: blocks not on the free "
       "list (a block goes back when its last user frees it)", "hits": "prefix_cache_hit_blocks counts the blocks "
       "shared from the cache", "fits": "can_allocate: None when there is no room, else how many of the prompt's "
       "blocks the prefix cache holds; can_append: whether there is room for the next token"}
NOT_REGISTERED = ("A's third block filled up in may_append (A grew from 10 to 12 tokens), so E, which starts with A's "
                  "12 tokens, should find all 3 of A's blocks in the prefix cache; it finds {got}. When may_append "
                  "completes a block (len(seq) % block_size == 0), hash it (chained on the block before) and "
                  "register it in the cache, as allocate does for a prompt's full blocks")


def diagnose(snaps: list[dict]) -> tuple[bool, str]:
    expected = run(BlockManager)
    for got, want in zip(snaps, expected):
        if "error" in got:
            return False, f"{want['step']} raised {got['error']}"
        for key, value in want.items():
            if key != "step" and got.get(key) != value:
                if want["step"].startswith("can_allocate before allocate(E)") and isinstance(got.get(key), int) \
                        and isinstance(value, int) and got[key] < value:
                    return False, f"after {want['step']}: fits is {got[key]}, expected {value}. " \
                                  + NOT_REGISTERED.format(got=got[key])
                return False, f"after {want['step']}: {key} is {got.get(key)}, expected {value} ({WHY[key]})"
    return True, ""
