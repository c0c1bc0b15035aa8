"""Continuous batching with chunked prefill: which sequences run in the next step, and how many of
their tokens.

Every step has a budget of ``max_num_batched_tokens`` tokens, which bounds a forward pass's activations.
The running sequences come first, oldest first: each decodes one token, or takes its prompt's next chunk.
Waiting prompts then join while there are sequence slots, budget and free blocks; a prompt longer than the
budget left starts with a chunk and continues in the next steps, beside the others' decodes (vLLM's default
scheduling). Only the step that feeds a sequence's last uncached token samples a token for it.
``schedule`` only sets how many tokens each sequence feeds (and, at admission, how many it prefills); after
the step, ``postprocess`` is the one place where its tokens change, and its count of cached tokens changes
only there and in the block manager (``allocate`` sets the cached prefix at admission, ``free`` resets it to 0
when it finishes or is preempted).

When the blocks run out, the most recently admitted running sequence that is not in the middle of its
prefill is preempted: its blocks are freed and it goes back to the front of the waiting queue, to be recomputed
(prompt and generated tokens alike) when there is room. Nothing is lost, and greedy output is the same.
"""
import sys
from collections import deque

from tplab.engine.sequence import Sequence


class Scheduler:
    def __init__(self, block_manager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_ids: frozenset[int] = frozenset(), max_model_len: int = sys.maxsize):
        self.block_manager = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.eos_ids, self.max_model_len = eos_ids, max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []       # in admission order: the newest is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_all(self, empty_block_manager) -> None:
        """Drop every unfinished sequence (a ``generate`` that raised or was interrupted), and the block manager
        with them, for ``empty_block_manager``: full blocks are registered in the prefix cache when allocated
        (a prompt's at admission, a decode's as its token fills one), before a step writes their K/V, so the
        failed step may have left registered blocks that were never written, for a later prompt to read."""
        self.block_manager, self.running, self.waiting = empty_block_manager, [], deque()

    def schedule(self) -> list[Sequence]:
        """The sequences of the next step, each with ``num_scheduled_tokens`` set: the running ones
        (a decode token, or a prompt's next chunk), then newly admitted prompts (whole, or a first chunk)."""
        bm, scheduled, budget = self.block_manager, [], self.max_num_batched_tokens
        unvisited, self.running = self.running, []     # the running ones, each visited once below
        while unvisited:
            seq = unvisited.pop(0)
            if budget == 0:                     # no tokens left this step: it keeps its blocks and waits
                self.running.append(seq)
                continue
            if self._make_room(seq, unvisited):
                bm.may_append(seq)              # a decode's next slot (a prompt mid-prefill has all its blocks)
                budget -= self._take(seq, budget)
                self.running.append(seq)
                scheduled.append(seq)
        # budget > 0 also says every running prompt got all its remaining tokens (a partial chunk empties
        # the budget): only then may a waiting prompt join (_make_room says why)
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            num_cached_blocks = bm.can_allocate(seq)
            if num_cached_blocks is None:
                break
            bm.allocate(seq, num_cached_blocks)  # a cached prefix: fewer tokens to compute
            seq.num_prefill_tokens = len(seq)
            budget -= self._take(seq, budget)
            self.running.append(self.waiting.popleft())
            scheduled.append(seq)
        return scheduled

    def _make_room(self, seq: Sequence, unvisited: list[Sequence]) -> bool:
        """Preempt the newest sequences still in ``unvisited`` until ``seq`` can append, or ``seq`` itself when no
        other is left: whether ``seq`` still runs.

        Never a prompt in the middle of its prefill: with prefix caching the block manager registers a prompt's
        full blocks when it allocates them, and they are all computed by the end of its last chunk's step (a
        layer writes a step's K/V before any sequence of the step reads them); a waiting prompt joins only when
        every running prompt is fully scheduled, so a prefix hit never reads a block not yet computed. Freeing
        a half-computed prompt would leave registered blocks that were never computed."""
        while not self.block_manager.can_append(seq):
            victim = next((s for s in reversed(unvisited) if not s.prefilling), seq)
            self._preempt(victim)
            if victim is seq:
                return False
            unvisited.remove(victim)
        return True

    @staticmethod
    def _take(seq: Sequence, budget: int) -> int:
        """Schedule as many of ``seq``'s uncached tokens as the budget allows; how many."""
        seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
        return seq.num_scheduled_tokens

    def postprocess(self, seqs: list[Sequence], sampled: list[tuple[int, float] | None]) -> list[Sequence]:
        """Record a step that ran ``seqs`` (``ModelRunner.step``'s answer in ``sampled``): their fed tokens
        are cached now, each sampled token is appended, and the sequences it finishes leave and free their
        blocks. Returns those that finished."""
        finished = []
        for seq, token in zip(seqs, sampled):
            seq.num_cached_tokens += seq.num_new_tokens    # before the reset: at 0 it reads "every uncached token"
            seq.num_scheduled_tokens = 0                # consumed: the next step is scheduled anew
            if token is None:                           # a prompt chunk that is not its last: nothing sampled
                continue
            seq.append(*token, self.eos_ids, self.max_model_len)
            if seq.finished:
                self.finish(seq)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)            # recompute later: its K/V are simply dropped
        seq.num_scheduled_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
