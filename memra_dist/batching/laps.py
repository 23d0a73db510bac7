"""Level 2 on a batched engine: a step that holds a level-2 request's rows runs eager with a
sub-split timer in its context, each block drained after its mixer and after its FFN (phase/
subsplit.py: the same laps a single request's eager verify takes), and every level-2 request of
the step gets the step's laps: the sub-split is the batch step's, shared by its requests (their
spec.verify.* spans and [spec-phase-v] lines show where the step's time went by mixer class).
Such a step never replays a graph and drains once a layer twice, so a batch with a level-2
request runs slower while it is in flight; level 1 and below never take this path."""

from __future__ import annotations

__all__ = ["timed_step"]


def timed_step(batcher, jobs, ids_dev, eager):
    """The step's logits, run by `eager` (step_forward.eager) under one timer; its laps added to
    each job's timer."""
    from ..device import Drainer  # noqa: PLC0415
    from ..phase.subsplit import SubsplitTimer  # noqa: PLC0415

    step = SubsplitTimer(Drainer(batcher.device))
    out = eager(batcher, jobs, ids_dev, step)
    ns, rows = step.take()
    for t in {id(j.timer): j.timer for j in jobs if j.timer is not None}.values():
        for bucket, v in ns.items():
            t.ns[bucket] += v
        t.seq_rows += rows
    return out
