"""Where the device waits for the engine loop between two steps, read from CUDA events.

The loop's `gap_ms` (stats.py) is host time, from a step's end to the next one's launch; it is
not the device's idle: a shared draft forward left on the device (dflash_pool_graph.py
DeviceDrafts) runs inside it. Here each step read back opens a record, and its events say what
the device did after it:
  ready     the step's readback copy done (the device's last work for it: ahead.py stage_readback),
            or, where rounds' maintenance was queued behind it (chain_drafts.py pre_maintain), that
            maintenance done
  drafting  recorded just before the next drafting's first launch (its maintenance), where the
            settled rounds draft on the device (loop_rounds.py)
  drafted   recorded behind the drafting's last launch: on the device it fires when the drafts are
            done
  verify    recorded just before the next step's forward is launched (step_forward.py)
-> idle after the step: ready -> the first of drafting / verify (the loop's rounds: acceptance,
commit, the drafters' host work before their first launch); idle before the verify: drafted ->
verify where positive (the loop still packing the verify when the draft was done; 0 where the
verify was queued behind the draft). An event recorded on an idle stream fires when it is
recorded, so each interval is the host's delay while the device had nothing queued. A record is
read once a later readback has passed its events. A step launched one step ahead (ahead.py) has
nothing between, and opens no record. New requests' drafters primed between two steps (primes.py)
run inside the first interval and count as idle there. Off CUDA no event is made and nothing is
counted.
"""

from __future__ import annotations

from collections import deque

__all__ = ["DeviceIdle"]


class DeviceIdle:
    """The counters (ns, and the steps they cover) and the record of the step last read back."""

    KEEP = 4096  # each step's own intervals kept for the medians (the last ones)

    def __init__(self):
        self.after_ns = 0.0
        self.before_verify_ns = 0.0
        self.steps = 0
        # each step's (after, before the verify), ns: a run's first steps (admissions, primes)
        # weigh on the means; the medians are a step of the steady run
        self.each: deque = deque(maxlen=self.KEEP)
        self._open: list | None = None  # [ready, drafting, drafted]
        self._closed: list = []  # [ready, drafting, drafted, verify]: read at the next readback

    def ready(self, ev) -> None:
        """The step just read back, its readback's event `ev` (None: no record, as for a step
        launched ahead of it, or off CUDA)."""
        self._open = [ev, None, None] if ev is not None else None

    def drafting(self, ev) -> None:
        if self._open is not None and self._open[1] is None and ev is not None:
            self._open[1] = ev

    def drafted(self, ev) -> None:
        if self._open is not None and self._open[1] is not None and ev is not None:
            self._open[2] = ev

    def verify(self, ev) -> None:
        """The next forward about to be launched: the open record closes."""
        if self._open is not None and ev is not None:
            self._closed.append((*self._open, ev))
        self._open = None

    def fold(self) -> None:
        """Called once a readback is done (every event recorded before it has fired): the closed
        records into the counters.

        >>> class Ev:
        ...     def __init__(self, ms): self.ms = ms
        ...     def elapsed_time(self, other): return other.ms - self.ms
        >>> d = DeviceIdle()
        >>> d.ready(Ev(10.0)); d.drafting(Ev(11.5)); d.drafted(Ev(15.0)); d.verify(Ev(14.0)); d.fold()
        >>> d.after_ns, d.before_verify_ns, d.steps
        (1500000.0, 0.0, 1)
        >>> d.ready(Ev(30.0)); d.verify(Ev(30.25)); d.fold()  # no drafting on the device
        >>> d.after_ns, d.steps
        (1750000.0, 2)
        >>> d.ready(Ev(40.0)); d.drafting(Ev(41.0)); d.drafted(Ev(43.0)); d.verify(Ev(43.5)); d.fold()
        >>> d.after_ns, d.before_verify_ns, d.steps
        (2750000.0, 500000.0, 3)
        >>> d.ready(None); d.verify(Ev(50.0)); d.fold(); d.steps  # launched ahead: nothing between
        3
        >>> d.as_dict()["device_idle_after_step_p50_ms"], d.as_dict()["device_idle_before_verify_p50_ms"]
        (1.0, 0.0)
        """
        closed, self._closed = self._closed, []
        for ready, drafting, drafted, verify in closed:
            try:  # (a diagnostic: an event it cannot read skips the record, never the step)
                after = ready.elapsed_time(drafting if drafting is not None else verify)
                before = drafted.elapsed_time(verify) if drafted is not None else 0.0
            except RuntimeError:
                continue
            after, before = max(0.0, after * 1e6), max(0.0, before * 1e6)
            self.after_ns += after
            self.before_verify_ns += before
            self.steps += 1
            self.each.append((after, before))

    def as_dict(self) -> dict:
        """Per step measured (ms), and the steps."""
        n = self.steps
        mid = [sorted(x)[len(x) // 2] / 1e6 for x in zip(*self.each)] if self.each else [None, None]
        return {"device_idle_steps": n,
                "device_idle_after_step_ms": round(self.after_ns / n / 1e6, 3) if n else None,
                "device_idle_before_verify_ms": round(self.before_verify_ns / n / 1e6, 3) if n else None,
                "device_idle_after_step_p50_ms": round(mid[0], 3) if mid[0] is not None else None,
                "device_idle_before_verify_p50_ms": round(mid[1], 3) if mid[1] is not None else None}
