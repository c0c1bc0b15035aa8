"""Where the 16-request row's time goes (``peers.py``'s ``batch16``), tplab eager and compiled against vLLM's
CPU build, in one run:

    .venv/bin/python bench/batch_split.py [--quick] [--rounds 3] [--no-vllm]

1. Each engine runs the same 16 prompts with ``max_tokens=1`` (the prefill, one step) and with
   ``max_tokens=n``; the difference over ``n - 1`` is its decode step at 16 rows. Rounds alternate the
   engines, order reversed every other round; medians.
2. Inside tplab's compiled decode step: the linear layers, the attention ops and the rest of the model's
   forward (the fused loops, the graph's own calls), each timed around its opaque op
   (``tplab.engine.compiled``), by the same difference of a 1-token and an ``n``-token call.
3. The matrix products alone, outside any engine: the model's 97 weight matrices (the LM head included),
   packed for oneDNN as tplab packs them, chained at 16 rows: the floor both engines share (vLLM's
   ``onednn_mm`` on the same shapes took the same time within 1%, measured with its own venv).
Not part of CI: it needs vLLM in ``bench/.peers/vllm`` (``peers.py --setup``), or ``--no-vllm``.
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import Settings, checkpoint, inproc_engine, layer_shapes, machine, median, set_threads  # noqa: E402
from peers import COMPILED, FULL, PEERS_QUICK, QUICK, batch_prompts, release, tplab_engines, tplab_gen  # noqa: E402
from tplab.kernels.gemm import Gemm  # noqa: E402


def engine_split(engines: dict, prompts, n: int, rounds: int) -> dict:
    """Per engine: median seconds of the 1-token call (the prefill) and of the ``n``-token call."""
    times = {k: {"one": [], "full": []} for k in engines}
    for gen in engines.values():
        gen(prompts, 2)                                                    # warm-up (and the compiles)
    names = list(engines)
    for r in range(rounds):
        for k in names if r % 2 == 0 else names[::-1]:
            times[k]["one"].append(engines[k](prompts, 1)[0])
            times[k]["full"].append(engines[k](prompts, n)[0])
    return {k: {w: median(v) for w, v in t.items()} for k, t in times.items()}


def compiled_parts(llm, prompts, n: int) -> dict:
    """ms a decode step spends in the linear layers, in attention, and in the rest of the compiled forward."""
    forward = inproc_engine(llm).runner.model.forward                     # a CompiledForward
    spent = {"linear": 0.0, "attention": 0.0, "forward": 0.0}

    def timed(fn, key):
        def call(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[key] += time.perf_counter() - t0
        return call

    forward.linears[:] = [timed(f, "linear") for f in forward.linears]
    forward.attentions[:] = [timed(f, "attention") for f in forward.attentions]
    inproc_engine(llm).runner.model.forward = timed(forward, "forward")
    gen = tplab_gen(llm)
    out = {}
    for what, tokens in (("one", 1), ("full", n)):
        spent.update(linear=0.0, attention=0.0, forward=0.0)
        gen(prompts, tokens)
        out[what] = dict(spent)
    step = {k: (out["full"][k] - out["one"][k]) / (n - 1) * 1e3 for k in spent}
    step["rest of the forward"] = step["forward"] - step["linear"] - step["attention"]
    return step


def gemm_floor(shape: dict, rows: int, reps: int = 9) -> float:
    """ms for every weight matrix of ``shape`` (the LM head too), oneDNN packed, ``rows`` rows, chained."""
    shapes = list(layer_shapes(shape).values()) * shape["num_hidden_layers"] + [(shape["vocab_size"],
                                                                                shape["hidden_size"])]
    gemm = Gemm(onednn=True, pack=True)
    packed = [gemm.packed(torch.randn(n, k) * 0.02) for n, k in shapes]
    xs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
    times = []
    with torch.inference_mode():
        for _ in range(reps):
            t0 = time.perf_counter()
            for (_, k), w in zip(shapes, packed):
                gemm.linear(xs[k], w)
            times.append(time.perf_counter() - t0)
    return median(times[1:]) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-vllm", action="store_true", help="tplab only")
    args = ap.parse_args()
    s = Settings.make(args.quick)
    if args.quick:                                          # the checkpoint peers.py --quick uses (vLLM runs it)
        s.name, s.shape = "peers-quick", PEERS_QUICK
    set_threads(s.threads)
    ckpt, prompts, n = checkpoint(s), batch_prompts(args.quick), (QUICK if args.quick else FULL)["batch_new"]
    print(f"# {machine()}, {s.threads} torch threads; {len(prompts)} prompts, {sum(map(len, prompts))} prompt "
          f"tokens, {n} new each")
    llms = tplab_engines(ckpt, True, dtype="float32", kv_cache_memory=512 << 20)
    engines = {k: tplab_gen(v) for k, v in llms.items()}
    peer = None
    if not args.no_vllm:
        from peer_setup import Peer
        peer = Peer("vllm", ckpt, tp=1, max_model_len=4096)
        engines["vllm"] = peer.generate
    try:
        split = engine_split(engines, prompts, n, args.rounds)
        parts = compiled_parts(llms[COMPILED], prompts, n)
    finally:
        if peer is not None:
            peer.close()
        release(llms)
    print("| engine | prefill of the 16 prompts (s) | decode step at 16 rows (ms) | tok/s of the call |\n|---|---|---|---|")
    for k, t in split.items():
        step = (t["full"] - t["one"]) / (n - 1) * 1e3
        print(f"| {k} | {t['one']:.2f} | {step:.1f} | {len(prompts) * n / t['full']:.1f} |")
    print("\ntplab compiled, inside a decode step (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
    print(f"the weight matrices alone, oneDNN packed, {len(prompts)} rows: {gemm_floor(s.shape, len(prompts)):.1f} ms")


if __name__ == "__main__":
    main()
