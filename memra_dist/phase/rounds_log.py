"""The per-round depth log (`MEMRA_SPEC_PROF=1`, first 64 rounds) and its one-line summary,
(docs/seed-names.md gives the originating engine's names for both)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SPEC_PROF_ROUNDS", "RoundProf", "RoundsLog"]

SPEC_PROF_ROUNDS = 64


@dataclass(frozen=True)
class RoundProf:
    """One round's attribution row (ms); rest = rollback + maint."""

    wall_ms: float
    draft_ms: float
    verify_ms: float
    accept_ms: float
    rest_ms: float
    k: int
    j: int
    ctx: int
    seq_rows: int = 0

    def line(self, i: int) -> str:
        return (f"r={i} wall={self.wall_ms:.3f}ms draft={self.draft_ms:.3f} verify={self.verify_ms:.3f} "
                f"accept={self.accept_ms:.3f} rest={self.rest_ms:.3f} k={self.k} j={self.j} "
                f"ctx={self.ctx} seq_rows={self.seq_rows}")


@dataclass
class RoundsLog:
    rounds: list[RoundProf] = field(default_factory=list)  # printing is the sink's: phase/report.py LineSink

    def wants_more(self) -> bool:
        return len(self.rounds) < SPEC_PROF_ROUNDS

    def push(self, r: RoundProf) -> None:
        if self.wants_more():
            self.rounds.append(r)

    def summary(self) -> str:
        n = len(self.rounds)
        if n == 0:
            return "rounds=0"
        k = sum(r.k for r in self.rounds)
        j = sum(r.j for r in self.rounds)
        walls = sorted(r.wall_ms for r in self.rounds)
        med = walls[n // 2]
        mean = sum(walls) / n
        slow = sum(1 for w in walls if w > 1.5 * med)
        verify_mean = sum(r.verify_ms for r in self.rounds) / n
        draft_mean = sum(r.draft_ms for r in self.rounds) / n
        seq = sum(r.seq_rows for r in self.rounds)
        return (
            f"rounds={n} k_mean={k / n:.2f} j_mean={j / n:.2f} accept={j / k if k else 0.0:.3f} "
            f"tok_per_round={(j + n) / n:.2f} wall_ms mean={mean:.1f} min={walls[0]:.1f} "
            f"med={med:.1f} max={walls[-1]:.1f} slow_rounds(>1.5x med)={slow} "
            f"draft_mean={draft_mean:.1f} verify_mean={verify_mean:.1f} seq_rows_total={seq} "
            f"ctx_first={self.rounds[0].ctx} ctx_last={self.rounds[-1].ctx}"
        )
