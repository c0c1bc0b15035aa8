"""Block manager and scheduler bookkeeping, without a model: blocks, reference counts, preemption."""
from tplab.engine.block_manager import BlockManager
from tplab.engine.sampling import SamplingParams
from tplab.engine.scheduler import Scheduler
from tplab.engine.sequence import Sequence
from tplab.layers.metadata import build_metadata


def seq(i, tokens, max_tokens=8):
    return Sequence(i, list(tokens), len(tokens), SamplingParams(max_tokens=max_tokens))


def admit(bm, s):
    """What the scheduler does: ask for room (and the cached prefix), then allocate."""
    num_cached_blocks = bm.can_allocate(s)
    assert num_cached_blocks is not None, "no room"
    bm.allocate(s, num_cached_blocks)


def test_allocate_append_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(0, range(6))                                   # 6 tokens -> 2 blocks
    admit(bm, s)
    assert len(s.block_table) == 2 and bm.num_used_blocks == 2
    for t in range(3):                                     # tokens 7, 8 fit; token 9 starts block 3
        s.token_ids.append(100 + t)
        assert bm.can_append(s)
        bm.may_append(s)
    assert len(s.block_table) == 3
    bm.free(s)
    assert bm.num_used_blocks == 0 and s.block_table == [] and sorted(bm.free_block_ids) == list(range(8))


def test_slots_of_a_sequence_are_distinct_and_in_its_blocks():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = seq(0, range(5)), seq(1, range(7))
    admit(bm, a)
    admit(bm, b)
    assert len(a.block_table) == len(b.block_table) == 2 and not set(a.block_table) & set(b.block_table)
    meta = build_metadata([5, 7], [5, 7], [a.block_table, b.block_table], 4, "cpu")
    slots = meta.slot_mapping.tolist()
    assert len(set(slots)) == 12
    assert all(s // 4 in a.block_table for s in slots[:5]) and all(s // 4 in b.block_table for s in slots[5:])


def test_shared_prefix_blocks_are_reference_counted():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    prefix = list(range(100, 108))                          # two full blocks
    a, b = seq(0, prefix + [1, 2]), seq(1, prefix + [3])
    admit(bm, a)
    admit(bm, b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert bm.prefix_cache_hit_blocks == 2 and bm.num_used_blocks == 4
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1] and bm.num_used_blocks == 3
    bm.free(b)
    assert bm.num_used_blocks == 0
    c = seq(2, prefix + [9])                                # freed blocks keep their hash: still a hit
    admit(bm, c)
    assert c.num_cached_tokens == 8 and bm.prefix_cache_hit_blocks == 4


def test_prefix_hit_needs_the_whole_chain_not_just_one_block():
    """A block's key chains on the block before it: the same four tokens at positions 0-3 and 4-7 are two
    different blocks (their K/V differ by RoPE), and a prompt starting with them shares only the first."""
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = seq(0, [1, 2, 3, 4] * 2 + [9])                  # blocks 0 and 1 hold the same tokens
    admit(bm, first)
    other = seq(1, [1, 2, 3, 4, 7])
    admit(bm, other)
    assert other.block_table[0] == first.block_table[0] != first.block_table[1]
    assert other.num_cached_tokens == 4
    third = seq(2, [0, 0, 0, 0, 1, 2, 3, 4, 9])             # same second block, different first: no hit
    admit(bm, third)
    assert third.num_cached_tokens == 0 and not set(third.block_table) & set(first.block_table)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    admit(bm, seq(0, range(8)))
    again = seq(1, range(8))
    admit(bm, again)
    assert again.num_cached_tokens == 4                     # the block holding the last token is recomputed


def test_scheduler_preempts_newest_and_loses_nothing():
    """Four one-block prompts in 5 blocks: the decodes run out of blocks, and the newest running sequence is
    preempted each time (vLLM's order), back to the front of the queue, with every block accounted for."""
    bm = BlockManager(num_blocks=5, block_size=2)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = [seq(i, [i + 1, i + 2]) for i in range(4)]       # 1 block each
    for s in seqs:
        sched.add(s)
    victims, preempt = [], sched._preempt
    sched._preempt = lambda s: victims.append(s.seq_id) or preempt(s)
    assert sched.schedule() == seqs                         # all four prefill in one step
    for step in range(6):                                   # decode: each needs a new block every 2 tokens
        before = len(victims)
        batch = sched.schedule()
        # a running sequence holds exactly the blocks its tokens need, a waiting one none
        assert all(len(s.block_table) == bm.blocks_needed(len(s)) for s in sched.running)
        assert all(s.block_table == [] for s in sched.waiting)
        if len(victims) > before:                           # the last one preempted waits first in line
            assert sched.waiting[0].seq_id == victims[-1], (list(sched.waiting), victims)
        for s in batch:
            s.num_cached_tokens = len(s)
            s.token_ids.append(7)
    assert victims[:2] == [3, 2], victims                   # the newest running sequence goes first
    used = sum(len(s.block_table) for s in sched.running)
    assert used == bm.num_used_blocks                       # no block leaked or double-owned


def test_scheduler_never_preempts_a_prompt_in_the_middle_of_its_prefill():
    """A 24-token prompt prefilled 2 tokens a step beside a short prompt's decodes, in 8 blocks of 4: the blocks
    run out while the long prompt is still prefilling (its blocks registered in the prefix cache but not yet
    computed), so the short one is preempted, never the prompt half-way through."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=2)
    short, long = seq(0, [3, 1, 4]), seq(1, range(10, 34))
    for s in (short, long):
        sched.add(s)
    victims, preempt = [], sched._preempt
    sched._preempt = lambda s: victims.append((s.seq_id, s.prefilling, long.prefilling)) or preempt(s)
    while sched.has_work():
        batch = sched.schedule()
        sched.postprocess(batch, [(7, 0.0) if s.num_cached_tokens + s.num_new_tokens == len(s) else None
                                  for s in batch])
    assert (short.seq_id, False, True) in victims, victims         # the short one went, the long one mid-prefill
    assert all(not prefilling for _, prefilling, _ in victims), victims
    assert short.finished and long.finished and bm.num_used_blocks == 0
