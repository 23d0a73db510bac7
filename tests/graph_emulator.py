"""CUDA-graph semantics on the CPU, for testing that a step is capturable.

A capture runs the step once under a dispatch mode that records every aten op with its
arguments; a replay re-runs exactly those ops on the same tensors (the captured region's
allocations are kept, like a graph's memory pool), with no Python in between: Python values
the step computed while capturing are baked in, as on a GPU. Ops a CUDA graph cannot hold
(a host readback, a data-dependent shape) raise at capture.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_FORBIDDEN = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "unique", "_unique2", "unique_consecutive", "masked_select",
              "bincount"}


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if name in _FORBIDDEN:
            raise RuntimeError(f"not capturable: aten::{name} (a host sync or a data-dependent shape)")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


class EmulatedGraph:
    def __init__(self):
        self.ops = []

    @torch.inference_mode()
    def capture(self, fn):
        rec = _Recorder()
        with rec:
            out = fn()
        self.ops = rec.ops
        return out

    @torch.inference_mode()
    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            for o, n in zip(_tensors(out), _tensors(new)):
                if o.data_ptr() == n.data_ptr() or o.numel() == 0:
                    continue  # in place, or a view of the same memory: already there
                o.copy_(n)


class EmulatedCapture:
    """A `graph_cls(fn, pool)` for the drafters' graph sets (DFlash's BlockGraphs, MTPGraphs):
    two eager warm-ups as a CUDA capture does, then fn recorded once; `.out` and `.replay()`
    as a captured graph has them. `captures` counts them (class-wide)."""

    captures = 0

    def __init__(self, fn, pool):
        for _ in range(2):
            fn()
        self.g = EmulatedGraph()
        self.out = self.g.capture(fn)
        EmulatedCapture.captures += 1

    def replay(self) -> None:
        self.g.replay()
