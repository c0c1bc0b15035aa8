"""Continuous batching: which sequences run in the next step.

Every step, each running sequence decodes one token, and waiting prompts join as
long as there are sequence slots, token budget and free blocks. Sequences that
finish leave between steps, so a short request never waits for a long one. When
the blocks run out, the most recently admitted running sequence is preempted: its
blocks are freed and it goes back to the front of the queue, to be recomputed
(prompt and generated tokens alike) when there is room again. Nothing is lost, and
greedy output is the same as without the preemption.
"""
from collections import deque

from tplab.engine.sequence import Sequence


class Scheduler:
    def __init__(self, block_manager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []       # in admission order: the newest is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        """The sequences of the next step: decodes of the running ones, then prefills of admitted ones."""
        bm, scheduled = self.block_manager, []
        queue, self.running = self.running, []
        while queue:
            seq = queue.pop(0)
            while not bm.can_append(seq):       # make room: preempt the newest, possibly seq itself
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                bm.may_append(seq)
                self.running.append(seq)
                scheduled.append(seq)
        budget = self.max_num_batched_tokens - len(scheduled)
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_cached_blocks = bm.can_allocate(seq)
            if num_cached_blocks is None:
                break
            # A prompt longer than the whole budget still runs when it is alone, so it cannot starve.
            if len(seq) > budget and scheduled:
                break
            bm.allocate(seq, num_cached_blocks)  # a cached prefix: fewer tokens to compute
            budget -= len(seq) - seq.num_cached_tokens
            self.running.append(self.waiting.popleft())
            scheduled.append(seq)
        return scheduled

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)            # recompute later: its K/V are simply dropped
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
