"""On a GPU: decode steps replayed as CUDA graphs against the same engine eager, the padded step eager, and HF,
on 16 requests with preemption, fp32, on the shipped tiny model. Per engine and prompt: the first generated
token that differs from HF's, and HF's own margin there (its top logit less the runner-up's): a near-tie
flips with any change of summation order (another batch size is another GEMM), a bug flips wide margins.

    TPLAB_PYTHON=python3 bench/graph_parity.py --out bench/results/<gpu>/graph_parity.json
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tplab import LLM, SamplingParams, models  # noqa: E402

NEW = 16
PROMPTS = {
    "natural": ["Once upon a time", "The little dog", "Tom and Lily went to the park", "One day, a girl named Mia",
                "There was a big red ball", "Sam had a new toy car", "The sun was shining and",
                "Lily found a shiny stone", "A little bird lived in a tree", "Ben wanted to bake a cake",
                "The cat sat on the mat", "Mom said it was time for bed", "Max and his friend Tim",
                "In a small town there was", "The boy saw a big truck", "Anna liked to draw pictures"],
    "odd": [f"{s} {w}" for w in ("", "saw a big", "was very happy", "wanted to play")
            for s in ("Once upon a time", "The little dog", "Tom and Lily went to the park", "One day, a girl named Mia")],
}
ENGINES = {"graphs": {}, "eager": dict(enforce_eager=True), "padded_eager": dict(enforce_eager=True, static_decode=True)}


def hf_reference(model, prompts):
    """HF's greedy tokens for each prompt alone, and its logits over prompt + tokens (fp32, on the GPU)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            tokens = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None,   # as ignore_eos
                                    pad_token_id=0)[0, len(p):].tolist()
            logits = model(torch.tensor([p + tokens], device="cuda")).logits[0, len(p) - 1:].float().cpu()
            out.append((tokens, logits))
    return out


def first_difference(tokens, ref_tokens, logits):
    i = next((j for j, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
    if i is None:
        return None
    top2 = logits[i].topk(2).values
    return {"index": i, "tplab": tokens[i], "hf": ref_tokens[i], "hf_margin": float(top2[0] - top2[1]),
            "tplab_token_below_hf_top_by": float(logits[i].max() - logits[i, tokens[i]])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/graph_parity.py: no CUDA device; nothing measured")
        return 0
    from transformers import AutoTokenizer, Qwen2ForCausalLM
    path = models.tiny_stories()
    tok = AutoTokenizer.from_pretrained(path)
    hf = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    result = {}
    for name, texts in PROMPTS.items():
        prompts = [tok.encode(t) for t in texts]
        ref = hf_reference(hf, prompts)
        for engine, settings in ENGINES.items():
            with LLM(path, num_kv_blocks=24, block_size=16, **settings) as llm:
                outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True))
                stats = llm.stats()
            diffs = [first_difference(o.token_ids, r[0], r[1]) for o, r in zip(outs, ref)]
            result[f"{name}/{engine}"] = {"equal": sum(d is None for d in diffs), "of": len(diffs),
                                          "preemptions": stats["num_preemptions"],
                                          "static_steps": stats["static_decode_steps"],
                                          "differences": {i: d for i, d in enumerate(diffs) if d is not None}}
            print(name, engine, json.dumps(result[f"{name}/{engine}"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
