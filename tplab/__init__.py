"""tplab: a hands-on workbook for vLLM-style tensor-parallel inference of Qwen2.

    from tplab import launch, LLM, SamplingParams, Parts, models

The engine (``distributed``, ``layers``, ``models``, ``engine``) never imports the teaching side
(``tplab.teaching``), and ``import tplab`` loads none of it: the teaching modules are imported when
first used, also by their short names ``tplab.bugs``, ``tplab.golden``, ``tplab.exercises``,
``tplab.workbook``, ``tplab.plotting`` (``from tplab.exercises import nb01``,
``import tplab.exercises.nb01``). So a rank process, which imports this package, loads the teaching
side only when a bug or a part from it was asked for.
"""
import importlib
import importlib.abc
import importlib.util
import sys

from tplab import models
from tplab.distributed.launcher import launch
from tplab.engine.llm import LLM, RequestOutput
from tplab.engine.parts import Parts
from tplab.engine.sampling import SamplingParams

_TEACHING = ("bugs", "exercises", "golden", "workbook", "plotting")


def _teaching_name(name: str) -> str | None:
    """``tplab.exercises.nb01`` -> ``tplab.teaching.exercises.nb01``; None for any other name."""
    head, _, rest = name.partition(".")
    short, _, tail = rest.partition(".")
    if head != __name__ or short not in _TEACHING:
        return None
    return f"{__name__}.teaching.{short}" + (f".{tail}" if tail else "")


class _ShortNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``tplab.<short>...`` as the module ``tplab.teaching.<short>...`` itself (one module object,
    under both names), when, and only when, someone imports it by the short name."""

    def find_spec(self, name, path=None, target=None):
        real = _teaching_name(name)
        return None if real is None else importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return importlib.import_module(_teaching_name(spec.name))

    def exec_module(self, module):
        pass                         # the real module ran when create_module imported it


if not any(isinstance(f, _ShortNames) for f in sys.meta_path):
    sys.meta_path.insert(0, _ShortNames())   # before the path finder, which would load a second copy


def __getattr__(name):
    # tplab.bugs etc.: imported on first use (plotting pulls in matplotlib, exercises the checkers)
    if name in _TEACHING:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'tplab' has no attribute {name!r}")


__all__ = ["launch", "LLM", "SamplingParams", "RequestOutput", "Parts", "models", *_TEACHING]
