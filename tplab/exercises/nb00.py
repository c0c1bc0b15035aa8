"""Notebook 00 (why tensor parallelism): all-reduce built by hand as a ring, reduce-scatter then all-gather.

``check_ring_all_reduce(fn)`` runs the learner's ``fn(x) -> tensor`` in real gloo ranks (3, then 2) and
compares what every rank returns with ``dist.all_reduce`` of the same tensors. ``fn`` may use point-to-point
messages only (``send``/``recv``/``isend``/``irecv``); a collective is named and refused (one of
``torch.distributed`` as it is called, so a rank that calls it alone is not left waiting for the others).
A right sum must also be the ring's: a rank that sends more than ``2 (world - 1)`` chunks of ``x`` (whole
tensors round the ring, a star through rank 0, an extra step) is told so.

The inputs say where every value came from: element ``i`` of rank ``r`` is ``8**r + 8**world * i``. A sum
of them reads back as "which ranks, how many times each, from which position", so a wrong result names
the usual mistake: no all-gather phase, a chunk added twice, chunks out of order, nothing exchanged.
"""
import re

import cloudpickle
import torch

from tplab.distributed.launcher import RankError, RankGroup
from tplab.distributed.stacks import RanksDidNotAnswer
from tplab.exercises import ExerciseResult, dist_watch, is_stub_error, not_a_tensor, run_checker, watchdog

WORLD_SIZES = (3, 2)        # 3 first: with 2 ranks, "rank + step" and "rank - step" pick the same chunk
BASE = 8                    # one octal digit per rank: how many times its value was summed in
TIMEOUT_S = 60.0            # a ring whose sends and recvs do not pair up waits forever; stop it
HINT_HANG = ("that never comes. Every send needs a matching recv: send to the right neighbour (rank + 1) % world, "
             "receive from the left one (rank - 1) % world, the same number of steps on every rank. A blocking "
             "dist.send on every rank before its recv waits forever too: dist.isend, then dist.recv, then wait() "
             "on the isend's request (and on every irecv's before you read its buffer)")
HINT_ORDER = ("at reduce-scatter step s, send chunk (rank - s) % world and add what arrives into chunk "
              "(rank - s - 1) % world; at all-gather step s, send chunk (rank + 1 - s) % world and copy what "
              "arrives into chunk (rank - s) % world")


def encoded_input(rank: int, world: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s checker input of ``n`` elements: element ``i`` is ``8**rank + 8**world * i`` (exact in fp32)."""
    return BASE ** rank + BASE ** world * torch.arange(n, dtype=torch.float32)


def _in_rank(blob: bytes, case, bound_s=None):
    """In each rank: the learner's result on one case, dist.all_reduce's, and the collectives fn called.
    ``blob`` is ``fn`` pickled by the parent and loaded here under ``dist_watch.Collectives``, so a cell's
    ``from torch.distributed import all_reduce`` is watched too, and tplab's own collectives are counted.
    ``case`` is a number of elements (the encoded input) or a shape (random values); ``fn`` is stopped after
    ``bound_s`` seconds (``watchdog``)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if isinstance(case, int):
        x = encoded_input(rank, world, case)
    else:
        x = torch.randn(*case, generator=torch.Generator().manual_seed(rank))
    ref, sent = x.clone(), [0]
    dist.all_reduce(ref)

    def counted(original):                                     # the values this rank sends, for the ring's volume
        def send(*args, **kwargs):
            sent[0] += (args[0] if args else kwargs["tensor"]).numel()
            return original(*args, **kwargs)
        return send
    with dist_watch.patched({"send": counted, "isend": counted}), \
            dist_watch.Collectives(refuse=True) as watch:     # torch.distributed's collectives raise at once
        fn = dist_watch.load(blob)
        with watch.block() as seen, watchdog.bounded(bound_s):
            out = fn(x.clone())
    used = [op for op, _ in seen if op not in ("send", "recv")]       # tplab's point-to-point is allowed
    return out, ref, used, sent[0]


def _counts(value: float, i: int, world: int):
    """Decode one output element: per-rank counts, or None when it mixes values from other positions."""
    scale = BASE ** world
    if abs(value - round(value)) > 1e-3:
        return None
    high, low = divmod(round(value), scale)
    counts = [(low // BASE ** r) % BASE for r in range(world)]
    return counts if high == sum(counts) * i else None


def _diagnose_encoded(out: torch.Tensor, rank: int, world: int) -> str | None:
    """None when ``out`` is the all-reduce of the encoded inputs; else the mistake, in words."""
    n = out.numel()
    chunk_of = [k for k, chunk in enumerate(torch.arange(n).tensor_split(world)) for _ in chunk]
    counts = [_counts(v, i, world) for i, v in enumerate(out.reshape(-1).tolist())]
    moved = [i for i, c in enumerate(counts) if c is None]
    if moved:
        i = moved[0]
        return (f"element {i} (chunk {chunk_of[i]}) holds values from other positions: the chunks are out of "
                f"order. {HINT_ORDER}")
    twice = [(i, c) for i, c in enumerate(counts) if max(c) >= 2]
    if twice:
        i, c = twice[0]
        return (f"element {i} (chunk {chunk_of[i]}) counts rank {c.index(max(c))}'s value {max(c)} times: a chunk "
                "was summed twice. What arrives in the all-gather phase is already the full sum: copy it in "
                "(chunk.copy_(incoming)), don't add it")
    partial = [i for i, c in enumerate(counts) if min(c) == 0]
    if not partial:
        return None
    if all(c == [int(r == rank) for r in range(world)] for c in counts):
        return "returned its own input unchanged: nothing was sent or summed"
    full = sorted({chunk_of[i] for i in range(n)} - {chunk_of[i] for i in partial})
    i = partial[0]
    have = [r for r, k in enumerate(counts[i]) if k]
    if full and full != [(rank + 1) % world] and all(counts[i] == [int(r == rank) for r in range(world)]
                                                     for i in partial):
        return (f"chunk {full} holds the sum over all {world} ranks, but chunk {chunk_of[partial[0]]} still holds "
                "only this rank's own values: what was added into it never reached the tensor you return. "
                "`chunks[i] = chunks[i] + incoming` makes a new tensor; add in place (chunks[i] += incoming, or "
                "chunks[i].add_(incoming)) so that the chunks stay views of it")
    if full:
        return (f"only chunk {full} holds the sum over all {world} ranks; chunk {chunk_of[i]} sums ranks {have} "
                f"only: the all-gather phase is missing (after the reduce-scatter, pass each finished chunk "
                f"round the ring, world - 1 more steps)")
    return (f"no chunk holds the sum over all {world} ranks (element {i} sums ranks {have} only): in the "
            f"reduce-scatter, the chunk a rank sends at step s + 1 must be the one it added into at step s, for "
            f"world - 1 = {world - 1} steps; the chunk order is off. {HINT_ORDER}")


def _called(rank: int, op: str) -> str:
    return (f"rank {rank} called the collective {op}: build the all-reduce yourself from point-to-point messages "
            "(dist.isend / dist.recv to the ring neighbours)")


def _judge(world: int, case, per_rank) -> str | None:
    """The first thing wrong with the ranks' results on one case, or None."""
    for rank, (_, _, used, _) in enumerate(per_rank):
        if used:
            return _called(rank, used[0])
    for rank, (out, ref, _, _) in enumerate(per_rank):
        where = f"world size {world}, rank {rank}, x of shape {tuple(ref.shape)}"
        wrong = not_a_tensor(out, "a torch.Tensor shaped like x")
        if wrong:
            return wrong
        if tuple(out.shape) != tuple(ref.shape):
            hint = ": return it shaped like x (x.reshape(-1) in, .view_as(x) out)" if out.numel() == ref.numel() else ""
            return f"{where}: returned shape {tuple(out.shape)}{hint}"
        if out.dtype != ref.dtype:
            return (f"{where}: returned {out.dtype}, but x is {ref.dtype}, the dtype the engine's activations "
                    "have and dist.all_reduce returns: keep x's dtype (chunks of x itself, or buffers made with "
                    "torch.empty_like / dtype=x.dtype)")
        if isinstance(case, int):
            wrong = _diagnose_encoded(out, rank, world)
            if wrong:
                return f"{where}: {wrong}"
        elif not torch.allclose(out.float(), ref, rtol=1e-5, atol=1e-5):
            return f"{where}, random values: differs from dist.all_reduce by up to {float((out.float() - ref).abs().max()):.2e}"
    for rank, (_, ref, _, sent) in enumerate(per_rank):
        n = ref.numel()
        if sent > 2 * (world - 1) * -(-n // world):               # the ring's 2 (world - 1) chunks, rounded up
            return (f"world size {world}, rank {rank}, x of {n} elements: the sum is right, but this rank sent {sent} "
                    f"values, {sent / n:.2f} times x; the ring sends 2 (world - 1) / world = "
                    f"{2 * (world - 1) / world:.2f} times x: one chunk (1 / world of x) per step, world - 1 steps of "
                    "reduce-scatter, then world - 1 of all-gather. Whole tensors, or extra steps, cost more")
    return None


def _rank_error(fn, error: RankError, world: int, case):
    """A learner's exception in a rank, with the line of ``fn`` it came from."""
    summary = str(error).splitlines()[0]
    stuck = watchdog.from_rank(error)
    if stuck:
        return False, f"world size {world}: {stuck}"
    if error.remote_traceback == "" and isinstance(case, int) and case % world:
        return False, (f"world size {world}, x of {case} elements: {summary}. gloo stops a rank whose recv "
                       "buffer is not the size of the message sent to it; with a length not divisible by the "
                       "world size the chunks differ in size, so a rank received one chunk into another's "
                       f"buffer: the chunk order is off. {HINT_ORDER}")
    name = getattr(fn, "__name__", "fn")
    lines = re.findall(rf'line (\d+), in {re.escape(name)}\b', error.remote_traceback)
    first = getattr(getattr(fn, "__code__", None), "co_firstlineno", None)
    where = f" (line {int(lines[-1]) - first + 1} of {name})" if lines and first else ""
    if "Timed out waiting" in summary:                # gloo's own timeout on a recv that nobody answers
        return False, (f"world size {world}: rank {error.rank} timed out in a recv{where}: it waited for a "
                       f"message {HINT_HANG}")
    refused = re.search(r"CollectiveRefused: (\w+)", summary)
    if refused:
        return False, f"world size {world}: {_called(error.rank, refused[1])}{where}"
    if "NotImplementedError" in summary:              # the stub's raise, after some code of the learner's
        return False, f"{summary}{where}: the stub's `raise NotImplementedError` is still there"
    return False, f"{summary}{where}"


def _reraise_untouched_stub(fn) -> None:
    """The stub raises NotImplementedError before anything else: pass that on to ``run_checker`` (which
    reports "not attempted") without starting ranks. Anything else is for the real check, in ranks."""
    try:
        with watchdog.bounded():
            fn(torch.zeros(4))
    except NotImplementedError as e:
        if is_stub_error(fn, e):
            raise
    except (Exception, SystemExit):        # e.g. no process group in this process
        pass


def _cases(world: int) -> list:
    # A length divisible by world first (equal chunks), then one that is not, then any shape.
    return [4 * world, 4 * world + 1, (3, 5)]


def _compare(fn, world_sizes=WORLD_SIZES, timeout=TIMEOUT_S):
    _reraise_untouched_stub(fn)
    blob = cloudpickle.dumps(fn)
    for world in world_sizes:
        case = None
        try:
            with RankGroup(world, backend="gloo", timeout=timeout) as group:
                for case in _cases(world):           # one run each: a rank that dies on one case
                    per_rank = group.run(_in_rank, (blob, case, watchdog.bound_for(timeout)),
                                         straggle=watchdog.STRAGGLE_S)
                    wrong = _judge(world, case, per_rank)     # leaves the verdicts before it
                    if wrong:
                        return False, wrong
        except RankError as e:
            return _rank_error(fn, e, world, case)
        except TimeoutError as e:               # at the timeout, or soon after a rank returned (STRAGGLE_S)
            stuck = e.stragglers() if isinstance(e, RanksDidNotAnswer) else ""
            return False, (f"world size {world}: {stuck or f'no answer within {timeout:g} s'}, so a rank waits for "
                           f"a message {HINT_HANG}")
    return True, (f"equal to dist.all_reduce on every rank at world sizes {', '.join(map(str, world_sizes))}, "
                  "for lengths divisible by the world size and not, and a random (3, 5) tensor, each rank sending "
                  "2 (world - 1) / world of x")


def check_ring_all_reduce(fn, world_sizes=WORLD_SIZES, timeout: float = TIMEOUT_S) -> ExerciseResult:
    """Run ``fn(x)`` in ``world_sizes`` real gloo ranks and compare each rank's result with ``dist.all_reduce``."""
    return run_checker("ring_all_reduce", fn, lambda f: _compare(f, world_sizes, timeout), bound=False)
