"""Level-2 verify sub-split: per-layer drained laps by mixer class (shares, never walls).

The verify walk passes one of these down through `StepCtx.timer`; every block calls
`begin()` before its mixer, `lap(<mixer class>)` after it and `lap("ffn")` after its FFN.
A KDA mixer brackets its recurrent scan with `scan_begin()` / `scan_end()` (the scan share
inside the kda bucket). Each call drains the stream first, so the device time of the work
just issued lands in the bucket. Only ever constructed at trace level 2.
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["SubsplitTimer", "SUB_BUCKETS"]

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
