"""Each batch step's span ids, and which steps' spans are made (pure: no tensors, no tracing).

A step serves many requests, each in its own trace, so the step is a span of its own trace
(`batch.step`) and every request's round that rode in it links to it (an OpenTelemetry span
link, tracing/emit.py). A step's ids derive from its number and two random bases the engine
draws once (`ids`: nothing is done per step, no global randomness); whichever request's span sink builds a
round of the step first makes the step's span (`claim`), so it is made once, and only when a
traced request rode the step (level 0 makes none).

>>> ids = StepIds(seed=1)
>>> t, s = ids.ids(7)
>>> 0 < t < 2**128 and 0 < s < 2**64 and ids.ids(7) == (t, s) != ids.ids(8)
True
>>> ids.claim(7), ids.claim(7), ids.claim(8)
(True, False, True)
"""

from __future__ import annotations

import os
import random
import threading

__all__ = ["StepIds"]

KEEP = 1 << 16  # claimed steps remembered (a step's rounds are built within a few bursts of it)


class StepIds:
    def __init__(self, seed: int | None = None):
        rng = random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
        self._base = (rng.getrandbits(128), rng.getrandbits(64))
        self._made: dict[int, None] = {}
        self._lock = threading.Lock()

    def ids(self, step: int) -> tuple[int, int]:
        """(trace id, span id) of step `step`: nonzero, as W3C trace context requires."""
        return (self._base[0] + step) % 2**128 or 1, (self._base[1] + step) % 2**64 or 1

    def __getstate__(self):
        """A copy (a step's record pickled to another process: the driver's lines at pp > 1)
        keeps the ids but makes no step span: the engine's process does."""
        return {"base": self._base}

    def __setstate__(self, state) -> None:
        self._base, self._made, self._lock = state["base"], None, None

    def claim(self, step: int) -> bool:
        """True once per step: the caller makes its span (never on a pickled copy).

        >>> import pickle
        >>> pickle.loads(pickle.dumps(StepIds(seed=1))).claim(7)
        False
        """
        if self._lock is None:
            return False
        with self._lock:
            if step in self._made:
                return False
            self._made[step] = None
            if len(self._made) > KEEP:
                del self._made[next(iter(self._made))]
            return True
