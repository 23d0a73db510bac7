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
