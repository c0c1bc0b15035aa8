"""Which experts HF's MoE router picks: the share of the top-k choices each expert gets, per layer."""

from __future__ import annotations

import torch


@torch.no_grad()
def expert_load(model, blocks: torch.Tensor, batch: int = 8) -> torch.Tensor:
    """``(layers, experts)``: the fraction of all top-k picks that went to each expert (each row sums to 1),
    over the token blocks ``blocks`` ``(N, L)``, from HF's ``router_logits``."""
    cfg = model.config
    counts = torch.zeros(cfg.num_hidden_layers, cfg.num_experts)
    model.eval()
    for i in range(0, blocks.shape[0], batch):
        logits = model(input_ids=blocks[i:i + batch], output_router_logits=True).router_logits
        for layer, lg in enumerate(logits):                                    # lg: (B * L, E)
            picks = lg.float().topk(cfg.num_experts_per_tok, dim=-1).indices   # (B * L, k)
            counts[layer] += torch.bincount(picks.flatten(), minlength=cfg.num_experts).float()
    return counts / counts.sum(-1, keepdim=True)


def load_table(load: torch.Tensor) -> str:
    """The load as a table in percent: one row per layer, one column per expert, and each row's min and max."""
    head = "layer " + " ".join(f"{f'e{e}':>5}" for e in range(load.shape[1])) + "    min    max"
    rows = [f"{layer:5d} " + " ".join(f"{100 * v:5.1f}" for v in row)
            + f"  {100 * min(row):5.1f}  {100 * max(row):5.1f}" for layer, row in enumerate(load.tolist())]
    return "\n".join([head] + rows)
