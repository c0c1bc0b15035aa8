"""The compiled path (``LLM(..., compile=True)``, ``tplab.engine.compiled``) against the eager one and HF:
greedy tokens equal, logprobs within the documented bound, at TP 1 and TP 2 and with the decode step at fixed
shapes; one graph for every token count but 1 (no recompile per step); and where no C++ compiler is present
or compiling fails, the eager model runs with one line saying so and the same results, bit for bit.

Compiling takes tens of seconds on 2 cores, so this file compiles each model once (module fixtures) and
the fallbacks run where nothing is compiled."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import hf_greedy
from tplab import LLM, SamplingParams
from tplab.engine.config import engine_config

PROMPTS = [[5, 17, 42, 9, 77, 3, 120], [8, 1, 200], [64]]   # a step of 11 tokens, then 3 a step
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
FALLBACK_LINE = "tplab: compile=True but"


def within_hf(outputs, hf, folder):
    """Each output's tokens equal HF's greedy ones and its logprobs are within HF's bound."""
    assert len(outputs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outputs):
        ref = hf_greedy(hf(folder), prompt, GREEDY.max_tokens)
        assert out.token_ids == ref[0]
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref[1])) <= ref.bound


@pytest.fixture(scope="module")
def eager(checkpoint):
    with LLM(checkpoint("gqa")) as llm:
        yield llm.generate(PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def compiled_tp1(checkpoint):
    from torch._dynamo.utils import counters
    graphs = counters["stats"]["unique_graphs"]
    with LLM(checkpoint("gqa"), compile=True) as llm:
        outputs = llm.generate(PROMPTS, GREEDY) + llm.generate([PROMPTS[2]], GREEDY)   # the second: T = 1 only
        yield outputs, llm.stats(), counters["stats"]["unique_graphs"] - graphs


def test_compiled_tp1_equals_eager_and_hf(compiled_tp1, eager, checkpoint, hf_model):
    outputs, stats, _ = compiled_tp1
    assert stats["compiled_forwards"] == stats["num_steps"] > 0      # every step ran the compiled graph
    within_hf(outputs[:3], hf_model, checkpoint("gqa"))
    assert len(outputs) == len(eager) + 1
    for out, ref in zip(outputs, eager + [eager[2]]):
        assert out.token_ids == ref.token_ids
    assert outputs[3].logprobs == pytest.approx(eager[2].logprobs, abs=1e-5)


def test_token_counts_share_two_graphs(compiled_tp1):
    """Steps of 11, 3 and 1 tokens: one graph with T a symbol, one for T = 1, nothing per step."""
    assert compiled_tp1[2] == 2


def test_compiled_tp2_equals_hf(checkpoint, hf_model):
    with LLM(checkpoint("gqa"), tensor_parallel_size=2, compile=True) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        stats = llm.stats()
    assert stats["compiled_forwards"] == stats["num_steps"] > 0
    within_hf(outputs, hf_model, checkpoint("gqa"))


def test_compiled_static_decode_equals_hf(checkpoint, hf_model):
    """``compile=True`` with the decode steps at fixed shapes: what a GPU captures in its graphs with
    ``compile=True``, run eagerly here (decode steps of 3 sequences, padded to the bucket of 4: test_static_decode)."""
    with LLM(checkpoint("gqa"), compile=True, static_decode=True) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        stats = llm.stats()
    assert stats["compiled_forwards"] == stats["num_steps"] > 0 and stats["static_decode_steps"] > 0, stats
    within_hf(outputs, hf_model, checkpoint("gqa"))


def test_compile_under_pipeline_parallelism_runs_eager_and_equals_hf(checkpoint, hf_model):
    """The stages run their layer ranges one at a time (``pipeline_loop``): compile=True keeps them eager."""
    with LLM(checkpoint("gqa"), pipeline_parallel_size=2, compile=True) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        assert llm.stats()["compiled_forwards"] == 0
    within_hf(outputs, hf_model, checkpoint("gqa"))


def test_compile_setting_is_checked_and_off_by_default(checkpoint, monkeypatch):
    monkeypatch.delenv("TPLAB_COMPILE", raising=False)
    assert engine_config(checkpoint("gqa")).compile is False
    monkeypatch.setenv("TPLAB_COMPILE", "1")
    assert engine_config(checkpoint("gqa")).compile is True
    with pytest.raises(ValueError, match="compile must be True or False, got 'yes'"):
        engine_config(checkpoint("gqa"), compile="yes")
    for off in ("0", "false", "False", "off", "no", ""):           # every one of these once turned it on
        monkeypatch.setenv("TPLAB_COMPILE", off)
        assert engine_config(checkpoint("gqa")).compile is False, off
    monkeypatch.setenv("TPLAB_COMPILE", "maybe")
    with pytest.raises(ValueError, match="TPLAB_COMPILE='maybe' is neither on nor off: set it to 1 or 0"):
        engine_config(checkpoint("gqa"))


SCRIPT = textwrap.dedent("""
    import json, sys
    from tplab import LLM, SamplingParams
    prompts, params = json.loads(sys.argv[2]), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = {}
    for compile in (False, True, True):          # the second compiled engine must not say it again
        with LLM(sys.argv[1], compile=compile) as llm:
            out[compile] = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
            steps = llm.stats()["compiled_forwards"]
    print(json.dumps({"eager": out[False], "fallback": out[True], "compiled_forwards": steps}))
""")


def run_without_compiling(folder, tmp_path, **env) -> tuple[dict, str]:
    """SCRIPT in a fresh process with ``env``, an empty inductor cache and no C++ compiler on PATH."""
    venv_bin = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": venv_bin, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), **env}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(folder), json.dumps(PROMPTS)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def failing_compiler(tmp_path) -> str:
    """A C++ compiler that answers ``--version`` and fails every build."""
    path = tmp_path / "broken-g++"
    path.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "g++ (broken) 1.0"; exit 0; }\necho no >&2; exit 1\n')
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("case", ["no compiler", "compiling fails"])
def test_fallback_runs_eager_with_one_line(case, checkpoint, tmp_path):
    cxx = "/nonexistent/g++" if case == "no compiler" else failing_compiler(tmp_path)
    result, stderr = run_without_compiling(checkpoint("gqa"), tmp_path, CXX=cxx)
    lines = [line for line in stderr.splitlines() if FALLBACK_LINE in line]
    assert len(lines) == 1, stderr[-3000:]
    assert ("no C++ compiler" if case == "no compiler" else "compiling failed") in lines[0]
    assert result["fallback"] == result["eager"]             # tokens and logprobs, bit for bit
    assert result["compiled_forwards"] == 0


def test_compiled_ops_are_the_eager_parts(checkpoint):
    """The opaque ops run each part's own forward, the one their index names: two linear layers of different
    shapes (layer 0's qkv_proj, op 0, and the last layer's down_proj, a later op) and the last layer's
    attention on a step over a cache already holding keys, which writes that layer's cache and no other."""
    from tplab.engine import compiled
    from tplab.engine.probe import load_model
    from tplab.layers.attention import cache_shape_of
    from tplab.layers.metadata import build_metadata
    torch.manual_seed(0)
    model = load_model(checkpoint("gqa"))
    layers = model.model.layers
    qkv, down, attn = layers[0].self_attn.qkv_proj, layers[-1].mlp.down_proj, layers[-1].self_attn.attn
    xs = {m: torch.randn(3, m.weight.shape[1]) for m in (qkv, down)}
    expected = {m: m(x) for m, x in xs.items()}
    # a step of two sequences: 3 new tokens after 2 cached, 1 new after 3 cached (block size 8, one block each)
    meta = build_metadata([3, 1], [5, 4], [[0], [1]], block_size=8, device="cpu")
    q = torch.randn(4, attn.num_heads, attn.head_dim)
    k, v = (torch.randn(4, attn.num_kv_heads, attn.head_dim) for _ in range(2))
    shape = cache_shape_of(type(attn), 2, 8, attn.num_heads, attn.num_kv_heads, attn.head_dim)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in layers]        # each layer's cache its own
    before = [tuple(c.clone() for c in cache) for cache in caches]
    eager_cache = tuple(c.clone() for c in caches[-1])
    expected_attn = attn(q, k, v, eager_cache, meta)
    attentions, linears = compiled._opaque(model)
    assert qkv.tplab_op_index == 0 and down.tplab_op_index > 0
    assert attn.tplab_op_index == len(layers) - 1 > 0
    compiled._step.update(linears=linears, attentions=attentions, kv_caches=caches, meta=meta)
    try:
        for m, x in xs.items():
            out = m(x)                                         # now through tplab::linear
            assert out.shape == expected[m].shape and torch.equal(out, expected[m])
        out = attn(q, k, v, None, None)                        # now through tplab::attention: _step's cache, meta
        assert torch.equal(out, expected_attn)
    finally:
        compiled._step.update(linears=None, attentions=None, kv_caches=None, meta=None)
    assert all(torch.equal(a, b) for a, b in zip(caches[-1], eager_cache))           # its K/V written there
    assert all(torch.equal(a, b) for cache, old in zip(caches[:-1], before[:-1]) for a, b in zip(cache, old))
    assert not torch.equal(caches[-1][0], before[-1][0])
