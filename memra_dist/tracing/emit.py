"""Records -> spans, from each settled burst record, with explicit start and end times (built a
round at a time in the verify's shadow: tracing/deferred.py). Times are perf_counter ns in the records; one offset per sink maps them to the
epoch ns OpenTelemetry wants."""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, TraceFlags

from ..phase.first_token import FirstTokenProf
from ..phase.records import BurstRecord, RoundRecord
from .conventions import (ATTR, PHASE_SPANS, PHASES, SPAN_BATCH_STEP, SPAN_BURST, SPAN_FIRST_TOKEN, SPAN_PRIME_CHUNK,
                          SPAN_ROUND, TTFT_BUCKETS, VERIFY_SUB_SPANS, free_mb_attr, ttft_span)

__all__ = ["SpanSink", "verify_sub_layout", "clock_offset"]


def clock_offset(tries: int = 5) -> int:
    """time_ns - perf_counter_ns, from the read whose perf_counter bracket was the tightest (a
    thread preempted between the two reads would shift every span of the sink by the pause;
    spans of several sinks, such as a batch step's and its requests' rounds, must line up)."""
    best = None
    for _ in range(tries):
        a = time.perf_counter_ns()
        w = time.time_ns()
        b = time.perf_counter_ns()
        if best is None or b - a < best[0]:
            best = (b - a, w - (a + b) // 2)
    return best[1]

_PRIME_BUCKETS = TTFT_BUCKETS[:6]  # cache_alloc .. draft_prime: contiguous laps from t0
_ROUND1_BUCKETS = TTFT_BUCKETS[6:]  # first_draft .. first_maint: contiguous from round 1's entry
_PHASE_MS = {p: ATTR[f"{p}_ms"] for p in PHASES}


def verify_sub_layout(r: RoundRecord, total_ns: int | None = None) -> list[tuple[str, int, dict]]:
    """(bucket, ns, extra attrs) for the level-2 sub-spans, laid end to end inside the verify
    span in a fixed order. They are drained SHARES of the verify walk (per-layer laps summed
    by class), not intervals: `rest` = verify - kda - mla - attn - ffn, so the sub-spans never
    sum past their parent. (The [spec-phase-v] line's vrest includes ffn: it prints vffn inside it.)
    `total_ns`: the parent's length when it is not the round's verify (a batch step's forward)."""
    v = r.phase_ns(1) if total_ns is None else total_ns
    s = r.sub_ns
    out = []
    for b in ("kda", "mla", "attn", "ffn"):
        ns = s.get(b, 0)
        if ns:
            extra = {ATTR["scan_ms"]: s.get("scan", 0) / 1e6} if b == "kda" else {}
            out.append((b, ns, extra))
    used = sum(ns for _, ns, _ in out)
    out.append(("rest", max(0, v - used), {}))
    return out


class SpanSink:
    """Builds finished spans straight from the records: ids, parents, times and attributes are
    all known after the burst, so the SDK's live-span path (a sampler call, locks and
    on_start per span) buys nothing; each span is a `ReadableSpan` handed to the provider's
    span processors (`on_end`), i.e. the same batching and export path as any span.
    The sampling decision is the parent's (or the tracer's sampler for a root), once per sink."""

    def __init__(self, tracer, parent: Context | None, attrs: dict | None = None):
        self.proc = tracer.span_processor
        self.resource = tracer.resource
        self.ids = tracer.id_generator
        self.scope = InstrumentationScope("memra_dist")
        self.attrs = attrs or {}  # e.g. memra.stage on a stage's spans
        self.offset = clock_offset()
        self.count = 0  # spans made (the level-0 test counts zero)
        psc = trace.get_current_span(parent).get_span_context() if parent is not None else None
        if psc is not None and psc.is_valid:
            self.parent, self.trace_id = psc, psc.trace_id
            self.sampled = psc.trace_flags.sampled
        else:
            self.parent, self.trace_id = None, self.ids.generate_trace_id()
            res = tracer.sampler.should_sample(None, self.trace_id, SPAN_BURST)
            self.sampled = res.decision.is_sampled()
        self.flags = TraceFlags(TraceFlags.SAMPLED if self.sampled else TraceFlags.DEFAULT)

    def _span(self, name: str, parent: SpanContext | None, t0: int, t1: int, attrs: dict, links=(),
              sc: SpanContext | None = None) -> SpanContext:
        sc = sc or SpanContext(self.trace_id, self.ids.generate_span_id(), is_remote=False, trace_flags=self.flags)
        if self.sampled:
            self.count += 1
            self.proc.on_end(ReadableSpan(name, context=sc, parent=parent, resource=self.resource,
                                          attributes={**self.attrs, **attrs}, instrumentation_scope=self.scope,
                                          start_time=t0 + self.offset, end_time=t1 + self.offset, links=links))
        return sc

    def _step_link(self, r: RoundRecord) -> tuple:
        """The link from a batched round to the step its verify rode in (its share: its rows, k
        and accepted), the step's span made here if no request's sink made it before
        (batching/step_ids.py); () for a round that rode no step."""
        b = r.batch
        if b is None or b.spans is None:
            return ()
        tid, sid = b.spans.ids(b.id)
        sc = SpanContext(tid, sid, is_remote=False, trace_flags=self.flags)
        if self.sampled and b.spans.claim(b.id):
            self._span(SPAN_BATCH_STEP, None, b.t0, b.t0 + b.forward_ns, {
                ATTR["batch_step"]: b.id, ATTR["batch_requests"]: b.requests, ATTR["batch_rows"]: b.rows,
                ATTR["batch_forward_ms"]: b.forward_ns / 1e6, ATTR["batch_kv_used"]: b.kv_used,
                ATTR["batch_kv_free"]: b.kv_free, ATTR["batch_preempted"]: b.preempted,
                **({ATTR["batch_predicted_ms"]: b.predicted_ns / 1e6} if b.predicted_ns else {}),
                ATTR["batch_gap_ms"]: b.gap_ns / 1e6, ATTR["batch_rounds_ms"]: b.rounds_ns / 1e6,
                ATTR["batch_held_ms"]: b.held_ns / 1e6, **self._mem(r.free_mb[1])}, sc=sc)
        if self.sampled and r.sub_ns and b.spans.claim((b.id, "verify")):
            self._step_subs(r, sc)
        return (Link(sc, {ATTR["rows"]: r.k + 1, ATTR["k"]: r.k, ATTR["accepted"]: r.j}),)

    def _step_subs(self, r: RoundRecord, step: SpanContext) -> None:
        """Level 2 on the engine loop: the step's verify sub-split (its graph's device-clock stamps
        or its drained walk, one per step: every request of the step rode the same forward), once,
        as children of the step's span in its trace, laid end to end from its launch; `rest` is the
        step's forward less the buckets."""
        b = r.batch
        mem = self._mem(r.free_mb[1])
        t = b.t0
        for bucket, ns, extra in verify_sub_layout(r, b.forward_ns):
            sc = SpanContext(step.trace_id, self.ids.generate_span_id(), is_remote=False, trace_flags=self.flags)
            self._span(VERIFY_SUB_SPANS[bucket], step, t, t + ns, {ATTR["batch_step"]: b.id, **extra, **mem}, sc=sc)
            t += ns

    @staticmethod
    def _mem(d: dict[str, int]) -> dict:
        return {free_mb_attr(k): v for k, v in d.items()}

    def burst(self, rec: BurstRecord) -> None:
        for _ in self.burst_steps(rec):
            pass

    def burst_steps(self, rec: BurstRecord):
        """The burst's spans, yielding after each round's (tracing/deferred.py pumps them)."""
        b = self._span(SPAN_BURST, self.parent, rec.t0, rec.t1, {
            ATTR["burst"]: rec.index, ATTR["k"]: rec.k, ATTR["rounds"]: rec.n, ATTR["tokens"]: rec.tokens,
            ATTR["clock"]: rec.clock})
        for r in rec.live():
            if rec.compact:
                self._round_compact(r, b)
            else:
                self._round(r, b)
            yield

    def _round_compact(self, r: RoundRecord, burst: SpanContext) -> None:
        """A round the engine loop ran (chained.py): one spec.round span with its phases' ms, the
        batch step it rode in and the free memory at its verify (level 2: the step's verify
        sub-split under the step's span, `_step_subs`)."""
        attrs = {ATTR["round"]: r.index, ATTR["k"]: r.k, ATTR["accepted"]: r.j, ATTR["ctx"]: r.ctx,
                 **self._mem(r.free_mb[1])}
        for i, ph in enumerate(PHASES):
            attrs[_PHASE_MS[ph]] = r.phase_ns(i) / 1e6
        b = r.batch
        if b is not None:
            attrs.update({ATTR["batch_step"]: b.id, ATTR["batch_requests"]: b.requests, ATTR["batch_rows"]: b.rows,
                          ATTR["batch_wait_ms"]: b.wait_ns / 1e6, ATTR["batch_forward_ms"]: b.forward_ns / 1e6})
        if r.draft_requests:
            attrs[ATTR["batch_draft_requests"]] = r.draft_requests
        if r.expected >= 0:
            attrs[ATTR["expected_accepted"]] = round(r.expected, 4)
        self._span(SPAN_ROUND, burst, r.t[0], r.t[5], attrs, self._step_link(r))

    def _round(self, r: RoundRecord, burst: SpanContext) -> None:
        base = {ATTR["round"]: r.index, ATTR["k"]: r.k, ATTR["accepted"]: r.j, ATTR["ctx"]: r.ctx}
        if r.batch is not None:  # a batched request: the step its verify rode in (every request of it names it)
            base[ATTR["batch_step"]] = r.batch.id
        rs = self._span(SPAN_ROUND, burst, r.t[0], r.t[5], {**base, ATTR["seq_rows"]: r.seq_rows}, self._step_link(r))
        for i, ph in enumerate(PHASES):
            mem = self._mem(r.free_mb[i])
            extra = {ATTR["draft_forwards"]: r.draft_forwards} if ph == "draft" and r.draft_forwards >= 0 else {}
            if ph == "draft" and r.draft_requests:
                extra[ATTR["batch_draft_requests"]] = r.draft_requests
            if r.h[i]:
                extra[ATTR["host_ms"]] = r.host_ns(i) / 1e6
            if ph == "verify" and r.batch is not None:
                b = r.batch
                extra.update({ATTR["batch_requests"]: b.requests, ATTR["batch_rows"]: b.rows,
                              ATTR["batch_wait_ms"]: b.wait_ns / 1e6, ATTR["batch_forward_ms"]: b.forward_ns / 1e6})
            ps = self._span(PHASE_SPANS[ph], rs, r.t[i], r.t[i + 1], {**base, **mem, **extra})
            if ph == "verify" and r.sub_ns:
                t = r.t[1]
                for bucket, ns, extra in verify_sub_layout(r):
                    self._span(VERIFY_SUB_SPANS[bucket], ps, t, t + ns, {**base, **extra, **mem})
                    t += ns

    def first_token(self, pf: FirstTokenProf) -> None:
        for _ in self.first_token_steps(pf):
            pass

    def first_token_steps(self, pf: FirstTokenProf):
        end = pf.round1_t0_ns + int(sum(pf.ms[b] for b in _ROUND1_BUCKETS) * 1e6)
        ft = self._span(SPAN_FIRST_TOKEN, self.parent, pf.t0_ns, max(end, pf.t0_ns), {
            ATTR["tokens"]: pf.first_burst_tokens, ATTR["rounds"]: pf.first_burst_rounds,
            ATTR["kv_mb"]: pf.draft_kv_mb, ATTR["cached_tokens"]: pf.cached_tokens,
            **{ATTR[f]: v for f, v in pf.depth().items()}})
        for buckets, t in ((_PRIME_BUCKETS, pf.t0_ns), (_ROUND1_BUCKETS, pf.round1_t0_ns)):
            for b in buckets:
                attrs = {}
                if b == "cache_alloc":
                    attrs = self._mem(pf.free_mb_before)
                elif b == "draft_alloc":
                    attrs = self._mem(pf.free_mb_after)
                dt = int(pf.ms[b] * 1e6)
                bs = self._span(ttft_span(b), ft, t, t + dt, attrs)
                if b == "prime":
                    self._prime_chunks(pf, bs, t)
                t += dt
        yield

    def _prime_chunks(self, pf: FirstTokenProf, parent: SpanContext, t: int) -> None:
        """One span per prefill chunk of the prime, laid end to end from the prime's start."""
        for i, (rows, ms) in enumerate(zip(pf.prime_chunk_rows, pf.prime_chunk_ms)):
            dt = int(ms * 1e6)
            self._span(SPAN_PRIME_CHUNK, parent, t, t + dt, {ATTR["chunk"]: i, ATTR["rows"]: rows})
            t += dt

    def rounds(self, log, final: bool) -> None:
        pass  # the depth log is a line instrument; its rows are the round spans already
