"""What `--compile auto` compiles: only the paths where a benchmark showed torch.compile gains
at least 3 % in decode (benchmarks/compile_pays.py, BENCHMARKS.md "Where compile pays").

A path's compile costs a fresh process its inductor work at the first capture (cold: tens of
seconds per path; warm on-disk cache: seconds), so compile is worth it only where decode
gains. `--compile on` compiles every path that supports it, `off` none, `auto` those in
`PAYS` marked True. Pure: the CLI, the runners and the tests read the same table.

Paths:
  target  the target's (and a draft model's) blocks captured in the decode / verify graphs
          (graphs.compile_blocks)
  dflash  the DFlash drafter's pieces captured in its block graphs (drafters/dflash_compile.py)
"""

from __future__ import annotations

__all__ = ["PAYS", "compiles", "SETTINGS"]

SETTINGS = ("auto", "on", "off")

# path -> whether compile gained >= 3 % in decode (benchmarks/compile_pays.py on one H200)
PAYS = {
    "target": False,  # 8B plain: +0.4 %; 1B plain and the draft model: see BENCHMARKS.md
    "dflash": True,  # the DFlash block: its norms / rotary as eager kernels cost more than its reads
}


def compiles(setting: str, path: str) -> bool:
    """Whether `path` compiles under `--compile setting`.

    >>> compiles("on", "target"), compiles("off", "dflash"), compiles("auto", "target"), compiles("auto", "dflash")
    (True, False, False, True)
    """
    if setting not in SETTINGS:
        raise ValueError(f"--compile must be one of {SETTINGS} (got {setting!r})")
    if path not in PAYS:
        raise KeyError(f"unknown compile path {path!r} (known: {', '.join(PAYS)})")
    return setting == "on" or (setting == "auto" and PAYS[path])
