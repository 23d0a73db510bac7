"""benchmarks/trace_cost.py on the CPU (tiny shape): every level and clock of each case gives
the same ids and rounds, the traced runs say which clock timed them (CPU: drained), and the
level-1 phases of both clocks are compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_trace_cost_runs_every_level_and_clock(tmp_path):
    env = {**os.environ, "MEMRA_BENCH_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trace_cost.py"), str(tmp_path / "out"),
                        "--shape", "tiny", "--cases", "ngram,dflash", "--new", "16", "--prompt", "48",
                        "--repeats", "1", "--explain"], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "trace_cost.json").read_text())
    assert [c["case"] for c in res["cases"]] == ["plain", "ngram", "dflash"]  # dflash replays plain's ids
    for c in res["cases"]:
        assert c["ids_equal"] and c["rounds_equal"], c["case"]
        assert set(c["runs"]) == {"0/events", "1/events", "2/events", "1/drain", "2/drain", "1/nospans", "1/nogc",
                                  "1/nopump"}
        for key, r in c["runs"].items():
            if key != "0/events":
                # the engine loop's rounds (pp 1, any --max-batch): off CUDA their boundaries are
                # drained, no timing events
                assert r["clock_used"] == "leader", (c["case"], key)
                assert (r["spans"] > 0) == (key != "1/nospans"), (c["case"], key)
        assert set(c["level1_phase_vs_drain"]) == {"draft", "verify", "accept", "rollback", "maint"}
    assert "| dflash | 7 |" in p.stdout
