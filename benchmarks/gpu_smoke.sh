#!/usr/bin/env bash
# On the GPU machine (device tool), from the repo root, with .whl carried.
set -uo pipefail
[ -f .whl/use-wheels.sh ] && source .whl/use-wheels.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python -m memra_dist.cli generate --model "${TINY:-/tmp/memra-ckpt/tiny}" --prompt "x" --help >/dev/null
timeout 500 python benchmarks/gpu_smoke.py "$OUT" 2>&1 | tail -40
