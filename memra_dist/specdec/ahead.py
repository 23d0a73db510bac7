"""Plain greedy decoding one step ahead of the host, on the graphed path.

A decode round's host work (load the id, write the positions, launch the replay, read the
argmax back, commit, stop checks, the caller's hook) is ~0.2 ms a token on the 8B shape,
and in the round-at-a-time loop the device idles through all of it: the next replay waits
for the host to learn the token it takes as input. Here the token never has to come back
first. After each replay the argmax is written on the device straight into the step graph's
input buffer, so the next replay is launched before the host reads the token of the one
before; the host then reads tokens one step behind the device, and its work overlaps the
next replay (the idle gap shrinks to the argmax and two copies).

Exactly the same graph, the same argmax over the same logits: the ids are those of the
round-at-a-time loop (the tests compare them). A step launched past the request's end (a
stop token, the token budget) wrote one cache row past the committed length; the caller
rolls it back, as a rejected verify row is.

It runs where nothing needs the host between the steps: greedy, no drafts, no first-token
profile, and either a local runner whose one-row step is a captured graph (pp = 1 on CUDA:
AheadSteps) or the pipeline head at trace level 0 or 1 (pp > 1: TargetAhead, any device).
Everything else takes the round loop.

Traced (levels 1 and 2) it still runs ahead, so the trace describes the path users run. The
phase clock's drains would serialize host and device at every boundary (what makes the round
loop's level 1 ~10 % slower than level 0 here); instead each step carries its own device
timing: a timing event before the replay, one after it (the verify), one after the argmax
and the token's copy back (the accept's device work). These are the device's own intervals,
which is what a drain buys the round loop, read one step behind with the token. At level 2
the step is the twin graph that stamps the device clock at the sub-split's boundaries
(graphs.py, phase/subsplit.py StampMarks); each replay's stamps are copied to a host slot of
their own in stream order, so the next replay cannot overwrite them before they are read.
"""

from __future__ import annotations

import math
import time

import torch

from ..phase.subsplit import StampMarks
from .accept import NonFiniteRow
from .drafters.none import NoDrafter

__all__ = ["AheadSteps", "TargetAhead", "HostEvent", "ahead_steps"]

RING = 4  # host slots for the tokens read back (at most two steps are in flight)


class HostEvent:
    """torch.cuda.Event's face for a CPU step (the graph emulator's): the CPU runs each op as
    it is issued, so the host clock at `record` is the time the work before it finished."""

    def __init__(self, enable_timing: bool = False):
        self.ns = 0

    def record(self) -> None:
        self.ns = time.perf_counter_ns()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "HostEvent") -> float:
        return (end.ns - self.ns) / 1e6  # ms, as CUDA's


def _event_kind(device: torch.device):
    return torch.cuda.Event if device.type == "cuda" else HostEvent


class _Ahead:
    """The ring of tokens read back one step behind: each launch ends with the step's argmax
    copied to a host slot and an event recorded; `take` waits for the oldest one only.
    `timed`: each step also records timing events before and after its forward (`verify_ns`).

    Non-finite logits: argmax lands on a NaN (or +inf) wherever the row holds one, so the logit at
    the argmax is finite exactly when the row is. What comes back for each step is the token
    as a float64, x + logit * 0: the token itself (exact), or NaN when that logit is NaN / inf.
    That costs two tiny kernels a step (the gather of the logit, the addcmul), in stream order,
    and no copy beyond the token's own (measured on an H200, a 1024-wide 8-layer llama at
    ~250 us a token: +7 us a token; a copy of its own cost +12). `take` raises NonFiniteRow
    for a NaN, before the token is used."""

    def __init__(self, device: torch.device, timed: bool = False):
        event = _event_kind(device)
        self.timed = timed
        # each step's token (float64: exact for any vocabulary), NaN when its logits were not finite
        self.host = torch.zeros(RING, dtype=torch.float64, pin_memory=device.type == "cuda")
        self._slots = [self.host[i:i + 1] for i in range(RING)]
        self._host_np = self.host.numpy()  # read without a tensor op per token
        self._zero = torch.zeros(1, dtype=torch.float64, device=device)  # float64: the sum is computed in it
        self._read = torch.zeros(1, dtype=torch.float64, device=device)  # what is copied back
        self._logit: torch.Tensor | None = None  # the argmax's logit, (1, 1) in the logits' dtype
        self.events = [event(enable_timing=timed) for _ in range(RING)]  # after the token's copy back
        self.began = [event(enable_timing=True) for _ in range(RING)] if timed else None
        self.verified = [event(enable_timing=True) for _ in range(RING)] if timed else None
        self.launched = self.taken = 0
        self.slot = -1  # the slot of the step taken last

    def verify_ns(self) -> int:
        """The device ns of the forward of the step taken last (timed steps)."""
        s = self.slot
        return round(self.began[s].elapsed_time(self.verified[s]) * 1e6)

    def laps_to(self, timer) -> None:
        """The level-2 sub-split of the step taken last, into `timer` (none here)."""

    @property
    def pending(self) -> int:
        return self.launched - self.taken

    def _read_back(self, x: torch.Tensor, logits: torch.Tensor) -> None:
        """x: the step's argmax (1,) on the device; logits: its row (1, V)."""
        s = self.launched % RING
        if self._logit is None or self._logit.dtype != logits.dtype:
            self._logit = torch.zeros(1, 1, dtype=logits.dtype, device=logits.device)
        torch.gather(logits, -1, x.view(1, 1), out=self._logit)
        torch.addcmul(x, self._logit.view(1), self._zero, out=self._read)  # x, or NaN for a NaN / inf logit
        self._slots[s].copy_(self._read, non_blocking=True)
        self.events[s].record()
        self.launched += 1

    def take(self) -> int:
        """The oldest pending step's token (waits for that step only); NonFiniteRow when that
        step's logits hold NaN / inf."""
        s = self.slot = self.taken % RING
        self.events[s].synchronize()
        self.taken += 1
        v = float(self._host_np[s])
        if not math.isfinite(v):
            raise NonFiniteRow(0)
        return int(v)

    def drop(self) -> None:
        """Forget the steps not taken (their rows are rolled back by the caller)."""
        self.taken = self.launched


class AheadSteps(_Ahead):
    """Launch one-row steps whose input is the previous step's argmax, on the device; take
    their tokens in launch order. `step` is the one-row token-id graph (graphs._Graph), or its
    level-2 twin (its `marks` then StampMarks). `timed`: each step also records the device
    time of its replay (`verify_ns` after `take`)."""

    def __init__(self, runner, step, timed: bool = False):
        super().__init__(step.x.device, timed)
        self.runner, self.step = runner, step
        self.marks = step.marks if timed else None
        n = self.marks.n if self.marks is not None else 0
        self.stamps = torch.zeros(RING, n, dtype=torch.int64, pin_memory=step.x.device.type == "cuda") if n else None

    @torch.inference_mode()  # the graph's buffers are inference tensors (captured under the runner's forward)
    def launch(self, start: int, token: int | None = None) -> None:
        """The step at position `start`. Its input: `token` (from the host) or, when None,
        the argmax the previous step left in the input buffer."""
        g = self.step
        s = self.launched % RING
        self.runner.cache.begin(start, 1)
        if token is not None:
            g.load(torch.tensor([token], dtype=torch.long))
        if self.timed:
            self.began[s].record()
        g.replay_at(start)
        if self.timed:
            self.verified[s].record()
        if self.stamps is not None:  # this replay's stamps, before the next replay rewrites them
            self.stamps[s].copy_(g.marks.buf[: self.marks.n], non_blocking=True)
        torch.argmax(g.out, dim=-1, out=g.x)  # the next step's input, never via the host
        self._read_back(g.x, g.out[-1:])

    def laps_to(self, timer) -> None:
        """The level-2 sub-split of the step taken last, into `timer` (phase/subsplit.py)."""
        if self.stamps is not None:
            self.marks.laps(self.stamps[self.slot].tolist(), timer)


class TargetAhead(_Ahead):
    """One step ahead through a target's own forward, for a target that takes its input ids
    on the device and never reads them back: the pipeline head (pipeline/head_target.py),
    whose forward puts the ids inside the command to stage 0 with a device-to-device copy
    (pipeline/transport.py). The head's host then sends the next step's command before it
    reads this step's token; stage 0 learns its command when the head's argmax is done, so
    the host work left between two tokens is stage 0's (its command read, its launch). `timed`
    (level 1): the forward's events bound the whole walk on the head's stream, which waits for
    the last stage's rows, as the round loop's terminal drain does (phase/clock.py)."""

    def __init__(self, target, timed: bool = False):
        super().__init__(target.device, timed)
        self.target = target
        self.x = torch.zeros(1, dtype=torch.long, device=target.device)  # the next step's input id

    @torch.inference_mode()
    def launch(self, start: int, token: int | None = None) -> None:
        s = self.launched % RING
        if token is not None:
            self.x.fill_(token)
        if self.timed:
            self.began[s].record()
        logits = self.target.forward(self.x, start)  # (1, V); the command copied x before the argmax rewrites it
        if self.timed:
            self.verified[s].record()
        torch.argmax(logits[-1:], dim=-1, out=self.x)
        self._read_back(self.x, logits[-1:])


def _stamped(step) -> bool:
    """A level-2 twin whose boundaries are device-clock stamps (one buffer, copyable per
    replay); a twin of CUDA events cannot run ahead (the next replay re-records them)."""
    marks = getattr(step, "marks", None)
    return isinstance(marks, StampMarks) and bool(marks.kinds)


def ahead_steps(target, drafter, sp, trace) -> AheadSteps | TargetAhead | None:
    """One-ahead steps for this session's target when nothing needs the host between steps
    (see the module docstring; `trace`: phase/levels.TraceSettings); None otherwise."""
    if trace.prof or not sp.greedy or not isinstance(drafter, NoDrafter):
        return None
    if getattr(target, "ids_on_device", False):  # the pipeline head
        # level 2 keeps the round loop: the stages' sub-split vectors ride back with each forward
        return TargetAhead(target, timed=trace.level >= 1) if trace.level < 2 else None
    graphs = getattr(target, "graphs", None)
    if graphs is None or getattr(target, "cache", None) is None:
        return None
    step = (graphs.timed if trace.level >= 2 else graphs.graphs).get(1)
    if step is None or step.copied is None:
        return None  # not captured yet, or a graph of hidden rows (a pipeline stage)
    if trace.level >= 2 and not _stamped(step):
        return None
    return AheadSteps(target, step, timed=trace.level >= 1)
