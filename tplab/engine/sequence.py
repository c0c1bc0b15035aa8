"""A request as the engine tracks it: its tokens, how many of them are in the KV cache, where."""
from dataclasses import dataclass, field

import torch

from tplab.engine.sampling import SamplingParams


@dataclass
class Sequence:
    seq_id: int
    token_ids: list[int]                 # prompt, then generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None
    num_cached_tokens: int = 0           # tokens whose K/V are already in the cache
    num_scheduled_tokens: int = 0        # tokens the scheduler gave the current step (0: none given;
                                         # num_new_tokens then counts every uncached one)
    num_prefill_tokens: int = 0          # tokens it had when (re)admitted: its prefill ends when they are cached
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)   # chained hashes of its full blocks (prefix caching)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None     # "length" or "stop" once finished

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prefilling(self) -> bool:
        """Still computing the tokens it was admitted with (a long prompt takes several steps)."""
        return self.num_cached_tokens < self.num_prefill_tokens

    @property
    def num_new_tokens(self) -> int:
        """Tokens the current step feeds: ``num_scheduled_tokens`` (the scheduler sets it for every sequence it
        schedules); without a scheduler (a sequence made by hand), every uncached one."""
        return self.num_scheduled_tokens or len(self) - self.num_cached_tokens

    def new_token_ids(self) -> list[int]:
        """Tokens to run through the model this step: the next ``num_new_tokens`` uncached ones."""
        return self.token_ids[self.num_cached_tokens:self.num_cached_tokens + self.num_new_tokens]

    def append(self, token: int, logprob: float, eos_ids: frozenset[int], max_model_len: int) -> None:
        """Record a sampled token; mark the sequence finished when it should stop."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if not self.params.ignore_eos and token in eos_ids:
            self.finish_reason = "stop"
        elif len(self.output_token_ids) >= self.params.max_tokens or len(self) >= max_model_len:
            self.finish_reason = "length"
