"""The Ray actors of the ppN split. Plain classes here; pipeline/driver.py wraps them with
`ray.remote` and places them (one GPU each). Models know nothing of parallelism: an actor
is a ModelRunner over its layer range plus a Link into the ring.

- StageWorker (ranks 1..N-1, stages 0..N-2): `serve()` runs a loop of commands received
  over torch.distributed until END; no Ray call per round.
- HeadWorker (rank 0): the last stage's layers + final norm, lm_head, sampling, acceptance,
  the drafter and the session. Co-locating the head with the last stage saves one hop per
  forward and keeps one rank per GPU (NCCL refuses two ranks of a group on one device).
  It runs the same `specdec.request.Request` an in-process run does, over the head target
  (pipeline/head_target.py); the driver calls `start` once, `burst` per burst (tokens and
  records come back at burst cadence), `finish` once.

The stage loop is written around one command queue per actor, so several sessions could
later be in flight across the stages (a full pipeline) by tagging commands with a session
id; today one session keeps one stage busy at a time.
"""

from __future__ import annotations

import os
import threading
import time

import torch

from ..device import actor_device, free_mb, resolve_dtype
from ..phase.subsplit import SUB_BUCKETS, SubsplitTimer
from ..runner import ModelRunner
from .actor_tracing import ActorTracing
from .head_target import PipelineTarget
from .transport import Flag, Link, Op, free_port

__all__ = ["StageWorker", "HeadWorker"]


class _Worker:
    role = "stage"

    def __init__(self, plan, rank: int, world: int, stage: int, run_dir: str | None):
        cfg = plan.cfg
        self.plan, self.cfg, self.rank, self.stage = plan, cfg, rank, stage
        self.device, label = actor_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, self.device)
        first, last = plan.stages[stage]
        self.runner = ModelRunner(cfg.model, self.device, dtype, first, last, has_embed=first == 0,
                                  has_head=self.role == "head", cfg=plan.model, max_pos=plan.capacity,
                                  **cfg.runner_kwargs(self.device))
        self.runner.label = label
        self.link = Link(rank, world, self.device)
        self.tracing = ActorTracing(self.role, stage, run_dir, cfg.trace.clock_on)
        self.carriers: list[dict] = []  # each request's W3C context, by request index
        self.req = -1  # the request the forwards now belong to
        self.records: list[tuple] = []  # this actor's stage.forward records (traced forwards)
        self.loop_done = threading.Event()  # the serve loop (stage) / the request (head) has ended
        self.closed = False

    def address(self) -> tuple[str, int]:
        return free_port()

    def connect(self, addr: str, port: int, timeout_s: float) -> int:
        self.link.connect(addr, port, timeout_s)
        return os.getpid()

    def close(self, wait_s: float) -> dict:
        """Flush this actor's spans and write its run-dir file; called by the driver in the
        `control` concurrency group, so it runs even while a serve loop or a burst is busy.
        Waits up to `wait_s` for the work in flight to end (a stage: its serve loop, which the
        head's END stops; the head: the burst in progress, then END to the stages), then
        turns every record made so far into spans. Returns what it made and lost."""
        self.closed = True
        self._stop(wait_s)
        self.tracing.stage_spans(self.carriers, self.records)
        made = self.span_count()
        lost = self.tracing.close(self._extra_spans())
        if self.loop_done.is_set():
            self.link.close()  # a loop still blocked in a receive keeps the group; the actor is killed next
        return {"role": self.role, "stage": self.stage, "rank": self.rank, "made": made, "lost": lost}

    def begin_request(self, carrier: dict) -> int:
        """The next request's trace context (called by the driver, in the control group,
        before the head starts that request); returns its index."""
        self.carriers.append(carrier)
        return len(self.carriers) - 1

    def span_count(self) -> int:
        """Spans made so far (cheap: the driver asks when a close runs past its bound)."""
        return self.tracing.made + self._extra_spans()

    def _stop(self, wait_s: float) -> None:
        self.loop_done.wait(wait_s)

    def _extra_spans(self) -> int:
        return 0


class StageWorker(_Worker):
    role = "stage"

    def serve(self) -> int:
        """Run commands until END, over any number of requests (each begins with ALLOC, whose
        argument is the request's index). Returns the forwards served."""
        link, run = self.link, self.runner
        records, served = self.records, 0
        try:
            served = self._serve_loop(link, run, records)
        finally:
            self.loop_done.set()
        self.tracing.stage_spans(self.carriers, records)
        return served

    def _serve_loop(self, link, run, records) -> int:
        served = 0
        while True:
            op, start, rows, flags, arg = link.recv_cmd()
            if link.next != 0:
                link.forward_cmd()  # ahead of the payload: the next stage posts its receive
            if op == Op.FORWARD:
                if run.length > start:  # the round's rollback, carried by this forward's start
                    run.rollback(start)
                served += self._forward(start, rows, flags, arg, records)
            elif op == Op.ALLOC:
                run.alloc(start)
                self.req = arg
            elif op == Op.END:
                return served

    def _forward(self, start, rows, flags, rnd, records) -> int:
        link, run = self.link, self.runner
        if not run.stage.has_embed:
            x = link.recv((rows, run.cfg.hidden_size), run.dtype)
        elif flags & Flag.INLINE:
            x = link.cmd_ids(rows)
        else:
            x = link.recv((rows,), torch.long)
        timer = SubsplitTimer(run.drain) if flags & Flag.TIMED else None
        if flags & Flag.TRACED:
            run.drain()
            t0 = time.perf_counter_ns()
        h = run.forward(x, start, timer)
        if flags & Flag.TRACED:
            run.drain()
            records.append((t0, time.perf_counter_ns(), start, rows, rnd, free_mb(self.device), run.label, self.req))
        link.send(h)
        if timer is not None:
            sub = link.recv((len(SUB_BUCKETS),), torch.long) if self.rank > 1 else torch.zeros(
                len(SUB_BUCKETS), dtype=torch.long, device=self.device)
            ns, _rows = timer.take()
            sub += torch.tensor([ns[b] for b in SUB_BUCKETS], device=self.device)
            link.send(sub)
        return 1


class HeadWorker(_Worker):
    role = "head"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.busy = threading.Lock()  # held by start / burst / finish; close waits for it
        self.request = None
        self._spans = None  # the current request's span sink
        self._spans_done = 0  # spans built for the requests before it
        self.failed = False  # a forward raised (a dead peer): no END is sent into the ring

    def start(self, carrier: dict, prompt: list[int], plan=None) -> tuple[int, bool]:
        """Build a request's session over the head target (the pipeline stays up between
        requests; `plan` is the request's, default the pipeline's); (first token, done)."""
        from ..specdec.request import Request  # noqa: PLC0415
        from ..tracing.deferred import DeferredSink  # noqa: PLC0415
        from ..tracing.emit import SpanSink  # noqa: PLC0415

        with self.busy:
            self._finish_spans()
            self.carriers.append(carrier)
            req = len(self.carriers) - 1
            self.target = PipelineTarget(self.link, self.runner, traced=self.cfg.trace.level >= 1,
                                         records=self.records, request=req)
            if self.tracing.enabled:
                self._spans = DeferredSink(SpanSink(self.tracing.tracer, self.tracing.parent(carrier), {}))
            self.request = Request(self.target, plan or self.plan, prompt, self._spans)
            first = self._guarded(self.request.start)
            return first, self.request.done

    def burst(self):
        """The next burst's BurstOut; after the request ended (or the actor was closed), an empty one."""
        from ..specdec.request import BurstOut  # noqa: PLC0415

        with self.busy:
            if self.closed or self.request.done:
                return BurstOut([], True)
            return self._guarded(self.request.burst)

    def _guarded(self, fn):
        try:
            return fn()
        except BaseException:
            self.failed = True
            raise

    def finish(self) -> dict:
        """The request's stats, its spans built; the stages stay up for the next request."""
        with self.busy:
            self._finish_spans()
            return self.request.finish()

    def _finish_spans(self) -> None:
        if self._spans is not None:
            self._spans.close()  # every queued span of this request built
            self._spans_done += self._spans.count
            self._spans = None

    def _end(self) -> None:
        """END to the stages (their serve loops return), every queued span built."""
        if self.loop_done.is_set():
            return
        self.loop_done.set()
        if self.request is not None and not self.failed:
            self.target.end()
        self._finish_spans()

    def _stop(self, wait_s: float) -> None:
        if self.busy.acquire(timeout=wait_s):  # the burst in progress ends first
            try:
                self._end()
            finally:
                self.busy.release()
        elif self._spans is not None:  # a burst stuck on a dead peer: build what is queued anyway
            self._spans.close()

    def _extra_spans(self) -> int:
        return self._spans_done + (self._spans.count if self._spans is not None else 0)
