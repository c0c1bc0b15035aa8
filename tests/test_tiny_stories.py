"""The shipped tiny model: loads offline with HF, tplab matches HF at TP 1/2/4, and its text is fluent."""
import re

import pytest
import torch

from tplab import LLM, SamplingParams, models

PROMPTS = ["Once upon a time", "Lily went to the", "One day, Tom and his dad"]
CORPUS_WORDS = {"the", "a", "and", "was", "to", "he", "she", "they", "said", "went", "saw", "day", "little"}


def hf_story_tokens(folder):
    """HF's tokenizer and model of a shipped checkpoint, and its 40 greedy tokens after each of ``PROMPTS``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    for text in PROMPTS:
        ids = tokenizer.encode(text)
        with torch.no_grad():
            outs.append(model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0, len(ids):].tolist())
    return tokenizer, model, outs


@pytest.fixture(scope="module")
def hf():
    tokenizer, _, outs = hf_story_tokens(models.tiny_stories())
    return tokenizer, outs


def test_folder_is_small_and_loads_offline(hf):
    folder = models.tiny_stories()
    assert sum(f.stat().st_size for f in folder.iterdir()) < 20e6
    tokenizer, _ = hf
    assert tokenizer.decode(tokenizer.encode("Once upon a time")) == "Once upon a time"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tplab_greedy_equals_hf(hf, tp):
    with LLM(models.tiny_stories(), tensor_parallel_size=tp) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=40))
    assert [o.token_ids for o in outs] == hf[1]


def assert_fluent_stories(model_dir) -> None:
    """Greedy continuations of ``PROMPTS`` read as story English: long enough, varied, no word stuck, the
    corpus's words, a sentence's end (the shipped tiny models' check; ``test_tiny_moe`` uses it too)."""
    with LLM(model_dir) as llm:
        texts = [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=60))]
    for text in texts:
        words = re.findall(r"[a-z]+", text.lower())
        assert len(words) >= 25, text
        assert len(set(words)) >= 15, f"too repetitive: {text!r}"
        assert not re.search(r"\b(\w+)( \1){3,}\b", text.lower()), f"a word repeated 4 times running: {text!r}"
        assert len(CORPUS_WORDS & set(words)) >= 4, text
        assert "." in text


def test_greedy_text_is_fluent_story_english():
    assert_fluent_stories(models.tiny_stories())


@pytest.mark.parametrize("bug", ["mask_mul_inf", "lm_head_missing"])
def test_the_students_bugs_visibly_break_it(bug):
    with LLM(models.tiny_stories(), bugs=[bug]) as llm:
        out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=30))[0]
    assert len(set(out.token_ids)) <= 2, f"{bug} should collapse the output, got {out.text!r}"
