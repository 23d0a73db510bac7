"""Slots of a fixed pool handed to owners (a batched engine's requests), one each until given
back: the bookkeeping the draft-cache pool (specdec/drafters/draft_pool.py) and the tap pool
(model/tap_pool.py) share. Thread-safe: requests' threads take and give at once."""

from __future__ import annotations

import threading

__all__ = ["OwnerSlots"]


class OwnerSlots:
    def __init__(self, n: int):
        self._free = list(range(n))
        self._held: dict[int, int] = {}  # id(owner) -> slot
        self._lock = threading.Lock()

    def take(self, owner) -> int | None:
        """`owner`'s slot (the same one while it holds it; the lowest free one first), or None
        when every slot is held."""
        with self._lock:
            s = self._held.get(id(owner))
            if s is None and self._free:
                s = self._held[id(owner)] = self._free.pop(0)
            return s

    def give(self, owner) -> None:
        """`owner`'s slot back; a no-op for one that holds none."""
        with self._lock:
            s = self._held.pop(id(owner), None)
            if s is not None:
                self._free.append(s)

    @property
    def held(self) -> int:
        return len(self._held)
