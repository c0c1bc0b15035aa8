"""4. Prefill tokens/s: tplab TP 1 against HF's forward on the same ``prefill_len``-token prompt.

tplab: ``llm.generate([prompt], max_tokens=1)`` (prefill, the LM head on the last position, sampling).
HF: one ``model(ids, use_cache=True, logits_to_keep=1)`` forward, what ``generate`` runs for its
prefill (the KV cache filled, logits of the last position only), then the argmax. Same process,
same threads, a short warm-up each, then ``reps`` rounds side by side; ratio = median of per-round ratios.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import Row, Settings, interleaved, log, median, paired, prompt_ids, standalone  # noqa: E402
from decode import load_hf, tplab_generate  # noqa: E402


def hf_prefill(model, prompt: list[int]) -> int:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
    return int(out.logits[0, -1].argmax())


def run(ckpt, s: Settings) -> list[Row]:
    from tplab import LLM

    torch.set_num_threads(s.threads)
    prompt = prompt_ids(s.prefill_len, seed=2)
    log(f"[prefill] HF forward vs tplab TP 1 on a {len(prompt)}-token prompt, {s.threads} threads")
    hf = load_hf(ckpt)
    llm = LLM(ckpt, tensor_parallel_size=1, dtype="float32", kv_cache_memory=256 << 20)
    try:
        hf_prefill(hf, prompt[:64]), tplab_generate(llm, prompt[:64], 1)  # warm-up
        out = {}

        def keep(name, fn):
            def go():
                out[name] = fn()
            return go
        times = interleaved({"hf": keep("hf", lambda: hf_prefill(hf, prompt)),
                             "tplab": keep("tplab", lambda: tplab_generate(llm, prompt, 1)[0])},
                            reps=s.reps, warmup=0)
    finally:
        llm.shutdown()
    del hf
    log("[prefill] times (s): " + ", ".join(f"{k}={[round(t, 3) for t in v]}" for k, v in times.items()))
    per_round = {k: [len(prompt) / t for t in v] for k, v in times.items()}
    return [Row(f"prefill tok/s ({len(prompt)}-token prompt), TP1 vs HF forward", median(per_round["tplab"]),
                median(per_round["hf"]), "tok/s", "HF forward", ratio=paired(per_round["tplab"], per_round["hf"]),
                note=f"HF: one forward with use_cache=True, logits_to_keep=1; tplab: generate(max_tokens=1); "
                     f"first token {'equal' if out['hf'] == out['tplab'] else 'DIFFERENT'} "
                     f"({out['tplab']} vs HF {out['hf']}); {s.reps} rounds, ratio: median of per-round ratios; per-round "
                     f"tok/s tplab {[round(x, 1) for x in per_round['tplab']]} HF {[round(x, 1) for x in per_round['hf']]}")], \
        {"times_s": times, "first_token": out}


if __name__ == "__main__":
    standalone(run)
