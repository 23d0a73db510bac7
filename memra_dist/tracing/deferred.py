"""Span building in the device's shadow: the session hands each burst's record over at the
burst's end, and the spans are built a round's worth at a time from `pump()`, which the
session calls right after it launches a verify forward, while the host would otherwise sit
in the readback waiting for the device.

Why not a thread (the first design): span building is Python, so a thread runs only under
the GIL. When the round loop woke from its device wait while the thread held the GIL, it
waited for the thread's next switch (CPython's switch interval is 5 ms): on an H200 that
made trace level 1 cost +8.5 % of an 8B decode, several times the spans' own CPU time.
Pumping on the loop's own thread costs the spans' CPU time only, and that time overlaps
the device's verify.

`flush()` / `close()` build whatever is still queued, so no span is lost on a normal exit or
Ctrl-C (the request span ends after them)."""

from __future__ import annotations

import time
from collections import deque

__all__ = ["DeferredSink", "PUMP_BUDGET_NS"]

PUMP_BUDGET_NS = 150_000  # one pump builds rounds until this much host time has passed (>= 1 round)


class DeferredSink:
    def __init__(self, inner):
        self.inner = inner
        self.work: deque = deque()  # generators, each yielding after one round's spans

    @property
    def count(self) -> int:
        return self.inner.count

    def burst(self, rec) -> None:
        self.work.append(self.inner.burst_steps(rec))

    def first_token(self, prof) -> None:
        self.work.append(self.inner.first_token_steps(prof))

    def rounds(self, log, final: bool) -> None:
        pass  # the span sink ignores the depth log; the line sink prints it synchronously

    def pump(self, budget_ns: int = PUMP_BUDGET_NS) -> None:
        """Build queued spans: at least one round's, then more while within the budget."""
        if not self.work:
            return
        t_end = time.perf_counter_ns() + budget_ns
        while self.work:
            try:
                next(self.work[0])
            except StopIteration:
                self.work.popleft()
                continue
            except Exception:  # noqa: BLE001 (a tracing bug must never take the run down)
                self.work.popleft()
                continue
            if time.perf_counter_ns() >= t_end:
                return

    def flush(self) -> None:
        """Build every queued span now."""
        while self.work:
            self.pump(budget_ns=1 << 62)

    def close(self) -> None:
        self.flush()
