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



def test_room_for_an_allocation_on_cuda_counts_what_the_caching_allocator_holds_unused(monkeypatch):
    """An engine closed in this process leaves its tensors' memory in torch's caching allocator:
    the device reports it used, but the next allocations take it. Sizing a KV pool by the free
    memory alone gave a benchmark's sixth engine (on an H100) a pool of one request."""
    from memra_dist.device import room_mb

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 18 << 30)
    assert free_mb(torch.device("cuda", 0)) == 1024
    assert room_mb(torch.device("cuda", 0)) == 13 * 1024
    assert room_mb(torch.device("cpu")) == pytest.approx(free_mb(torch.device("cpu")), abs=256)


def test_the_batched_engines_kv_pool_is_sized_by_the_room_for_an_allocation(llama, monkeypatch):
    """The pool takes every request of the batch at its capacity where the room holds them, and
    shrinks where it does not (a row priced at 1 MB here, the room 150 MB: ~135 rows)."""
    import memra_dist.device as device
    from memra_dist.app import open_engine
    from memra_dist.batching.paged import PagedKV
    from memra_dist.config import RunConfig

    cfg = RunConfig(model=str(llama), drafter="none", device="cpu", dtype="fp32", max_new_tokens=4)
    with open_engine(cfg, capacity=64, max_batch=4) as eng:
        assert eng._backend.batcher.pool.rows >= 4 * 64
    monkeypatch.setattr(PagedKV, "row_bytes", staticmethod(lambda stage, dtype: 1 << 20))
    monkeypatch.setattr(device, "room_mb", lambda dev: 150)
    with open_engine(cfg, capacity=64, max_batch=4) as eng:
        rows = eng._backend.batcher.pool.rows
    assert 128 <= rows <= 150, rows
