"""Chunked prefill: prompts longer than the step's token budget are split over steps, mixed with the
decodes of other sequences, and the output is still HF's (greedy tokens, logprobs within the fp32 bound)."""
import pytest
import torch

from conftest import hf_greedy
from tplab import LLM, SamplingParams, models
from tplab.engine.block_manager import BlockManager
from tplab.layers.metadata import MetadataBuilder
from tplab.engine.model_runner import token_positions
from tplab.engine.scheduler import Scheduler
from tplab.engine.sequence import Sequence
from tplab.layers.metadata import build_metadata

MAX_TOKENS = 8
SHARED = list(range(60, 100))                                       # a 40-token prefix
PROMPTS = [list(range(1, 70)), [3, 17, 42], SHARED + [1, 2, 3], [250, 7] * 20, SHARED + [4], [9]]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def assert_matches_hf(outs, reference, prompts):
    assert len(outs) == len(reference) == len(prompts)
    for out, ref, prompt in zip(outs, reference, prompts):
        tokens, logprobs = ref
        assert out.token_ids == tokens, f"tokens differ from HF for a prompt of {len(prompt)} tokens"
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs, strict=True)) <= ref.bound


@pytest.fixture(scope="module")
def reference(checkpoint, hf_model):
    model = hf_model(checkpoint("gqa"))
    return [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def record_steps(llm):
    """Per step, ``(seq_id, tokens fed, uncached before)`` of each scheduled sequence (TP 1, in process)."""
    scheduler, steps = llm._worker.engine.scheduler, []
    schedule = scheduler.schedule

    def recording():
        batch = schedule()
        steps.append([(s.seq_id, s.num_scheduled_tokens, len(s) - s.num_cached_tokens) for s in batch])
        return batch
    scheduler.schedule = recording
    return steps


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("prefix", [False, True], ids=["", "prefix_caching"])
def test_prompts_longer_than_the_budget_mixed_with_decodes_match_hf(checkpoint, reference, tp, prefix):
    with LLM(checkpoint("gqa"), tensor_parallel_size=tp, max_num_batched_tokens=13, max_num_seqs=4,
             block_size=8, enable_prefix_caching=prefix) as llm:
        steps = record_steps(llm) if tp == 1 else None
        outs = llm.generate(PROMPTS, GREEDY)
        stats = llm.stats()
    assert_matches_hf(outs, reference, PROMPTS)
    assert stats["kv_blocks_in_use"] == 0
    if prefix:
        assert stats["prefix_cache_hit_blocks"] > 0
    if steps is not None:
        assert all(sum(n for _, n, _ in step) <= 13 for step in steps)              # the budget holds
        chunked = [step for step in steps if any(n < left for _, n, left in step)]
        assert any(any(left == 1 for _, _, left in step) for step in chunked)      # a chunk beside a decode


def test_tiny_cache_preempts_with_chunks_and_prefix_caching_and_matches_hf(checkpoint, reference):
    with LLM(checkpoint("gqa"), num_kv_blocks=14, block_size=8, max_num_batched_tokens=16,
             enable_prefix_caching=True) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_blocks"] > 0, stats
    assert_matches_hf(outs, reference, PROMPTS)


def test_a_prompt_is_not_preempted_in_the_middle_of_its_prefill(checkpoint, hf_model):
    """A 24-token prompt prefilled 2 tokens a step beside a short one's decodes, in 8 blocks of 4, with prefix
    caching: the blocks run out mid-prefill. Preempting the long prompt then would leave its registered but
    uncomputed blocks in the prefix cache, for its own readmission to hit; the short one goes instead."""
    short, long = [3, 1, 4], list(range(10, 34))
    model = hf_model(checkpoint("gqa"))
    refs = [hf_greedy(model, p, MAX_TOKENS) for p in (short, long)]
    with LLM(checkpoint("gqa"), enable_prefix_caching=True, block_size=4, num_kv_blocks=8,
             max_num_batched_tokens=2, max_num_seqs=2) as llm:
        outs = llm.generate([short, long], GREEDY)
        stats = llm.stats()
    assert stats["num_preemptions"] > 0, stats
    assert_matches_hf(outs, refs, [short, long])


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    return models.save_random_qwen2(tmp_path_factory.mktemp("long"), seed=5, max_position_embeddings=8448,
                                    hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("tp", [1, 2])
def test_8k_prompt_in_chunks_matches_hf(long_checkpoint, hf_model, tp):
    prompt = torch.randint(0, 256, (8192,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = hf_greedy(hf_model(long_checkpoint), prompt, 4)
    with LLM(long_checkpoint, tensor_parallel_size=tp, max_num_batched_tokens=1000) as llm:
        fed = []
        if tp == 1:                                                 # every forward stays within the budget
            llm._worker.engine.model.register_forward_pre_hook(lambda m, args: fed.append(args[0].numel()))
        out = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert out.token_ids == ref[0]
    assert max(abs(a - b) for a, b in zip(out.logprobs, ref[1])) <= ref.bound
    if tp == 1:
        assert max(fed) == 1000 and len(fed) == 9 + 3               # 8 chunks of 1000 + 192, then 3 decodes


def test_incremental_metadata_equals_build_metadata():
    """The builder that keeps each sequence's slots between steps gives ``build_metadata``'s answer (slots from
    the block tables) at every step of a chunked run, in a cache small enough that sequences are preempted and
    come back in other blocks (the builder must drop the slots it kept for them)."""
    bm = BlockManager(6, 4, enable_prefix_caching=True)
    scheduler = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=7)
    for i, n in enumerate([9, 3, 14, 2, 9]):
        scheduler.add(Sequence(i, list(range(1, n + 1)), n, SamplingParams(max_tokens=5, ignore_eos=True)))
    builder, steps, held, moved = MetadataBuilder(4, torch.device("cpu")), 0, {}, 0
    while scheduler.has_work():
        batch = scheduler.schedule()
        for s in batch:                 # a sequence whose table no longer starts with the blocks it last ran in
            before = held.get(s.seq_id, [])
            moved += s.block_table[:len(before)] != before
            held[s.seq_id] = list(s.block_table)
        meta = builder.build([s.num_new_tokens for s in batch], [s.num_cached_tokens + s.num_new_tokens for s in batch],
                             [s.block_table for s in batch], [p for s in batch for p in token_positions(s)],
                             [s.seq_id for s in batch])
        ref = build_metadata([s.num_scheduled_tokens for s in batch], [s.num_cached_tokens + s.num_scheduled_tokens
                             for s in batch], [s.block_table for s in batch], 4, torch.device("cpu"))
        for field in ("positions", "slot_mapping", "kv_slots"):
            assert torch.equal(getattr(meta, field), getattr(ref, field)), field
        assert meta.positions.tolist() == [p for s in batch                 # each new token after the cached ones
                                           for p in range(s.num_cached_tokens, s.num_cached_tokens + s.num_new_tokens)]
        assert (meta.query_start_loc, meta.kv_start_loc) == (ref.query_start_loc, ref.kv_start_loc)
        assert all(torch.equal(a, b) for a, b in zip(meta.visible, ref.visible))
        # the runner's answer: a token for each sequence whose tokens are all fed by this step
        scheduler.postprocess(batch, [(1, 0.0) if s.num_cached_tokens + s.num_new_tokens == len(s) else None
                                      for s in batch])
        steps += 1
    assert steps > 10 and scheduler.num_preemptions > 0 and moved > 0


def test_an_unscheduled_sequence_feeds_all_its_uncached_tokens():
    seq = Sequence(0, [5, 6, 7], 3, GREEDY)
    assert token_positions(seq) == [0, 1, 2] and seq.new_token_ids() == [5, 6, 7]
    seq.num_cached_tokens, seq.num_scheduled_tokens = 1, 1          # a chunk of one token
    assert token_positions(seq) == [1] and seq.new_token_ids() == [6]
