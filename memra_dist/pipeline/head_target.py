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

import queue
import threading
import time

import torch

from ..device import free_mb
from ..runner import ModelRunner
from ..specdec.chunks import attention_weight
from ..phase.subsplit import SUB_BUCKETS
from .ring import Ring
from .transport import Flag, Op

__all__ = ["PipelineTarget"]


class PipelineTarget:
    ids_on_device = True  # forward's ids may stay on the device: they ride in the command (specdec/ahead.py)
    rollback_on_host = True  # the head's runner moves lengths; each stage rolls back in its next forward

    def __init__(self, ring: Ring, runner: ModelRunner, traced: bool, records: list | None = None,
                 request: int = 0, slot: int = 0, remote_taps: tuple[int, ...] = (), shared: bool = False):
        self.ring, self.runner, self.traced = ring, runner, traced
        self.shared = shared  # other sessions' forwards run on the head's stream between this one's
        self.records = records if records is not None else []  # (t0, t1, start, rows, round, free_mb, label, request, slot)
        self.request = request  # this request's index among the pipeline's requests
        self.slot = slot  # its cache slot on every stage
        self.remote_taps = remote_taps  # the taps the stages ship behind each forward's rows (model/taps.py)
        self.buf = ring.buffer()
        self.device, self.dtype, self.label = runner.device, runner.dtype, runner.label
        self.drain = runner.drain
        self.hidden = runner.cfg.hidden_size
        self.round = -1  # one target forward per round: -1 = the prime, then round 0, 1, ...
        self.stages = ring.link.world  # the pipeline's stages: the head's rank and every stage's
        c = runner.cfg  # the chunk planner's cost model (specdec/chunks.py)
        self.attention_weight = attention_weight(c.hidden_size, c.num_heads, c.head_dim, c.num_kv_heads,
                                                 c.intermediate_size)

    def alloc(self, capacity: int) -> None:
        self.ring.command(Op.ALLOC, capacity, arg=self.request, slot=self.slot, buf=self.buf)  # the slot's forwards now belong to it
        self.runner.alloc(capacity)
        self.round = -1

    @property
    def length(self) -> int:
        return self.runner.length

    def forward(self, ids: torch.Tensor, start: int, timer=None, last: bool = False) -> torch.Tensor:
        flags = (Flag.TRACED if self.traced else 0) | (Flag.TIMED if timer is not None else 0)
        rnd = self.round
        ticket = self.ring.forward(ids, start, flags, rnd, self.slot, self.buf)
        self.round += 1
        return self._finish(ticket, ids.shape[0], start, rnd, timer, last)

    def _finish(self, ticket: int, rows: int, start: int, rnd: int, timer=None, last: bool = False) -> torch.Tensor:
        """Receive a sent forward's rows (and taps, and level-2 vector), run the head's own layers."""
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
            return self.runner.forward(h, start, timer, last)
        self.drain()
        t0 = time.perf_counter_ns()
        out = self.runner.forward(h, start, timer, last)
        self.drain()
        self.records.append((t0, time.perf_counter_ns(), start, rows, rnd, free_mb(self.device), self.label,
                             self.request, self.slot))
        return out

    def prefill(self, ids: torch.Tensor, chunks: list[tuple[int, int]], stamp=None) -> tuple[torch.Tensor, list[int]]:
        """The prompt's chunks pipelined across the stages (SGLang's chunked pipeline
        parallelism): a feeder thread sends chunk c + 1's command (and ids) while this thread
        receives chunk c's rows and runs the head's own layers on them, so stage s works on
        chunk c while stage s + 1 works on chunk c - 1; at most `stages + 1` chunks are in
        flight. Every stage serves its commands in order, so the chunks reach each cache in
        order. Returns the last row's logits (1, V) and, with `stamp` (the profile's drained
        clock), each chunk's time from the previous chunk's arrival to its own (ns)."""
        flags = Flag.TRACED if self.traced else 0
        window = threading.Semaphore(self.stages + 1)
        tickets: queue.Queue = queue.Queue()
        stop = threading.Event()

        def feed():
            try:
                for lo, hi in chunks:
                    while not window.acquire(timeout=0.1):
                        if stop.is_set():
                            return
                    # a command row of its own per chunk: several are in flight, and a reused
                    # device row could be rewritten before NCCL has sent the previous command
                    tickets.put(self.ring.forward(ids[lo:hi], lo, flags, -1, self.slot, self.ring.buffer()))
            except BaseException as e:  # noqa: BLE001 (handed to the receiving thread, which raises it)
                tickets.put(e)

        feeder = threading.Thread(target=feed, name="prefill-feed", daemon=True)
        feeder.start()
        logits, laps, ok = None, [], False
        t = stamp() if stamp is not None else 0
        try:
            for i, (lo, hi) in enumerate(chunks):
                ticket = tickets.get()
                if isinstance(ticket, BaseException):
                    raise ticket
                logits = self._finish(ticket, hi - lo, lo, -1, None, last=i == len(chunks) - 1)
                window.release()
                if stamp is not None:
                    t1 = stamp()
                    laps.append(t1 - t)
                    t = t1
            ok = True
        finally:  # on an error the feeder stops at its next chunk (one blocked on a dead peer: daemon)
            stop.set()
            feeder.join(timeout=None if ok else 5.0)
        self.round = 0  # the prime's forwards are round -1; the next forward is round 0
        return logits, laps

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

    def stream_marks(self):
        """The head's stream: its verify ends by receiving the last stage's rows (the clock's
        transitive bound over every stage, phase/clock.py). None (the draining clock) while
        sessions share the stream: the event clock's anchor needs the stream to run dry after
        this session's readback, which another session's queued work would not let it."""
        return None if self.shared else self.runner.stream_marks()

