"""device.free_mb reports FREE memory: the host's MemAvailable on CPU, the free half of
torch.cuda.mem_get_info on CUDA (never the total); device labels name the device."""

from __future__ import annotations

import pytest
import torch

from memra_dist.device import device_label, free_mb


def _meminfo_mb(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024
    raise RuntimeError(f"no {field} in /proc/meminfo")


def test_cpu_free_mb_is_mem_available():
    try:
        before = _meminfo_mb("MemAvailable")
    except (OSError, RuntimeError):
        pytest.skip("no /proc/meminfo MemAvailable here")
    got = free_mb(torch.device("cpu"))
    after = _meminfo_mb("MemAvailable")
    tol = 256  # MB: other processes allocate and free between the reads
    assert min(before, after) - tol <= got <= max(before, after) + tol, (got, before, after)


def test_cuda_free_mb_is_the_free_half_of_mem_get_info(monkeypatch):
    seen = []

    def fake_mem_get_info(device=None):
        seen.append(device)
        return 3 * (1 << 30) + 5, 80 * (1 << 30)  # (free, total) bytes

    monkeypatch.setattr(torch.cuda, "mem_get_info", fake_mem_get_info)
    assert free_mb(torch.device("cuda", 0)) == 3 * 1024
    assert free_mb(torch.device("cuda", 1)) == 3 * 1024
    assert [torch.device(d) for d in seen] == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_device_labels():
    assert device_label(torch.device("cpu")) == "cpu"
    assert device_label(torch.device("cuda", 0)) == "cuda0"
    assert device_label(torch.device("cuda", 3)) == "cuda3"

