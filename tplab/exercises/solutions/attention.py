# Exercise: attention (reference solution)
import torch
import torch.nn.functional as F
from torch import nn


class MyAttention(nn.Module):
    """One layer's attention over the paged KV cache: store this step's K/V heads (not their repeats)
    where slot_mapping says, then let each sequence's new queries attend to exactly its keys."""

    def __init__(self, num_heads, num_kv_heads, head_dim, attend=None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5

    def forward(self, q, k, v, kv_cache, meta):
        # q (T, H, D); k, v (T, H_kv, D); each cache (num_blocks, block_size, H_kv, D)
        k_cache, v_cache = (c.view(-1, *c.shape[2:]) for c in kv_cache)   # (num_slots, H_kv, D) views
        k_cache[meta.slot_mapping] = k                                     # the KV heads, as they are
        v_cache[meta.slot_mapping] = v
        out = torch.empty_like(q)                                          # (T, H, D)
        for b in range(len(meta.seq_lens)):
            start, end = meta.query_start_loc[b], meta.query_start_loc[b + 1]
            slots = meta.seq_kv_slots(b)                                   # (Lk,) this sequence's keys
            keys = k_cache[slots].transpose(0, 1)                          # (H_kv, Lk, D)
            values = v_cache[slots].transpose(0, 1)
            queries = q[start:end].transpose(0, 1)                         # (H, Lq, D)
            out[start:end] = F.scaled_dot_product_attention(               # GQA: head h reads KV head h // group
                queries, keys, values, attn_mask=meta.visible[b], scale=self.scale, enable_gqa=True
            ).transpose(0, 1)                                              # (Lq, H, D)
        return out.flatten(1)                                              # (T, H * D)
