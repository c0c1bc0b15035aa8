"""A learner's ``moe_dispatch`` or ``moe_combine`` alone, in real ranks, every collective it runs watched, so that
what would hang or abort the engine is named at once, from the call itself, instead of at the ranks' timeout:

- a rank that returns without joining an exchange the other ranks wait in (an idle DP rank that skips the
  dispatch when it has no tokens): each collective is first a rendezvous through the process group's store,
  and a rank that has finished without arriving is named within milliseconds;
- split sizes that do not pair up (rank i expects n rows from rank j, which sends it m): refused, every rank
  alike, before gloo sees them (gloo would abort, or wait);
- different collectives, or tensors of different widths, on different ranks at the same point.

The inputs say where each value came from: row t of rank r's ``x`` is ``1000 r + 10 t + f`` in feature f, so a
row that arrives names its sender and token. For the combine, each received row's "expert output" is its row
times ``(global expert id + 1)``, so a sum names the experts and weights that went into it.
"""
import json
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tplab.exercises import dist_watch
from tplab.layers.moe_exchange import all_to_all_dispatch

X, TOP_K, E, WORLD = 8, 2, 4, 2         # experts, per token, hidden size, ranks: rank r holds experts 4r .. 4r + 3
CASES = [(5, 3), (4, 0), (1, 1)]        # each rank's tokens: uneven, rank 1 idle (a DP rank with nothing to run),
                                        # one decode token each
WATCHED = ("all_to_all_single", "all_to_all", "all_gather_into_tensor", "all_gather", "all_reduce", "broadcast",
           "reduce_scatter_tensor", "reduce_scatter")                 # the collectives: every rank calls them


class Refused(BaseException):
    """A collective the watch did not run (a BaseException, so that a learner's ``except Exception`` keeps out)."""


def inputs(case: int, rank: int):
    """Rank ``rank``'s ``x`` ``(T, E)``, ``ids`` ``(T, k)`` (k distinct global experts a token) and routing
    ``weights`` ``(T, k)`` (summing to 1) in case ``case``; the same here and in the ranks."""
    tokens, gen = CASES[case][rank], torch.Generator().manual_seed(100 * case + rank)
    ids = torch.stack([torch.randperm(X, generator=gen)[:TOP_K] for _ in range(tokens)]) if tokens else \
        torch.empty(0, TOP_K, dtype=torch.long)
    x = 1000.0 * rank + 10.0 * torch.arange(tokens, dtype=torch.float32)[:, None] + torch.arange(E)[None, :]
    weights = torch.rand(tokens, TOP_K, generator=gen) + 0.5
    return x, ids, weights / weights.sum(-1, keepdim=True)


def expert_outputs(received: torch.Tensor, local: torch.Tensor, rank: int) -> torch.Tensor:
    """What the combine is handed: each received row's "expert output", its row times (global expert + 1)."""
    return received * (local + rank * (X // WORLD) + 1).unsqueeze(-1).float()


class ExchangeWatch:
    """This rank's collectives: each a rendezvous of every rank through the store, checked, then run."""

    def __init__(self, run_id: str, seconds: float):
        self.store, self.rank, self.world = c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
        self.run_id, self.seconds, self.calls, self.problems = run_id, seconds, 0, []

    def wrappers(self) -> dict:
        return {name: (lambda original, name=name: self._watched(name, original)) for name in WATCHED}

    def refuse(self, why: str):
        self.problems.append(why)
        raise Refused(why)

    def done(self) -> None:
        """This rank has finished: a rank still waiting for it in a collective is told at once."""
        self.store.set(f"{self.run_id}/done/{self.rank}", "1")

    def join(self, name: str, info: dict) -> list:
        """Wait until every rank has reached its ``n``-th collective; every rank's ``(name, info)``."""
        n, self.calls = self.calls, self.calls + 1
        key = lambda r: f"{self.run_id}/{n}/{r}"       # noqa: E731
        self.store.set(key(self.rank), json.dumps([name, info]))
        end = time.monotonic() + self.seconds
        while True:
            here = [r for r in range(self.world) if self.store.check([key(r)])]
            if len(here) == self.world:
                return [json.loads(self.store.get(key(r))) for r in range(self.world)]
            away = [r for r in range(self.world) if r not in here]
            gone = [r for r in away if self.store.check([f"{self.run_id}/done/{r}"])]
            if gone or time.monotonic() > end:
                what = "returned without joining" if gone else f"did not reach, within {self.seconds:.3g} s,"
                self.refuse(f"rank {(gone or away)[0]} {what} the {name} that rank(s) {here} waited in (collective "
                            f"{n + 1}): every rank must join every exchange, the same ones in the same order, also a "
                            "rank with no tokens to send (an idle DP rank sends and receives zero rows), or the "
                            "others wait for it forever")
            time.sleep(0.002)

    def _watched(self, name: str, original):
        def call(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            info = {"width": list(tensors[-1].shape[1:]) if tensors else []}
            if name == "all_to_all_single":
                info.update(_splits(*args, **kwargs))
            everyone = self.join(name, info)
            why = _mismatch(everyone)
            if why:
                self.refuse(why)
            return original(*args, **kwargs)
        return call


def _splits(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False) -> dict:
    even = lambda rows: [rows // dist.get_world_size()] * dist.get_world_size()   # noqa: E731
    return {"out": [int(n) for n in (output_split_sizes or even(output.shape[0]))],
            "in": [int(n) for n in (input_split_sizes or even(input.shape[0]))]}


def _mismatch(everyone: list) -> str | None:
    """What does not pair up between the ranks' ``(name, info)`` of one collective (the same words on every rank)."""
    names = [n for n, _ in everyone]
    if len(set(names)) > 1:
        return (f"the ranks ran different collectives at the same point ({names}, rank by rank): a rank skipped an "
                "exchange that the others ran (or ran one more). Every rank must join every exchange, the same ones "
                "in the same order, also a rank with no tokens (an idle DP rank sends and receives zero rows)")
    widths = [info["width"] for _, info in everyone]
    if len(set(map(tuple, widths))) > 1:
        counts = names[0].startswith("all_gather") and {len(w) for w in widths} == {1} and max(widths) == [X]
        return f"the ranks' tensors in {names[0]} have different widths: {widths} (rank by rank)" + (
            f": one entry per expert ({X}) on one rank, fewer on another, as torch.bincount(ids.flatten()) counts "
            "only up to the largest id it sees. Each rank's counts need one entry per expert, also for the experts "
            "none of its tokens chose: torch.bincount(ids.flatten(), minlength=num_experts)" if counts else "")
    if names[0] != "all_to_all_single":
        return None
    for i, (_, mine) in enumerate(everyone):
        for j, (_, theirs) in enumerate(everyone):
            if mine["out"][j] != theirs["in"][i]:
                return (f"split sizes that do not pair up: rank {i} expects {mine['out'][j]} rows from rank {j} (its "
                        f"output split sizes {mine['out']}), but rank {j} sends it {theirs['in'][i]} (its input split "
                        f"sizes {theirs['in']}). The rows rank i receives from rank j are traffic[j][i], counted by the "
                        "sender: split sizes taken from the wrong rank's counts (each rank knows only its own until "
                        "they are all-gathered)")
    return None


def _plain(got):
    """What the part returned, its tensors (alone or in a tuple) detached and on the CPU, to travel back."""
    if isinstance(got, tuple):
        return tuple(_plain(g) for g in got)
    return got.detach().cpu() if isinstance(got, torch.Tensor) else got


def run(blob: bytes, name: str, run_id: str, seconds: float) -> dict:
    """In a rank: the part (``cloudpickle.dumps``'d) on every case, watched; what it returned in each, and what
    the watch refused. ``moe_combine`` is handed tplab's dispatch of the case and its rows' "expert outputs"."""
    from tplab.distributed.layout import init_model_parallel
    rank, world = dist.get_rank(), dist.get_world_size()
    init_model_parallel(1, 1, world, use_shm=False)        # the ranks as DP ranks, every exchange through gloo
    watch, results = ExchangeWatch(run_id, seconds), []
    try:
        with dist_watch.patched(watch.wrappers()):
            part = dist_watch.load(blob)
            for case in range(len(CASES)):
                x, ids, weights = inputs(case, rank)
                if name == "moe_dispatch":
                    results.append(_plain(part(x.clone(), ids.clone(), X, rank, world)))
                else:
                    received, local, order, traffic = all_to_all_dispatch(x, ids, X, rank, world)
                    y = expert_outputs(received, local, rank)
                    results.append(_plain(part(y, order.clone(), [list(r) for r in traffic], weights.clone())))
    except Refused:
        pass
    finally:
        watch.done()
    return {"results": results, "problems": watch.problems}
