"""Device plumbing: resolve `--device`, drain streams (counted), read free memory per device."""

from __future__ import annotations

import os

import torch

from .errors import UserError

__all__ = ["DTYPES", "device_mark", "resolve_device", "actor_device", "resolve_dtype", "Drainer", "device_label", "free_mb", "room_mb", "CudaMarks", "stream_marks",
           "to_device"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA device is available here")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise UserError(f"--device {name}: expected cpu, cuda, cuda:N or auto")
    return torch.device(name)


def actor_device(name: str) -> tuple[torch.device, str]:
    """(device, label) inside a pipeline actor. Ray gives a GPU actor one device and sets
    CUDA_VISIBLE_DEVICES to it, so the device is cuda:0 and the label names the physical id;
    an actor without a GPU (or `--device cpu`) runs on the CPU with one intra-op thread,
    since the stage actors share the host's cores."""
    if name != "cpu" and torch.cuda.is_available():
        import ray  # noqa: PLC0415

        ids = ray.get_gpu_ids()
        return torch.device("cuda:0"), f"cuda{int(ids[0]) if ids else 0}"
    torch.set_num_threads(1)
    return torch.device("cpu"), "cpu"


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise UserError(f"unsupported dtype '{name}' (supported: fp32, bf16, fp16)")
    return DTYPES[name]


def device_label(device: torch.device) -> str:
    """The `memra.free_mb.<label>` suffix: cuda0, cuda1, ... or cpu."""
    if device.type == "cuda":
        return f"cuda{device.index if device.index is not None else torch.cuda.current_device()}"
    return "cpu"


def free_mb(device: torch.device) -> int:
    """Free memory in MB: device memory on CUDA (~9 us), host-available memory on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free // (1 << 20))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1 << 20))


def room_mb(device: torch.device) -> int:
    """Memory in MB an allocation on `device` can take: on CUDA the device's free memory plus what
    torch's caching allocator holds unused (an engine closed in this process leaves its tensors'
    memory there, which the next allocations reuse but `free_mb` does not count: sized by
    `free_mb`, a benchmark's sixth engine got a KV pool of one request); on CPU `free_mb`. For
    sizing and fit checks; spans and the first-token profile report `free_mb`."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free_mb(device) + max(int(cached), 0) // (1 << 20)
    return free_mb(device)


class Drainer:
    """Drains one device's stream and counts the drains (the level-0 test counts them)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.count = 0
        self._cuda = device.type == "cuda"

    def __call__(self) -> None:
        self.count += 1
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()


class CudaMarks:
    """The phase clock's timing events on one CUDA device's current stream (phase/clock.py).
    The stream is looked up once a burst (`bind`), and events are recorded through the event's
    base class: `torch.cuda.Event.record()` looks the current stream up per call, which made a
    record cost ~7 us of host time on an H200 host."""

    def __init__(self, device: torch.device):
        self.device = device
        self._record = torch._C._CudaEventBase.record
        self.bind()

    def bind(self) -> None:
        self.stream = torch.cuda.current_stream(self.device)

    def event(self):
        return torch.cuda.Event(enable_timing=True)

    def record(self, ev) -> None:
        self._record(ev, self.stream)

    def wait(self, ev) -> None:
        ev.synchronize()

    def elapsed_ns(self, a, b) -> int:
        return round(a.elapsed_time(b) * 1e6)


def stream_marks(device: torch.device) -> CudaMarks | None:
    """Timing events for the event clock where the device has them (CUDA); None elsewhere (the
    clock then drains: CPU work is done when its call returns)."""
    return CudaMarks(device) if device.type == "cuda" else None


def to_device(values, device) -> torch.Tensor:
    """A host list (or long tensor) of indices on `device` without waiting for the device: a
    CUDA copy from pageable memory would first wait for every kernel queued before it (a shared
    draft forward's, say), so the copy goes through pinned memory, asynchronously (the caching
    host allocator keeps the pinned block until the copy is done)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def device_mark():
    """A timing event recorded now on the current CUDA stream (None off CUDA): where a drafting
    left on the device began, for its cost (`DeviceDrafts.ns_since`), or where the device's wait
    for the engine loop ended (batching/device_idle.py)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev
