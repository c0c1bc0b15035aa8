#!/usr/bin/env bash
# One run on a lent GPU machine, under 10 minutes: the CUDA tests (graphs on, off, with compile=True), then
# bench/gpu.py (bf16 first: the default engine with CUDA graphs, enforce_eager, compile=True, HF eager and HF's
# static cache). Logs and results go to $OUT (set on a lent machine) or bench/results/<gpu>/.
#   TPLAB_PYTHON=python3 bench/gpu_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9-')
out=${OUT:-bench/results/${gpu:-gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TPLAB_PYTHON=${TPLAB_PYTHON:-python3} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
"$TPLAB_PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  >> "$out/gpu.txt"
timeout 170 ./workbook.sh test-gpu -q 2>&1 | tee "$out/test-gpu.log"
timeout 90 "$TPLAB_PYTHON" bench/graph_parity.py --out "$out/graph_parity.json" 2>&1 | tee "$out/graph_parity.log"
timeout 260 "$TPLAB_PYTHON" bench/gpu.py --new 64 --reps 3 --budget 150 --out "$out/gpu.json" 2>&1 | tee "$out/bench.log"
