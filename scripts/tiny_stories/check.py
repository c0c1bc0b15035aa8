"""Check the shipped tiny_stories model folder, offline.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/tiny_stories/check.py [folder]

Loads the folder with ``AutoTokenizer`` and ``AutoModelForCausalLM``, checks that
the special-token ids agree between tokenizer, config and generation config,
prints greedy continuations of three prompts and the folder size.
``scripts/tiny_moe/check.py`` runs the same checks on the MoE model, then its own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

DEFAULT = Path(__file__).resolve().parents[2] / "tplab" / "models" / "tiny_stories"
PROMPTS = ["Once upon a time", "Lily went to the", "One day, Tom and his dad"]


def main(folder=None):
    """Check ``folder`` (the command line's, else the shipped one); returns its (tokenizer, model)."""
    folder = Path(folder or (sys.argv[1] if len(sys.argv) > 1 else DEFAULT))
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.eval()
    cfg, gcfg = model.config, model.generation_config
    print(f"tokenizer: {type(tok).__name__}, {len(tok)} tokens; eos {tok.eos_token!r}={tok.eos_token_id}, "
          f"bos={tok.bos_token_id}, pad={tok.pad_token_id}")
    print(f"config: vocab {cfg.vocab_size}, hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers}, "
          f"heads {cfg.num_attention_heads}/{cfg.num_key_value_heads}, intermediate {cfg.intermediate_size}, "
          f"tie {cfg.tie_word_embeddings}, dtype {next(model.parameters()).dtype}")
    for name, c in (("config", cfg), ("generation_config", gcfg)):
        ids = (c.eos_token_id, c.bos_token_id, c.pad_token_id)
        assert ids == (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id), (name, ids)
    assert cfg.vocab_size >= len(tok)
    # AutoTokenizer must tokenize exactly as the trained tokenizer.json does.
    from tokenizers import Tokenizer
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    samples = ["Once upon a time, there was a little girl named Lily.",
               "She said, \"I can't find my red ball!\" 123 apples\n\nThe end.",
               "Caf\u00e9 na\u0131ve \u4f60\u597d  two  spaces <|endoftext|>"]
    for s in samples:
        a = raw.encode(s, add_special_tokens=False).ids
        b = tok(s, add_special_tokens=False)["input_ids"]
        assert a == b, (s, a, b)
        assert tok.decode(b) == raw.decode(a, skip_special_tokens=False), s
    for tp in (1, 2, 4):
        assert cfg.num_attention_heads % tp == 0 and cfg.intermediate_size % tp == 0
        assert cfg.vocab_size % tp == 0
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, do_sample=False, max_new_tokens=60)
        print("---")
        print(tok.decode(out[0]))
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    print("---")
    print(f"folder {folder}: {size / 1e6:.2f} MB ({size} bytes) in "
          f"{sum(1 for f in folder.iterdir() if f.is_file())} files")
    assert size <= 20 * 1000 * 1000, "folder is over 20 MB"
    return tok, model


if __name__ == "__main__":
    main()
