"""Records -> spans, after each burst, with explicit start and end times (never inside the
round loop). Times are perf_counter ns in the records; one offset per sink maps them to the
epoch ns OpenTelemetry wants."""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.context import Context

from ..phase.first_token import FirstTokenProf
from ..phase.records import BurstRecord, RoundRecord
from .conventions import (ATTR, PHASE_SPANS, PHASES, SPAN_BURST, SPAN_FIRST_TOKEN, SPAN_ROUND,
                          TTFT_BUCKETS, VERIFY_SUB_SPANS, free_mb_attr, ttft_span)

__all__ = ["SpanSink", "verify_sub_layout"]

_PRIME_BUCKETS = TTFT_BUCKETS[:6]  # cache_alloc .. draft_prime: contiguous laps from t0
_ROUND1_BUCKETS = TTFT_BUCKETS[6:]  # first_draft .. first_maint: contiguous from round 1's entry


def verify_sub_layout(r: RoundRecord) -> list[tuple[str, int, dict]]:
    """(bucket, ns, extra attrs) for the level-2 sub-spans, laid end to end inside the verify
    span in a fixed order. They are drained SHARES of the verify walk (per-layer laps summed
    by class), not intervals: `rest` = verify - kda - mla - attn - ffn, so the sub-spans never
    sum past their parent. (The [spec-phase-v] line keeps the seed's vrest, which includes ffn.)"""
    v = r.phase_ns(1)
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
    def __init__(self, tracer: trace.Tracer, parent: Context | None, attrs: dict | None = None):
        self.tracer = tracer
        self.parent = parent
        self.attrs = attrs or {}  # e.g. memra.stage on a stage's spans
        self.offset = time.time_ns() - time.perf_counter_ns()
        self.count = 0  # spans made (the level-0 test counts zero)

    def _span(self, name: str, ctx: Context | None, t0: int, attrs: dict):
        self.count += 1
        return self.tracer.start_span(name, context=ctx, start_time=t0 + self.offset,
                                      attributes={**self.attrs, **attrs})

    @staticmethod
    def _mem(d: dict[str, int]) -> dict:
        return {free_mb_attr(k): v for k, v in d.items()}

    def burst(self, rec: BurstRecord) -> None:
        b = self._span(SPAN_BURST, self.parent, rec.t0, {ATTR["burst"]: rec.index, ATTR["k"]: rec.k,
                                                         ATTR["rounds"]: rec.n, ATTR["tokens"]: rec.tokens})
        bctx = trace.set_span_in_context(b)
        for r in rec.live():
            self._round(r, bctx)
        b.end(end_time=rec.t1 + self.offset)

    def _round(self, r: RoundRecord, bctx: Context) -> None:
        base = {ATTR["round"]: r.index, ATTR["k"]: r.k, ATTR["accepted"]: r.j, ATTR["ctx"]: r.ctx}
        rs = self._span(SPAN_ROUND, bctx, r.t[0], {**base, ATTR["seq_rows"]: r.seq_rows})
        rctx = trace.set_span_in_context(rs)
        for i, ph in enumerate(PHASES):
            ps = self._span(PHASE_SPANS[ph], rctx, r.t[i], {**base, **self._mem(r.free_mb[i])})
            if ph == "verify" and r.sub_ns:
                vctx, t = trace.set_span_in_context(ps), r.t[1]
                for bucket, ns, extra in verify_sub_layout(r):
                    sub = self._span(VERIFY_SUB_SPANS[bucket], vctx, t, {**base, **extra, **self._mem(r.free_mb[i])})
                    t += ns
                    sub.end(end_time=t + self.offset)
            ps.end(end_time=r.t[i + 1] + self.offset)
        rs.end(end_time=r.t[5] + self.offset)

    def first_token(self, pf: FirstTokenProf) -> None:
        end = pf.round1_t0_ns + int(sum(pf.ms[b] for b in _ROUND1_BUCKETS) * 1e6)
        ft = self._span(SPAN_FIRST_TOKEN, self.parent, pf.t0_ns, {
            ATTR["tokens"]: pf.first_burst_tokens, ATTR["rounds"]: pf.first_burst_rounds,
            ATTR["kv_mb"]: pf.draft_kv_mb})
        fctx = trace.set_span_in_context(ft)
        for buckets, t in ((_PRIME_BUCKETS, pf.t0_ns), (_ROUND1_BUCKETS, pf.round1_t0_ns)):
            for b in buckets:
                attrs = {}
                if b == "cache_alloc":
                    attrs = self._mem(pf.free_mb_before)
                elif b == "draft_alloc":
                    attrs = self._mem(pf.free_mb_after)
                s = self._span(ttft_span(b), fctx, t, attrs)
                t += int(pf.ms[b] * 1e6)
                s.end(end_time=t + self.offset)
        ft.end(end_time=max(end, pf.t0_ns) + self.offset)

    def rounds(self, log, final: bool) -> None:
        pass  # the depth log is a line instrument; its rows are the round spans already
