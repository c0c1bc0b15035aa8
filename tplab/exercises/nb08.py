"""Notebook 08 (experts across ranks): the router, and what it does on real text.

``check_select_experts(fn)`` compares the learner's ``fn(router_logits, top_k, renormalize)`` -> ``(weights, ids)``
with HF's own router (``Qwen3MoeTopKRouter``) on the hidden states that reach each layer's router of the shipped
trained MoE model, with ``norm_topk_prob`` true and false, in fp32 and bf16; the usual mistakes are named: the
weights not renormalised where the model says to (or renormalised where it says not to, or by a sum over the
tokens, not each token's own), the softmax taken over the k chosen logits, or in bf16, the weights not cast back to
the logits' dtype.

``router_choices(hf, ids)`` returns HF's routing of a prompt in every MoE layer (the notebook's load plot and load
imbalance), and ``rank_shares(choices, num_experts, ep_size)`` each rank's share of the pairs under expert
parallelism.
"""
import functools

import torch

from tplab.exercises import FORGOT_RETURN, run_checker

PROMPT = "Once upon a time, in a cozy little house, there lived a happy girl named Zoe. She loved to help her mom."


def router_choices(hf, ids: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """HF's routing of ``ids`` in each MoE layer of ``hf`` (an HF MoE model): ``{layer: {"hidden": (T, E) the
    router's input, "logits": (T, X), "weights": (T, k), "ids": (T, k)}}``, from hooks on each ``mlp.gate``."""
    seen, hooks = {}, []
    for i, layer in enumerate(hf.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "top_k"):           # an MoE block's router (a dense MLP has none)
            hooks.append(gate.register_forward_hook(_keep_routing(seen, i)))
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return seen


def _keep_routing(seen: dict, i: int):
    """A forward hook for layer ``i``'s router: its input and its outputs (logits, weights, ids) into ``seen[i]``."""
    def hook(router, args, out):
        seen[i] = dict(zip(("hidden", "logits", "weights", "ids"), (args[0].detach(), *out)))
    return hook


def rank_shares(choices: dict, num_experts: int, ep_size: int) -> torch.Tensor:
    """``(layers, ep_size)``: each rank's share of a layer's (token, expert) pairs when ``ep_size`` ranks hold
    ``num_experts / ep_size`` experts each, in order (rank r: experts ``r X / ep_size ...``)."""
    rows = []
    for layer in sorted(choices):
        per_expert = torch.bincount(choices[layer]["ids"].flatten(), minlength=num_experts).float()
        rows.append(per_expert.view(ep_size, -1).sum(-1) / per_expert.sum())
    return torch.stack(rows)


@functools.lru_cache(maxsize=1)
def _routers():
    """HF's router modules of the shipped MoE model and the hidden states that reach each on ``PROMPT``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from tplab.models import tiny_moe
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe(), dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(tiny_moe()).encode(PROMPT)
    choices = router_choices(hf, ids)
    return [(hf.model.layers[i].mlp.gate, c["hidden"]) for i, c in sorted(choices.items())]


def _hf_route(router, hidden, renormalize: bool, dtype):
    """HF's router with ``norm_topk_prob`` set to ``renormalize``, in ``dtype``: (logits, weights, ids)."""
    saved, router.norm_topk_prob = router.norm_topk_prob, renormalize
    try:
        with torch.no_grad():
            logits, weights, ids = router.to(dtype)(hidden.to(dtype))
    finally:
        router.norm_topk_prob = saved
        router.float()
    return logits, weights, ids


def _by_id(weights, ids):
    """The pairs of each row sorted by expert id: the order of the k is not part of the answer."""
    ids, where = ids.sort(dim=-1)
    return weights.gather(-1, where), ids


def _mistake(got_w, logits, ids, renormalize: bool) -> str:
    """The usual mistake that gives weights ``got_w`` (each row's k in the order of ``ids``), or ""."""
    top = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, ids)     # (T, k): the softmax's own
    near = lambda a, b: torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3)   # noqa: E731 (bf16 too)
    if renormalize and near(got_w, top):
        return ("the weights are not renormalised where the model says to (norm_topk_prob true): divide the k "
                "weights by their sum, so that each token's add up to 1")
    sums = got_w.float().sum(-1)
    if renormalize and not torch.allclose(sums, torch.ones_like(sums), atol=1e-2):
        slot = top.argsort(-1, descending=True).argsort(-1)              # each weight's place in topk's order
        by_column = top.sort(-1, descending=True).values.sum(0)[slot]     # weights.sum(dim=0): over the tokens
        over_tokens = any(near(got_w, top / s) for s in (top.sum(), by_column))
        return (f"each token's k weights must sum to 1 (norm_topk_prob true), the first token's sum to "
                f"{float(sums[0]):.3g}" + (": yours are divided by a sum over the tokens (weights.sum() or "
                "weights.sum(dim=0)), not by each token's own" if over_tokens else "") +
                ": divide by weights.sum(dim=-1, keepdim=True)")
    renormalised = top / top.sum(-1, keepdim=True)
    if not renormalize and torch.equal(got_w.float(), renormalised):               # as HF divides, to the bit
        return "the weights are renormalised where the model says not to (norm_topk_prob false): leave them as they are"
    if not renormalize and near(got_w, torch.softmax(logits.float().gather(-1, ids), dim=-1)):
        return ("the softmax is taken over the k chosen logits: that is the renormalised weights; with "
                "norm_topk_prob false the weights are the softmax over all X experts, left as they are")
    return ""


def _compare(fn):
    cases = 0
    for layer, (router, hidden) in enumerate(_routers()):
        for renormalize in (True, False):
            for dtype in (torch.float32, torch.bfloat16):
                logits, hf_w, hf_ids = _hf_route(router, hidden, renormalize, dtype)
                got = fn(logits.clone(), router.top_k, renormalize)
                if got is None:
                    return False, FORGOT_RETURN
                where = f"layer {layer}, norm_topk_prob {renormalize}, {str(dtype).removeprefix('torch.')}"
                why = _problem(got, logits, hf_w, hf_ids, router.top_k, renormalize)
                if why:
                    return False, f"{where}: {why}"
                cases += 1
    return True, f"equal to HF's router on {cases} cases (every layer, norm_topk_prob true and false, fp32 and bf16)"


def _problem(got, logits, hf_w, hf_ids, top_k: int, renormalize: bool) -> str | None:
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(g, torch.Tensor) for g in got)):
        return "return two tensors: (weights, ids), each (T, k)"
    wrong = _form(*got, hf_ids)
    if wrong:
        return wrong
    (w, ids), (ref_w, ref_ids) = _by_id(*got), _by_id(hf_w, hf_ids)
    if not torch.equal(ids, ref_ids):
        t = int((ids != ref_ids).any(-1).nonzero()[0])
        return (f"ids are not the k most likely experts of each token: token {t} has experts {ids[t].tolist()}, "
                f"HF's top {top_k} are {ref_ids[t].tolist()} (topk of the softmax over all X experts)")
    if w.dtype != ref_w.dtype:
        return (f"weights in {w.dtype}, but the logits are {logits.dtype}: take the softmax in fp32, then cast the "
                "weights back to the logits' dtype (.to(router_logits.dtype)), as HF does")
    matches = torch.equal(w, ref_w) if logits.dtype != torch.float32 else torch.allclose(w, ref_w, rtol=1e-6, atol=1e-7)
    if matches:
        return None
    why = _mistake(w, logits, ids, renormalize)
    if not why and logits.dtype == torch.bfloat16:
        why = ("not HF's to the bit in bf16: take the softmax in fp32 (dtype=torch.float32), renormalise in fp32, "
               "and only then cast the weights to bf16")
    return why or f"weights {w[0].tolist()} for the first token, HF's {ref_w[0].tolist()}"


def _form(w, ids, hf_ids) -> str:
    """What is wrong with the shapes or dtypes of (weights, ids), or ""."""
    want = tuple(hf_ids.shape)
    if not w.is_floating_point() and ids.is_floating_point():
        return f"you returned (ids, weights) ({w.dtype}, {ids.dtype}); return (weights, ids)"
    if tuple(w.shape) != want or tuple(ids.shape) != want:
        return (f"weights {tuple(w.shape)} and ids {tuple(ids.shape)}: each must be (T, k) = {want}, "
                "one row of k per token")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        return f"ids are {ids.dtype}: return the experts' indices as an integer tensor (topk's indices)"
    if not w.is_floating_point():
        return f"weights are {w.dtype}: return the routing weights, floats in the logits' dtype"
    return ""


def check_select_experts(fn):
    """``fn(router_logits, top_k, renormalize)`` -> ``(weights, ids)``, against HF's router on the trained model."""
    return run_checker("select_experts", fn, _compare)
