#!/usr/bin/env bash
# Where does a pipeline lose time against pp=1? The engine's own phase clock answers: the same
# greedy generation at trace level 1 with the profile, at each --pp in $PPS (default "1 2"),
# printing the [spec-phase] / [spec-prof-summary] lines of each; every run dir keeps its spans
# (stage forwards included) and the --json result (token ids: they must agree across pp).
#   usage: benchmarks/pp_phases.sh [N tokens]     env: PPS="1 2 4" SHAPE=8b|kimi DRAFTER=none|ngram
#   (DEVICE=cpu SHAPE=tiny: a dry run of the script itself on a CPU machine)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .whl/use-wheels.sh ]; then
  # shellcheck disable=SC1091
  source .whl/use-wheels.sh || echo "[pp_phases] warning: .whl/use-wheels.sh failed; using the installed packages" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MEMRA_BENCH_CACHE="${MEMRA_BENCH_CACHE:-/tmp/memra-bench-ckpt}"   # shared with run_gpu.sh
shape="${SHAPE:-8b}"; drafter="${DRAFTER:-none}"; device="${DEVICE:-cuda}"
compile=(); [ "$device" = cuda ] && compile=(--compile)
out="${OUT:-benchmarks/out}/pp_phases-$shape-$drafter"; mkdir -p "$out"
ckpt=$(SHAPE="$shape" DEVICE="$device" python3 - <<'PY'
import os, sys
import torch
from memra_dist.bench.checkpoints import bench_cache_dir, ensure_checkpoint
print(ensure_checkpoint(os.environ["SHAPE"], bench_cache_dir(), torch.device(os.environ["DEVICE"]),
                        lambda m: print(m, file=sys.stderr)))
PY
)
prompt="the quick brown fox jumps over the lazy dog and then the fox runs away into the forest"
for pp in ${PPS:-1 2}; do
  python3 -m memra_dist.cli generate --model "$ckpt" --prompt "$prompt" --max-new-tokens "${1:-160}" \
    --drafter "$drafter" -k 4 --pp "$pp" --device "$device" "${compile[@]}" --trace-level 1 --prof --burst-rounds 16 \
    --run-dir "$out/pp$pp" --json > "$out/pp$pp.json" 2> "$out/pp$pp.err" || echo "pp=$pp failed: $(tail -3 "$out/pp$pp.err")"
  echo "== $shape pp=$pp drafter=$drafter"; grep -E "^\[spec-(phase|prof-summary)\]" "$out/pp$pp.err" | tail -4 || true
done
python3 - "$out" ${PPS:-1 2} <<'PY'
import json, sys
from pathlib import Path
out, pps = Path(sys.argv[1]), sys.argv[2:]
ids = {pp: json.loads((out / f"pp{pp}.json").read_text()).get("token_ids") for pp in pps if (out / f"pp{pp}.json").stat().st_size}
base = ids.get(pps[0])
print("greedy ids equal across pp:", {pp: v == base for pp, v in ids.items()})
PY
