"""The engine as one rank runs it: build this rank's shard, load its slices, serve requests.

Every rank of a TP group runs the same scheduler on the same requests with the same number of KV
blocks (SPMD), so they make the same decisions step for step; the only
communication is inside the model's collectives (and, under pipeline parallelism,
between stages: ``tplab.engine.pipeline_loop``). Under data parallelism each DP rank's TP group
serves its own requests; an MoE model's DP ranks step together (``tplab.engine.data_parallel``).
"""
import dataclasses
import functools

import torch
import torch.distributed as dist

from tplab.distributed.parallel_state import dp_any, init_model_parallel, pp_rank_and_size, tp_rank_and_size
from tplab.engine.checks import install_finite_check
from tplab.engine.config import EngineConfig
from tplab.engine.kv_cache import kv_blocks_per_batch, kv_cache_spec, static_max_blocks
from tplab.engine.malloc import keep_freed_memory
from tplab.engine.model_runner import ModelRunner
from tplab.engine.pipeline_loop import PipelineLoop, check_stages
from tplab.engine.progress import Progress
from tplab.engine.sampling import SamplingParams
from tplab.engine.scheduler import Scheduler
from tplab.engine.sequence import Sequence
from tplab.layers.linear_method import hand_out_linear_methods
from tplab.models.loader import LoadReport, checkpoint_names
from tplab.models.pipeline import other_stages_names
from tplab.models.qwen2 import Qwen2ForCausalLM
from tplab.models.registry import model_class, steps_in_lockstep

def eos_token_ids(hf_config) -> frozenset[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    return frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)


def build_model(cfg: EngineConfig, device, tp_rank: int | None = None, tp_size: int | None = None,
                pack: bool = True) -> tuple[Qwen2ForCausalLM, LoadReport]:
    """This rank's shard of the model (the class for the config's ``model_type``: ``tplab.models.registry``),
    built from ``cfg.parts``, with its weight slices read from the checkpoint, and every linear layer handed its
    ``linear_method`` (``Parts.gemm``; ``pack=False`` keeps every weight readable); and what the load read.
    ``tp_rank``/``tp_size`` default to the process group's."""
    tp_rank, tp_size = tp_rank_and_size(tp_rank, tp_size)
    pp_rank, pp_size = pp_rank_and_size()
    if (tp_size, pp_size) != (cfg.tensor_parallel_size, cfg.pipeline_parallel_size):
        raise ValueError(f"tensor_parallel_size={cfg.tensor_parallel_size} x pipeline_parallel_size="
                         f"{cfg.pipeline_parallel_size}, but this rank's group has {tp_size} TP ranks x {pp_size} stages")
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(cfg.dtype)  # parameters are created in the target dtype, on the device
    try:
        with torch.device(device):
            model = model_class(cfg.hf_config.model_type)(cfg.hf_config, cfg.parts, tp_rank, tp_size,
                                                          cfg.sequence_parallel, pp_rank, pp_size,
                                                          cfg.enable_expert_parallel)
    finally:
        torch.set_default_dtype(default_dtype)
    # HF omits a tied lm_head.weight when saving; some checkpoints keep it anyway.
    skip = frozenset({"lm_head.weight"}) if cfg.hf_config.tie_word_embeddings else frozenset()
    if pp_size > 1:   # the other stages' tensors are theirs to read
        skip |= other_stages_names(model, checkpoint_names(cfg.model))
    report = cfg.parts.load_weights(model, cfg.model, skip=skip)
    gemm = cfg.parts.gemm.choose(cfg.onednn, pack and cfg.pack_weights, cfg.dtype, cfg.few_rows_mkl,
                                 cfg.max_num_seqs)
    hand_out_linear_methods(model, gemm)
    return model.eval(), report


def static_decode_maker(cfg: EngineConfig, device: torch.device):
    """``Parts.static_decode`` with the config's sizes, for ``ModelRunner`` to build over its KV cache (None
    where decode steps run eagerly at their own shapes)."""
    if not cfg.static_decode:
        return None
    return functools.partial(cfg.parts.static_decode, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                             max_blocks=static_max_blocks(cfg), device=device, graphs=cfg.cuda_graphs)


class LLMEngine:
    """One rank's engine: the model shard, its paged KV cache, the scheduler and the step loop."""

    def __init__(self, cfg: EngineConfig, device):
        self.cfg, self.device = cfg, torch.device(device)
        if self.device.type == "cpu" and cfg.malloc_tune:
            keep_freed_memory()            # activations reuse mapped pages instead of faulting in new ones
        if dist.is_initialized():          # the stages' (or DP ranks') TP groups; at PP 1 and DP 1 the world
            init_model_parallel(cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.data_parallel_size)
        self.model, self.load_report = build_model(cfg, self.device)
        if cfg.check_finite:
            install_finite_check(self.model)
        stage, pp = self.model.stage, cfg.pipeline_parallel_size
        if pp > 1:
            check_stages(stage, cfg.hf_config.num_hidden_layers, cfg.tensor_parallel_size)
        if cfg.compile:                    # opt-in: torch.compile, eager where it cannot
            from tplab.engine.compiled import compile_model   # here: only compile=True needs dynamo, slow to import
            why_not = ("check_finite=True watches every sublayer" if cfg.check_finite else
                       "pipeline parallelism runs the layers stage by stage" if pp > 1 else None)
            compile_model(self.model, eager_because=why_not)
        spec = kv_cache_spec(cfg, num_layers=len(stage.kv_cache_layers))
        self.runner = ModelRunner(self.model, spec, kv_blocks_per_batch(cfg, spec, self.device), self.device,
                                  cfg.parts.positions, stage.kv_cache_layers, num_virtual_engines=pp,
                                  make_static_decode=static_decode_maker(cfg, self.device), attend=cfg.parts.attend)
        # one scheduler per batch in flight (vLLM V0's virtual engines), each with its own share of the blocks
        self.schedulers = [self._scheduler() for _ in range(pp)]
        self.scheduler = self.schedulers[0]                                # the only one without PP
        # an MoE model's DP ranks step together: one with nothing to run joins the experts' exchanges
        self.lockstep = steps_in_lockstep(cfg.hf_config, cfg.data_parallel_size)
        # under pipeline parallelism: this rank's stage, running the p batches in flight one tick a step
        self.pipeline = (PipelineLoop(self.runner, stage, cfg.hf_config.hidden_size, cfg.dtype, self.lockstep)
                         if pp > 1 else None)
        self.num_idle = 0                  # steps in a row that ran nothing (_check_progress)
        self.num_steps = 0                 # batches run to the end (postprocessed)

    def _scheduler(self) -> Scheduler:
        """A scheduler with its own block manager over ``runner.num_blocks`` blocks."""
        cfg = self.cfg
        return Scheduler(self._new_block_manager(), cfg.max_num_seqs, cfg.max_num_batched_tokens,
                         eos_token_ids(cfg.hf_config), cfg.hf_config.max_position_embeddings)

    def _new_block_manager(self):
        """An empty block manager (``Parts.block_manager``) over ``runner.num_blocks`` blocks."""
        return self.cfg.parts.block_manager(self.runner.num_blocks, self.cfg.block_size, self.cfg.enable_prefix_caching)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams], use_tqdm: bool = False,
                 indices: list[int] | None = None) -> list[Sequence]:
        """Serve every prompt with continuous batching; returns the finished sequences in prompt order.
        ``use_tqdm``: rank 0 draws a progress bar on stderr (the driver's, which the ranks share). ``indices``:
        the prompts' places in the caller's list (a DP rank's share), which seed their sampling; default 0, 1, ...
        Under lockstep (``data_parallel``) it steps until no DP rank has work, with nothing of its own too."""
        indices = range(len(prompts)) if indices is None else indices
        seqs = [Sequence(i, list(p), len(p), sp, self._generator(i, sp)) for i, p, sp in zip(indices, prompts, params)]
        bar = Progress(seqs) if use_tqdm and (not dist.is_initialized() or dist.get_rank() == 0) else None
        self.runner.metadata.clear()           # every call numbers its sequences by prompt index again
        if self.pipeline is not None:
            self.pipeline.timeline = []
        for seq in seqs:
            self.add_request(seq)
        try:
            with torch.inference_mode():
                while dp_any(self.has_unfinished()) if self.lockstep else self.has_unfinished():
                    for seq in self.step():
                        if bar is not None:
                            bar.finished(seq)
        except BaseException:               # an error or Ctrl-C: nothing of this call is left for the next one
            for scheduler in self.schedulers:
                scheduler.abort_all(self._new_block_manager())
            if self.pipeline is not None:
                self.pipeline.clear()
            raise
        finally:
            if bar is not None:
                bar.close()
        return seqs

    def add_request(self, seq: Sequence) -> None:
        """Queue ``seq`` on the virtual engine with the fewest unfinished sequences (the only one without
        pipeline parallelism); deterministic, so every rank queues it alike."""
        min(self.schedulers, key=lambda sch: len(sch.waiting) + len(sch.running)).add(seq)

    def has_unfinished(self) -> bool:
        in_flight = self.pipeline is not None and self.pipeline.busy()
        return in_flight or any(sch.has_work() for sch in self.schedulers)

    def step(self) -> list[Sequence]:
        """One step of the engine: schedule a batch, run it through this rank's model, postprocess the tokens
        it sampled. Returns the sequences that finished (the runner forgets their cache slots). Under pipeline
        parallelism a step is one tick instead (``_pipeline_tick``)."""
        if self.pipeline is not None:
            return self._pipeline_tick()
        batch = self.scheduler.schedule() if self.scheduler.has_work() else []         # 1. schedule
        self._check_progress(idle=not batch)
        if not batch:
            if self.lockstep:      # an MoE model's DP ranks step together: join the experts' exchanges, no tokens
                self.model.dummy_forward()
            return []
        tokens = self.runner.step(batch)                                                # 2. run
        self.num_steps += 1
        finished = self.scheduler.postprocess(batch, tokens)                            # 3. postprocess
        self.runner.forget(finished)
        return finished

    def _pipeline_tick(self) -> list[Sequence]:
        """A step under pipeline parallelism (p stages), one tick: virtual engine ``tick mod p`` schedules its next
        batch, this rank's stage runs the batch that reached it, and the batch that the last stage finished is
        postprocessed (``PipelineLoop``). Returns the sequences that finished."""
        v = self.pipeline.to_schedule()                    # tick mod p; None while its last batch is in flight
        ready = v is not None and self.schedulers[v].has_work()
        batch = self.schedulers[v].schedule() if ready else []                          # 1. schedule
        self._check_progress(idle=not batch and not self.pipeline.busy())
        done = self.pipeline.run(v, batch)                 # 2. run this stage's part of the tick
        if done is None:                                   # no batch left the last stage this tick
            return []
        v, batch, tokens = done
        self.num_steps += 1
        finished = self.schedulers[v].postprocess(batch, tokens)                        # 3. postprocess
        self.runner.forget(finished)
        return finished

    def _check_progress(self, idle: bool) -> None:
        """Raise when requests are left but more steps in a row than there are batches in flight ran nothing:
        no scheduler can schedule them, and ``generate`` would loop for ever."""
        self.num_idle = self.num_idle + 1 if idle and self.has_unfinished() else 0
        if self.num_idle > len(self.schedulers):
            raise RuntimeError("requests are left but no scheduler could schedule a batch")

    def stats(self) -> dict:
        """This rank's counters, summed over the schedulers (one per batch in flight under PP)."""
        schedulers, managers = self.schedulers, [s.block_manager for s in self.schedulers]
        total = lambda objs, attr: sum(getattr(o, attr) for o in objs)                  # noqa: E731
        return {"num_preemptions": total(schedulers, "num_preemptions"),
                "prefix_cache_hit_blocks": total(managers, "prefix_cache_hit_blocks"),
                "peak_kv_blocks_used": total(managers, "peak_blocks_used"),
                "num_kv_blocks": total(managers, "num_blocks"),
                "kv_blocks_in_use": total(managers, "num_used_blocks"), "block_size": self.cfg.block_size,
                "kv_cache_bytes": self.runner.kv_cache_bytes(), "num_steps": self.num_steps,
                "static_decode_steps": 0 if self.runner.static is None else self.runner.static.num_steps,
                "compiled_forwards": getattr(self.model.forward, "num_compiled", 0)}   # engine.compiled

    def timeline(self) -> list[dict]:
        """This rank's ticks of the last ``generate`` under pipeline parallelism (``PipelineLoop.timeline``)."""
        return [] if self.pipeline is None else [dataclasses.asdict(t) for t in self.pipeline.timeline]

    def _generator(self, index: int, params: SamplingParams) -> torch.Generator | None:
        if params.greedy:
            return None
        # The same seed on every rank: every rank draws the same token from the same logits.
        return torch.Generator().manual_seed(int(params.seed) if params.seed is not None else self.cfg.seed + index)
