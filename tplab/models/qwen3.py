"""Qwen3 (dense), tensor parallel: Qwen2 with an RMSNorm over each head of q and k before RoPE.

Per attention on each rank (T tokens, this rank's H / H_kv heads of D = the config's ``head_dim``):
    x (T, E) -> qkv_proj (T, (H + 2 H_kv) D) -> q (T, H, D), k (T, H_kv, D)
             -> q_norm(q), k_norm(k): RMSNorm over each head's D features (one (D,) weight, on every rank)
             -> RoPE -> attention -> o_proj + all-reduce
The norms act on one head at a time, so a rank applies them to its own heads with no communication.
``head_dim`` comes from the config (Qwen3's need not be hidden_size / heads), and q/k/v have no bias unless
``attention_bias`` (which gives o_proj one too). The rest is Qwen2's (``tplab.models.qwen2``).
"""
from tplab.layers.norm import RMSNorm
from tplab.models.qwen2 import Qwen2Attention, Qwen2DecoderLayer, Qwen2ForCausalLM


class Qwen3Attention(Qwen2Attention):
    def __init__(self, config, parts, tp_rank: int, tp_size: int, sequence_parallel: bool = False):
        super().__init__(config, parts, tp_rank, tp_size, sequence_parallel)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)        # HF's names: self_attn.q_norm.weight
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    @staticmethod
    def biases(config) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def norm_heads(self, q, k):
        return self.q_norm(q), self.k_norm(k)                            # (T, H, D), (T, H_kv, D)


class Qwen3DecoderLayer(Qwen2DecoderLayer):
    attention = Qwen3Attention


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """One rank's shard of a Qwen3 model (``model_type`` ``qwen3``)."""
    decoder_layer = Qwen3DecoderLayer
