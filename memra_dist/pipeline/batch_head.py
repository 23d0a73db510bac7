"""A batched pipeline's head (pp > 1, `--max-batch B` > 1): the batcher, its block pool and every
request's session live in the head actor, as at pp = 1 (batching/backend.py over the head's
runner: the last stage's layers, the final norm and the lm_head); the earlier stages hold a paged
pool of the same geometry for their own layers (pipeline/batch_stage.py).

A step walks the ring once: ONE command and its plan row (batching/step_plan.py: each
request's segment and block table, the step's ids) go to stage 0, every stage runs its layers
over every request's rows and passes the hidden rows on (the tap drafters' tapped rows behind
them, as a single request's forward ships them), and the head finishes the step with its own
layers and the lm_head. A preemption swaps the request's rows out on every stage (SWAP_OUT /
SWAP_IN: each stage keeps its own rows in its host memory), and a request that ends is
dropped everywhere (LEAVE: its recurrent states).

The steps run eager (no CUDA graphs across the ring yet) and every stage's stream is drained by
the head's receive of the last stage's rows, which cannot complete before each stage's forward
has (the phase clock's transitive bound, as for a single request's verify at pp > 1)."""

from __future__ import annotations

import time

import torch

from ..batching.step_plan import pack, swap_row
from ..device import free_mb
from ..phase.subsplit import SUB_BUCKETS
from ..tracing.conventions import ATTR
from .transport import Flag, Op

__all__ = ["RingWalk", "RemoteKV", "open_batched"]


class RingWalk:
    """The earlier stages of a batched step, down the ring (Batcher.remote). Traced (level >= 1),
    every stage records its part of each step (a `stage.forward` span with the step's id,
    requests and rows, under the trace of the step's first request: `index_of`), the head's own
    part between two drains of its stream (`head`)."""

    def __init__(self, ring, hidden: int, dtype, remote_taps: tuple[int, ...], traced: bool = False,
                 records: list | None = None, label: str = "", drain=None):
        self.ring, self.hidden, self.dtype, self.remote_taps = ring, hidden, dtype, tuple(remote_taps)
        self.traced, self.records, self.label = traced, records if records is not None else [], label
        self.drain = drain  # the head's stream drained (traced: its part of a step between two drains)
        self.index_of: dict = {}  # batch slot id -> the request's index (its trace context on every rank)

    def _tag(self, b, jobs) -> tuple[int, int, dict]:
        """(the request whose trace a step's spans join, the step's id, its span attributes)."""
        rows = sum(j.n for j in jobs)
        return self.index_of.get(jobs[0].rid, -1), b.stats.steps, {ATTR["batch_step"]: b.stats.steps,
                                                                    ATTR["batch_requests"]: len(jobs),
                                                                    ATTR["batch_rows"]: rows}

    def walk(self, b, jobs, timer=None):
        """The step's plan (its ids inside) sent, the last stage's rows received -> (hidden rows,
        {tap: rows}); `timer`: level 2's, given the stages' laps."""
        parts = [(j.rid, j.start, j.n, j.width, b.pool.table(j.rid)) for j in jobs]
        ids = [int(i) for j in jobs for i in (j.ids.tolist() if torch.is_tensor(j.ids) else j.ids)]
        rows = len(ids)
        flags = (Flag.TIMED if timer is not None else 0) | (Flag.TRACED if self.traced else 0)
        index, step, _ = self._tag(b, jobs)
        ticket = self.ring.command_row(Op.BATCH, pack(parts, ids), rows=rows, flags=flags, arg=index, slot=step)
        H = self.hidden
        want = [((rows, H), self.dtype)]
        if self.remote_taps:
            want.append(((rows, len(self.remote_taps) * H), self.dtype))
        if timer is not None:
            want.append(((len(SUB_BUCKETS),), torch.long))
        got = self.ring.receive(ticket, want)
        taps = {t: got[1][:, i * H:(i + 1) * H] for i, t in enumerate(self.remote_taps)} if self.remote_taps else {}
        if timer is not None:
            for bucket, ns in zip(SUB_BUCKETS, got[-1].tolist()):
                timer.ns[bucket] += ns
        return got[0], taps

    def head(self, b, jobs, run):
        """The head's own layers of a step (`run()`), recorded between drains when traced."""
        if not self.traced:
            return run()
        drain = self.drain
        drain()
        t0 = time.perf_counter_ns()
        out = run()
        drain()
        index, _, attrs = self._tag(b, jobs)
        self.records.append((t0, time.perf_counter_ns(), 0, attrs[ATTR["batch_rows"]], -1, free_mb(b.device),
                             self.label, index, -1, attrs))
        return out


class RemoteKV:
    """The head's paged pool (its own layers) plus every stage's, kept in step: a preemption and
    a request's end reach the stages as commands (in ring order with the steps)."""

    def __init__(self, local, ring):
        self.local, self.ring = local, ring

    def __getattr__(self, name):
        return getattr(self.local, name)

    def save(self, slots: list[int], rid=None):
        self.ring.command_row(Op.SWAP_OUT, swap_row(rid, slots))
        return self.local.save(slots)

    def restore(self, slots: list[int], saved, rid=None) -> None:
        self.ring.command_row(Op.SWAP_IN, swap_row(rid, slots))
        self.local.restore(slots, saved)

    def leave(self, rid) -> None:
        self.ring.command_row(Op.LEAVE, [int(rid)])
        self.local.leave(rid)


def open_batched(head, max_batch: int, max_tokens: int | None, kv_rows: int | None):
    """The head actor's batched backend over its runner (every request at the pipeline plan's
    capacity), its stages told the pool's geometry."""
    from ..batching.backend import BatchedBackend  # noqa: PLC0415

    backend = BatchedBackend(head.plan, max_batch, max_tokens, kv_rows, runner=head.runner)
    b = backend.batcher
    b.remote = RingWalk(head.ring, head.runner.cfg.hidden_size, head.runner.dtype, head.remote_taps,
                        traced=head.cfg.trace.level >= 1, records=head.records, label=head.runner.label,
                        drain=head.runner.drain)
    b.kv = RemoteKV(b.kv, head.ring)
    head.ring.command_row(Op.BATCH_OPEN, [b.pool.rows, b.pool.block])
    return backend
