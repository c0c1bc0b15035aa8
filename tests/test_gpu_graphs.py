"""CUDA graphs (``./workbook.sh test-gpu``, marker ``gpu``): decode steps replayed as CUDA graphs by default on
CUDA, off with ``enforce_eager=True``, with inductor's kernels inside them with ``compile=True``; HF's greedy
tokens at batch 1 and 16 requests, with continuous batching and preemption in the run (in bf16,
``tolerance.TOKEN_AGREEMENT`` of them). Without CUDA every test is skipped, with the reason (``-rs``)."""
import pytest
import torch

from test_gpu import NO_CUDA, SIXTEEN, STORIES, assert_matches, generate, hf_cuda  # noqa: F401 (a fixture)
from tplab import LLM, models

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]


def replays(llm) -> int:
    static = llm._worker.engine.runner.static
    return 0 if static is None else static.num_replays


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
@pytest.mark.parametrize("stories", [STORIES[:1], SIXTEEN], ids=["batch1", "16_requests"])
def test_graphs_are_on_by_default_and_match_hf(hf_cuda, name, stories):
    dtype = getattr(torch, name)
    prompts, ref = hf_cuda(dtype, tuple(stories))
    # a cache of 24 blocks of 16 for 16 sequences of ~25 tokens: some are preempted and come back
    small = dict(num_kv_blocks=24, block_size=16) if len(stories) > 1 else {}
    with LLM(models.tiny_stories(), dtype=name, **small) as llm:
        assert llm.config.cuda_graphs and llm.config.static_decode
        outs = generate(llm, prompts)
        stats = llm.stats()
        assert replays(llm) > 0, "no decode step was replayed as a CUDA graph"
        assert stats["static_decode_steps"] > 0
    if small:
        assert stats["num_preemptions"] > 0, stats
    assert_matches(outs, ref, dtype, f"CUDA graphs {name}, {len(stories)} prompt(s)")


def test_enforce_eager_runs_no_graph(hf_cuda):
    prompts, ref = hf_cuda(torch.float32)
    with LLM(models.tiny_stories(), enforce_eager=True) as llm:
        assert not llm.config.cuda_graphs and llm._worker.engine.runner.static is None
        assert_matches(generate(llm, prompts), ref, torch.float32, "enforce_eager")


def test_the_static_step_without_graphs_matches_hf(hf_cuda):
    """``static_decode=True, enforce_eager=True``: the padded step the graphs capture, run eagerly on the GPU."""
    prompts, ref = hf_cuda(torch.float32)
    with LLM(models.tiny_stories(), enforce_eager=True, static_decode=True) as llm:
        assert_matches(generate(llm, prompts), ref, torch.float32, "static decode, eager")
        assert replays(llm) == 0 and llm.stats()["static_decode_steps"] > 0


def test_compiled_kernels_inside_the_graphs_match_hf(hf_cuda):
    prompts, ref = hf_cuda(torch.float32)
    with LLM(models.tiny_stories(), compile=True) as llm:
        outs = generate(llm, prompts)
        assert llm.stats()["compiled_forwards"] > 0, "the model ran eagerly: compiling failed (see stderr)"
        assert replays(llm) > 0
    assert_matches(outs, ref, torch.float32, "compiled, in CUDA graphs")
