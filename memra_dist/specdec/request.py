"""One request's speculative session over a target, whatever the split.

`Request` is the only place that builds a session: the drafter (the replay drafter's
recording included), the sampling generator, the SpecSession, and the per-burst hand-off of
records. The in-process engine (pp=1) drives it over a local ModelRunner; the pipeline head
actor drives the very same class over the pipeline's head target (pipeline/head_target.py).
Nothing else differs between the two.

Per burst it returns a `BurstOut`: the tokens committed, whether the request ended, and the
records made (burst record, first-token profile, depth log) for the caller's lines, share
table and metrics. Spans are built where the session runs, by the `span_sink` given here
(its pump runs while a verify is on the device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..phase.levels import TraceSettings
from .drafters import NoDrafter, build_drafter
from .sampling import SamplingParams
from .session import SpecSession

__all__ = ["Request", "BurstOut", "Result"]

RECORD_BURST = 64  # rounds per burst of the replay drafter's untraced recording pass


@dataclass
class Result:
    token_ids: list[int]
    stats: dict


@dataclass
class BurstOut:
    tokens: list[int]
    done: bool
    records: tuple = ()  # phase.records.BurstRecord (trace level >= 1): this burst's, or the one before's
    # (the event clock hands a burst's record over in the next burst: phase/clock.py), or both at the end
    prof: object = None  # phase.first_token.FirstTokenProf (profile, first burst)
    rounds: tuple | None = None  # (phase.rounds_log.RoundsLog, final) (profile)


class _Collect:
    """The session's sink: forwards to the span sink where the session runs, and keeps the
    burst's records to hand back with its tokens, or, when the caller's own sink runs in this
    process (`Request.feed_in_shadow`), feeds them to it from `pump`, while a verify is on
    the device: a share table's sums, `[spec-phase]` lines and metrics then cost the round
    loop nothing either (between bursts they were on the host's critical path)."""

    def __init__(self, spans):
        self.spans = spans
        self.recs: list = []
        self.prof = self.log = None
        self.caller = None  # the caller's sink, fed from pump
        self.due: list = []  # burst records still to feed it
        self._spans_pump = getattr(spans, "pump", None) if spans is not None else None

    def burst(self, rec):
        if self.spans is not None:
            self.spans.burst(rec)
        # the session makes a fresh record per burst
        (self.due if self.caller is not None else self.recs).append(rec)

    def pump(self) -> None:
        """Called by the session right after it launches a verify."""
        if self.due:
            self.feed()
        if self._spans_pump is not None:
            self._spans_pump()

    def feed(self) -> None:
        """Every burst record still due, to the caller's sink now."""
        due, self.due = self.due, []
        for rec in due:
            self.caller.burst(rec)

    def first_token(self, prof):
        if self.spans is not None:
            self.spans.first_token(prof)
        self.prof = prof

    def rounds(self, log, final):
        if self.spans is not None:
            self.spans.rounds(log, final)
        self.log = (log, final)

    def take(self) -> tuple:
        out = (tuple(self.recs), self.prof, self.log)
        self.recs, self.prof, self.log = [], None, None
        return out


class Request:
    """start() -> the first token; burst(hook) -> BurstOut until done; finish() -> stats."""

    def __init__(self, target, plan, prompt: list[int], span_sink=None, drafter=None):
        """`drafter`: one kept loaded between requests (a draft model); else built here."""
        self.target, self.plan, self.prompt = target, plan, list(prompt)
        cfg = plan.cfg
        self.collect = _Collect(span_sink)
        if drafter is None:
            drafter = build_drafter(cfg, plan, target.device, target.dtype, len(prompt), self._record_greedy,
                                    target=target)
        gen = torch.Generator().manual_seed(cfg.seed)
        self.session = SpecSession(target, drafter, cfg.sampling, gen, cfg.k, cfg.trace, self.collect,
                                   plan.model.eos_token_ids, cfg.prefill_chunk)

    @property
    def done(self) -> bool:
        return self.session.done

    def _record_greedy(self) -> list[int]:
        """The replay drafter's recording: a plain greedy pass on the same target, untraced."""
        traced = getattr(self.target, "traced", None)
        if traced is not None:
            self.target.traced = False
        plain = SpecSession(self.target, NoDrafter(), SamplingParams(), torch.Generator(), 1, TraceSettings(),
                            eos_ids=self.plan.model.eos_token_ids, prefill_chunk=self.plan.cfg.prefill_chunk)
        out = [plain.start(self.prompt, self.plan.cfg.max_new_tokens, self.plan.capacity)]
        while not plain.done:
            out.extend(plain.burst(RECORD_BURST))
        if traced is not None:
            self.target.traced = traced
        return out

    def start(self) -> int:
        return self.session.start(self.prompt, self.plan.cfg.max_new_tokens, self.plan.capacity)

    def burst(self, hook: Callable[[list[int]], None] | None = None) -> BurstOut:
        toks = self.session.burst(self.plan.cfg.burst_rounds, hook)
        recs, prof, log = self.collect.take()
        return BurstOut(toks, self.session.done, recs, prof, log)

    def feed_in_shadow(self, sink) -> None:
        """Give the caller's sink (lines, share table, metrics: its `burst`) to the session:
        each burst record reaches it from the session's pump, in a verify's shadow, instead of
        in `BurstOut.records`; the last ones in `finish` (or `flush_trace`). Before `start`."""
        self.collect.caller = sink

    def flush_trace(self) -> None:
        """Abandoned before its end: the burst record still held by the event clock is built
        into spans, and what the caller's sink is still due goes to it (best effort: a device
        that failed may not answer)."""
        try:
            self.session.flush_trace()
        except Exception:  # noqa: BLE001 (tracing never takes the caller's error's place)
            pass
        if self.collect.caller is not None:
            try:
                self.collect.feed()
            except Exception:  # noqa: BLE001
                pass

    def finish(self) -> dict:
        """The session's stats, with the fast path the target's steps ran (`fast_path`); the
        caller's sink gets the burst records still due to it first."""
        if self.collect.caller is not None:
            self.collect.feed()
        stats = self.session.stats.as_dict()
        by_source = getattr(self.session.drafter, "source_stats", None)
        if by_source is not None:  # --ngram-first: the lookup's rounds and the network's, apart
            stats["drafts_by_source"] = by_source(self.session.tokens, self.session.stats.accepted)
        target = self.session.target
        runner = getattr(target, "runner", target)  # a pipeline head: the runner of its own layers
        if hasattr(runner, "fast_path"):
            stats["fast_path"] = {**runner.fast_path(), "ahead": self.session.ran_ahead}
        return stats
