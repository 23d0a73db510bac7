#!/usr/bin/env bash
# Issue 9 in one command on a 4-GPU machine (nvidia-h200-x4), ~8-9 min:
#  1. the bench's pp section: hop, pp=2 and pp=4 decode against pp=1 (8B shape), greedy ids;
#  2. the phase clock at pp 1 / 2 / 4: plain and n-gram (spec-round walls), 8B and the kimi hybrid,
#     greedy ids compared across pp;
#  3. one level-1 request at pp=4: every actor's spans in one trace, with each GPU's free memory.
# Results under $OUT (bench/, pp_phases-*/); record with `memra-dist bench --from-json ... --record`.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-benchmarks/out}"
OUT="$OUT/bench" BENCH_BUDGET_S="${BENCH_BUDGET_S:-200}" timeout 260 bash benchmarks/run_gpu.sh --sections pp
for spec in "8b none" "8b ngram" "kimi none"; do
  set -- $spec
  SHAPE=$1 DRAFTER=$2 PPS="1 2 4" timeout 150 bash benchmarks/pp_phases.sh 96
done
[ -f .whl/use-wheels.sh ] && { source .whl/use-wheels.sh || true; }
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/trace_roles.py "$OUT/pp_phases-8b-none/pp4" --pp 4
