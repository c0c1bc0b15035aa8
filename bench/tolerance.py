"""Where tplab's bound against HF comes from (``tplab.tolerance``), measured on this machine.

Part 1: how far a correct tplab is from HF, per checkpoint and TP size, in units of the dtype's eps
(worst over every activation of ``golden``'s per-sublayer diff, each relative to that activation's
largest value). Part 2: how far each of the student's bugs is, as a multiple of the bound. Part 3: a correct
bf16 engine against HF's own model in bf16, on the shipped model, in bf16 eps: why bf16 activations are not
held to a bound (docs/numerics.md).

    ./workbook.sh python bench/tolerance.py            # add TPLAB_ONEDNN=0 OMP_NUM_THREADS=1 to perturb
"""
import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402
from tplab import bugs, golden, models  # noqa: E402
from tplab import tolerance  # noqa: E402

EPS = tolerance.EPS[torch.float32]
RANDOM = {  # the test suite's shapes (tests/conftest.py), and deeper ones
    "gqa, 2 layers": dict(num_attention_heads=4, num_key_value_heads=2),
    "untied, 3 layers": dict(tie_word_embeddings=False, num_attention_heads=8, num_key_value_heads=2,
                             hidden_size=64, num_hidden_layers=3, rope_theta=1e6),
    "8 layers": dict(num_hidden_layers=8, hidden_size=128, intermediate_size=384, num_attention_heads=4,
                     num_key_value_heads=2),
    "24 layers": dict(num_hidden_layers=24, hidden_size=128, intermediate_size=384, num_attention_heads=4,
                      num_key_value_heads=2),
}
# bug -> (TP size it shows at, checkpoint); the others change memory or bytes read, not numbers
NUMERIC_BUGS = {"mask_mul_inf": 1, "no_rope": 1, "rope_layout": 1, "rope_cos_sin_axis": 2, "rope_swallowed": 2,
                "shard_dim1": 2, "lm_head_missing": 1, "lm_head_random": 2}


def worst_eps(ref, mine, eps: float = EPS) -> tuple[float, str]:
    """The worst ``max|mine - ref| / max|ref|`` over activations, in ``eps``, and where."""
    rel = {n: float((mine[n].float() - r.float()).abs().max() / r.float().abs().max()) for n, r in ref.items()
           if r.abs().max() > 0}
    name = max(rel, key=rel.get)
    return rel[name] / eps, name


def correct_rows(folders: dict, ids: list[int]) -> None:
    print(f"{'checkpoint':18} {'TP':>3} {'worst, eps':>11}  where")
    for label, folder in folders.items():
        ref = golden.hf_activations(folder, ids)
        for tp in (1, 2, 4):
            e, where = worst_eps(ref, golden.tplab_activations(folder, ids, tp))
            print(f"{label:18} {tp:>3} {e:>11.0f}  {where}", flush=True)
    print(f"bound: RTOL = {tolerance.RTOL[torch.float32] / EPS:.0f} eps = {tolerance.RTOL[torch.float32]:.1e}")


def bug_rows(tiny: Path, untied: Path, ids: list[int]) -> None:
    print(f"\n{'bug':24} {'TP':>3}  first divergence            max_abs / bound there")
    refs = {tiny: golden.hf_activations(tiny, ids), untied: golden.hf_activations(untied, ids)}
    for bug, tp in NUMERIC_BUGS.items():
        folder = untied if bug == "lm_head_random" else tiny
        try:
            rows = golden.compare(refs[folder], golden.tplab_activations(folder, ids, tp, bugs=[bug]))
        except Exception as e:              # some shapes turn the bug into an error instead of wrong numbers
            print(f"{bug:24} {tp:>3}  raises {type(e).__name__}", flush=True)
            continue
        first = next(r for r in rows if not r.ok)
        print(f"{bug:24} {tp:>3}  {first.name:28} {first.max_abs / first.bound:.1e}", flush=True)
    hf_last = refs[tiny]["logits"][-1]
    shifted = bugs.decode_with_positions(tiny, ids, 1)
    print(f"{'decode_position_offby1':24} {1:>3}  {'logits of the decode step':28} "
          f"{(shifted - hf_last).abs().max() / golden.bound(hf_last):.1e}")


def bf16_rows(tiny: Path, ids: list[int]) -> None:
    from transformers import AutoModelForCausalLM
    ref = golden.hf_activations(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16).eval(), ids)
    print(f"\n{'bf16, shipped model':18} {'TP':>3} {'worst, bf16 eps':>16}  where")
    for tp in (1, 2, 4):
        mine = golden.tplab_activations(tiny, ids, tp, dtype="bfloat16")
        e, where = worst_eps(ref, mine, tolerance.EPS[torch.bfloat16])
        print(f"{'tiny_stories':18} {tp:>3} {e:>16.2f}  {where}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=17)
    args = parser.parse_args()
    from transformers.utils import logging
    logging.disable_progress_bar()
    print(machine())
    print(f"torch threads {torch.get_num_threads()}; fp32 eps {EPS:.2e}\n")
    ids = list(range(3, 3 + args.tokens))
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"tiny_stories": models.tiny_stories()}
        folders.update({k: models.save_random_qwen2(Path(tmp) / str(i), seed=i, **c) for i, (k, c) in enumerate(RANDOM.items())})
        correct_rows(folders, ids)
        bug_rows(models.tiny_stories(), folders["untied, 3 layers"], ids)
    bf16_rows(models.tiny_stories(), ids)


if __name__ == "__main__":
    main()
