"""THE single place where the benchmark switches the fast path on or off: CUDA graphs over
the decode/verify steps (memra_dist/graphs.py) with torch.compile'd blocks and our Triton
kernels (memra_dist/kernels/) inside them, as the default path runs.
RunConfig takes it as `graphs` ("on" | "off") + `compile` + `kernels`; ModelRunner likewise."""

from __future__ import annotations

import torch

from ..env import environment
from ..kernels import available as kernels_available

__all__ = ["resolve_graphs", "runner_kwargs", "config_kwargs", "graphs_status"]



def _compile() -> bool:
    """The bench compiles the captured blocks unless told not to (MEMRA_BENCH_COMPILE=0)."""
    return environment().bench_compile


WARM_ROWS = 9  # K up to 8: every verify row count captured before anything is timed


def resolve_graphs(flag: str, device: torch.device) -> bool:
    """--graphs on|off|auto: auto = on when CUDA."""
    if flag == "auto":
        return device.type == "cuda"
    return flag == "on"


def runner_kwargs(on: bool) -> dict:
    """Keyword arguments for every ModelRunner the bench builds."""
    return {"graphs": on, "compile": on and _compile(), "kernels": on, "warm_rows": WARM_ROWS if on else 0}


def config_kwargs(on: bool) -> dict:
    """Keyword arguments for every RunConfig the bench builds."""
    return {"graphs": "on" if on else "off", "compile": on and _compile(), "kernels": "auto" if on else "off"}


def graphs_status(on: bool) -> dict:
    kernels = on and kernels_available()
    return {"requested": on, "active": on, "compile": on and _compile(), "kernels": kernels,
            "why": "CUDA graphs per row count + fused QKV/gate-up" + (" + torch.compile'd blocks" if on and _compile() else "")
            + (" + Triton GEMV / cached-attention kernels" if kernels else "")}
