"""Functions ``LLM`` runs inside each rank through ``tplab.dist.RankGroup``.

The engine lives in a module global of the rank process between calls.
"""
from tplab.dist import rank_device

_engine = None


def start_engine(cfg) -> int:
    """Build this rank's engine; returns the bytes of parameters it holds."""
    global _engine
    from tplab.engine.engine import LLMEngine
    device = cfg.device or rank_device()
    _engine = LLMEngine(cfg, device)
    return sum(p.numel() * p.element_size() for p in _engine.model.parameters())


def generate(prompts, params) -> list[tuple[list[int], list[float], str]]:
    """Run one generate call on this rank: ``[(output token ids, logprobs, finish reason)]``."""
    return [(s.output_token_ids, s.logprobs, s.finish_reason) for s in _engine.generate(prompts, params)]


def stop_engine() -> None:
    global _engine
    _engine = None
