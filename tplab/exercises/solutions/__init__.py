"""Reference solutions of every exercise, one file per exercise, named as the exercise.

Each file is a cell a learner could have written: its imports, then the definitions under the
exact names of the exercise's stub. In solution mode (``workbook.setup(solutions=True)`` or
``TPLAB_SOLUTIONS=1``) a stub cell that starts with ``# Exercise: <name>`` runs this code instead,
so a room can skip ahead and CI proves the whole track end to end. ``show_solution(name)`` prints it.
"""
import pathlib

_HERE = pathlib.Path(__file__).parent

# exercise name -> the class it defines, for the exercises that are parts of the engine (tplab.Parts fields)
PARTS = {"gate_up_linear": "MyMergedColumnParallelLinear", "row_linear": "MyRowParallelLinear",
         "qkv_linear": "MyQKVParallelLinear", "embedding": "MyVocabParallelEmbedding",
         "lm_head": "MyParallelLMHead", "attention": "MyAttention", "block_manager": "MyBlockManager",
         "sp_norm_region": "MySequenceParallelNormRegion", "pipeline_stage": "MyPipelineStage"}


def names() -> list[str]:
    """Every exercise that has a reference solution."""
    return sorted(p.stem for p in _HERE.glob("*.py") if p.stem != "__init__")


def source(name: str) -> str:
    """The reference solution of exercise ``name``, as the text of a notebook cell."""
    path = _HERE / f"{name}.py"
    if not path.is_file():
        raise KeyError(f"no exercise named {name!r}; the exercises are {names()}")
    return path.read_text()


def define(name: str) -> dict:
    """Run the reference solution of ``name`` in a fresh namespace and return what it defines."""
    namespace = {"__name__": f"solution_{name}"}
    exec(compile(source(name), f"<solution {name}>", "exec"), namespace)
    return namespace
