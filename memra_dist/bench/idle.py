"""Where the device idled, from a torch.profiler timeline (the bench's `--torch-profile`): the
device's busy share, its idle gaps, and the host work that ran in them, by thread.

The batched engine's own counters say how long its loop spent between steps (`gap_ms`,
`leader_rounds_ms`, `held_ms`: batching/stats.py); this says what the host was doing while the
device waited, op by op, so a gap is explained by its calls (a readback's wait, a graph launch,
a Python-side pack) rather than guessed. Pure functions over chrome-trace events (dicts with
`ph`, `cat`, `name`, `ts`, `dur` in us, `tid`), tested on CPU with made-up events.

>>> ev = [{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 100},
...       {"ph": "X", "cat": "kernel", "name": "k", "ts": 400, "dur": 100},
...       {"ph": "X", "cat": "cpu_op", "name": "aten::tolist", "ts": 90, "dur": 250, "tid": 7}]
>>> r = idle_gaps(ev, min_us=50)
>>> r["busy"], r["gaps"], r["idle_ms"], r["host"][0][:3]
(0.4, 1, 0.3, (7, 'aten::tolist', 0.24))
"""

from __future__ import annotations

import bisect
import collections

__all__ = ["idle_gaps", "format_idle", "DEVICE_CATS", "HOST_CATS"]

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver", "python_function", "user_annotation")
LONGEST_HOST_US = 50_000  # host events longer than this (a whole run's annotation) explain no one gap


def idle_gaps(events: list[dict], min_us: float = 100.0, top: int = 30) -> dict:
    """The device's busy share over the span of its work, its idle gaps of at least `min_us`,
    and the host events overlapping them: (thread, name, ms inside the gaps, count), largest
    first. The gaps' lengths by 0.5 ms bins too. Empty (busy None) where no device work is in
    the timeline (a CPU run)."""
    dev = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    if not dev:
        return {"busy": None, "span_ms": 0.0, "gaps": 0, "idle_ms": 0.0, "host": [], "bins": []}
    start, end, busy, gaps = dev[0]["ts"], dev[0]["ts"], 0.0, []
    for e in dev:
        s, f = e["ts"], e["ts"] + e["dur"]
        if s - end >= min_us:
            gaps.append((end, s))
        busy += max(0.0, f - max(end, s))
        end = max(end, f)
    host = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATS
                   and e.get("dur", 0) < LONGEST_HOST_US), key=lambda e: e["ts"])
    starts = [e["ts"] for e in host]
    inside: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for a, b in gaps:
        for e in host[bisect.bisect_left(starts, a - LONGEST_HOST_US):bisect.bisect_left(starts, b)]:
            o = min(b, e["ts"] + e["dur"]) - max(a, e["ts"])
            if o > 0:
                key = (e.get("tid"), str(e.get("name", ""))[:72])
                inside[key] += o
                count[key] += 1
    bins = collections.Counter(min(int((b - a) // 500), 20) for a, b in gaps)
    span = end - start
    return {"busy": round(busy / span, 3) if span > 0 else None, "span_ms": round(span / 1e3, 2),
            "gaps": len(gaps), "idle_ms": round(sum(b - a for a, b in gaps) / 1e3, 2),
            "host": [(tid, name, round(us / 1e3, 2), count[(tid, name)]) for (tid, name), us in inside.most_common(top)],
            "bins": sorted(bins.items())}


def format_idle(r: dict, min_us: float = 100.0) -> str:
    """The report as text (the bench writes it beside the op tables)."""
    if r["busy"] is None:
        return "no device work in the timeline (a CPU run): nothing idled\n"
    lines = [f"device busy {r['busy']:.3f} of {r['span_ms']} ms; {r['gaps']} idle gaps of >= {min_us:g} us, "
             f"{r['idle_ms']} ms in all",
             "gap lengths (0.5 ms bins, 20 = 10 ms or more): " + ", ".join(f"{b}: {n}" for b, n in r["bins"]),
             "host work inside the gaps (thread, op: ms inside gaps, calls):"]
    lines += [f"  {tid} {name:72s} {ms:9.2f} {n}" for tid, name, ms, n in r["host"]]
    return "\n".join(lines) + "\n"
