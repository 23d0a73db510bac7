"""The terminal's phase-share table: where the traced rounds' time went, summed over bursts."""

from __future__ import annotations

import threading

from ..tracing.conventions import PHASES
from .lines import sub_totals
from .records import BurstRecord

__all__ = ["ShareTable", "JobShare", "CLOCK_HOW"]

# how the rounds of each BurstRecord.clock were timed (phase/clock.py, specdec/ahead.py, batching/chain.py)
CLOCK_HOW = {
    "events": "each phase ends when its streams reach its boundary's event (no drain)",
    "ahead": "one step ahead: verify is each step's device time, accept the rest of its round",
    "drain": "each phase timed from one stream drain to the next",
    "leader": "the batch step leader's stamps: the verify ends at its step's readback",
    "host": "host stamps: each phase's device work is done when the host leaves it (a batched request, no drain)",
}


class ShareTable:
    def __init__(self):
        self.ns = [0] * len(PHASES)
        self.host_ns = [0] * len(PHASES)  # each phase's host part (RoundRecord.host_ns), drained rounds only
        self.sub: dict[str, int] = {}
        self.n_rounds = 0
        self.by_clock: dict[str, int] = {}  # rounds per BurstRecord.clock
        # --spec-k auto: per K chosen, [rounds, their ns, accepted drafts, expected accepted drafts]
        self.by_k: dict[int, list] = {}

    def burst(self, rec: BurstRecord) -> None:
        for i, v in enumerate(rec.totals_ns()):
            self.ns[i] += v
        for i, v in enumerate(rec.host_totals_ns()):
            self.host_ns[i] += v
        self.n_rounds += rec.n
        self.by_clock[rec.clock] = self.by_clock.get(rec.clock, 0) + rec.n
        for r in rec.live():
            if r.expected >= 0:  # its K was chosen by goodput
                row = self.by_k.setdefault(r.k, [0, 0, 0, 0.0])
                row[0] += 1
                row[1] += r.t[-1] - r.t[0]
                row[2] += r.j
                row[3] += r.expected
        if any(r.sub_ns for r in rec.live()):
            for key, v in sub_totals(rec).items():
                self.sub[key] = self.sub.get(key, 0) + v

    def merge(self, other: "ShareTable") -> None:
        """Add another table's rounds to this one's (many requests' tables into one)."""
        self.ns = [a + b for a, b in zip(self.ns, other.ns)]
        self.host_ns = [a + b for a, b in zip(self.host_ns, other.host_ns)]
        for key, v in other.sub.items():
            self.sub[key] = self.sub.get(key, 0) + v
        self.n_rounds += other.n_rounds
        for clock, n in other.by_clock.items():
            self.by_clock[clock] = self.by_clock.get(clock, 0) + n
        for k, row in other.by_k.items():
            mine = self.by_k.setdefault(k, [0, 0, 0, 0.0])
            for i, v in enumerate(row):
                mine[i] += v

    def ms_a_round(self) -> dict[str, float]:
        """Each phase's mean ms a round (0 rounds: {})."""
        if not self.n_rounds:
            return {}
        return {p: round(ns / self.n_rounds / 1e6, 3) for p, ns in zip(PHASES, self.ns)}

    @property
    def ahead_rounds(self) -> int:
        """Rounds one step ahead (phases from the step's device events)."""
        return self.by_clock.get("ahead", 0)

    @property
    def event_rounds(self) -> int:
        """Rounds timed by the event clock (phase/clock.py: no drain at a boundary)."""
        return self.by_clock.get("events", 0)

    def first_token(self, prof) -> None:
        pass

    def rounds(self, log, final) -> None:  # the profile's rows are printed by LineSink
        pass

    def _how(self) -> str:
        kinds = [(n, CLOCK_HOW.get(clock, CLOCK_HOW["drain"])) for clock, n in self.by_clock.items() if n]
        if len(kinds) == 1:
            return kinds[0][1]
        if not kinds:
            return "each phase timed from one stream drain to the next"
        return "; ".join(f"{n} rounds {how}" for n, how in kinds)

    def table(self) -> str:
        """Phase rows are shares of the traced rounds' time (they add up to 100 %). At level 2
        the verify rows below them are shares of verify (they add up to 100 % of verify):
        one row per mixer class the model has, then `rest` (everything else in verify), with
        the FFN's time shown inside rest and the KDA scan inside kda. The host column is each
        phase's part before its drain (ms a drained round): launches, host work and waits inside
        the phase such as a readback; `-` where no round was drained (one step ahead)."""
        n = max(self.n_rounds, 1)
        total = sum(self.ns) or 1
        drained = self.n_rounds - self.ahead_rounds
        head = f"  {'':<16}{'total ms':>10}{'ms/round':>10}{'host':>8}{'share':>8}"
        lines = [f"phase shares over {self.n_rounds} speculative rounds: where their time went ({self._how()})", head]

        def row(name: str, ns: int, of: int, bar: bool = True, host: int | None = None) -> str:
            pct = 100 * ns / (of or 1)
            tail = " " + "#" * int(round(30 * ns / (of or 1))) if bar else ""
            h = "" if host is None else (f"{host / 1e6 / drained:.3f}" if drained else "-")
            return f"  {name:<16}{ns / 1e6:>10.2f}{ns / 1e6 / n:>10.3f}{h:>8}{pct:>7.1f}%{tail}"

        for name, ns, host in zip(PHASES, self.ns, self.host_ns):
            lines.append(row(name, ns, total, host=host))
        if drained:
            lines.append("  host: ms a round until the host reached the phase's end (launches, host work, waits such "
                         "as a readback); the rest of ms/round is the device finishing what was launched")
        if self.sub:
            verify = self.ns[PHASES.index("verify")] or 1
            lines.append("  verify by mixer class (shares of verify):")
            for key in ("kda", "mla", "attn"):
                if self.sub.get(key, 0) > 0:
                    lines.append(row(f"  {key}", self.sub[key], verify))
                    if key == "kda" and self.sub.get("scan", 0) > 0:
                        lines.append(row("    of it scan", self.sub["scan"], verify, bar=False))
            lines.append(row("  rest", self.sub.get("rest", 0), verify))
            if self.sub.get("ffn", 0) > 0:
                lines.append(row("    of it ffn", self.sub["ffn"], verify, bar=False))
        lines += self._k_lines()
        return "\n".join(lines)

    def _k_lines(self) -> list[str]:
        """--spec-k auto: one line per K chosen: its rounds, their ms a round, and the drafts
        accepted a round against the number the choice expected."""
        if not self.by_k:
            return []
        out = ["  by K chosen (--spec-k auto):   rounds  ms/round  accepted  expected"]
        for k in sorted(self.by_k):
            n, ns, acc, exp = self.by_k[k]
            out.append(f"    K={k:<3}{'':<20}{n:>7}{ns / 1e6 / n:>10.3f}{acc / n:>10.2f}{exp / n:>10.2f}")
        return out


class JobShare(ShareTable):
    """A ShareTable many requests' threads feed at once (a batch job's: serve/batch.py), each
    burst's record added under a lock."""

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()

    def burst(self, rec: BurstRecord) -> None:
        with self._lock:
            super().burst(rec)

    def table(self) -> str:
        with self._lock:
            return super().table()
