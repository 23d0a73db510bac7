"""Where one thread's wall time goes, by sampling its stack (the bench's `--loop-profile`: the
engine loop's thread, batching/batcher.py `_run`).

cProfile cannot answer this for the engine loop: since Python 3.12 it traces every thread of
the process (PEP 669 events are process-wide), so 64 request threads' calls land in the loop's
profile, and its per-call overhead slows the loop it measures. Here a sampler thread reads the
watched thread's current frame (`sys._current_frames`) every `interval_s`, and its CPU clock
(`time.pthread_getcpuclockid`, Linux): a sample whose interval saw the thread use less than
half of it on the CPU is "waiting". So a frame in pure Python that is mostly waiting is the
thread waiting for the interpreter (the GIL, held by other threads), and a frame in a device
readback that is waiting is the thread waiting for the device: the two causes of a loop's idle
device that a timeline cannot tell apart. The sampler itself needs the interpreter to read a
frame, so a thread that never lets it go is sampled less often: the counts are shares of the
samples taken, and `n` says how many there were.

Pure aggregation (`summarize`, `format_summary`) over samples of (stack, running) is tested on
the CPU with made-up samples; `Sampler` on real threads.

>>> a = (("batcher.py", 10, "_run"), ("loop_rounds.py", 30, "chain_rounds"))
>>> b = (("batcher.py", 10, "_run"), ("graphs.py", 7, "replay"))
>>> s = summarize([(a, True), (b, False), (b, False), (b, False)])
>>> s["n"], s["running"], s["self"][0]   # the loop waiting in a replay: 3 of 4 samples, none running
(4, 0.25, ('graphs.py:replay', 0.75, 0.0))
>>> s["inclusive"][0]
('batcher.py:_run', 1.0, 0.25)
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

__all__ = ["Sampler", "summarize", "format_summary"]

Frame = tuple[str, int, str]  # (file's base name, line, function)


def summarize(samples: list[tuple[tuple[Frame, ...], bool]], top: int = 25) -> dict:
    """Samples of (stack root-first, running) -> the running share of all, and by function
    (`file:function`) its share of the samples as the innermost frame ("self") and anywhere on
    the stack ("inclusive"), each (name, share, running share of all samples), largest first;
    and the top whole stacks (innermost 6 frames) the same way."""
    n = len(samples)
    if not n:
        return {"n": 0, "running": 0.0, "self": [], "inclusive": [], "stacks": []}
    own, incl, stacks = (collections.defaultdict(lambda: [0, 0]) for _ in range(3))
    for stack, running in samples:
        if not stack:
            continue
        names = [f"{f}:{fn}" for f, _, fn in stack]
        for d, key in ((own, names[-1]), (stacks, " < ".join(reversed(names[-6:])))):
            d[key][0] += 1
            d[key][1] += running
        for name in set(names):
            incl[name][0] += 1
            incl[name][1] += running

    def ranked(d):
        return [(k, round(c / n, 4), round(r / n, 4)) for k, (c, r) in sorted(d.items(), key=lambda x: -x[1][0])[:top]]

    return {"n": n, "running": round(sum(r for _, r in samples) / n, 4), "self": ranked(own),
            "inclusive": ranked(incl), "stacks": ranked(stacks)}


def format_summary(s: dict, title: str = "engine loop") -> str:
    """The summary as text: one table a view, shares in % of the samples."""
    out = [f"==== {title}: {s['n']} samples; on the CPU in {100 * s['running']:.1f} % of them "
           "(the rest waiting: for the device, a lock, or the interpreter)"]
    for key, what in (("self", "innermost frame"), ("inclusive", "anywhere on the stack"),
                      ("stacks", "stacks, innermost first")):
        out.append(f"\n-- by {what}: % of samples (% running)")
        out += [f"{100 * share:6.1f} ({100 * run:5.1f})  {name}" for name, share, run in s[key]]
    return "\n".join(out) + "\n"


def _stack(frame, depth: int) -> tuple[Frame, ...]:
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append((os.path.basename(code.co_filename), frame.f_lineno, code.co_name))
        frame = frame.f_back
    return tuple(reversed(out))


class Sampler:
    """Samples thread `ident`'s stack every `interval_s` from a daemon thread of its own, from
    `start()` until `stop()` (which returns the samples: (stack root-first, running))."""

    def __init__(self, ident: int, interval_s: float = 0.001, depth: int = 24):
        self.ident, self.interval_s, self.depth = ident, interval_s, depth
        self.samples: list[tuple[tuple[Frame, ...], bool]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self._clock = time.pthread_getcpuclockid(ident)
        except (AttributeError, OSError):  # (no per-thread CPU clock here: every sample "running")
            self._clock = None

    def _cpu(self) -> float:
        return time.clock_gettime(self._clock) if self._clock is not None else 0.0

    def _run(self) -> None:
        last_cpu, last = self._cpu(), time.perf_counter()
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self.ident)
            if frame is None:  # the thread ended
                return
            stack = _stack(frame, self.depth)
            del frame
            cpu, now = self._cpu(), time.perf_counter()
            running = self._clock is None or (cpu - last_cpu) >= 0.5 * (now - last)
            last_cpu, last = cpu, now
            self.samples.append((stack, running))

    def start(self) -> "Sampler":
        self._thread = threading.Thread(target=self._run, name="memra-loop-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[tuple[tuple[Frame, ...], bool]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.samples
