"""CUDA and NCCL (``./workbook.sh test-gpu``, marker ``gpu``): tplab on a GPU against HF on the same GPU.

TP 1 on CUDA in fp32 and bf16 (the device a notebook's ``LLM`` picks when there is a GPU), the NCCL backend
in a one-rank group and at TP 2 where two GPUs exist, the KV cache sized from the GPU's free memory, and
the backend the notebooks pick. Greedy tokens must equal HF's (in bf16, ``tolerance.TOKEN_AGREEMENT`` of
them); logprobs stay within the dtype's bound (``tplab.tolerance.logprob_bound`` of HF's logits).
Without CUDA every test is skipped, with the reason (``-rs``).
"""
import gc
import math
import sys

import cloudpickle
import pytest
import torch

from tplab import LLM, SamplingParams, launch, models
from tplab import tolerance, workbook
from tplab.engine.kv_cache import graph_memory_for

cloudpickle.register_pickle_by_value(sys.modules[__name__])    # the functions below run in ranks

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NO_CUDA = (f"no CUDA device: torch {torch.__version__} "
           f"({'CUDA ' + torch.version.cuda if torch.version.cuda else 'a CPU-only build'}) sees {GPUS} GPU(s)")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason=NO_CUDA)]
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"NCCL at TP 2 needs two GPUs; {GPUS} visible")

STORIES = ["Once upon a time", "The little dog", "Tom and Lily went to the park", "One day, a girl named Mia"]
SIXTEEN = STORIES + ["There was a big red ball", "Sam had a new toy car", "The sun was shining and", "Lily found a shiny stone",
                     "A little bird lived in a tree", "Ben wanted to bake a cake", "The cat sat on the mat",
                     "Mom said it was time for bed", "Max and his friend Tim", "In a small town there was",
                     "The boy saw a big truck", "Anna liked to draw pictures"]
NEW = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def hf_cuda():
    """``hf_cuda(dtype)`` -> (prompts, [(HF's greedy tokens, their logprobs, the logprobs' bound)]) from HF's
    Qwen2 on cuda:0."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM
    path, cache = models.tiny_stories(), {}
    tokenizer = AutoTokenizer.from_pretrained(path)

    def reference(dtype, stories=tuple(STORIES)):
        prompts = [tokenizer.encode(s) for s in stories]
        if (dtype, stories) not in cache:
            hf = Qwen2ForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()
            cache[dtype, stories] = []
            with torch.no_grad():
                for p in prompts:
                    ids = torch.tensor([p], device="cuda")
                    # as ignore_eos: never stop at EOS, and never ban it (min_new_tokens would)
                    out = hf.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(p):]
                    assert len(out) == NEW, len(out)
                    logits = hf(torch.tensor([p + out.tolist()], device="cuda")).logits[0].float()
                    logprobs = logits.log_softmax(-1)
                    cache[dtype, stories].append((out.tolist(), [logprobs[len(p) - 1 + i, t].item()
                                                                 for i, t in enumerate(out.tolist())],
                                                  tolerance.logprob_bound(logits, dtype)))
            del hf
            torch.cuda.empty_cache()
        return prompts, cache[dtype, stories]
    return reference


def assert_matches(outs, ref, dtype, where):
    """tplab's greedy tokens and logprobs against HF's: in fp32 every token equal; in bf16 at least
    ``tolerance.TOKEN_AGREEMENT`` of them (a near-tie rounds either way, as in tests/test_bf16.py). Logprobs
    within the bound wherever the two still share the context."""
    agree = total = 0
    for i, (tokens, logprobs, (want, want_logprobs, bound)) in enumerate(zip(*outs, ref)):
        if tolerance.TOKEN_AGREEMENT[dtype] == 1.0:
            assert tokens == want, f"{where}: prompt {i}'s greedy tokens {tokens} differ from HF's {want}"
        agree, total = agree + sum(a == b for a, b in zip(tokens, want)), total + len(want)
        same = next((j for j, (a, b) in enumerate(zip(tokens, want)) if a != b), len(want))
        worst = max([0.0] + [abs(a - b) for a, b in zip(logprobs[:same], want_logprobs[:same])])
        assert worst <= bound, f"{where}: prompt {i}'s logprobs off HF's by {worst:.2e} > the bound {bound:.2e}"
    assert agree >= tolerance.TOKEN_AGREEMENT[dtype] * total, f"{where}: {agree} of {total} greedy tokens equal HF's"


def generate(llm, prompts) -> tuple[list, list]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True))
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


@pytest.mark.parametrize("name", DTYPES)
def test_tp1_picks_cuda_and_matches_hf_on_the_same_gpu(hf_cuda, name):
    prompts, ref = hf_cuda(DTYPES[name])
    before = torch.cuda.memory_allocated()
    with LLM(models.tiny_stories(), dtype=name) as llm:         # no device given: what a notebook gets
        assert llm.config.device == "cuda" and llm.backend == "none"
        held = torch.cuda.memory_allocated() - before
        on_gpu = llm.rank_info[0]["param_bytes"] + llm.stats()["kv_cache_bytes"]
        assert held >= on_gpu, f"{held} bytes on the GPU, the weights and KV cache alone are {on_gpu}"
        assert_matches(generate(llm, prompts), ref, DTYPES[name], f"TP 1 cuda {name}")


def all_reduce_on_the_gpu():
    import torch.distributed as dist
    from tplab.distributed.launcher import rank_device
    t = torch.arange(4.0, device=rank_device()) + 1
    dist.all_reduce(t)
    return dist.get_backend(), str(t.device), t


def test_a_one_rank_nccl_group_all_reduces_on_the_gpu():
    [(backend, device, t)] = launch(all_reduce_on_the_gpu, 1, backend="nccl")
    assert "nccl" in backend and device == "cuda:0", (backend, device)    # "cpu:gloo,cuda:nccl": CPU tensors too
    assert t.device.type == "cpu" and torch.equal(t, torch.arange(4.0) + 1)     # results come back on the CPU


def generate_in_rank(model, prompts):
    """In a rank of an NCCL group: an LLM over that group (as under torchrun), on the rank's GPU."""
    with LLM(model, tensor_parallel_size=1) as llm:
        on_gpu = torch.cuda.memory_allocated() >= llm.rank_info[0]["param_bytes"]
        return llm.backend, llm.config.device, on_gpu, generate(llm, prompts)


def test_the_engine_in_a_one_rank_nccl_group_matches_hf(hf_cuda):
    prompts, ref = hf_cuda(torch.float32)
    [(backend, device, on_gpu, outs)] = launch(generate_in_rank, 1, args=(str(models.tiny_stories()), prompts),
                                               backend="nccl")
    assert "nccl" in backend and on_gpu, (backend, device)
    assert_matches(outs, ref, torch.float32, "TP 1 in a one-rank NCCL group")


@two_gpus
def test_tp2_over_nccl_matches_hf(hf_cuda):
    prompts, ref = hf_cuda(torch.float32)
    with LLM(models.tiny_stories(), tensor_parallel_size=2) as llm:  # a GPU per rank: NCCL, picked by itself
        assert "nccl" in llm.backend
        assert_matches(generate(llm, prompts), ref, torch.float32, "TP 2 over NCCL")


def test_the_notebooks_backend_is_nccl_with_a_gpu_per_rank_else_gloo():
    for ranks in range(1, GPUS + 2):
        assert workbook.backend_for(ranks) == ("nccl" if ranks <= GPUS else "gloo"), ranks


def megatron_mlp_as_notebook_02_runs_it(x, w_up, w_down):
    """Notebook 02's cell: CPU tensors from the notebook, tplab's column/row layers built in each rank."""
    import torch.nn.functional as F
    from tplab.layers.linear import ColumnParallelLinear, RowParallelLinear
    up, down = ColumnParallelLinear(w_up.shape[1], w_up.shape[0]), RowParallelLinear(w_down.shape[1], w_down.shape[0])
    up.weight.weight_loader(up.weight, w_up)
    down.weight.weight_loader(down.weight, w_down)
    return down(F.silu(up(x)))


@two_gpus
def test_a_notebook_cell_with_cpu_tensors_runs_under_the_backend_the_notebooks_pick():
    """Notebook 02 launches its Megatron MLP with ``launch(fn, 2)``: NCCL on two GPUs, with CPU tensors."""
    gen = torch.Generator().manual_seed(0)
    x, w_up, w_down = (torch.randn(*s, generator=gen) for s in ((3, 16), (32, 16), (16, 32)))
    dense = torch.nn.functional.silu(x @ w_up.T) @ w_down.T
    for y in launch(megatron_mlp_as_notebook_02_runs_it, 2, args=(x, w_up, w_down)):
        assert tolerance.within(y, dense), f"off the dense MLP by {(y - dense).abs().max():.1e}"


def test_the_kv_cache_takes_90_percent_of_the_gpu_memory_left_after_the_weights(tmp_path):
    """``kv_cache_budget`` on CUDA: 90% of ``torch.cuda.mem_get_info``'s free bytes once the weights are loaded,
    less the bound on what the CUDA graphs' pool may take (``graph_memory_for``).
    A checkpoint whose longest sequences need more than any GPU holds, so memory (not the model) is the limit."""
    path = models.save_random_qwen2(tmp_path / "long", hidden_size=1024, num_attention_heads=8, num_key_value_heads=8,
                                    intermediate_size=256, num_hidden_layers=4, max_position_embeddings=131072)
    max_num_seqs, block_size = 64, 16
    useful = max_num_seqs * math.ceil(131072 / block_size)   # 64 sequences of 131072 tokens: 256 GiB in fp32
    gc.collect()                     # an earlier test's engine or HF model, held only by a reference cycle
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    llm = LLM(path, device="cuda", max_num_seqs=max_num_seqs, block_size=block_size)
    try:
        stats = llm.stats()
        assert stats["num_kv_blocks"] < useful, "the cache was capped by the model's length, not by memory"
        graphs = graph_memory_for(llm.config)                   # kept free for the CUDA graphs' pool
        assert 0.85 * free_before - graphs <= stats["kv_cache_bytes"] <= 0.9 * free_before - graphs, (stats, free_before)
        assert torch.cuda.mem_get_info()[0] < 0.12 * free_before + graphs
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0]   # room left to run
        assert len(out.token_ids) == 4
    finally:
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()


def test_the_compiled_path_on_the_gpu_matches_hf(hf_cuda):
    """``compile=True`` on CUDA: the same graph as on CPU, built by inductor as Triton kernels (bench/gpu.py
    measured it 1.37-1.48x faster than eager at batch 1 on an H200); fp32 tokens equal HF's."""
    prompts, ref = hf_cuda(torch.float32)
    with LLM(models.tiny_stories(), compile=True) as llm:
        assert llm.config.device == "cuda"
        outs = generate(llm, prompts)
        assert llm.stats()["compiled_forwards"] > 0, "the model ran eagerly: compiling failed (see stderr)"
    assert_matches(outs, ref, torch.float32, "TP 1 cuda compiled")


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_a_decode_forward_never_waits_for_the_gpu(enforce_eager):
    """Inside the model's forward of a decode step nothing makes the host wait for the GPU (a .item(), a copy
    to the CPU, an op that checks its inputs' values): a decode step is bound by launching kernels, and one
    such wait a layer costs what the GPU takes to catch up. CUDA's sync debug mode turns any into an error."""
    with LLM(models.tiny_stories(), max_num_seqs=4, enforce_eager=enforce_eager) as llm:
        model = llm._worker.engine.runner.model            # with graphs: the forward each bucket captures
        forward, decodes = model.forward, []

        def strict(input_ids, kv_caches, meta):
            if meta.decode is None or len(meta.decode.seqs) != input_ids.shape[0]:
                return forward(input_ids, kv_caches, meta)           # a step with a prompt in it
            torch.cuda.set_sync_debug_mode("error")
            try:
                return forward(input_ids, kv_caches, meta)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                decodes.append(input_ids.shape[0])
        model.forward = strict
        try:
            generate(llm, [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 20, [10, 11]])
        finally:
            del model.forward
    assert 4 in decodes, f"no 4-row decode step ran: {decodes}"
