"""The rounds of ``bench/peers.py`` and its rows: each engine as a ``generate(prompts, n) -> (seconds, tokens)``,
rounds that alternate the engines (order reversed every other round), and the rows made of their rates.
"""
import time

import torch

import common
from common import Row, log, median, paired

COMPILED = "tplab compile=True"


def tplab_gen(llm):
    from tplab import SamplingParams

    def generate(prompts, n):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0, [o.token_ids for o in outs]
    return generate


def hf_gen(model):
    def generate(prompts, n):
        (prompt,) = prompts
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=0, eos_token_id=None)
        return time.perf_counter() - t0, [out[0, len(prompt):].tolist()]
    return generate


def rounds(engines: dict, prompts, n, reps, decode_rate: bool, bandwidth: list | None = None):
    """Per round, every engine's rate on ``prompts`` (order reversed every other round); and its tokens.
    ``bandwidth``: a list that gets the read bandwidth (bytes/s, ``x.sum()`` over 1 GiB) measured in each round."""
    rates, tokens = {k: [] for k in engines}, {}
    names = list(engines)
    for e in names:                                             # warm-up
        engines[e](prompts, 2)
    for r in range(reps):
        if bandwidth is not None:
            bandwidth.append(common.read_bandwidth(reps=3)["read_bytes_per_s"])
        for e in (names if r % 2 == 0 else names[::-1]):
            t_full, tokens[e] = engines[e](prompts, n)
            if decode_rate:
                t_one, _ = engines[e](prompts, 1)
                rates[e].append((n - 1) / (t_full - t_one))
            else:
                rates[e].append(len(prompts) * n / t_full)
    log(f"[peers] per-round tok/s: {({k: [round(x, 2) for x in v] for k, v in rates.items()})}")
    return rates, tokens


def row(name, rates, tokens, ours, peer, peer_name, target=">= 1.0", note=""):
    same = tokens[ours] == tokens[peer]
    return Row(name, median(rates[ours]), median(rates[peer]), "tok/s", peer_name,
               ratio=paired(rates[ours], rates[peer]), target=target,
               note=f"greedy tokens {'equal' if same else 'DIFFER'}; per-round tplab "
                    f"{[round(x, 2) for x in rates[ours]]} vs {[round(x, 2) for x in rates[peer]]}. {note}",
               extra={"tokens_equal": same})


def release(llms: dict) -> None:
    """Shut the engines down and give their memory back to the OS now: the engine keeps freed memory mapped
    for its own reuse (``tplab.engine.malloc``), and the next row's engines and peer need it (two fp32 engines
    and vLLM TP 2 beside them ran a 24 GiB machine out of memory)."""
    import ctypes
    import gc
    for llm in llms.values():
        llm.shutdown()
    llms.clear()
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)


def compiled_row(name, rates, tokens, peer, peer_name, target=">= 1.0", note=""):
    """The row of tplab compiled against ``peer``; its tokens also checked equal to tplab eager's."""
    r = row(f"{name}, {COMPILED}", rates, tokens, COMPILED, peer, peer_name, target=target, note=note)
    same = tokens[COMPILED] == tokens["tplab"]
    r.note += f" Greedy tokens {'equal' if same else 'DIFFER from'} tplab eager's."
    r.extra["tokens_equal_eager"] = same
    return r


def bound_row(name, rates, peer, peer_name, bandwidth, per_token) -> Row:
    """tplab's decode rate against the rate the memory allows (every weight read once a token at the read
    bandwidth measured in the same rounds), and the fraction of it that each engine reaches: where batch-1
    decode is bound by memory, the figure that carries from one machine to another."""
    bound = [bw / per_token for bw in bandwidth]                 # tok/s, per round
    fraction = {k: paired(v, bound) for k, v in rates.items()}
    return Row(name, median(rates["tplab"]), median(bound), "tok/s", "bandwidth bound", ratio=fraction["tplab"],
               note=f"{per_token / 1e9:.3f} GB of weights a token; read bandwidth per round "
                    f"{[round(bw / 1e9, 1) for bw in bandwidth]} GB/s; fraction of the bound: "
                    + ", ".join(f"{peer_name if k == peer else k} {f:.2f}" for k, f in fraction.items()),
               extra={"fraction_of_bound": {(peer_name if k == peer else k): f for k, f in fraction.items()},
                      "weight_bytes_per_token": per_token, "read_bytes_per_s": bandwidth})
