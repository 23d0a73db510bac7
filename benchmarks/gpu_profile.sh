#!/usr/bin/env bash
set -uo pipefail
[ -f .whl/use-wheels.sh ] && source .whl/use-wheels.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 300 python benchmarks/gpu_profile.py "$OUT" 2>&1 | tail -45
