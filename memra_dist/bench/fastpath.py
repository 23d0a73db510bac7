"""THE single place where the benchmark switches the fast path on or off: CUDA graphs over
the decode/verify steps (memra_dist/graphs.py) with torch.compile'd blocks and our Triton
kernels (memra_dist/kernels/) inside them, as the default path runs.
RunConfig takes it as `graphs` ("on" | "off") + `compile` + `kernels`; ModelRunner likewise."""

from __future__ import annotations

import torch

from ..compile_policy import compiles
from ..env import environment
from ..kernels import available as kernels_available

__all__ = ["resolve_graphs", "runner_kwargs", "config_kwargs", "graphs_status"]



def _compile(path: str = "target") -> bool:
    """Whether the bench's graphed runs compile `path`: as `--compile auto` does on the default
    path (compile_policy.py) unless MEMRA_BENCH_COMPILE says on / off."""
    setting = environment().bench_compile
    return compiles(setting if setting in ("on", "off") else "auto", path)


WARM_ROWS = 9  # K up to 8: every verify row count captured before anything is timed


def resolve_graphs(flag: str, device: torch.device) -> bool:
    """--graphs on|off|auto: auto = on when CUDA."""
    if flag == "auto":
        return device.type == "cuda"
    return flag == "on"


def runner_kwargs(on: bool) -> dict:
    """Keyword arguments for every ModelRunner the bench builds."""
    return {"graphs": on, "compile": on and _compile(), "compile_drafter": on and _compile("dflash"), "kernels": on,
            "warm_rows": WARM_ROWS if on else 0}


def config_kwargs(on: bool) -> dict:
    """Keyword arguments for every RunConfig the bench builds."""
    setting = environment().bench_compile
    return {"graphs": "on" if on else "off", "compile": (setting if setting in ("on", "off") else "auto") if on else "off",
            "kernels": "auto" if on else "off"}


def graphs_status(on: bool) -> dict:
    kernels = on and kernels_available()
    return {"requested": on, "active": on, "compile": on and _compile(), "kernels": kernels,
            "why": "CUDA graphs per row count + fused QKV/gate-up" + (" + torch.compile'd blocks" if on and _compile() else "")
            + (" + Triton GEMV / cached-attention kernels" if kernels else "")}
