"""The engine runs without the teaching side: a plain ``LLM(...).generate(...)`` loads no teaching module
(``tplab.TEACHING``), in the process that made the ``LLM`` (a fresh one) or in any rank; a bug asked for by name loads
its catalogue there, and only then."""
import json
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys
from tplab import LLM, SamplingParams

def teaching_loaded():
    import sys, tplab
    return sorted(m for m in sys.modules if m.split(".")[:2] in [["tplab", t] for t in tplab.TEACHING])

model, tp, bugs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
with LLM(model, tensor_parallel_size=tp, bugs=bugs, device="cpu") as llm:
    tokens = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids
    ranks = llm._group.run(teaching_loaded) if llm._group is not None else []
print(json.dumps({"tokens": tokens, "caller": teaching_loaded(), "ranks": ranks}))
"""


def run(model, tp, *bugs):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model), str(tp), *bugs], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tp", [1, 2])
def test_a_plain_generate_loads_no_teaching_module(checkpoint, tp):
    out = run(checkpoint("gqa"), tp)
    assert len(out["tokens"]) == 2
    assert out["caller"] == [], f"the caller loaded {out['caller']}"
    assert len(out["ranks"]) == (tp if tp > 1 else 0)
    assert all(r == [] for r in out["ranks"]), f"ranks loaded {out['ranks']}"


def test_a_bug_by_name_loads_its_catalogue_in_the_caller_and_the_ranks(checkpoint):
    """The check above can see a teaching module: a bug by name loads the catalogue where it is used."""
    out = run(checkpoint("gqa"), 2, "mask_mul_inf")
    assert "tplab.bugs" in out["caller"]
    assert all("tplab.bugs.attention" in r for r in out["ranks"]), out["ranks"]
