"""Opening a notebook in JupyterLab must not mark it modified.

When its kernel starts, JupyterLab writes the notebook's ``metadata.kernelspec`` from the installed
kernel spec and ``metadata.language_info`` from the kernel's info reply; a value that differs marks
the notebook modified, so closing it asks to save and saving changes a tracked file. The committed
notebooks therefore carry exactly what JupyterLab writes. (``language_info.version`` is the Python
that executed them; on another Python JupyterLab records yours, which only that machine sees.)
The browser test (``./workbook.sh test-browser``) checks the same thing in a real JupyterLab.
"""
import json

import pytest

from conftest import NOTEBOOKS


def lab_kernelspec() -> dict:
    """What JupyterLab writes into ``metadata.kernelspec`` for the kernel that ipykernel installs
    (``python3``, "Python 3 (ipykernel)"), the one in the workbook's environment."""
    from ipykernel.kernelspec import KERNEL_NAME, get_kernel_dict
    spec = get_kernel_dict()
    return {"name": KERNEL_NAME, "display_name": spec["display_name"], "language": spec["language"]}


def mismatches(nb: dict) -> list[str]:
    """The metadata JupyterLab would rewrite on open, as readable lines (empty when it opens clean)."""
    from ipykernel.ipkernel import IPythonKernel
    problems = []
    meta = nb.get("metadata", {})
    spec = meta.get("kernelspec", {})
    want = lab_kernelspec()
    if spec != want:
        problems.append(f"metadata.kernelspec is {spec}, JupyterLab writes {want}")
    info, kernel_info = meta.get("language_info", {}), dict(IPythonKernel.language_info)
    if {k: v for k, v in info.items() if k != "version"} != {k: v for k, v in kernel_info.items() if k != "version"}:
        problems.append(f"metadata.language_info is {info}, the kernel reports {kernel_info}")
    if (nb.get("nbformat"), nb.get("nbformat_minor")) < (4, 5) or not all("id" in c for c in nb["cells"]):
        problems.append("nbformat older than 4.5 or cells without ids: JupyterLab upgrades it on open")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_opens_unmodified_in_jupyterlab(path):
    problems = mismatches(json.loads(path.read_text()))
    assert not problems, f"{path.name} is marked modified as soon as it opens:\n" + "\n".join(problems)


def test_the_check_sees_the_old_kernelspec():
    """The check can fail: ``display_name: "Python 3"`` (what the notebooks once had) is caught."""
    nb = json.loads(NOTEBOOKS[0].read_text())
    nb["metadata"]["kernelspec"]["display_name"] = "Python 3"
    assert any("kernelspec" in p for p in mismatches(nb))
    del nb["cells"][0]["id"]
    assert any("ids" in p for p in mismatches(nb))
