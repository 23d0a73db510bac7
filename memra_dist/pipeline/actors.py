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

Sessions in flight: the head runs up to S sessions at once (one thread each, `prepare`),
and every stage keeps one cache slot per session (a runner view over the same weights,
`ModelRunner.slot_view`); a command names its slot. While stage 0 runs session a's forward,
the head runs session b's last stage, acceptance and drafting: every stage stays busy. The
head's `Ring` (pipeline/ring.py) keeps each session's results its own. A driver call for a
session carries a sequence number, so a threaded actor runs that session's calls in the
order they were made.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager, nullcontext

import torch

from ..device import actor_device, free_mb, resolve_dtype
from ..model.taps import shipped_before, stage_taps
from ..phase.subsplit import SUB_BUCKETS, SubsplitTimer
from ..runner import ModelRunner
from ..specdec.drafters import TAP_DRAFTERS, tap_layers
from .actor_tracing import ActorTracing
from .batch_stage import BATCH_OPS, StageBatch
from .head_target import PipelineTarget
from .ring import Ring
from .transport import Flag, Link, Op

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
        taps = tap_layers(cfg, plan)  # a drafter reading the target's hidden states (DFlash, MTP)
        if taps:
            self.runner.keep_taps(taps)
        # tap columns (each H wide) arriving behind a forward's input rows / leaving behind its output
        self.remote_taps = shipped_before(taps, plan.stages, stage)
        self.own_taps = stage_taps(taps, plan.stages, stage)
        self.taps_out = len(self.remote_taps) + len(self.own_taps)
        self.batch = None  # a batched pipeline's part of this stage (batch_stage.py / batch_head.py)
        self.link = Link(rank, world, self.device)
        self.tracing = ActorTracing(self.role, stage, run_dir, cfg.trace.clock_on)
        self.carriers: dict[int, dict] = {}  # each request's W3C context, by request index
        self.views = {0: self.runner}  # a runner per cache slot (slot 0: the runner itself)
        self.slot_req: dict[int, int] = {}  # the request each slot's forwards now belong to
        self.records: list[tuple] = []  # this actor's stage.forward records (traced forwards)
        self.loop_done = threading.Event()  # the serve loop (stage) / the request (head) has ended
        self.closed = False

    def address(self) -> tuple[str, int]:
        """Rank 0: the store's socket, bound to this node's Ray address (transport.Link.listen)."""
        return self.link.listen()

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

    def begin_request(self, index: int, carrier: dict) -> None:
        """A request's trace context, by the index the driver gave it (called in the control
        group before the head starts that request)."""
        self.carriers[index] = carrier

    def view(self, slot: int) -> ModelRunner:
        """The runner of a cache slot (made on first use: the same weights, its own cache)."""
        if slot not in self.views:
            self.views[slot] = self.runner.slot_view()
        return self.views[slot]

    def span_count(self) -> int:
        """Spans made so far, and those its recorded forwards will make (cheap: the driver
        asks when a close runs past its bound, maybe before the close has built them)."""
        return self.tracing.at_stake(self.records) + self._extra_spans()

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
            op, start, rows, flags, arg, slot = link.recv_cmd()
            if link.next != 0:
                link.forward_cmd()  # ahead of the payload: the next stage posts its receive
            if op == Op.FORWARD:
                run = self.views[slot]
                if run.length > start:  # the round's rollback, carried by this forward's start
                    run.rollback(start)
                served += self._forward(run, start, rows, flags, arg, slot, records)
            elif op == Op.ALLOC:
                self.view(slot).alloc(start)
                self.slot_req[slot] = arg
            elif op in BATCH_OPS:  # a batched pipeline's (batch_stage.py): an int64 row follows
                row = link.recv((start,), torch.long)
                if link.next != 0:
                    link.send(row)
                row = row.tolist()
                if op == Op.BATCH_OPEN:
                    self.batch = StageBatch(self, row[0], row[1])
                else:
                    served += self.batch.op(op, row, rows, flags, arg, slot)
            elif op == Op.END:
                return served

    def _forward(self, run, start, rows, flags, rnd, slot, records) -> int:
        link, H = self.link, run.cfg.hidden_size
        up = None
        if not run.stage.has_embed:
            x = link.recv((rows, H), run.dtype)
            if self.remote_taps:  # the earlier stages' taps of these rows ride behind them
                up = link.recv((rows, len(self.remote_taps) * H), run.dtype)
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
            records.append((t0, time.perf_counter_ns(), start, rows, rnd, free_mb(self.device), run.label,
                            self.slot_req.get(slot, -1), slot))
        link.send(h)
        if self.taps_out:  # every tap so far, this stage's appended (positions: the rows')
            pos = torch.arange(start, start + rows, device=self.device)
            mine = run.cache.taps.gather(pos) if run.cache.taps is not None and run.cache.taps.bufs else None
            link.send(mine if up is None else up if mine is None else torch.cat([up, mine], dim=-1))
        if timer is not None:
            sub = link.recv((len(SUB_BUCKETS),), torch.long) if self.rank > 1 else torch.zeros(
                len(SUB_BUCKETS), dtype=torch.long, device=self.device)
            ns, _rows = timer.take()
            sub += torch.tensor([ns[b] for b in SUB_BUCKETS], device=self.device)
            link.send(sub)
        return 1


class _Slot:
    """One session in flight at the head: its runner view, stream, drafter and request, and
    the turn its driver calls take (by sequence number)."""

    def __init__(self, index: int, view: ModelRunner):
        self.index, self.view = index, view
        cuda = view.device.type == "cuda"
        self.stream = torch.cuda.Stream(view.device) if cuda else None  # its phase clock drains only its own work
        self.drafter = None  # a draft model's runner view, kept between requests
        self.target = self.request = self.spans = None
        self.held = None  # a batched pipeline's session context (batch_head.py), left at finish
        self.cv = threading.Condition()
        self.seq = 0  # the sequence number of the call whose turn it is
        self.busy = False

    @contextmanager
    def turn(self, seq: int):
        with self.cv:
            self.cv.wait_for(lambda: self.seq == seq)
            self.busy = True
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
                yield
        finally:
            with self.cv:
                self.seq += 1
                self.busy = False
                self.cv.notify_all()


class HeadWorker(_Worker):
    role = "head"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.runner.tap_all = True  # its sink holds the remote stages' taps too (written from the ring)
        if self.cfg.drafter in TAP_DRAFTERS and not self.runner.stage.has_embed:
            from ..model.loader import load_embedding  # noqa: PLC0415

            # the drafter embeds tokens with the target's table; the head holds the last layers
            self.runner.stage.embed_tokens = load_embedding(self.cfg.model, self.plan.model, self.device,
                                                            self.runner.dtype)
        self.ring = Ring(self.link)
        self.slots: dict[int, _Slot] = {}
        self._spans_done = 0  # spans built for the requests already finished
        self._spans_lock = threading.Lock()
        self.failed = False  # a forward raised (a dead peer): no END is sent into the ring

    def prepare(self, sessions: int, capacity: int, batched: dict | None = None) -> int:
        """S cache slots on every rank, allocated (and their graphs captured) now, before
        any session runs: no capture ever lands beside another session's work. A draft
        model is loaded once; each slot drafts on a view of it. `batched` (max_tokens,
        kv_rows): the S sessions' forwards joined into one step instead (batch_head.py),
        over a paged pool on every rank rather than a cache slot each."""
        if batched is not None:
            from .batch_head import open_batched  # noqa: PLC0415

            self.batch = open_batched(self, sessions, batched.get("max_tokens"), batched.get("kv_rows"))
            for i in range(sessions):
                self.slots[i] = _Slot(i, self.runner)
                self.slots[i].stream = None  # whichever session leads a step launches it: one stream for all
            return sessions
        for i in range(sessions):
            slot = self.slots[i] = _Slot(i, self.view(i))
            self.ring.command(Op.ALLOC, capacity, arg=-1, slot=i)
            slot.view.alloc(capacity)
            if self.cfg.drafter in ("model", *TAP_DRAFTERS):
                slot.drafter = self._draft_view(i)
                slot.drafter.alloc(capacity)
        return sessions

    def _draft_view(self, i: int):
        """Slot i's drafter, loaded once: later slots share the first one's weights (a draft
        model's runner view; a DFlash network) over their own state."""
        from ..specdec.drafters import ModelDrafter, build_drafter  # noqa: PLC0415

        if i > 0 and self.cfg.drafter == "model":
            return ModelDrafter(self.slots[0].drafter.runner.slot_view(), k=self.cfg.k)
        if i > 0 and self.cfg.drafter in TAP_DRAFTERS:  # the network / MTP layers, over this slot's taps
            first = self.slots[0].drafter
            own = getattr(first, "inner", first)  # (--ngram-first wraps the network's drafter)
            d = type(own)(own.head if self.cfg.drafter == "mtp" else own.net, self.slots[i].view)
            if self.cfg.ngram_first:
                from ..specdec.drafters.ngram_first import NgramFirst  # noqa: PLC0415

                d = NgramFirst(d)
            return d
        return build_drafter(self.cfg, self.plan, self.device, self.runner.dtype, 1, target=self.slots[i].view)

    def start(self, slot: int, seq: int, index: int, carrier: dict, prompt: list[int], plan=None) -> tuple[int, bool]:
        """Build request `index`'s session in `slot` over the head target (the pipeline stays
        up between requests; `plan` is the request's, default the pipeline's); (first token, done)."""
        from ..specdec.request import Request  # noqa: PLC0415
        from ..tracing.deferred import DeferredSink  # noqa: PLC0415
        from ..tracing.emit import SpanSink  # noqa: PLC0415

        s = self.slots[slot]
        with s.turn(seq):
            self.carriers[index] = carrier
            if self.tracing.enabled:
                s.spans = DeferredSink(SpanSink(self.tracing.tracer, self.tracing.parent(carrier), {}))
            if self.batch is not None:  # a batch slot's session (batching/backend.py), released at finish
                held = self.batch.session(plan or self.plan, prompt, s.spans, carrier)
                s.request = held.__enter__()
                s.held = held  # entered: left at finish
                self.batch.batcher.remote.index_of[s.request.target.rid] = index  # its steps' spans join its trace
            else:
                s.target = PipelineTarget(self.ring, s.view, traced=self.cfg.trace.level >= 1, records=self.records,
                                          request=index, slot=slot, remote_taps=self.remote_taps,
                                          shared=len(self.slots) > 1)
                s.request = Request(s.target, plan or self.plan, prompt, s.spans, drafter=s.drafter)
            first = self._guarded(s.request.start)
            return first, s.request.done

    def burst(self, slot: int, seq: int):
        """The slot's next BurstOut; after its request ended (or the actor was closed), an empty one."""
        from ..specdec.request import BurstOut  # noqa: PLC0415

        s = self.slots[slot]
        with s.turn(seq):
            if self.closed or s.request is None or s.request.done:
                return BurstOut([], True)
            return self._guarded(s.request.burst)

    def _guarded(self, fn):
        try:
            return fn()
        except BaseException:
            self.failed = True
            raise

    def finish(self, slot: int, seq: int) -> dict:
        """The slot's request stats, its spans built (also for a request the driver gave up
        on before its end); the slot is free for the next request."""
        s = self.slots[slot]
        with s.turn(seq):
            if s.request is not None:
                s.request.flush_trace()  # a request given up on: its last burst's record too
            self._finish_spans(s)
            try:
                stats = s.request.finish() if s.request is not None else {}
            finally:
                if s.held is not None:  # the batch slot's blocks given back, on every rank
                    held, s.held = s.held, None
                    if s.request is not None:
                        self.batch.batcher.remote.index_of.pop(s.request.target.rid, None)
                    held.__exit__(None, None, None)
                s.request = None
            return stats

    def batch_stats(self) -> dict | None:
        """The batched pipeline's counts (batching/backend.py stats), None when not batched."""
        return self.batch.stats() if self.batch is not None else None

    def _finish_spans(self, s: _Slot) -> None:
        if s.spans is not None:
            s.spans.close()  # every queued span of this request built
            with self._spans_lock:
                self._spans_done += s.spans.count
            s.spans = None

    def _end(self) -> None:
        """END to the stages (their serve loops return), every queued span built."""
        if self.loop_done.is_set():
            return
        self.loop_done.set()
        if not self.failed:
            self.ring.command(Op.END)
        if self.batch is not None:
            self.batch.close()
        for s in self.slots.values():
            self._finish_spans(s)

    def _stop(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        stuck = False
        for s in self.slots.values():  # the bursts in progress end first
            with s.cv:
                stuck |= not s.cv.wait_for(lambda: not s.busy, timeout=max(0.0, deadline - time.monotonic()))
        if not stuck:
            self._end()
            return
        for s in self.slots.values():  # a burst stuck on a dead peer: build what is queued anyway
            if s.spans is not None:
                s.spans.close()

    def _extra_spans(self) -> int:
        return self._spans_done + sum(s.spans.count for s in self.slots.values() if s.spans is not None)
