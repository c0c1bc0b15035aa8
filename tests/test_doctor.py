"""./workbook.sh doctor: each check on a faked bad environment says what to fix, and the exit code follows."""
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("doctor", Path(__file__).parents[1] / "scripts" / "doctor.py")
doctor = sys.modules["doctor"] = importlib.util.module_from_spec(SPEC)   # dataclasses look their module up
SPEC.loader.exec_module(doctor)
GiB = doctor.GiB


def test_old_python_fails_with_what_to_install():
    c = doctor.check_python((3, 9, 18))
    assert c.status == "FAIL" and "3.11" in c.fix
    assert doctor.check_python((3, 11, 7)).status == "ok"


def test_torch_that_does_not_import_fails():
    [c] = doctor.check_torch({"error": "ImportError: libtorch_cpu.so: cannot open shared object file"})
    assert c.status == "FAIL" and "libtorch_cpu.so" in c.detail and "rm -rf .venv" in c.fix


def test_cuda_build_without_a_gpu_points_at_the_cpu_build():
    checks = doctor.check_torch({"version": "2.13.0+cu128", "cuda": "12.8", "gpus": [], "nccl": False}, system="Linux")
    assert [c.status for c in checks] == ["ok", "warn"]
    assert "download.pytorch.org/whl/cpu" in checks[1].fix


def test_cpu_build_and_two_gpus_are_reported():
    cpu = doctor.check_torch({"version": "2.13.0+cpu", "cuda": None, "gpus": [], "nccl": False})
    assert "CPU build" in cpu[0].detail and all(c.status == "ok" for c in cpu)
    gpus = doctor.check_torch({"version": "2.13.0+cu128", "cuda": "12.8", "gpus": ["H100 (80 GiB)"] * 2, "nccl": True})
    assert "NCCL" in gpus[1].detail
    assert doctor.check_torch({"version": "2.5.1", "cuda": None, "gpus": [], "nccl": False})[0].status == "warn"


def test_one_core_little_memory_and_no_shared_memory(tmp_path):
    assert doctor.check_cores(1).status == "warn" and doctor.check_cores(2).status == "ok"
    assert doctor.check_memory(1 * GiB).status == "FAIL"
    assert doctor.check_memory(3 * GiB).status == "warn" and doctor.check_memory(8 * GiB).status == "ok"
    missing = doctor.check_shared_memory(str(tmp_path / "no-shm"), system="Linux")
    assert missing.status == "FAIL" and "--shm-size" in missing.fix


def test_notebooks_saved_on_another_python_warn(tmp_path):
    nb = tmp_path / "01.ipynb"
    nb.write_text('{"metadata": {"language_info": {"version": "3.11.7"}}, "cells": []}')
    assert doctor.check_saved_python([nb], version="3.11.7").status == "ok"
    assert doctor.check_saved_python([nb], version="3.12.4").status == "warn"


def test_ranks_that_cannot_start_fail_with_the_error():
    def broken():
        raise RuntimeError("rank 1 exited with code 1")
    check, seconds = doctor.check_ranks(broken)
    assert check.status == "FAIL" and "rank 1 exited" in check.detail and seconds is None


def test_slow_machine_names_the_slow_notebooks():
    ref = doctor.REFERENCE_RANKS_SECONDS
    [fast] = doctor.slow_notebooks(ref, {"01_x": 30, "06_y": 80})
    assert fast.status == "ok"
    [slow] = doctor.slow_notebooks(ref * 3, {"01_x": 30, "06_y": 80})      # 06: 240 s estimated
    assert slow.status == "warn" and "06_y" in slow.fix and "01_x" not in slow.fix


def test_report_exits_non_zero_only_on_a_problem():
    out = io.StringIO()
    assert doctor.report([doctor.check_cores(1), doctor.check_memory(8 * GiB)], out) == 0
    out = io.StringIO()
    assert doctor.report([doctor.check_python((3, 8, 0)), doctor.check_memory(8 * GiB)], out) == 1
    text = out.getvalue()
    assert "What to do:" in text and "python: install Python 3.11" in text
    assert text.strip().endswith("1 ok, 0 warnings, 1 problems - fix the problems above first")


@pytest.mark.timeout(300)
def test_this_machine_passes_the_two_rank_check():
    check, seconds = doctor.check_ranks()
    assert check.status == "ok", check.detail


def test_float32_gemm_paths_here_are_float32_and_a_bf16_path_is_named():
    import torch.nn.functional as F
    here = doctor.check_float32_gemm()
    assert here.status == "ok", here.detail
    assert "F.linear (HF)" in here.detail
    bf16 = {"F.linear (HF)": F.linear, "bf16 inputs": lambda x, w: F.linear(x.bfloat16(), w.bfloat16()).float()}
    check = doctor.check_float32_gemm(bf16)
    assert check.status == "warn" and "bf16 inputs is not float32" in check.detail and "F.linear (HF) is" not in check.detail
    assert "TPLAB_ONEDNN=0" in check.fix


def test_fp32_kernels_say_where_few_rows_go_to_mkl():
    from tplab.kernels.gemm import Gemm
    assert "MKL on plain weights" in doctor.check_fp32_kernels(Gemm(True, True, True)).detail
    amd = doctor.check_fp32_kernels(Gemm(True, True, False)).detail
    assert "packed weights at every batch size" in amd and "for Intel" in amd
    assert "F.linear" in doctor.check_fp32_kernels(Gemm()).detail


def test_bf16_kernels_say_what_a_bf16_engine_runs_on():
    assert "streams half" in doctor.check_bf16_kernels(True).detail
    without = doctor.check_bf16_kernels(False)
    assert without.status == "ok" and "F.linear" in without.detail and "float32" in without.detail


def _workbook(python: str, *args: str):
    root = Path(__file__).parents[1]
    return subprocess.run([str(root / "workbook.sh"), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TPLAB_PYTHON": python})


def test_an_environment_of_your_own_is_used_as_it_is():
    """``TPLAB_PYTHON``: that python runs the command, tplab comes from this checkout, nothing is installed."""
    run = _workbook(sys.executable, "python", "-c", "import sys, tplab; print(sys.executable, tplab.__file__)")
    assert run.returncode == 0, run.stderr
    exe, where = run.stdout.split()
    assert exe == sys.executable and Path(where).parent == Path(__file__).parents[1] / "tplab"
    assert "installing" not in run.stderr


def test_an_environment_of_your_own_that_lacks_a_package_says_which(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho transformers nbval\n")     # what its module check prints: the missing ones
    fake.chmod(0o755)
    run = _workbook(str(fake), "test")
    assert run.returncode == 1 and "lacks transformers nbval" in run.stderr
    assert f"{fake} -m pip install transformers nbval" in run.stderr
    run = _workbook(str(tmp_path / "no-such-python"), "test-gpu")
    assert run.returncode == 1 and "does not run" in run.stderr
