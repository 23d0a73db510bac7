"""The in-process sections: copy bandwidth + roofline, step costs, plain and speculative decode
(with the ideal speedup and the achieved fraction of it), trace levels. Each takes the Suite
and returns a JSON-able dict; nothing here is claimed without being measured in this run.
Every figure a target reads comes with the range of its repeats ("<figure>_range" keys, see
noise.py): timed figures are medians over repeats, derived ones carry the worst-case range."""

from __future__ import annotations

import time

from ..phase.levels import TraceSettings
from .checkpoints import shape_config, weight_bytes
from .drafting import bandwidth_run, phase_fields
from .noise import Fig
from .spans import span_sink
from .roofline import (SPEC_FORMULA, achieved_fraction, expected_tokens, ideal_speedup, per_token_acceptance,
                       roofline_tok_s)

__all__ = ["bandwidth", "steps", "decode", "trace_levels", "plain_decode", "span_sink"]


def _fig_t(t: dict) -> Fig:
    """A time_call / propose_times dict as a Fig of seconds."""
    return Fig(t["median_s"], t["lo_s"], t["hi_s"], t["n"])


def _median_run(runs: list):
    """(the median run by decode wall, Fig of the runs' decode tok/s valued at that run)."""
    best = sorted(runs, key=lambda r: r.decode_s)[len(runs) // 2]
    f = Fig.of([r.decode_tok_s for r in runs])
    return best, Fig(best.decode_tok_s, f.lo, f.hi, f.n)


def bandwidth(s) -> dict:
    bw = dict(bandwidth_run(s))
    wb = weight_bytes(shape_config(s.opts.shape), s.dtype)
    s.memo["roofline_tok_s"] = roofline_tok_s(bw["bandwidth_bytes_s"], wb)
    lo, hi = bw["bandwidth_bytes_s_range"]
    s.memo["roofline"] = Fig(s.memo["roofline_tok_s"], lo / wb, hi / wb, bw["repeats"])
    return {**bw, "weight_bytes": wb, "roofline_tok_s": round(s.memo["roofline_tok_s"], 2),
            "roofline_tok_s_range": s.memo["roofline"].rng(2), "formula": "roofline tok/s = bandwidth / weight bytes"}


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
    """Step medians (ms) with their ranges; verify / decode with the worst-case range of the ratio."""
    c = step_costs(s)
    dec = _fig_t(c["decode"])
    out = {"ctx": c["ctx"], "repeats": c["decode"]["n"], "decode_ms": round(dec.value * 1e3, 4),
           "decode_ms_range": dec.map(lambda x: x * 1e3).rng(),
           "draft_decode_ms": round(c["draft_decode"]["median_s"] * 1e3, 4) if "draft_decode" in c else None,
           "verify": {}}
    for k in s.p.ks:
        ver = _fig_t(c[f"verify_{k + 1}"])
        ratio = ver / dec
        out["verify"][str(k)] = {"rows": k + 1, "ms": round(ver.value * 1e3, 4),
                                 "ms_range": ver.map(lambda x: x * 1e3).rng(), "ratio_vs_decode": round(ratio.value, 4),
                                 "ratio_range": ratio.rng(), "repeats": ratio.n}
    return out


def plain_decode(s) -> dict:
    if "plain" in s.memo:
        return s.memo["plain"]
    b, prompt, n = s.bench, s.prompt, s.p.max_new
    b.generate(b.drafter("none"), prompt, min(8, n))  # warm-up (allocator, graphs capture)
    runs = [b.generate(b.drafter("none"), prompt, n) for _ in range(s.p.gen_repeats)]
    best, tok = _median_run(runs)
    s.memo["plain"] = {"result": best, "tok_s_all": [round(r.decode_tok_s, 3) for r in runs], "tok_s_fig": tok}
    return s.memo["plain"]


def _draft_step(s, name: str, corrupt: float = 0.0) -> Fig:
    """The drafter's step (s per drafted token) with its range: the draft model's forward(1), or
    the host time of propose() for replay / ngram."""
    b = s.bench
    if name == "model":
        return _fig_t(step_costs(s)["draft_decode"])
    rec = s.memo["plain"]["result"].tokens
    d = b.drafter(name, rec, len(s.prompt), corrupt)
    ctxt = s.prompt + rec[: len(rec) // 2]
    return _fig_t(b.propose_times(d, ctxt, max(s.p.ks), 50))


def _spec_run(s, name: str, k: int, corrupt: float | None) -> dict:
    """gen_repeats generations of one (drafter, K): the median run's figures, the tok/s range,
    and the ideal speedup / fraction of it with their worst-case ranges (steps, drafter step,
    plain tok/s and this row's tok/s all carry theirs); flags from report.row_flags."""
    from .report import row_flags, row_label  # noqa: PLC0415

    b, prompt, n = s.bench, s.prompt, s.p.max_new
    rec = s.memo["plain"]["result"].tokens
    plain = s.memo["plain"]["tok_s_fig"]
    mk = (lambda: b.drafter(name, rec, len(prompt), corrupt or 0.0, k=k))
    warm = s.memo.setdefault("warm", set())
    if (name, k) not in warm:  # warm-up of this drafter at this K (once: the replay labels share it)
        b.generate(mk(), prompt, min(8, n), k)
        warm.add((name, k))
    runs = [b.generate(mk(), prompt, n, k) for _ in range(s.p.gen_repeats)]
    r, tok = _median_run(runs)
    row = {"drafter": name, "k": k, **r.as_dict(), "repeats": len(runs),
           "tok_s_all": [round(x.decode_tok_s, 3) for x in runs], "tok_s_range": tok.rng(3)}
    if corrupt is not None:
        row.update(target_acceptance=round(1 - corrupt, 3), corrupt=corrupt)
    if name in ("none",) or r.rounds == 0:
        return row
    c = step_costs(s)
    a = per_token_acceptance(r.accepted / r.rounds, k)  # every repeat is the same greedy path
    dec, ver, draft = _fig_t(c["decode"]), _fig_t(c[f"verify_{k + 1}"]), _draft_step(s, name, corrupt or 0.0)
    ideal_v = ideal_speedup(a, k, dec.value, draft.value, ver.value)
    ideal = Fig.exact(expected_tokens(a, k)) * dec / (draft * k + ver)
    achieved = tok / plain
    frac = achieved / ideal
    row.update(acceptance=round(a, 4), ideal_speedup=round(ideal_v, 4), ideal_speedup_range=ideal.rng(),
               achieved_speedup=round(achieved.value, 4), achieved_speedup_range=achieved.rng(),
               fraction_of_ideal=round(achieved_fraction(r.decode_tok_s, plain.value, ideal_v), 4),
               fraction_of_ideal_range=frac.rng())
    row.update(phase_fields(s, name, k, corrupt))  # draft cost per round, off the phase clock (drafting.py)
    if any(x.tokens != rec[: len(x.tokens)] for x in runs):
        row["greedy_mismatch"] = True  # greedy spec output must equal plain: flag, never hide
    row["label"] = row_label(row)
    row["flags"] = row_flags(row)
    return row


def decode(s) -> dict:
    pl = plain_decode(s)
    r = pl["result"]
    tok = pl["tok_s_fig"]
    out = {"prompt_len": len(s.prompt), "max_new": s.p.max_new, "formula": SPEC_FORMULA, "repeats": s.p.gen_repeats,
           "plain": {**r.as_dict(), "tok_s_all": pl["tok_s_all"], "tok_s_range": tok.rng(3), "repeats": tok.n},
           "spec": [], "skipped": []}
    if "roofline_tok_s" in s.memo:
        rf = tok / s.memo["roofline"]
        out["plain"]["roofline_fraction"] = round(r.decode_tok_s / s.memo["roofline_tok_s"], 4)
        out["plain"]["roofline_fraction_range"] = rf.rng()
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
        row = _spec_run(s, name, k, corrupt)
        out["spec"].append(row)
        fr = row.get("fraction_of_ideal_range") or [0, 0]
        s.say(f"  {row.get('label', label)}: {row['tok_s']:.1f} tok/s, {row.get('fraction_of_ideal', 0):.2f} of ideal "
              f"(range {fr[0]:.2f}-{fr[1]:.2f}, {row['repeats']} runs){''.join(' ' + f for f in row.get('flags', []))} "
              f"({time.perf_counter() - t0:.1f}s)")
    if "draft_read" in s.memo:  # the model drafter's weight-read time the model rows were set against
        out["draft_weight_read"] = {k: v for k, v in s.memo["draft_read"].items() if k != "fig"}
    return out


def _trace_sink(level: int):
    """(sink, closer): the sink the CLI would build at `level`; closer() flushes and stops it."""
    if level == 0:
        return None, lambda: None
    from ..phase.report import FanOut  # noqa: PLC0415
    from ..phase.share import ShareTable  # noqa: PLC0415

    spans, tp, _ = span_sink()

    def close() -> None:  # after the timed decode, as the CLI does at request end
        spans.close()
        tp.shutdown()

    return FanOut(ShareTable(), spans), close


TRACE_CASES = (("replay", 4, 0.2), ("none", 1, None), ("ngram", 4, None), ("model", 4, None))


def _trace_case(s, name: str, k: int, corrupt: float | None) -> dict:
    """Levels 0, 1, 2 of one drafter's generation, interleaved repeats, median decode wall; the
    ranges' worst cases over the level-N and level-0 ranges (noise.Fig); `max_over_median`:
    the slowest repeat of a level over its median (a capture inside a traced request shows)."""
    b, prompt, n = s.bench, s.prompt, s.p.max_new
    rec = plain_decode(s)["result"].tokens
    mk = (lambda: b.drafter(name, rec, len(prompt), corrupt or 0.0, k=k))
    walls = {0: [], 1: [], 2: []}
    b.generate(mk(), prompt, min(8, n), k)  # warm-up at level 0 only: the first traced requests are timed
    for _ in range(s.p.trace_repeats):
        for lv in (0, 1, 2):
            sink, close = _trace_sink(lv)
            r = b.generate(mk(), prompt, n, k, TraceSettings(level=lv), sink)
            walls[lv].append(r.decode_s)
            close()
    f = {lv: Fig.of(w) for lv, w in walls.items()}
    ov = {lv: (f[lv] / f[0]).map(lambda x: (x - 1) * 100) for lv in (1, 2)}
    w0 = walls[0]
    noise = (max(w0) - min(w0)) / f[0].value * 100 if len(w0) > 1 else None
    out = {"drafter": name, "k": k, "tokens": n, "repeats": s.p.trace_repeats,
           "wall_s": {str(lv): round(v.value, 5) for lv, v in f.items()},
           "wall_s_all": {str(lv): [round(x, 5) for x in w] for lv, w in walls.items()},
           "overhead_pct": {str(lv): round(o.value, 3) for lv, o in ov.items()},
           "overhead_pct_range": {str(lv): o.rng(3) for lv, o in ov.items()},
           "max_over_median": {str(lv): round(max(w) / f[lv].value, 3) for lv, w in walls.items()},
           "level0_noise_pct": round(noise, 3) if noise is not None else None}
    if corrupt is not None:
        out["corrupt"] = corrupt
    if noise is None:
        out["level0_noise_why"] = f"{len(w0)} level-0 run(s); the spread needs >= 2"
    return out


def trace_levels(s) -> dict:
    """Levels 0, 1, 2 with each drafter (`TRACE_CASES`: replay at K=4 and acceptance ~0.8, plain,
    ngram, the draft model where the bench has one), interleaved repeats, median decode wall;
    spans go to a batched in-memory exporter (the SDK's real cost, no network). Level-0 noise
    = (max - min) / median of the level-0 walls, %. The replay case's figures stay at the top
    (its target rows); `by_drafter` holds every case; `clock`: how traced rounds were timed
    (plain greedy runs one step ahead at every level; the others use the default clock)."""
    cases = []
    for name, k, corrupt in TRACE_CASES:
        if name == "model" and s.bench.draft is None:
            continue
        if cases and s.left() <= 0:
            cases.append({"drafter": name, "k": k, "skipped": "budget"})
            continue
        cases.append(_trace_case(s, name, k, corrupt))
    out = dict(cases[0])
    out["clock"] = "events on CUDA (phase/clock.py), drained stamps on CPU; plain greedy: one step ahead"
    out["by_drafter"] = cases
    out["note"] = ("level 0 vs a build with the hooks removed is not measurable here; level0_noise_pct is the "
                   "spread of repeated level-0 runs")
    return out
