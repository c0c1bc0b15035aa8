"""Train the workbook's tiny Qwen2 story model from scratch, on the CPU.

One command does everything::

    .venv/bin/python scripts/tiny_stories/train.py --out tplab/models/tiny_stories

Recipe (the defaults below; every value is printed at the start of a run):

* corpus: ``corpus.py`` with seed 0: 40,000 training stories and 1,000
  validation stories (simple English, built from templates and word lists;
  nothing is downloaded).
* tokenizer: byte-level BPE (``tokenizers``), with the same pipeline as
  Qwen2's own tokenizer.json (NFC normaliser, Qwen2's split regex, ByteLevel
  pre-tokenizer and decoder), trained on the training stories with
  vocab_size 2048 requested; BPE stops at about 1,720 tokens, once every word
  of the corpus is a single token. One special token, ``<|endoftext|>``
  (id 0), is eos, bos and pad. Saved as tokenizer.json +
  tokenizer_config.json (+ a plain chat template) so that ``AutoTokenizer``
  loads it offline.
* model: ``Qwen2ForCausalLM`` from scratch: hidden 256, 4 layers, 4 query
  heads and 2 key/value heads (GQA; head_dim 64), MLP intermediate 768,
  q/k/v bias, tied embeddings, RoPE theta 10000 (default rope type), no
  sliding window, max_position_embeddings 512, float32, 3.67M parameters.
  vocab_size is 2048: the rows past the tokenizer's last id are padding
  (as in Qwen2 itself), and 2048 splits evenly for tensor-parallel sizes
  1, 2, 4 and 8.
* data: each story followed by ``<|endoftext|>``, all stories concatenated
  into one stream and cut into blocks of 256 tokens; a seeded permutation of
  the blocks each epoch.
* optimisation: AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices
  only), peak learning rate 2e-3, linear warmup 60 steps, cosine decay to
  10% of peak; batch 8 blocks (2048 tokens), 1200 steps (2.46M tokens, about
  a third of an epoch), gradient clipping at 1.0; ``torch.manual_seed(0)``;
  2 CPU threads.
* evaluation: mean next-token cross-entropy (nats/token) on validation
  blocks, on 48 blocks every 100 steps and on all 680 at the end.
* result of the shipped run: final validation loss 0.2506 nats/token.
  Cost: about 2.5M training tokens; at ~4,500 tokens/s (2 threads, idle
  2-core machine) that is roughly 10-15 minutes; the shipped run took 45 minutes
  because another job shared the CPU.

The output folder holds config.json, generation_config.json,
model.safetensors (float32), tokenizer.json, tokenizer_config.json and a
README.md with the recipe, the final validation loss and this command.

This file holds the options, the recipe text, the README and the training
loop; the tokenizer and data pipeline are in ``data.py``, the model, the
learning-rate schedule, evaluation and sampling in ``model.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import corpus  # noqa: E402
from data import EOS, encode_stream, to_blocks, train_tokenizer  # noqa: E402
from model import evaluate, lr_at, make_model, sample  # noqa: E402


def build_parser(description="Train the tiny Qwen2 story model."):
    """The options of the recipe below; ``scripts/tiny_moe/train.py`` adds its own to them."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default="tplab/models/tiny_stories", help="output folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-train", type=int, default=40000, help="training stories")
    ap.add_argument("--n-val", type=int, default=1000, help="validation stories")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--max-pos", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-blocks", type=int, default=48, help="validation blocks for in-run evals")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    return ap


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def recipe_text(args, vocab: int, model_vocab: int, n_params: int, n_train_tok: int, n_val_tok: int) -> str:
    tokens_per_step = args.batch_size * args.seq_len
    lines = [
        f"corpus: scripts/tiny_stories/corpus.py, seed {args.seed}, {args.n_train} training stories "
        f"({n_train_tok} tokens), {args.n_val} validation stories ({n_val_tok} tokens)",
        f"tokenizer: byte-level BPE, {vocab} tokens (vocab_size {args.vocab_size} requested; BPE "
        f"stops once every word of the corpus is one token), special token {EOS} (id 0) = eos = bos = pad",
        f"model vocab_size: {model_vocab} (embedding rows past {vocab - 1} are padding, never produced by "
        f"the tokenizer; the size is divisible by 1, 2, 4 and 8)",
        f"model: Qwen2ForCausalLM, hidden {args.hidden}, layers {args.layers}, heads {args.heads}, "
        f"kv_heads {args.kv_heads}, head_dim {args.hidden // args.heads}, intermediate "
        f"{args.intermediate}, max_position_embeddings {args.max_pos}, rope_theta 10000, "
        f"tied embeddings, q/k/v bias, no sliding window, float32, {n_params} parameters",
        f"data: story + {EOS}, concatenated, blocks of {args.seq_len} tokens, seeded permutation per epoch",
        f"optimiser: AdamW(lr {args.lr}, betas (0.9, {args.beta2}), eps 1e-8, weight_decay "
        f"{args.weight_decay} on 2-D weights only), warmup {args.warmup} steps, cosine to "
        f"{args.min_lr_ratio} x peak, grad clip {args.clip}",
        f"schedule: {args.steps} steps x batch {args.batch_size} x {args.seq_len} tokens = "
        f"{args.steps * tokens_per_step} tokens ({args.steps * tokens_per_step / max(1, n_train_tok):.2f} epochs)",
        f"seed: torch.manual_seed({args.seed}), random.seed({args.seed}); threads {args.threads}",
        f"eval: every {args.eval_every} steps on {args.eval_blocks} validation blocks; all validation blocks at the end",
    ]
    return "\n".join(lines)


def write_readme(out: Path, recipe: str, final_val: float, wall: float, samples, argv):
    cmd = ".venv/bin/python scripts/tiny_stories/train.py " + " ".join(argv)
    text = f"""# tiny_stories: a small Qwen2 model for the workbook

A `Qwen2ForCausalLM` trained from scratch on a generated corpus of simple
English short stories (`scripts/tiny_stories/corpus.py`), with its own
byte-level BPE tokenizer. It is small enough to run on a CPU, and fluent
enough that a correct tensor-parallel engine produces readable stories while
a broken one visibly does not.

## Recipe

```
{recipe}
```

Final validation loss: **{final_val:.4f} nats/token** (perplexity {math.exp(final_val):.3f})
on all validation blocks. Training wall time: {wall / 60:.1f} minutes on 2 CPU threads.

## Retrain

```
{cmd.strip()}
```

Training is seeded (`torch.manual_seed`, fixed data order), so a rerun on the
same software gives the same recipe; CPU kernels can differ in the last bits
from one machine to another.

## Greedy samples (`do_sample=False, max_new_tokens=60`)

"""
    for s in samples:
        text += "```\n" + s.strip() + "\n```\n\n"
    (out / "README.md").write_text(text)


PROMPTS = ["Once upon a time", "Lily went to the", "One day, Tom and his dad"]


def prepare_data(args):
    """The corpus and the tokenizer: (tok, eos_id, vocab, model_vocab, train_stream, val_stream), printed as made."""
    t0 = time.time()
    train_texts, val_texts = corpus.make_splits(args.seed, args.n_train, args.n_val)
    print(f"corpus: {len(train_texts)} train / {len(val_texts)} val stories, "
          f"{len(corpus.sentences(train_texts))} distinct training sentences "
          f"({time.time() - t0:.1f}s)", flush=True)
    tok = train_tokenizer(train_texts, args.vocab_size)
    eos_id = tok.convert_tokens_to_ids(EOS)
    assert eos_id == 0, eos_id
    vocab = len(tok)
    # The embedding is padded up to a round size (like Qwen2's own 151936 rows
    # for 151665 tokens) so that tensor-parallel sizes 1, 2, 4 and 8 split it.
    model_vocab = max(args.vocab_size, -(-vocab // 64) * 64)
    train_stream = encode_stream(tok, train_texts, eos_id)
    val_stream = encode_stream(tok, val_texts, eos_id)
    print(f"tokenizer: vocab {vocab}; {train_stream.numel() / len(train_texts):.1f} tokens/story; "
          f"{train_stream.numel() // args.seq_len} train blocks, {val_stream.numel() // args.seq_len} val blocks "
          f"({time.time() - t0:.1f}s)", flush=True)
    return tok, eos_id, vocab, model_vocab, train_stream, val_stream


def train(model, args, train_blocks, val_blocks, loss_fn=None):
    """AdamW with warmup and cosine decay over ``args.steps`` batches; returns (final val loss, wall seconds).
    ``loss_fn(model, x)``: the loss of a batch (the MoE adds its router's); by default the model's own."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, args.beta2), eps=1e-8)

    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(train_blocks.shape[0], generator=gen)
    pos = 0
    eval_sub = val_blocks[: args.eval_blocks]
    model.train()
    t_train = time.time()
    tokens = 0
    loss_acc, n_acc = 0.0, 0
    for step in range(args.steps):
        if pos + args.batch_size > order.numel():
            order = torch.randperm(train_blocks.shape[0], generator=gen)
            pos = 0
        x = train_blocks[order[pos:pos + args.batch_size]]
        pos += args.batch_size
        lr = lr_at(step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = loss_fn(model, x) if loss_fn else model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        tokens += x.numel()
        loss_acc += loss.item()
        n_acc += 1
        if (step + 1) % args.log_every == 0 or step == 0:
            el = time.time() - t_train
            print(f"step {step + 1:5d}/{args.steps}  loss {loss_acc / n_acc:.4f}  lr {lr:.2e}  "
                  f"gnorm {gnorm:.2f}  {tokens / el:.0f} tok/s  {el / 60:.1f} min", flush=True)
            loss_acc, n_acc = 0.0, 0
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            vl = evaluate(model, eval_sub, args.batch_size)
            print(f"step {step + 1:5d}  val_loss {vl:.4f} ({eval_sub.shape[0]} blocks)", flush=True)
    train_wall = time.time() - t_train

    final_val = evaluate(model, val_blocks, args.batch_size)
    print(f"final val_loss {final_val:.4f} nats/token on {val_blocks.shape[0]} blocks "
          f"(ppl {math.exp(final_val):.3f}); training wall time {train_wall / 60:.1f} min", flush=True)
    return final_val, train_wall


def save(model, tok, out: Path, eos_id: int):
    """config.json, generation_config.json, model.safetensors and the tokenizer files into ``out``."""
    from transformers import GenerationConfig
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        do_sample=False, max_new_tokens=60)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    # Name Qwen2's tokenizer class (transformers 5 writes its internal
    # "TokenizersBackend"); AutoTokenizer picks it for a qwen2 config anyway,
    # and older transformers know the name too.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "Qwen2Tokenizer"
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")


def start(args) -> Path:
    """Threads and seeds from ``args``; the output folder, made."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def finish(out: Path, t0: float, log: dict) -> None:
    """``train_log.json`` (``log`` and the total wall time), and what was saved."""
    total_wall = time.time() - t0
    (out / "train_log.json").write_text(json.dumps({**log, "total_wall_s": total_wall}, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"saved to {out} ({size / 1e6:.2f} MB); total wall time {total_wall / 60:.1f} min", flush=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    out, t0 = start(args), time.time()

    tok, eos_id, vocab, model_vocab, train_stream, val_stream = prepare_data(args)
    model = make_model(args, model_vocab, eos_id)
    n_params = sum(p.numel() for p in model.parameters())
    recipe = recipe_text(args, vocab, model_vocab, n_params, train_stream.numel(), val_stream.numel())
    print("=== recipe ===\n" + recipe + "\n==============", flush=True)
    val_blocks = to_blocks(val_stream, args.seq_len)
    final_val, train_wall = train(model, args, to_blocks(train_stream, args.seq_len), val_blocks)

    save(model, tok, out, eos_id)
    samples = sample(model, tok, PROMPTS)
    for s in samples:
        print("---\n" + s, flush=True)
    write_readme(out, recipe, final_val, train_wall, samples, argv)
    finish(out, t0, {"final_val_loss": final_val, "train_wall_s": train_wall, "n_params": n_params, "vocab": vocab})


if __name__ == "__main__":
    main()
