"""2. TP 2 against TP 1 on the same machine: what the collectives cost per token, and tokens/s.

TP 1 runs in this process with ``threads`` torch threads (all the cores); TP 2 runs two rank
processes with one thread each (``RankGroup``'s default: cores // world_size), so both use the
same cores. Per decode token a TP 2 rank does 2 all-reduces of (1, hidden) per layer, one more
for the embedding, and one all-gather of the logits shard (1, ceil(vocab / 2)); those are timed
alone in a ``launch()`` of 2 ranks, both as tplab runs them (``tplab.distributed.parallel_state``: shared memory
between ranks of one host) and through gloo (TCP), for contrast.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cloudpickle  # noqa: E402
import torch  # noqa: E402

from common import Row, Settings, interleaved, log, median, paired, prompt_ids, standalone  # noqa: E402
from decode import tplab_generate  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the rank function travels by value


def collective_times(hidden: int, logits_per_rank: int, iters: int) -> dict:
    """Runs in each rank: mean seconds of one all-reduce of (1, hidden) fp32 and one all-gather of
    (1, logits_per_rank) fp32 into a (1, world * logits_per_rank) tensor (with the concatenation)."""
    import time

    import torch
    import torch.distributed as dist
    from tplab.distributed import parallel_state as parallel

    x = torch.ones(1, hidden)
    y = torch.ones(1, logits_per_rank)
    world = dist.get_world_size()

    def all_reduce():
        dist.all_reduce(x)

    def all_gather():
        parts = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(parts, y)
        torch.cat(parts, dim=-1)

    def tplab_all_reduce():
        parallel.all_reduce(x, world)

    def tplab_all_gather():
        parallel.all_gather(y, world, dim=-1)

    out = {"threads": torch.get_num_threads()}
    for name, fn, n in (("all_reduce", all_reduce, iters), ("all_gather", all_gather, max(20, iters // 20)),
                        ("tplab_all_reduce", tplab_all_reduce, iters),
                        ("tplab_all_gather", tplab_all_gather, max(20, iters // 20))):
        for _ in range(max(10, n // 10)):
            fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = (time.perf_counter() - t0) / n
    return out


def run(ckpt, s: Settings) -> list[Row]:
    from tplab import LLM, launch

    torch.set_num_threads(s.threads)
    shape = s.shape
    layers, hidden, vocab = shape["num_hidden_layers"], shape["hidden_size"], shape["vocab_size"]
    per_rank = -(-vocab // 2)
    log(f"[tp] timing collectives in 2 ranks ({s.allreduce_iters} all-reduces of (1, {hidden}))")
    coll = launch(collective_times, world_size=2, args=(hidden, per_rank, s.allreduce_iters), timeout=600)
    t_ar, t_ag, g_ar, g_ag = (max(c[k] for c in coll) for k in
                              ("tplab_all_reduce", "tplab_all_gather", "all_reduce", "all_gather"))
    comm_per_token = (2 * layers + 1) * t_ar + t_ag
    gloo_per_token = (2 * layers + 1) * g_ar + g_ag

    prompt, n = prompt_ids(s.prompt_len), s.tp_new_tokens
    log(f"[tp] TP 1 ({s.threads} threads, this process) vs TP 2 (2 ranks x 1 thread), prompt {len(prompt)}, {n} new")
    tp1 = LLM(ckpt, tensor_parallel_size=1, dtype="float32", kv_cache_memory=256 << 20)
    tp2 = LLM(ckpt, tensor_parallel_size=2, dtype="float32", kv_cache_memory=256 << 20)
    try:
        tplab_generate(tp1, prompt, 4), tplab_generate(tp2, prompt, 4)  # warm-up
        out = {}

        def full(name, llm):
            def go():
                out[name] = tplab_generate(llm, prompt, n)
            return go
        times = interleaved({"tp1_full": full("tp1", tp1), "tp2_full": full("tp2", tp2),
                             "tp1_one": lambda: tplab_generate(tp1, prompt, 1),
                             "tp2_one": lambda: tplab_generate(tp2, prompt, 1)}, reps=s.reps, warmup=0)
    finally:
        tp1.shutdown()
        tp2.shutdown()
    log("[tp] times (s): " + ", ".join(f"{k}={[round(t, 3) for t in v]}" for k, v in times.items()))
    per_round = {w: [(n - 1) / (f - o) for f, o in zip(times[f"{w}_full"], times[f"{w}_one"])] for w in ("tp1", "tp2")}
    rate = {w: median(v) for w, v in per_round.items()}
    same = sum(a == b for a, b in zip(out["tp1"], out["tp2"])) / n
    return [
        Row("all-reduce (1, hidden) fp32, 2 ranks: tplab shm vs gloo", t_ar * 1e6, g_ar * 1e6, "us", "gloo",
            note=f"mean of {s.allreduce_iters}, slower rank; tplab.distributed.parallel_state.all_reduce (shared memory) "
                 f"against dist.all_reduce (gloo, TCP)"),
        Row("all-gather of logits (1, vocab/2): tplab shm vs gloo", t_ag * 1e6, g_ag * 1e6, "us", "gloo"),
        Row("collectives per token at TP2 vs a TP1 token", comm_per_token * 1e3, 1e3 / rate["tp1"], "ms",
            "TP1 ms/token",
            note=f"{2 * layers + 1} all-reduces + 1 all-gather per token = {comm_per_token * 1e3:.2f} ms "
                 f"(through gloo it would be {gloo_per_token * 1e3:.1f} ms); "
                 f"ratio = share of a TP1 decode step; {comm_per_token * rate['tp2']:.0%} of a TP2 step"),
        Row("decode tok/s, TP2 (1 thread/rank) vs TP1", rate["tp2"], rate["tp1"], "tok/s", f"TP1, {s.threads} threads",
            ratio=paired(per_round["tp2"], per_round["tp1"]), target=">= 0.9",
            note=f"(new-1)/(t[{n} new] - t[1 new]), prompt {len(prompt)}; {s.reps} rounds, values: medians, ratio: "
                 f"median of per-round ratios; per-round tok/s TP2 {[round(x, 2) for x in per_round['tp2']]} "
                 f"TP1 {[round(x, 2) for x in per_round['tp1']]}"),
        Row("TP2 greedy tokens equal to TP1's", same, 1.0, "fraction", "TP1 tokens", ratio=same, target=">= 1.0"),
    ], {"collectives": coll, "times_s": times, "tok_s_per_round": per_round, "tp1_tokens": out["tp1"], "tp2_tokens": out["tp2"]}


if __name__ == "__main__":
    standalone(run)
