"""tplab: a hands-on workbook for vLLM-style tensor-parallel inference of Qwen2.

    from tplab import launch, LLM, SamplingParams, Parts, models

Two sides. The engine (``distributed``, ``layers``, ``kernels``, ``models``, ``engine``) serves a model; the
teaching side (``TEACHING``: the pitfalls, the checkers, HF's activations, plots) is what the
notebooks add on top. The engine never imports the teaching side, and ``import tplab`` loads none of
it: ``tplab.exercises`` and the others are imported on first use, so a rank process, which imports
this package, loads the teaching side only when a bug or a part from it was asked for. This module, above
both sides, is where they meet: it hands the engine the function that loads the pitfalls' catalogue.
"""
import importlib

from tplab import models
from tplab.distributed.launcher import launch
from tplab.engine.llm import LLM, RequestOutput
from tplab.engine.parts import Parts, provide_bugs
from tplab.engine.sampling import SamplingParams

TEACHING = ("bugs", "exercises", "golden", "tolerance", "workbook", "plotting", "interactive")


def _bugs() -> dict:
    from tplab.bugs import BUGS      # the pitfalls, loaded the first time LLM(bugs=[...]) names one
    return BUGS


provide_bugs(_bugs)                  # the engine finds the pitfalls by name through this, and imports none of them


def __getattr__(name):
    # tplab.bugs etc. as attributes, imported on first use (plotting pulls in matplotlib)
    if name in TEACHING:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'tplab' has no attribute {name!r}")


__all__ = ["launch", "LLM", "SamplingParams", "RequestOutput", "Parts", "models", *TEACHING]
