"""A device clock read as a one-thread kernel: level 2's boundaries inside a captured step.

`stamp(buf, i)` writes the GPU's global nanosecond timer into buf[i] when the stream reaches it
(after every kernel issued before it). A captured step records one stamp per sub-split
boundary; after a replay the whole buffer comes back in one copy, where CUDA timing events
cost one driver call per interval read (64 of them for an 8B step: ~10 % of the step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["stamp"]


@triton.jit
def _stamp_kernel(BUF, i):
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(BUF + i, t)


def stamp(buf: torch.Tensor, i: int) -> None:
    """buf (int64, CUDA)[i] = the device's global timer in ns, in stream order."""
    _stamp_kernel[(1,)](buf, i, num_warps=1)
