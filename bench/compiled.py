"""6. The compiled path (``LLM(..., compile=True)``, ``tplab.engine.compiled``) against the eager engine, in the
same run: decode at batch 1 (with the fraction of the memory-bandwidth bound each reaches), ``batch_requests``
concurrent requests, and a prefill of ``prefill_len`` tokens, rounds alternating the two engines (the order
reversed every other round, ratios the median of per-round ratios); greedy tokens compared. Then what
compiling costs: a fresh process starts the engine and generates 2 tokens (a prefill and one decode step,
the two graphs), eager, compiled with an empty inductor cache, and compiled again with that cache.

The two engines are built eager first; ``TPLAB_BENCH_REVERSE_BUILD=1`` builds the compiled one first. On the
Xeon VM of docs/performance.md the engine built second decoded 5-14% faster, either engine: run both orders
(bench/README.md, "Build order").
"""
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import (Row, Settings, decode_bytes_per_token, interleaved, log, machine_info, median, paired,  # noqa: E402
                    build_order, prompt_ids, read_bandwidth, standalone)

START = textwrap.dedent("""
    import sys, time
    t0 = time.perf_counter()
    from tplab import LLM, SamplingParams
    llm = LLM(sys.argv[1], kv_cache_memory=256 << 20, compile=sys.argv[2] == "1")
    llm.generate([list(range(1, 33))], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    print(time.perf_counter() - t0, llm.stats()["compiled_forwards"])
""")


def start_seconds(ckpt, compile: bool, cache_dir: str, threads: int) -> tuple[float, int]:
    """Seconds from a fresh process's import of tplab to its first 2 tokens, and its compiled forwards."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, "-c", START, str(ckpt), "1" if compile else "0"], env=env,
                          capture_output=True, text=True, timeout=1800, check=True)
    seconds, forwards = done.stdout.split()[-2:]
    return float(seconds), int(forwards)


def starts(ckpt, s: Settings) -> dict:
    with tempfile.TemporaryDirectory(prefix="tplab-inductor-") as cache:
        out = {"eager": start_seconds(ckpt, False, cache, s.threads),
               "compiled_cold_cache": start_seconds(ckpt, True, cache, s.threads),
               "compiled_warm_cache": start_seconds(ckpt, True, cache, s.threads)}
    log(f"[compiled] start to first 2 tokens (s, compiled forwards): {out}")
    return out


def generate(llm, prompts, n):
    from tplab import SamplingParams
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))]


def measure(eager, compiled, s: Settings) -> dict:
    """Per round: each engine's batch-1 generates of ``new_tokens`` and of 1 token, its 16 requests and its
    prefill (one new token), and the read bandwidth; interleaved (``common.interleaved``)."""
    prompt, n = prompt_ids(s.prompt_len), s.new_tokens
    batch = [prompt_ids(s.batch_prompt_len, seed=100 + i) for i in range(s.batch_requests)]
    long = prompt_ids(s.prefill_len, seed=7)
    tokens, bws, fns = {}, [], {"bandwidth": lambda: bws.append(read_bandwidth(reps=3))}
    for name, llm in (("eager", eager), ("compiled", compiled)):
        for what, prompts, new in (("full", [prompt], n), ("one", [prompt], 1),
                                   ("batch", batch, s.batch_new_tokens), ("prefill", [long], 1)):
            def go(llm=llm, key=f"{name}_{what}", prompts=prompts, new=new):
                tokens[key] = generate(llm, prompts, new)
            fns[f"{name}_{what}"] = go
    times = interleaved(fns, reps=s.reps, warmup=1)
    del bws[:-s.reps]                                    # the warm-up's
    log("[compiled] times (s): " + ", ".join(f"{k}={[round(t, 3) for t in v]}" for k, v in times.items()))
    rate = {w: {"decode": [(n - 1) / (f - o) for f, o in zip(times[f"{w}_full"], times[f"{w}_one"])],
                "batch": [len(batch) * s.batch_new_tokens / t for t in times[f"{w}_batch"]],
                "prefill": [len(long) / t for t in times[f"{w}_prefill"]]} for w in ("eager", "compiled")}
    same = {k: tokens[f"compiled_{k}"] == tokens[f"eager_{k}"] for k in ("full", "batch", "prefill")}
    return {"times_s": times, "rates": rate, "bw": [b["read_bytes_per_s"] for b in bws], "tokens_equal": same}


def run(ckpt, s: Settings):
    from tplab import LLM

    torch.set_num_threads(s.threads)
    log(f"[compiled] eager vs compile=True, TP 1, {s.threads} thread(s): decode, {s.batch_requests} requests, "
        f"prefill {s.prefill_len}; then start times in fresh processes")
    settings = dict(tensor_parallel_size=1, dtype="float32", max_num_seqs=s.batch_requests,
                    kv_cache_memory=512 << 20)
    order = build_order(["eager", "compiled"])          # TPLAB_BENCH_REVERSE_BUILD=1: compiled first
    log(f"[compiled] built in the order {order}")
    made = {k: LLM(ckpt, compile=k == "compiled", **settings) for k in order}
    eager, compiled = made["eager"], made["compiled"]
    try:
        t0 = time.perf_counter()
        generate(compiled, [prompt_ids(8)], 2)           # compiles here (or loads from the cache)
        first = time.perf_counter() - t0
        r = measure(eager, compiled, s)
        forwards = compiled.stats()["compiled_forwards"]
    finally:
        eager.shutdown(), compiled.shutdown()
    start = starts(ckpt, s)
    per_token = decode_bytes_per_token(s.shape)
    bound = [bw / per_token for bw in r["bw"]]
    c, e = r["rates"]["compiled"], r["rates"]["eager"]
    how = f"{s.threads} thread(s), {len(bound)} rounds; values: medians; ratio: median of per-round ratios"
    eq = lambda k: "greedy tokens equal" if r["tokens_equal"][k] else "GREEDY TOKENS DIFFER"
    return [
        Row("decode tok/s, batch 1: compiled vs eager", median(c["decode"]), median(e["decode"]), "tok/s", "eager",
            ratio=paired(c["decode"], e["decode"]), note=f"prompt {s.prompt_len}, {s.new_tokens} new; {how}; {eq('full')}"),
        Row("decode, compiled vs memory-bandwidth bound", median(c["decode"]), median(bound), "tok/s",
            "bandwidth bound", ratio=paired(c["decode"], bound),
            note=f"{per_token / 1e9:.3f} GB of weights read per token; read bandwidth (1 GiB x.sum()) "
                 f"{[round(b / 1e9, 1) for b in r['bw']]} GB/s; eager reaches {paired(e['decode'], bound):.0%}",
            extra={"weight_bytes_per_token": per_token, "eager_fraction": paired(e["decode"], bound)}),
        Row(f"{s.batch_requests} concurrent requests: compiled vs eager", median(c["batch"]), median(e["batch"]),
            "tok/s", "eager", ratio=paired(c["batch"], e["batch"]),
            note=f"{s.batch_requests} x ({s.batch_prompt_len} prompt + {s.batch_new_tokens} new); {eq('batch')}"),
        Row(f"prefill tok/s, {s.prefill_len}-token prompt: compiled vs eager", median(c["prefill"]),
            median(e["prefill"]), "tok/s", "eager", ratio=paired(c["prefill"], e["prefill"]), note=eq("prefill")),
        Row("start to first 2 tokens, compiled, empty inductor cache", start["compiled_cold_cache"][0],
            start["eager"][0], "s", "eager", note="fresh process: import, load, prefill + 1 decode step (2 graphs)"),
        Row("start to first 2 tokens, compiled, cache from the start before", start["compiled_warm_cache"][0],
            start["eager"][0], "s", "eager", note=f"in-process first generate after the load: {first:.1f} s"),
    ], {"measure": r, "starts": start, "compiled_forwards": forwards, "machine": machine_info()}


if __name__ == "__main__":
    standalone(run)
