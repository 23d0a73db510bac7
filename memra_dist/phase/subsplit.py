"""Level-2 verify sub-split: per-layer laps by mixer class (shares, never walls).

The verify walk passes a timer down through `StepCtx.timer`; every block calls `begin()`
before its mixer, `lap(<mixer class>)` after it and `lap("ffn")` after its FFN. A KDA mixer
brackets its recurrent scan with `scan_begin()` / `scan_end()` (the scan share inside the
kda bucket). Two timers keep that contract:
- `SubsplitTimer` (eager steps): each call drains the stream first, so the device time of
  the work just issued lands in the bucket;
- `StampMarks` (captured step graphs): each call adds a one-thread kernel to the graph being
  captured that writes the device clock into a slot of a buffer; after every replay the buffer
  comes back in one copy and its intervals are added to the request's SubsplitTimer. So level
  2 runs the same graphed, compiled step as levels 0 and 1 (plus one tiny kernel per
  boundary), not an eager walk. `EventMarks` does the same with CUDA timing events (one
  driver call per interval to read: the fallback where Triton is missing).
Only ever used at trace level 2.
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["SubsplitTimer", "Laps", "EventMarks", "StampMarks", "add_laps", "no_drain", "SUB_BUCKETS"]

SUB_BUCKETS = ("kda", "mla", "attn", "ffn", "scan")


def no_drain() -> None:
    """The drain of a timer whose laps come from elsewhere (a batched round's: its step's stamps,
    or the step's own drained timer added in)."""


class SubsplitTimer:
    def __init__(self, drain: Callable[[], None]):
        self.drain = drain
        self.ns = dict.fromkeys(SUB_BUCKETS, 0)
        self.seq_rows = 0  # verify rows that took a per-row mixer arm instead of the batched one
        self._t = 0
        self._ts = 0
        self._later: list[Callable[["SubsplitTimer"], None]] = []  # laps whose stamps are on their way back

    def later(self, read: Callable[["SubsplitTimer"], None]) -> None:
        """A replay's laps, added into a timer at the next `take` or `Laps.settle` (its stamps
        copied back without a wait)."""
        self._later.append(read)

    def detach(self) -> "Laps":
        """The laps since the last take or detach, to be added up later (`Laps.settle`, off the
        round's critical path); resets the timer."""
        out = Laps(self.ns, self.seq_rows, self._later)
        self.ns, self.seq_rows, self._later = dict.fromkeys(SUB_BUCKETS, 0), 0, []
        return out

    def begin(self) -> None:
        self.drain()
        self._t = time.perf_counter_ns()

    def lap(self, bucket: str) -> None:
        self.drain()
        now = time.perf_counter_ns()
        self.ns[bucket] += now - self._t
        self._t = now

    def scan_begin(self) -> None:
        self.drain()
        self._ts = time.perf_counter_ns()

    def scan_end(self) -> None:
        self.drain()
        self.ns["scan"] += time.perf_counter_ns() - self._ts

    def take(self) -> tuple[dict[str, int], int]:
        """The accumulated ns per bucket and seq_rows since the last take; resets both. Laps still
        on their way back are added first (waiting for their copy: called after the round's
        readback, it waits for nothing)."""
        while self._later:
            self._later.pop(0)(self)
        ns, rows = self.ns, self.seq_rows
        self.ns, self.seq_rows = dict.fromkeys(SUB_BUCKETS, 0), 0
        return ns, rows


class Laps:
    """One verify's sub-split, detached from the timer: the laps already added (eager walks
    drain as they go) and the replays' whose stamps are still to be read."""

    def __init__(self, ns: dict[str, int], seq_rows: int, pending: list):
        self.ns, self.seq_rows, self.pending = ns, seq_rows, pending

    def settle(self) -> tuple[dict[str, int], int]:
        """(ns per bucket, seq_rows): the pending replays' stamps read in. Their copies are
        done once the round's readback returned; each replay's buffer is its own until read."""
        acc = SubsplitTimer(lambda: None)
        acc.ns, acc.seq_rows = self.ns, self.seq_rows
        for read in self.pending:
            read(acc)
        self.pending = []
        return acc.ns, acc.seq_rows


def add_laps(kinds: list[str], ns: list[int], timer: "SubsplitTimer") -> None:
    """One replay's boundaries (kind, device time in ns, in walk order) into the timer's
    buckets, as SubsplitTimer would have drained them: a lap runs from the previous begin or
    lap; the scan from its scan_begin, inside the kda lap."""
    last = scan0 = 0
    for what, t in zip(kinds, ns):
        if what == "begin":
            last = t
        elif what == "scan_begin":
            scan0 = t
        elif what == "scan_end":
            timer.ns["scan"] += t - scan0
        else:
            timer.ns[what] += t - last
            last = t


class _Marks:
    """The boundary calls of a captured walk; `_mark` records one boundary on the device."""

    def begin(self) -> None:
        self._mark("begin")

    def lap(self, bucket: str) -> None:
        self._mark(bucket)

    def scan_begin(self) -> None:
        self._mark("scan_begin")

    def scan_end(self) -> None:
        self._mark("scan_end")


class EventMarks(_Marks):
    """The boundaries of one captured step, as events recorded in its graph. `make_event`
    builds a timing event that may be recorded during a capture (CUDA:
    `torch.cuda.Event(enable_timing=True, external=True)`). Reading them costs one driver call
    per boundary after every replay: StampMarks is the fast path, this the fallback."""

    def __init__(self, make_event: Callable[[], object]):
        self.make_event = make_event
        self.marks: list[tuple[str, object]] = []  # (kind or bucket, event), in walk order

    def reset(self) -> None:
        """Forget the boundaries recorded (a warm-up walk before the one captured)."""
        self.marks = []

    def _mark(self, what: str) -> None:
        ev = self.make_event()
        ev.record()
        self.marks.append((what, ev))

    def add_to(self, timer: SubsplitTimer) -> None:
        """After a replay: wait for its last event, then add each interval to its bucket."""
        if not self.marks:
            return
        self.marks[-1][1].synchronize()
        first = self.marks[0][1]
        add_laps([w for w, _ in self.marks], [round(first.elapsed_time(ev) * 1e6) for _, ev in self.marks], timer)


class StampMarks(_Marks):
    """The boundaries of one captured step as device-clock stamps written into `buf` (one
    int64 slot per boundary, `stamp(buf, i)`: kernels/stamp.py on CUDA). After a replay the
    stamps come back in one copy."""

    def __init__(self, buf, stamp: Callable[[object, int], None], host=None, copied=None):
        self.buf, self.stamp = buf, stamp
        self.kinds: list[str] = []
        self.slots: list[int] = []  # the buffer slot each boundary reads (a begin right after a lap shares it)
        self.n = 0  # slots written
        # pinned host copies of buf and an event after each copy (`host`, `copied`: sequences of
        # the same length, or None): the stamps come back without a wait in the verify; the laps
        # are added later (in the next verify's shadow). Used in turn: with two, a replay's copy
        # never overwrites the one before's before it was read (one replay of a graph a round).
        self.host, self.copied = host, copied
        self._turn = 0

    def _mark(self, what: str) -> None:
        """A layer's begin right after the layer before's FFN lap (nothing is launched between
        two blocks of a walk) reads that lap's stamp: a third fewer stamp kernels in a step."""
        if what == "begin" and self.kinds and self.kinds[-1] == "ffn":
            self.kinds.append(what)
            self.slots.append(self.n - 1)
            return
        if self.n >= self.buf.numel():
            raise RuntimeError(f"more sub-split boundaries than the stamp buffer holds ({self.buf.numel()})")
        self.stamp(self.buf, self.n)
        self.kinds.append(what)
        self.slots.append(self.n)
        self.n += 1

    def reset(self) -> None:
        """Forget the boundaries recorded (a warm-up walk before the one captured)."""
        self.kinds, self.slots, self.n = [], [], 0

    def laps(self, stamps: list[int], timer: SubsplitTimer) -> None:
        """One replay's stamps (its `n` slots, in order) into the timer's buckets."""
        add_laps(self.kinds, [stamps[s] for s in self.slots], timer)

    def add_to(self, *timers: SubsplitTimer) -> None:
        """After a replay: the stamps back and their laps into each timer (a step's level-2
        rounds all rode the same replay: the stamps are read once, their laps added to each).
        With a pinned host copy, the copy is queued behind the replay and the laps are added at
        each timer's next take (the first to take reads them); without one, the copy waits for
        the replay here."""
        n = self.n
        if not n or not timers:
            return
        if self.host is None:
            self._into(self.buf[:n].tolist(), timers)
            return
        b = self._turn
        self._turn = (b + 1) % len(self.host)
        self.host[b][:n].copy_(self.buf[:n], non_blocking=True)
        self.copied[b].record()
        read: list[dict] = []  # the replay's laps, once read

        def into(timer: SubsplitTimer) -> None:
            if not read:
                self.copied[b].synchronize()
                read.append(self._laps_of(self.host[b][:n].tolist()))
            for bucket, v in read[0].items():
                timer.ns[bucket] += v

        for t in timers:
            t.later(into)

    def _laps_of(self, stamps: list[int]) -> dict[str, int]:
        acc = SubsplitTimer(no_drain)
        self.laps(stamps, acc)
        return acc.ns

    def _into(self, stamps: list[int], timers) -> None:
        laps = self._laps_of(stamps)
        for t in timers:
            for bucket, v in laps.items():
                t.ns[bucket] += v
