"""A step under pipeline parallelism (``pipeline_parallel_size`` p > 1): p batches in flight.

A sequence's next step needs the token its last step sampled, which leaves the last stage p ticks after the
first stage started. So p independent batches (vLLM V0's virtual engines: p schedulers, each with its own
requests and its own share of the KV blocks; V1 queues p batches under one scheduler) keep every stage busy:
at tick k stage s runs virtual engine (k - s) mod p's batch. Every rank runs all p schedulers alike (SPMD).
One tick is one ``LLMEngine.step``: engine k mod p schedules; stage s receives the previous stage's
``(hidden, residual)``, runs its layers and sends its pair on (or samples, on the last stage); the last stage's
tokens are broadcast and every rank postprocesses that batch. A share of blocks per engine, not one pool: a
prefix-cache hit must only find blocks whose chunk its own scheduler has already scheduled.
"""
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from tplab.distributed.parallel_state import broadcast_in_replica
from tplab.engine.sequence import Sequence


class InFlight(NamedTuple):
    """A virtual engine's batch between its schedule and its postprocess (``PipelineLoop.in_flight[v]``)."""
    tick: int                      # the tick it was scheduled in: stage s runs it at tick + s
    batch: list[Sequence]


@dataclass(frozen=True)
class Tick:
    """What one rank's stage did in one tick (``LLM.pipeline_timeline``). Times are ``time.monotonic()``,
    one clock for every process of a machine."""
    tick: int
    stage: int
    virtual_engine: int | None     # None: nothing to run this tick (a bubble)
    num_tokens: int                # tokens of the batch it ran
    start: float                   # when the tick began, before waiting for the previous stage
    busy: float                    # when its input was there and it started computing
    end: float                     # after its send (or its sampling, on the last stage)


def check_stages(stage, num_layers: int, tp_size: int) -> None:
    """Every rank's ``Parts.pipeline_stage`` against the contract, before anything runs (a replacement that gets
    it wrong would otherwise hang or compute silently wrong): the stages' ``layers`` are non-empty, contiguous, in
    order and cover ``range(num_layers)``, only the first has the embedding and only the last the head."""
    mine = (list(stage.layers), bool(stage.has_embedding), bool(stage.has_head))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    stages, end = every[:stage.pp_size * tp_size:tp_size], 0   # each stage's TP rank 0 (of the first DP rank)
    for s, (layers, embedding, head) in enumerate(stages):
        last = s == len(stages) - 1
        if not layers or layers != list(range(end, end + len(layers))):
            raise ValueError(f"pipeline stage {s} owns layers {layers}: each stage needs a non-empty run of "
                             f"consecutive layers starting where the previous stage's ended (layer {end})")
        if embedding != (s == 0) or head != last:
            raise ValueError(f"pipeline stage {s} says has_embedding={embedding}, has_head={head}: only the first "
                             "stage has the embedding, only the last the final norm and LM head")
        end = layers[-1] + 1
    if end != num_layers:
        raise ValueError(f"the pipeline stages own layers 0..{end - 1} but the model has {num_layers}")


class PipelineLoop:
    """This rank's stage of a pipeline with p batches in flight, one tick at a time (``LLMEngine.step``)."""

    def __init__(self, runner, stage, hidden_size: int, dtype: torch.dtype, lockstep: bool = False):
        self.runner, self.stage = runner, stage
        self.decoder = runner.model.model  # the decoder stack (Qwen2Model): forward_stage runs this stage's layers
        self.hidden_size, self.dtype = hidden_size, dtype
        self.lockstep = lockstep         # an MoE model under DP: an idle tick joins its MoE layers' exchanges
        self.in_flight: list[InFlight | None] = [None] * stage.pp_size    # per virtual engine
        self.num_ticks = 0
        self.stranded = False            # a generate stopped with batches between stages (clear)
        self.timeline: list[Tick] = []

    def to_schedule(self) -> int | None:
        """The virtual engine whose turn it is to schedule this tick (tick mod p), or None while its last batch
        is still in flight."""
        v = self.num_ticks % len(self.in_flight)
        return v if self.in_flight[v] is None else None

    def busy(self) -> bool:
        """Whether a batch is in flight."""
        return any(self.in_flight)

    def clear(self) -> None:
        """Forget the batches in flight (``generate`` stopped by an error). A batch in flight has left a stage,
        and the next stage will never receive what it sent: then this loop refuses to run again."""
        self.stranded = self.stranded or self.busy()
        self.in_flight = [None] * len(self.in_flight)

    def run(self, v: int | None, batch: list[Sequence]) -> tuple[int, list[Sequence], list] | None:
        """One tick: ``batch`` (empty: none) enters the pipeline as virtual engine ``v``'s, this stage runs the
        batch of virtual engine ``(tick - stage) mod p`` if it reached this stage now. Returns ``(v, batch,
        tokens)`` for the batch the last stage finished this tick, the tokens shared with every rank; None if
        none did."""
        if self.stranded:
            raise RuntimeError("an earlier generate stopped with batches between pipeline stages, whose sends no "
                               "stage will receive: this engine cannot run again; create a new LLM")
        tick, p = self.num_ticks, len(self.in_flight)
        self.num_ticks += 1
        if batch:
            self.in_flight[v] = InFlight(tick, batch)
        here = (tick - self.stage.pp_rank) % p              # the engine whose batch this stage may run now
        sampled = self._run_stage(tick, self.in_flight[here], here)
        leaving = (tick - p + 1) % p                        # the engine whose batch the last stage ran
        job = self.in_flight[leaving]
        if job is None or job.tick != tick - p + 1:
            return None
        self.in_flight[leaving] = None
        # sampled is that batch's tokens on the last stage (there here == leaving), None on the others
        return leaving, job.batch, self._share(job.batch, sampled)

    def _run_stage(self, tick: int, job: InFlight | None, v: int):
        """This stage's part of tick ``tick``: the batch of virtual engine ``v`` if it reached this stage now."""
        start, stage = time.monotonic(), self.stage
        if job is None or job.tick != tick - stage.pp_rank:
            if self.lockstep:                                # its MoE layers with no tokens (as LLMEngine.step)
                self.runner.model.dummy_forward()
            self.timeline.append(Tick(tick, stage.pp_rank, None, 0, start, start, time.monotonic()))
            return None
        seqs = job.batch
        input_ids, meta = self.runner.prepare(seqs)
        received = None
        if not stage.has_embedding:                          # (rows, E) twice from the previous stage
            rows = self.decoder.boundary_rows(input_ids.shape[0])
            received = stage.recv(rows, self.hidden_size, self.dtype, self.runner.device)
        busy = time.monotonic()
        out = self.decoder.forward_stage(input_ids, received, self.runner.kv_caches_of[v], meta)
        sampled = None
        if stage.has_head:
            sampled = self.runner.sample(seqs, meta.last_token_rows(), out)
        else:
            stage.send(*out)
        self.timeline.append(Tick(tick, stage.pp_rank, v, int(input_ids.shape[0]), start, busy, time.monotonic()))
        return sampled

    def _share(self, seqs, sampled) -> list[tuple[int, float] | None]:
        """The last stage's ``(token, logprob)`` per sequence (None: a prompt chunk that samples nothing), on
        every rank: one broadcast of a ``(B, 2)`` float64 tensor (token ids and float32 logprobs are exact)."""
        buf = torch.full((len(seqs), 2), -1.0, dtype=torch.float64, device=self.runner.device)   # (B, 2)
        if sampled is not None:
            for b, pair in enumerate(sampled):
                if pair is not None:
                    buf[b, 0], buf[b, 1] = pair
        broadcast_in_replica(buf, src=(self.stage.pp_size - 1) * self.runner.model.tp_size)   # last stage's TP rank 0
        return [None if token < 0 else (int(token), logprob) for token, logprob in buf.tolist()]
