"""The LLM front end: bad input fails early with a message that says what to change; sampling is
seeded and identical on every rank; EOS stops a sequence."""
import json
import shutil

import pytest

from tplab import LLM, SamplingParams, models
from tplab.engine.worker import Worker


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(checkpoint("gqa")) as engine:
        yield engine


@pytest.mark.parametrize("tp,msg", [
    (3, r"tensor_parallel_size=3 does not work: 4 query heads are not divisible by 3\. "
        r"TP sizes that work: \[1, 2, 4\]"),
    (8, r"8 query heads|4 query heads are not divisible by 8"),
    (0, r"tensor_parallel_size must be >= 1"),
])
def test_bad_tp_size_is_refused_before_any_rank_starts(checkpoint, tp, msg, monkeypatch):
    import tplab.engine.llm as llm_module
    monkeypatch.setattr(llm_module, "RankGroup", lambda *a, **k: pytest.fail("ranks started for a TP size refused"))
    with pytest.raises(ValueError, match=msg):
        LLM(checkpoint("gqa"), tensor_parallel_size=tp)


def test_tp_size_must_divide_intermediate_size(tmp_path):
    folder = models.save_random_qwen2(tmp_path, intermediate_size=90)
    with pytest.raises(ValueError, match=r"intermediate_size 90 is not divisible by 4\. TP sizes that work: \[1, 2\]"):
        LLM(folder, tensor_parallel_size=4)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(dtype="float64"), r"unknown dtype 'float64'"),
    (dict(bugs=["not_a_bug"]), r"unknown bug name\(s\) \['not_a_bug'\]"),
    (dict(bugs=True), r"bugs must be a bug's name or a list of names, got True"),
    (dict(parts={"row_linear": 42}), r"parts: each is a class or a function, not \{'row_linear': 42\}"),
    (dict(parts=["row_linear"]), r"parts must be a dict of field -> your class or function, got list"),
])
def test_bad_llm_arguments(checkpoint, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        LLM(checkpoint("gqa"), **kwargs)


def test_a_file_of_the_checkpoint_is_refused_with_its_folder(checkpoint):
    folder = checkpoint("gqa")
    with pytest.raises(FileNotFoundError, match=f"config.json is a file: pass the checkpoint's folder, {folder}$"):
        LLM(folder / "config.json")


@pytest.mark.parametrize("prompts,params,msg", [
    ([[1, 2], []], SamplingParams(), r"prompt 1 is empty"),
    ([[1, 256, 7]], SamplingParams(), r"prompt 0 has token id\(s\) \[256\] outside the vocabulary \[0, 256\)"),
    ([[-1]], SamplingParams(), r"outside the vocabulary"),
    ([[1] * 250], SamplingParams(max_tokens=10), r"250 tokens \+ max_tokens 10 = 260 > max_position_embeddings 256"),
    (["hello"], SamplingParams(), r"has no tokenizer: pass prompts as lists of token ids"),
    ([[1], [2]], [SamplingParams()] * 3, r"3 SamplingParams for 2 prompts"),
    ([[1.7, 2.2]], SamplingParams(), r"prompt 0: a prompt is a string or a list of int token ids, got float 1.7"),
    ([b"hello"], SamplingParams(), r"prompt 0: .* got bytes b'hello'"),
    ([[True, 2]], SamplingParams(), r"got bool True"),
    ([[1, 2]], 32, r"sampling_params must be a SamplingParams or a list of them, one per prompt; got int 32"),
    ([[1], [2]], [SamplingParams(), None], r"sampling_params must be a SamplingParams or a list of them"),
    (123, SamplingParams(), r"prompts must be a non-empty list of strings or of lists of token ids, got int 123"),
    ([], SamplingParams(), r"prompts must be a non-empty list .*, got list \[\]"),
])
def test_bad_prompts_are_refused(llm, prompts, params, msg):
    with pytest.raises(ValueError, match=msg):
        llm.generate(prompts, params)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(max_tokens=0), "max_tokens must be a positive int"),
    (dict(max_tokens=True), "max_tokens must be a positive int, got True"),
    (dict(temperature=-0.5), "temperature must be a number >= 0"),
    (dict(temperature="0.7"), "temperature must be a number >= 0"),
    (dict(temperature=1e-40), "too small to sample with"),
    (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be a number in \(0, 1\]"),
    (dict(top_p=None), r"top_p must be a number in \(0, 1\]"),
    (dict(top_k=0), "top_k must be -1"),
    (dict(top_k=True), "top_k must be -1"),
    (dict(ignore_eos="no"), "ignore_eos must be True or False"),
    (dict(seed=2 ** 70), r"seed must be None or an int"),
])
def test_bad_sampling_params(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kwargs)


def test_numpy_numbers_sample_as_the_python_numbers_they_equal(llm):
    import numpy as np
    plain = SamplingParams(temperature=0.75, top_k=8, top_p=0.5, max_tokens=6, seed=3)     # exact in float32
    numpy = SamplingParams(temperature=np.float32(0.75), top_k=np.int32(8), top_p=np.float32(0.5),
                           max_tokens=np.int64(6), seed=np.int64(3))
    want, got = llm.generate([[1, 2, 3]], plain)[0], llm.generate([[1, 2, 3]], numpy)[0]
    assert len(got.token_ids) == 6 and got.token_ids == want.token_ids


def test_sampling_params_changed_after_they_were_made_are_checked_by_generate(llm):
    params = SamplingParams()
    params.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens must be a positive int, got 0"):
        llm.generate([[1, 2]], params)


def test_use_tqdm_of_another_type_is_refused(llm):
    with pytest.raises(ValueError, match="use_tqdm must be True, False or None"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm="no")


def test_prompts_as_tuples_arrays_and_tensors_are_token_ids(llm):
    import numpy as np
    import torch
    want = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids
    for prompts in ((1, 2, 3), np.array([1, 2, 3]), [np.int64(1), np.int64(2), np.int64(3)], torch.tensor([[1, 2, 3]])):
        assert llm.generate(prompts, SamplingParams(max_tokens=2))[0].token_ids == want, prompts


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm):
    params = lambda seed: SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=16, seed=seed,
                                         ignore_eos=True)
    a, b = (llm.generate([[1, 2, 3]], params(7))[0].token_ids for _ in range(2))
    c = llm.generate([[1, 2, 3]], params(8))[0].token_ids
    assert a == b and a != c


def test_greedy_picks_the_first_of_tied_maxima_as_argmax_does():
    """The sampler takes the greedy token from ``max`` (faster than ``argmax`` on CPU): the same index
    where a row's maximum appears twice (the first), holds NaN (the NaN's) or is -inf throughout (0),
    over rows as long as a real vocabulary, where the reduction is split between threads."""
    import torch
    from tplab.engine.sampling import sample
    logits = torch.randn(5, 151_936, generator=torch.Generator().manual_seed(0))
    logits[0, [9, 140_000]] = 50.0                 # tied, far apart: in different threads' halves
    logits[1, [70_000, 80_000]] = 50.0
    logits[2, 123] = float("nan")
    logits[3] = float("-inf")
    tokens, logprobs = sample(logits, [SamplingParams()] * 5, [None] * 5)
    assert tokens.tolist()[:4] == [9, 70_000, 123, 0]
    assert torch.equal(tokens, logits.argmax(-1))
    expected = logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.5, 4, 1.0), (2.0, -1, 0.8)])
def test_sampled_frequencies_follow_the_tempered_and_filtered_softmax(temperature, top_k, top_p):
    """20,000 seeded draws from fixed logits, against softmax(logits / T) over the tokens top-k and top-p keep
    (worked out here apart from the sampler): the others never drawn, the kept ones' counts within a chi-square
    of 25 of the expected (3 degrees of freedom: a chance under 1 in 50,000, and the seed is fixed). Sampling
    at T = 1 instead puts it in the thousands. The logprobs reported are the model's, untempered."""
    import math
    import torch
    from tplab.engine.sampling import sample
    logits = [3.0, 2.0, 1.5, 1.0, 0.0, -2.0]
    weights = sorted(((math.exp(x / temperature), i) for i, x in enumerate(logits)), reverse=True)
    weights = weights[:top_k] if top_k > 0 else weights
    kept, before, total = {}, 0.0, sum(w for w, _ in weights)
    for w, i in weights:                           # top-p: keep a token while the mass before it is under p
        if before >= top_p:
            break
        kept[i], before = w, before + w / total
    want = {i: w / sum(kept.values()) for i, w in kept.items()}
    assert len(want) == 4                          # both settings keep 4 of the 6 tokens
    n, g = 20_000, torch.Generator().manual_seed(0)
    table = torch.tensor([logits]).expand(n, -1)
    tokens, logprobs = sample(table, [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * n, [g] * n)
    counts = torch.bincount(tokens, minlength=len(logits)).tolist()
    assert all(c == 0 for i, c in enumerate(counts) if i not in want), counts
    chi2 = sum((counts[i] - n * q) ** 2 / (n * q) for i, q in want.items())
    expected = [round(n * want.get(i, 0)) for i in range(len(logits))]
    assert chi2 < 25, f"counts {counts} against {expected}: chi-square {chi2:.0f}"
    assert torch.equal(logprobs, torch.tensor(logits).log_softmax(-1)[tokens])


def test_top_k_1_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    for p in (SamplingParams(temperature=1.0, top_k=1, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=10, ignore_eos=True)):
        assert llm.generate([[5, 6, 7]], p)[0].token_ids == greedy


def test_sampling_gives_the_same_tokens_on_every_rank_and_at_every_tp(checkpoint):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, seed=3, ignore_eos=True)
    prompts = [[1, 2, 3], [9, 8]]
    with LLM(checkpoint("gqa")) as one:
        tp1 = [o.token_ids for o in one.generate(prompts, params)]
    with LLM(checkpoint("gqa"), tensor_parallel_size=2) as two:
        per_rank = two._group.call(Worker.generate, (prompts, [params] * 2))
    assert per_rank[0] == per_rank[1]                               # both ranks drew the same tokens
    assert [ids for ids, _, _ in per_rank[0]] == tp1


def test_eos_stops_a_sequence_unless_ignored(checkpoint, tmp_path):
    folder = shutil.copytree(checkpoint("gqa"), tmp_path / "eos")
    with LLM(folder) as engine:
        greedy = engine.generate([[4, 5, 6]], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    eos = next(t for i, t in enumerate(greedy) if i >= 2 and t not in greedy[:i])
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    with LLM(folder) as engine:
        stopped = engine.generate([[4, 5, 6]], SamplingParams(max_tokens=12))[0]
        ignored = engine.generate([[4, 5, 6]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert stopped.token_ids == greedy[: greedy.index(eos) + 1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == greedy and ignored.finish_reason == "length"


def test_shut_down_llm_refuses_to_generate(checkpoint):
    engine = LLM(checkpoint("gqa"))
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate([[1, 2]])


def test_progress_bar_counts_every_prompt_on_stderr(llm, capsys):
    outs = llm.generate([[1, 2], [3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err and "output:" in err and len(outs) == 2
    llm.generate([[1, 2], [3]], SamplingParams(max_tokens=2))   # default: no terminal here, no bar
    assert "Processed prompts" not in capsys.readouterr().err


def test_chat_messages_that_are_not_role_content_dicts_are_refused_with_the_form():
    from tplab import models
    with LLM(models.tiny_stories()) as llm:
        assert "Tell me a story" in llm.chat_prompt("Tell me a story")
        for messages in (["Hi!", "Tell me a story"], [("user", "Hi!")], [{"role": "user"}], []):
            with pytest.raises(ValueError, match=r"messages must be a string, or a non-empty list of \{'role'"):
                llm.chat(messages)
