#!/usr/bin/env bash
# On the GPU machine (device tool), from the repo root, with .whl carried.
set -uo pipefail
[ -f .whl/use-wheels.sh ] && source .whl/use-wheels.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python -m memra_dist.cli generate --model "${TINY:-/tmp/memra-ckpt/tiny}" --prompt "x" --help >/dev/null
timeout 500 python benchmarks/gpu_smoke.py "$OUT" 2>&1 | tail -40
# pp=2 on two GPUs vs pp=1, tiny fp32 (token-identical expected)
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  for pp in 1 2; do
    timeout 200 python -m memra_dist.cli generate --model /tmp/memra-ckpt/mid --prompt "the phase clock drains the streams" \
      --pp $pp --device cuda --dtype fp32 --json --max-new-tokens 32 --trace-level 1 --run-dir "$OUT/pp$pp" > "$OUT/pp$pp.json" 2> "$OUT/pp$pp.err"
    echo "pp=$pp rc=$?"; tail -3 "$OUT/pp$pp.err"
  done
  python - "$OUT" <<'PY'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/pp{p}.json")) for p in (1, 2))
print("pp2 == pp1:", a["token_ids"] == b["token_ids"], a["stats"], b["stats"])
PY
  ls "$OUT"/pp2
fi
