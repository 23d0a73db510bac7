"""The phase clock: drain the streams of the engines that ran a phase, then stamp the time.

Which streams each boundary drains (and why that bounds the phase):
- The clock of a session drains its PRIMARY engine's stream (the target's first engine in
  this process: the whole model at pp=1, the head at pp>1) and its HEAD engine's stream when
  that is a different engine or device (the drafter's device when the drafter sits apart).
  At pp=1 primary == head == one device, so a boundary is one drain.
- draft: the drafter runs on the head's device, so the head drain bounds it.
- verify: at pp>1 the head's verify walk ends by receiving the last stage's hidden rows and
  running the lm_head on them; the receive cannot complete before every stage's forward
  has, so the head's terminal drain covers all stage streams TRANSITIVELY. No stage is
  drained directly from here.
- accept: host + head-device work (argmax / rejection sampling + readback): head drain.
- rollback: the head's cache rollback (a length change; KDA layers restore a snapshot on
  the head's device): head drain. At pp>1 no message goes to the stages: each stage rolls
  back to the next forward's start before running it, so a stage's own rollback work (a
  snapshot restore for its KDA layers) lands in the NEXT round's verify.
- maint: drafter rollback / re-seed on the head's device: head drain.
Only constructed when the clock is on (trace level >= 1 or the profile): level 0 has no
clock object, hence no drains and no clock reads.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

__all__ = ["PhaseClock"]


class PhaseClock:
    def __init__(self, drains: Sequence[Callable[[], None]], free_mb: Callable[[], dict[str, int]]):
        self.drains = tuple(drains)
        self.free_mb = free_mb  # device label -> free MB, for the devices of this process

    def stamp(self) -> int:
        for d in self.drains:
            d()
        return time.perf_counter_ns()

    def boundary(self) -> tuple[int, int]:
        """(host_ns, end_ns): the time the host reached the boundary, then the stamp after the
        drains. What lies between is the device finishing the phase's launched work."""
        host = time.perf_counter_ns()
        return host, self.stamp()

    def lap_ms(self, since_ns: int) -> tuple[int, float]:
        now = self.stamp()
        return now, (now - since_ns) / 1e6
