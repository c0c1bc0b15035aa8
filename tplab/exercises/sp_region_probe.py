"""A learner's ``sp_norm_region`` alone, in real ranks: known partial sums (different on every rank), a known
residual and a known RMSNorm, for T tokens that the ranks divide and that they do not (a lone decode token
included); every method's output against the right one and against the usual mistakes. Then the idea, not only
the numbers: each method's collectives (``dist_watch``) against SP's own, a reduce-scatter of the padded tokens
in ``add`` and an all-gather in ``norm_gather``, so an all-reduce that keeps this rank's rows is named, with the
bytes it sends against a reduce-scatter's."""
import time

import torch
import torch.nn.functional as F

from tplab.exercises import FORGOT_RETURN, dist_watch
from tplab.exercises.layer_probes import NamedMistake
from tplab.layers.norm import RMSNorm

E = 8                                   # hidden size: small, divisible by every TP size the check runs at
TOKENS = (5, 1, 8)                      # T: not divisible by 2 or 4, one decode token, divisible by both
SYNC_S = 15.0                           # after a method, how long a rank waits for the others to end it
_RUNS = [0]


class CountingNorm(RMSNorm):
    """The model's RMSNorm, counting the token rows it is given (SP norms each rank's T / t, not all T)."""

    def __init__(self, weight):
        super().__init__(E)
        self.weight.data.copy_(weight)
        self.rows = 0

    def forward(self, x):
        self.rows += x.shape[0]
        return super().forward(x)


def inputs(num_tokens: int, tp_size: int):
    """The same on every rank and here: every rank's partial sums (t, T, E), the residual (T, E), the norm weight."""
    gen = torch.Generator().manual_seed(num_tokens)
    return (torch.randn(tp_size, num_tokens, E, generator=gen), torch.randn(num_tokens, E, generator=gen),
            1.0 + 0.1 * torch.randn(E, generator=gen))


def rows(full: torch.Tensor, rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``full`` (T, ...) padded with zero rows to a multiple of ``tp_size``."""
    per_rank = -(-full.shape[0] // tp_size)
    return F.pad(full, (0, 0, 0, per_rank * tp_size - full.shape[0]))[rank * per_rank:(rank + 1) * per_rank]


CALLS = {"local": "local(full)", "add_first": "add(partial)", "add": "add(partial, residual)",
         "norm_gather": "norm_gather"}               # each method the check calls, as a learner reads it


def _kept(value):
    """What ``run`` sends back of a method's return: a tensor as fp32, None as None, anything else its type's name."""
    if value is None:
        return None
    return value.detach().float() if isinstance(value, torch.Tensor) else type(value).__name__


def run(blob: bytes) -> list[dict]:
    """In a rank: each method of the part (``cloudpickle.dumps``'d) on each T, and the collectives each ran
    (inputs cloned: a method may work in place)."""
    import torch.distributed as dist
    rank, tp_size = dist.get_rank(), dist.get_world_size()
    out = []
    _RUNS[0] += 1                                        # the same count in every rank of a group: store keys
    with dist_watch.Collectives() as watch:
        impl = dist_watch.load(blob)
        for num_tokens in TOKENS:
            partials, residual, weight = inputs(num_tokens, tp_size)
            mine = rows(residual, rank, tp_size)                     # this rank's tokens of the residual
            norm, got, ops = CountingNorm(weight), {}, {}
            calls = {"local": lambda r: r.local(residual.clone()), "add_first": lambda r: r.add(partials[rank].clone()),
                     "add": lambda r: r.add(partials[rank].clone(), mine.clone()),
                     "norm_gather": lambda r: r.norm_gather(mine.clone(), norm)}
            with torch.inference_mode():
                region = impl(num_tokens, rank, tp_size)
                for name, call in calls.items():
                    try:
                        with watch.block() as seen:
                            got[name] = call(region)
                    except Exception as e:               # a method before it may say why (a wrong per_rank...)
                        why = not isinstance(e, NotImplementedError) and _earlier_problem(got, num_tokens, rank,
                                                                                           tp_size)
                        if why:
                            raise NamedMistake(why) from e
                        raise
                    ops[name] = sorted(seen)
                    _arrived(f"sp_region/{_RUNS[0]}/{num_tokens}/{name}", ops[name], name, num_tokens, rank, tp_size)
            out.append({k: _kept(v) for k, v in got.items()} | {"norm_rows": norm.rows, "ops": ops})
    return out


def _earlier_problem(got: dict, num_tokens: int, rank: int, tp: int) -> str | None:
    """In a rank whose method raised: what the methods before it returned wrong, or None."""
    partials, residual, _ = inputs(num_tokens, tp)
    got = {k: _kept(v) for k, v in got.items()}
    why = "local" in got and (_not_tensors(got, rank, tp, num_tokens) or _local_problem(
        got["local"], residual, rank, tp, num_tokens) or next(filter(None, (_check_add(
            got, n, partials, residual, rank, tp, num_tokens) for n in ("add_first", "add") if n in got)), None))
    return f"{why.removeprefix(f'rank {rank}, ')}; the method after it then raised" if why else None


def _arrived(key: str, ops: list, name: str, num_tokens: int, rank: int, tp: int) -> None:
    """Wait (``SYNC_S`` at most) for every rank to end this method: one that ran no collective, or other ones than
    SP's, while another rank still waits inside the method, is told so in seconds, not at the ranks' timeout."""
    import torch.distributed.distributed_c10d as c10d
    store, end = c10d._get_default_store(), time.monotonic() + SYNC_S
    store.set(f"{key}/{rank}", "1")
    while not store.check([f"{key}/{r}" for r in range(tp)]):
        if time.monotonic() > end:
            if [op for op, _ in ops] == [op for op, _ in _sp_ops(num_tokens, tp)[name]]:
                return                                   # a right method: the late rank is named by its own watch
            late = [r for r in range(tp) if not store.check([f"{key}/{r}"])]
            ran = " + ".join(op for op, _ in ops) or "no collective"
            raise NamedMistake(f"T = {num_tokens}: rank(s) {late} had not ended {CALLS[name]} after {SYNC_S:g} s, "
                               f"while rank {rank} ran {ran} in it: a collective waits until every rank calls it, so "
                               "every rank runs the same collectives in the same order (one inside `if tp_rank == "
                               "0:`, or one that a rank skips by returning early, waits for ever)")
        time.sleep(0.005)


def _local_problem(local, residual, rank, tp, num_tokens) -> str | None:
    where = f"rank {rank}, T = {num_tokens} at TP {tp}: local(full)"
    if local is None:
        return f"{where} {FORGOT_RETURN}"
    if _same(local, rows(residual, rank, tp)):
        return None
    per_rank, floor = -(-num_tokens // tp), num_tokens // tp
    if local.shape[0] < per_rank and _same(local, residual[rank * per_rank:(rank + 1) * per_rank]):
        return (f"{where} gave {local.shape[0]} row(s), past the end of the T tokens: pad them with zero rows to "
                f"per_rank * tp_size first (F.pad), so that every rank gets per_rank = {per_rank} rows")
    if num_tokens % tp and _same(local, residual[rank * floor:(rank + 1) * floor]):
        return (f"{where} gave {local.shape[0]} row(s): per_rank = T // tp_size leaves out T % tp_size tokens; "
                "per_rank = ceil(T / tp_size) = -(-T // tp_size), the tokens padded with zero rows to that times tp")
    return (f"{where} must be this rank's rows [r * per_rank, (r + 1) * per_rank) of the tokens padded to a multiple "
            f"of {tp}")


def _same(a, b) -> bool:
    return a is not None and a.shape == b.shape and bool(torch.allclose(a, b, atol=1e-5, rtol=1e-5))


def _add_mistake(got, partials, rank, tp) -> str:
    """What ``add(partial)`` (no residual) did instead of reduce-scattering over tokens, or ""."""
    total = partials.sum(0)                                          # (T, E)
    padded = F.pad(total, (0, 0, 0, -(-total.shape[0] // tp) * tp - total.shape[0]))   # (T_pad, E)
    hidden = padded.narrow(1, rank * E // tp, E // tp).reshape(-1, E)   # reduce-scatter on dim 1, forced back
    if _same(got, total) or _same(got, padded):
        return ("every rank holds every token's sum: that is an all-reduce. Reduce-scatter over tokens (dim 0) "
                "so that rank r keeps only its rows [r * per_rank, (r + 1) * per_rank)")
    if _same(got, rows(partials[rank], rank, tp)):
        return "these are this rank's own partial sums of its tokens, not summed over the ranks: reduce-scatter them"
    if _same(got, hidden):
        return ("the sums were scattered over the hidden dimension (dim 1) and reshaped into this rank's rows: "
                "every row mixes pieces of several tokens. SP splits tokens: reduce_scatter(..., dim=0)")
    return ""


def _residual_mistake(got, residual, rank, tp) -> str:
    """When add(partial) is right and add(partial, residual) is not: what happened to the residual."""
    summed, mine = got["add_first"], rows(residual, rank, tp)
    if tp > 1 and _same(got["add"], summed + tp * mine):
        return (f"the residual was added {tp} times, once per rank (added before the reduce-scatter, which sums it "
                "over the ranks): add it once, after the reduce-scatter")
    other = next((r for r in range(tp) if r != rank and _same(got["add"], summed + rows(residual, r, tp))), None)
    if other is not None:
        return (f"it added rank {other}'s rows of the residual: the residual given to add is already this rank's "
                "(per_rank, E) rows, add it as it is")
    return ("add(partial) is right, so the residual is off: add this rank's (per_rank, E) rows of the residual (the "
            "second argument, as given) once, after the reduce-scatter")


def _check_add(got, name, partials, residual, rank, tp, num_tokens) -> str | None:
    mine = rows(residual, rank, tp)
    want = rows(partials.sum(0), rank, tp) + (0 if name == "add_first" else mine)
    if got[name] is not None and _same(got[name], want):
        return None
    where = f"rank {rank}, T = {num_tokens} at TP {tp}: {CALLS[name]}"
    if got[name] is None:
        return f"{where} {FORGOT_RETURN}"
    if name == "add" and _same(got["add"], got["add_first"]):
        return f"{where} did not add the residual (this rank's tokens of the residual stream, the second argument)"
    shape = f" gave shape {tuple(got[name].shape)}, want {tuple(want.shape)}" if got[name].shape != want.shape else ""
    if name == "add":                                # add(partial) was right (checked first): the residual is off
        return f"{where}{shape}: {_residual_mistake(got, residual, rank, tp)}"
    why = _add_mistake(got[name], partials, rank, tp) or \
        "the values are not the sum over the ranks of this rank's tokens"
    return f"{where}{shape}: {why}"


def _check_norm_gather(got, residual, weight, rank, tp, num_tokens) -> str | None:
    norm = CountingNorm(weight)
    want, x = norm(residual), rows(residual, rank, tp)
    where = f"rank {rank}, T = {num_tokens} at TP {tp}: norm_gather"
    out = got["norm_gather"]
    if out is None:
        return f"{where} {FORGOT_RETURN}"
    if out.shape == (x.shape[0], tp * E):
        return (f"{where} gathered on the hidden dimension ({tuple(out.shape)}): all_gather's dim defaults to -1; "
                "gather tokens, dim=0")
    if not _same(out, want) and _same(out, CountingNorm(weight)(x)):
        return (f"{where} returned this rank's {x.shape[0]} normed rows, not gathered: the next layer needs all T "
                "tokens on every rank, so all_gather(norm(x), tp_size, dim=0) and drop the padding rows")
    if out.shape[0] > num_tokens and _same(out[:num_tokens], want):
        return f"{where} kept the padding rows ({out.shape[0]} rows for {num_tokens} tokens): drop them after gathering"
    if _same(out, torch.cat([rows(residual, r, tp) for r in range(tp)])[:num_tokens]):
        return f"{where} gathered the tokens without the norm: norm this rank's tokens, then gather"
    if _same(out, norm(want)):
        return (f"{where} applied the norm twice (to this rank's tokens, then to the gathered ones): the next "
                "layer takes the gathered tokens as they are")
    if out.shape != want.shape:
        return f"{where} returned shape {tuple(out.shape)}: return the (T, E) = {tuple(want.shape)} normed tokens"
    if not _same(out, want):
        return f"{where} differs from the norm of every token by up to {float((out - want).abs().max()):.1e}"
    if got["norm_rows"] != x.shape[0]:
        return (f"{where} is right, but the norm ran on {got['norm_rows']} token rows on this rank, not its "
                f"{x.shape[0]}: it normed the gathered tokens, the work SP exists to split. Norm, then gather")
    return None


def _sp_ops(num_tokens: int, tp: int) -> dict:
    """Each method's collectives under SP, as (op, bytes put in)."""
    per_rank = -(-num_tokens // tp)
    return {"local": [], "add_first": [("reduce_scatter", tp * per_rank * E * 4)],
            "add": [("reduce_scatter", tp * per_rank * E * 4)], "norm_gather": [("all_gather", per_rank * E * 4)]}


def _collective_problem(results, tp) -> str | None:
    """Once the numbers are right: whether each method ran SP's one collective on SP's bytes, largest T first."""
    for i in sorted(range(len(TOKENS)), key=lambda i: -TOKENS[i]):
        want = _sp_ops(TOKENS[i], tp)
        for rank, per_case in enumerate(results):
            for name, right in want.items():
                if per_case[i]["ops"][name] != right:
                    return _wrong_collectives(name, per_case[i]["ops"][name], right, rank, tp, TOKENS[i])
    return None


RETURNS = {"local": "this rank's (per_rank, E) rows", "add_first": "the (per_rank, E) sums of this rank's tokens",
           "add": "the (per_rank, E) sums of this rank's tokens plus its residual rows",
           "norm_gather": "the (T, E) normed tokens of every rank"}


def _not_tensors(got, rank, tp, num_tokens) -> str | None:
    """A method that returned something other than a tensor or None (``run`` keeps its type's name)."""
    name = next((n for n in RETURNS if isinstance(got.get(n), str)), None)
    if name is None:
        return None
    return (f"rank {rank}, T = {num_tokens} at TP {tp}: {CALLS[name]} returned a {got[name]}, not a tensor: return only "
            f"{RETURNS[name]}")


ALL_REDUCE_WASTE = ("an all-reduce leaves every token's sum on every rank, and keeping this rank's rows throws "
                    "(t - 1) / t of it away: that is plain TP's all-reduce, and with norm_gather's all-gather after it "
                    "each region moves 1.5x plain TP's bytes instead of the same")
ADVICE = {"add": "Reduce-scatter the partial sums, padded with zero rows to per_rank * tp_size (F.pad), over tokens, "
                 "and nothing more: reduce_scatter(padded, tp_size, dim=0)",
          "norm_gather": "Norm this rank's tokens and all-gather them over tokens: all_gather(norm(x), tp_size, dim=0)",
          "local": "Every rank already holds the whole tensor: narrow it to this rank's rows, with no communication"}


def _wrong_collectives(name, ops, right, rank, tp, num_tokens) -> str:
    """What a method that gives the right numbers with the wrong collectives did, with the bytes it sends."""
    ran = " + ".join(f"{op} of {n} B" for op, n in ops) or "no collective"
    should = " + ".join(f"one {op} of {n} B" for op, n in right) or "no collective"
    mine, sp = (sum(dist_watch.sent(op, n, tp) for op, n in x) for x in (ops, right))
    return (f"rank {rank}, T = {num_tokens} at TP {tp}: {CALLS[name]} gives the right numbers, but it ran {ran} (put in) "
            f"where sequence parallelism runs {should}. Counted as notebook 07 counts a ring, it sends {mine:g} B "
            f"from each rank, where SP sends {sp:g} B: " + f"{ALL_REDUCE_WASTE}. " * any(op == "all_reduce" for op, _ in ops)
            + ADVICE[name.removesuffix("_first")])


def diagnose(results: list[list[dict]], tp: int) -> tuple[bool, str]:
    """``results``: ``run``'s list on every rank. (ok, what is wrong with the first wrong output, or the first
    method whose collectives are not SP's)."""
    for i, num_tokens in enumerate(TOKENS):
        partials, residual, weight = inputs(num_tokens, tp)
        for rank, per_case in enumerate(results):
            got = per_case[i]
            why = _not_tensors(got, rank, tp, num_tokens)
            if why:
                return False, why
            why = _local_problem(got["local"], residual, rank, tp, num_tokens) or \
                _check_add(got, "add_first", partials, residual, rank, tp, num_tokens) or \
                _check_add(got, "add", partials, residual, rank, tp, num_tokens) or \
                _check_norm_gather(got, residual, weight, rank, tp, num_tokens)
            if why:
                return False, why
    why = _collective_problem(results, tp)
    if why:
        return False, why
    return True, (f"add, norm_gather and local are right on every rank for T in {TOKENS} at TP {tp}, with one "
                  "reduce-scatter per add and one all-gather per norm_gather")
