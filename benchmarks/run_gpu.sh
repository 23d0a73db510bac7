#!/usr/bin/env bash
# The full `memra-dist bench` suite on the GPU machine, in ONE run (so the ratios hold).
# One H200: shape 8b target + 1b draft (+ the kimi hybrid), ~6-8 min wall including writing the
# random-weight checkpoints on first use (~25 GB, cached under $MEMRA_BENCH_CACHE for later runs).
# With >= 2 GPUs the pp section (pp=2 vs pp=1, per-hop transfer) runs too.
#   run it:   benchmarks/run_gpu.sh [extra bench flags, e.g. --graphs off | --quick]
#   results:  $OUT/bench.json, $OUT/bench.md, $OUT/bench.log (benchmarks/out/ when OUT is unset)
#   record:   memra-dist bench --from-json <fetched bench.json> --record   (appends to BENCHMARKS.md here)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .whl/use-wheels.sh ]; then
  # shellcheck disable=SC1091
  source .whl/use-wheels.sh || echo "[run_gpu] warning: .whl/use-wheels.sh failed; using the installed packages" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the repo itself, installed or not
export TOKENIZERS_PARALLELISM=false
export MEMRA_BENCH_CACHE="${MEMRA_BENCH_CACHE:-/tmp/memra-bench-ckpt}"
outdir="${OUT:-benchmarks/out}"
mkdir -p "$outdir"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$outdir/gpus.txt" || true
python3 -m memra_dist.cli bench --budget-s "${BENCH_BUDGET_S:-420}" --out "$outdir/bench.json" "$@" \
  2> >(tee "$outdir/bench.log" >&2) | tee "$outdir/bench.md"
