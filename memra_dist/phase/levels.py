"""Trace level and profile flag, resolved from the environment ONCE per process (the seed's
`spec_trace_level` / `spec_prof_on`), with CLI flags that beat the environment."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["ENV_TRACE", "ENV_TRACE_ALIAS", "ENV_PROF", "TraceSettings", "parse_level",
           "trace_level_from", "env_settings", "resolve"]

ENV_TRACE = "MEMRA_SPEC_TRACE"  # 1 = per-burst phase lines, 2 = + the verify sub-split
ENV_TRACE_ALIAS = "MEMRA_GLM5_SPEC_TRACE"  # the glm5 loop's name, still honoured
ENV_PROF = "MEMRA_SPEC_PROF"  # 1 = first-token profile + per-round depth log


@dataclass(frozen=True)
class TraceSettings:
    level: int = 0  # 0 off, 1 phases, 2 phases + verify sub-split
    prof: bool = False

    @property
    def clock_on(self) -> bool:
        """Phase boundaries drain and stamp only when something will read the stamps."""
        return self.level >= 1 or self.prof


def parse_level(v: str | None) -> int | None:
    """'1' -> 1, '2' -> 2; anything else (unset, '0', junk) -> None (off)."""
    return {"1": 1, "2": 2}.get(v) if v is not None else None


def trace_level_from(general: str | None, alias: str | None, warn=None) -> int:
    """Either name alone is honoured; both set and different = the general name wins LOUDLY
    (one stderr line naming both values); a junk general value never masks a valid alias."""
    g, a = parse_level(general), parse_level(alias)
    if g is not None and a is not None and g != a:
        (warn or _stderr)(
            f"[spec-trace] {ENV_TRACE}={g} overrides {ENV_TRACE_ALIAS}={a} "
            "(the general flag wins; unset one to silence this)"
        )
    if g is not None:
        return g
    return a if a is not None else 0


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@lru_cache(maxsize=1)
def env_settings() -> TraceSettings:
    """Read once per process; later changes to the environment are not seen (the seed's law)."""
    level = trace_level_from(os.environ.get(ENV_TRACE), os.environ.get(ENV_TRACE_ALIAS))
    return TraceSettings(level=level, prof=os.environ.get(ENV_PROF) == "1")


def resolve(flag_level: int | None = None, flag_prof: bool | None = None) -> TraceSettings:
    """CLI flags beat the environment; an unset flag falls back to it."""
    env = env_settings()
    return TraceSettings(
        level=env.level if flag_level is None else flag_level,
        prof=env.prof if flag_prof is None else flag_prof,
    )
