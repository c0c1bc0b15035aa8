"""Qwen2 for causal LM, tensor parallel. Parameter names follow HF's, apart from the fused
``qkv_proj`` (q_proj | k_proj | v_proj) and ``gate_up_proj`` (gate_proj | up_proj).

Per decoder layer on each rank (T tokens, hidden size E, this rank's H/H_kv heads of D, I_local):
    x (T, E) -> input_layernorm -> qkv_proj (T, (H + 2 H_kv) D) -> RoPE -> attention (T, H D)
             -> o_proj + all-reduce (T, E) -> + residual
             -> post_attention_layernorm -> gate_up_proj (T, 2 I_local) -> SiLU * up (T, I_local)
             -> down_proj + all-reduce (T, E) -> + residual
Two all-reduces per layer, none inside attention: each rank owns whole heads.
"""
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from tplab.layers.activation import SiluAndMul
from tplab.layers.attention import Attention, AttentionMetadata, sdpa_attend
from tplab.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from tplab.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tplab.layers.norm import RMSNorm
from tplab.layers.rotary import RotaryEmbedding, apply_rotary, rope_settings
from tplab.parallel import tp_rank_and_size


@dataclass(frozen=True)
class Parts:
    """The replaceable pieces a model is built from. ``tplab.bugs`` swaps some for the seeds' broken ones,
    so the engine itself never branches on a bug."""
    attend: Callable = sdpa_attend              # softmax(q k^T) v with the causal mask applied
    apply_rope: Callable = apply_rotary         # rotate q, k by cos/sin
    qkv_linear: type = QKVParallelLinear        # fused q|k|v, column parallel by head
    gate_up_linear: type = MergedColumnParallelLinear
    row_linear: type = RowParallelLinear        # o_proj and down_proj
    attention: type = Attention                 # writes K/V into the cache, then attends


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Qwen2Attention(nn.Module):
    def __init__(self, config, parts: Parts, tp_rank: int, tp_size: int):
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = parts.qkv_linear(config.hidden_size, head_dim, config.num_attention_heads,
                                         config.num_key_value_heads, bias=True, tp_rank=tp_rank, tp_size=tp_size)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = parts.row_linear(config.num_attention_heads * head_dim, config.hidden_size, bias=False,
                                       tp_rank=tp_rank, tp_size=tp_size)
        theta, _ = rope_settings(config)
        self.rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, theta, parts.apply_rope)
        self.attn = parts.attention(self.num_heads, self.num_kv_heads, head_dim, parts.attend)

    def forward(self, x, kv_cache, meta: AttentionMetadata):
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))             # (T, H D), (T, H_kv D), (T, H_kv D)
        q = q.view(-1, self.num_heads, self.head_dim)               # (T, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)            # (T, H_kv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(meta.positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))     # (T, E), all-reduced


class Qwen2MLP(nn.Module):
    def __init__(self, config, parts: Parts, tp_rank: int, tp_size: int):
        super().__init__()
        if config.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act={config.hidden_act!r}: tplab implements Qwen2's 'silu' only")
        size = config.intermediate_size
        self.gate_up_proj = parts.gate_up_linear(config.hidden_size, [size, size], bias=False,
                                                 tp_rank=tp_rank, tp_size=tp_size)
        self.down_proj = parts.row_linear(size, config.hidden_size, bias=False, tp_rank=tp_rank, tp_size=tp_size)
        self.act_fn = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))   # (T, E) after the all-reduce


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config, parts: Parts, tp_rank: int, tp_size: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen2Attention(config, parts, tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Qwen2MLP(config, parts, tp_rank, tp_size)

    def forward(self, x, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    def __init__(self, config, parts: Parts, tp_rank: int, tp_size: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(config, parts, tp_rank, tp_size)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, kv_caches, meta):
        x = self.embed_tokens(input_ids)                            # (T, E)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, kv_cache, meta)
        return self.norm(x)


class Qwen2ForCausalLM(nn.Module):
    """One rank's shard of a Qwen2 model. ``tp_rank``/``tp_size`` default to the process group's."""

    # checkpoint name -> (name of the fused parameter, shard id given to its weight_loader)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, tp_rank: int | None = None, tp_size: int | None = None, parts: Parts = Parts()):
        super().__init__()
        tp_rank, tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.config, self.tp_rank, self.tp_size = config, tp_rank, tp_size
        self.model = Qwen2Model(config, parts, tp_rank, tp_size)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids ``(T,)`` -> final hidden states ``(T, E)``."""
        return self.model(input_ids, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(N, E)`` -> ``(N, vocab)``, the same full logits on every rank."""
        return self.lm_head(hidden)
