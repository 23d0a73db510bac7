"""THE single place where the benchmark switches the fast path (CUDA graphs) on or off.

The lead's graph capture (memra_dist/graphs.py) exposes it as a `graphs` field of RunConfig
and/or a `graphs` keyword of ModelRunner. This module detects either at run time, so the
bench needs no edit when they land; until then `wired()` says "not available" and the JSON
records `graphs: {"requested": ..., "active": false, "why": ...}` (never a claimed figure).
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

__all__ = ["resolve_graphs", "runner_kwargs", "config_kwargs", "graphs_status"]


def resolve_graphs(flag: str, device: torch.device) -> bool:
    """--graphs on|off|auto: auto = on when CUDA."""
    if flag == "auto":
        return device.type == "cuda"
    return flag == "on"


def _runconfig_has() -> bool:
    from ..config import RunConfig  # noqa: PLC0415

    return any(f.name == "graphs" for f in dataclasses.fields(RunConfig))


def _runner_has() -> bool:
    from ..engine import ModelRunner  # noqa: PLC0415

    return "graphs" in inspect.signature(ModelRunner.__init__).parameters


def runner_kwargs(on: bool) -> dict:
    """Keyword arguments for every ModelRunner the bench builds."""
    return {"graphs": on} if _runner_has() else {}


def config_kwargs(on: bool) -> dict:
    """Keyword arguments for every RunConfig the bench builds."""
    return {"graphs": on} if _runconfig_has() else {}


def graphs_status(on: bool) -> dict:
    wired = _runner_has() or _runconfig_has()
    return {"requested": on, "active": bool(on and wired),
            "why": "wired through " + ("ModelRunner" if _runner_has() else "RunConfig") if wired
            else "no `graphs` field in RunConfig / ModelRunner yet (bench/fastpath.py is the one place to wire it)"}
