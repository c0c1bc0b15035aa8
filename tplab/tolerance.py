"""How close tplab must be to Hugging Face's Qwen2, in one place, and why.

tplab and HF compute the same sums in another order: oneDNN's packed matmuls against MKL's (or
OpenBLAS's), another split of the work over threads, partial sums added across ranks at TP > 1. Each
order is exact to the dtype's rounding, ``eps`` (float32: 2**-23, about 1.2e-7), *relative to the size of
the numbers summed*, and the differences grow a little with every layer they pass through. So the bound
is relative: an activation may differ from HF's by at most ``RTOL[dtype] * max|HF's activation|``. An
absolute bound (the 1e-4 this replaces) is too loose for the small activations of the first layers and
too tight for the logits of a deep model, whose size grows with depth; and it is what moves a check
from pass to fail on another CPU.

Measured (``bench/tolerance.py``, 17 tokens; 2-core AMD EPYC, default kernels and with
``TPLAB_ONEDNN=0`` on one thread): the shipped tiny model's worst activation is 9-13 eps off HF at TP
1, 2 and 4 (0 at TP 1 with oneDNN off: the same kernels in the same order are bitwise HF's); random
checkpoints of the tests' shapes 7-17 eps, 8 layers 38-55 eps, 24 layers 107-134 eps, always in an
attention output, where values that nearly cancel leave a small result. ``RTOL`` is 1024 eps: 7x the
24-layer model, 80x the tiny one. A real bug is far over it (the same script): a decode position one
ahead 1.1e3 times, no RoPE or RoPE in the wrong layout 3e3, a missing or random LM head 8e3, q/k/v
sharded on dim 1 1.3e4, the ``* -inf`` mask NaN (infinitely).

bfloat16 runs compare tplab in bf16 with HF in bf16: the same reasoning with bf16's eps (2**-7), and a
far smaller multiple, since bf16 rounds every stored activation, not only the sums, so the two engines
differ by whole bf16 steps wherever they round in another place (``RTOL[bfloat16]``: 1 eps; the logprobs
of the shipped model, ``tests/test_bf16.py``, stay within it).
"""
import torch

EPS = {torch.float32: torch.finfo(torch.float32).eps, torch.bfloat16: torch.finfo(torch.bfloat16).eps}
RTOL = {torch.float32: 1024 * EPS[torch.float32],       # 1.2e-4 of the activation's largest value
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


def within(mine: torch.Tensor, ref: torch.Tensor, dtype=torch.float32) -> bool:
    """True when ``mine`` is within ``bound(ref)`` of ``ref`` everywhere (a NaN never is)."""
    mine, ref = mine.detach().float().cpu(), ref.detach().float().cpu()
    if mine.shape != ref.shape:
        return False
    return bool((mine - ref).abs().max() <= bound(ref, dtype)) if ref.numel() else True
