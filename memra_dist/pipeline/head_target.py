"""The head's view of the pipeline: a `Target` (specdec/session.py) whose forward walks the ring.

The head holds the LAST stage's layers plus the final norm and lm_head, so a forward sends
the command with the token ids inside it to rank 1 (stage 0), receives the hidden rows of the
second-to-last stage, and finishes the walk locally. Verify's clock (phase/clock.py) then
drains only the head's stream: the receive cannot complete before every stage's forward
has, so that terminal drain covers the stage streams transitively.

Each session in flight has its own target: its slot (a cache slot on every stage, and a
runner view of the head's own layers over that slot's cache) and its own command row; they
share the head's `Ring`, which hands each session its own forward's results.

When traced, the head's own part of each forward (the last stage's layers + the head) is
recorded like every stage's, between drains, so the last stage gets its `stage.forward`
spans too and "which stage is the bottleneck" can be read across all of them.
"""

from __future__ import annotations

import time

import torch

from ..device import free_mb
from ..runner import ModelRunner
from ..phase.subsplit import SUB_BUCKETS
from .ring import Ring
from .transport import Flag, Op

__all__ = ["PipelineTarget"]


class PipelineTarget:
    ids_on_device = True  # forward's ids may stay on the device: they ride in the command (specdec/ahead.py)

    def __init__(self, ring: Ring, runner: ModelRunner, traced: bool, records: list | None = None,
                 request: int = 0, slot: int = 0, remote_taps: tuple[int, ...] = ()):
        self.ring, self.runner, self.traced = ring, runner, traced
        self.records = records if records is not None else []  # (t0, t1, start, rows, round, free_mb, label, request, slot)
        self.request = request  # this request's index among the pipeline's requests
        self.slot = slot  # its cache slot on every stage
        self.remote_taps = remote_taps  # the taps the stages ship behind each forward's rows (model/taps.py)
        self.buf = ring.buffer()
        self.device, self.dtype, self.label = runner.device, runner.dtype, runner.label
        self.drain = runner.drain
        self.hidden = runner.cfg.hidden_size
        self.round = -1  # one target forward per round: -1 = the prime, then round 0, 1, ...

    def alloc(self, capacity: int) -> None:
        self.ring.command(Op.ALLOC, capacity, arg=self.request, slot=self.slot, buf=self.buf)  # the slot's forwards now belong to it
        self.runner.alloc(capacity)
        self.round = -1

    @property
    def length(self) -> int:
        return self.runner.length

    def forward(self, ids: torch.Tensor, start: int, timer=None) -> torch.Tensor:
        rows = ids.shape[0]
        flags = (Flag.TRACED if self.traced else 0) | (Flag.TIMED if timer is not None else 0)
        rnd = self.round
        ticket = self.ring.forward(ids, start, flags, rnd, self.slot, self.buf)
        self.round += 1
        want = [((rows, self.hidden), self.runner.dtype)]  # (rows, H) from the last remote stage
        if self.remote_taps:
            want.append(((rows, len(self.remote_taps) * self.hidden), self.runner.dtype))
        if timer is not None:
            want.append(((len(SUB_BUCKETS),), torch.long))
        got = self.ring.receive(ticket, want)
        h = got[0]
        if self.remote_taps:
            self._keep_taps(got[1], start, rows)
        if timer is not None:
            for b, ns in zip(SUB_BUCKETS, got[-1].tolist()):
                timer.ns[b] += ns
        if not self.traced:
            return self.runner.forward(h, start, timer)
        self.drain()
        t0 = time.perf_counter_ns()
        out = self.runner.forward(h, start, timer)
        self.drain()
        self.records.append((t0, time.perf_counter_ns(), start, rows, rnd, free_mb(self.device), self.label,
                             self.request, self.slot))
        return out

    def _keep_taps(self, cols: torch.Tensor, start: int, rows: int) -> None:
        """The remote stages' taps of this forward's rows into the head's sink, by position."""
        sink, H = self.runner.cache.taps, self.hidden
        pos = torch.arange(start, start + rows, device=self.device)
        for j, layer in enumerate(self.remote_taps):
            sink.write(layer, pos, cols[:, j * H:(j + 1) * H])

    def rollback(self, new_len: int) -> None:
        # no message: the next forward's start is new_len, and each stage rolls back to it
        # before that forward (transport.Op); the head's own layers roll back now
        self.runner.rollback(new_len)

    def free_mb(self) -> int:
        return self.runner.free_mb()

