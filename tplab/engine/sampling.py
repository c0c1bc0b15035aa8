"""Sampling parameters and the sampler. Every rank of a TP group holds the same logits and the same
seeded generators, so every rank picks the same token without a broadcast (under pipeline parallelism
the last stage samples and broadcasts its tokens: ``tplab.engine.pipeline_loop``)."""
import numbers
from dataclasses import dataclass

import torch

# A floor, as vLLM's 1e-5: below it the top token takes all the mass (greedy in all but name), and far below it
# (about 1e-37 for logits of 10) logits / temperature overflow fp32 to inf and the softmax is NaN.
MIN_TEMPERATURE = 1e-6


def is_int(v) -> bool:
    """An int (numpy's too), not a bool: True is an int to Python, not to a user."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """How to pick tokens, as in vLLM. ``temperature=0`` is greedy."""
    temperature: float = 0.0
    top_k: int = -1             # keep the k most likely tokens; -1 keeps all
    top_p: float = 1.0          # keep the smallest set with this much probability mass
    max_tokens: int = 16        # tokens to generate per prompt
    ignore_eos: bool = False    # keep going past the end-of-sequence token
    seed: int | None = None     # per-request seed; None uses the LLM's seed and the prompt's index

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field out of range; ``generate`` checks again (fields can change)."""
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0 (0 is greedy), got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature {self.temperature!r} is too small to sample with (the top token takes all "
                             f"the mass; far smaller, the logits overflow): use 0 for greedy, or at least "
                             f"{MIN_TEMPERATURE:g}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (all tokens) or a positive int, got {self.top_k!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.seed is not None and (not is_int(self.seed) or not -2 ** 63 <= self.seed < 2 ** 64):
            raise ValueError(f"seed must be None or an int a torch.Generator takes, in [-2**63, 2**64), "
                             f"got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """(V,) logits / temperature with everything outside top-k and top-p set to -inf."""
    logits = logits / p.temperature
    if 0 < p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = probs.cumsum(-1) - probs >= p.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]):
    """logits ``(B, V)`` -> next tokens ``(B,)`` and their logprobs under the model ``(B,)``."""
    logits = logits.float()
    logprobs = logits.log_softmax(-1)
    # the first index of the row's max, as argmax gives it: torch's max over a dim runs faster than its
    # argmax on CPU (docs/performance-journal.md)
    tokens = logits.max(-1).indices
    for b, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy:
            probs = _filtered(logits[b], p).softmax(-1)
            # the request's generator lives on the CPU (the same draws on every device): so does what it draws from
            tokens[b] = torch.multinomial(probs.cpu(), 1, generator=g).item()
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)
