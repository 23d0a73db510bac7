"""Timing primitives: device sync, median-of-repeats wall timing (with the range of the repeats,
noise.trimmed_range), copy bandwidth."""

from __future__ import annotations

import time
from typing import Callable

import torch

from .noise import trimmed_range
from .roofline import median

__all__ = ["sync", "time_call", "copy_bandwidth", "device_name", "capture_graph", "graph_replay_ms", "graph_kernels"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2,
              between: Callable[[], object] | None = None) -> dict:
    """Wall seconds of `fn` with a device sync on both sides (launch overhead included, as a
    real step pays it); `between` runs untimed after each call (e.g. a cache rollback)."""
    for _ in range(warmup):
        fn()
        if between is not None:
            between()
    sync(device)
    xs = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        xs.append(time.perf_counter() - t0)
        if between is not None:
            between()
    lo, hi = trimmed_range(xs)
    return {"median_s": median(xs), "min_s": min(xs), "max_s": max(xs), "lo_s": lo, "hi_s": hi, "n": len(xs)}


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> dict:
    """Device-to-device copy of an `nbytes` buffer (a host memcpy on CPU). Counts read + write
    (2 x nbytes per copy), the convention under which one H200 measured 4.25 TB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    t = time_call(lambda: dst.copy_(src), device, repeats, warmup=2)
    bw = 2 * nbytes / t["median_s"]
    rng = [2 * nbytes / t["hi_s"], 2 * nbytes / t["lo_s"]]  # bandwidth over the range of copy times
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"bytes": nbytes, "copy_median_s": t["median_s"], "bandwidth_bytes_s": bw,
            "bandwidth_tb_s": bw / 1e12, "bandwidth_bytes_s_range": rng, "repeats": t["n"],
            "convention": "2 * bytes / copy time (read + write)"}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform  # noqa: PLC0415

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# ---- CUDA-graph micro-benchmarks (benchmarks/*.py) ----------------------------------------

def capture_graph(run: Callable[[], object], warmup: int = 3) -> "torch.cuda.CUDAGraph":
    """`run` captured in a CUDA graph after `warmup` eager calls on a side stream (kernels tune
    and compile there, not inside the capture). The graph keeps `run` (and so the static inputs
    its closure holds: a freed input row would be reread by every replay) and its output
    (`g.out`)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(g):
        g.out = run()
    g.keep = run
    return g


def graph_replay_ms(g: "torch.cuda.CUDAGraph", n: int, warmup: int = 3) -> float:
    """Mean device ms of one replay over n, by events after `warmup` replays."""
    for _ in range(warmup):
        g.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    e0.record()
    for _ in range(n):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n


def graph_kernels(g: "torch.cuda.CUDAGraph", reps: int = 5) -> list[tuple[float, int, str]]:
    """The kernels of one replay, (device us, calls, name), largest first (the profiler over
    `reps` replays, divided back)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", 0) or 0
        if us and not ev.key.startswith(("cuda", "aten::")):
            rows.append((us / reps, ev.count // reps, ev.key[:120]))
    return sorted(rows, reverse=True)
