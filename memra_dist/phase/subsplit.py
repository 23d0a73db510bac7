"""Level-2 verify sub-split: per-layer laps by mixer class (shares, never walls).

The verify walk passes a timer down through `StepCtx.timer`; every block calls `begin()`
before its mixer, `lap(<mixer class>)` after it and `lap("ffn")` after its FFN. A KDA mixer
brackets its recurrent scan with `scan_begin()` / `scan_end()` (the scan share inside the
kda bucket). Two timers keep that contract:
- `SubsplitTimer` (eager steps): each call drains the stream first, so the device time of
  the work just issued lands in the bucket;
- `EventMarks` (captured step graphs): each call records a CUDA event into the graph being
  captured; after every replay the intervals between the graph's events are added to the
  request's SubsplitTimer. So level 2 runs the same graphed, compiled step as levels 0 and 1
  (plus one event record per boundary), not an eager walk.
Only ever used at trace level 2.
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["SubsplitTimer", "EventMarks", "SUB_BUCKETS"]

SUB_BUCKETS = ("kda", "mla", "attn", "ffn", "scan")


class SubsplitTimer:
    def __init__(self, drain: Callable[[], None]):
        self.drain = drain
        self.ns = dict.fromkeys(SUB_BUCKETS, 0)
        self.seq_rows = 0  # verify rows that took a per-row mixer arm instead of the batched one
        self._t = 0
        self._ts = 0

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
        """The accumulated ns per bucket and seq_rows since the last take; resets both."""
        ns, rows = self.ns, self.seq_rows
        self.ns, self.seq_rows = dict.fromkeys(SUB_BUCKETS, 0), 0
        return ns, rows


class EventMarks:
    """The boundaries of one captured step, as events recorded in its graph. `make_event`
    builds a timing event that may be recorded during a capture (CUDA:
    `torch.cuda.Event(enable_timing=True, external=True)`)."""

    def __init__(self, make_event: Callable[[], object]):
        self.make_event = make_event
        self.marks: list[tuple[str, object]] = []  # (kind or bucket, event), in walk order

    def _mark(self, what: str) -> None:
        ev = self.make_event()
        ev.record()
        self.marks.append((what, ev))

    def begin(self) -> None:
        self._mark("begin")

    def lap(self, bucket: str) -> None:
        self._mark(bucket)

    def scan_begin(self) -> None:
        self._mark("scan_begin")

    def scan_end(self) -> None:
        self._mark("scan_end")

    def add_to(self, timer: SubsplitTimer) -> None:
        """After a replay: wait for its last event, then add each interval to its bucket, as
        SubsplitTimer would have (a lap runs from the previous begin or lap; the scan from
        its scan_begin, inside the kda lap)."""
        if not self.marks:
            return
        self.marks[-1][1].synchronize()
        last = scan0 = None
        for what, ev in self.marks:
            if what == "begin":
                last = ev
            elif what == "scan_begin":
                scan0 = ev
            elif what == "scan_end":
                timer.ns["scan"] += int(scan0.elapsed_time(ev) * 1e6)  # elapsed_time is in ms
            else:
                timer.ns[what] += int(last.elapsed_time(ev) * 1e6)
                last = ev
