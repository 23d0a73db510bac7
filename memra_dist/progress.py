"""Progress lines for long work on stderr: loading a checkpoint. Quiet for small models (a
tiny checkpoint loads before a line would help), at most one line a second otherwise."""

from __future__ import annotations

import sys
import time
from typing import Callable

__all__ = ["LoadProgress", "QUIET_BELOW_BYTES"]

QUIET_BELOW_BYTES = 512 << 20  # checkpoints under this load without progress lines


class LoadProgress:
    """`progress(done, total)` for load_stage: '[memra] loading NAME: 41 % (6.6 of 16.1 GB)'."""

    def __init__(self, name: str, out=None, every_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.name, self.out, self.every_s, self.clock = name, out, every_s, clock
        self.t0 = clock()
        self.last = None

    def __call__(self, done: int, total: int) -> None:
        if total < QUIET_BELOW_BYTES:
            return
        now = self.clock()
        if done < total and self.last is not None and now - self.last < self.every_s:
            return
        if done < total and self.last is None and now - self.t0 < self.every_s:
            return  # a load that finishes within the first second says nothing until its end
        self.last = now
        pct = 100 * done // total
        tail = f" in {now - self.t0:.1f} s" if done >= total else ""
        print(f"[memra] loading {self.name}: {pct} % ({done / 1e9:.1f} of {total / 1e9:.1f} GB){tail}",
              file=self.out or sys.stderr, flush=True)
