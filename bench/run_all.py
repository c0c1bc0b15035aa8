"""Run every benchmark, print one table, write it as JSON.

    .venv/bin/python bench/run_all.py            # Qwen2.5-0.5B shape, random weights, fp32 (~15 min here)
    .venv/bin/python bench/run_all.py --quick    # a small model and few tokens (~1 min): checks the scripts
    .venv/bin/python bench/run_all.py --only decode,memory --threads 1

Each row: measurement | tplab | reference | ratio (tplab / reference) | target | met?. Every ratio is
taken within this run, tplab and its reference measured side by side, because absolute numbers on a
shared machine move with the load. Results go to bench/results/<machine>/run_all.json (--quick:
bench/results/quick/run_all.json); docs/performance.md quotes them.
"""
import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import common  # noqa: E402
from common import Row, Settings, checkpoint, log, machine_info, print_table, rows_to_json  # noqa: E402
from common import machine as common_machine  # noqa: E402

ITEMS = ["decode", "tp_scaling", "memory", "prefill", "batching", "compiled"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small model, few tokens: check that the scripts work")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for HF and tplab TP 1 (default: the cores this process may use)")
    ap.add_argument("--only", default=",".join(ITEMS), help=f"comma-separated subset of {ITEMS}")
    ap.add_argument("--out", default=None, help="JSON output (default bench/results/<machine>/run_all.json)")
    args = ap.parse_args(argv)
    items = [i.strip() for i in args.only.split(",") if i.strip()]
    unknown = [i for i in items if i not in ITEMS]
    if unknown:
        ap.error(f"unknown item(s) {unknown}; choose from {ITEMS}")

    s = Settings.make(args.quick, args.threads)
    torch.set_num_threads(s.threads)
    out_path = Path(args.out) if args.out else common.results_path("run_all.json", quick=s.quick)
    machine = machine_info()
    log(f"machine: {machine['cpu_model']}, {machine['cores']} cores, torch {machine['torch']}, "
        f"load average {machine['load_average_at_start']}")
    t_start = time.perf_counter()
    ckpt = checkpoint(s)

    rows, raw, timings = [], {}, {}
    for item in items:
        t0 = time.perf_counter()
        try:
            module = __import__(item)
            result = module.run(ckpt, s)
            item_rows, item_raw = result if isinstance(result, tuple) else (result, {})
        except Exception as e:  # one broken benchmark must not hide the others
            traceback.print_exc()
            item_rows, item_raw = [Row(f"{item}: FAILED", None, None, note=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}")], \
                {"error": traceback.format_exc()}
        timings[item] = time.perf_counter() - t0
        log(f"[{item}] {timings[item]:.0f} s")
        for r in item_rows:
            r.extra = {**r.extra, "item": item}
        rows += item_rows
        raw[item] = item_raw
        torch.set_num_threads(s.threads)  # in case a module changed it

    print(f"\n# tplab benchmarks: {s.name} ({'--quick' if s.quick else 'full'}), fp32, greedy; "
          f"{s.threads} torch threads in-process; {common_machine()}\n")
    print_table(rows)
    targets = [r for r in rows if r.target]
    print(f"\ntargets met: {sum(r.met is True for r in targets)} of {len(targets)}"
          f"{' (' + str(sum(r.met is None for r in targets)) + ' n/a)' if any(r.met is None for r in targets) else ''}; "
          f"total {time.perf_counter() - t_start:.0f} s")

    settings = {k: v for k, v in vars(s).items()}
    doc = {"machine": machine, "settings": settings, "checkpoint": str(ckpt), "rows": rows_to_json(rows),
           "seconds_per_item": timings, "raw": raw, "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    out_path.write_text(json.dumps(doc, indent=2, default=str))
    log(f"wrote {out_path}")


if __name__ == "__main__":
    main()
