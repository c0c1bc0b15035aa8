"""Under torchrun (an initialised env:// group) LLM uses those ranks instead of spawning its own: on one node,
and as two node groups (two torchrun processes on 127.0.0.1, each with two ranks) running TP 2 x PP 2."""
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from conftest import hf_greedy

TORCHRUN = Path(sys.executable).with_name("torchrun")
SCRIPT = Path(__file__).with_name("torchrun_generate.py")
PROMPTS = ([3, 17, 42], [250, 7, 1, 9])


def _results(out, n):
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(n)]


def test_llm_under_torchrun_matches_hf(checkpoint, hf_model, tmp_path):
    folder = checkpoint("gqa")
    out = tmp_path / "tokens.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node", "2", str(SCRIPT), str(folder), str(out)],
                   check=True, timeout=180, env=env, capture_output=True)
    ranks = _results(out, 2)
    expected = [hf_greedy(hf_model(folder), p, 10)[0] for p in PROMPTS]
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == expected
    assert ranks[0]["shm"] and ranks[1]["shm"]                      # one node: shared memory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_groups_run_tp2_x_pp2_and_match_hf(hf_model, tmp_path):
    """Node 0 holds stage 0 (world ranks 0, 1), node 1 stage 1 (ranks 2, 3); each stage's TP group is on one
    node, so it all-reduces through shared memory, and the stages talk over TCP (gloo)."""
    from tplab import models
    folder = models.tiny_stories()                                    # 4 layers: 2 per stage
    out, port = tmp_path / "tokens.json", _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen([str(TORCHRUN), "--nnodes", "2", "--nproc_per_node", "2", "--node_rank", str(node),
                               "--master_addr", "127.0.0.1", "--master_port", str(port),
                               str(SCRIPT), str(folder), str(out), "2", "2"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)      # its own process group: its ranks are stopped with it
             for node in (0, 1)]
    try:
        logs = [node.communicate(timeout=240)[0] for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:                                  # torchrun and its ranks, none left spinning
            os.killpg(node.pid, signal.SIGKILL)
        logs = [node.communicate()[0] for node in nodes]
        raise AssertionError("the two node groups did not finish within 240 s:\n" + "\n".join(logs)[-6000:]) from None
    assert all(node.returncode == 0 for node in nodes), "\n".join(logs)[-3000:]
    ranks = _results(out, 4)
    expected = [hf_greedy(hf_model(folder), p, 10)[0] for p in PROMPTS]
    assert all(r["tokens"] == expected for r in ranks)
    assert all(r["shm"] for r in ranks)
