"""5. Continuous batching with the paged KV cache: ``batch_requests`` concurrent requests against the same
requests one at a time, and the KV memory the paged cache actually held against a contiguous cache
preallocated for every sequence at ``max_position_embeddings``.

Same ``LLM`` (TP 1, this process) for both; the batched call runs before and after the one-at-a-time
loop (mean of the two). Throughput = generated tokens / wall time of the whole call(s).
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import Row, Settings, log, prompt_ids, standalone  # noqa: E402


def run(ckpt, s: Settings) -> list[Row]:
    from tplab import LLM, SamplingParams

    torch.set_num_threads(s.threads)
    n, new = s.batch_requests, s.batch_new_tokens
    prompts = [prompt_ids(s.batch_prompt_len, seed=100 + i) for i in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    log(f"[batching] {n} requests of {s.batch_prompt_len} prompt + {new} new tokens: together vs one at a time")
    llm = LLM(ckpt, tensor_parallel_size=1, dtype="float32", max_num_seqs=n, kv_cache_memory=512 << 20)
    try:
        llm.generate([prompts[0]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up

        def together():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            return time.perf_counter() - t0, [o.token_ids for o in outs]

        t_batch1, batched = together()
        t0 = time.perf_counter()
        alone = [llm.generate([p], params)[0].token_ids for p in prompts]
        t_alone = time.perf_counter() - t0
        t_batch2, _ = together()
        stats = llm.stats()
    finally:
        llm.shutdown()
    t_batch = (t_batch1 + t_batch2) / 2
    log(f"[batching] together {t_batch1:.2f} s / {t_batch2:.2f} s, one at a time {t_alone:.2f} s; stats {stats}")
    tokens = n * new
    same = sum(a == b for a, b in zip(batched, alone)) / n

    cfg = s.shape
    bytes_per_block = stats["kv_cache_bytes"] / stats["num_kv_blocks"]
    bytes_per_token = bytes_per_block / stats["block_size"]
    paged = stats["peak_kv_blocks_used"] * bytes_per_block
    contiguous = n * cfg["max_position_embeddings"] * bytes_per_token
    mib = 1 << 20
    return [
        Row(f"{n} concurrent requests vs one at a time", tokens / t_batch, tokens / t_alone, "tok/s", "one at a time",
            target=">= 5", note=f"{n} x ({s.batch_prompt_len} prompt + {new} new) tokens; together "
                               f"{t_batch1:.1f}/{t_batch2:.1f} s, one at a time {t_alone:.1f} s; outputs "
                               f"{'identical' if same == 1 else f'identical for {same:.0%} of requests'}"),
        Row("KV held by the paged cache vs contiguous max-length cache", paged / mib, contiguous / mib, "MiB",
            f"{n} x {cfg['max_position_embeddings']} tokens",
            note=f"peak_kv_blocks_used {stats['peak_kv_blocks_used']} x {bytes_per_block / 1024:.0f} KiB/block "
                 f"(block_size {stats['block_size']}, {bytes_per_token / 1024:.0f} KiB/token); "
                 f"preemptions {stats['num_preemptions']}"),
    ], {"stats": stats, "t_together_s": [t_batch1, t_batch2], "t_one_at_a_time_s": t_alone,
        "outputs_identical_fraction": same}


if __name__ == "__main__":
    standalone(run)
