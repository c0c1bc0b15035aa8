"""Bytes a pipeline stage sends to the next one, per decode step and per 2K-token prefill, counted in a real run.

    .venv/bin/python bench/pipeline_bytes.py [--tokens 2048]

A counting script, not a timing benchmark: it runs ``LLM(..., tensor_parallel_size=t, pipeline_parallel_size=p)``
at (t, p) = (1, 2), (2, 2), (1, 4), and (2, 2) with sequence parallelism, inside ``launch``ed ranks, on a random
checkpoint with Qwen2.5-0.5B's hidden size (896; 4 layers and a small vocabulary, so a 2K-token prefill is quick),
fp32, and records every ``send`` with ``count_collectives``. One prompt of ``--tokens`` tokens is prefilled in
chunks of 512 and decodes one token more. Each stage but the last sends (hidden, residual), ``2 x rows x hidden x
4`` bytes per step and per TP rank; beside them, for scale, the bytes each rank puts into its stage's TP
collectives over the same steps.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cloudpickle  # noqa: E402

from common import machine  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the rank function travels by value
SHAPE = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
             num_hidden_layers=4, vocab_size=1024, max_position_embeddings=4096, rope_theta=1e6)
CONFIGS = [(1, 2, False), (2, 2, False), (2, 2, True), (1, 4, False)]


def count(folder: str, tp: int, pp: int, sp: bool, tokens: int) -> dict:
    """In each rank: the bytes it sent (and put into TP collectives) in the prefill and in the one decode step."""
    from tplab import LLM, SamplingParams
    from tplab.distributed.parallel_state import count_collectives

    with LLM(folder, tensor_parallel_size=tp, pipeline_parallel_size=pp, sequence_parallel=sp,
             max_num_batched_tokens=512, num_kv_blocks=2 * pp * (tokens // 16 + 2),
             enforce_eager=True) as llm:                  # a CUDA graph's collectives are not counted
        with count_collectives() as seen:
            llm.generate([[t % 1000 + 1 for t in range(tokens)]], SamplingParams(max_tokens=2, ignore_eos=True))
    sends = [r for r in seen if r.op == "send"]
    tp_ops = [r for r in seen if r.op not in ("send", "recv")]
    decode = sends[-2:] if sends else []       # the decode step's pair: one row per rank (SP pads 1 token to t)
    return {"prefill_send": sum(r.nbytes for r in sends) - sum(r.nbytes for r in decode),
            "decode_send": sum(r.nbytes for r in decode), "num_sends": len(sends),
            "tp_bytes": sum(r.nbytes for r in tp_ops)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    from tplab import launch, models
    folder = models.save_random_qwen2(Path.home() / ".cache" / "tplab-bench" / "pipeline-bytes", seed=0, **SHAPE)
    print(f"machine: {machine()}")
    print(f"hidden {SHAPE['hidden_size']}, fp32, a {args.tokens}-token prompt prefilled in chunks of 512, then one decode step")
    print("| t x p | boundaries | per TP rank of a sending stage: decode step | 2K prefill | all sending ranks of one "
          "boundary: decode | 2K prefill | TP collectives per rank, whole run |")
    print("|---|---|---|---|---|---|---|")
    for tp, pp, sp in CONFIGS:
        ranks = launch(count, tp * pp, args=(str(folder), tp, pp, sp, args.tokens), timeout=600)
        first = ranks[0]                                   # stage 0, TP rank 0; every sending rank sends as much
        boundary = ranks[:tp]                              # stage 0's TP ranks: one boundary
        print(f"| {tp} x {pp}{' SP' if sp else ''} | {pp - 1} | {first['decode_send']:,} B | {first['prefill_send']:,} B | "
              f"{sum(r['decode_send'] for r in boundary):,} B | {sum(r['prefill_send'] for r in boundary):,} B | "
              f"{first['tp_bytes']:,} B |")


if __name__ == "__main__":
    main()
