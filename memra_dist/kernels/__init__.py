"""Our Triton kernels for the graphed decode / verify steps (the CUDA fast path).

`install(stage)` switches a loaded stage onto them: one-row linear layers become Triton GEMVs
(the down projection with the SwiGLU gating folded in) and cached attention becomes a
split-sequence kernel that reads only the live rows. Prefills and the CPU path keep the
reference code. `available()` says whether Triton is importable on this machine.
"""

from __future__ import annotations

import functools

__all__ = ["available", "install"]


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401, PLC0415
    except Exception:  # noqa: BLE001
        return False
    return True


def install(stage) -> int:
    """Route the stage's one-row linears, gating and cached attention through the kernels
    (model/fast.py). Returns the number of modules switched."""
    from .ops import install_stage  # noqa: PLC0415

    return install_stage(stage)
