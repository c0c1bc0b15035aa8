"""How close tplab must be to Hugging Face's own model, in one place, and why.

tplab and HF compute the same sums in another order (other kernels, another split over threads, partial
sums added across ranks at TP > 1). Each order is exact to the dtype's ``eps`` *relative to the size of the
numbers summed*, and the differences grow a little with every layer. So the bound is relative: an
activation may differ from HF's by at most ``RTOL[dtype] * max|HF's activation|``; an absolute bound is too
loose for the first layers' small activations, too tight for a deep model's logits, and moves a check from
pass to fail on another CPU. fp32: 1024 eps, several times the worst a correct engine reaches, and a bug that
changes a prefill's numbers is a thousand times over it (``bench/tolerance.py`` measures both; docs/numerics.md).
bf16 (tplab's bf16 against HF's): 1 bf16 eps, for log-probabilities (``logprob_bound``) only: bf16 rounds every
stored activation, not only the sums, so a correct TP 2 engine's activations are a couple of bf16 steps off.
"""
import torch

EPS = {torch.float32: torch.finfo(torch.float32).eps, torch.bfloat16: torch.finfo(torch.bfloat16).eps}
RTOL = {torch.float32: 1024 * EPS[torch.float32],       # 1.2e-4 of the activation's largest magnitude
        torch.bfloat16: EPS[torch.bfloat16]}             # 7.8e-3
# The share of greedy tokens that must equal HF's. fp32: all. bf16: 90%, since two bf16 engines round in
# other places and a near-tie between two tokens can go either way (then the continuations differ); on a
# GPU, the attention kernels SDPA picks may also differ from run to run in the order they sum.
TOKEN_AGREEMENT = {torch.float32: 1.0, torch.bfloat16: 0.9}


def _dtype(dtype) -> torch.dtype:
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if dtype not in RTOL:
        raise ValueError(f"no tolerance for {dtype}; known: {[str(d) for d in RTOL]}")
    return dtype


def bound(ref: torch.Tensor, dtype=torch.float32) -> float:
    """How far an activation may be from HF's ``ref``: ``RTOL[dtype] * max|ref|``."""
    return RTOL[_dtype(dtype)] * float(ref.detach().float().abs().max()) if ref.numel() else 0.0


def logprob_bound(logits, dtype=torch.float32) -> float:
    """How far a log-probability may be from HF's, given HF's logits (or their largest magnitude).

    ``log_softmax(z)_i = z_i - logsumexp(z)``: an error of at most ``d`` in every logit moves it by at
    most ``2 d``, and the logits may be off by ``bound(logits)``."""
    scale = float(logits.detach().float().abs().max()) if isinstance(logits, torch.Tensor) else float(logits)
    return 2 * RTOL[_dtype(dtype)] * scale


def max_abs(mine: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |mine - ref|`` of two tensors of one shape: inf where ``mine`` holds a NaN or an inf (so it is
    never within a bound), 0 for empty tensors."""
    mine, ref = mine.detach().float().cpu(), ref.detach().float().cpu()
    if not mine.numel():
        return 0.0
    if not torch.isfinite(mine).all():
        return float("inf")
    return float((mine - ref).abs().max())


def within(mine: torch.Tensor, ref: torch.Tensor, dtype=torch.float32) -> bool:
    """True when ``mine`` has ``ref``'s shape and is within ``bound(ref)`` of it everywhere."""
    return mine.shape == ref.shape and max_abs(mine, ref) <= bound(ref, dtype)
