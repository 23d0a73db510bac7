"""Each batch step's span ids, and which steps' spans are made (pure: no tensors, no tracing).

A step serves many requests, each in its own trace, so the step is a span of its own trace
(`batch.step`) and every request's round that rode in it links to it (an OpenTelemetry span
link, tracing/emit.py). The loop gives the step its ids when it ends (`new`: two random ints
from the batcher's own generator, no global state); whichever request's span sink builds a
round of the step first makes the step's span (`claim`), so it is made once, and only when a
traced request rode the step (level 0 makes none).

>>> ids = StepIds(seed=1)
>>> t, s = ids.new()
>>> 0 < t < 2**128 and 0 < s < 2**64
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
        self._rng = random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
        self._made: dict[int, None] = {}
        self._lock = threading.Lock()

    def new(self) -> tuple[int, int]:
        """(trace id, span id) for a step: nonzero, as W3C trace context requires."""
        return self._rng.getrandbits(128) or 1, self._rng.getrandbits(64) or 1

    def __getstate__(self):
        """A copy (a step's record pickled to another process: the driver's lines at pp > 1)
        makes no step span: the engine's process does."""
        return {"detached": True}

    def __setstate__(self, state) -> None:
        self._rng, self._made, self._lock = None, None, None

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
