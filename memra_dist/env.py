"""Every MEMRA_* environment variable the package reads, read here and nowhere else.

`environment()` reads them once per process (later changes to `os.environ` are not seen, so a
run cannot change level half-way); `environment.cache_clear()` forgets the reading (tests).
OTEL_* variables stay the OpenTelemetry SDK's and are read where the SDK's habits say.

| variable | meaning | default |
|---|---|---|
| MEMRA_SPEC_TRACE | trace level: 1 phases, 2 + verify sub-split; anything else = off | off |
| MEMRA_GLM5_SPEC_TRACE | the same, under the name of the engine whose phase semantics this one follows (see docs/seed-names.md); MEMRA_SPEC_TRACE wins, loudly, when both are set and differ | off |
| MEMRA_SPEC_PROF | 1 = first-token profile + per-round depth log; anything else = off | off |
| MEMRA_PHASE_CLOCK | how a traced round's phases are timed: events (timing events on the streams, read once a burst; the device never idles for the clock) or drain (every boundary synchronizes the streams: the seed's literal clock, for comparison) | events |
| MEMRA_CACHE_DIR | where the demo's tiny checkpoints are built once | $XDG_CACHE_HOME/memra_dist or ~/.cache/memra_dist |
| MEMRA_FLUSH_TIMEOUT_S | bound on each process's span flush at exit | 5 |
| MEMRA_PG_TIMEOUT_S | bound on the pipeline's process-group bootstrap and on a stalled peer | 60 |
| MEMRA_KDA_KERNELS | CUDA KDA scans: auto, torch (the reference), fla (fla or an error) | auto |
| MEMRA_BENCH_CACHE | `memra-dist bench` checkpoint cache | ~/.cache/memra_dist/bench |
| MEMRA_BENCH_COMPILE | the bench's `--compile` for its graphed runs: auto (the default path's: compile_policy.py), 1 / on, 0 / off (shown in the result's metadata) | auto |
| MEMRA_COMMIT | the commit a bench result names when the tree has no .git | from git |
| MEMRA_TUNE | Triton kernel configs: 0 / off, a key the shipped table lacks takes a heuristic config (nothing benchmarked); 1 / missing, it is benchmarked (autotuned); all, every key is benchmarked, the table unread (kernels/tuning.py) | off |
| MEMRA_TUNED_DIR | a directory of tuned-config tables (`<gpu>.json`, benchmarks/tune_kernels.py --out) read before the package's own | unset |

Junk values of the trace and profile flags mean off (a typo never turns tracing on), and are
said once on stderr so the typo is seen.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import lru_cache

from .phase.levels import (ENV_CLOCK, ENV_PROF, ENV_TRACE, ENV_TRACE_ALIAS, TraceSettings, clock_from, parse_level,
                           prof_from, trace_level_from)

__all__ = ["Env", "environment", "trace_settings", "cache_root", "VARIABLES"]

VARIABLES = (ENV_TRACE, ENV_TRACE_ALIAS, ENV_PROF, ENV_CLOCK, "MEMRA_CACHE_DIR", "MEMRA_FLUSH_TIMEOUT_S",
             "MEMRA_PG_TIMEOUT_S", "MEMRA_KDA_KERNELS", "MEMRA_BENCH_CACHE", "MEMRA_BENCH_COMPILE", "MEMRA_COMMIT",
             "MEMRA_TUNE", "MEMRA_TUNED_DIR")
KDA_MODES = ("auto", "torch", "fla")
TUNE_MODES = {"0": "off", "off": "off", "1": "missing", "on": "missing", "missing": "missing", "all": "all"}


@dataclass(frozen=True)
class Env:
    trace_level: int = 0
    prof: bool = False
    clock: str = "events"
    trace_level_set: bool = False  # MEMRA_SPEC_TRACE (or its alias) says 0, 1 or 2: the demo's default defers to it
    cache_dir: str | None = None
    flush_timeout_s: float = 5.0
    pg_timeout_s: float = 60.0
    kda_kernels: str = "auto"
    bench_cache: str | None = None
    bench_compile: str = "auto"
    commit: str | None = None
    tune: str = "off"  # kernels/tuning.py: off | missing | all
    tuned_dir: str | None = None


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _seconds(name: str, default: float, warn=_say) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not v > 0:
        warn(f"memra-dist: warning: ignoring {name}={raw!r} (expected seconds > 0); using {default:g}")
        return default
    return v


def _kda(warn=_say) -> str:
    raw = os.environ.get("MEMRA_KDA_KERNELS")
    v = (raw or "").strip().lower()
    if v and v not in KDA_MODES:
        warn(f"memra-dist: warning: ignoring MEMRA_KDA_KERNELS={raw!r} (expected {', '.join(KDA_MODES)}); using auto")
    return v if v in KDA_MODES else "auto"


def _tune(warn=_say) -> str:
    raw = os.environ.get("MEMRA_TUNE")
    v = (raw or "").strip().lower()
    if v and v not in TUNE_MODES:
        warn(f"memra-dist: warning: ignoring MEMRA_TUNE={raw!r} (expected 0, 1 or all); using 0")
    return TUNE_MODES.get(v, "off")


@lru_cache(maxsize=1)
def environment() -> Env:
    """Read every MEMRA_* variable once per process."""
    e = os.environ
    g, a = e.get(ENV_TRACE), e.get(ENV_TRACE_ALIAS)
    level = trace_level_from(g, a, _say)
    said = any(v is not None and (v == "0" or parse_level(v) is not None) for v in (g, a))
    return Env(trace_level=level, prof=prof_from(e.get(ENV_PROF), _say), clock=clock_from(e.get(ENV_CLOCK), _say),
               trace_level_set=said,
               cache_dir=e.get("MEMRA_CACHE_DIR") or None,
               flush_timeout_s=_seconds("MEMRA_FLUSH_TIMEOUT_S", 5.0),
               pg_timeout_s=_seconds("MEMRA_PG_TIMEOUT_S", 60.0), kda_kernels=_kda(),
               bench_cache=e.get("MEMRA_BENCH_CACHE") or None, bench_compile={"1": "on", "0": "off"}.get(e.get("MEMRA_BENCH_COMPILE", "auto"), e.get("MEMRA_BENCH_COMPILE", "auto")),
               commit=e.get("MEMRA_COMMIT") or None, tune=_tune(), tuned_dir=e.get("MEMRA_TUNED_DIR") or None)


def trace_settings(flag_level: int | None = None, flag_prof: bool | None = None) -> TraceSettings:
    """CLI flags beat the environment; an unset flag falls back to it."""
    env = environment()
    return TraceSettings(level=env.trace_level if flag_level is None else flag_level,
                         prof=env.prof if flag_prof is None else flag_prof, clock=env.clock)


def cache_root() -> str:
    """The package's cache directory: MEMRA_CACHE_DIR, else $XDG_CACHE_HOME/memra_dist or
    ~/.cache/memra_dist (demo checkpoints, compiled kernels)."""
    return environment().cache_dir or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                   "memra_dist")
