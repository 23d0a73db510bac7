"""The in-process sections: copy bandwidth + roofline, step costs, plain and speculative decode
(with the ideal speedup and the achieved fraction of it), trace levels. Each takes the Suite
and returns a JSON-able dict; nothing here is claimed without being measured in this run."""

from __future__ import annotations

import time

from ..phase.levels import TraceSettings
from .checkpoints import shape_config, weight_bytes
from .roofline import SPEC_FORMULA, achieved_fraction, ideal_speedup, median, per_token_acceptance, roofline_tok_s
from .timing import copy_bandwidth

__all__ = ["bandwidth", "steps", "decode", "trace_levels", "plain_decode"]


def bandwidth(s) -> dict:
    bw = copy_bandwidth(s.device, s.p.copy_bytes, repeats=s.p.copy_repeats)
    wb = weight_bytes(shape_config(s.opts.shape), s.dtype)
    s.memo["roofline_tok_s"] = roofline_tok_s(bw["bandwidth_bytes_s"], wb)
    return {**bw, "weight_bytes": wb, "roofline_tok_s": round(s.memo["roofline_tok_s"], 2),
            "formula": "roofline tok/s = bandwidth / weight bytes"}


def step_costs(s) -> dict:
    """Medians (s) of target forward(1), forward(K+1) for each K, draft forward(1): memoized."""
    if "costs" in s.memo:
        return s.memo["costs"]
    b, ctx, n = s.bench, s.p.ctx, s.p.step_repeats
    cap = b.max_pos  # the capacity every bench run uses (see Bench.generate)
    s.say(f"  priming target and draft at ctx {ctx}")
    b.steps.prime(b.target, ctx, cap)
    costs = {"ctx": ctx, "decode": b.steps.step_time(b.target, 1, ctx, n)}
    for k in s.p.ks:
        costs[f"verify_{k + 1}"] = b.steps.step_time(b.target, k + 1, ctx, n)
    if b.draft is not None:
        b.steps.prime(b.draft, ctx, cap)
        costs["draft_decode"] = b.steps.step_time(b.draft, 1, ctx, n)
    s.memo["costs"] = costs
    return costs


def steps(s) -> dict:
    c = step_costs(s)
    t1 = c["decode"]["median_s"]
    out = {"ctx": c["ctx"], "repeats": c["decode"]["n"], "decode_ms": round(t1 * 1e3, 4),
           "draft_decode_ms": round(c["draft_decode"]["median_s"] * 1e3, 4) if "draft_decode" in c else None,
           "verify": {}}
    for k in s.p.ks:
        tv = c[f"verify_{k + 1}"]["median_s"]
        out["verify"][str(k)] = {"rows": k + 1, "ms": round(tv * 1e3, 4), "ratio_vs_decode": round(tv / t1, 4)}
    return out


def plain_decode(s) -> dict:
    if "plain" in s.memo:
        return s.memo["plain"]
    b, prompt, n = s.bench, s.prompt, s.p.max_new
    b.generate(b.drafter("none"), prompt, min(8, n))  # warm-up (allocator, graphs capture)
    runs = [b.generate(b.drafter("none"), prompt, n) for _ in range(s.p.gen_repeats)]
    best = sorted(runs, key=lambda r: r.decode_s)[len(runs) // 2]  # the median run
    s.memo["plain"] = {"result": best, "tok_s_all": [round(r.decode_tok_s, 3) for r in runs]}
    return s.memo["plain"]


def _draft_step_s(s, name: str, corrupt: float = 0.0) -> float:
    b = s.bench
    if name == "model":
        return step_costs(s)["draft_decode"]["median_s"]
    rec = s.memo["plain"]["result"].tokens
    d = b.drafter(name, rec, len(s.prompt), corrupt)
    ctxt = s.prompt + rec[: len(rec) // 2]
    return b.propose_time(d, ctxt, max(s.p.ks), 50)


def _spec_run(s, name: str, k: int, corrupt: float | None, plain_tok_s: float) -> dict:
    b, prompt, n = s.bench, s.prompt, s.p.max_new
    rec = s.memo["plain"]["result"].tokens
    mk = (lambda: b.drafter(name, rec, len(prompt), corrupt or 0.0))
    b.generate(mk(), prompt, min(8, n), k)  # warm-up of this K
    r = b.generate(mk(), prompt, n, k)
    row = {"drafter": name, "k": k, **r.as_dict()}
    if corrupt is not None:
        row.update(target_acceptance=round(1 - corrupt, 3), corrupt=corrupt)
    if name in ("none",) or r.rounds == 0:
        return row
    c = step_costs(s)
    a = per_token_acceptance(r.accepted / r.rounds, k)
    ideal = ideal_speedup(a, k, c["decode"]["median_s"], _draft_step_s(s, name, corrupt or 0.0),
                          c[f"verify_{k + 1}"]["median_s"])
    achieved = r.decode_tok_s / plain_tok_s
    row.update(acceptance=round(a, 4), ideal_speedup=round(ideal, 4), achieved_speedup=round(achieved, 4),
               fraction_of_ideal=round(achieved_fraction(r.decode_tok_s, plain_tok_s, ideal), 4))
    if r.tokens != rec[: len(r.tokens)]:
        row["greedy_mismatch"] = True  # greedy spec output must equal plain: flag, never hide
    return row


def decode(s) -> dict:
    pl = plain_decode(s)
    r = pl["result"]
    out = {"prompt_len": len(s.prompt), "max_new": s.p.max_new, "formula": SPEC_FORMULA,
           "plain": {**r.as_dict(), "tok_s_all": pl["tok_s_all"]}, "spec": [], "skipped": []}
    if "roofline_tok_s" in s.memo:
        out["plain"]["roofline_fraction"] = round(r.decode_tok_s / s.memo["roofline_tok_s"], 4)
    step_costs(s)
    plan = [("replay", k, round(1 - a, 3)) for k in s.p.ks for a in s.p.accs]
    plan += [("ngram", k, None) for k in s.p.ks]
    if s.bench.draft is not None:
        plan += [("model", k, None) for k in s.p.ks]
    for name, k, corrupt in plan:
        label = f"{name} K={k}" + (f" acc~{1 - corrupt:.1f}" if corrupt is not None else "")
        if s.left() <= 0:
            out["skipped"].append(f"{label}: budget")
            continue
        t0 = time.perf_counter()
        row = _spec_run(s, name, k, corrupt, r.decode_tok_s)
        out["spec"].append(row)
        s.say(f"  {label}: {row['tok_s']:.1f} tok/s, acceptance {row.get('acceptance', 0):.3f}, "
              f"{row.get('fraction_of_ideal', 0):.2f} of ideal ({time.perf_counter() - t0:.1f}s)")
    return out


def _trace_sink(level: int):
    """(sink, closer): the sink the CLI would build at `level`; closer() flushes and stops it."""
    if level == 0:
        return None, lambda: None
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: PLC0415

    from ..phase.report import FanOut  # noqa: PLC0415
    from ..phase.share import ShareTable  # noqa: PLC0415
    from ..tracing.deferred import DeferredSink  # noqa: PLC0415
    from ..tracing.emit import SpanSink  # noqa: PLC0415

    from ..tracing.otel import quick_gil_handoff  # noqa: PLC0415

    quick_gil_handoff()  # as make_provider does for the CLI's provider
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    spans = DeferredSink(SpanSink(tp.get_tracer("memra.bench"), None))  # as the CLI builds them

    def close() -> None:  # after the timed decode, as the CLI does at request end
        spans.close()
        tp.shutdown()

    return FanOut(ShareTable(), spans), close


def trace_levels(s) -> dict:
    """The same replay generation (K=4, acceptance ~0.8) at levels 0, 1, 2, interleaved
    repeats, median decode wall; spans go to a batched in-memory exporter (the SDK's real
    cost, no network). Level-0 noise = spread of the level-0 repeats."""
    b, prompt, n, k = s.bench, s.prompt, s.p.max_new, 4
    rec = plain_decode(s)["result"].tokens
    walls = {0: [], 1: [], 2: []}
    for lv in (0, 1, 2):  # warm-up of each level
        sink, close = _trace_sink(lv)
        b.generate(b.drafter("replay", rec, len(prompt), 0.2), prompt, min(8, n), k, TraceSettings(level=lv), sink)
        close()
    for _ in range(s.p.trace_repeats):
        for lv in (0, 1, 2):
            sink, close = _trace_sink(lv)
            r = b.generate(b.drafter("replay", rec, len(prompt), 0.2), prompt, n, k, TraceSettings(level=lv), sink)
            walls[lv].append(r.decode_s)
            close()
    m = {lv: median(w) for lv, w in walls.items()}
    w0 = walls[0]
    noise = (max(w0) - min(w0)) / m[0] * 100 if len(w0) > 1 else None
    return {"drafter": "replay", "k": k, "corrupt": 0.2, "tokens": n, "repeats": s.p.trace_repeats,
            "wall_s": {str(lv): round(v, 5) for lv, v in m.items()},
            "overhead_pct": {str(lv): round((m[lv] / m[0] - 1) * 100, 3) for lv in (1, 2)},
            "level0_noise_pct": round(noise, 3) if noise is not None else None,
            "note": "level 0 vs a build with the hooks removed is not measurable here; level0_noise_pct is the "
                    "spread of repeated level-0 runs"}
