"""Shared pieces of the benchmarks: the checkpoint (made once), threads, timing, bandwidth, the table.

Every benchmark measures tplab and its reference in the same run (interleaved where it can)
and reports their ratio, because absolute numbers on a shared 2-core machine are noisy.
"""
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
CACHE_DIR = Path(os.environ.get("TPLAB_BENCH_CACHE", Path.home() / ".cache" / "tplab-bench"))
from machines import machine, machine_folder, machine_info, results_path, same_machine  # noqa: E402,F401

# Qwen2.5-0.5B's exact shape (its config.json), random weights.
QWEN25_05B = dict(
    hidden_size=896, num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=24,
    intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
    max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu", use_sliding_window=False,
)
# --quick: same structure (14 query heads on 2 KV heads, tied), small enough that everything runs in ~1 min.
QUICK_SHAPE = dict(
    hidden_size=224, num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=4,
    intermediate_size=1216, vocab_size=16384, tie_word_embeddings=True, rope_theta=1e6,
    max_position_embeddings=2048, rms_norm_eps=1e-6, hidden_act="silu", use_sliding_window=False,
)


@dataclass
class Settings:
    """Sizes of every benchmark; ``--quick`` shrinks them."""
    quick: bool
    name: str
    shape: dict
    threads: int                 # torch threads for the in-process runs (HF and tplab TP 1)
    prompt_len: int = 32
    new_tokens: int = 128
    reps: int = 3                # timed rounds (median; ratios paired per round) after a warm-up
    decode_also_one_thread: bool = True  # item 1 again at 1 torch thread (informational rows)
    one_thread_reps: int = 2     # rounds for that
    tp_new_tokens: int = 32      # new tokens per generate in the TP 2 vs TP 1 comparison
    prefill_len: int = 512
    batch_requests: int = 16
    batch_prompt_len: int = 16
    batch_new_tokens: int = 32
    allreduce_iters: int = 2000
    memory_kv_blocks: int = 16   # KV blocks in the loading-memory runs (so the cache does not hide the weights)

    @staticmethod
    def make(quick: bool, threads: int | None = None) -> "Settings":
        threads = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
        if quick:
            return Settings(True, "quick-random", QUICK_SHAPE, threads, prompt_len=16, new_tokens=64, reps=2,
                            tp_new_tokens=32, prefill_len=128, batch_requests=8, batch_prompt_len=8,
                            batch_new_tokens=8, allreduce_iters=300, one_thread_reps=1)
        return Settings(False, "qwen2.5-0.5b-random", QWEN25_05B, threads)


def checkpoint(settings: Settings) -> Path:
    """The random checkpoint of ``settings.shape``, written once under ``CACHE_DIR`` and reused."""
    from tplab import models

    path = CACHE_DIR / settings.name
    stamp = path / "bench-shape.json"
    want = json.dumps(settings.shape, sort_keys=True)
    if stamp.is_file() and stamp.read_text() == want:
        return path
    tmp = CACHE_DIR / f"{settings.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    log(f"writing random checkpoint {settings.name} to {path} (once) ...")
    models.save_random_qwen2(tmp, seed=0, **settings.shape)
    (tmp / "bench-shape.json").write_text(want)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    log(f"  done in {time.perf_counter() - t0:.0f} s")
    return path


def set_threads(n: int) -> None:
    torch.set_num_threads(n)


def build_order(names: list[str]) -> list[str]:
    """The order in which to build engines compared in one process: ``names`` as given, reversed with
    ``TPLAB_BENCH_REVERSE_BUILD=1``. On a 2-core Xeon VM (docs/performance.md), of two engines built one after
    the other in a process the second decoded 5-14% faster than the first at batch 1, the same engine either way
    (bench/README.md, "Build order"): a comparison made in one order only carries that bias."""
    return names[::-1] if os.environ.get("TPLAB_BENCH_REVERSE_BUILD") == "1" else list(names)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prompt_ids(n: int, seed: int = 1, vocab: int = 1000) -> list[int]:
    """A fixed pseudo-random prompt of ``n`` token ids (ids < 1000, inside every vocabulary used here)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def interleaved(fns: dict, reps: int, warmup: int = 1) -> dict:
    """Run each callable ``warmup`` times, then ``reps`` rounds of all of them in turn, the order reversed
    every other round, so that a burst of load from other processes (or a slow drift) hits both sides
    alike; ``{name: [seconds in round 0, round 1, ...]}``. Quantities computed per round from these and
    compared within the round are *paired* (see ``paired``)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {k: [] for k in fns}
    keys = list(fns)
    for r in range(reps):
        for k in (keys if r % 2 == 0 else keys[::-1]):
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return times


def paired(a: list[float], b: list[float]) -> float:
    """Median over rounds of ``a[r] / b[r]``: the ratio of two quantities measured side by side."""
    return median([x / y for x, y in zip(a, b)])


def median(xs) -> float:
    return statistics.median(xs)


def read_bandwidth(gib: float = 1.0, reps: int = 5) -> dict:
    """Memory read bandwidth in bytes/s of this process's threads: ``x.sum()`` over a tensor far larger than
    the caches (median of ``reps``), and copy bandwidth (``y.copy_(x)``, read + write bytes) for reference."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    nbytes = x.numel() * 4
    x.sum(), y.copy_(x)  # touch both
    sums, copies = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        sums.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        y.copy_(x)
        copies.append(time.perf_counter() - t0)
    return {"read_bytes_per_s": nbytes / median(sums), "read_bytes_per_s_best": nbytes / min(sums),
            "copy_bytes_per_s": 2 * nbytes / median(copies), "tensor_bytes": nbytes, "threads": torch.get_num_threads()}


def layer_shapes(shape: dict) -> dict:
    """``{name: (out, in)}`` of one decoder layer's weight matrices at TP 1, as tplab holds them (q, k, v in one
    ``qkv_proj``, gate and up in one ``gate_up_proj``)."""
    h, i, heads = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"]
    d = h // heads
    return {"qkv_proj": ((heads + 2 * shape["num_key_value_heads"]) * d, h), "o_proj": (h, h),
            "gate_up_proj": (2 * i, h), "down_proj": (h, i)}


def decode_bytes_per_token(shape: dict, itemsize: int = 4, tp_size: int = 1) -> int:
    """Weight bytes one decode step reads on one rank: every layer's weights, the final norm and the LM
    head (the whole vocab x hidden matrix; the embedding lookup reads one row, counted as nothing)."""
    e, i, layers, v = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    h, hkv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = e // h
    qkv = (h + 2 * hkv) * d * e + (h + 2 * hkv) * d      # weight + bias
    o = h * d * e
    mlp = 2 * i * e + i * e
    norms = 2 * e
    per_layer = (qkv + o + mlp) // tp_size + norms
    head = v * e // tp_size
    return (layers * per_layer + e + head) * itemsize


# ----------------------------------------------------------------------------- results table


@dataclass
class Row:
    """One line of the table. ``ratio`` is tplab / reference unless ``ratio_note`` says otherwise."""
    name: str
    tplab: float | None
    reference: float | None
    unit: str = ""
    ref_name: str = ""
    ratio: float | None = None
    target: str = ""             # e.g. ">= 1.5"; "" for an informational row
    met: bool | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.ratio is None and self.tplab is not None and self.reference:
            self.ratio = self.tplab / self.reference
        if self.met is None and self.target and self.ratio is not None:
            op, value = self.target.split()
            self.met = self.ratio >= float(value) if op == ">=" else self.ratio <= float(value)


def fmt(x, digits=4) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, str):
        return x
    if x == 0 or 1e-3 <= abs(x) < 1e6:
        return f"{x:.{digits}g}"
    return f"{x:.3e}"


def print_table(rows: list[Row], out=sys.stdout) -> None:
    head = ["measurement", "tplab", "reference", "ratio", "target", "met?"]
    lines = [[r.name + (f" [{r.unit}]" if r.unit else ""),
              fmt(r.tplab), fmt(r.reference) + (f" ({r.ref_name})" if r.ref_name else ""),
              fmt(r.ratio), r.target or "-", {True: "yes", False: "NO", None: "-"}[r.met]] for r in rows]
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
    sep = "-+-".join("-" * w for w in widths)
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths)), file=out)
    print(sep, file=out)
    for l in lines:
        print(" | ".join(c.ljust(w) for c, w in zip(l, widths)), file=out)
    notes = [(r.name, r.note) for r in rows if r.note]
    if notes:
        print("\nnotes:", file=out)
        for name, note in notes:
            print(f"  {name}: {note}", file=out)
    out.flush()


# CPU features that decide which kernels oneDNN, MKL and inductor pick (fp32 and bf16 GEMM, AMX tiles)
def rows_to_json(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]


def standalone(run, argv=None) -> None:
    """``python bench/<item>.py [--quick]``: run one benchmark and print its rows."""
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads in this process (default: the cores)")
    args = ap.parse_args(argv)
    settings = Settings.make(args.quick, args.threads)
    set_threads(settings.threads)
    result = run(checkpoint(settings), settings)
    print_table(result[0] if isinstance(result, tuple) else result)


def inproc_engine(llm):
    """The ``LLMEngine`` of an in-process (TP 1) ``LLM``: its worker holds it."""
    return llm._worker.engine
