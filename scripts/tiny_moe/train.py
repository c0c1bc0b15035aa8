"""Train the workbook's tiny Qwen3-MoE story model from scratch, on the CPU.

    .venv/bin/python scripts/tiny_moe/train.py --out tplab/models/tiny_moe

The dense model's recipe (``scripts/tiny_stories/train.py``: the same corpus, tokenizer, data, optimiser,
schedule and seed, imported from there), with HF's ``Qwen3MoeForCausalLM`` in place of Qwen2: the same
attention shape (hidden 256, 4 layers, 4 query and 2 key/value heads of 64; Qwen3's q/k norms and no bias)
and, in every layer, a sparse MoE block instead of the MLP: 8 experts of ``moe_intermediate_size`` 96 (the
dense model's 768-wide MLP cut into eight), 2 per token, top-k weights renormalised (``norm_topk_prob``),
as Qwen3-30B-A3B does. The model has as many parameters as the dense one (3.68M) and spends a quarter of
its MLP compute per token.

The router is trained with Switch Transformer's load-balancing loss, one per layer (HF's
``load_balancing_loss_func`` on each layer's router logits), summed over the layers, weighted by
``--aux-coef`` and added to the next-token loss, so that every expert of every layer gets work. HF's own
``output_router_logits=True`` loss pools the layers' counts before balancing them, which lets an expert
idle in one layer while it is busy in another.
After training, ``expert_load`` counts which experts the router picks on the validation stories; the
README written beside the model shows that table, and ``scripts/tiny_moe/check.py`` prints it again.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from experts import expert_load, load_table  # noqa: E402
from tiny_stories import train as dense  # noqa: E402


def parse_args(argv=None):
    ap = dense.build_parser("Train the tiny Qwen3-MoE story model.")
    ap.set_defaults(out="tplab/models/tiny_moe")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--experts-per-tok", type=int, default=2)
    ap.add_argument("--moe-intermediate", type=int, default=96, help="each expert's MLP width")
    ap.add_argument("--aux-coef", type=float, default=0.02, help="weight of the router load-balancing loss")
    return ap.parse_args(argv)


def make_moe_model(args, vocab: int, eos_id: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        attention_bias=False, hidden_act="silu", max_position_embeddings=args.max_pos,
        initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        use_sliding_window=False, sliding_window=None, attention_dropout=0.0,
        # every layer sparse (intermediate_size, for dense layers, is unused; set to the dense model's width)
        num_experts=args.experts, num_experts_per_tok=args.experts_per_tok,
        moe_intermediate_size=args.moe_intermediate, intermediate_size=args.intermediate,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        output_router_logits=False, router_aux_loss_coef=args.aux_coef,  # the coefficient of moe_loss's aux
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, use_cache=True, dtype="float32",
    )
    return Qwen3MoeForCausalLM(cfg)


def moe_loss(model, x: torch.Tensor, aux_coef: float) -> torch.Tensor:
    """Next-token cross-entropy of the batch ``x`` ``(B, L)`` + ``aux_coef`` x the sum over layers of each
    layer's load-balancing loss (``E * sum_e f_e P_e``: f_e the share of top-k picks, P_e the mean router
    probability of expert e; k at an even load)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    cfg = model.config
    out = model(input_ids=x, output_router_logits=True)
    logits = out.logits[:, :-1].float()                                     # (B, L - 1, V)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    aux = sum(load_balancing_loss_func((lg,), cfg.num_experts, cfg.num_experts_per_tok)   # lg: (B * L, E)
              for lg in out.router_logits)
    return ce + aux_coef * aux


def moe_recipe(args, vocab, model_vocab, n_params, n_train_tok, n_val_tok) -> str:
    """The dense recipe's lines, its model line replaced by this model's, and a router line."""
    model_line = (
        f"model: Qwen3MoeForCausalLM, hidden {args.hidden}, layers {args.layers} (all sparse), heads "
        f"{args.heads}, kv_heads {args.kv_heads}, head_dim {args.hidden // args.heads}, q/k RMSNorm, no "
        f"attention bias, {args.experts} experts of moe_intermediate_size {args.moe_intermediate}, top "
        f"{args.experts_per_tok}, norm_topk_prob True, no shared expert, max_position_embeddings "
        f"{args.max_pos}, rope_theta 10000, tied embeddings, float32, {n_params} parameters")
    router_line = (f"router: Switch Transformer's load-balancing loss per layer, summed over layers, x "
                   f"{args.aux_coef}, added to the training loss (the validation loss is next-token only)")
    lines = dense.recipe_text(args, vocab, model_vocab, n_params, n_train_tok, n_val_tok).splitlines()
    lines = [model_line if line.startswith("model:") else line for line in lines]
    return "\n".join(lines + [router_line])


def write_readme(out: Path, recipe: str, final_val: float, wall: float, load, samples, argv):
    cmd = ".venv/bin/python scripts/tiny_moe/train.py " + " ".join(argv)
    text = f"""# tiny_moe: a small Qwen3-MoE model for the workbook

A `Qwen3MoeForCausalLM` trained from scratch on the generated short stories of
`tiny_stories` (`scripts/tiny_stories/corpus.py`), with the same tokenizer,
data and schedule. Each layer's MLP is 8 experts of which the router picks 2
per token, so the experts' load and which tokens go where mean something on
real text. The file names every expert's tensors
(`model.layers.0.mlp.experts.3.gate_proj.weight`), as the Hub's files do.

Qwen3-MoE rather than Qwen2-MoE: with no shared expert, every token's MLP
work goes through the router, so the load and the routing are the whole
story (Qwen3-30B-A3B's layout). The router is balanced per layer (Switch
Transformer's loss on each layer, summed); HF's `output_router_logits=True`
loss pools the layers' counts first, and a run with it left one expert with
0.4% of its layer's picks while the same expert was busy in another layer.

## Recipe

```
{recipe}
```

Final validation loss: **{final_val:.4f} nats/token** (perplexity {math.exp(final_val):.3f})
on all validation blocks. Training wall time: {wall / 60:.1f} minutes on 2 CPU threads
(shared with another job), CPU: {cpu_name()}.

## The experts' load on held-out text

The share of the top-2 choices each expert gets, per layer, over all
validation blocks (1/8 = 12.5% is an even load):

```
{load_table(load)}
```

## Retrain and check

```
{cmd.strip()}
HF_HUB_OFFLINE=1 .venv/bin/python scripts/tiny_moe/check.py
```

Training is seeded (`torch.manual_seed`, fixed data order), so a rerun on the
same software gives the same recipe; CPU kernels can differ in the last bits
from one machine to another.

## Greedy samples (`do_sample=False, max_new_tokens=60`)

"""
    text += "".join("```\n" + s.strip() + "\n```\n\n" for s in samples)
    (out / "README.md").write_text(text)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    out, t0 = dense.start(args), time.time()

    tok, eos_id, vocab, model_vocab, train_stream, val_stream = dense.prepare_data(args)
    model = make_moe_model(args, model_vocab, eos_id)
    n_params = sum(p.numel() for p in model.parameters())
    recipe = moe_recipe(args, vocab, model_vocab, n_params, train_stream.numel(), val_stream.numel())
    print("=== recipe ===\n" + recipe + "\n==============", flush=True)
    val_blocks = dense.to_blocks(val_stream, args.seq_len)
    final_val, train_wall = dense.train(model, args, dense.to_blocks(train_stream, args.seq_len), val_blocks,
                                        loss_fn=lambda m, x: moe_loss(m, x, args.aux_coef))

    load = expert_load(model, val_blocks, args.batch_size)
    print("expert load on the validation blocks (share of top-k picks):\n" + load_table(load), flush=True)
    dense.save(model, tok, out, eos_id)
    samples = dense.sample(model, tok, dense.PROMPTS)
    for s in samples:
        print("---\n" + s, flush=True)
    write_readme(out, recipe, final_val, train_wall, load, samples, argv)
    dense.finish(out, t0, {"final_val_loss": final_val, "train_wall_s": train_wall, "n_params": n_params,
                           "vocab": vocab, "expert_load_min": load.min().item(), "expert_load_max": load.max().item()})


if __name__ == "__main__":
    main()
