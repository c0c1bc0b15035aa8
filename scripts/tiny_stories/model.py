"""The model side of train.py: the Qwen2 config built from scratch, the learning-rate schedule, evaluation
and greedy samples."""

from __future__ import annotations

import math

import torch


def make_model(args, vocab: int, eos_id: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        hidden_act="silu",
        max_position_embeddings=args.max_pos,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=args.layers,
        attention_dropout=0.0,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        use_cache=True,
        dtype="float32",
    )
    model = Qwen2ForCausalLM(cfg)
    return model


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    lo = args.lr * args.min_lr_ratio
    return lo + 0.5 * (args.lr - lo) * (1 + math.cos(math.pi * min(1.0, t)))


@torch.no_grad()
def evaluate(model, blocks: torch.Tensor, batch: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, blocks.shape[0], batch):
        x = blocks[i:i + batch]
        logits = model(input_ids=x).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def sample(model, tok, prompts, max_new_tokens=60):
    model.eval()
    outs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tok.pad_token_id)
        outs.append(tok.decode(out[0], skip_special_tokens=False))
    model.train()
    return outs
