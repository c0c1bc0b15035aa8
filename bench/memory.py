"""3. Peak resident memory of each rank while it builds its engine and loads its weights.

Each configuration runs in fresh rank processes (``tplab.launch``; TP 1 too, as a group of one) that
build ``tplab.engine.worker.Worker`` exactly as ``LLM`` does. Inside the rank a sampler thread
reads ``/proc/self/status`` every 2 ms while the engine is built:

* ``RssAnon`` (anonymous resident memory: the weights tplab copied in, temporaries, the KV cache,
  the RoPE tables) is the measure used for the ratios. safetensors mmaps the checkpoint, and the
  file-backed pages it touches count in ``VmRSS``/``ru_maxrss`` but belong to the page cache, shared by
  every rank, so they are reported beside it but not used.
* ``VmHWM`` (peak ``VmRSS``, file-backed pages included) and ``psutil`` USS after loading are reported
  too. (``getrusage(RUSAGE_SELF).ru_maxrss`` is kept in the JSON only: Linux carries it over ``execve``,
  so a rank spawned from a parent that once held 2.5 GB reports at least 2.5 GB.)

The KV cache is fixed to ``memory_kv_blocks`` blocks so that the cache (sized from free RAM by
default) does not hide the weights.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cloudpickle  # noqa: E402

from common import Row, Settings, log, standalone  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

FULL_LOAD_BUG = "full_load_per_rank"


def _status() -> dict:
    """RssAnon, RssFile, VmRSS, VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem", "VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def measure_rank_load(model: str, tp: int, bugs: tuple, kv_blocks: int) -> dict:
    """Runs in a rank: build the engine as ``LLM`` does and report this process's memory."""
    import resource
    import threading
    import time

    import psutil
    import torch

    import tplab.engine.llm_engine  # noqa: F401  (imported before the baseline: code is not weights)
    from tplab.engine.config import EngineConfig
    from tplab.engine.worker import Worker

    cfg = EngineConfig(model=model, tensor_parallel_size=tp, dtype="float32", bugs=tuple(bugs),
                       num_kv_blocks=kv_blocks, device="cpu")
    base = _status()
    peak = dict(base)
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            now = _status()
            for k, v in now.items():
                peak[k] = max(peak.get(k, 0), v)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        worker = Worker(cfg)
    finally:
        stop.set()
        sampler.join()
    load_s = time.perf_counter() - t0
    engine = worker.engine
    after = _status()
    for k, v in after.items():
        peak[k] = max(peak.get(k, 0), v)
    model_ = engine.model
    param_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model_.parameters()}.values())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model_.buffers())
    info = {
        "rank": torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
        "threads": torch.get_num_threads(), "load_s": load_s,
        "baseline": base, "peak": peak, "after": after,
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "uss_after_bytes": psutil.Process().memory_full_info().uss,
        "param_bytes": param_bytes, "buffer_bytes": buffer_bytes,
        "kv_cache_bytes": engine.runner.kv_cache_bytes(),
        "elements_read": engine.load_report.elements_read,
    }
    del worker, engine, model_
    return info


def run(ckpt, s: Settings) -> list[Row]:
    from tplab import bugs, launch

    configs = [("tp1", 1, ()), ("tp2", 2, ())]
    has_bug = FULL_LOAD_BUG in getattr(bugs, "NAMES", ())
    if has_bug:
        configs.append(("tp2_full_load", 2, (FULL_LOAD_BUG,)))
    results = {}
    for name, tp, bug in configs:
        log(f"[memory] {name}: building the engine in {tp} fresh rank(s){' with bugs=' + str(list(bug)) if bug else ''}")
        results[name] = launch(measure_rank_load, world_size=tp, args=(str(ckpt), tp, bug, s.memory_kv_blocks),
                               timeout=900)
    mib = 1 << 20

    def worst(name, key, field="peak"):
        return max(r[field][key] for r in results[name]) / mib

    def grown(name):
        return max(r["peak"]["RssAnon"] - r["baseline"]["RssAnon"] for r in results[name]) / mib

    def per_rank(name, key="RssAnon"):
        return [round(r["peak"][key] / mib) for r in results[name]]

    tp1, tp2 = results["tp1"][0], results["tp2"]
    rope = tp1["buffer_bytes"] / mib
    rows = [
        Row("peak anon RSS per rank while loading, TP2 vs TP1", worst("tp2", "RssAnon"), worst("tp1", "RssAnon"),
            "MiB", "TP1", target="<= 0.6",
            note=f"/proc/self/status RssAnon sampled every 2 ms while Worker(cfg) builds the engine, largest rank "
                 f"(TP2 ranks {per_rank('tp2')} MiB); params per rank TP1 {tp1['param_bytes'] / mib:.0f} MiB, "
                 f"TP2 {tp2[0]['param_bytes'] / mib:.0f} MiB; buffers (RoPE tables) per rank {rope:.0f} MiB; "
                 f"KV cache {s.memory_kv_blocks} blocks = {tp1['kv_cache_bytes'] / mib:.1f} MiB at TP1; "
                 f"process baseline before loading TP1 {tp1['baseline']['RssAnon'] / mib:.0f} MiB"),
        Row("  same, growth over the pre-load baseline", grown("tp2"), grown("tp1"), "MiB", "TP1",
            note="peak RssAnon minus RssAnon just before Worker(cfg) (imports and interpreter excluded)"),
        Row("  peak VmRSS (VmHWM, file-backed incl.)", worst("tp2", "VmHWM"), worst("tp1", "VmHWM"), "MiB", "TP1",
            note="includes the mmapped safetensors pages each rank touched (page cache, shared between ranks)"),
        Row("  USS after loading", max(r["uss_after_bytes"] for r in tp2) / mib, tp1["uss_after_bytes"] / mib,
            "MiB", "TP1"),
    ]
    if has_bug:
        rows.append(Row(f"peak anon RSS per rank, TP2 vs TP2 {FULL_LOAD_BUG}", worst("tp2", "RssAnon"),
                        worst("tp2_full_load", "RssAnon"), "MiB", f"bugs=[{FULL_LOAD_BUG!r}]", target="<= 0.6",
                        note=f"the student's every-rank-loads-everything loader: ranks {per_rank('tp2_full_load')} MiB, "
                             f"growth {grown('tp2_full_load'):.0f} MiB, VmHWM {worst('tp2_full_load', 'VmHWM'):.0f} MiB; "
                             f"elements read per rank {[r['elements_read'] for r in results['tp2_full_load']]} "
                             f"(params per rank {tp2[0]['param_bytes'] // 4}). safetensors.torch.load_file maps the "
                             f"file, so the full state dict is file-backed and only the pages narrowed into the "
                             f"shard are touched: it costs address space and reads, not anonymous memory"))
    else:
        rows.append(Row(f"peak anon RSS per rank, TP2 vs TP2 {FULL_LOAD_BUG}", worst("tp2", "RssAnon"), None, "MiB",
                        f"bugs=[{FULL_LOAD_BUG!r}]", target="<= 0.6",
                        note=f"n/a: tplab.bugs.NAMES has no {FULL_LOAD_BUG!r} yet"))
    return rows, results


if __name__ == "__main__":
    standalone(run)
