"""``check_part("moe_dispatch" | "moe_combine", fn)``: a learner's half of the experts' exchange, judged in two steps.

1. Alone, in 2 real gloo ranks (``exchange_watch``): known tokens and routings, an idle rank among them, every
   collective watched (a rank that never joins, split sizes that do not pair up: named in milliseconds). What
   each rank returns is read back to its sender and token, so the message names the mistake: global expert ids
   used as local ones, the traffic matrix from one rank's counts (or transposed), rows sent to the wrong rank,
   an ``order`` that does not follow them; for the combine, outputs not weighted, weighted by another pair's
   weight, or added into the wrong tokens. A pair index taken for a token index (``x[order]``, ``x[order % T]``;
   ``order`` or ``order % T`` as the combine's tokens) is named in either half, raised or not.
2. Inside the engine: the shipped MoE model (``tplab.models.tiny_moe``) at ``data_parallel_size=2`` with
   ``enable_expert_parallel=True`` and the part swapped in (the other half tplab's), every sublayer of a prefill on
   both DP ranks against HF, then greedy tokens against HF's, one round with both DP ranks busy and one with
   DP rank 1 idle (it joins every exchange with no tokens).
"""
import functools
import re
import uuid

import cloudpickle
import torch

from tplab import golden
from tplab.engine.config import EngineConfig
from tplab.engine.data_parallel import in_prompt_order
from tplab.engine.sampling import SamplingParams
from tplab.exercises import FORGOT_RETURN, ExerciseResult
from tplab.exercises.exchange_watch import CASES, E, X, TOP_K, WORLD, inputs, run
from tplab.exercises.in_engine import NEW_TOKENS, checked, first_diff, hf_reference, kept_ranks
from tplab.exercises.watchdog import bound_for, call_bounded

PER_RANK = X // WORLD
PAIRS = ("order holds pair indices (T_r k of them, T_r tokens with k experts each), not token indices; pair p is "
         "token p // k: index the tokens with order // k")
OUT_OF_BOUNDS = re.compile(r"out of bounds for dimension|index out of range in self")   # a tensor indexed too far
PROMPTS = ["Once upon a time, there was a little", "The cat sat in the sun and", "Tom and his dog went to"]
SHARES = [[[0, 1], [2]], [[0], []]]        # two rounds: both DP ranks busy, then DP rank 1 idle


@functools.lru_cache(maxsize=1)
def reference() -> dict:
    """HF on the shipped MoE model: ``PROMPTS`` (``in_engine.hf_reference``)."""
    from tplab.models import tiny_moe
    return hf_reference(tiny_moe(), PROMPTS)


def true_traffic(case: int) -> list[list[int]]:
    return [[sum(int(e) // PER_RANK == j for e in inputs(case, i)[1].flatten()) for j in range(WORLD)]
            for i in range(WORLD)]


def _segments(rows: int, sizes: list[int]) -> list[slice]:
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    return [slice(a, a + n) for a, n in zip(starts, sizes)] if sum(sizes) == rows else []


def _shape_problem(got, rank: int, case: int) -> str | None:
    if got is None:
        return FORGOT_RETURN
    if not (isinstance(got, tuple) and len(got) == 4):
        return f"returned {type(got).__name__}: return the four values (received, local, order, traffic)"
    received, local, order, traffic = got
    tokens = CASES[case][rank]
    if not all(isinstance(t, torch.Tensor) for t in (received, local, order)):
        given = ", ".join(type(t).__name__ for t in (received, local, order))
        return f"received, local and order must be tensors (traffic a list of lists of ints); yours are {given}"
    if received.dim() != 2 or received.shape[1:] != (E,) or local.shape != (received.shape[0],):
        return f"received {tuple(received.shape)}, local {tuple(local.shape)}: expected (R, E) and (R,), one local id a row"
    if order.shape != (tokens * TOP_K,) or torch.is_floating_point(order):
        return f"order {tuple(order.shape)} {order.dtype}: one integer index a pair, (T_r k,) = ({tokens * TOP_K},)"
    return None


def _traffic_problem(traffic, rank: int, case: int) -> str | None:
    right = true_traffic(case)
    mine = [[int(n) for n in row] for row in (traffic.tolist() if isinstance(traffic, torch.Tensor) else traffic)]
    if mine == right:
        return None
    if mine == [list(col) for col in zip(*right)]:
        return (f"rank {rank}'s traffic is the matrix transposed ({mine}, right: {right}): traffic[i][j] is what "
                "rank i sends rank j, so row i sums to rank i's pairs")
    if mine[rank] == right[rank]:
        return (f"rank {rank}'s traffic has its own row right but not the other ranks' ({mine}, right: {right}): "
                "split sizes taken from the wrong rank's counts. All-gather every rank's counts per expert "
                "(ep_all_gather) and build the whole matrix from them")
    return f"rank {rank}'s traffic is {mine}, but the ranks' pairs make {right} (traffic[i][j]: rows rank i sends j)"


def _sender_token(row: torch.Tensor) -> tuple[int, int] | None:
    """Which rank and token a received row is (its values ``1000 r + 10 t + f``), or None if it is no sent row."""
    rank, rest = divmod(int(row[0]), 1000)
    token = rest // 10
    expected = 1000.0 * rank + 10.0 * token + torch.arange(row.shape[0])
    return (rank, token) if rest % 10 == 0 and torch.equal(row, expected) else None


def _received_problem(got: list, case: int) -> str | None:
    """Rank j's rows: from each source in rank order, the pairs routed to j's experts, each with its local id."""
    for j, (received, local, _, _) in enumerate(got):
        expected, own = sum(row[j] for row in true_traffic(case)), CASES[case][j] * TOP_K
        if received.shape[0] != expected:
            kept = " (every pair of its own: nothing was exchanged? x's rows go to the ranks by all_to_all)" \
                if received.shape[0] == own != expected else ""
            return (f"rank {j} received {received.shape[0]} rows{kept}, but the ranks' pairs routed to its experts "
                    f"{j * PER_RANK} .. {(j + 1) * PER_RANK - 1} are {expected}")
        for s, seg in enumerate(_segments(received.shape[0], [row[j] for row in true_traffic(case)])):
            ids = inputs(case, s)[1]
            want = sorted((t, int(e)) for t in range(ids.shape[0]) for e in ids[t] if int(e) // PER_RANK == j)
            senders = [_sender_token(r) for r in received[seg]]
            if any(r is None or r[0] != s for r in senders):
                return (f"rank {j} received rows from rank {s} that rank {s} does not hold as tokens, or in the place "
                        "of another rank's: send x's rows of the pairs (x[order // k]), grouped by destination rank")
            tokens, ids_given = [r[1] for r in senders], [int(n) for n in local[seg]]
            if want and j > 0 and sorted(zip(tokens, ids_given)) == want:
                return (f"rank {j}'s local ids are the global expert ids {sorted(set(ids_given))}: global expert ids "
                        f"used as local ones. Rank {j} holds experts {j * PER_RANK} .. {(j + 1) * PER_RANK - 1} at local "
                        f"indices 0 .. {PER_RANK - 1}: local = global - ep_rank * (num_experts // ep_size)")
            if sorted(tokens) != sorted(t for t, _ in want):
                mod_t = sorted(p % len(ids) for p, e in enumerate(ids.flatten().tolist()) if e // PER_RANK == j)
                why = (f"x's rows at order % T_r (a pair index taken for a token index): {PAIRS}"
                       if sorted(tokens) == mod_t else "the rows sent to a rank are those of the pairs whose expert it "
                       "holds (sort the pairs by expert)")
                return (f"rank {j} received tokens {sorted(tokens)} of rank {s}, but rank {s}'s tokens routed to experts "
                        f"{j * PER_RANK} .. {(j + 1) * PER_RANK - 1} are {sorted(t for t, _ in want)}: {why}")
            if sorted(zip(tokens, (n + j * PER_RANK for n in ids_given))) != want:
                return (f"rank {j}'s local ids do not say which of its experts each row is for ({ids_given} for tokens "
                        f"{tokens} of rank {s}; their experts: {want})")
    return None


def _order_problem(got: list, case: int) -> str | None:
    """Each sender's ``order`` lists its pairs once, in the order its rows were sent (what the combine relies on)."""
    for s, (_, _, order, traffic) in enumerate(got):
        x, ids = inputs(case, s)[:2]
        pairs = ids.shape[0] * TOP_K
        if sorted(order.tolist()) != list(range(pairs)):
            if sorted(order.tolist()) == sorted(p // TOP_K for p in range(pairs)):
                return (f"rank {s}'s order holds token indices; it must hold pair indices into ids.flatten() (pair p "
                        "is token p // k, slot p % k), so that the combine finds each pair's weight")
            return f"rank {s}'s order is {order.tolist()}: every pair once, an index into ids.flatten() (0 .. {pairs - 1})"
        for j, seg in enumerate(_segments(pairs, traffic[s])):
            received, local = got[j][0], got[j][1]
            there = _segments(received.shape[0], [row[j] for row in traffic])[s]
            if not (torch.equal(received[there], x[order[seg] // TOP_K]) and
                    torch.equal(local[there] + j * PER_RANK, ids.flatten()[order[seg]])):
                return (f"rank {s}'s order does not follow the rows it sent rank {j}, in the order sent: the combine "
                        "gets the outputs back in that order and adds output i into token order[i] // k")
    return None


def dispatch_problem(per_rank: list[dict]) -> str | None:
    for case in range(len(CASES)):
        got = [r["results"][case] for r in per_rank]
        for rank, g in enumerate(got):
            why = _shape_problem(g, rank, case) or _traffic_problem(g[3], rank, case)
            if why:
                return f"case {case + 1} (tokens per rank {CASES[case]}): {why}"
        why = _received_problem(got, case) or _order_problem(got, case)
        if why:
            return f"case {case + 1} (tokens per rank {CASES[case]}): {why}"
    return None


def combine_expected(case: int, rank: int, weighted: bool = True, slot_of=None, token_of=None,
                     pairs=None) -> torch.Tensor:
    """Rank ``rank``'s right combine ``(T_r, E)``: each token's k outputs (its row times (expert + 1)) weighted and
    summed; ``weighted=False``: not weighted; ``slot_of(p)``: pair p weighted by pair ``slot_of(p)``'s weight;
    ``token_of(p)``: pair p's output added into token ``token_of(p)``, not its own; ``pairs``: only these pairs."""
    x, ids, weights = inputs(case, rank)
    flat_w = weights.flatten()
    out = torch.zeros(x.shape)
    for p, e in enumerate(ids.flatten().tolist()):
        if pairs is not None and p not in pairs:
            continue
        w = (flat_w[p if slot_of is None else slot_of(p)]) if weighted else 1.0
        out[p // TOP_K if token_of is None else token_of(p)] += w * x[p // TOP_K] * (e + 1)
    return out


def combine_problem(per_rank: list[dict]) -> str | None:
    for case in range(len(CASES)):
        for rank, r in enumerate(per_rank):
            got, where = r["results"][case], f"case {case + 1} (tokens per rank {CASES[case]}), rank {rank}"
            why = _combined_problem(got, case, rank)
            if why:
                return f"{where}: {why}"
    return None


def _near(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-3)


def _combined_problem(got, case: int, rank: int) -> str | None:
    tokens = CASES[case][rank]
    if got is None:
        return FORGOT_RETURN
    if not isinstance(got, torch.Tensor) or got.dim() != 2:
        return f"returned {type(got).__name__}: return the combined outputs, a (T_r, E) tensor"
    if got.shape[0] == tokens * TOP_K and tokens:
        return (f"{tuple(got.shape)}: one row a pair; a token's k outputs are summed into its row, (T_r, E) = "
                f"({tokens}, {got.shape[1]}): index_add_ at the pair's token, order[i] // k")
    got, order = got.float(), inputs(case, rank)[1].flatten().argsort(stable=True).tolist()
    if _near(got, combine_expected(case, rank)):
        return None
    if not tokens:
        return f"rank {rank} has no tokens, so (0, E); got {tuple(got.shape)}"
    if _near(got, combine_expected(case, rank, weighted=False)):
        return "the outputs are summed without their routing weights: each pair's output times its weight"
    if _near(got, combine_expected(case, rank, slot_of=lambda p: order.index(p))):
        return ("each output is weighted by another pair's weight: back[i] is pair order[i], so its weight is "
                "weights.flatten()[order[i]], not weights.flatten()[i]")
    if _near(got, combine_expected(case, rank, token_of=lambda p: p % tokens)):
        return f"output i added into token order[i] % T_r (a pair index taken for a token index): {PAIRS}"
    first, last = ({p // TOP_K: p for p in pairs} for pairs in (order[::-1], order))   # one pair a token
    if any(_near(got, combine_expected(case, rank, pairs=set(kept.values()))) for kept in (first, last)):
        return ("each token holds one of its k outputs, not their sum: an indexed += (out[order // k] += ...) with a "
                "token's index repeated writes that row once, one pair winning; add them all with "
                "out.index_add_(0, order // k, ...)")
    return (f"tokens combined in the wrong order or from the wrong rows: token 0 got {got[0].tolist()}, expected "
            f"{combine_expected(case, rank)[0].tolist()}. The outputs come back in the order the pairs were sent "
            "(the traffic transposed): output i is pair order[i], token order[i] // k")


def moe_config(name: str, impl) -> EngineConfig:
    """The shipped MoE model at DP 2 (experts over both ranks), with ``impl`` as part ``name``."""
    return EngineConfig(model=reference()["model"], data_parallel_size=WORLD, enable_expert_parallel=True,
                        device="cpu", max_num_batched_tokens=64, parts={name: checked(impl)})


def serve_rounds(cfg: EngineConfig, prompts: list, shares: list) -> list:
    """In a rank: one ``Worker`` of ``cfg`` generates each round's share of ``prompts`` (``shares[k][dp_rank]``)."""
    from tplab.engine.worker import Worker
    worker = Worker(cfg)
    params = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)] * len(prompts)
    return [[ids for ids, _, _ in worker.generate(prompts, params, False, share)] for share in shares]


def _verdict(name: str, acts: list, rounds: list) -> ExerciseResult:
    ref, where = reference(), f"inside the engine at DP {WORLD} with expert parallelism"
    for rank, a in enumerate(acts):
        diff = first_diff(ref["acts"], a)
        if diff:
            return ExerciseResult(name, False, f"{where}, {diff[0]} is the first sublayer that differs from HF on DP "
                                  f"rank {rank}: it {diff[1]}; everything before it matches")
    for k, share in enumerate(SHARES):
        got = in_prompt_order([r[k] for r in rounds], share)
        if got != ref["tokens"][:len(got)]:
            idle = " with DP rank 1 idle" if not share[1] else ""
            return ExerciseResult(name, False, f"{where}: every sublayer of a prefill matches HF, but the greedy "
                                  f"tokens{idle} differ from HF's (decode steps go wrong)")
    return ExerciseResult(name, True, f"alone in {WORLD} ranks it exchanged {len(CASES)} cases right (one rank idle); "
                          f"{where} every sublayer matches HF on both DP ranks, and {len(PROMPTS)} x {NEW_TOKENS} greedy "
                          "tokens equal HF's, also with DP rank 1 idle")


def judge(name: str, impl, timeout: float, on_error) -> ExerciseResult:
    """The two steps of the module docstring; ``on_error(name, impl, error, where, group)`` words an exception."""
    where, bound, group = f"alone in {WORLD} ranks", bound_for(timeout), None
    problem = dispatch_problem if name == "moe_dispatch" else combine_problem
    try:
        group = kept_ranks(WORLD, timeout, "ep")
        per_rank = group.run(call_bounded, (bound, run, cloudpickle.dumps(impl), name, uuid.uuid4().hex, bound / 2),
                             timeout=timeout)
        refused = next((p for r in per_rank for p in r["problems"]), None)
        if refused:
            group.close()                          # a collective may be left half-done: other ranks from now on
        why = refused or problem(per_rank)
        if why:
            return ExerciseResult(name, False, f"{where}: {why}")
        where, ref = f"inside the engine at DP {WORLD}", reference()
        acts = group.run(call_bounded, (bound, golden.stage_activations, moe_config(name, impl), ref["prompts"][0]),
                         timeout=timeout)
        rounds = group.run(call_bounded, (bound, serve_rounds, moe_config(name, impl), ref["prompts"], SHARES),
                           timeout=timeout)
    except TimeoutError as e:
        return ExerciseResult(name, False, f"{where}: the ranks did not finish in time ({e}): an exchange that not "
                              "every rank joins waits forever (a rank with no tokens must still join)")
    except Exception as e:  # the learner's code raised, here or in a rank
        result = on_error(name, impl, e, where, group)
        if result.ok is False and OUT_OF_BOUNDS.search(result.message):       # x[order], index_add_(0, order, ..)
            result.message += f". Hint: a pair index taken for a token index? {PAIRS}"
        return result
    return _verdict(name, acts, rounds)
