"""The calls ``LLM`` makes on every rank, through ``tplab.dist.RankGroup``.

Inside a rank process the engine lives in a module global between calls. In-process
(TP 1, or torchrun) ``LLM`` keeps its own engine and passes it in, so two ``LLM``s in
one process never share one.
"""
from tplab.dist import rank_device

_engine = None


def start_engine(cfg):
    """Build this rank's engine and keep it for later calls; returns it."""
    global _engine
    from tplab.engine.engine import LLMEngine
    _engine = None  # drop a previous engine (and its cache) before building the next
    _engine = LLMEngine(cfg, cfg.device or rank_device())
    return _engine


def engine_info(engine=None) -> dict:
    """What the driver checks requests against, and what each rank holds."""
    engine = engine or _engine
    return {"param_bytes": sum(p.numel() * p.element_size() for p in engine.model.parameters()),
            "elements_read": getattr(engine.model, "elements_read", None),   # from the checkpoint files
            "num_kv_blocks": engine.block_manager.num_blocks, "block_size": engine.block_manager.block_size}


def start(cfg) -> dict:
    return engine_info(start_engine(cfg))


def generate(prompts, params, engine=None) -> list[tuple[list[int], list[float], str]]:
    """Run one generate call on this rank: ``[(output token ids, logprobs, finish reason)]``."""
    return [(s.output_token_ids, s.logprobs, s.finish_reason) for s in (engine or _engine).generate(prompts, params)]


def stats(engine=None) -> dict:
    return (engine or _engine).stats()


def stop_engine() -> None:
    global _engine
    _engine = None
