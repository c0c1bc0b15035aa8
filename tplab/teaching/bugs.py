"""The pitfalls of a student's TP implementation, each a drop-in replacement for one part of the engine.

``LLM(..., bugs=["mask_mul_inf"])`` builds the engine with these parts swapped in; the engine
itself has no ``if bug:`` branches. Each replacement's docstring quotes the review notes on the
pitfall it reproduces. A bug replaces fields of ``tplab.Parts`` (attention, RoPE, the linear
layers, the LM head, the positions function, the checkpoint loader); bugs that replace
different fields combine. This module registers them with ``tplab.engine.parts``, the one
place where parts are resolved.
"""
import torch
import torch.nn.functional as F

from tplab.engine import parts
from tplab.engine.model_runner import token_positions
from tplab.engine.probe import load_model, probe
from tplab.layers.attention import Attention
from tplab.layers.embed_head import ParallelLMHead
from tplab.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, linear
from tplab.layers.weights import materialize
from tplab.models.loader import LoadReport, param_for, checkpoint_files, default_weight_loader


# --- attention -------------------------------------------------------------------------------

def mask_mul_inf_attend(q, k, v, visible, scale):
    """Causal mask built as ``triu(ones) * -inf`` and added to the scores.

    Review notes: "you use torch.ones(...) * -inf then add it to scores; the lower triangle
    becomes 0 * -inf = NaN, so scores contain NaN and softmax spreads it everywhere."
    """
    group = q.shape[0] // k.shape[0]                                # q (H, Lq, D), k, v (H_kv, Lk, D)
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = q @ k.transpose(-1, -2) * scale                        # (H, Lq, Lk)
    mask = (~visible).to(scores.dtype) * float("-inf")              # 1 * -inf = -inf, but 0 * -inf = NaN
    return F.softmax(scores + mask, dim=-1) @ v                     # (H, Lq, D)


class RepeatedKVAttention(Attention):
    """GQA attention that repeats K/V to the query head count *before* writing them to the cache.

    Review notes: "you repeat_interleave k/v to match Q heads, then return (k, v) as cache ... That will
    explode KV size". The answers stay right (a repeated head holds the same numbers); its cache
    layout has ``H`` heads per token instead of ``H_kv``, so with a fixed ``num_kv_blocks``
    ``llm.stats()["kv_cache_bytes"]`` is ``H / H_kv`` times larger (with a fixed memory budget,
    the cache holds ``H / H_kv`` times fewer tokens).
    """

    @staticmethod
    def kv_cache_shape(num_blocks, block_size, num_heads, num_kv_heads, head_dim):
        return (num_blocks, block_size, num_heads, head_dim)        # a slot per query head

    def forward(self, q, k, v, kv_cache, meta):
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (T, H, D), cached so
        return super().forward(q, k, v, kv_cache, meta)


# --- RoPE ------------------------------------------------------------------------------------

def no_rope_apply(q, k, cos, sin):
    """RoPE never applied: the model is blind to token order.

    Review notes: "your attention.py only does plain dot-product attention, with no rotary
    position embedding applied to q/k."
    """
    return q, k


def rope_layout_apply(q, k, cos, sin):
    """RoPE that rotates interleaved pairs (x0, x1), (x2, x3), ... with HF's cos/sin, made for halves.

    Review notes: "rotary_emb returns cos/sin, you assume [B, S, D] and that it broadcasts ... relying on
    broadcasting happening to line up produces silent errors" (靠"广播刚好对上"会产生 silent 错误).
    Here the shapes do line up: cos/sin ``(T, 1, D)`` broadcast over q ``(T, H, D)`` for every batch.
    The layout of D does not: HF's table is ``cat(freqs, freqs)``, which pairs x_i with x_{i + D/2}
    (``rotate_half``, GPT-NeoX style); this is the GPT-J / Meta LLaMA rotation, written for a table
    of repeated pairs ``(f0, f0, f1, f1, ...)``. Position 0 (cos 1, sin 0) still comes out right,
    every later one is mixed wrongly, and nothing raises.
    """
    def rotate_pairs(x):                                            # (x0, x1, x2, ...) -> (-x1, x0, -x3, ...)
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                   # (T, 1, D)
    return q * cos + rotate_pairs(q) * sin, k * cos + rotate_pairs(k) * sin


# --- sharding --------------------------------------------------------------------------------

class _NarrowsDim1:
    """A checkpoint tensor whose ``narrow(0, start, rows)`` (out_features, right) cuts dim 1 instead.

    The rank takes the same fraction of the *input* columns, ``(out, in * rows / out)``, and forces it
    into its ``(rows, in)`` shard: the element counts agree, so a reshape fits it with no error."""

    def __init__(self, loaded):
        self.loaded, self.shape = loaded, tuple(loaded.shape)

    def narrow(self, dim, start, rows):
        if len(self.shape) == 1:                                    # a bias has no dim 1: sharded right
            return self.loaded.narrow(dim, start, rows)
        full, cols_in = self.shape                                  # (out_features, in_features)
        cols = cols_in * rows // full                               # this rank's fraction, of the wrong dim
        part = materialize(self.loaded.narrow(1, start * cols_in // full, cols))   # (full, cols)
        return part.reshape(rows, cols_in)                          # forced into the (rows, in) shard


class Dim1QKVParallelLinear(QKVParallelLinear):
    """Fused q|k|v whose loader narrows the checkpoint on dim 1 (in_features), not dim 0.

    Review notes: "你当前的 loader 假设 fused QKV 的格式是 [hidden_size, (Q+K+V)*head_size]，然后按 dim=1 切分
    ... HuggingFace/PyTorch 的 nn.Linear.weight 标准形状是 [out_features, in_features]": a
    column-parallel layer must cut dim 0, the outputs. At TP 1 a narrow takes the whole tensor, so
    the model is exact and the mistake hides; at TP 2 each rank holds input columns reshaped into
    rows: it loads without an error and is wrong from the first attention on."""

    def weight_loader(self, param, loaded, shard_id):
        super().weight_loader(param, _NarrowsDim1(loaded), shard_id)


class Dim1MergedColumnParallelLinear(MergedColumnParallelLinear):
    """gate_proj | up_proj narrowed on dim 1, as ``Dim1QKVParallelLinear``.

    Review notes: "并且在 _shard_weight 里也是沿着 dim=1 narrow 来切分": the student's shared helper
    cut dim 1 for every column-parallel weight."""

    def weight_loader(self, param, loaded, shard_id):
        super().weight_loader(param, _NarrowsDim1(loaded), shard_id)


# --- positions -------------------------------------------------------------------------------

def offby1_token_positions(seq):
    """Decode positions one ahead of the cache: the new token gets ``len(seq)``, not ``len(seq) - 1``.

    Review notes: "cache 的长度必须严格等于'当前 position'所代表的历史长度，否则 attention 会看错位置"
    (the cache length must strictly equal the current position), with the asserts it asked for:
    ``assert k_cache.shape[2] == position_ids.item()``. ``build_metadata`` is that assert, so
    generate raises a ValueError naming the position and the cache length. To see what the wrong
    position does to the numbers without the check, call ``decode_with_positions``.
    """
    positions = token_positions(seq)
    if not seq.output_token_ids:                                    # prefill: right
        return positions
    return [p + 1 for p in positions]                               # decode: len(seq), new token included


_models: dict[str, torch.nn.Module] = {}   # decode_with_positions is called in a loop: one model per folder


def decode_with_positions(model_dir, prompt: list[int], position_shift: int = 1) -> torch.Tensor:
    """Logits ``(vocab,)`` of decoding ``prompt[-1]`` at position ``len(prompt) - 1 + position_shift``.

    Prefills ``prompt[:-1]``, then decodes the last token with its K/V in the right cache slot but
    RoPE at the shifted position: what ``decode_position_offby1`` would compute if the engine did
    not stop it. ``position_shift=0`` gives HF's logits for the last prompt token (TP 1, CPU).
    """
    key = str(model_dir)
    model = _models.get(key) or _models.setdefault(key, load_model(key))
    n = len(prompt)
    prefill = probe(model, prompt[:-1], max_len=n)
    return probe(model, prompt[-1:], positions=[n - 1 + position_shift], cache=prefill.cache).logits[0]


# --- loading ---------------------------------------------------------------------------------

class UnloadedLMHead(ParallelLMHead):
    """An LM head that computes logits with a weight nothing ever loads or ties: all zeros.

    Review notes: "weight_loader.py 在没有 safetensors 的情况下会用 AutoModel.from_pretrained 加载 state_dict。
    这通常不包含 lm_head ... logits head 没正确加载/没 tie embedding，就很容易出现'永远偏向某个
    token'的坍缩" (AutoModel has no lm_head; a head neither loaded nor tied locks generation onto
    one token). Its ``weight`` is tied or loaded as usual, but ``forward`` uses ``unloaded``, which
    keeps its initial value. Every logit is 0: greedy picks token 0 forever at logprob
    ``-log(vocab)``, and no error, since nothing checks the head that is actually used."""

    def __init__(self, num_embeddings, embedding_dim, tp_rank=None, tp_size=None):
        super().__init__(num_embeddings, embedding_dim, tp_rank=tp_rank, tp_size=tp_size)
        self.register_buffer("unloaded", self.initial_weight(), persistent=False)

    def initial_weight(self) -> torch.Tensor:
        return torch.zeros_like(self.weight)

    def forward(self, hidden, gather_output: bool = True):
        logits = linear(hidden, self.unloaded)                      # not self.weight: (N, per_rank)
        return self.gather(logits) if gather_output else logits


def full_load_per_rank_load(model, model_dir, skip=frozenset()) -> LoadReport:
    """Every rank reads the whole checkpoint, then narrows in memory.

    Review notes: "load_and_shard_state_dict currently loads the full state dict on every rank ...
    memory-wise you still hold full tensors in wrapper.state_dict on each rank" (每 rank load 全量
    state_dict, 不影响正确性). The answers are right; I/O and peak memory are not (each rank's peak
    holds the whole checkpoint on top of its shard): ``elements_read`` is the whole checkpoint on
    every rank, against about ``1 / tp_size`` of it with ``tplab.models.loader.load_weights``,
    which reads slices (``safe_open(...).get_slice``)."""
    from safetensors.torch import load
    params, names, elements_read = dict(model.named_parameters()), set(), 0
    for path in checkpoint_files(model_dir):
        # Every tensor, whole, in this rank's memory, as torch.load / AutoModel's state dict would be
        # (safetensors.torch.load_file would map the file instead and hide the cost).
        state_dict = load(path.read_bytes())
        elements_read += sum(t.numel() for t in state_dict.values())
        for name, tensor in state_dict.items():
            if name not in skip:
                param_name, shard_id = param_for(model, name)
                param = params[param_name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
                names.add(name)
    return LoadReport(names, elements_read)


# --- the registry ----------------------------------------------------------------------------

# name -> {field of tplab.Parts: replacement}
_BUGS = {
    "mask_mul_inf": {"attend": mask_mul_inf_attend},
    "no_rope": {"apply_rope": no_rope_apply},
    "rope_layout": {"apply_rope": rope_layout_apply},
    "shard_dim1": {"qkv_linear": Dim1QKVParallelLinear, "gate_up_linear": Dim1MergedColumnParallelLinear},
    "kv_cache_repeated": {"attention": RepeatedKVAttention},
    "decode_position_offby1": {"positions": offby1_token_positions},
    "lm_head_missing": {"lm_head": UnloadedLMHead},
    "full_load_per_rank": {"load_weights": full_load_per_rank_load},
}
for _name, _replacements in _BUGS.items():
    parts.register(_name, **_replacements)
NAMES = tuple(_BUGS)


def describe(name: str) -> str:
    """The pitfall a bug reproduces (its replacement's docstring)."""
    if name not in _BUGS:
        raise ValueError(f"unknown bug name {name!r}; known: {list(NAMES)}")
    return next(iter(_BUGS[name].values())).__doc__.strip()
