"""The terminal's share table adds up: phase rows are shares of the rounds (100 %), level-2
rows shares of verify (100 %), ffn inside rest and scan inside kda, absent classes omitted."""

from __future__ import annotations

import re

from memra_dist.phase.share import ShareTable


def _table(sub):
    t = ShareTable()
    t.ns = [1_000_000, 6_000_000, 400_000, 100_000, 500_000]  # draft verify accept rollback maint
    t.n_rounds = 10
    t.sub = sub
    return t.table().splitlines()


def _pct(line: str) -> float:
    return float(re.search(r"([\d.]+)%", line).group(1))


def test_phase_rows_add_to_100_and_verify_rows_to_100_of_verify():
    lines = _table({"kda": 2_000_000, "scan": 500_000, "mla": 0, "attn": 1_000_000, "ffn": 1_500_000,
                    "rest": 3_000_000})
    phases = [ln for ln in lines if re.match(r"  (draft|verify|accept|rollback|maint)\s+[\d.]", ln)]
    assert len(phases) == 5 and abs(sum(_pct(ln) for ln in phases) - 100) < 0.3
    head = lines.index("  verify by mixer class (shares of verify):")
    sub = lines[head + 1:]
    top = [ln for ln in sub if re.match(r"    (kda|mla|attn|rest)\s", ln)]
    assert [ln.split()[0] for ln in top] == ["kda", "attn", "rest"]  # mla absent: no row
    assert abs(sum(_pct(ln) for ln in top) - 100) < 0.3  # kda + attn + rest = verify
    inner = {ln.split()[2]: ln for ln in sub if "of it" in ln}
    assert set(inner) == {"scan", "ffn"}
    assert sub.index(inner["scan"]) == sub.index(top[0]) + 1  # scan right under kda
    assert sub.index(inner["ffn"]) == sub.index(top[-1]) + 1  # ffn right under rest
    widths = {len(ln) - len(ln.split("%")[0]) for ln in phases + top}  # the share column lines up
    assert len({ln.index("%") for ln in phases + top}) == 1, widths


def test_no_level_2_rows_without_level_2_data():
    assert not any("mixer class" in ln for ln in _table({}))


def test_the_header_says_how_the_phases_were_timed():
    from memra_dist.phase.records import BurstRecord

    def rec(n, ahead, clock="drain"):
        r = BurstRecord()
        r.reset(0, 1, n)
        for _ in range(n):
            r.next_round().t = [0, 0, 5, 6, 6, 6]
        r.clock = "ahead" if ahead else clock
        return r

    t = ShareTable()
    t.burst(rec(3, False))
    assert "from one stream drain to the next" in t.table().splitlines()[0]
    t2 = ShareTable()
    t2.burst(rec(4, True))
    first = t2.table().splitlines()[0]
    assert "one step ahead" in first and "drain" not in first
    t2.burst(rec(2, False))
    assert t2.table().splitlines()[0].startswith("phase shares over 6 speculative rounds") and \
        "4 rounds one step ahead" in t2.table().splitlines()[0]
    t3 = ShareTable()
    t3.burst(rec(5, False, "events"))
    first = t3.table().splitlines()[0]
    assert "boundary's event (no drain)" in first and "from one stream drain" not in first
    t3.burst(rec(1, False))
    assert "5 rounds each phase ends when its streams reach" in t3.table().splitlines()[0]
    again = BurstRecord()
    again.clock = "ahead"
    again.reset(1, 1, 1)
    assert not again.ahead and again.clock == "drain"  # a reused record starts as a round-loop burst
