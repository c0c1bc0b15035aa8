"""tplab: a hands-on workbook for vLLM-style tensor-parallel inference of Qwen2.

    from tplab import launch, LLM, SamplingParams, Parts, models

The engine (``distributed``, ``layers``, ``models``, ``engine``) never imports the teaching side
(``tplab.teaching``); the teaching modules are also reachable by their short names,
``tplab.bugs``, ``tplab.golden``, ``tplab.exercises``, ``tplab.workbook``, ``tplab.plotting``.
"""
import importlib
import sys

from tplab import models
from tplab.distributed.launcher import launch
from tplab.engine.llm import LLM, RequestOutput
from tplab.engine.parts import Parts
from tplab.engine.sampling import SamplingParams
from tplab.teaching import bugs, exercises, golden, workbook  # bugs registers its pitfalls with the engine

_TEACHING = ("bugs", "exercises", "golden", "workbook", "plotting")
for _key, _module in list(sys.modules.items()):   # `import tplab.exercises.nb01` finds the same module object
    if _key.startswith(f"{__name__}.teaching."):
        sys.modules[_key.replace(".teaching.", ".", 1)] = _module


def __getattr__(name):
    # plotting pulls in matplotlib: imported on first use, not by every rank process
    if name == "plotting":
        module = importlib.import_module("tplab.teaching.plotting")
        sys.modules[f"{__name__}.plotting"] = module
        globals()[name] = module
        return module
    raise AttributeError(f"module 'tplab' has no attribute {name!r}")


__all__ = ["launch", "LLM", "SamplingParams", "RequestOutput", "Parts", "models", *_TEACHING]
