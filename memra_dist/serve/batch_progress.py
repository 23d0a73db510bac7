"""The batch job's progress on stderr: a line at most every second, then one summary line."""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

__all__ = ["Progress", "say"]


def say(line: str, out: TextIO | None = None) -> None:
    """One stderr line; a closed stderr (`... 2>&1 | head`) never stops the job."""
    try:
        print(line, file=out or sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _clock_text(s: float) -> str:
    s = int(round(s))
    h, rem = divmod(s, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


class Progress:
    """'[batch] 7/12 done, 1 error | 412.3 tok/s | ETA 0:09' on `out`, at most one line every
    `every_s` seconds; rates count this run only (not the requests done before it)."""

    def __init__(self, total: int, done: int, errors: int, out: TextIO | None = None, every_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.done, self.errors = total, done, errors
        self.before = done
        self.out, self.every_s, self.clock = out, every_s, clock
        self.tokens = 0
        self.ran = 0  # requests the engine ran in this run (what the ETA is made of)
        self.t0 = clock()
        self.t_run: float | None = None  # when the first request started (the engine is up)
        self.last: float | None = None

    def _say(self, line: str) -> None:
        say(line, self.out)

    def start(self) -> None:
        if self.t_run is None:
            self.t_run = self.clock()

    def add_tokens(self, n: int) -> None:
        self.tokens += n
        self.tick()

    def finished(self, error: bool = False, ran: bool = True) -> None:
        self.done += 1
        self.errors += error
        self.ran += ran
        self.tick()

    def rate(self) -> float:
        el = self.clock() - self.t_run if self.t_run is not None else 0.0
        return self.tokens / el if el > 0 else 0.0

    def line(self) -> str:
        errs = f", {self.errors} error{'s' if self.errors != 1 else ''}" if self.errors else ""
        s = f"[batch] {self.done}/{self.total} done{errs}"
        if self.t_run is None:
            return s
        el = self.clock() - self.t_run
        eta = _clock_text(el / self.ran * (self.total - self.done)) if self.ran and el > 0 else "--"
        return f"{s} | {self.rate():.1f} tok/s | ETA {eta}"

    def tick(self) -> None:
        now = self.clock()
        if self.last is not None and now - self.last < self.every_s:
            return
        if self.last is None and now - self.t0 < self.every_s:
            return  # a job that ends within a second prints its summary only
        self.last = now
        self._say(self.line())

    def summary(self, output: str, interrupted: bool = False) -> str:
        errs = f", {self.errors} error{'s' if self.errors != 1 else ''}" if self.errors else ""
        before = f" ({self.before} before this run)" if self.before else ""
        el = self.clock() - self.t_run if self.t_run is not None else 0.0
        rate = f", {self.tokens} tokens in {el:.1f} s ({self.rate():.1f} tok/s)" if self.t_run is not None else ""
        if interrupted:
            return (f"[batch] interrupted at {self.done}/{self.total} done{errs}{rate}: every finished request is "
                    f"in {output}; the same command resumes")
        return f"[batch] done: {self.done}/{self.total}{before}{errs}{rate} -> {output}"
