#!/usr/bin/env bash
# The workbook's one entry point. It creates .venv in the repo and installs what it needs on first use.
#   ./workbook.sh lab           open the workbook in JupyterLab (extra args go to jupyter lab)
#   ./workbook.sh test          run the tests and execute the notebooks (what CI runs); extra args go to pytest
#   ./workbook.sh doctor        check this machine before a workshop: what is missing, what will be slow
#   ./workbook.sh test-gpu      run the CUDA and NCCL tests (tests/test_gpu.py); skipped, with the reason, without a GPU
#   ./workbook.sh test-browser  open every notebook in headless Chromium (installs Chromium: CI, not laptops)
#   ./workbook.sh python ...    run Python inside the environment (benchmarks, scripts)
# TPLAB_PYTHON=/path/to/python uses an environment of your own (a CUDA build of torch, say) as it is: nothing
# is installed, and tplab is imported from this checkout.
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv
PY=${TPLAB_PYTHON:-$VENV/bin/python}

own_python() {   # $@: modules the command needs beyond tplab's
  local missing
  missing=$("$PY" -c 'import importlib.util as u, sys
print(" ".join(m for m in ["torch", "transformers", "safetensors", "cloudpickle", "psutil", "tqdm"] + sys.argv[1:]
               if u.find_spec(m) is None))' "$@" 2>/dev/null) || {
    echo "workbook: TPLAB_PYTHON=$TPLAB_PYTHON does not run; point it at a python executable" >&2; exit 1; }
  if [ -n "$missing" ]; then
    echo "workbook: TPLAB_PYTHON=$TPLAB_PYTHON lacks $missing: \`$TPLAB_PYTHON -m pip install $missing\`, or unset TPLAB_PYTHON to use .venv" >&2
    exit 1
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
}

base_python() {   # the Python .venv is made from: python3, or where that is older than 3.10, python3.13 ... 3.10
  local py
  for py in python3 python3.13 python3.12 python3.11 python3.10; do
    "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null && { echo "$py"; return; }
  done
  echo "workbook: Python 3.10 or newer is needed (3.11 tested); found: $(python3 -V 2>&1), and no python3.10 to" \
       "python3.13 on PATH" >&2
  return 1
}

setup() {   # $@: modules the command needs, checked in an environment of your own (TPLAB_PYTHON)
  if [ -n "${TPLAB_PYTHON:-}" ]; then own_python "$@"; return; fi
  if [ ! -x "$VENV/bin/python" ]; then
    local base; base=$(base_python) || exit 1
    "$base" -m venv "$VENV"
  fi
  local want stamp="$VENV/.tplab-installed"
  want=$(cat requirements.txt pyproject.toml | sha1sum)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "workbook: installing torch, transformers and JupyterLab into $VENV (first run only, about 2 minutes)..." >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # Pinned on its own first. TPLAB_TORCH_INDEX picks the build, e.g. https://download.pytorch.org/whl/cpu
    # on a Linux laptop without a GPU (the default index's Linux torch brings GBs of CUDA libraries).
    "$VENV/bin/python" -m pip install -q torch==2.13.0 ${TPLAB_TORCH_INDEX:+--index-url "$TPLAB_TORCH_INDEX"}
    # (setuptools warns about editable installs in its build step: noise on a learner's first run)
    PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip install -q -r requirements.txt -e .
    echo "$want" > "$stamp"
  fi
}

lab_settings() {
  # JupyterLab defaults for this environment only: no "get Jupyter news?" prompt over the first notebook.
  [ -z "${TPLAB_PYTHON:-}" ] || return 0       # not in an environment of the user's own
  mkdir -p "$VENV/share/jupyter/lab/settings"
  echo '{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": false}}' \
    > "$VENV/share/jupyter/lab/settings/overrides.json"
}

browser_deps() {
  # Only for ./workbook.sh test-browser (CI): the README's test command never installs system packages.
  if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    command -v apt-get >/dev/null || { echo "workbook: install Chromium and chromedriver (or set CHROMIUM and CHROMEDRIVER)" >&2; exit 1; }
    echo "workbook: installing Chromium and its driver with apt-get..." >&2
    local sudo=(); [ "$(id -u)" = 0 ] || sudo=(sudo -n)
    ${sudo[@]+"${sudo[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    ${sudo[@]+"${sudo[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  fi
  export CHROMIUM=${CHROMIUM:-$(command -v chromium)} CHROMEDRIVER=${CHROMEDRIVER:-$(command -v chromedriver)}
  "$PY" -c "import selenium" 2>/dev/null || {
    echo "workbook: installing Selenium into $PY's environment..." >&2; "$PY" -m pip install -q "selenium>=4.10"; }
}

export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TOKENIZERS_PARALLELISM=false
cmd=${1:-}; shift || true
case "$cmd" in
  lab)    setup jupyterlab ipywidgets matplotlib; lab_settings
          # The repository root is served (so tplab/ opens beside the notebooks) and the lab opens on
          # notebooks/. Root is the default user in containers and cloud notebook machines.
          root=(); [ "$(id -u)" = 0 ] && root=(--allow-root)
          exec "$PY" -m jupyter lab --ServerApp.root_dir="$PWD" --LabApp.default_url=/lab/tree/notebooks \
            ${root[@]+"${root[@]}"} "$@" ;;
  test)   setup pytest nbval ipykernel ipywidgets matplotlib hypothesis
          nbval=(--nbval-lax --nbval-sanitize-with nbval_sanitize.cfg --nbval-cell-timeout 300)
          for arg in "$@"; do    # a path given: run just that
            [ -e "${arg%%::*}" ] && exec "$PY" -m pytest "${nbval[@]}" "$@"
          done
          compgen -G "notebooks/*.ipynb" >/dev/null || exec "$PY" -m pytest tests "$@"
          # nbval runs the notebooks as committed (the exercises' stubs); tests/test_notebooks_rerun.py runs
          # them twice in one kernel in solution mode, every exercise filled by its reference solution, with
          # oneDNN off on one thread, and compares what nbval compares. CI adds -n 2 (pytest-xdist).
          exec "$PY" -m pytest "${nbval[@]}" tests notebooks "$@" ;;
  test-gpu)
          # tplab on CUDA against HF on the same GPU, NCCL groups, the KV cache from free GPU memory (marker gpu).
          # Without CUDA every test is skipped and the reason printed (-rs); the command still succeeds.
          setup pytest; exec "$PY" -m pytest -m gpu -rs tests/test_gpu_graphs.py tests/test_gpu.py "$@" ;;
  test-browser)
          setup pytest jupyterlab; browser_deps
          exec "$PY" -m pytest -p no:cacheprovider --timeout 600 -v tests/browser/lab_in_chromium.py "$@" ;;
  doctor) setup; exec "$PY" scripts/doctor.py "$@" ;;      # doctor checks .venv's Python (or TPLAB_PYTHON's)
  python) setup; exec "$PY" "$@" ;;
  *)      sed -n '2,8p' "$0"; exit 2 ;;
esac
