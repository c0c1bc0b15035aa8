"""tplab: a hands-on workbook for vLLM-style tensor-parallel inference of Qwen2.

    from tplab import launch, LLM, SamplingParams, models
"""
from tplab import bugs, models
from tplab.dist import launch
from tplab.engine.llm import LLM, RequestOutput
from tplab.engine.sampling import SamplingParams

__all__ = ["launch", "LLM", "SamplingParams", "RequestOutput", "models", "bugs"]
