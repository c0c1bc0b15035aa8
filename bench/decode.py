"""1. Decode tokens/s: tplab TP 1 (an engine of one sequence) against HF ``generate`` on the same checkpoint, same
process, same threads.

Greedy, prompt ``prompt_len`` tokens, ``new_tokens`` new tokens. Decode rate = (new_tokens - 1) /
(time of a new_tokens generate - time of a 1-token generate), i.e. prefill and the first token
taken out; the end-to-end rate is printed too. A short warm-up each, then ``reps`` rounds, each
running HF and tplab side by side (order reversed every other round); the ratio is the median of the
per-round ratios, so that load from other processes, which changes over minutes, cancels.

Also: the fraction of the memory-bandwidth bound tplab reaches, where the bound is the read bandwidth
(``x.sum()`` over 1 GiB, same threads), measured in every round, divided by the weight bytes a decode
step reads. Item 1 is repeated at 1 thread (informational rows) when the main thread count is higher.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import (Row, Settings, decode_bytes_per_token, interleaved, log, median, paired,  # noqa: E402
                    prompt_ids, read_bandwidth, standalone)


def load_hf(ckpt, dtype=torch.float32):
    from transformers import Qwen2ForCausalLM
    return Qwen2ForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()


def hf_generate(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def tplab_generate(llm, prompt: list[int], n: int) -> list[int]:
    from tplab import SamplingParams
    return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].token_ids


def measure(hf, llm, prompt: list[int], n: int, reps: int, threads: int) -> dict:
    """Per round: HF and tplab generates of ``n`` and of 1 new token, and the read bandwidth, all at
    ``threads`` torch threads, side by side (see ``common.interleaved``)."""
    torch.set_num_threads(threads)
    hf_generate(hf, prompt, 4), tplab_generate(llm, prompt, 4)                         # warm-up
    out, bws = {}, []

    def full(name, fn):
        def go():
            out[name] = fn()
        return go

    def bandwidth():
        bws.append(read_bandwidth(reps=3))
    times = interleaved({
        "bandwidth": bandwidth,
        "hf_full": full("hf", lambda: hf_generate(hf, prompt, n)),
        "tplab_full": full("tplab", lambda: tplab_generate(llm, prompt, n)),
        "hf_one": lambda: hf_generate(hf, prompt, 1), "tplab_one": lambda: tplab_generate(llm, prompt, 1),
    }, reps=reps, warmup=0)
    log(f"[decode] {threads} thread(s), times (s): "
        + ", ".join(f"{k}={[round(t, 3) for t in v]}" for k, v in times.items())
        + f"; read GB/s {[round(b['read_bytes_per_s'] / 1e9, 1) for b in bws]}")
    decode = {w: [(n - 1) / (f - o) for f, o in zip(times[f"{w}_full"], times[f"{w}_one"])] for w in ("hf", "tplab")}
    e2e = {w: [n / f for f in times[f"{w}_full"]] for w in ("hf", "tplab")}
    return {"threads": threads, "times_s": times, "hf_tokens": out["hf"], "tplab_tokens": out["tplab"],
            "decode_per_round": decode, "e2e_per_round": e2e, "bandwidth_per_round": bws,
            "bw": [b["read_bytes_per_s"] for b in bws]}


def run(ckpt, s: Settings) -> list[Row]:
    from tplab import LLM

    prompt, n = prompt_ids(s.prompt_len), s.new_tokens
    plan = [(s.threads, s.reps)] + ([(1, s.one_thread_reps)] if s.threads > 1 and s.decode_also_one_thread else [])
    log(f"[decode] loading HF and tplab TP 1, prompt {len(prompt)}, {n} new tokens, (threads, rounds) {plan}")
    hf = load_hf(ckpt)
    # an engine of one sequence, as HF's generate of one prompt is (and bench/peers.py's batch-1 rows): on AMD
    # its fp32 weights then stay plain, tplab's fastest layout for one row (kernels.gemm.one_row_keeps_plain)
    llm = LLM(ckpt, tensor_parallel_size=1, dtype="float32", kv_cache_memory=256 << 20, max_num_seqs=1)
    try:
        results = [measure(hf, llm, prompt, n, reps, t) for t, reps in plan]
    finally:
        llm.shutdown()
        torch.set_num_threads(s.threads)
    del hf
    per_token = decode_bytes_per_token(s.shape)
    rows = []
    for r in results:
        t, decode, e2e = r["threads"], r["decode_per_round"], r["e2e_per_round"]
        rounds = len(r["bw"])
        main = t == s.threads
        tag = "" if main else f" [{t} thread{'s' * (t > 1)}]"
        same = sum(a == b for a, b in zip(r["hf_tokens"], r["tplab_tokens"])) / n
        first_diff = next((i for i, (a, b) in enumerate(zip(r["hf_tokens"], r["tplab_tokens"])) if a != b), None)
        bound = [bw / per_token for bw in r["bw"]]                      # tok/s the bandwidth allows, per round
        how = f"{t} thread(s), {rounds} rounds; values: medians; ratio: median of per-round ratios"
        rows += [
            Row("decode tok/s, TP1 vs HF generate" + tag, median(decode["tplab"]), median(decode["hf"]), "tok/s",
                "HF generate", ratio=paired(decode["tplab"], decode["hf"]), target=">= 1.5" if main else "",
                note=f"(new-1)/(t[{n} new] - t[1 new]), prompt {len(prompt)}; {how}; per-round tok/s "
                     f"tplab {[round(x, 2) for x in decode['tplab']]} HF {[round(x, 2) for x in decode['hf']]}"),
            Row("end-to-end generate tok/s (incl. prefill)" + tag, median(e2e["tplab"]), median(e2e["hf"]), "tok/s",
                "HF generate", ratio=paired(e2e["tplab"], e2e["hf"])),
            Row("greedy tokens equal to HF's" + tag, same, 1.0, "fraction", "HF tokens", ratio=same,
                target=">= 1.0" if main else "",
                note="all equal" if first_diff is None else f"first difference at new token {first_diff}"),
            Row("decode vs memory-bandwidth bound" + tag, median(decode["tplab"]), median(bound), "tok/s",
                "bandwidth bound", ratio=paired(decode["tplab"], bound), target=">= 0.7" if main else "",
                note=f"{per_token / 1e9:.3f} GB of weights read per token; bound = read bandwidth / that, the "
                     f"bandwidth measured in each round (1 GiB x.sum(), {t} thread(s)): "
                     f"{[round(bw / 1e9, 1) for bw in r['bw']]} GB/s; HF reaches {paired(decode['hf'], bound):.0%}",
                extra={"weight_bytes_per_token": per_token, "hf_fraction": paired(decode["hf"], bound)}),
        ]
    return rows, {"runs": results, "weight_bytes_per_token": per_token}


if __name__ == "__main__":
    standalone(run)
