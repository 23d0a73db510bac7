#!/usr/bin/env bash
# Where does pp=2 lose time against pp=1? The engine's own phase clock answers: the same
# plain greedy generation of the 8B shape at trace level 1 with the profile, at --pp 1 and
# --pp 2 (2 GPUs), printing the [spec-phase] / [spec-prof-summary] lines of each; the run
# dirs keep every span (stage forwards included).   usage: benchmarks/pp_phases.sh [N tokens]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .whl/use-wheels.sh ] && source .whl/use-wheels.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MEMRA_BENCH_CACHE="${MEMRA_BENCH_CACHE:-/tmp/memra-bench-ckpt}"   # shared with run_gpu.sh
out="${OUT:-benchmarks/out}/pp_phases"; mkdir -p "$out"
ckpt=$(python3 - <<'PY'
import sys
from pathlib import Path
import torch
from memra_dist.bench.checkpoints import bench_cache_dir, ensure_checkpoint
print(ensure_checkpoint("8b", bench_cache_dir(), torch.device("cuda"), lambda m: print(m, file=sys.stderr)))
PY
)
prompt="the quick brown fox jumps over the lazy dog and then the fox runs away into the forest"
for pp in 1 2; do
  python3 -m memra_dist.cli generate --model "$ckpt" --prompt "$prompt" --max-new-tokens "${1:-160}" \
    --drafter none --pp $pp --device cuda --compile --trace-level 1 --prof --burst-rounds 16 \
    --run-dir "$out/pp$pp" --json > "$out/pp$pp.json" 2> "$out/pp$pp.err" || echo "pp=$pp failed: $(tail -3 "$out/pp$pp.err")"
  echo "== pp=$pp"; grep -E "^\[spec-(phase|prof-summary)\]" "$out/pp$pp.err" | tail -4
done
