"""Who runs now, who waits, who is turned away: S engine sessions and a queue of at most Q
requests, on one asyncio event loop (the server's).

    adm = Admission(sessions=2, max_queue=4)
    ticket = adm.enter()          # QueueFull at once when S run and Q wait (-> HTTP 429)
    await ticket.wait()           # returns when one of the S sessions is this request's
    ...                           # run it
    adm.release()                 # when the engine has freed the session (not before)

A session goes to the longest waiter first. A waiter that gives up (its client went away,
so its task is cancelled) leaves the queue; one cancelled just as a session was handed to it
passes the session on."""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["Admission", "QueueFull", "Ticket"]


class QueueFull(Exception):
    pass


class Ticket:
    def __init__(self, adm: "Admission", fut: asyncio.Future | None):
        self._adm, self._fut = adm, fut  # fut None: the session was free at once

    async def wait(self) -> None:
        if self._fut is None:
            return
        try:
            await self._fut
        except asyncio.CancelledError:
            if self._fut.done() and not self._fut.cancelled():
                self._adm.release()  # handed a session in the same instant: pass it on
            else:
                self._fut.cancel()
                self._adm._drop(self._fut)
            raise


class Admission:
    def __init__(self, sessions: int, max_queue: int):
        if sessions < 1 or max_queue < 0:
            raise ValueError("sessions >= 1 and max_queue >= 0")
        self.sessions, self.max_queue = sessions, max_queue
        self.active = 0  # sessions held (a request running, or an aborted one still unwinding)
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def enter(self) -> Ticket:
        """A place: a session now, or one in the queue; QueueFull when the queue is full."""
        if self.active < self.sessions and not self._waiters:
            self.active += 1
            return Ticket(self, None)
        if len(self._waiters) >= self.max_queue:
            raise QueueFull(f"all {self.sessions} session(s) are busy and {len(self._waiters)} request(s) are "
                            f"queued (the most this server queues, --max-queue {self.max_queue}); retry later")
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return Ticket(self, fut)

    def release(self) -> None:
        """A session is free again: the oldest waiter gets it, else it goes back to the pool."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.active -= 1

    def _drop(self, fut: asyncio.Future) -> None:
        try:
            self._waiters.remove(fut)
        except ValueError:
            pass
