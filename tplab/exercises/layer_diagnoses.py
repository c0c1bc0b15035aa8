"""Read every rank's probe result (``layer_probes.run_probe``) and say what is right, or which usual
mistake it is. Each ``diagnose_<part>(spec, results, tp)`` returns ``(ok, message)``; the
expected weights and outputs are worked out here from the full tensors, with plain matmuls."""
import torch
import torch.nn.functional as F

from tplab.exercises.layer_probes import D, E, H, H_KV, I, V, device_or_dtype_mistake, vocab_shards

ALL_REDUCE = "tplab.distributed.parallel_state.all_reduce(y, tp_size) or torch.distributed.all_reduce(y)"
# requires_grad=True on a part's parameters is not checked: the engine runs every step under
# torch.inference_mode(), so no graph is recorded, no activation is kept for a backward and no .grad is
# ever allocated; the numbers and the memory are the same as with requires_grad=False.


def _near(got, want: torch.Tensor) -> bool:
    """Whether ``got`` (a part's parameter or output, or None) is a tensor of ``want``'s shape and values."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return False
    return torch.allclose(got.float(), want.float(), atol=1e-5)


def _shape(t) -> tuple:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else ()


NOT_LOADED, ELSEWHERE = -1, -2       # a row that is all NaN (never written), or found in no checkpoint tensor


def _never_written(it: str) -> str:
    """What NaN in a loaded parameter means: the probe builds parts with torch.empty filling NaN
    (``layer_probes.empty_is_nan``)."""
    return f"NaN, torch.empty's values (the checker makes them NaN): the weight_loader never wrote {it}"


def _origin(got: torch.Tensor, want: torch.Tensor, sources: dict, unit: str) -> str | None:
    """Where ``got``'s rows (``unit``) come from in the checkpoint tensors ``sources`` ({name: full tensor}), at the
    first row that is not where ``want``'s is: "rows 0-5 hold up_proj's rows 0-5, expected gate_proj's rows 0-5"."""
    names = [n for n, t in sources.items() for _ in range(len(t))]
    index = [i for t in sources.values() for i in range(len(t))]
    table = torch.cat([t.reshape(len(t), -1) for t in sources.values()]).float()

    def where(rows):           # for each row of rows: its row index in table, NOT_LOADED or ELSEWHERE
        flat = rows.reshape(len(rows), -1).float()
        hits = (flat[:, None] == table[None]).all(-1)
        return [int(h.nonzero()[0]) if h.any() else NOT_LOADED if r.isnan().all() else ELSEWHERE
                for h, r in zip(hits, flat)]
    mine, right = where(got), where(want)
    first = next((i for i, (a, b) in enumerate(zip(mine, right)) if a != b), None)
    if first is None:
        return None
    n, units = 1, {"entry": "entries"}.get(unit, unit + "s")
    while first + n < len(mine) \
            and all(s[first + n] == (s[first] + n if s[first] >= 0 else s[first]) for s in (mine, right)) \
            and all(s[first] < 0 or names[s[first + n]] == names[s[first]] for s in (mine, right)):
        n += 1

    them, hold = ("them", "hold") if n > 1 else ("it", "holds")
    unsourced = {NOT_LOADED: _never_written(them), ELSEWHERE: "numbers that are none of the checkpoint's"}

    def say(at):
        if at < 0:
            return unsourced[at]
        return f"{names[at]}'s {units} {index[at]}-{index[at] + n - 1}" if n > 1 else f"{names[at]}'s {unit} {index[at]}"
    span = f"{units} {first}-{first + n - 1}" if n > 1 else f"{unit} {first}"
    return f"{span} {hold} {say(mine[first])}, expected {say(right[first])}"


def _check_param(results, name, expected, what, sources=None, unit="row") -> str | None:
    """A message for the first rank whose ``name`` differs from ``expected[r]``, else None. With ``sources``
    (the full checkpoint tensors it is cut from), a wrong shard of the right shape says where its rows are from."""
    for r, res in enumerate(results):
        got = res["params"].get(name)
        if got is None:                       # run_probe found a tensor self.<name>, but not among the parameters
            return (f"rank {r}: `self.{name}` is a tensor but not an nn.Parameter, so named_parameters(), where the "
                    f"engine's loader looks weights up, does not list it: make it nn.Parameter(..., requires_grad=False)")
        if _shape(got) != _shape(expected[r]):
            flipped = ("; yours is transposed: keep the checkpoint's (out, in) layout, as nn.Linear does, and compute "
                       "x @ self.weight.T" if len(_shape(got)) == 2 and _shape(got) == _shape(expected[r])[::-1] else "")
            return f"rank {r}: `{name}` has shape {_shape(got)}, expected {_shape(expected[r])} ({what}){flipped}"
        wrong_kind = device_or_dtype_mistake(f"`{name}`", got, expected[r])
        if wrong_kind:
            return f"rank {r}: {wrong_kind}"
        if not _near(got, expected[r]):
            other = next((o for o, want in enumerate(expected) if o != r and _near(got, want)), None)
            if other is not None:
                return (f"rank {r}: `{name}` holds rank {other}'s shard, not its own ({what}): start the narrow at "
                        "this rank's offset, tp_rank * the shard's size")
            if not sources and got.isnan().any():
                part, it = ("", "it") if got.isnan().all() else ("part of ", "that part")
                return f"rank {r}: {part}`{name}` holds {_never_written(it)} ({what})"
            flip = (lambda t: t.T) if unit == "column" else (lambda t: t)
            origin = _origin(flip(got), flip(expected[r]), sources, unit) if sources else None
            return f"rank {r}: `{name}` " + (f"{origin} ({what})" if origin else
                                              f"has the right shape but holds the wrong numbers ({what})")
    return None


def _check_output(results, expected, mistakes) -> tuple[bool, str]:
    """``mistakes``: list of (name, per-rank expected outputs, explanation); first matching rank wins."""
    for r, res in enumerate(results):
        out = res["out"]
        wrong_kind = device_or_dtype_mistake("forward's output", out, expected[r])
        if wrong_kind:
            return False, f"rank {r}: {wrong_kind}"
        if _near(out, expected[r]):
            continue
        for _, outputs, why in mistakes:
            if _near(out, outputs[r]):
                return False, f"rank {r}: {why}"
        if _shape(out) != _shape(expected[r]):
            return False, f"rank {r}: forward returned shape {_shape(out)}, expected {_shape(expected[r])}"
        worst = float((out.float() - expected[r].float()).abs().max())
        return False, f"rank {r}: forward's output differs from the right one by up to {worst:.1e}"
    return True, ""


def diagnose_row_linear(spec, results, tp):
    w, b, x = spec.weights[0][1], spec.weights[1][1], spec.x
    cols = I // tp
    w_r = [w[:, r * cols:(r + 1) * cols] for r in range(tp)]
    bad = _check_param(results, "weight", w_r, "this rank's columns of the (output_size, input_size) weight: "
                       "row parallel splits dim 1, the inputs", {"the checkpoint weight": w.T}, "column")
    if bad and _shape(results[0]["params"].get("weight")) == (E // tp, I) and tp > 1:
        bad += "; yours is the column-parallel shard: rows of dim 0, sharded on the wrong dimension"
    bad = bad or _check_param(results, "bias", [b] * tp, "the bias is not split: it is added once, in full")
    if bad or "out" not in results[0]:                                      # weights only: stop here
        return not bad, bad or ""
    partial = [x[:, r * cols:(r + 1) * cols] @ w_r[r].T for r in range(tp)]        # (T, E) each
    total = sum(partial) + b
    if tp == 1:
        return _check_output(results, [total], [])
    return _check_output(results, [total] * tp, [
        ("no all-reduce", [p + b for p in partial], "returned its own partial sum plus the bias: no all-reduce. "
         f"Each rank holds a slice of the inputs, so the ranks' results must be summed: {ALL_REDUCE}"),
        ("no all-reduce", [p + (b if r == 0 else 0) for r, p in enumerate(partial)],
         f"returned its own partial sum: no all-reduce. Sum the ranks' results with {ALL_REDUCE}"),
        ("twice", [total * tp] * tp, f"the output is {tp}x the right one: reduced twice. One all-reduce adds the "
         "partial sums; a second adds tp_size copies of the total"),
        ("averaged", [total / tp] * tp, f"the output is 1/{tp} of the right one: averaged. The partial sums must be "
         "added (ReduceOp.SUM), not averaged, and not divided by tp_size"),
        ("bias", [total + (tp - 1) * b] * tp, f"the bias is counted {tp} times: added on every rank before the "
         "all-reduce. Add it on rank 0 only, or once after the all-reduce"),
        ("bias on rank 0", [total - (b if r else 0) for r in range(tp)], "the bias is missing on this rank: added "
         "after the all-reduce on rank 0 only. Add it before the all-reduce on rank 0, or after it on every rank"),
        ("gathered", [torch.cat([p + (b if r == 0 else 0) for r, p in enumerate(partial)], -1)] * tp,
         "returned the ranks' partial sums side by side (all-gather): they are parts of one sum, so add them: "
         f"{ALL_REDUCE}"),
    ])


def diagnose_gate_up_linear(spec, results, tp):
    g, u, x = spec.weights[0][1], spec.weights[1][1], spec.x
    rows = I // tp
    right = [torch.cat([g[r * rows:(r + 1) * rows], u[r * rows:(r + 1) * rows]]) for r in range(tp)]
    bad = _check_param(results, "weight", right, "[this rank's gate rows | this rank's up rows]",
                       {"gate_proj": g, "up_proj": u})
    if bad:
        got = results[0]["params"].get("weight")
        fused = torch.cat([g, u])[: 2 * rows]
        if _near(got, fused):
            bad = ("rank 0 holds the first rows of the fused [gate | up] tensor, i.e. gate rows only: each rank "
                   "needs its rows of gate_proj AND its rows of up_proj, so silu(gate) * up pairs up on the rank")
        elif _near(got, torch.cat([u[:rows], g[:rows]])):
            bad = "rank 0 holds [up | gate]: shard_id 0 is gate_proj and goes first, shard_id 1 is up_proj"
        elif _shape(got) == (2 * rows, E) and _near(got[:rows], u[:rows]):
            bad += ("; gate and up were written at the same offset, up over gate: in the fused rows up starts after "
                    "this rank's gate rows, at I / tp (the sum of the local sizes before shard_id) whatever the rank; "
                    "tp_rank only picks the checkpoint rows to narrow")
        elif tp > 1 and _shape(got) == (2 * I, E // tp):
            bad += "; yours keeps every row and a slice of the columns: sharded on the wrong dimension (dim 1)"
        elif tp > 1 and _near(got, torch.cat([t[:, :E // tp].reshape(rows, E) for t in (g, u)])):
            bad = ("rank 0 holds gate's and up's first E / tp input columns (dim 1), reshaped into rows: the "
                   "shape fits, but the numbers belong to other outputs (notebook 02's shard_dim1 bug). Column "
                   "parallel splits the outputs: narrow dim 0, rows [rank * I / tp, (rank + 1) * I / tp)")
    if bad or "out" not in results[0]:                                      # weights only: stop here
        return not bad, bad or ""
    out = [x @ w.T for w in right]                                                  # (T, 2 I / tp)
    return _check_output(results, out, [
        ("gathered", [torch.cat([o for o in out], -1)] * tp, "returned every rank's outputs gathered: column "
         "parallel needs no collective, the next (row-parallel) layer takes this rank's slice"),
        ("reduced", [sum(out)] * tp, "summed over ranks: column parallel needs no all-reduce, each rank keeps its "
         "own output features"),
        ("activated", [F.silu(o[:, :rows]) * o[:, rows:] for o in out], "returned silu(gate) * up: return the fused "
         "[gate | up] output, (T, 2 * I / tp); the MLP applies the activation to it"),
    ])


def diagnose_qkv_linear(spec, results, tp):
    (_, q, _), (_, k, _), (_, v, _), (_, bq, _), (_, bk, _), (_, bv, _) = spec.weights
    nh, nkv, reps = H // tp, max(1, H_KV // tp), max(1, tp // H_KV)

    def rows(t, start, n):
        return t[start * D:(start + n) * D]

    def fused(r, group):
        return [torch.cat([rows(a, r * nh, nh), rows(b_, group * nkv, nkv), rows(c, group * nkv, nkv)])
                for a, b_, c in ((q, k, v), (bq, bk, bv))]
    right = [fused(r, r // reps) for r in range(tp)]
    bad = _check_param(results, "weight", [w for w, _ in right], "rows [q heads | k heads | v heads] of this rank",
                       {"q_proj": q, "k_proj": k, "v_proj": v})
    if bad and reps > 1 and _shape(results[0]["params"].get("weight"))[:1] == (nh * D,):        # no KV rows
        return False, (bad + f"; at TP {tp} there are fewer KV heads ({H_KV}) than ranks, so total_num_kv_heads // "
                       "tp_size is 0: each rank keeps one KV head, a replica, num_kv_heads = max(1, "
                       "total_num_kv_heads // tp_size)")
    if bad and reps > 1:
        for r, res in enumerate(results):
            got = res["params"].get("weight")
            if r // reps != r % H_KV and _near(got, fused(r, r % H_KV)[0]):
                return False, (f"rank {r} keeps KV head {r % H_KV} (r % total_num_kv_heads), but its query heads "
                               f"{list(range(r * nh, (r + 1) * nh))} attend with KV head {r // reps}: with tp_size "
                               f"{tp} > {H_KV} KV heads, each KV head is replicated on {reps} neighbouring ranks, "
                               f"rank r keeps KV head r // {reps}")
    for r, res in enumerate(results if bad else []):
        g, nq = r // reps, nh * D
        swapped = [torch.cat([f[:nq], f[nq + nkv * D:], f[nq:nq + nkv * D]]) for f in fused(r, g)]   # [q | v | k]
        if _near(res["params"].get("weight"), swapped[0]):
            return False, (f"rank {r} holds [q | v | k]: the k and v rows are swapped. shard_id 'k' goes right after "
                           "the q rows and 'v' last, the order in which attention splits the fused output")
    bad = bad or _check_param(results, "bias", [b for _, b in right], "this rank's q | k | v bias",
                              {"q_proj.bias": bq, "k_proj.bias": bk, "v_proj.bias": bv}, "entry")
    if bad or "out" not in results[0]:                                      # weights only: stop here
        return not bad, bad or ""
    return _check_output(results, [spec.x @ w.T + b for w, b in right], [
        ("bias on rank 0", [spec.x @ w.T + (b if r == 0 else 0) for r, (w, b) in enumerate(right)], "the bias is "
         "missing on this rank: added on rank 0 only, as a row-parallel layer does before its all-reduce. A column-"
         "parallel layer's bias is sharded with its rows (this rank's q | k | v entries): add it on every rank"),
        ("no bias", [spec.x @ w.T for w, _ in right], "the bias is not added: y = x @ self.weight.T + self.bias")])


def diagnose_embedding(spec, results, tp):
    w, ids = spec.weights[0][1], spec.x
    per_rank, shard = vocab_shards(w, tp)
    bad = _check_param(results, "weight", shard, f"rows [r * {per_rank}, (r + 1) * {per_rank}) of the vocabulary "
                       "padded to a multiple of tp_size, zeros past the real vocabulary")
    if bad or "out" not in results[0]:                                      # weights only: stop here
        return not bad, bad or ""
    full = w[ids]                                                                   # (T, E)
    owned = [(ids >= r * per_rank) & (ids < (r + 1) * per_rank) for r in range(tp)]  # (T,) each
    looked_up = [shard[r][(ids - r * per_rank).clamp(0, per_rank - 1)] for r in range(tp)]  # ids not owned: clamped
    local = [looked_up[r] * owned[r][:, None] for r in range(tp)]
    unmasked = sum(looked_up)
    not_zeroed = sum(torch.where(owned[r][:, None], looked_up[r], shard[r][0])      # ids not owned: local row 0
                     for r in range(tp))
    return _check_output(results, [full] * tp, [
        ("unmasked", [unmasked] * tp, "ids outside this rank's rows were looked up anyway (clamped, not zeroed): "
         "mask them, i.e. zero the rows of ids the rank does not own, before the all-reduce"),
        ("not zeroed", [not_zeroed] * tp, "the ids this rank does not own were masked to a valid row (local row 0) "
         "but that row was not zeroed: each rank adds its row 0 for every id it does not own. After the lookup, "
         "zero the rows of those ids (y.masked_fill(~mine[:, None], 0)), then all-reduce"),
        ("no all-reduce", local, f"returned only the ids it owns (zeros elsewhere): no all-reduce. {ALL_REDUCE}"),
        ("not shifted", [sum(s[ids.clamp(0, per_rank - 1)] * (ids < per_rank)[:, None] for s in shard)] * tp,
         "every rank looked the ids up as they are, as rows of its own shard: the ids are the whole vocabulary's, "
         f"and rank r's row 0 is id r * {per_rank}. Subtract this rank's first id before the mask and the lookup: "
         "local = input_ids - tp_rank * per_rank"),
        ("twice", [full * tp] * tp, f"{tp}x the right embedding: reduced twice"),
        ("averaged", [full / tp] * tp, f"1/{tp} of the right embedding: averaged, not summed"),
    ])


def diagnose_lm_head(spec, results, tp):
    w, hidden = spec.weights[0][1], spec.x
    per_rank, shard = vocab_shards(w, tp)
    bad = _check_param(results, "weight", shard,
                       f"this rank's {per_rank} rows of the vocabulary padded to a multiple of tp_size")
    if bad or "out" not in results[0]:                                      # weights only: stop here
        return not bad, bad or ""
    local = [hidden @ s.T for s in shard]                                          # (N, per_rank) each
    logits = torch.cat(local, -1)                                                  # (N, per_rank * tp)
    return _check_output(results, [logits[:, :V]] * tp, [
        ("no gather", local, "returned only this rank's slice of the vocabulary: all-gather every rank's "
         "(N, vocab / tp) logits along the last dim"),
        ("padding", [logits] * tp, f"returned {per_rank * tp} logits a token: drop the padding on the last dim, the "
         f"vocabulary, logits[:, :num_embeddings] (the first {V}); logits[:num_embeddings] slices dim 0, the tokens, "
         "and keeps the padding"),
        ("reduced", [sum(local)] * tp, "summed the ranks' logits: they hold different vocabulary rows, so "
         "concatenate them (all-gather), do not add them"),
        ("dim 0", [torch.cat(local, 0)] * tp, "gathered along dim 0: the vocabulary is the last dim"),
    ])


DIAGNOSE = {"row_linear": diagnose_row_linear, "gate_up_linear": diagnose_gate_up_linear,
            "qkv_linear": diagnose_qkv_linear, "embedding": diagnose_embedding, "lm_head": diagnose_lm_head}
