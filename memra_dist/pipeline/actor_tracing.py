"""Tracing inside an actor: its own provider (resource memra.role), the driver's W3C context
as parent, stage-forward records turned into spans (at the end of a request, or at close
for the forwards run so far), and a bounded flush before teardown (a BatchSpanProcessor
loses buffered spans on ray.kill). Emission is guarded by a lock: the serve loop's thread
and the close call's thread may both get there."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..tracing.conventions import ATTR, SPAN_STAGE_FORWARD, free_mb_attr
from ..tracing.otel import flush_timeout_s, make_provider, quick_gil_handoff, shutdown_bounded

__all__ = ["ActorTracing"]


class ActorTracing:
    def __init__(self, role: str, stage: int, run_dir: str | None, enabled: bool):
        self.enabled = enabled
        self.stage = stage
        if enabled:
            quick_gil_handoff()  # the actor's process is ours: left lowered until it exits
            stem = f"{role}{stage}-"
            self.provider, self.counting, self.files = make_provider(role, Path(run_dir) if run_dir else None, stem)
            self.tracer = self.provider.get_tracer("memra_dist")
        # (spans made or being built, records of the list taken for spans): one tuple, so a
        # reader on another thread (the driver's count at its close bound) never sees a build
        # half-counted
        self._tally = (0, 0)
        self.offset = time.time_ns() - time.perf_counter_ns()
        self._emit_lock = threading.Lock()

    @property
    def made(self) -> int:
        return self._tally[0]

    @staticmethod
    def parent(carrier: dict):
        return TraceContextTextMapPropagator().extract(carrier or {})

    def stage_spans(self, carriers: dict[int, dict], records: list[tuple]) -> None:
        """records: (t0_ns, t1_ns, start, rows, round, free_mb, label, request, slot) per
        forward, `request` keying `carriers` (each request's W3C context: its own trace) and
        `slot` the session's cache slot (sessions in flight interleave); a batched pipeline's
        step (pipeline/batch_stage.py) adds its attributes (the step's id, requests and rows:
        phase "batch"), under the trace of its first request. Only the records not yet emitted
        become spans (a later call with the same, longer list adds the rest)."""
        if not self.enabled:
            return
        with self._emit_lock:  # held while building: a second caller waits, then finds nothing left
            made, emitted = self._tally
            todo = records[emitted:]
            self._tally = (made + len(todo), len(records))  # at stake from here, built or not
            parents: dict[int, object] = {}
            for t0, t1, start, rows, rnd, mb, label, req, slot, *batch in todo:
                if req not in parents:
                    parents[req] = self.parent(carriers.get(req, {}))
                attrs = {ATTR["stage"]: self.stage, ATTR["rows"]: rows, free_mb_attr(label): mb}
                if batch:
                    attrs.update(batch[0], **{ATTR["phase"]: "batch"})
                else:
                    attrs.update({ATTR["session"]: slot, ATTR["ctx"]: start, ATTR["round"]: rnd,
                                  ATTR["phase"]: "verify" if rnd >= 0 else "prime"})
                s = self.tracer.start_span(SPAN_STAGE_FORWARD, context=parents[req], start_time=t0 + self.offset,
                                           attributes=attrs)
                s.end(end_time=t1 + self.offset)

    def at_stake(self, records: list) -> int:
        """Spans made or being built, plus the recorded forwards not yet taken for spans
        (spans all the same); safe to call while another thread builds."""
        made, emitted = self._tally
        return made + (len(records) - emitted if self.enabled else 0)

    def close(self, extra_made: int = 0) -> int:
        """Flush within the bound, then write the run-dir file; returns spans not delivered."""
        if not self.enabled:
            return 0
        return shutdown_bounded(self.provider, self.counting, self.made + extra_made, flush_timeout_s())
