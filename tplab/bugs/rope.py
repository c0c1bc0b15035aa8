"""RoPE pitfalls: no rotation, the wrong pairing of D, cos/sin on the wrong axis, an exception swallowed.

Each replaces ``Parts.apply_rope(q, k, cos, sin)``: q ``(T, H, D)``, k ``(T, H_kv, D)`` (this rank's heads),
cos/sin ``(T, D)``, one row per token of the step.
"""
import torch

from tplab.layers.rotary import rotate_half


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
    They warned about shapes; this layout of D is not in them. Here the shapes do line up: cos/sin
    ``(T, 1, D)`` broadcast over q ``(T, H, D)`` for every batch.
    The layout of D does not: HF's table is ``cat(freqs, freqs)``, which pairs x_i with x_{i + D/2}
    (``rotate_half``, GPT-NeoX style); this is the GPT-J / Meta LLaMA rotation, written for a table
    of repeated pairs ``(f0, f0, f1, f1, ...)``. Position 0 (cos 1, sin 0) still comes out right,
    every later one is mixed wrongly, and nothing raises.
    """
    def rotate_pairs(x):                                            # (x0, x1, x2, ...) -> (-x1, x0, -x3, ...)
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                   # (T, 1, D)
    return q * cos + rotate_pairs(q) * sin, k * cos + rotate_pairs(k) * sin


def rope_cos_sin_axis_apply(q, k, cos, sin):
    """cos/sin ``(T, D)`` multiplied into q ``(T, H, D)`` and k ``(T, H_kv, D)`` with no head axis.

    Review notes: "你现在没有显式把 cos/sin reshape 到 apply_rotary_pos_emb 期望的 layout，靠'广播刚好对上'
    会产生 silent 错误，最终表现为生成胡言乱语但不报错" (cos/sin never reshaped to the layout the rotation
    expects; relying on broadcasting happening to line up gives silent errors: gibberish, no error).
    Broadcasting aligns shapes from the right, so cos ``(T, D)`` acts as ``(1, T, D)``: its *token* axis
    meets the *head* axis. What happens depends on the step's token count T and this rank's head counts,
    that is on the prompt and on the TP size:

    - ``T == 1`` (a decode step of one sequence): one cos row fits every head. Right, by luck.
    - ``T == H == H_kv`` (e.g. a 4-token prompt at TP 2 on 8 query and 8 KV heads): it broadcasts, and head
      h of every token is rotated by token h's angle. Silently wrong.
    - ``T == H != H_kv``: q is rotated as above, and k's multiply raises, except with ``H_kv == 1`` (one KV
      head per rank), where k grows to ``(T, T, D)`` and the KV-cache write raises instead.
    - any other ``T != H``: a RuntimeError in q's multiply, except with ``H == 1`` (one query head per rank,
      e.g. the tiny model at TP 4), where q and k both grow to ``(T, T, D)`` and the KV-cache write raises.
    """
    def rotate(x):                                                  # (T, heads, D) * (T, D): tokens vs heads
        return x * cos + rotate_half(x) * sin
    return rotate(q), rotate(k)


def rope_swallowed_apply(q, k, cos, sin):
    """RoPE in a try/except that falls back to no rotation when the shapes disagree.

    Review notes: "HybridTPDecoderLayer 里仍然有一个'吞 RoPE 异常'的备用逻辑（建议移除）... 避免出现
    'RoPE 没生效但你以为生效'的情况" (a fallback that swallows RoPE's exception: remove it, or RoPE silently
    does nothing while you believe it works). The rotation inside the ``try`` is
    ``rope_cos_sin_axis_apply``: whenever it raises (or would change a shape), q and k come back unrotated.
    A one-token decode step rotates correctly, so decode looks fine, while a prompt's keys are cached
    unrotated (or, where ``T == H == H_kv`` and the rotation runs without raising, rotated by the wrong
    token's angle): wrong at any TP size, and nothing ever raises.
    """
    try:
        q_rot, k_rot = rope_cos_sin_axis_apply(q, k, cos, sin)
        if q_rot.shape != q.shape or k_rot.shape != k.shape:      # would fail in the cache write
            raise RuntimeError(f"RoPE changed the shapes {tuple(q.shape)}, {tuple(k.shape)}")
        return q_rot, k_rot
    except RuntimeError:
        return q, k                                                 # "RoPE failed, carry on without it"
