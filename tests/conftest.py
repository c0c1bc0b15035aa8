"""Shared fixtures: random Qwen2 checkpoints of several shapes, HF references, tolerances by dtype."""
import os
import signal

import pytest
import torch

from tplab import models

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One place for tolerances: max abs difference allowed against HF, by dtype.
ATOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}

# Random checkpoints the parity tests run on; each stresses one sharding case.
CONFIGS = {
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "vocab_pad": dict(vocab_size=251, num_attention_heads=4, num_key_value_heads=4),     # 251 % 2, % 4 != 0
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1),                           # one KV head, replicated
    "untied": dict(tie_word_embeddings=False, num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
                   num_hidden_layers=3, rope_theta=1e6),
}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint(name)`` -> folder of the random Qwen2 checkpoint ``CONFIGS[name]`` (written once)."""
    made = {}

    def make(name):
        if name not in made:
            made[name] = models.save_random_qwen2(tmp_path_factory.mktemp(name), seed=len(made), **CONFIGS[name])
        return made[name]
    return make


@pytest.fixture(scope="session")
def hf_model():
    """``hf_model(folder)`` -> HF's own ``Qwen2ForCausalLM`` on that checkpoint, fp32, cached."""
    from transformers import Qwen2ForCausalLM
    cache = {}

    def load(folder):
        if folder not in cache:
            cache[folder] = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        return cache[folder]
    return load


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """HF ``generate`` greedy tokens for one prompt, and their logprobs from one HF forward."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens)[0, len(prompt):].tolist()
        logprobs = model(torch.tensor([prompt + out])).logits[0].float().log_softmax(-1)
    return out, [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(out)]


@pytest.fixture(autouse=True, scope="module")
def no_kept_ranks_after_a_module():
    """``check_part`` keeps gloo ranks warm between checks; a test module leaves none behind for the next
    (whose process and shared-memory counts would include them)."""
    yield
    from tplab.teaching.exercises.in_engine import close_kept_ranks
    close_kept_ranks()


@pytest.fixture
def sigint_raises():
    """Ctrl-C raises KeyboardInterrupt in this process during the test, also where it was started with
    SIGINT ignored (a background job of a shell without job control), which Python then leaves as is."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)
