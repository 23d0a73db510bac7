"""A job's worker threads and the signals that stop it.

The main thread waits for the workers in short waits, so Ctrl-C or SIGTERM (its handler
raises KeyboardInterrupt) reaches it at once, and then waits for them again before the
engine closes: no worker may be left running torch code while the interpreter exits (a
daemon thread inside a torch call at exit aborts the process: "terminate called without an
active exception").

The waits are on each worker's own `done` event, never `Thread.join`: on Python < 3.13 a
KeyboardInterrupt that lands inside `join(timeout)` while the thread still runs marks the
thread stopped (threading's bpo-45274 branch: it releases the lock the running thread holds),
and every later `join` returns at once with the worker still running.

`signals_held`: SIGINT / SIGTERM wait until a block is done (a results line written whole,
a worker started and counted)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from contextlib import contextmanager

__all__ = ["Workers", "signals_held"]

_HELD = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def signals_held():
    """SIGINT / SIGTERM wait until the block is done, then go to the handlers they would have
    met (Ctrl-C's KeyboardInterrupt comes right after). Python-level handlers, not a thread's
    signal mask: a signal sent to the process reaches whichever thread does not block it
    (torch has many). Outside the main thread (where handlers cannot be set) it holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    prev: dict[int, object] = {}
    try:
        for s in _HELD:
            prev[s] = signal.signal(s, lambda signum, frame: got.append(signum))
        yield
    finally:
        for s, h in prev.items():
            signal.signal(s, h)
        for s in dict.fromkeys(got):
            h = prev.get(s)
            if callable(h):
                h(s, None)  # Python's own SIGINT handler raises KeyboardInterrupt here
            elif h == signal.SIG_DFL:
                signal.raise_signal(s)


class Workers:
    """Daemon threads running `target(thread)`; each keeps what it raised on `thread.error`
    (None when it returned). `wait` is interruptible (short waits); `finish` waits for every
    started worker to return, whatever interrupted `wait`."""

    def __init__(self, poll_s: float = 0.2):
        self.threads: list[threading.Thread] = []
        self.poll_s = poll_s

    def start(self, target: Callable[[threading.Thread], None], name: str) -> threading.Thread:
        done = threading.Event()

        def run() -> None:
            me = threading.current_thread()
            try:
                target(me)
            except BaseException as e:  # noqa: BLE001 (kept for the main thread)
                me.error = e
            finally:
                done.set()

        t = threading.Thread(target=run, name=name, daemon=True)
        t.error, t.done = None, done
        with signals_held():  # started and counted, or neither
            t.start()
            self.threads.append(t)
        return t

    def wait(self) -> None:
        """Until every worker has returned, in waits of `poll_s` (a signal's handler runs
        between them)."""
        for t in self.threads:
            while not t.done.wait(self.poll_s):
                pass

    def finish(self) -> None:
        """Until every started worker has returned (after an interrupt too)."""
        for t in self.threads:
            t.done.wait()

    def first_error(self) -> BaseException | None:
        return next((t.error for t in self.threads if t.error is not None), None)
