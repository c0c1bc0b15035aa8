"""Qwen2 for causal LM, tensor parallel. Parameter names follow HF's, apart from the fused
``qkv_proj`` (q_proj | k_proj | v_proj) and ``gate_up_proj`` (gate_proj | up_proj).

Per decoder layer on each rank (T tokens, hidden size E, this rank's H/H_kv heads of D, I_local):
    x (T, E) -> input_layernorm -> qkv_proj (T, (H + 2 H_kv) D) -> RoPE -> attention (T, H D)
             -> o_proj + all-reduce (T, E) -> + residual
             -> post_attention_layernorm -> gate_up_proj (T, 2 I_local) -> SiLU * up (T, I_local)
             -> down_proj + all-reduce (T, E) -> + residual
Two all-reduces per layer, none inside attention: each rank owns whole heads.

With ``sequence_parallel`` (at TP > 1) each all-reduce becomes a reduce-scatter over tokens, and the
residual stream between layers holds this rank's T/t tokens (``tplab.models.sequence_parallel``):
    x (T/t, E) -> input_layernorm -> all-gather (T, E) -> qkv_proj ... o_proj (partial sums, T, E)
             -> reduce-scatter (T/t, E) -> + residual -> post_attention_layernorm -> all-gather (T, E)
             -> gate_up_proj ... down_proj (partial sums) -> reduce-scatter (T/t, E) -> + residual
and the final norm runs on T/t tokens before one all-gather hands the LM head all T.

With pipeline parallelism (``tplab.models.pipeline``) this rank builds only its stage's layers (the others
are ``PPMissingLayer``), the embedding on the first stage, the norm and LM head on the last, and runs
``Qwen2Model.forward_stage``: from the ids or the previous stage's ``(hidden, residual)`` to the pair it sends.

The layers come from ``parts`` (``tplab.engine.parts.Parts``): tplab's own, or a pitfall's or a
learner's replacements, each built with the same arguments and called the same way. Qwen3 (``qwen3.py``) and
the MoE models (``qwen_moe.py``) are these classes with another attention or MLP (``tplab.models.registry``).
"""
import torch
from torch import nn

from tplab.distributed.parallel_state import cdiv, tp_rank_and_size
from tplab.layers.activation import SiluAndMul
from tplab.layers.linear import heads_per_rank, returns_partial_sums
from tplab.layers.metadata import AttentionMetadata
from tplab.layers.norm import RMSNorm
from tplab.layers.rotary import RotaryEmbedding, rope_settings
from tplab.models.pipeline import PipelineStage, PPMissingLayer


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def local_head_counts(config, tp_size: int) -> tuple[int, int]:
    """``(H, H_kv)`` on one rank of a model of this config (``tplab.layers.linear.heads_per_rank``)."""
    return heads_per_rank(config.num_attention_heads, config.num_key_value_heads, tp_size)


def row_settings(partial_sums: bool) -> dict:
    """The row-parallel layers' (and the embedding's) extra settings: where the caller reduces their partial
    sums (under sequence parallelism, reduce-scattered), they return them; the part must be
    ``ReturnsPartialSums``."""
    return {"reduce_results": False} if partial_sums else {}


class Qwen2Attention(nn.Module):
    def __init__(self, config, parts, tp_rank: int, tp_size: int, sequence_parallel: bool = False):
        super().__init__()
        head_dim = head_dim_of(config)
        qkv_bias, o_bias = self.biases(config)
        self.qkv_proj = parts.qkv_linear(config.hidden_size, head_dim, config.num_attention_heads,
                                         config.num_key_value_heads, bias=qkv_bias, tp_rank=tp_rank, tp_size=tp_size)
        self.num_heads, self.num_kv_heads = local_head_counts(config, tp_size)
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim   # this rank's widths
        self.o_proj = parts.row_linear(config.num_attention_heads * head_dim, config.hidden_size, bias=o_bias,
                                       tp_rank=tp_rank, tp_size=tp_size, **row_settings(sequence_parallel))
        theta, _ = rope_settings(config)
        self.rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, theta, parts.apply_rope)
        self.attn = parts.attention(self.num_heads, self.num_kv_heads, head_dim, parts.attend)

    def forward(self, x, kv_cache, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # (T, H D), (T, H_kv D) x2
        q = q.view(-1, self.num_heads, self.head_dim)               # (T, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)            # (T, H_kv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(meta.positions, *self.norm_heads(q, k))
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))     # (T, E), all-reduced (SP: partial sums)

    @staticmethod
    def biases(config) -> tuple[bool, bool]:
        """Whether q/k/v and o_proj have a bias: Qwen2's q/k/v do (Qwen2-MoE's unless ``qkv_bias=False``)."""
        return getattr(config, "qkv_bias", True), False

    def norm_heads(self, q, k):
        """What each head of q and k goes through before RoPE: nothing in Qwen2 (Qwen3: an RMSNorm)."""
        return q, k


class Qwen2MLP(nn.Module):
    """``partial_sums``: down_proj returns this rank's partial sum, for the caller to reduce (under SP the
    layer reduce-scatters it); ``intermediate_size`` defaults to the config's (an MoE model's shared expert
    has its own)."""

    def __init__(self, config, parts, tp_rank: int, tp_size: int, partial_sums: bool = False,
                 intermediate_size: int | None = None):
        super().__init__()
        if config.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act={config.hidden_act!r}: tplab implements Qwen2's 'silu' only")
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = parts.gate_up_linear(config.hidden_size, [size, size], bias=False,
                                                 tp_rank=tp_rank, tp_size=tp_size)
        self.down_proj = parts.row_linear(size, config.hidden_size, bias=False, tp_rank=tp_rank, tp_size=tp_size,
                                          **row_settings(partial_sums))
        self.act_fn = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))   # (T, E) after the all-reduce (SP: partial)


class Qwen2DecoderLayer(nn.Module):
    """One decoder layer. Other Qwen models change its ``attention`` class or what ``make_mlp`` builds for
    layer ``layer_idx`` (an MoE block); ``enable_expert_parallel`` only matters to an MoE block."""
    attention = Qwen2Attention

    def __init__(self, config, parts, tp_rank: int, tp_size: int, sequence_parallel: bool = False,
                 layer_idx: int = 0, enable_expert_parallel: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention(config, parts, tp_rank, tp_size, sequence_parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.make_mlp(config, parts, tp_rank, tp_size, sequence_parallel, layer_idx, enable_expert_parallel)

    def make_mlp(self, config, parts, tp_rank, tp_size, sequence_parallel, layer_idx, enable_expert_parallel):
        return Qwen2MLP(config, parts, tp_rank, tp_size, partial_sums=sequence_parallel)

    def forward(self, x, kv_cache, meta, sp=None):
        """The residual stream after this layer: ``x`` plus attention, plus the MLP, each of its normed input."""
        hidden, residual = self.forward_unsummed(x, kv_cache, meta, sp)
        return residual + hidden

    def forward_unsummed(self, x, kv_cache, meta, sp=None):
        """``(hidden, residual)``: the MLP's output and the residual stream it is added to, whose sum
        ``forward`` returns. A pipeline stage's last layer sends this pair to the next stage (vLLM's)."""
        if sp is None:
            x = x + self.self_attn(self.input_layernorm(x), kv_cache, meta)
            return self.mlp(self.post_attention_layernorm(x)), x
        # sequence parallel (a Parts.sp_norm_region): x is this rank's (T_pad / t, E) tokens
        x = sp.add(self.self_attn(sp.norm_gather(x, self.input_layernorm), kv_cache, meta), x)
        return sp.add(self.mlp(sp.norm_gather(x, self.post_attention_layernorm))), x


class Qwen2Model(nn.Module):
    def __init__(self, config, parts, tp_rank: int, tp_size: int, sequence_parallel: bool = False, stage=None,
                 decoder_layer: type = Qwen2DecoderLayer, enable_expert_parallel: bool = False):
        super().__init__()
        stage = stage or PipelineStage(config.num_hidden_layers, 0, 1)   # default: the whole model
        self.tp_rank, self.tp_size, self.sequence_parallel, self.stage = tp_rank, tp_size, sequence_parallel, stage
        self.sp_norm_region = parts.sp_norm_region
        # an embedding that can return its partial lookups is reduce-scattered too; any other is all-reduced
        self.embed_partial = sequence_parallel and returns_partial_sums(parts.embedding)
        self.embed_tokens = PPMissingLayer()
        if stage.has_embedding:
            self.embed_tokens = parts.embedding(config.vocab_size, config.hidden_size, tp_rank=tp_rank,
                                                tp_size=tp_size, **row_settings(self.embed_partial))
        self.layers = nn.ModuleList(decoder_layer(config, parts, tp_rank, tp_size, sequence_parallel, layer_idx=i,
                                                  enable_expert_parallel=enable_expert_parallel)
                                    if i in stage.layers else PPMissingLayer() for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.has_head else PPMissingLayer()

    def _region(self, num_tokens: int):
        """This step's sequence-parallel region (a ``Parts.sp_norm_region``), or None without SP."""
        return self.sp_norm_region(num_tokens, self.tp_rank, self.tp_size) if self.sequence_parallel else None

    def _embed(self, input_ids, sp):
        x = self.embed_tokens(input_ids)                            # (T, E): full, or SP's partial lookups
        if sp is not None:                                          # -> (T_pad / t, E): this rank's tokens
            x = sp.add(x) if self.embed_partial else sp.local(x)
        return x

    def forward(self, input_ids, kv_caches, meta):
        """The whole decoder stack, without pipeline stages (under PP each stage runs ``forward_stage``)."""
        sp = self._region(input_ids.shape[0])
        x = self._embed(input_ids, sp)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, kv_cache, meta, sp)
        return self._final_norm(x, sp)

    def _final_norm(self, x, sp):
        """The final norm, on this rank's T / t tokens then all-gathered under SP: ``(T, E)`` for the LM head."""
        return self.norm(x) if sp is None else sp.norm_gather(x, self.norm)

    def boundary_rows(self, num_tokens: int) -> int:
        """Rows of the ``(hidden, residual)`` a stage sends for a step of ``num_tokens`` tokens: all of them,
        or this rank's T / t (padded) under sequence parallelism."""
        return cdiv(num_tokens, self.tp_size) if self.sequence_parallel else num_tokens

    def forward_stage(self, input_ids, received, kv_caches, meta):
        """This pipeline stage's share of ``forward``. ``input_ids`` ``(T,)``: the step's tokens (every stage
        knows them; the first embeds them); ``received``: the previous stage's ``(hidden, residual)``, None on
        the first stage; ``kv_caches[i]``: layer i's cache. Returns ``(hidden, residual)`` for the next stage,
        or on the last stage the final hidden states ``(T, E)`` for the LM head."""
        sp, layers = self._region(input_ids.shape[0]), self.stage.layers
        if received is None:
            x = self._embed(input_ids, sp)
        else:
            hidden, residual = received
            x = residual + hidden                                   # the previous stage's last add, as it would be
        for i in layers[:-1]:
            x = self.layers[i](x, kv_caches[i], meta, sp)
        last = self.layers[layers[-1]]
        if not self.stage.has_head:
            return last.forward_unsummed(x, kv_caches[layers[-1]], meta, sp)   # (rows, E) twice
        return self._final_norm(last(x, kv_caches[layers[-1]], meta, sp), sp)


def tie_weights(lm_head: nn.Module, embedding: nn.Module) -> None:
    """Point ``lm_head.weight`` at ``embedding.weight`` (``tie_word_embeddings``): both split the vocab
    over ranks the same way, so this rank's head rows are its embedding rows."""
    head, emb = getattr(lm_head, "weight", None), getattr(embedding, "weight", None)
    if not isinstance(emb, torch.Tensor) or head is None or tuple(head.shape) != tuple(emb.shape):
        raise ValueError(f"tie_word_embeddings: the LM head's weight {tuple(getattr(head, 'shape', ()))} must have "
                         f"the embedding's shape {tuple(getattr(emb, 'shape', ()))} on every rank")
    lm_head.weight = emb


class Qwen2ForCausalLM(nn.Module):
    """One rank's shard of a Qwen2 model. ``tp_rank``/``tp_size`` default to the process group's;
    ``sequence_parallel`` (at TP > 1) splits the residual stream over ranks by tokens. The other Qwen models
    (``tplab.models.registry``) are this class with another ``decoder_layer``."""
    decoder_layer = Qwen2DecoderLayer

    # checkpoint name -> (name of the fused parameter, shard id given to its weight_loader)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    # an MoE model's (param_name, weight_name, expert_id, shard_id) per expert tensor (tplab.layers.moe)
    expert_params_mapping: list = []

    def __init__(self, config, parts, tp_rank: int | None = None, tp_size: int | None = None,
                 sequence_parallel: bool = False, pp_rank: int = 0, pp_size: int = 1,
                 enable_expert_parallel: bool = False):
        super().__init__()
        tp_rank, tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.config, self.tp_rank, self.tp_size = config, tp_rank, tp_size
        self.sequence_parallel = sequence_parallel and tp_size > 1   # at TP 1 there is nothing to split
        self.stage = parts.pipeline_stage(config.num_hidden_layers, pp_rank, pp_size, tp_rank, tp_size)
        self.model = Qwen2Model(config, parts, tp_rank, tp_size, self.sequence_parallel, self.stage,
                                self.decoder_layer, enable_expert_parallel)
        self.weight_aliases = {}  # checkpoint name -> parameter name, where they differ (a tied head below)
        if not self.stage.has_head:
            self.lm_head = PPMissingLayer()
            return
        self.lm_head = parts.lm_head(config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size)
        if config.tie_word_embeddings and self.stage.has_embedding:  # one tensor for both: the embedding's rows
            tie_weights(self.lm_head, self.model.embed_tokens)
        elif config.tie_word_embeddings:   # the last stage has no embedding: its head reads the embedding's tensor
            self.weight_aliases["model.embed_tokens.weight"] = "lm_head.weight"

    @classmethod
    def tp_split_sizes(cls, config, enable_expert_parallel: bool = False) -> dict[str, int]:
        """The sizes tensor parallelism splits besides the heads, by config field: each must divide by tp_size."""
        return {"intermediate_size": config.intermediate_size}

    def forward(self, input_ids: torch.Tensor, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids ``(T,)`` -> final hidden states ``(T, E)``."""
        return self.model(input_ids, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(N, E)`` -> ``(N, vocab)``, the same full logits on every rank."""
        return self.lm_head(hidden)
