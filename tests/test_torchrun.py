"""Under torchrun (an initialised env:// group) LLM uses those ranks instead of spawning its own."""
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import hf_greedy


def test_llm_under_torchrun_matches_hf(checkpoint, hf_model, tmp_path):
    folder = checkpoint("gqa")
    torchrun = Path(sys.executable).with_name("torchrun")
    out = tmp_path / "tokens.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2",
                    str(Path(__file__).with_name("torchrun_generate.py")), str(folder), str(out)],
                   check=True, timeout=180, env=env, capture_output=True)
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
    model = hf_model(folder)
    expected = [hf_greedy(model, p, 10)[0] for p in ([3, 17, 42], [250, 7, 1, 9])]
    assert ranks[0] == ranks[1] == expected
