"""tplab TP 1 on a GPU against HF ``generate`` on the same GPU: greedy tokens, decode rates against the
weight-streaming bound, memory. tplab as ``LLM(model)`` gives it (decode steps replayed as CUDA graphs), with
``enforce_eager=True`` and with ``compile=True``; HF eager and with its static cache (a compiled forward
replayed as CUDA graphs).

Per dtype, on the 0.5B-shape random checkpoint: batch 1 (a 32-token prompt) and 16 requests of 32 tokens;
decode rate = (n - 1) / (time of an n-token generate - time of a 1-token one), paired rounds, CUDA
synchronised; how many greedy tokens equal HF's from the start. Results go to ``--out`` (default
bench/results/<machine>/gpu.json) after every section, so a run cut off keeps what it measured. Without CUDA it
says so and exits 0; ``--device cpu --quick`` is a dry run. ``--profile PREFIX`` writes the ops of one decode
step per engine. The figures are in docs/performance.md ("On a GPU").
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import (Settings, checkpoint, interleaved, log, machine_info, median, paired, prompt_ids,  # noqa: E402
                    results_path)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Clock:
    """Seconds since the start; ``over`` once ``budget`` is spent (later sections are skipped, and say so)."""

    def __init__(self, budget: float):
        self.t0, self.budget = time.perf_counter(), budget

    @property
    def over(self) -> bool:
        return time.perf_counter() - self.t0 > self.budget


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def hf_runner(model, device):
    def run(prompts, n):
        ids = torch.tensor(prompts, device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=0, eos_token_id=None)
        sync(device)
        return out[:, ids.shape[1]:].tolist()
    return run


def tplab_runner(llm, device):
    from tplab import SamplingParams

    def run(prompts, n):
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        sync(device)
        return [o.token_ids for o in outs]
    return run


def decode_rates(runners: dict, prompts, n: int, reps: int) -> dict:
    """``{name: decode tok/s}`` (all rows together), and the paired ratio of each to the first name."""
    fns = {}
    for name, run in runners.items():
        fns[name + ":n"] = lambda run=run: run(prompts, n)
        fns[name + ":1"] = lambda run=run: run(prompts, 1)
    times = interleaved(fns, reps)
    rows = len(prompts) * (n - 1)
    per_round = {k: [rows / (a - b) for a, b in zip(times[k + ":n"], times[k + ":1"])] for k in runners}
    first = next(iter(runners))
    return {k: {"tok_s": median(v), "vs_" + first: paired(v, per_round[first])} for k, v in per_round.items()}


def stream_bandwidth(device) -> float:
    """Bytes per second this device reads: the best of 5 sums over 2 GiB (the bound a decode step's weight
    reads are held to: at batch b it is ``b * bandwidth / weight bytes`` tokens per second)."""
    x = torch.ones(1 << 30, dtype=torch.bfloat16, device=device)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        x.sum()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del x
    return 2 * (1 << 30) / best


def leading_equal(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def memory_of(build, device):
    """``(the object build() returns, bytes it left allocated on the GPU)``; 0 bytes on the CPU."""
    cuda = torch.device(device).type == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0
    obj = build()
    return obj, (torch.cuda.memory_allocated() - before if cuda else 0)


def peak_added(run, device) -> int:
    if torch.device(device).type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    return torch.cuda.max_memory_allocated() - base


def measure(runners: dict, one, batch, args, res: dict, clock: Clock, tag: str, fresh=None) -> None:
    """Tokens against HF's and peak memory of the runners named in ``fresh`` (default: all; a later section
    names only its new one), then the paired decode rates of all of ``runners`` (``"hf"`` first)."""
    if "hf_tokens" not in res:                                   # HF's reference, once per dtype
        res["hf_tokens"] = runners["hf"](one, args.new), runners["hf"](batch, args.new)
    want_one, want_batch = res["hf_tokens"]
    for k in fresh or runners:
        run = runners[k]
        got_one, got_batch = run(one, args.new), run(batch, args.new)
        res.setdefault("tokens", {})[k] = {"batch1_leading_equal": leading_equal(got_one[0], want_one[0]),
                                           "of": args.new, "batch_leading_equal": [
                                               leading_equal(g, w) for g, w in zip(got_batch, want_batch)]}
        res.setdefault("peak_added_bytes", {})[k] = peak_added(lambda run=run: run(batch, args.new), args.device)
    for rows, prompts in (("batch1", one), (f"batch{args.batch}", batch)):
        if clock.over:
            res.setdefault(tag, {})[rows] = "skipped: out of time"
            continue
        res.setdefault(tag, {})[rows] = rates = decode_rates(runners, prompts, args.new, args.reps)
        if res.get("bandwidth_bytes_s"):        # the fraction of the weight-streaming bound each engine reaches
            bound = len(prompts) * res["bandwidth_bytes_s"] / res["weight_bytes"]
            for rate in rates.values():
                rate["of_bound"] = rate["tok_s"] / bound
        log(f"{tag} {rows}: " + ", ".join(f"{k} {v['tok_s']:.1f} tok/s" for k, v in rates.items()))


def host_syncs(run, prompts) -> dict:
    """The operations that made the host wait for the GPU in one decode step of ``prompts`` (CUDA's sync debug
    mode, "warn"): ``{"file:line": count per step}`` over a 9-token generate less a 1-token one, per step,
    after one of each: a graph's capture waits for the GPU once, and is not a step's wait."""
    import collections
    import warnings

    def count(n):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run(prompts, n)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                   if "synchronizing" in str(w.message))
    run(prompts, 9), run(prompts, 1)
    many, one = count(9), count(1)
    return {k: (many[k] - one.get(k, 0)) / 8 for k in many if many[k] != one.get(k, 0)}


def profile_table(run, prompts, device) -> str:
    """torch.profiler over a 9-token generate of ``prompts`` and over a 1-token one (the prefill alone): the
    ops of one decode step as their difference over 8, so a prefill that runs sequence by sequence does not
    hide in it. Calls, own host time and, on a GPU, own device time per step, and kernel launches."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.device(device).type == "cuda"

    def ops(n):
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            run(prompts, n)
        return {e.key: (e.count, e.self_cpu_time_total, getattr(e, "self_device_time_total", 0.0))
                for e in prof.key_averages()}

    nine, one = ops(9), ops(1)
    step = {k: tuple((a - b) / 8 for a, b in zip(v, one.get(k, (0, 0.0, 0.0)))) for k, v in nine.items()}
    lines = [f"{'op (per decode step)':<60} {'calls':>8} {'host us':>10} {'device us':>10}"]
    for k, (n, host, dev) in sorted(step.items(), key=lambda kv: -kv[1][1])[:40]:
        lines.append(f"{k[:60]:<60} {n:>8.1f} {host:>10.1f} {dev:>10.1f}")
    launches = sum(n for k, (n, _, _) in step.items() if k.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
    lines.append(f"kernel launches per decode step: {launches:.0f}; host us per step, all ops' own: "
                 f"{sum(h for _, h, _ in step.values()):.0f}; device us: {sum(d for _, _, d in step.values()):.0f}")
    return "\n".join(lines) + "\n"


def first_calls(run, one, batch, n: int) -> float:
    """Seconds of the first generates, of ``n`` tokens and of 1 (compiling; HF's static cache is sized by them)."""
    t0 = time.perf_counter()
    run(one, n), run(batch, n), run(one, 1), run(batch, 1)
    return time.perf_counter() - t0


def one_dtype(ckpt, name: str, args, clock: Clock, res: dict, save) -> None:
    """Fills ``res``: tplab as it comes (CUDA graphs on a GPU), HF and HF's static cache first; then tplab with
    ``enforce_eager=True``; then tplab compiled, as time allows."""
    from transformers import Qwen2ForCausalLM

    from tplab import LLM
    dtype, dev = DTYPES[name], args.device
    one, batch = [prompt_ids(32)], [prompt_ids(32, seed=s) for s in range(args.batch)]
    kv = dict(kv_cache_memory=args.kv_gib << 30)
    load_hf = lambda: Qwen2ForCausalLM.from_pretrained(ckpt, dtype=dtype).to(dev).eval()  # noqa: E731
    hf, res["hf_weight_bytes"] = memory_of(load_hf, dev)
    llm, res["tplab_bytes_with_kv_cache"] = memory_of(lambda: LLM(str(ckpt), dtype=name, device=dev, **kv), dev)
    res["tplab_kv_cache_bytes"] = llm.stats()["kv_cache_bytes"]
    res["tplab_cuda_graphs"] = llm.config.cuda_graphs                  # the default engine: graphs on CUDA
    eager = LLM(str(ckpt), dtype=name, device=dev, enforce_eager=True, **kv)
    runners = {"hf": hf_runner(hf, dev), "tplab": tplab_runner(llm, dev), "tplab_eager": tplab_runner(eager, dev)}
    res["weight_bytes"] = llm.rank_info[0]["param_bytes"]
    if torch.device(dev).type == "cuda":
        res["bandwidth_bytes_s"] = stream_bandwidth(dev)
        res["host_syncs_per_decode_step"] = {k: host_syncs(run, batch) for k, run in runners.items()}
    if args.profile:
        text = "".join(f"=== {k}, {len(batch)} prompts, {name}\n{profile_table(run, batch, dev)}\n"
                       for k, run in runners.items())
        Path(f"{args.profile}-{name}.txt").write_text(text)
    if args.hf_static:
        try:
            static = load_hf()
            static.generation_config.cache_implementation = "static"
            s = hf_runner(static, dev)
            res["hf_static_first_calls_s"] = first_calls(s, one, batch, args.new)
            measure({"hf": runners["hf"], "hf_static": s, "tplab": runners["tplab"]}, one, batch, args, res, clock,
                    "hf_static")
            del static
            save()
        except Exception as e:                          # noqa: BLE001
            res["hf_static_error"] = f"{type(e).__name__}: {e}"[:600]
    if not clock.over:
        fresh = [k for k in runners if k not in res.get("tokens", {})]       # tokens and peaks once per runner
        measure(runners, one, batch, args, res, clock, "eager", fresh=fresh)
        save()
    if args.compile and not clock.over:
        try:
            compiled = LLM(str(ckpt), dtype=name, device=dev, compile=True, **kv)     # graphs too, on CUDA
            c = tplab_runner(compiled, dev)
            res["tplab_compiled_first_calls_s"] = first_calls(c, one, batch, args.new)
            res["tplab_compiled_forwards"] = compiled.stats().get("compiled_forwards")
            measure({"hf": runners["hf"], "tplab": runners["tplab"], "tplab_compiled": c}, one, batch, args, res,
                    clock, "compiled", fresh=["tplab_compiled"])
            compiled.shutdown()
        except Exception as e:                          # noqa: BLE001 (a measurement: report and go on)
            res["tplab_compiled_error"] = f"{type(e).__name__}: {e}"[:600]
    res["tplab_graph_replays"] = llm._worker.engine.runner.static.num_replays if llm.config.static_decode else 0
    llm.shutdown()
    eager.shutdown()
    del hf, llm, eager, runners
    if torch.device(dev).type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="the small random shape (a dry run)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kv-gib", type=int, default=4, help="tplab's KV cache, GiB (HF allocates as it goes)")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--no-hf-static", dest="hf_static", action="store_false")
    ap.add_argument("--budget", type=float, default=420, help="seconds; sections past it are skipped")
    ap.add_argument("--out", default=None, help="JSON output (default bench/results/<machine>/gpu.json)")
    ap.add_argument("--profile", default=None, help="PREFIX: write torch.profiler tables to PREFIX-<dtype>.txt")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"bench/gpu.py: no CUDA device (torch {torch.__version__}); nothing measured")
        return 0
    result = {"machine": machine_info(), "args": vars(args), "dtypes": {}}
    if args.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        result["machine"]["gpu_memory_bytes"] = p.total_memory
    settings = Settings.make(args.quick)
    ckpt = checkpoint(settings)
    result["checkpoint"] = settings.name
    clock = Clock(args.budget)                          # from the checkpoint written: a fresh machine writes it

    out = Path(args.out) if args.out else results_path("gpu.json", quick=args.quick or args.device != "cuda")

    def save():
        out.write_text(json.dumps(result, indent=1))
    for name in args.dtypes.split(","):
        if clock.over:
            result["dtypes"][name] = "skipped: out of time"
            continue
        log(f"--- {name} ({time.perf_counter() - clock.t0:.0f} s in)")
        result["dtypes"][name] = {}
        try:
            one_dtype(ckpt, name, args, clock, result["dtypes"][name], save)
        finally:
            save()
    result["seconds"] = time.perf_counter() - clock.t0
    save()
    print(json.dumps(result["dtypes"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
