"""Span building off the generation's path: the SDK costs 15-50 us a span, six or more spans
a round, so building them inline between bursts would stall the next burst. Records are
handed to one daemon thread through a queue (the session gives each burst a fresh record,
so nothing is copied); the thread turns them into spans while the main thread waits on
the device. `flush()` drains the queue before the request span ends and the provider
shuts down, so no span is lost on a normal exit or Ctrl-C."""

from __future__ import annotations

import queue
import threading

__all__ = ["BackgroundSink"]

_STOP = object()


class BackgroundSink:
    def __init__(self, inner):
        self.inner = inner
        self.q: queue.Queue = queue.Queue()
        self.t = threading.Thread(target=self._run, name="memra-span-emitter", daemon=True)
        self.t.start()

    @property
    def count(self) -> int:
        return self.inner.count

    def _run(self) -> None:
        while True:
            item = self.q.get()
            try:
                if item is _STOP:
                    return
                name, args = item
                try:
                    getattr(self.inner, name)(*args)
                except Exception:  # noqa: BLE001 (a tracing bug must never take the run down)
                    pass
            finally:
                self.q.task_done()

    def burst(self, rec) -> None:
        self.q.put(("burst", (rec,)))

    def first_token(self, prof) -> None:
        self.q.put(("first_token", (prof,)))

    def rounds(self, log, final: bool) -> None:
        pass  # the span sink ignores the depth log; the line sink prints it synchronously

    def flush(self) -> None:
        """Wait until every queued record has become spans."""
        self.q.join()

    def close(self) -> None:
        self.flush()
        self.q.put(_STOP)
        self.t.join(timeout=5)
