"""What a round leaves behind when the clock is on: numbers only, filled in the round loop,
turned into lines and spans after the burst (never inside it)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RoundRecord", "BurstRecord", "PHASE_COUNT"]

PHASE_COUNT = 5  # draft, verify, accept, rollback, maint


@dataclass
class RoundRecord:
    """One round: six clock stamps (entry + the five boundaries, perf_counter ns) and the
    numbers each phase span carries. `h[i]`: when the host reached phase i's end boundary
    (before its drain, or as it recorded its events; 0: not taken, as in a one-step-ahead
    round)."""

    index: int = 0
    t: list[int] = field(default_factory=lambda: [0] * (PHASE_COUNT + 1))
    h: list[int] = field(default_factory=lambda: [0] * PHASE_COUNT)
    k: int = 0  # drafted tokens that entered the verify
    j: int = 0  # accepted drafts
    ctx: int = 0  # committed target rows at round entry
    free_mb: list[dict[str, int]] = field(default_factory=lambda: [{} for _ in range(PHASE_COUNT)])
    sub_ns: dict[str, int] = field(default_factory=dict)  # level 2: kda/mla/attn/ffn/scan
    seq_rows: int = 0
    draft_forwards: int = -1  # draft-network forwards in the draft phase (-1: the drafter does not say)
    batch: object | None = None  # a batched request: the BatchStep its verify rode in (batching/batcher.py)
    draft_requests: int = 0  # a leader's round: requests its shared draft forward drafted (0: none shared)
    expected: float = -1.0  # --spec-k auto: the accepted drafts its K was chosen for (-1: K was fixed)

    def phase_ns(self, i: int) -> int:
        return self.t[i + 1] - self.t[i]

    def host_ns(self, i: int) -> int:
        """Phase i's host part: from its start until the host reached its end (its launches,
        its host work and any wait inside it, such as a readback); the rest of the phase is
        the drain, the device finishing work already launched. 0 where not taken."""
        if not self.h[i]:
            return 0
        return max(0, min(self.h[i], self.t[i + 1]) - self.t[i])

    @property
    def wall_ns(self) -> int:
        return self.t[PHASE_COUNT] - self.t[0]


@dataclass
class BurstRecord:
    """The rounds of one burst plus its bounds. `rounds` is a preallocated pool; `n` are live."""

    index: int = 0
    t0: int = 0
    t1: int = 0
    k: int = 0
    rounds: list[RoundRecord] = field(default_factory=list)
    n: int = 0
    tokens: int = 0
    clock: str = "drain"  # how its boundaries were timed (phase/clock.py): events | drain | ahead | leader
    compact: bool = False  # each round one span, its phases attributes (a batched leader's rounds at level 1)

    @property
    def ahead(self) -> bool:
        """Its rounds ran one step ahead (specdec/ahead.py): phases from each step's device events."""
        return self.clock == "ahead"

    def reset(self, index: int, k: int, capacity: int) -> None:
        self.index, self.k, self.n, self.tokens, self.clock, self.compact = index, k, 0, 0, "drain", False
        while len(self.rounds) < capacity:
            self.rounds.append(RoundRecord())

    def next_round(self) -> RoundRecord:
        r = self.rounds[self.n]
        self.n += 1
        return r

    def live(self) -> list[RoundRecord]:
        return self.rounds[: self.n]

    def totals_ns(self) -> list[int]:
        """Per-phase ns summed over the live rounds (draft, verify, accept, rollback, maint)."""
        return self._per_phase(RoundRecord.phase_ns)

    def host_totals_ns(self) -> list[int]:
        """Per-phase host ns (RoundRecord.host_ns) summed over the live rounds."""
        return self._per_phase(RoundRecord.host_ns)

    def _per_phase(self, of) -> list[int]:
        live = self.live()
        return [sum(of(r, i) for r in live) for i in range(PHASE_COUNT)]
