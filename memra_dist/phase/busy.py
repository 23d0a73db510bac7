"""How busy each pipeline stage was, from its `stage.forward` intervals (pure logic).

A stage's busy share is the union of its forwards' intervals over a window (overlapping
intervals count once), the window being the span from the first forward of any stage to
the last. At one session a ppN split keeps each stage busy about 1/N of the time; with
sessions in flight the shares rise towards 1. `overlap_ms` is the time two different
stages worked at once, which only sessions in flight can produce.

>>> s = stage_busy({0: [(0, 10), (20, 30)], 1: [(10, 20), (30, 40)]})
>>> s.share
{0: 0.5, 1: 0.5}
>>> stage_busy({0: [(0, 10), (10, 20)], 1: [(5, 15)]}).overlap_ms
1e-05
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StageBusy", "stage_busy", "merge"]


def merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of [t0, t1) intervals as disjoint sorted intervals."""
    out: list[list[int]] = []
    for t0, t1 in sorted(intervals):
        if out and t0 <= out[-1][1]:
            out[-1][1] = max(out[-1][1], t1)
        else:
            out.append([t0, t1])
    return [(a, b) for a, b in out]


def _length(iv: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in iv)


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass
class StageBusy:
    window_ns: int
    busy_ns: dict[int, int]
    overlap_ns: int  # summed over stage pairs: time two stages worked at once

    @property
    def share(self) -> dict[int, float]:
        w = self.window_ns or 1
        return {s: round(b / w, 4) for s, b in sorted(self.busy_ns.items())}

    @property
    def overlap_ms(self) -> float:
        return self.overlap_ns / 1e6

    def line(self) -> str:
        shares = " ".join(f"stage{s}={v:.2f}" for s, v in self.share.items())
        return f"stage busy share over {self.window_ns / 1e6:.1f} ms: {shares} (overlap {self.overlap_ms:.1f} ms)"


def stage_busy(by_stage: dict[int, list[tuple[int, int]]]) -> StageBusy:
    """by_stage: stage -> [(t0_ns, t1_ns), ...] of its forwards (one clock for all stages)."""
    merged = {s: merge(iv) for s, iv in by_stage.items() if iv}
    if not merged:
        return StageBusy(0, {}, 0)
    t0 = min(iv[0][0] for iv in merged.values())
    t1 = max(iv[-1][1] for iv in merged.values())
    stages = sorted(merged)
    overlap = sum(_intersect(merged[a], merged[b]) for i, a in enumerate(stages) for b in stages[i + 1:])
    return StageBusy(t1 - t0, {s: _length(iv) for s, iv in merged.items()}, overlap)
