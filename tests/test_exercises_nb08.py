"""Notebook 08's checkers. The router (``nb08.check_select_experts``) against HF's on the trained MoE model; the
experts' exchange (``check_part("moe_dispatch" | "moe_combine")``) alone in watched ranks, then at DP 2 in the
engine against HF. The reference solutions pass; each usual mistake is named for what it is, in seconds, a
dispatch that never sends (a hang in the engine) included; a stub is not attempted."""
import re
import sys
import time

import cloudpickle
import pytest
import torch

from tplab.distributed.parallel_state import all_to_all, ep_all_gather
from tplab.exercises import check_part, in_engine, nb08
from tplab.exercises.exchange_probe import PAIRS
from tplab.exercises.solutions import define

cloudpickle.register_pickle_by_value(sys.modules[__name__])    # the mistakes below travel to the ranks by value

dispatch, combine = define("moe_dispatch")["moe_dispatch"], define("moe_combine")["moe_combine"]
select_experts = define("select_experts")["select_experts"]
NAMED_WITHIN_S = 60


@pytest.fixture(scope="module", autouse=True)
def _ranks():
    yield
    in_engine.close_kept_ranks()


def test_the_reference_router_passes_and_a_stub_is_not_attempted():
    assert nb08.check_select_experts(select_experts).ok is True

    def stub(router_logits, top_k, renormalize):
        raise NotImplementedError
    assert nb08.check_select_experts(stub).ok is None


def _softmax_top(logits, k):
    return torch.softmax(logits, -1, dtype=torch.float32).topk(k, -1)


def not_renormalized(logits, k, renormalize):
    w, i = _softmax_top(logits, k)
    return w.to(logits.dtype), i


def always_renormalized(logits, k, renormalize):
    w, i = _softmax_top(logits, k)
    return (w / w.sum(-1, keepdim=True)).to(logits.dtype), i


def softmax_of_the_k(logits, k, renormalize):
    v, i = logits.topk(k, -1)
    return torch.softmax(v.float(), -1).to(logits.dtype), i


def softmax_in_bf16(logits, k, renormalize):
    w, i = torch.softmax(logits, -1).topk(k, -1)
    return (w / w.sum(-1, keepdim=True) if renormalize else w), i


def not_cast(logits, k, renormalize):
    w, i = _softmax_top(logits, k)
    return (w / w.sum(-1, keepdim=True) if renormalize else w), i


def renormalized_over_the_tokens(logits, k, renormalize, dims=()):    # weights.sum(), or .sum(dim=0) with dims (0,)
    w, i = _softmax_top(logits, k)
    return (w / w.sum(*dims) if renormalize else w).to(logits.dtype), i


@pytest.mark.parametrize("fn,words", [
    (not_renormalized, "not renormalised where the model says to"),
    (always_renormalized, "renormalised where the model says not to"),
    (softmax_of_the_k, "softmax is taken over the k chosen logits"),
    (softmax_in_bf16, "take the softmax in fp32"),
    (not_cast, "cast the weights back to the logits' dtype"),
    (renormalized_over_the_tokens, "not by each token's own: divide by weights.sum(dim=-1, keepdim=True)"),
    (lambda logits, k, norm: renormalized_over_the_tokens(logits, k, norm, (0,)), "a sum over the tokens")])
def test_each_router_mistake_is_named(fn, words):
    result = nb08.check_select_experts(fn)
    assert result.ok is False and words in result.message, result.message


def swapped(logits, k, renormalize):
    weights, ids = select_experts(logits, k, renormalize)
    return ids, weights


def one_weight_per_token(logits, k, renormalize):
    weights, ids = select_experts(logits, k, renormalize)
    return weights[:, 0], ids


def least_likely(logits, k, renormalize):
    w, i = torch.softmax(logits, -1, dtype=torch.float32).topk(k, -1, largest=False)
    return (w / w.sum(-1, keepdim=True) if renormalize else w).to(logits.dtype), i


@pytest.mark.parametrize("fn,words", [
    (swapped, re.escape("you returned (ids, weights) (torch.int64, torch.float32); return (weights, ids)")),
    (one_weight_per_token, r"weights \(\d+,\) and ids \(\d+, \d+\): each must be \(T, k\)"),
    (least_likely, r"ids are not the k most likely experts of each token: token \d+ has experts \[\d+, \d+\], "
                   r"HF's top \d+ are \[\d+, \d+\]")])
def test_a_router_answer_of_the_wrong_form_is_named_not_raised(fn, words):
    result = nb08.check_select_experts(fn)
    assert result.ok is False and "raised" not in result.message, result.message
    assert re.search(words, result.message), result.message


@pytest.mark.parametrize("name,impl", [("moe_dispatch", dispatch), ("moe_combine", combine)])
def test_the_reference_exchange_passes_alone_and_in_the_engine(name, impl):
    result = check_part(name, impl)
    assert result.ok is True, result.message
    assert "greedy tokens equal HF's, also with DP rank 1 idle" in result.message


# The dispatch's mistakes ----------------------------------------------------------------------------------------
def _plan(ids, num_experts, ep_size):
    per_rank = num_experts // ep_size
    order = ids.flatten().argsort(stable=True)
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    return per_rank, order, counts


def global_ids(x, ids, num_experts, ep_rank, ep_size):
    received, local, order, traffic = dispatch(x, ids, num_experts, ep_rank, ep_size)
    return received, local + ep_rank * (num_experts // ep_size), order, traffic


def own_counts(x, ids, num_experts, ep_rank, ep_size):
    per_rank, order, counts = _plan(ids, num_experts, ep_size)
    mine = counts.view(ep_size, per_rank).sum(-1).tolist()
    traffic = [mine] * ep_size                                  # every rank as if it sent what this one sends
    received = all_to_all(x[order // ids.shape[1]], traffic)
    return received, torch.zeros(received.shape[0], dtype=torch.long), order, traffic


def transposed(x, ids, num_experts, ep_rank, ep_size):
    per_rank, order, counts = _plan(ids, num_experts, ep_size)
    plan = ep_all_gather(counts, ep_size).view(ep_size, ep_size, per_rank)
    traffic = plan.sum(-1).T.tolist()                           # traffic[j][i]: what rank j receives from i
    return all_to_all(x[order // ids.shape[1]], traffic), None, order, traffic


def idle_skips(x, ids, num_experts, ep_rank, ep_size):
    if x.shape[0] == 0:                                         # nothing to send: nothing to do?
        return x, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), [[0] * ep_size] * ep_size
    return dispatch(x, ids, num_experts, ep_rank, ep_size)


def token_order(x, ids, num_experts, ep_rank, ep_size):
    per_rank, order, counts = _plan(ids, num_experts, ep_size)
    plan = ep_all_gather(counts, ep_size).view(ep_size, ep_size, per_rank)
    traffic = plan.sum(-1).tolist()
    received = all_to_all(x.repeat_interleave(ids.shape[1], 0), traffic)     # the pairs in token order, unsorted
    local = torch.arange(per_rank).repeat(ep_size).repeat_interleave(plan[:, ep_rank].flatten())
    return received, local, order, traffic


def token_indices(x, ids, num_experts, ep_rank, ep_size):
    received, local, order, traffic = dispatch(x, ids, num_experts, ep_rank, ep_size)
    return received, local, order // ids.shape[1], traffic


def _rows_of(x, ids, num_experts, ep_rank, ep_size, rows):
    """The reference dispatch, but sending ``rows(order)`` of x, a learner's mix-up of pair and token indices."""
    per_rank, order, counts = _plan(ids, num_experts, ep_size)
    plan = ep_all_gather(counts, ep_size).view(ep_size, ep_size, per_rank)
    local = torch.arange(per_rank).repeat(ep_size).repeat_interleave(plan[:, ep_rank].flatten())
    return all_to_all(x[rows(order)], plan.sum(-1).tolist()), local, order, plan.sum(-1).tolist()


def rows_at_pair_indices(x, ids, num_experts, ep_rank, ep_size):           # x[order]: raises IndexError
    return _rows_of(x, ids, num_experts, ep_rank, ep_size, lambda order: order)


def rows_at_pair_indices_mod_t(x, ids, num_experts, ep_rank, ep_size):     # x[order % T]: real rows, wrong tokens
    return _rows_of(x, ids, num_experts, ep_rank, ep_size, lambda order: order % x.shape[0])


def never_sends(x, ids, num_experts, ep_rank, ep_size):
    if ep_rank == 1:                                            # rank 1 "has nothing to send"
        return x[:0], torch.zeros(0, dtype=torch.long), ids.flatten().argsort(), [[0, 0], [0, 0]]
    return dispatch(x, ids, num_experts, ep_rank, ep_size)


def keeps_its_rows(x, ids, num_experts, ep_rank, ep_size):
    per_rank, order, counts = _plan(ids, num_experts, ep_size)
    plan = ep_all_gather(counts, ep_size).view(ep_size, ep_size, per_rank)
    received = x[order // ids.shape[1]]                         # the rows, never sent anywhere
    return received, ids.flatten()[order] % per_rank, order, plan.sum(-1).tolist()


def spins(x, ids, num_experts, ep_rank, ep_size):
    while True:
        pass


# The combine's mistakes -----------------------------------------------------------------------------------------
def _back(y, traffic):
    return all_to_all(y, [list(col) for col in zip(*traffic)])


def _sum(rows, tokens, num_tokens):
    return torch.zeros(num_tokens, rows.shape[1]).index_add_(0, tokens, rows.float())


def not_transposed(y, order, traffic, weights):
    back = all_to_all(y, traffic)                                     # as if the way back were the way out
    return _sum(back * weights.flatten()[order].unsqueeze(-1), order // weights.shape[1], weights.shape[0])


def unweighted(y, order, traffic, weights):
    return _sum(_back(y, traffic), order // weights.shape[1], weights.shape[0])


def weights_in_arrival_order(y, order, traffic, weights):
    back = _back(y, traffic)
    return _sum(back * weights.flatten().unsqueeze(-1), order // weights.shape[1], weights.shape[0])


def wrong_tokens(y, order, traffic, weights):
    back, k = _back(y, traffic), weights.shape[1]
    return _sum(back * weights.flatten()[order].unsqueeze(-1), torch.arange(back.shape[0]) // k, weights.shape[0])


def tokens_are_pair_indices(y, order, traffic, weights):             # index_add_ at order: out of bounds
    return _sum(_back(y, traffic) * weights.flatten()[order].unsqueeze(-1), order, weights.shape[0])


def tokens_are_pair_indices_mod_t(y, order, traffic, weights):
    return _sum(_back(y, traffic) * weights.flatten()[order].unsqueeze(-1), order % weights.shape[0], weights.shape[0])


def per_pair(y, order, traffic, weights):
    return _back(y, traffic) * weights.flatten()[order].unsqueeze(-1)


def indexed_add(y, order, traffic, weights):
    out = torch.zeros(weights.shape[0], y.shape[1])
    out[order // weights.shape[1]] += _back(y, traffic).float() * weights.flatten()[order].unsqueeze(-1)
    return out                                                        # a token's repeated index: one write wins


def idle_returns_early(y, order, traffic, weights):
    if weights.shape[0] == 0:
        return torch.zeros(0, y.shape[1])
    return combine(y, order, traffic, weights)


MISTAKES = [("moe_dispatch", global_ids, "global expert ids used as local ones"),
            ("moe_dispatch", own_counts, "split sizes taken from the wrong rank's counts"),
            ("moe_dispatch", transposed, "traffic[i][j] is what rank i sends j"),
            ("moe_dispatch", idle_skips, "every rank must join every exchange"),
            ("moe_dispatch", token_order, "the rows sent to a rank are those of the pairs whose expert it holds"),
            ("moe_dispatch", token_indices, "order holds token indices"),
            ("moe_dispatch", rows_at_pair_indices, f"Hint: a pair index taken for a token index? {PAIRS}"),
            ("moe_dispatch", rows_at_pair_indices_mod_t, f"x's rows at order % T_r (a pair index taken for a token "
                                                         f"index): {PAIRS}"),
            ("moe_dispatch", never_sends, "rank 1 returned without joining"),
            ("moe_dispatch", keeps_its_rows, "nothing was exchanged"),
            ("moe_dispatch", spins, "did not return within"),
            ("moe_combine", not_transposed, "the traffic transposed"),
            ("moe_combine", unweighted, "without their routing weights"),
            ("moe_combine", weights_in_arrival_order, "weighted by another pair's weight"),
            ("moe_combine", wrong_tokens, "tokens combined in the wrong order"),
            ("moe_combine", per_pair, "one row a pair"),
            ("moe_combine", tokens_are_pair_indices, f"Hint: a pair index taken for a token index? {PAIRS}"),
            ("moe_combine", tokens_are_pair_indices_mod_t, f"output i added into token order[i] % T_r (a pair index "
                                                           f"taken for a token index): {PAIRS}"),
            ("moe_combine", indexed_add, "an indexed += (out[order // k] += ...) with a token's index repeated"),
            ("moe_combine", idle_returns_early, "Every rank must join every exchange")]


@pytest.mark.parametrize("name,impl,words", MISTAKES, ids=[m[1].__name__ for m in MISTAKES])
def test_each_exchange_mistake_is_named_in_under_a_minute(name, impl, words):
    start = time.monotonic()
    result = check_part(name, impl)
    assert result.ok is False and words in result.message, result.message
    assert time.monotonic() - start < NAMED_WITHIN_S


def test_a_stub_is_not_attempted():
    def moe_dispatch(x, ids, num_experts, ep_rank, ep_size):
        raise NotImplementedError

    def moe_combine(y, order, traffic, weights):
        raise NotImplementedError
    assert check_part("moe_dispatch", moe_dispatch).ok is None
    assert check_part("moe_combine", moe_combine).ok is None


def test_links_price_calls_and_bytes_as_notebook_00_does():
    from tplab.exercises.links import LINKS, link_bytes, price
    assert link_bytes("all_reduce", 1000, 4) == 1500 and link_bytes("all_gather", 1000, 4) == 3000
    assert link_bytes("all_to_all", 1000, 4, to_others=600) == 600          # the rows a rank keeps never leave it
    beta, alpha = LINKS["InfiniBand NDR"]
    assert price(3, 2 * beta, "InfiniBand NDR") == pytest.approx(3 * alpha + 2.0)
