"""The engine's step has a name: ``LLMEngine.step`` is the one place where a batch is scheduled, run and
postprocessed (under pipeline parallelism, in the tick it hands over to, ``_pipeline_tick``); and it serves
requests added one at a time."""
import ast
import pathlib

import pytest

from tplab import SamplingParams
from tplab.engine.config import engine_config
from tplab.engine.llm_engine import LLMEngine
from tplab.engine.sequence import Sequence

ENGINE = pathlib.Path(__file__).resolve().parent.parent / "tplab"
STEP_CALLS = ("schedule", "postprocess")


def callers(source: str, method: str) -> list[str]:
    """``Class.function`` (or ``function``) of every call to ``<anything>.method(...)`` in ``source``."""
    found = []

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            name = where
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                name = f"{where}.{child.name}" if where else child.name
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and child.func.attr == method):
                found.append(where)
            visit(child, name)
    visit(ast.parse(source), "")
    return found


def calls_of(method: str) -> set[str]:
    """``file:Class.function`` of every call to ``<anything>.method(...)`` in tplab."""
    return {f"{p.relative_to(ENGINE.parent)}:{c}" for p in ENGINE.rglob("*.py") for c in callers(p.read_text(), method)}


@pytest.mark.parametrize("method", STEP_CALLS)
def test_only_the_step_schedules_and_postprocesses(method):
    step, tick = "tplab/engine/llm_engine.py:LLMEngine.step", "tplab/engine/llm_engine.py:LLMEngine._pipeline_tick"
    assert calls_of(method) == {step, tick}, calls_of(method)
    assert calls_of("_pipeline_tick") == {step}                     # the tick is the step's own, under PP


def test_the_check_sees_a_second_loop():
    source = "class A:\n    def run(self):\n        b = self.scheduler.schedule()\n"
    assert callers(source, "schedule") == ["A.run"]


def test_steps_serve_requests_added_one_at_a_time(checkpoint):
    """A serving loop in the caller's hands (vLLM's ``add_request`` / ``step``): the tokens ``generate`` gives."""
    engine = LLMEngine(engine_config(checkpoint("gqa"), device="cpu"), "cpu")
    params = SamplingParams(temperature=0.0, max_tokens=5)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    want = [s.output_token_ids for s in engine.generate(prompts, [params] * 3)]
    seqs = [Sequence(i, p, len(p), params, None) for i, p in enumerate(prompts)]
    engine.add_request(seqs[0])
    finished, steps = [], 0
    while engine.has_unfinished():
        finished += engine.step()
        steps += 1
        if steps == 2:                                       # the others join a running batch
            engine.add_request(seqs[1])
            engine.add_request(seqs[2])
    assert sorted(s.seq_id for s in finished) == [0, 1, 2]
    assert [s.output_token_ids for s in seqs] == want
    assert engine.runner.metadata._slots == {}               # each finished sequence's slots forgotten by step


def test_llm_engine_is_this_processs_engine_and_refused_where_ranks_run_elsewhere(checkpoint):
    """``llm.engine`` hands over the in-process engine to watch its steps; with two ranks there is none here."""
    from tplab import LLM
    with LLM(checkpoint("gqa")) as llm:
        assert isinstance(llm.engine, LLMEngine) and llm.engine.scheduler is llm.engine.schedulers[0]
    with pytest.raises(RuntimeError, match="this LLM was shut down; create a new one"):
        llm.engine
    with LLM(checkpoint("gqa"), tensor_parallel_size=2) as llm:
        with pytest.raises(RuntimeError, match="2 ranks run in their own processes"):
            llm.engine
