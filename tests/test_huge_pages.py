"""``import tplab`` asks torch's CPU allocator for transparent huge pages (``tplab.engine.malloc``): the
variable set for this process and its ranks, the user's own setting kept, ``TPLAB_MALLOC_TUNE=0`` leaving
it alone, and a packed weight then really on huge pages where the kernel gives them. Each case runs in a
fresh process: torch reads the variable once, at its first allocation."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

CHILD = """
import json, os
import tplab
import torch
w = torch.randn(4096, 4096)                                  # 64 MiB, as a layer of a 7B model
packed = torch.ops.mkldnn._reorder_linear_weight(w, 4) if torch.backends.mkldnn.is_available() else w.clone()
huge = next(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages"))
print(json.dumps({"env": os.environ.get("THP_MEM_ALLOC_ENABLE"), "huge_kib": huge}))
"""


def child(**env) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "TPLAB_MALLOC_TUNE")}
    out = subprocess.run([sys.executable, "-c", CHILD], env={**base, **env}, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def thp_mode() -> str | None:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``), None where it does not say."""
    if not THP_MODE.exists():
        return None
    return THP_MODE.read_text().split("[", 1)[1].split("]", 1)[0]


@linux_only
def test_import_asks_for_huge_pages_and_keeps_what_the_user_set():
    assert child()["env"] == "1"
    assert child(THP_MEM_ALLOC_ENABLE="0")["env"] == "0"     # the user's choice wins
    assert child(TPLAB_MALLOC_TUNE="0")["env"] is None       # the engine's memory tuning off: torch's default


@linux_only
@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="this kernel gives no transparent huge pages")
def test_weights_land_on_huge_pages():
    on = child()
    assert on["huge_kib"] >= 64 * 1024, f"{on['huge_kib']} KiB on huge pages for 128 MiB of tensors"
    if thp_mode() == "madvise":                              # only what torch asks for gets them
        assert child(TPLAB_MALLOC_TUNE="0")["huge_kib"] < 16 * 1024
