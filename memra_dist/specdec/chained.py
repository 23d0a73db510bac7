"""A batched request whose rounds the batcher's step leader runs (batching/chain.py): the
session's side. The leader queues each next verify right after the step before; here each
round is taken as it comes and committed into the session (the same commit and stop rules, so
the session ends where the chain does), recorded and streamed. A chain that parked (its next
rows found no free block) leaves one round to the session's own loop, which waits for blocks
or preempts; then a new chain starts. Traced, each round's phases come from the leader's
stamps (the verify ends at the step's readback; no boundary drained but that readback)."""

from __future__ import annotations

import torch

from ..phase.late_stamps import monotone
from ..phase.records import BurstRecord, RoundRecord
from .accept import NonFiniteRow

__all__ = ["burst_chained"]

# Traced, a round the loop ran is ONE span (spec.round, its phases as attributes and the batch
# step's id) instead of six: 16 requests a step would otherwise build ~100 spans each ~5 ms step
# on the host the loop launches from (measured at 16 concurrent on an H200: level 1 cost 13 % of
# the batch's rate with six spans a round). At level 2 too: there the step's verify sub-split is
# made once, under the step's span (tracing/emit.py `_step_subs`), not once a request (on an
# H100 at 16 plain requests, nine spans a round cost level 2 12.6 % of the batch's rate). An
# engine of one request at a time (--max-batch 1) keeps the seed's shape: a round's five phase
# spans (and level 2's sub-split under its verify), no batch.step spans.


def burst_chained(s, max_rounds: int, hook, out: list[int], rec: BurstRecord | None) -> None:
    """Up to `max_rounds` of session `s`'s rounds, taken from its chain."""
    fm = s.clock.free_mb() if rec is not None else None  # one reading a burst
    if rec is not None:
        rec.clock = "leader"
        rec.compact = s.target.batcher.max_requests != 1  # an engine of one: the seed's six spans
    pump = s._pump
    floor = 0  # the burst's last round's end
    for _ in range(max_rounds):
        if s.done:
            break
        if s._chain is None:
            s._chain = s._new_chain(s.stats.tokens)
        if pump is not None:
            pump()  # deferred span work while the steps run
        rnd = s.target.take(s._chain)
        if rnd is None:
            ch, s._chain = s._chain, None
            if ch.err is not None:
                if isinstance(ch.err, NonFiniteRow) and ch.err_ids is not None:
                    ids, start = ch.err_ids
                    raise s._non_finite(torch.tensor(ids), start, ch.err.row,
                                        f"round {s.stats.rounds}, verify row {ch.err.row}") from None
                raise ch.err
            if not ch.parked:
                raise RuntimeError("a batched request's rounds ended before the request")
            new = s._round(rec)  # parked: this round the session's own way
        else:
            new = s._commit(rnd.new)
            if rec is not None:
                floor = _record(rec.next_round(), rnd, s.stats.rounds, s._draft_fw, fm, floor)
            s.stats.rounds += 1
            s.stats.drafted += rnd.k
            s.stats.accepted += rnd.j
        out.extend(new)
        if hook is not None:
            hook(new)
    if rec is not None and rec.n:  # its rounds may have run before the burst began
        rec.t0 = min(rec.t0, rec.rounds[0].t[0])


def _record(r: RoundRecord, rnd, index: int, draft_fw: int, fm, floor: int = 0) -> int:
    """The round's record from the chain's; returns its end (the next round starts no earlier)."""
    r.index, r.ctx, r.k, r.j, r.batch = index, rnd.ctx, rnd.k, rnd.j, rnd.step
    r.draft_requests = rnd.draft_requests
    r.expected = rnd.expected
    r.t[:] = rnd.t
    if rnd.late:  # a drafter's device work ends at an event, not a drain (phase/late_stamps.py)
        for i, st in rnd.late:
            r.t[i] = st.at(r.t[i])
    monotone(r.t, floor)
    r.h[:] = [0] * len(r.h)
    for i in range(len(r.free_mb)):
        r.free_mb[i] = fm
    r.draft_forwards = draft_fw if rnd.k or draft_fw < 0 else 0
    r.sub_ns, r.seq_rows = rnd.laps if rnd.laps is not None else ({}, 0)
    return r.t[5]
