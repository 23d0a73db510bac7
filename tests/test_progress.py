"""Load progress: quiet for small checkpoints, at most one line a second, always a last line."""

from __future__ import annotations

import io

from memra_dist.progress import QUIET_BELOW_BYTES, LoadProgress


def _run(steps, total, times):
    out = io.StringIO()
    t = iter(times)
    p = LoadProgress("m", out=out, clock=lambda: next(t))
    for done in steps:
        p(done, total)
    return out.getvalue().splitlines()


def test_small_checkpoints_say_nothing():
    assert _run([1, 2, 3], 1000, [0, 0, 0, 0]) == []


def test_throttled_lines_and_a_final_one():
    big = 4 * QUIET_BELOW_BYTES
    steps = [big // 4, big // 2, 3 * big // 4, big]
    lines = _run(steps, big, [0.0, 0.5, 1.2, 1.7, 2.5])  # t0, then one clock read per call
    assert lines[0].startswith("[memra] loading m: 50 % (")
    assert lines[-1].startswith("[memra] loading m: 100 % (") and lines[-1].endswith("in 2.5 s")
    assert len(lines) == 2  # 0.5 s: too soon; 1.2 s: a line; 1.7 s: within a second of it


def test_a_fast_big_load_says_only_its_end():
    big = 2 * QUIET_BELOW_BYTES
    assert _run([big // 2, big], big, [0.0, 0.1, 0.2]) == ["[memra] loading m: 100 % (1.1 of 1.1 GB) in 0.2 s"]
