"""Level 2 on a batched engine, where a step cannot replay a graph (an eager step: a long prefill
chunk, a family whose steps run eager, the CPU): the step runs with a sub-split timer in its
context, each block drained after its mixer and after its FFN (phase/subsplit.py: the same laps a
single request's eager verify takes), and every level-2 request of the step gets the step's laps:
the sub-split is the batch step's, shared by its requests (their spec.verify.* spans and
[spec-phase-v] lines show where the step's time went by mixer class). Such a step drains once a
layer twice. A graphed step replays its bucket's timed twin instead (graphs.py), which stamps
the same boundaries on the device; level 1 and below take neither."""

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
