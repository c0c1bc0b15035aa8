"""Functions ``LLM`` runs inside each rank through ``tplab.dist.RankGroup`` (or in-process at TP 1).

The engine lives in a module global of the rank process between calls.
"""
from tplab.dist import rank_device

_engine = None


def start_engine(cfg) -> dict:
    """Build this rank's engine; returns what the driver needs to check requests against."""
    global _engine
    from tplab.engine.engine import LLMEngine
    _engine = None  # drop a previous engine (and its cache) before building the next
    _engine = LLMEngine(cfg, cfg.device or rank_device())
    return {"param_bytes": sum(p.numel() * p.element_size() for p in _engine.model.parameters()),
            "num_kv_blocks": _engine.block_manager.num_blocks, "block_size": _engine.block_manager.block_size}


def generate(prompts, params) -> list[tuple[list[int], list[float], str]]:
    """Run one generate call on this rank: ``[(output token ids, logprobs, finish reason)]``."""
    return [(s.output_token_ids, s.logprobs, s.finish_reason) for s in _engine.generate(prompts, params)]


def stats() -> dict:
    return _engine.stats()


def stop_engine() -> None:
    global _engine
    _engine = None
