"""What tracing costs with each drafter, timed from the outside (issue 32).

Per case, one engine through `memra_dist.app.open_engine` with a default RunConfig (the
user's path: graphs, kernels, compile auto), then requests through `Engine.generate` at trace
levels 0, 1 and 2 (event clock, the default) and at levels 1 and 2 with MEMRA_PHASE_CLOCK's
`drain` (the seed's literal clock, for comparison), in interleaved repeats. Each traced
request builds its spans as the CLI does (DeferredSink over SpanSink, a BatchSpanProcessor,
an in-memory exporter: the SDK's real cost without a network) and feeds a phase-share table.
Decode tok/s: tokens after the first over the first to the last streamed token.

Cases (8B shape: the bench's chain-structured Llama target, random bf16; prompt: the bench's
copy-with-edits prompt):
  plain   no drafter (greedy decode runs one step ahead at every level)
  ngram   K = 4 on the copy-with-edits prompt
  model   the bench's draft checkpoint (the 1B shape over the 8B), K = 4
  dflash  a random DFlash drafter (benchmarks/tap_drafters.py's layout), its block drafted in full
          every round, its drafts replaced by the recorded greedy continuation corrupted to an
          acceptance of ~0.8 per token (bench/tap_replay.py), K = 7
No level-2 twin or timed stamp is captured inside a traced request: the first traced request
after a level-0 warm-up is in the repeats, and `max_over_median` says whether one was slow.

    python benchmarks/trace_cost.py OUT_DIR [--shape 8b|tiny] [--cases plain,ngram,model,dflash]
                                    [--new 256] [--repeats 5] [--warmup 2] [--explain]
Results: OUT_DIR/trace_cost.json and a markdown table on stdout; a line per run on stderr."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

RUNS = ((0, "events"), (1, "events"), (2, "events"), (1, "drain"), (2, "drain"))
# --explain: level 1 taken apart: without spans (the clock and the share table alone), and with
# spans but the garbage collector off (what the spans' allocations cost in collections)
# and with spans built only after the request (no pump in the rounds)
EXPLAIN = ((1, "nospans"), (1, "nogc"), (1, "nopump"))
K = {"plain": 1, "ngram": 4, "model": 4, "dflash": 7}


def _say(*a) -> None:
    print("[trace_cost]", *a, file=sys.stderr, flush=True)


def _span_sink():
    """The bench's span sink (bench/sections.py), its pump timed."""
    from memra_dist.bench.spans import span_sink  # noqa: PLC0415

    sink, tp, exp = span_sink("memra.trace_cost")
    pump = sink.pump

    def timed_pump(*a, **kw):  # the host time span building takes inside the rounds (in the verify's shadow)
        t = time.perf_counter_ns()
        pump(*a, **kw)
        HOST["pump_ns"] += time.perf_counter_ns() - t
    sink.pump = timed_pump
    return sink, tp, exp


class _AfterRequest:
    """A DeferredSink without its pump: the session builds no span in its rounds; every span
    is built at close, after the request's last token (--explain's nopump)."""

    def __init__(self, inner):
        self.inner = inner

    def burst(self, rec) -> None:
        self.inner.burst(rec)

    def first_token(self, prof) -> None:
        self.inner.first_token(prof)

    def rounds(self, log, final) -> None:
        pass

    def close(self) -> None:
        self.inner.close()


HOST = {"pump_ns": 0, "resolve_ns": 0, "resolves": 0}
# --explain: the host's critical path of a round whose draft is host work (ngram): from the accept's
# readback returning to the next verify's launch (within a burst, and across a burst boundary),
# and the garbage collector's pauses in the request
GAP: dict = {"rb": 0, "new_burst": False, "in": [], "across": [], "gc": [], "gc_t": 0}


def _time_gaps() -> None:
    """Bench-side wrappers (--explain): the readback's return (greedy_commit), a burst's start,
    the next verify row built (the launch right after); gc.callbacks for the collector."""
    import gc  # noqa: PLC0415

    from memra_dist.specdec import session as sm  # noqa: PLC0415

    commit, verify_ids, burst = sm.greedy_commit, sm.SpecSession._verify_ids, sm.SpecSession.burst

    def greedy_commit(*a, **kw):
        out = commit(*a, **kw)
        GAP["rb"] = time.perf_counter_ns()
        return out

    def _verify_ids(self, drafts):
        if GAP["rb"]:
            GAP["across" if GAP["new_burst"] else "in"].append(time.perf_counter_ns() - GAP["rb"])
        GAP["rb"], GAP["new_burst"] = 0, False
        return verify_ids(self, drafts)

    def burst_(self, *a, **kw):
        GAP["new_burst"] = True
        return burst(self, *a, **kw)

    def on_gc(phase, info):
        if phase == "start":
            GAP["gc_t"] = time.perf_counter_ns()
        elif GAP["gc_t"]:
            GAP["gc"].append((info["generation"], time.perf_counter_ns() - GAP["gc_t"]))
    sm.greedy_commit, sm.SpecSession._verify_ids, sm.SpecSession.burst = greedy_commit, _verify_ids, burst_
    gc.callbacks.append(on_gc)


def _gap_stats() -> dict:
    def us(xs: list[int]) -> dict:
        if not xs:
            return {"n": 0}
        xs = sorted(xs)
        return {"n": len(xs), "p50_us": round(xs[len(xs) // 2] / 1e3, 1), "mean_us": round(sum(xs) / len(xs) / 1e3, 1),
                "p99_us": round(xs[min(len(xs) - 1, int(len(xs) * 0.99))] / 1e3, 1), "max_us": round(xs[-1] / 1e3, 1)}
    gcs = GAP["gc"]
    return {"in_burst": us(GAP["in"]), "across_bursts": us(GAP["across"]),
            "gc": {f"gen{g}": {"n": sum(1 for x, _ in gcs if x == g),
                               "ms": round(sum(d for x, d in gcs if x == g) / 1e6, 2),
                               "max_ms": round(max((d for x, d in gcs if x == g), default=0) / 1e6, 2)}
                   for g in (0, 1, 2)}}


def _time_resolve() -> None:
    """The event clock's once-a-burst read (its wait and the event reads), timed (a bench-side wrapper)."""
    from memra_dist.phase.clock import PhaseClock  # noqa: PLC0415

    inner = PhaseClock.resolve

    def resolve(self, rounds, bank=None):
        t = time.perf_counter_ns()
        inner(self, rounds, bank)
        HOST["resolve_ns"] += time.perf_counter_ns() - t
        HOST["resolves"] += 1
    PhaseClock.resolve = resolve


def _request(engine, prompt, cfg, level: int, clock: str) -> dict:
    """`clock`: events | drain, or an --explain variant of the event clock (nospans, nogc)."""
    import gc  # noqa: PLC0415

    from memra_dist.phase.levels import TraceSettings  # noqa: PLC0415
    from memra_dist.phase.share import ShareTable  # noqa: PLC0415
    from memra_dist.tracing.conventions import PHASES  # noqa: PLC0415

    stamps: list[tuple[float, int]] = []
    share = ShareTable() if level else None
    spans = tp = exp = None
    if level and clock != "nospans":
        spans, tp, exp = _span_sink()
        if clock == "nopump":  # built at close, after the last token
            spans = _AfterRequest(spans)
    c = cfg.with_(trace=TraceSettings(level=level, clock="drain" if clock == "drain" else "events"))
    for key in HOST:
        HOST[key] = 0
    GAP.update(rb=0, new_burst=False, **{"in": [], "across": [], "gc": []})
    if clock == "nogc":
        gc.disable()
    try:
        res = engine.generate(prompt, c, stream=lambda t: stamps.append((time.perf_counter(), len(t))), sink=share,
                              span_sink=spans)
    finally:
        gc.enable()
    (t0, _), (t1, _) = stamps[0], stamps[-1]
    n_after = sum(n for _, n in stamps[1:])
    st = res.stats
    out = {"level": level, "clock": clock, "ids": res.token_ids, "decode_s": t1 - t0,
           "tok_s": n_after / (t1 - t0) if t1 > t0 else 0.0, "rounds": st["rounds"],
           "tokens_per_round": st["tokens_per_round"], "ttft_ms": st["ttft_ms"], "gaps": _gap_stats()}
    if spans is not None:
        spans.close()
        tp.shutdown()
    if share is not None:
        n = max(share.n_rounds, 1)
        out["pump_ms_per_round"] = HOST["pump_ns"] / 1e6 / n
        out["resolve_ms_per_burst"] = HOST["resolve_ns"] / 1e6 / max(HOST["resolves"], 1)
        out["phase_ms"] = {p: ns / 1e6 / n for p, ns in zip(PHASES, share.ns)}
        out["host_ms"] = {p: ns / 1e6 / n for p, ns in zip(PHASES, share.host_ns)}
        out["spans"] = len(exp.get_finished_spans()) if exp is not None else 0
        out["clock_used"] = "+".join(k for k, v in share.by_clock.items() if v) or "none"
        out["table"] = share.table()
    return out


def _case(name: str, a, dev, cache: Path, prompt: list[int], recorded: list[int] | None) -> dict:
    import torch  # noqa: PLC0415

    from memra_dist.app import open_engine  # noqa: PLC0415
    from memra_dist.bench import tap_checkpoints as tc  # noqa: PLC0415
    from memra_dist.bench.checkpoints import DRAFT_OF, ensure_checkpoint  # noqa: PLC0415
    from memra_dist.bench.tap_replay import TapReplay, wrap_drafters  # noqa: PLC0415
    from memra_dist.config import RunConfig  # noqa: PLC0415
    from memra_dist.specdec.drafters.replay import ReplayDrafter  # noqa: PLC0415

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = ensure_checkpoint(a.shape, cache, dev, _say, dtype)
    # fixed K: every level must run the same rounds (under --spec-k auto, the default, a round's K
    # follows the step times the engine measures, so two levels would run different work)
    kw = dict(model=str(target), max_new_tokens=a.new, k=K[name], drafter={"plain": "none"}.get(name, name),
              spec_k="fixed")
    if name == "model":
        kw["draft_model"] = str(ensure_checkpoint(DRAFT_OF[a.shape], cache, dev, _say, dtype))
    if name == "dflash":
        kw["draft_model"] = str(tc.ensure_dflash(a.shape, cache, dev, _say, dtype)[1])
    cfg = RunConfig(**kw)
    out: dict = {"case": name, "k": K[name], "graphs": cfg.graphs, "compile": cfg.compile}
    t = time.perf_counter()
    with open_engine(cfg, len(prompt) + a.new + K[name] + 1) as engine:
        out["open_s"] = round(time.perf_counter() - t, 1)
        if name == "dflash":  # the same corrupted drafts in every request (a new replay's generator each)
            wrap_drafters(engine, lambda d, _p: TapReplay(d, ReplayDrafter(recorded, len(prompt),
                                                                           engine.model.vocab_size, 0.2, seed=1)))
            out["corrupt"] = 0.2
        for _ in range(a.warmup):  # warm-up at level 0 only (clocks up): level 1 / 2's first requests are timed
            _request(engine, prompt, cfg, 0, "events")
        plan = RUNS + (EXPLAIN if a.explain else ())
        runs = {f"{lv}/{ck}": [] for lv, ck in plan}
        for rep in range(a.repeats):
            for lv, ck in plan:
                r = _request(engine, prompt, cfg, lv, ck)
                runs[f"{lv}/{ck}"].append(r)
                _say(f"{name} rep {rep} level {lv} {ck}: {r['tok_s']:.1f} tok/s, {r['rounds']} rounds")
    ids0 = runs["0/events"][0]["ids"]
    out["ids_equal"] = all(r["ids"] == ids0 for rs in runs.values() for r in rs)
    out["rounds_equal"] = len({r["rounds"] for rs in runs.values() for r in rs}) == 1
    if name == "plain":
        out["recorded"] = ids0
    base = statistics.median(r["decode_s"] for r in runs["0/events"])
    w0 = [r["decode_s"] for r in runs["0/events"]]
    out["level0"] = {"tok_s": round(statistics.median(r["tok_s"] for r in runs["0/events"]), 2),
                     "noise_pct": round((max(w0) - min(w0)) / base * 100, 2),
                     "tokens_per_round": runs["0/events"][0]["tokens_per_round"]}
    out["runs"] = {}
    for key, rs in runs.items():
        walls = [r["decode_s"] for r in rs]
        med = statistics.median(walls)
        row = {"overhead_pct": round((med / base - 1) * 100, 2),
               "overhead_pct_all": [round((w / base - 1) * 100, 2) for w in walls],
               "max_over_median": round(max(walls) / med, 3), "tok_s": round(statistics.median(r["tok_s"] for r in rs), 2)}
        if "phase_ms" in rs[0]:
            row["phase_ms"] = {p: round(statistics.median(r["phase_ms"][p] for r in rs), 4) for p in rs[0]["phase_ms"]}
            row["host_ms"] = {p: round(statistics.median(r["host_ms"][p] for r in rs), 4) for p in rs[0]["host_ms"]}
            row["spans"] = rs[0]["spans"]
            row["clock_used"] = rs[0]["clock_used"]
            for f in ("pump_ms_per_round", "resolve_ms_per_burst"):
                row[f] = round(statistics.median(r[f] for r in rs), 4)
            row["table"] = rs[len(rs) // 2]["table"]
        row["gaps"] = rs[len(rs) // 2]["gaps"]
        out["runs"][key] = row
    for lv in (1, 2):  # the event clock's phases against the draining clock's on the same rounds
        ev, dr = out["runs"][f"{lv}/events"].get("phase_ms"), out["runs"][f"{lv}/drain"].get("phase_ms")
        if ev and dr:
            out[f"level{lv}_phase_vs_drain"] = {p: {"events_ms": ev[p], "drain_ms": dr[p],
                                                    "diff_ms": round(ev[p] - dr[p], 4),
                                                    "diff_pct": round((ev[p] / dr[p] - 1) * 100, 2) if dr[p] else None}
                                                for p in ev}
    return out


def probe() -> dict:
    """--explain on CUDA: what the clock's host calls cost, and whether reading free memory
    waits for the device (timed while ~25 ms of matmuls are queued)."""
    import torch  # noqa: PLC0415

    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    x @ x
    torch.cuda.synchronize()

    def busy() -> float:
        for _ in range(20):
            x @ x
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    queued = busy()
    for _ in range(20):
        x @ x
    t0 = time.perf_counter()
    torch.cuda.mem_get_info()
    during = time.perf_counter() - t0
    torch.cuda.synchronize()
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(1000)]
    t0 = time.perf_counter()
    for e in evs:
        e.record()
    rec = (time.perf_counter() - t0) / len(evs)
    from memra_dist.device import CudaMarks  # noqa: PLC0415

    m = CudaMarks(torch.device("cuda"))
    m.bind()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for e in evs:
        m.record(e)
    rec_clock = (time.perf_counter() - t0) / len(evs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for a, b in zip(evs, evs[1:]):
        a.elapsed_time(b)
    el = (time.perf_counter() - t0) / (len(evs) - 1)
    t0 = time.perf_counter()
    for _ in range(1000):
        torch.cuda.mem_get_info()
    idle = (time.perf_counter() - t0) / 1000
    return {"queued_work_ms": round(queued * 1e3, 3), "mem_get_info_busy_ms": round(during * 1e3, 3),
            "mem_get_info_idle_us": round(idle * 1e6, 2), "event_record_us": round(rec * 1e6, 2),
            "clock_record_us": round(rec_clock * 1e6, 2),
            "elapsed_time_us": round(el * 1e6, 2)}


def table(res: dict) -> str:
    lines = ["| case | K | level-0 tok/s | level-0 noise | L1 (events) | L2 (events) | L1 (drain) | L2 (drain) | "
             "worst repeat / median (L1, L2) | ids equal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in res["cases"]:
        r = c["runs"]
        lines.append(f"| {c['case']} | {c['k']} | {c['level0']['tok_s']} | {c['level0']['noise_pct']} % | "
                     f"{r['1/events']['overhead_pct']:+.2f} % | {r['2/events']['overhead_pct']:+.2f} % | "
                     f"{r['1/drain']['overhead_pct']:+.2f} % | {r['2/drain']['overhead_pct']:+.2f} % | "
                     f"{r['1/events']['max_over_median']} / {r['2/events']['max_over_median']} | {c['ids_equal']} |")
    lines += ["", "Level 1, ms a round by phase, event clock / draining clock (median over the repeats):", "",
              "| case | draft | verify | accept | rollback | maint |", "|---|---|---|---|---|---|"]
    for c in res["cases"]:
        cmp_ = c.get("level1_phase_vs_drain")
        if cmp_:
            lines.append(f"| {c['case']} | " + " | ".join(f"{v['events_ms']:.3f} / {v['drain_ms']:.3f}"
                                                         for v in cmp_.values()) + " |")
    if any("gaps" in c["runs"]["0/events"] and c["runs"]["0/events"]["gaps"]["in_burst"]["n"] for c in res["cases"]):
        lines += ["", "Host critical path of a round (--explain): readback to the next verify's launch, us "
                  "(p50 / mean / p99 / max), within a burst and across a burst boundary; collector pauses:", "",
                  "| case | run | in burst | across bursts | gc gen0 / gen1 / gen2 (n, ms) |", "|---|---|---|---|---|"]
        for c in res["cases"]:
            for key, r in c["runs"].items():
                g = r.get("gaps")
                if not g or not g["in_burst"]["n"]:
                    continue
                f = lambda d: " / ".join(str(d.get(x, "-")) for x in ("p50_us", "mean_us", "p99_us", "max_us"))  # noqa: E731
                gc_ = ", ".join(f"{v['n']} {v['ms']}" for v in g["gc"].values())
                lines.append(f"| {c['case']} | {key} | {f(g['in_burst'])} | {f(g['across_bursts'])} | {gc_} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shape", default="8b", choices=["8b", "tiny"])
    ap.add_argument("--cases", default="plain,ngram,model,dflash")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="level-0 requests before the repeats (the GPU's clocks ramp up)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--explain", action="store_true", help="also level 1 without spans, with the collector off and with spans built after the "
                    "request; the host's critical path of each run's rounds (readback to next launch) and "
                    "its collector pauses")
    a = ap.parse_args()
    import torch  # noqa: PLC0415

    from memra_dist.bench.checkpoints import bench_cache_dir, shape_config  # noqa: PLC0415
    from memra_dist.bench.runs import make_prompt  # noqa: PLC0415

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    _time_resolve()
    if a.explain:
        _time_gaps()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cache = bench_cache_dir()
    prompt = make_prompt(a.prompt, shape_config(a.shape)["vocab_size"])
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in K]
    if bad:
        print(f"trace_cost: unknown case(s) {', '.join(bad)} (choose from {', '.join(K)})", file=sys.stderr)
        return 2
    res = {"shape": a.shape, "new": a.new, "repeats": a.repeats, "prompt": a.prompt, "torch": torch.__version__,
           "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "cases": []}
    if dev.type == "cuda":
        res["probe"] = probe()
        _say(f"probe: {res['probe']}")
    recorded = None
    if "dflash" in cases and "plain" not in cases:
        cases.insert(0, "plain")  # the DFlash replay follows the plain greedy continuation
    for name in cases:
        t = time.perf_counter()
        r = _case(name, a, dev, cache, prompt, recorded)
        recorded = r.pop("recorded", recorded)
        r["wall_s"] = round(time.perf_counter() - t, 1)
        res["cases"].append(r)
        (out / "trace_cost.json").write_text(json.dumps(res, indent=1))
        _say(f"{name}: done in {r['wall_s']} s")
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
