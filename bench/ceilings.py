"""What the kernels torch offers allow on this machine: the ceilings under the ``peers.py`` rows that stay
below their targets, each measured side by side with what it bounds, in one run:

    .venv/bin/python bench/ceilings.py [--quick] [--rounds 5] [--only gemm,shapes,bf16,attention]

1. **gemm**: the layers' weight matrices of Qwen2.5-0.5B's shape (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
   ``down_proj``; 24 layers; fp32), each set through each fp32 kernel torch has for it: oneDNN on the layout
   tplab packs for it (``Gemm.packed``), oneDNN on the plain layout, ``F.linear`` (MKL where torch is built
   with it) and, at one row, ``torch.mv``; at 1, 16 and 512 rows. Beside each, GB/s and the fraction of the
   read bandwidth that the decode rows' bound uses (``x.sum()`` over 1 GiB, measured in the same rounds).
   The weights are allocated plain first, then packed: on the Xeon VM of docs/performance.md weights allocated
   later in a process streamed up to ~15% faster (bench/README.md, "Build order"), a bias that favours
   the packed layout here.
2. **shapes**: each of a layer's four matrix shapes alone (every layer's copy of it), fp32, at 1, 2, 4 and 16 rows:
   oneDNN packed, oneDNN plain, ``F.linear``. The table behind ``Gemm.few_rows_mkl``: which shapes MKL wins at
   one or two rows, and what keeping them plain costs a batch.
3. **bf16**: the same matrices in bf16 at one row: oneDNN packed (tplab's bf16 path), ``torch.mv`` on the
   plain layout, and their speed-up over fp32's fastest kernel in the same round: the ceiling of bf16/fp32
   at batch 1, which halving the bytes would make 2.0 if the kernels streamed as fast as fp32's.
   ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` (or another level) in the environment caps the instructions
   oneDNN may use, to compare its AMX and AVX-512 kernels.
4. **attention**: a decode step's attention for the 16-request row (16 sequences of 49-289 keys, 14 query
   heads on 2 KV heads, blocks of 16 scattered over the cache), one layer's cache after another, each evicted
   first by a 60 MB read (a decode step streams its layer's weights between two attentions):
   tplab's ``paged_decode``, and the two ``index_select``s that gather the KV blocks alone. The gather is
   the share of the paged formulation that only a fused kernel (reading the blocks where they lie) avoids.

Ratios are medians over rounds of per-round ratios (``common.paired``); the rounds alternate the kernels,
the order reversed every other round. Not part of CI.
"""
import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import (QUICK_SHAPE, QWEN25_05B, Settings, interleaved, layer_shapes, machine, median, paired,  # noqa: E402
                    set_threads)
from tplab.kernels.gemm import Gemm  # noqa: E402
from tplab.kernels.paged_decode import paged_decode  # noqa: E402
from tplab.kernels.decode_blocks import decode_blocks  # noqa: E402


def kernels(shape: dict, dtype: torch.dtype, rows: int) -> tuple[dict, int]:
    """``{kernel: callable running every layer's matrices at ``rows`` rows}`` and the weights' bytes."""
    layers = shape["num_hidden_layers"]
    plain = {n: [torch.randn(o, i).mul_(0.02).to(dtype) for _ in range(layers)]
             for n, (o, i) in layer_shapes(shape).items()}
    xs = {i: torch.randn(rows, i).to(dtype) for _, i in layer_shapes(shape).values()}   # one input per width
    nbytes = sum(w.numel() * w.element_size() for ws in plain.values() for w in ws)
    # what this machine does in dtype, as tplab; oneDNN for every row count (MKL is its own column)
    gemm = Gemm.choose(onednn=True, pack=True, dtype=dtype, few_rows_mkl=False)
    flat = [(xs[w.shape[1]], w) for ws in plain.values() for w in ws]
    fns = {}
    if gemm.pack:
        packed = [(x, gemm.packed(w)) for x, w in flat]
        fns["oneDNN packed"] = lambda: [gemm.linear(x, w) for x, w in packed]
    if gemm.onednn:
        fns["oneDNN plain"] = lambda: [gemm.linear(x, w) for x, w in flat]
    fns["F.linear"] = lambda: [F.linear(x, w) for x, w in flat]
    if rows == 1:
        fns["torch.mv"] = lambda: [torch.mv(w, x[0]) for x, w in flat]
    return fns, nbytes              # a kernel oneDNN does not offer here for dtype is left out


def read_sum(gib: float):
    """A callable reading ``gib`` GiB once (``x.sum()``), and the bytes it reads."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    return (lambda: x.sum()), x.numel() * 4


def gemm(shape, rounds, gib) -> None:
    read, read_bytes = read_sum(gib)
    print("\n## gemm: the layers' matrices, fp32, every kernel, ms (median) and GB/s")
    for rows in (1, 16, 512):
        fns, nbytes = kernels(shape, torch.float32, rows)
        fns["read (x.sum)"] = read
        t = interleaved(fns, rounds if rows < 512 else max(2, rounds // 2))
        bw = [read_bytes / s for s in t.pop("read (x.sum)")]
        best = min(t, key=lambda k: median(t[k]))
        print(f"\n{rows} row(s), {nbytes / 1e9:.2f} GB of weights; read bandwidth {median(bw) / 1e9:.1f} GB/s")
        print("| kernel | ms | GB/s | fraction of the read bandwidth | time / fastest |\n|---|---|---|---|---|")
        for k, v in t.items():
            frac = median([nbytes / s / b for s, b in zip(v, bw)])
            print(f"| {k} | {median(v) * 1e3:.1f} | {nbytes / median(v) / 1e9:.1f} | {frac:.2f} "
                  f"| {paired(v, t[best]):.2f} |")
        del fns


def shapes(shape, rounds) -> None:
    """Each of a layer's matrix shapes alone (all layers' copies of it), through each fp32 kernel, at few rows and
    at 16: where MKL's few-row product wins and what the plain layout costs a batch (``Gemm.few_rows_mkl``)."""
    print("\n## shapes: each of a layer's matrices (every layer's copy), fp32, ms (median)")
    gemm = Gemm.choose(onednn=True, pack=True, few_rows_mkl=False)     # oneDNN at any rows; MKL its own column
    if not gemm.pack:
        print("(no oneDNN packing here: nothing to compare)")
        return
    layers = shape["num_hidden_layers"]
    weights = {n: [torch.randn(o, i).mul_(0.02) for _ in range(layers)] for n, (o, i) in layer_shapes(shape).items()}
    packed = {n: [gemm.packed(w) for w in ws] for n, ws in weights.items()}
    print("| matrices | rows | oneDNN packed | oneDNN plain | F.linear (MKL) |\n|---|---|---|---|---|")
    for rows in (1, 2, 4, 16):
        for name, ws in weights.items():
            x = torch.randn(rows, ws[0].shape[1])
            t = interleaved({"packed": lambda: [gemm.linear(x, w) for w in packed[name]],
                             "plain": lambda: [gemm.linear(x, w) for w in ws],
                             "mkl": lambda: [F.linear(x, w) for w in ws]}, rounds)
            print(f"| {name} | {rows} | " + " | ".join(f"{median(v) * 1e3:.2f}" for v in t.values()) + " |")


def bf16(shape, rounds) -> None:
    print("\n## bf16: the layers' matrices at one row, against fp32's fastest kernel in the same rounds")
    f32, b32 = kernels(shape, torch.float32, 1)
    f16, b16 = kernels(shape, torch.bfloat16, 1)
    fns = {f"fp32 {k}": f32[k] for k in ("oneDNN packed", "F.linear") if k in f32}
    fns.update({f"bf16 {k}": f16[k] for k in ("oneDNN packed", "torch.mv", "F.linear") if k in f16})
    t = interleaved(fns, rounds)
    fp32_best = [min(r) for r in zip(*(v for k, v in t.items() if k.startswith("fp32")))]
    print("| kernel | ms | GB/s | fp32's fastest / this |\n|---|---|---|---|")
    for k, v in t.items():
        nbytes = b32 if k.startswith("fp32") else b16
        print(f"| {k} | {median(v) * 1e3:.1f} | {nbytes / median(v) / 1e9:.1f} | {paired(fp32_best, v):.2f} |")


def attention(shape, rounds, quick) -> None:
    h, hkv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d, bs, layers = shape["hidden_size"] // h, 16, shape["num_hidden_layers"]
    lens = [(4 if quick else 16) * (1 + i) + (i % 3) * 5 + 33 for i in range(16)]
    need = [-(-n // bs) for n in lens]
    nblk = sum(need) + 16
    rng = random.Random(0)
    order = rng.sample(range(nblk), nblk)                      # blocks scattered over the cache
    tables = [order[sum(need[:b]):sum(need[:b + 1])] for b in range(16)]
    dec = decode_blocks([1] * 16, lens, tables, bs, "cpu")
    caches = [(torch.randn(nblk, bs, hkv, d), torch.randn(nblk, bs, hkv, d)) for _ in range(layers)]
    q = torch.randn(16, h, d)
    evict, _ = read_sum(60 / 1024)

    def per_layer(fn):
        def run():
            spent = 0.0
            for k, v in caches:
                evict()
                t0 = time.perf_counter()
                fn(k, v)
                spent += time.perf_counter() - t0
            return spent / layers
        return run

    fns = {"paged_decode": per_layer(lambda k, v: paged_decode(q, k, v, dec, d ** -0.5)),
           "the KV gather alone": per_layer(lambda k, v: (k.index_select(0, dec.blocks),
                                                          v.index_select(0, dec.blocks)))}
    spent = {k: [] for k in fns}
    for r in range(rounds + 1):                                 # round 0 warms up
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            s = fns[k]()
            if r:
                spent[k].append(s)
    kv_bytes = 2 * len(dec.blocks) * bs * hkv * d * 4
    print(f"\n## attention: one decode step's, 16 sequences of {min(lens)}-{max(lens)} keys, {len(dec.blocks)} blocks"
          f" of {bs}, the layer's cache evicted first; per layer")
    print("| what | us a layer | share of paged_decode |\n|---|---|---|")
    for k, v in spent.items():
        print(f"| {k} | {median(v) * 1e6:.0f} | {paired(v, spent['paged_decode']):.2f} |")
    print(f"(the blocks hold {kv_bytes / 1e6:.2f} MB of K and V a layer)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a small shape: checks the script")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default="gemm,shapes,bf16,attention")
    args = ap.parse_args()
    shape = QUICK_SHAPE if args.quick else QWEN25_05B
    set_threads(Settings.make(args.quick).threads)                  # the cores, as every bench item
    print(f"# {machine()}, {torch.get_num_threads()} torch threads")
    only = set(args.only.split(","))
    with torch.inference_mode():
        if "gemm" in only:
            gemm(shape, args.rounds, 0.25 if args.quick else 1.0)
        if "shapes" in only:
            shapes(shape, args.rounds)
        if "bf16" in only:
            bf16(shape, args.rounds)
        if "attention" in only:
            attention(shape, args.rounds, args.quick)


if __name__ == "__main__":
    main()
