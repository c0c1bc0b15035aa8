"""Decode steps at fixed shapes (``static_decode=True``): padded to a bucket, inputs in buffers at fixed
addresses, attention over padded block tables. The step a CUDA graph captures, run eagerly here: HF's
tokens at TP 1 and 2 with continuous batching, chunked prefill and preemption in the same run; the
stale-buffer pitfall's fingerprint; and the settings that cannot run it refused with what to change."""
from types import SimpleNamespace

import pytest
import torch

from conftest import hf_greedy
from tplab import LLM, SamplingParams, models
from tplab.engine.config import resolve_static_decode
from tplab.models.registry import load_model_config
from tplab.engine.parts import Parts
from tplab.engine.static_decode import bucket_of, buckets

MAX_TOKENS = 9
PROMPTS = [list(range(1, 40)), [3, 17, 42], [250, 7] * 11, [9], list(range(100, 117)), [5, 6, 7, 8, 9]]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(checkpoint, hf_model):
    model = hf_model(checkpoint("gqa"))
    return [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def test_buckets():
    assert buckets(1) == [1] and buckets(6) == [1, 2, 4, 6] and buckets(16) == [1, 2, 4, 8, 16]
    assert buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert [bucket_of(n, buckets(40)) for n in (1, 3, 5, 9, 17, 33, 40)] == [1, 4, 8, 16, 32, 40, 40]


@pytest.mark.parametrize("tp", [1, 2])
def test_static_decode_matches_hf_with_batching_chunks_and_preemption(checkpoint, reference, tp):
    with LLM(checkpoint("gqa"), tensor_parallel_size=tp, static_decode=True, max_num_seqs=5, block_size=8,
             num_kv_blocks=14, max_num_batched_tokens=16) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        stats = llm.stats()
    assert stats["num_preemptions"] > 0, stats                    # a sequence was preempted and came back
    assert stats["static_decode_steps"] > 0, stats                # decode steps ran at fixed shapes
    assert len(outs) == len(reference) == len(PROMPTS)
    for out, ref, prompt in zip(outs, reference, PROMPTS):
        assert out.token_ids == ref[0], f"tokens differ from HF for a prompt of {len(prompt)} tokens"
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref[1])) <= ref.bound


def record_rows(llm) -> list[tuple[int, int]]:
    """``(sequences, rows)`` of each decode step the engine of ``llm`` runs at fixed shapes, from now on."""
    static, rows = llm._worker.engine.runner.static, []
    copy_inputs = static.copy_inputs
    static.copy_inputs = lambda seqs, n, w: rows.append((len(seqs), n)) or copy_inputs(seqs, n, w)
    return rows


def test_padding_rows_write_only_the_scratch_block(checkpoint, hf_model):
    """3 prompts of 13 tokens fill all 12 blocks of 4 at their prefill, and their 3 decode steps (positions 13-15,
    in blocks they hold) are padded to 4 rows: the padding row's K/V must go to the scratch block, not to a
    block a sequence holds, or that sequence reads a padding token's K/V as its own."""
    prompts = [list(range(1, 14)), list(range(20, 33)), list(range(40, 53))]
    model = hf_model(checkpoint("gqa"))
    refs = [hf_greedy(model, p, 4) for p in prompts]
    with LLM(checkpoint("gqa"), static_decode=True, device="cpu", block_size=4, num_kv_blocks=12,
             max_num_seqs=8) as llm:
        rows = record_rows(llm)
        outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
        stats = llm.stats()
    assert stats["static_decode_steps"] == 3 and stats["num_preemptions"] == 0, stats
    assert rows == [(3, 4)] * 3, rows                             # a padding row in every decode step
    assert stats["peak_kv_blocks_used"] == 12, stats              # no free block for a stray write to land in
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref[0]
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref[1])) <= ref.bound


def test_only_decode_steps_run_padded(checkpoint):
    """Steps with a prompt chunk run at their own shapes; a step of 3 decodes runs in the bucket of 4."""
    with LLM(checkpoint("gqa"), static_decode=True, max_num_seqs=4) as llm:     # buckets 1, 2, 4
        rows = record_rows(llm)
        llm.generate(PROMPTS[:3], SamplingParams(max_tokens=4, ignore_eos=True))
    assert rows == [(3, 4)] * 3, rows                             # 3 decode steps after the prefill step, 4 rows


def test_the_padded_step_makes_its_length_mask_once_a_step(checkpoint):
    """Every layer reads one mask of the rows' lengths, made by the first layer from the lengths' tensor (in a
    graph, by each replay): 4 kernels a step rather than 4 a layer, where a GPU's step is bound by launches."""
    with LLM(checkpoint("gqa"), static_decode=True, max_num_seqs=2, device="cpu") as llm:     # eager: no replay
        static, fills = llm._worker.engine.runner.static, []
        forward = static.forward

        def profiled(seqs):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                hidden = forward(seqs)
            fills.append(sum(e.name == "aten::masked_fill_" for e in prof.events()))
            return hidden
        static.forward = profiled
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=3, ignore_eos=True))
        layers = llm.config.hf_config.num_hidden_layers
    assert layers > 1 and fills == [1, 1], f"masks made per decode step: {fills}, in a model of {layers} layers"


def test_stale_buffers_fingerprint(checkpoint, reference):
    """A replay whose positions and slots were not refreshed: the prefill's token and the first decode step's
    are HF's (their values were in the buffers when the bucket first ran), the second decode step's are not."""
    with LLM(checkpoint("gqa"), static_decode=True, bugs=["graph_stale_inputs"]) as llm:
        outs = llm.generate(PROMPTS[:1], GREEDY)
    tokens, want = outs[0].token_ids, reference[0][0]
    assert tokens[:2] == want[:2], (tokens, want)
    assert tokens[2:] != want[2:], "the stale positions and slots left every token unchanged"


class ReplayedOnCPU:
    """Stands in for a CUDA graph where there is none: captured, it runs bucket (n, w)'s step once (as the warm-up
    does); replayed, it runs the step again from whatever the buffers hold, into the one tensor it returned at
    capture (a graph's output lives at one address)."""

    def __init__(self, static, n, w):
        self.step = lambda: static.model(static.views(n, w)["input_ids"], static.kv_caches, static.metadata(n, w))
        self.hidden = self.step()

    def replay(self):
        self.hidden.copy_(self.step())


def generate_with_graphs_on_cpu(checkpoint, prompts, capture_fails_after=None, bugs=()):
    """Outputs, the engine's StaticDecode and the buckets captured, with ``ReplayedOnCPU`` for a CUDA graph
    (preemption and prompt chunks in the run); ``capture_fails_after``: captures that succeed, then one raises."""
    with LLM(checkpoint("gqa"), static_decode=True, device="cpu", max_num_seqs=5, block_size=8, num_kv_blocks=14,
             max_num_batched_tokens=16, bugs=list(bugs)) as llm:
        static, captured = llm._worker.engine.runner.static, []

        def capture(n, w):
            if len(captured) == capture_fails_after:
                raise RuntimeError("operation not permitted when stream is capturing")
            captured.append((n, w))
            graph = ReplayedOnCPU(static, n, w)
            return graph, graph.hidden
        static.use_graphs, static.capture = True, capture
        return llm.generate(prompts, GREEDY), static, captured


def assert_hf_tokens(outs, reference):
    assert len(outs) == len(reference)
    for out, ref in zip(outs, reference):
        assert out.token_ids == ref[0]
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref[1])) <= ref.bound


def test_graphs_capture_the_largest_bucket_first_and_replay_every_step(checkpoint, reference):
    """The graphs' control flow on a CPU, with a stand-in for the graph: the largest bucket is captured first, on
    padding rows alone (its memory pool then serves every smaller bucket), every decode step is a replay of its
    bucket's graph, and the tokens are HF's."""
    outs, static, captured = generate_with_graphs_on_cpu(checkpoint, PROMPTS)
    assert captured[0] == (static.batch_sizes[-1], static.widths[-1]) and len(set(captured)) == len(captured) > 1
    assert static.num_replays == static.num_steps > 0, (static.num_replays, static.num_steps)
    assert_hf_tokens(outs, reference)


def test_stale_buffers_fingerprint_in_replays(checkpoint, reference):
    outs, static, _ = generate_with_graphs_on_cpu(checkpoint, PROMPTS[:1], bugs=["graph_stale_inputs"])
    assert static.num_replays == static.num_steps > 2
    assert outs[0].token_ids[:2] == reference[0][0][:2] and outs[0].token_ids[2:] != reference[0][0][2:]


def test_a_capture_that_fails_leaves_every_step_eager(checkpoint, reference, capsys):
    """A kernel that cannot be captured: the engine says so once, drops the graphs it had, and runs every step
    eagerly from then on, with HF's tokens."""
    outs, static, captured = generate_with_graphs_on_cpu(checkpoint, PROMPTS, capture_fails_after=1)
    assert len(captured) == 1 and not static.use_graphs and not static.graphs and static.num_replays == 0
    assert capsys.readouterr().err.count("capturing a CUDA graph failed (operation not permitted") == 1
    assert_hf_tokens(outs, reference)


@pytest.mark.parametrize("settings, names", [
    (dict(pipeline_parallel_size=2), "pipeline_parallel_size"),
    (dict(check_finite=True), "check_finite"),
    (dict(bugs=["mask_mul_inf"]), "mask_mul_inf_attend"),
])
def test_static_decode_refused_where_it_cannot_run(checkpoint, settings, names):
    with pytest.raises(ValueError, match=f"static_decode=True cannot run with .*{names}"):
        LLM(checkpoint("gqa"), static_decode=True, device="cpu", **settings)


def test_an_moe_models_decode_is_refused_at_fixed_shapes_and_off_by_default(tmp_path):
    """Which rows each expert runs depends on the routing: no step at fixed shapes, so no graph to capture."""
    moe = models.save_random_qwen3_moe(tmp_path / "moe")
    with pytest.raises(ValueError, match="static_decode=True cannot run with an MoE model"):
        LLM(moe, static_decode=True, device="cpu")
    # the settings as given (static_decode None: on where CUDA graphs run), judged for a CUDA device
    unset = SimpleNamespace(static_decode=None, enforce_eager=False, pipeline_parallel_size=1, tensor_parallel_size=1,
                            sequence_parallel=False, check_finite=False)
    assert resolve_static_decode(unset, Parts(), "cuda", load_model_config(moe)) is False
    assert resolve_static_decode(unset, Parts(), "cuda", load_model_config(models.save_random_qwen3(tmp_path / "d")))


def test_cpu_defaults_to_steps_at_their_own_shapes(checkpoint):
    with LLM(checkpoint("gqa"), device="cpu") as llm:
        assert not llm.config.static_decode and not llm.config.cuda_graphs
        assert llm._worker.engine.runner.static is None
    with pytest.raises(ValueError, match="enforce_eager must be True or False"):
        LLM(checkpoint("gqa"), device="cpu", enforce_eager="yes")
