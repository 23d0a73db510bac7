"""Our Triton kernels for the graphed decode / verify steps (the CUDA fast path).

`install(stage)` switches a loaded stage onto them: one-row linear layers become Triton GEMVs
(the down projection with the SwiGLU gating folded in; on a decode row the block's pre-norms
and residual adds and the final norm folded into its GEMVs too), verify rows (2 .. 16) run the
same folded halves on a row GEMM (gemm_rows.py), rotary and the K/V cache write become one
kernel, cached attention becomes a split-sequence kernel that reads only the live rows, and a
MoE's routed experts for a few rows become per-slot GEMVs (moe_gemv.py). A target's MTP layers
follow it (ops.install_mtp). Prefills and the CPU path keep the
reference code. `available(device)` says whether they can run there: Triton importable and,
on a CUDA device, a probe kernel compiled and run once (Triton builds its launcher with the
machine's C compiler and needs the GPU's assembler: a container without them falls back to
cuBLAS and the reference attention, with one warning line, instead of failing at capture).
"""

from __future__ import annotations

import functools
import sys

__all__ = ["available", "install", "tuning_tally"]

_PROBED: dict[str, bool] = {}  # device -> whether the probe kernel ran there


@functools.cache
def _importable() -> bool:
    try:
        import triton  # noqa: F401, PLC0415
    except Exception:  # noqa: BLE001
        return False
    return True


def available(device=None) -> bool:
    """Triton imports (no device, or a non-CUDA one: the interpreter's case), and on a CUDA
    device a one-thread kernel (kernels/stamp.py) compiles and writes the device clock."""
    if not _importable():
        return False
    import torch  # noqa: PLC0415

    if device is None or torch.device(device).type != "cuda":
        return True
    key = str(torch.device(device))
    if key not in _PROBED:
        try:
            from .stamp import stamp  # noqa: PLC0415

            buf = torch.zeros(1, dtype=torch.int64, device=device)
            stamp(buf, 0)
            ok = int(buf.item()) > 0  # the global timer is never 0 on a running GPU
            why = "the probe kernel wrote no clock"
        except Exception as e:  # noqa: BLE001 (any failure: compiler, assembler, driver)
            ok, why = False, (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        _PROBED[key] = ok
        if not ok:
            print(f"memra-dist: warning: our Triton kernels cannot run on {key} ({why}); the fast path uses "
                  f"cuBLAS and the reference attention (--kernels off says so without trying)", file=sys.stderr)
    return _PROBED[key]


def install(stage) -> int:
    """Route the stage's one-row linears, gating and cached attention through the kernels
    (kernels/ops.py). Returns the number of modules switched."""
    from .ops import install_stage  # noqa: PLC0415

    return install_stage(stage)


def tuning_tally() -> dict:
    """What Triton autotuning has cost this process so far (kernels/tuning.py's TALLY: configs
    benchmarked, their seconds, keys read from disk); zeros when no kernel module is loaded
    (nothing imports Triton for this)."""
    mod = sys.modules.get(__name__ + ".tuning")
    return dict(mod.TALLY) if mod is not None else {"configs": 0, "tune_s": 0.0, "cached": 0}
