"""Where a decode step's time goes: torch.profiler over decode steps only (prefill excluded), tplab TP 1
against HF ``generate`` on the same checkpoint, same process, same threads; plus cProfile of tplab's
Python side.

    .venv/bin/python bench/profile_decode.py [--quick] [--steps 8] [--rows 25] [--threads N] [--compile] [--batch B]
        [--dtype D] [--vllm-attention] [--vllm-gemm] [--max-num-seqs N]

``--batch B`` decodes B requests together (B prompts of the same length, so HF needs no padding).

``--compile`` profiles tplab's compiled path (``LLM(compile=True)``): its fused C++ loops show as
``## Call CompiledFxGraph`` rows, the matmuls and attention as ``tplab::linear`` / ``tplab::attention``.

The profiler is started at the second forward of a generate call (the first one is the prefill) and
stopped when the call returns, so the tables cover ``steps`` decode steps. tplab is not modified: the
runner's ``step`` and HF's ``forward`` are wrapped on the instances.
"""
import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from common import Settings, checkpoint, inproc_engine, prompt_ids  # noqa: E402
from decode import load_hf  # noqa: E402


class DecodeOnly:
    """Wraps a per-step callable: starts ``prof`` at the step after the first, and times every step."""

    def __init__(self, fn, prof):
        self.fn, self.prof, self.calls, self.step_times, self.on = fn, prof, 0, [], False

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 2 and self.prof is not None:
            self.prof.start()
            self.on = True
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        if self.calls >= 2:
            self.step_times.append(time.perf_counter() - t0)
        return out

    def stop(self):
        if self.on:
            self.prof.stop()
            self.on = False


def profiled(install, call, steps):
    """Run ``call(steps + 1)`` (1 prefill + steps decodes) under a decode-only profiler."""
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    wrapper = install(lambda fn: DecodeOnly(fn, prof))
    try:
        call(steps + 1)
    finally:
        wrapper.stop()
    return prof, wrapper.step_times


def timed_only(install, call, steps):
    wrapper = install(lambda fn: DecodeOnly(fn, None))
    call(steps + 1)
    return wrapper.step_times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the cores)")
    ap.add_argument("--compile", action="store_true", help="tplab with compile=True (tplab.engine.compiled)")
    ap.add_argument("--batch", type=int, default=1, help="requests decoded together")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both engines' dtype")
    ap.add_argument("--vllm-attention", action="store_true", help="tplab with VllmCpuAttention")
    ap.add_argument("--vllm-gemm", action="store_true", help="tplab with VllmCpuGemm")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="tplab's max_num_seqs (1: an engine of one sequence, whose fp32 weights stay plain on AMD)")
    args = ap.parse_args()
    s = Settings.make(args.quick, args.threads)
    torch.set_num_threads(s.threads)
    ckpt = checkpoint(s)
    from tplab import LLM

    prompts = [prompt_ids(s.prompt_len, seed=1 + i) for i in range(args.batch)]
    hf = load_hf(ckpt, getattr(torch, args.dtype))
    parts = {}
    if args.vllm_attention:
        from tplab.kernels.vllm_attention import VllmCpuAttention
        parts["attention"] = VllmCpuAttention
    if args.vllm_gemm:
        from tplab.kernels.vllm_gemm import VllmCpuGemm
        parts["gemm"] = VllmCpuGemm
    llm = LLM(ckpt, tensor_parallel_size=1, dtype=args.dtype, kv_cache_memory=256 << 20, compile=args.compile,
              parts=parts, **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}))
    runner = inproc_engine(llm).runner

    def install_tplab(make):
        w = make(type(runner).step.__get__(runner))
        runner.step = w
        return w

    def install_hf(make):
        w = make(type(hf).forward.__get__(hf))
        hf.forward = w
        return w

    def call_tplab(n):
        from tplab import SamplingParams
        return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))

    def call_hf(n):
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                               min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    call_tplab(2), call_hf(2)  # warm-up

    # plain per-step times first (no profiler overhead), interleaved
    plain = {"tplab": [], "hf": []}
    for _ in range(2):
        plain["tplab"] += timed_only(install_tplab, call_tplab, args.steps)
        plain["hf"] += timed_only(install_hf, call_hf, args.steps)
    med = {k: sorted(v)[len(v) // 2] for k, v in plain.items()}
    print(f"# {s.name}, {s.threads} torch threads, {args.batch} prompt(s) of {s.prompt_len}{', tplab compiled' * args.compile}, "
          f"{args.dtype}{', VllmCpuAttention' * args.vllm_attention}{', VllmCpuGemm' * args.vllm_gemm}")
    print(f"# decode step, no profiler (median of {len(plain['tplab'])} steps): "
          f"tplab {med['tplab'] * 1e3:.1f} ms, HF {med['hf'] * 1e3:.1f} ms (HF step = its forward only)\n")

    for name, install, call in (("tplab TP1", install_tplab, call_tplab), ("HF generate", install_hf, call_hf)):
        prof, step_times = profiled(install, call, args.steps)
        total = sum(step_times)
        print(f"## {name}: {len(step_times)} decode steps, {total * 1e3 / len(step_times):.1f} ms/step under the profiler")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        print(f"## {name}: by input shape (top {args.rows // 2})")
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total",
                                                                  row_limit=args.rows // 2, max_name_column_width=40,
                                                                  max_shapes_column_width=60))

    # cProfile of the tplab decode steps: the Python functions
    pr = cProfile.Profile()
    wrapper = install_tplab(lambda fn: DecodeOnly(fn, None))
    orig = wrapper.fn

    def step_profiled(*a, **k):
        if wrapper.calls >= 1:
            pr.enable()
            try:
                return orig(*a, **k)
            finally:
                pr.disable()
        return orig(*a, **k)
    wrapper.fn = step_profiled
    call_tplab(args.steps + 1)
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(args.rows)
    print(f"## tplab TP1 cProfile of {args.steps} decode steps (tottime)")
    print(out.getvalue())
    llm.shutdown()


if __name__ == "__main__":
    main()
