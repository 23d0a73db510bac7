"""The phase clock: a phase ends when every stream that ran it has finished it.

Which streams each boundary covers (and why that bounds the phase):
- The clock of a session covers its PRIMARY engine's stream (the target's first engine in
  this process: the whole model at pp=1, the head at pp>1) and its HEAD engine's stream when
  that is a different engine or device (the drafter's device when the drafter sits apart).
  At pp=1 primary == head == one device, so a boundary is one stream.
- draft: the drafter runs on the head's device, so the head's stream bounds it.
- verify: at pp>1 the head's verify walk ends by receiving the last stage's hidden rows and
  running the lm_head on them; the receive cannot complete before every stage's forward
  has, so the head's stream covers all stage streams TRANSITIVELY. No stage is marked from here.
- accept: host + head-device work (argmax / rejection sampling + readback): head stream.
- rollback: the head's cache rollback (a length change; KDA layers restore a snapshot on
  the head's device): head stream. At pp>1 no message goes to the stages: each stage rolls
  back to the next forward's start before running it, so a stage's own rollback work (a
  snapshot restore for its KDA layers) lands in the NEXT round's verify.
- maint: drafter rollback / re-seed on the head's device: head stream.

Two ways to find when a stream finished a phase (`TraceSettings.clock`, MEMRA_PHASE_CLOCK):
- `events` (the default where every stream can record timing events, i.e. CUDA): at each
  boundary an event is recorded on every stream and the host goes on launching the next
  phase: the device never idles for the clock. A boundary's time is when the LAST of its
  streams reached its event (the seed's "drained" moment, read on the device's own clock).
  A burst's events are read in the next burst's first verify, in the device's shadow (a
  request's last burst: at its end, the one wait the clock adds), and placed on the host's
  clock by an anchor event recorded right after the burst's first readback, when the streams
  have just run dry; the burst's record reaches the sinks then, one burst late. A phase bound
  by its host (launches, the accept's readback and host logic) still shows it:
  the device cannot reach a boundary's event before the host has recorded it.
- `drain` (the seed's literal clock; CPU, engines without events, the first-token profile):
  each boundary synchronizes every stream, then stamps perf_counter. The device then idles
  while the host launches the next phase: that idle time lands in the next phase.
A boundary whose phase launched no device work (`quiet`: a host-only drafter's draft and
maintenance, a rollback that only moves the cache's length, the accept's end on one stream,
which its readback has just run dry) records no event either: the streams reach it when they
finished the boundary before, or as the host gets there, whichever is later (the rule of a
later round's entry). An ngram round then records one event, the verify's, in its shadow.
Only constructed when the clock is on (trace level >= 1 or the profile): level 0 has no
clock object, hence no drains, no events and no clock reads.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Protocol, Sequence

__all__ = ["PhaseClock", "StreamMarks", "stream_marks_of", "quiet_boundaries", "session_clock"]


class StreamMarks(Protocol):
    """Timing events on one engine's stream (device.py: CudaMarks; tests: a simulated stream)."""

    def bind(self) -> None: ...  # look up the stream to record on (once a burst)
    def event(self) -> object: ...  # a new reusable event
    def record(self, ev: object) -> None: ...  # record it on the stream, in stream order
    def wait(self, ev: object) -> None: ...  # the host waits until the stream reached it
    def elapsed_ns(self, a: object, b: object) -> int: ...  # stream time from a to b (both reached)


class PhaseClock:
    """`drains`: one callable per stream the clock covers; `marks`: one StreamMarks per stream
    (the same order) for the event clock, or None for the draining clock."""

    def __init__(self, drains: Sequence[Callable[[], None]], free_mb: Callable[[], dict[str, int]],
                 marks: Sequence[StreamMarks] | None = None, quiet: Iterable[int] = ()):
        self.drains = tuple(drains)
        self.free_mb = free_mb  # device label -> free MB, for the devices of this process
        self.marks = tuple(marks) if marks else ()
        self.events = bool(self.marks)
        # boundaries whose phase launches no device work: no event (the event clock only); the
        # verify's end (2) always has one, so every round ends its device work on an event
        quiet = set(quiet)
        if not quiet <= {1, 3, 4, 5}:
            raise ValueError(f"quiet boundaries must lie in 1, 3, 4, 5 (got {sorted(quiet)})")
        self.quiet = tuple(i in quiet for i in range(6))
        self._last = max(i for i in range(6) if not self.quiet[i])  # a round's last boundary with an event
        # two banks of event slots, [round slot][boundary][stream]: a burst records into one while
        # the burst before's are still to be read (`resolve` runs in the next burst's first verify)
        self._banks: list[list[list[list[object]]]] = [[], []]
        self._anchors = [[m.event() for m in self.marks] for _ in range(2)]
        self._anchor_ns = [0, 0]  # the host's time as each bank's anchor was recorded
        self.bank = 0

    @property
    def mode(self) -> str:
        """events | drain | host (no stream to drain: every phase's device work is done when the
        host leaves it, as in a batched request whose steps return read back)."""
        return "events" if self.events else ("drain" if self.drains else "host")

    # ---- drained stamps (the first-token profile, the draining clock) ----
    def stamp(self) -> int:
        for d in self.drains:
            d()
        return time.perf_counter_ns()

    def lap_ms(self, since_ns: int) -> tuple[int, float]:
        now = self.stamp()
        return now, (now - since_ns) / 1e6

    # ---- round boundaries ----
    def begin(self, rounds: int) -> int:
        """Before a burst of up to `rounds` rounds: switch to the other bank of event slots
        (created once, reused every other burst). Returns the bank the burst records into."""
        if not self.events:
            return 0
        for m in self.marks:
            m.bind()
        self.bank ^= 1
        slots = self._banks[self.bank]
        while len(slots) < rounds:
            slots.append([[m.event() for m in self.marks] for _ in range(6)])
        self._anchor_ns[self.bank] = 0
        return self.bank

    def mark(self, r, slot: int, i: int) -> int:
        """Boundary i (0: round entry, 1..5: the end of draft, verify, accept, rollback, maint)
        of the round record `r` in burst slot `slot`. Returns the host's time on reaching it.
        Draining clock: r.t[i] is the stamp after the drains. Event clock: an event on every
        stream, r.t[i] the host time for now (`resolve` replaces it by the streams' time). A
        round's entry after another round of the burst records no event: nothing was launched
        since the previous round's last boundary, so the streams reach it at that boundary's
        time or, if they were idle by then, as the host gets there (`resolve` takes the later).
        Nor does a quiet boundary, by the same rule."""
        host = time.perf_counter_ns()
        if self.events:
            r.t[i] = host
            if self.quiet[i] or (i == 0 and slot):
                return host
            for m, ev in zip(self.marks, self._banks[self.bank][slot][i]):
                m.record(ev)
        else:
            r.t[i] = host if i == 0 else self.stamp()  # round entry: the previous boundary drained
        return host

    def anchor(self) -> None:
        """Right after the burst's first readback, when every stream has just run dry: an event
        the streams reach as the host records it, which places the bank's events on the host's
        clock. (Boundaries 0-2 of the burst's first round lie before it; every later one after.)"""
        if self.events and not self._anchor_ns[self.bank]:
            self._anchor_ns[self.bank] = time.perf_counter_ns()
            for m, a in zip(self.marks, self._anchors[self.bank]):
                m.record(a)

    def resolve(self, rounds: list, bank: int | None = None) -> None:
        """Set every round's t[i] of a burst recorded into `bank` (default: the current one) to
        the time its last stream reached boundary i (monotone). Waits for the burst's last
        events: called in the next burst's first verify, that wait is in the device's shadow
        (the streams reach them before that verify's work); at a request's end it is the one
        wait the clock adds. A burst without an anchor (none of its rounds read back) gets one
        now, on the streams just waited for."""
        if not self.events or not rounds:
            return
        bank = self.bank if bank is None else bank
        slots, anchors = self._banks[bank], self._anchors[bank]
        for m, ev in zip(self.marks, slots[len(rounds) - 1][self._last]):
            m.wait(ev)
        h = self._anchor_ns[bank]
        first_after = (0, 3)  # (slot, boundary) of the first event recorded after the anchor
        if not h:
            h = self._anchor_ns[bank] = time.perf_counter_ns()
            for m, a in zip(self.marks, anchors):
                m.record(a)
            first_after = (len(rounds), 0)  # every event lies before it
        for m, a in zip(self.marks, anchors):
            m.wait(a)

        def at(m, e, a, n: int, i: int) -> int:
            return h + m.elapsed_ns(a, e) if (n, i) >= first_after else h - m.elapsed_ns(e, a)

        prev, quiet = 0, self.quiet
        for n, r in enumerate(rounds):
            evs, t = slots[n], r.t
            for i in range(6):
                if quiet[i] or (i == 0 and n):
                    v = t[i] if t[i] > prev else prev  # the boundary before's time, or the host's arrival
                else:
                    v = max(at(m, e, a, n, i) for m, e, a in zip(self.marks, evs[i], anchors))
                if v < prev:
                    v = prev
                t[i] = prev = v


def stream_marks_of(trace, engines: list) -> list | None:
    """The event clock's marks, one per engine's stream (`engine.stream_marks()`), when every
    one records timing events and the clock is `events`; None = the draining clock (CPU, a
    batched target, MEMRA_PHASE_CLOCK=drain, the first-token profile: its depth laps drain)."""
    if trace.clock != "events" or trace.prof:
        return None
    marks = []
    for e in engines:
        m = getattr(e, "stream_marks", None)
        m = m() if callable(m) else None
        if m is None:
            return None
        marks.append(m)
    return marks


def quiet_boundaries(drafter, target, marks) -> set[int]:
    """The round boundaries whose phase launches no device work, so the event clock records no
    event there (phase/clock.py): a host-only drafter's draft (1) and maintenance (5), a target
    whose rollback only moves its cache's length (4), and the accept's end (3) when the clock
    covers one stream (the accept's readback has just run it dry)."""
    if not marks:
        return set()
    quiet = {1, 5} if getattr(drafter, "host_only", False) else set()
    if getattr(target, "rollback_on_host", False):
        quiet.add(4)
    if len(marks) == 1:
        quiet.add(3)
    return quiet


def session_clock(target, drafter, trace, free_mb: Callable[[], dict[str, int]]) -> PhaseClock:
    """A speculative session's clock: the target's stream, and the drafter's where it sits on
    a device of its own; timing events where every stream has them (`stream_marks_of`), with
    the quiet boundaries of this target and drafter. A batched request with a host drafter
    (`target.synchronous`: each forward returns with its step read back) drains nothing: no
    other phase of its round touches the device, so the host's stamps are the boundaries, and a
    drain would wait for the other requests' steps on the shared stream (mode `host`)."""
    engines = [(target.drain, target)]
    if drafter.device is not None and drafter.device != getattr(target, "device", None):
        engines.append((drafter.drain, getattr(drafter, "runner", None)))  # a drafter on its own device
    marks = stream_marks_of(trace, [e for _, e in engines])
    drains = [d for d, _ in engines]
    if getattr(target, "synchronous", False) and getattr(drafter, "host_only", False) and not trace.prof:
        drains = []
    return PhaseClock(drains, free_mb, marks, quiet_boundaries(drafter, target, marks))
