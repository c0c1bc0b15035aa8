"""One rank's side of ``LLM``: the object that holds this rank's engine between the driver's calls.

With more than one rank (TP, PP or DP > 1) every rank process keeps one ``Worker`` (``RankGroup.create``)
and ``LLM`` calls its methods on all ranks at once (``RankGroup.call``), as vLLM's driver calls its workers.
With one rank, and under torchrun, ``LLM`` holds its ``Worker`` itself and calls the same methods directly. Under data
parallelism every rank is sent every prompt and the driver's split, and serves its DP rank's share.
"""
import torch.distributed as dist

from tplab.distributed.launcher import rank_device
from tplab.distributed.parallel_state import dp_rank_and_size
from tplab.engine.config import EngineConfig
from tplab.engine.llm_engine import LLMEngine
from tplab.engine.sampling import SamplingParams


class Worker:
    def __init__(self, cfg: EngineConfig):
        # under a NCCL group "cuda" is this rank's GPU
        self.engine = LLMEngine(cfg, rank_device() if cfg.device == "cuda" and dist.is_initialized() else cfg.device)

    def info(self) -> dict:
        """What the driver checks requests against, and what this rank holds."""
        engine = self.engine
        params = {id(p): p for p in engine.model.parameters()}.values()
        return {"param_bytes": sum(p.numel() * p.element_size() for p in params),
                "elements_read": engine.load_report.elements_read,      # from the checkpoint files
                "kv_blocks_per_batch": engine.runner.num_blocks}   # under PP: each batch in flight's share

    def generate(self, prompts: list[list[int]], params: list[SamplingParams], use_tqdm: bool = False,
                 shares: list[list[int]] | None = None) -> list[tuple[list[int], list[float], str]]:
        """One generate call on this rank: ``[(output token ids, logprobs, finish reason)]`` for every prompt, or
        under data parallelism for those of ``shares[dp_rank]`` (indices into ``prompts``, the driver's split)."""
        if shares is not None:
            mine = shares[dp_rank_and_size()[0]]
            prompts, params = [prompts[i] for i in mine], [params[i] for i in mine]
        seqs = self.engine.generate(prompts, params, use_tqdm, None if shares is None else mine)
        return [(s.output_token_ids, s.logprobs, s.finish_reason) for s in seqs]

    def stats(self) -> dict:
        return self.engine.stats()

    def timeline(self) -> list[dict]:
        return self.engine.timeline()
