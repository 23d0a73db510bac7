"""A traced round's boundaries where the loop's device work ends, read from timing events instead
of draining the stream (pure: any event with `synchronize` and `elapsed_time` in ms).

A round the loop runs (chain.py) is stamped on the host. Where its drafter works on the device
(DFlash's ingest, a tap drafter's shared draft forward), the stamp after that work must not come
before the device finished it, or the work's time lands in the next phase: a traced round used to
drain the stream there (the device then idled while the loop launched what came next). Here the
loop records an event behind that work instead and goes on; the boundary is the later of the
host's stamp and the moment the stream reached the event, placed on the host's clock by the
step's readback (`anchor`: the host's time when the readback's wait returned, and the readback's
event, which the stream reached just before). The request's thread resolves it when it records
the round, by then in the shadow of later steps (a wait there holds no step).

>>> class Ev:
...     def __init__(self, ms): self.ms = ms
...     def synchronize(self): pass
...     def elapsed_time(self, other): return other.ms - self.ms
>>> anchor = (1_000_000, Ev(5.0))
>>> LateStamp(Ev(5.3), anchor).at(1_100_000)  # the device ended 0.3 ms after the readback
1300000
>>> LateStamp(Ev(5.05), anchor).at(1_100_000)  # it ended before the host's stamp
1100000
>>> monotone([10, 40, 30, 50, 45, 60])
[10, 40, 40, 50, 50, 60]
>>> monotone([10, 40, 30, 50, 45, 60], floor=42)  # the round before ended at 42
[42, 42, 42, 50, 50, 60]
"""

from __future__ import annotations

__all__ = ["LateStamp", "monotone"]


class LateStamp:
    __slots__ = ("ev", "anchor")

    def __init__(self, ev, anchor: tuple[int, object]):
        self.ev, self.anchor = ev, anchor

    def at(self, host_ns: int) -> int:
        """The boundary: the later of `host_ns` and the event's time on the host's clock."""
        self.ev.synchronize()
        h, a = self.anchor
        return max(host_ns, h + round(a.elapsed_time(self.ev) * 1e6))


def monotone(t: list[int], floor: int = 0) -> list[int]:
    """Boundaries in clock order: each at least the one before (a late boundary pushes the next),
    the first at least `floor` (the round before's end)."""
    if t and t[0] < floor:
        t[0] = floor
    for i in range(1, len(t)):
        if t[i] < t[i - 1]:
            t[i] = t[i - 1]
    return t
