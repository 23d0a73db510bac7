"""The Ray actors of the ppN split. Plain classes here; pipeline/driver.py wraps them with
`ray.remote` and places them (one GPU each). Models know nothing of parallelism: an actor
is a ModelRunner over its layer range plus a Link into the ring.

- StageWorker (ranks 1..N-1, stages 0..N-2): `serve()` runs a loop of commands received
  over torch.distributed until END; no Ray call per round.
- HeadWorker (rank 0): the last stage's layers + final norm, lm_head, sampling, acceptance,
  the drafter and the session. Co-locating the head with the last stage saves one hop per
  forward and keeps one rank per GPU (NCCL refuses two ranks of a group on one device).
  The driver calls `start` once, `burst` per burst (tokens come back at burst cadence),
  `finish` once.

The stage loop is written around one command queue per actor, so several sessions could
later be in flight across the stages (a full pipeline) by tagging commands with a session
id; today one session keeps one stage busy at a time.
"""

from __future__ import annotations

import os
import time

import torch

from ..config import RunConfig
from ..device import free_mb
from ..runner import ModelRunner
from ..phase.subsplit import SUB_BUCKETS, SubsplitTimer
from .actor_tracing import ActorTracing
from .pipeline_target import PipelineTarget
from .transport import Flag, Link, Op, free_port

__all__ = ["StageWorker", "HeadWorker"]


def _device_and_label() -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        import ray  # noqa: PLC0415

        ids = ray.get_gpu_ids()
        return torch.device("cuda:0"), f"cuda{int(ids[0]) if ids else 0}"  # the physical id
    torch.set_num_threads(1)  # CPU actors share the host's cores
    return torch.device("cpu"), "cpu"


class _Worker:
    role = "stage"

    def __init__(self, cfg: RunConfig, rank: int, world: int, stage: int, first: int, last: int,
                 capacity: int, run_dir: str | None):
        from ..device import resolve_dtype  # noqa: PLC0415

        self.cfg, self.rank, self.stage = cfg, rank, stage
        self.device, label = _device_and_label()
        dtype = resolve_dtype(cfg.dtype, self.device)
        self.runner = ModelRunner(cfg.model, self.device, dtype, first, last, has_embed=first == 0,
                                  has_head=self.role == "head", max_pos=capacity,
                                  **cfg.runner_kwargs(self.device))
        self.runner.label = label
        self.link = Link(rank, world, self.device)
        self.tracing = ActorTracing(self.role, stage, run_dir, cfg.trace.level >= 1 or cfg.trace.prof)

    def address(self) -> tuple[str, int]:
        return free_port()

    def connect(self, addr: str, port: int, timeout_s: float) -> int:
        self.link.connect(addr, port, timeout_s)
        return os.getpid()

    def close(self) -> int:
        dropped = self.tracing.close(self._extra_spans())
        self.link.close()
        return dropped

    def _extra_spans(self) -> int:
        return 0


class StageWorker(_Worker):
    role = "stage"

    def serve(self, carrier: dict) -> int:
        """Run commands until END. Returns the forwards served."""
        link, run = self.link, self.runner
        records, served = [], 0
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
            elif op == Op.END:
                break
        self.tracing.stage_spans(carrier, records)
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
            records.append((t0, time.perf_counter_ns(), start, rows, rnd, free_mb(self.device), run.label))
        link.send(h)
        if timer is not None:
            sub = link.recv((len(SUB_BUCKETS),), torch.long) if self.rank > 1 else torch.zeros(
                len(SUB_BUCKETS), dtype=torch.long, device=self.device)
            ns, _rows = timer.take()
            sub += torch.tensor([ns[b] for b in SUB_BUCKETS], device=self.device)
            link.send(sub)
        return 1


class _Collect:
    """The head's session sink: spans emitted here (head process), records handed back to
    the driver with each burst for lines, the share table and metrics."""

    def __init__(self, spans):
        self.spans, self.rec, self.prof, self.log = spans, None, None, None

    def burst(self, rec):
        if self.spans is not None:
            self.spans.burst(rec)
        self.rec = rec  # the session gives each burst a fresh record

    def first_token(self, prof):
        if self.spans is not None:
            self.spans.first_token(prof)
        self.prof = prof

    def rounds(self, log, final):
        self.log = (log, final)

    def pump(self):
        if self.spans is not None:
            self.spans.pump()

    def take(self):
        out = (self.rec, self.prof, self.log)
        self.rec = self.prof = self.log = None
        return out


class HeadWorker(_Worker):
    role = "head"

    def start(self, carrier: dict, prompt: list[int], capacity: int) -> int:
        from ..request import make_drafter  # noqa: PLC0415
        from ..specdec.drafters import NoDrafter  # noqa: PLC0415
        from ..specdec.sampling import SamplingParams  # noqa: PLC0415
        from ..phase.levels import TraceSettings  # noqa: PLC0415
        from ..specdec.session import SpecSession  # noqa: PLC0415
        from ..tracing.deferred import DeferredSink  # noqa: PLC0415
        from ..tracing.emit import SpanSink  # noqa: PLC0415

        cfg, mcfg = self.cfg, self.runner.cfg
        self.target = PipelineTarget(self.link, self.runner, traced=cfg.trace.level >= 1)
        spans = None
        if self.tracing.enabled:
            spans = DeferredSink(SpanSink(self.tracing.tracer, self.tracing.parent(carrier), {}))
        self._spans = spans
        self.collect = _Collect(spans)

        def record() -> list[int]:  # the replay drafter's recording: plain greedy, untraced
            self.target.traced = False
            plain = SpecSession(self.target, NoDrafter(), SamplingParams(), torch.Generator(), 1, TraceSettings())
            out = [plain.start(prompt, cfg.max_new_tokens, capacity)]
            while not plain.done:
                out.extend(plain.burst(64))
            self.target.traced = cfg.trace.level >= 1
            return out

        drafter = make_drafter(cfg, mcfg, self.device, self.runner.dtype, capacity, len(prompt), record)
        gen = torch.Generator().manual_seed(cfg.seed)
        self.session = SpecSession(self.target, drafter, cfg.sampling, gen, cfg.k, cfg.trace, self.collect,
                                   mcfg.eos_token_ids)
        return self.session.start(prompt, cfg.max_new_tokens, capacity)

    def burst(self) -> tuple[list[int], bool, object, object, object]:
        toks = self.session.burst(self.cfg.burst_rounds)
        rec, prof, log = self.collect.take()
        return toks, self.session.done, rec, prof, log

    def finish(self) -> dict:
        self.target.end()
        if self._spans is not None:
            self._spans.close()  # every burst's spans built before the flush in close()
        return self.session.stats.as_dict()

    def _extra_spans(self) -> int:
        return self._spans.count if getattr(self, "_spans", None) is not None else 0
