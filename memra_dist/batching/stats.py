"""A batched engine's counters (the batcher's `stats`; `BatchedBackend.stats` and the bench
read `as_dict`): steps, rows, requests a step, the device's busy share, the loop's host time on
the chained rounds, preemptions."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BatchStats"]


@dataclass
class BatchStats:
    steps: int = 0
    rows: int = 0
    requests: int = 0  # request-steps: a request's rows in a step count once
    max_requests: int = 0  # the most requests one step held
    waits: int = 0  # admissions that waited for blocks
    k_chosen: dict = field(default_factory=dict)  # --spec-k auto: chained rounds by the K chosen for them
    k_cut: int = 0  # ... of them, rounds the engine gave fewer drafts than their bound (loop_rounds.py count_k)
    k_cut_drafts: int = 0  # ... and the drafts it cut from them
    shadows: int = 0  # --spec-k auto: host drafters' K-0 rounds that proposed unverified drafts to score (chain.py shadow)
    remeasures: int = 0  # --spec-k auto: steps that drafted every request after a long run at K 0 (loop_rounds.py)
    prefix_waits: int = 0  # admissions that waited for another request to compute their prompt's shared blocks
    preemptions: int = 0  # requests swapped out to let another grow
    forward_ns: int = 0  # the steps' forwards, launch to device done
    # from a step's end to the next one's start, when a request rode both: the device idle while
    # requests mid-generation do their host work (acceptance, drafts, streaming) and the wait
    gap_ns: int = 0
    # ... of it, the loop holding a step back for a request's next submission while others wait
    # (batcher.py _ready_in: a request busy on the host, or not yet chained)
    holds: int = 0
    held_ns: int = 0
    chained: int = 0  # request rounds the step leader ran (chain.py)
    rounds_ns: int = 0  # the leader's host time in those rounds (inside the gaps between steps)
    maint_ns: int = 0  # ... of it, the drafters' maintenance (chain_drafts.py maintain_rounds)
    draft_ns: int = 0  # ... and the next proposals (propose_rounds); the rest: acceptance, commit, trim
    ahead: int = 0  # steps launched one step ahead (ahead.py)
    ahead_verifies: int = 0  # ... of them, speculative rounds' verifies (verify_ahead.py)
    eager: int = 0  # steps not replayed as a graph (prefill chunks, or no graphs: the CPU)
    eager_ns: int = 0  # their share of forward_ns
    voids: int = 0  # rows of those past their request's end (an EOS), dropped
    parks: int = 0  # chains whose next rows found no free block (their session ran that round)
    draft_batches: int = 0  # draft forwards the leader ran for several chained requests at once (chain_drafts.py)
    draft_batched: int = 0  # the proposals made in them
    pre_maintained: int = 0  # rounds whose drafter ingested their verify rows behind the step, before its readback
    early_drafted: int = 0  # ... and drafted their next round there too, the acceptance found on the device
    primes: int = 0  # new requests' drafters the loop allocated and primed (primes.py)
    prime_runs: int = 0  # ... in this many passes between steps
    prime_ns: int = 0  # the loop's time in them (launch, and what the device made it wait for)

    def as_dict(self) -> dict:
        return {"steps": self.steps, "rows": self.rows, "max_requests": self.max_requests,
                "mean_requests": round(self.requests / self.steps, 3) if self.steps else 0.0,
                "mean_rows": round(self.rows / self.steps, 3) if self.steps else 0.0,
                "mean_step_ms": round(self.forward_ns / self.steps / 1e6, 3) if self.steps else 0.0,
                "gap_ms": round(self.gap_ns / 1e6, 1), "step_ms": round(self.forward_ns / 1e6, 1),
                "busy": round(self.forward_ns / (self.forward_ns + self.gap_ns), 3) if self.steps else 0.0,
                "holds": self.holds, "held_ms": round(self.held_ns / 1e6, 1), "chained_rounds": self.chained, "chain_parks": self.parks,
                "draft_batches": self.draft_batches,
                "mean_draft_batch": round(self.draft_batched / self.draft_batches, 3) if self.draft_batches else 0.0,
                "pre_maintained_rounds": self.pre_maintained, "early_drafted_rounds": self.early_drafted,
                "leader_rounds_ms": round(self.rounds_ns / 1e6, 1), "leader_maint_ms": round(self.maint_ns / 1e6, 1),
                "leader_draft_ms": round(self.draft_ns / 1e6, 1),
                "loop_primes": self.primes, "loop_prime_runs": self.prime_runs,
                "loop_prime_ms": round(self.prime_ns / 1e6, 1), "ahead_steps": self.ahead,
                "ahead_verify_steps": self.ahead_verifies, "void_rows": self.voids,
                "eager_steps": self.eager, "eager_step_ms": round(self.eager_ns / 1e6, 1),
                "admission_waits": self.waits, "prefix_waits": self.prefix_waits,
                "k_chosen": {str(k): n for k, n in sorted(self.k_chosen.items())}, "k_cut_rounds": self.k_cut,
                "k_cut_drafts": self.k_cut_drafts, "k_remeasures": self.remeasures, "k_shadows": self.shadows,
                "preemptions": self.preemptions}
