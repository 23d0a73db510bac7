#!/usr/bin/env bash
# pp=2 on 2 GPUs through the CLI, as a user runs it: greedy ids equal to pp=1, every role's
# spans in one trace, one Perfetto file with every process, decode tok/s from each run's
# stats. Usage (GPU machine, repo root): benchmarks/pp_gpu_check.sh [shape=mid] [tokens=200]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .whl/use-wheels.sh ] && source .whl/use-wheels.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
shape=${1:-mid}; n=${2:-200}; out=${OUT:-benchmarks/out}; work=$(mktemp -d)
mkdir -p "$out"
model=$(python3 -c "import pathlib, torch; from memra_dist.bench.checkpoints import ensure_checkpoint; \
print(ensure_checkpoint('$shape', pathlib.Path('${MEMRA_BENCH_CACHE:-/tmp/memra-bench-ckpt}'), torch.device('cuda'), lambda s: None))")
for pp in 1 2; do
  t0=$(python3 -c 'import time; print(time.time())')
  python3 -m memra_dist.cli generate --model "$model" --prompt "the phase clock drains the streams" --pp $pp \
    --max-new-tokens "$n" --drafter ngram --trace-level 1 --run-dir "$work/r$pp" --json > "$work/pp$pp.json" 2> "$work/pp$pp.err" \
    || { echo "pp=$pp failed"; tail -20 "$work/pp$pp.err"; exit 1; }
  echo "pp=$pp process_s=$(python3 -c "import time; print(round(time.time() - $t0, 1))")"
done
python3 - "$work" <<'PY' | tee "$out/pp_gpu_check.txt"
import json, sys
w = sys.argv[1]
a, b = (json.load(open(f"{w}/pp{p}.json")) for p in (1, 2))
print("ids equal pp=1/pp=2:", a["token_ids"] == b["token_ids"])
for p, r in (("1", a), ("2", b)):
    print(f"pp={p} stats:", {k: r["stats"][k] for k in ("tokens", "tok_per_s", "ttft_ms", "rounds", "acceptance")},
          "trace_complete:", r["trace_complete"])
PY
python3 benchmarks/trace_roles.py "$work/r2" --pp 2 | tee -a "$out/pp_gpu_check.txt"
grep -h "lost\|INCOMPLETE\|Traceback" "$work"/pp*.err || echo "no lost spans, no traceback"
