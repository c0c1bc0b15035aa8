#!/usr/bin/env bash
# The workbook's one entry point. It creates .venv in the repo and installs what it needs on first use.
#   ./workbook.sh lab        open the notebooks in JupyterLab
#   ./workbook.sh test       run the test suite (what CI runs); extra args go to pytest
#   ./workbook.sh python ... run Python inside the environment (benchmarks, scripts)
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv

setup() {
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  local want stamp="$VENV/.tplab-installed"
  want=$(cat requirements.txt pyproject.toml | sha1sum)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # Pinned on its own first: 2.13.0 is the CPU build here; an unpinned torch pulls GBs of CUDA packages.
    "$VENV/bin/python" -m pip install -q torch==2.13.0
    "$VENV/bin/python" -m pip install -q -r requirements.txt -e .
    echo "$want" > "$stamp"
  fi
}

export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TOKENIZERS_PARALLELISM=false
cmd=${1:-}; shift || true
case "$cmd" in
  lab)    setup; exec "$VENV/bin/jupyter" lab notebooks/ "$@" ;;
  test)   setup
          nb=(); compgen -G "notebooks/*.ipynb" >/dev/null && \
            nb=(--nbval-lax --nbval-sanitize-with nbval_sanitize.cfg --nbval-cell-timeout 300 notebooks)
          exec "$VENV/bin/python" -m pytest tests "${nb[@]}" "$@" ;;
  python) setup; exec "$VENV/bin/python" "$@" ;;
  *)      sed -n '2,6p' "$0"; exit 2 ;;
esac
