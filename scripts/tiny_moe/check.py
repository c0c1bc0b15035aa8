"""Check the shipped tiny_moe model folder, offline.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/tiny_moe/check.py [folder]

Runs ``scripts/tiny_stories/check.py`` on the folder (tokenizer, special ids, greedy samples, size), checks
that the experts split evenly over tensor- and expert-parallel sizes 1, 2, 4 and 8, and prints the experts'
load on the validation stories: the share of the top-k picks each expert gets, per layer.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "tiny_stories")]
import corpus  # noqa: E402
from data import encode_stream, to_blocks  # noqa: E402
from experts import expert_load, load_table  # noqa: E402
from tiny_stories import check as dense_check  # noqa: E402

DEFAULT = HERE.parents[1] / "tplab" / "models" / "tiny_moe"


def main():
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT
    tok, model = dense_check.main(folder)
    cfg = model.config
    print(f"experts: {cfg.num_experts} of moe_intermediate_size {cfg.moe_intermediate_size}, top "
          f"{cfg.num_experts_per_tok}, norm_topk_prob {cfg.norm_topk_prob}")
    for tp in (1, 2, 4, 8):
        assert cfg.num_experts % tp == 0 and cfg.moe_intermediate_size % tp == 0, tp
    _, val_texts = corpus.make_splits(0, 40000, 1000)          # the training run's validation stories
    blocks = to_blocks(encode_stream(tok, val_texts, tok.eos_token_id), 256)
    load = expert_load(model, blocks)
    print(f"expert load on {blocks.shape[0]} validation blocks (share of top-{cfg.num_experts_per_tok} picks, "
          f"even = {100 / cfg.num_experts:.1f}%):\n{load_table(load)}")


if __name__ == "__main__":
    main()
