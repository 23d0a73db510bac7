"""Session sinks: the stderr phase lines, and a fan-out to several sinks (lines + spans)."""

from __future__ import annotations

import sys

from ..tracing.conventions import TAGS
from .first_token import FirstTokenProf
from .levels import TraceSettings
from .lines import phase_line, phase_v_line
from .records import BurstRecord
from .rounds_log import RoundsLog

__all__ = ["LineSink", "FanOut"]


class LineSink:
    """[spec-phase] per burst (level >= 1), [spec-phase-v] (level 2), [spec-prof] once per
    request, [spec-prof-rounds] rows and one [spec-prof-summary] (profile on)."""

    def __init__(self, settings: TraceSettings, out=None):
        self.s = settings
        self.out = out
        self._printed = 0  # rows of the depth log printed so far: the sink's own count, so a
        self._summarized = False  # log that arrives as a fresh copy each burst prints each row once

    def _print(self, line: str | None) -> None:
        if line:
            print(line, file=self.out or sys.stderr, flush=True)

    def burst(self, rec: BurstRecord) -> None:
        if self.s.level >= 1:
            self._print(phase_line(rec))
        if self.s.level >= 2:
            self._print(phase_v_line(rec))

    def first_token(self, prof: FirstTokenProf) -> None:
        self._print(f"[{TAGS['prof']}] {prof.line()}")

    def rounds(self, log: RoundsLog, final: bool) -> None:
        for i in range(self._printed, len(log.rounds)):
            self._print(f"[{TAGS['prof_rounds']}] {log.rounds[i].line(i)}")
        self._printed = len(log.rounds)
        if final and not self._summarized:
            self._summarized = True
            self._print(f"[{TAGS['prof_summary']}] {log.summary()}")


class FanOut:
    def __init__(self, *sinks):
        self.sinks = [s for s in sinks if s is not None]

    def burst(self, rec):
        for s in self.sinks:
            s.burst(rec)

    def first_token(self, prof):
        for s in self.sinks:
            s.first_token(prof)

    def rounds(self, log, final):
        for s in self.sinks:
            s.rounds(log, final)

    def pump(self):
        """Deferred host work (span building) the session runs while a verify is on the device."""
        for s in self.sinks:
            p = getattr(s, "pump", None)
            if p is not None:
                p()
