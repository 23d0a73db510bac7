"""Who gets the next of the batched engine's B request slots: longest cached prefix first,
within a fairness bound.

A request waits here before it takes any block. When a slot frees, the waiting request whose
prompt has the most leading blocks in the prefix cache goes first (SGLang's longest-prefix-match
policy): it is admitted while those blocks are still cached, before the LRU evicts them for
unrelated prompts, and its prefill skips them. Arrival order breaks ties, so with the cache off
(every count 0) this is first come, first served. A request that later arrivals have gone ahead
of `max_passes` times goes next whatever the counts, so a prompt nobody shares is never starved
by a stream of ones that share.

`pick` is the rule alone (pure, tested on its own); `Admission` the slots and their waiters.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable

__all__ = ["Admission", "pick", "MAX_PASSES"]

MAX_PASSES = 8  # later arrivals admitted ahead of a waiting request before it goes next


def pick(waiting: list[tuple[int, int, int]], max_passes: int = MAX_PASSES) -> int:
    """The index of the request to admit among `waiting` = [(arrival, cached blocks, passes)]:
    the earliest one passed over `max_passes` times, else the most cached blocks (the earliest
    of those).

    >>> pick([(0, 0, 0), (1, 5, 0), (2, 5, 0)])
    1
    >>> pick([(0, 0, 8), (1, 5, 0)])
    0
    >>> pick([(3, 0, 0), (4, 0, 0)])
    0
    """
    starved = [i for i, (_, _, passes) in enumerate(waiting) if passes >= max_passes]
    if starved:
        return min(starved, key=lambda i: waiting[i][0])
    return min(range(len(waiting)), key=lambda i: (-waiting[i][1], waiting[i][0]))


class _Waiter:
    __slots__ = ("arrival", "hits", "passes", "granted")

    def __init__(self, arrival: int, hits: Callable[[], int]):
        self.arrival, self.hits, self.passes, self.granted = arrival, hits, 0, False


class Admission:
    """`slots` requests in at once; `enter(hits)` waits for one (hits(): the request's cached
    leading blocks now, read whenever a slot is given out)."""

    def __init__(self, slots: int, max_passes: int = MAX_PASSES):
        self.free, self.max_passes = slots, max_passes
        self.cv = threading.Condition()
        self.waiting: list[_Waiter] = []
        self._arrivals = 0
        self.ahead = 0  # admissions that went ahead of an earlier arrival (their prefix was cached)

    @contextmanager
    def enter(self, hits: Callable[[], int] = lambda: 0):
        with self.cv:
            w = _Waiter(self._arrivals, hits)
            self._arrivals += 1
            self.waiting.append(w)
            try:
                self._grant()
                while not w.granted:
                    self.cv.wait()
            except BaseException:  # (interrupted while waiting: its place, or its slot, given back)
                if w.granted:
                    self.free += 1
                else:
                    self.waiting.remove(w)
                self._grant()
                raise
        try:
            yield
        finally:
            with self.cv:
                self.free += 1
                self._grant()

    def _grant(self) -> None:
        """Called holding the condition: free slots to the waiters `pick` names."""
        granted = False
        while self.free > 0 and self.waiting:
            # (one waiter, the uncontended case: no choice, so no lookup of cached blocks under the engine's lock)
            i = 0 if len(self.waiting) == 1 else pick([(w.arrival, w.hits(), w.passes) for w in self.waiting],
                                                      self.max_passes)
            w = self.waiting.pop(i)
            passed = [o for o in self.waiting if o.arrival < w.arrival]
            for o in passed:
                o.passes += 1
            self.ahead += bool(passed)
            w.granted, granted = True, True
            self.free -= 1
        if granted:
            self.cv.notify_all()
