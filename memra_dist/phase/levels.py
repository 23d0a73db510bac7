"""Trace level and profile flag: the pure rules (names, parsing, which one wins). The
environment itself is read once per process in memra_dist/env.py, which also resolves CLI
flags over it (`env.trace_settings`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

__all__ = ["ENV_TRACE", "ENV_TRACE_ALIAS", "ENV_PROF", "ENV_CLOCK", "TraceSettings", "parse_level",
           "trace_level_from", "prof_from", "clock_from"]

ENV_TRACE = "MEMRA_SPEC_TRACE"  # 1 = per-burst phase lines, 2 = + the verify sub-split
ENV_TRACE_ALIAS = "MEMRA_GLM5_SPEC_TRACE"  # the originating engine's name for it (docs/seed-names.md)
ENV_PROF = "MEMRA_SPEC_PROF"  # 1 = first-token profile + per-round depth log
ENV_CLOCK = "MEMRA_PHASE_CLOCK"  # events (default) | drain: how the phase clock finds a phase's end (phase/clock.py)
CLOCK_MODES = ("events", "drain")


@dataclass(frozen=True)
class TraceSettings:
    level: int = 0  # 0 off, 1 phases, 2 phases + verify sub-split
    prof: bool = False
    clock: str = "events"  # events: timing events read once a burst; drain: synchronize at every boundary

    @property
    def clock_on(self) -> bool:
        """Phase boundaries drain and stamp only when something will read the stamps."""
        return self.level >= 1 or self.prof


def parse_level(v: str | None) -> int | None:
    """'1' -> 1, '2' -> 2; anything else (unset, '0', junk) -> None (off)."""
    return {"1": 1, "2": 2}.get(v) if v is not None else None


def _junk(v: str | None) -> bool:
    return v not in (None, "", "0") and parse_level(v) is None


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def trace_level_from(general: str | None, alias: str | None, warn=None) -> int:
    """Either name alone is honoured; both set and different = the general name wins LOUDLY
    (one stderr line naming both values); a junk general value never masks a valid alias.
    A junk value means off and is said once (one line per junk variable)."""
    say = warn or _stderr
    g, a = parse_level(general), parse_level(alias)
    for name, raw in ((ENV_TRACE, general), (ENV_TRACE_ALIAS, alias)):
        if _junk(raw):
            say(f"[spec-trace] ignoring {name}={raw!r} (expected 1 or 2; junk means off)")
    if g is not None and a is not None and g != a:
        say(f"[spec-trace] {ENV_TRACE}={g} overrides {ENV_TRACE_ALIAS}={a} "
            "(the general flag wins; unset one to silence this)")
    if g is not None:
        return g
    return a if a is not None else 0


def prof_from(raw: str | None, warn=None) -> bool:
    """'1' = on; unset, '' or '0' = off; junk = off, said once."""
    if raw == "1":
        return True
    if raw not in (None, "", "0"):
        (warn or _stderr)(f"[spec-prof] ignoring {ENV_PROF}={raw!r} (expected 1; junk means off)")
    return False


def clock_from(raw: str | None, warn=None) -> str:
    """'events' / 'drain' (any case); unset or '' = events; junk = events, said once."""
    v = (raw or "").strip().lower()
    if v in CLOCK_MODES:
        return v
    if v:
        (warn or _stderr)(f"[spec-trace] ignoring {ENV_CLOCK}={raw!r} (expected events or drain); using events")
    return "events"
