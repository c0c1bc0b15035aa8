#!/usr/bin/env bash
# One run on a lent GPU machine, under 10 minutes: the CUDA tests (graphs first: graphs on, off, with
# compile=True), then bench/graph_parity.py, then bench/gpu.py in bf16 (tplab as it comes, with CUDA graphs,
# against HF eager and HF's static cache first; then enforce_eager; then compile=True, as time allows).
# Logs and results go to $OUT (set on a lent machine) or bench/results/<gpu>/.
#   TPLAB_PYTHON=python3 bench/gpu_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
deadline=$((SECONDS + 540))        # the run's time: gpu.py gets what the steps before it leave
left() { echo $((deadline - SECONDS)); }
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9-')
out=${OUT:-bench/results/${gpu:-gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TPLAB_PYTHON=${TPLAB_PYTHON:-python3} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
"$TPLAB_PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  >> "$out/gpu.txt"
# what the tests need beyond torch and transformers, and the C++ compiler inductor builds with
"$TPLAB_PYTHON" -c "import pytest, cloudpickle, psutil, tqdm, safetensors; print('test packages: ok')" >> "$out/gpu.txt" 2>&1
echo "c++ compiler: $(command -v g++ || command -v c++ || echo none)" >> "$out/gpu.txt"
timeout 200 ./workbook.sh test-gpu -v 2>&1 | tee "$out/test-gpu.log"
timeout 90 "$TPLAB_PYTHON" bench/graph_parity.py --out "$out/graph_parity.json" 2>&1 | tee "$out/graph_parity.log"
t=$(left)                          # gpu.py starts no section in its last 100 s (its clock starts after the checkpoint)
timeout "$t" "$TPLAB_PYTHON" bench/gpu.py --dtypes bfloat16 --new 64 --reps 2 --budget $((t - 100)) \
  --out "$out/gpu.json" 2>&1 | tee "$out/bench.log"
