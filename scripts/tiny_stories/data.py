"""The tokenizer and data pipeline of train.py: a byte-level BPE tokenizer with Qwen2's pipeline, and the
stories as one token stream cut into blocks."""

from __future__ import annotations

import torch

EOS = "<|endoftext|>"
# Qwen2's pre-tokenizer split (transformers' tokenization_qwen2.PRETOKENIZE_REGEX)
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
               r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% else %}{{ message['content'] + '\\n' }}{% endif %}"
    "{% endfor %}"
)


def train_tokenizer(texts, vocab_size: int):
    from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                            processors, trainers)
    from transformers import PreTrainedTokenizerFast

    # The same pipeline as Qwen2's own tokenizer.json (NFC, Qwen2's split
    # regex, then byte-level), so that transformers' Qwen2Tokenizer, which
    # AutoTokenizer picks for a qwen2 config, tokenizes exactly as trained.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=None,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode_stream(tok, texts, eos_id: int) -> torch.Tensor:
    ids: list[int] = []
    batch = 2000
    for i in range(0, len(texts), batch):
        for row in tok(texts[i:i + batch], add_special_tokens=False)["input_ids"]:
            ids.extend(row)
            ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def to_blocks(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len)
