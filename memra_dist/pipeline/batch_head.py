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

import torch

from ..batching.step_plan import pack, swap_row
from ..phase.subsplit import SUB_BUCKETS
from .transport import Flag, Op

__all__ = ["RingWalk", "RemoteKV", "open_batched"]


class RingWalk:
    """The earlier stages of a batched step, down the ring (Batcher.remote)."""

    def __init__(self, ring, hidden: int, dtype, remote_taps: tuple[int, ...]):
        self.ring, self.hidden, self.dtype, self.remote_taps = ring, hidden, dtype, tuple(remote_taps)

    def walk(self, pool, jobs, x: torch.Tensor, pos: torch.Tensor, timer=None):
        """The step's plan sent, the last stage's rows received -> (hidden rows, {tap: rows})."""
        parts = [(j.rid, j.start, j.n, j.width, pool.table(j.rid)) for j in jobs]
        ids = [int(i) for j in jobs for i in (j.ids.tolist() if torch.is_tensor(j.ids) else j.ids)]
        rows = len(ids)
        flags = Flag.TIMED if timer is not None else 0
        ticket = self.ring.command_row(Op.BATCH, pack(parts, ids), rows=rows, flags=flags)
        H = self.hidden
        want = [((rows, H), self.dtype)]
        if self.remote_taps:
            want.append(((rows, len(self.remote_taps) * H), self.dtype))
        if timer is not None:
            want.append(((len(SUB_BUCKETS),), torch.long))
        got = self.ring.receive(ticket, want)
        taps = {t: got[1][:, i * H:(i + 1) * H] for i, t in enumerate(self.remote_taps)} if self.remote_taps else {}
        if timer is not None:
            for b, ns in zip(SUB_BUCKETS, got[-1].tolist()):
                timer.ns[b] += ns
        return got[0], taps


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
    b.remote = RingWalk(head.ring, head.runner.cfg.hidden_size, head.runner.dtype, head.remote_taps)
    b.kv = RemoteKV(b.kv, head.ring)
    head.ring.command_row(Op.BATCH_OPEN, [b.pool.rows, b.pool.block])
    return backend
