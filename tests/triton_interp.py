"""Triton for the kernel tests: on a CPU machine its interpreter runs the kernels (set before
any kernel module imports Triton). A test module that imports `triton` from here is skipped
where Triton is missing or too old for the interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
    pytest.skip("Triton's interpreter needs triton >= 3.9 with numpy 2 (pip install -U triton)",
                allow_module_level=True)

if os.environ.get("TRITON_INTERPRET") == "1":
    # The interpreter runs a launch with module-wide state (the grid index, the patched language
    # functions), so launches from two threads at once break each other. On a GPU they are
    # independent; here, where requests' threads launch kernels side by side (a batched step
    # beside a tap drafter's own forward), they take turns.
    import threading

    from triton.runtime import interpreter as _interp

    if hasattr(_interp, "GridExecutor"):
        _turn = threading.RLock()
        _launch = _interp.GridExecutor.__call__

        def _one_at_a_time(self, *args, **kwargs):
            with _turn:
                return _launch(self, *args, **kwargs)

        _interp.GridExecutor.__call__ = _one_at_a_time
