"""Batched requests against one at a time, timed from the outside (issue 29's benchmark).

N concurrent callers of one engine (`app.open_engine(..., max_batch=B)`: what `batch` and `serve`
run) each generate one request; every token is stamped as the caller's stream callback
receives it. Per setting:

    decode tok/s     tokens after each request's first / from the first request's first token
                     to the last token (prefill steps of later arrivals included)
    steady tok/s     tokens received while every request was in flight (from the last
                     request's first token to the first request's last): the batch's decode
                     rate with no prefill step and no request already done
    ITL p50 / p99    gaps between a request's stream callbacks, over the tokens each delivered
    gap p50 / p99    the gaps themselves, each request's first (the ramp-up: first gap) apart
    TTFT p50 / p99   from the callers' start to each request's first token
    KV MB / request  the paged pool's bytes for one request's rows (prompt + new + K + 1, in
                     whole blocks)
plus the batcher's own counts (steps, requests and rows a step, graphed step ms, busy share).
Before the timed run the same callers run 8 tokens each at each level timed (the warm-up a
server gets from its first requests); the batcher's counts cover the timed run only.

The section (`memra-dist bench --sections batching`): plain greedy at 1, 4, 16 and 64 concurrent
callers on a GPU (1 and 4 on CPU), ngram (K = 4) and the replay drafter (K = 4, each request's
own greedy continuation corrupted at REPLAY_CORRUPT: a set acceptance, no draft cost) at 1 and
16 (CPU: 4), and the DFlash replay at 16 (CPU: 4: the bench's random DFlash drafter over the
target drafting in full, the step leader's shared block forwards, its drafts then replaced as
the replay drafter's: the same acceptance with the draft's cost paid), on the suite's copy-with-edits
prompts (512 tokens on a GPU, each request its own seed), every batched request's ids
checked against its one-at-a-time ids (request 0's: the same prompt). Three timed runs per
setting on one engine; plain and the DFlash replay at 16 (CPU: 4) run five, each at trace levels
0, 1 and 2 in turn (each request its share table and span sink, as the CLI builds them). Its
figures, with their worst-case ranges: steady tok/s over one request's decode tok/s at 16 and 64,
ITL p50 at 16 over alone, ngram over plain at 16, levels 1 and 2's costs in % at 16. Then issue
45's sweep (batching_sweep.py): --spec-k auto with ngram and the DFlash and EAGLE-3 replays at
1 to 64 concurrent (CPU: 1, 2, 4) over plain at each, the replays at ~0.8 of their drafts
right, at 16 and 64 (CPU: 4) ~0.6 and none right too; `memra-dist bench` charts it beside its
JSON (OUT-speedup.svg, and .png with matplotlib). It opens ~40 engines on a GPU: give the run
`--budget-s 2400` (what the budget leaves out is listed in the sweep's `skipped`). Last, issue
44's first token under load (ttft_load.py): 16 prompts of 512 together, the prefix cache off,
plain and ngram, over one 8k prompt alone.
`benchmarks/batching.py` is the same measurement as a script, any settings.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time

from .noise import Fig, fig_row as _row, ratio_row as _ratio, runs_fig as _of

__all__ = ["draft_over_read", "concurrent", "batching", "graphed_ms", "per_step", "figures", "fig", "rows", "REPORT"]

NEW, PROMPT, K = 64, 64, 4
REPEATS = 3  # timed runs per setting, on one engine (the figures' ranges)
REPEATS_TRACED = 5  # the row timing level 1 against level 0: a cost of a few % needs tighter ranges
RUN_KEYS = ("steady_tok_s", "decode_tok_s", "itl_ms_p50", "ttft_ms_p50")  # what a row keeps of each timed run
REPLAY_CORRUPT = 0.2  # the replay drafter's corruption rate: ~0.8 of its drafts right


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _level_sinks(level: int, n: int, spans_on: bool = True):
    """(share tables, span sinks, closer) for n callers at trace `level`, as the CLI builds
    them: each request its share table and its span sink, one tracer provider for them all
    (a server's), spans into an in-memory exporter (the SDK's real cost, no network)."""
    if level == 0:
        return [None] * n, [None] * n, lambda: None
    from ..phase.share import ShareTable  # noqa: PLC0415

    if not spans_on:  # the share tables alone (what the spans cost, taken apart)
        return [ShareTable() for _ in range(n)], [None] * n, lambda: None
    from ..tracing.deferred import DeferredSink  # noqa: PLC0415
    from ..tracing.emit import SpanSink  # noqa: PLC0415
    from .spans import span_sink  # noqa: PLC0415

    first, tp, _ = span_sink("memra.bench.batching")
    tracer = tp.get_tracer("memra.bench.batching")
    spans = [first] + [DeferredSink(SpanSink(tracer, None)) for _ in range(n - 1)]

    def close() -> None:
        for s in spans:
            s.close()
        tp.shutdown()
    return [ShareTable() for _ in range(n)], spans, close


def _tap_replay(eng, prompts: list[list[int]], recorded: list[list[int]], vocab: int, corrupt: float) -> None:
    """Each request the engine makes gets its tap drafter wrapped in TapReplay (tap_replay.py):
    the real drafts are paid in full (a batched engine's shared draft forwards, or the solo
    engine's own), then replaced by the request's recorded greedy continuation corrupted at
    `corrupt`."""
    from ..specdec.drafters.replay import ReplayDrafter  # noqa: PLC0415
    from .tap_replay import TapReplay, wrap_drafters  # noqa: PLC0415

    by_prompt = {tuple(p): r for p, r in zip(prompts, recorded)}
    wrap_drafters(eng, lambda d, prompt: TapReplay(d, ReplayDrafter(by_prompt[tuple(prompt)], len(prompt), vocab,
                                                                    corrupt, seed=1)))


def concurrent(model: str, device: str, n: int, max_batch: int, new: int = NEW, plen: int = PROMPT,
               drafter: str = "none", k: int = K, repeats: int = 1, levels: tuple[int, ...] = (0,),
               spans_on: bool = True, corrupt: float = REPLAY_CORRUPT, draft_model: str | None = None,
               recorded: list[list[int]] | None = None, profile=None, spec_k: str = "fixed",
               prefix_cache: bool = True, temperature: float = 0.0) -> dict:
    """n callers, each one request (greedy), on an engine of `max_batch` -> the setting's row
    (its `ids`: each request's token ids, for the caller's check against one at a time). With
    repeats > 1 the timed run is repeated on the same engine: the row's figures are the
    medians, `runs` keeps each run's (steady / decode tok/s, ITL p50). With more than one trace
    level, each repeat runs every level in turn (interleaved): the figures are the first
    level's, `by_level` each level's median steady tok/s and its runs. `drafter` "dflash-replay":
    the DFlash drafter at `draft_model` drafting in full, its
    drafts replaced by `recorded` (each request's greedy ids) corrupted at `corrupt`. `profile`: a
    context manager factory wrapped around the last timed run (benchmarks/batching.py
    --torch-profile). `spec_k`: the engine's --spec-k (fixed, or auto: each request's K by goodput).
    `prefix_cache`: the engine's (on by default): the warm-up runs the timed prompts, so with it on
    the timed runs' prompts are cached but their last block and TTFT is a cached prompt's; off,
    every run prefills its prompts whole (the first token under load). `temperature` > 0: every
    request sampled (top-k 50), request i seeded i."""
    from ..app import open_engine  # noqa: PLC0415
    from ..config import RunConfig  # noqa: PLC0415
    from ..model.config import load_config  # noqa: PLC0415
    from ..phase.levels import TraceSettings  # noqa: PLC0415
    from .runs import make_prompt  # noqa: PLC0415

    tap = drafter.endswith("-replay")
    if tap and (recorded is None or (draft_model is None and drafter != "mtp-replay")):  # (MTP: the target's own layer)
        raise ValueError(f"{drafter}: the draft checkpoint and each request's recorded ids")
    cfg = RunConfig(model=model, drafter=drafter[:-len("-replay")] if tap else drafter, k=k, device=device,
                    max_new_tokens=new, replay_corrupt=corrupt, draft_model=draft_model, spec_k=spec_k,
                    prefix_cache=prefix_cache)
    if temperature > 0:
        from ..specdec.sampling import SamplingParams  # noqa: PLC0415

        cfg = cfg.with_(sampling=SamplingParams(temperature=temperature, top_k=50))
    vocab = load_config(model).vocab_size  # the bench's copy-with-edits prompts, one seed per request
    prompts = [make_prompt(plen, vocab, seed=i) for i in range(n)]
    kv_mb = None
    runs: dict[int, list[dict]] = {lv: [] for lv in levels}
    with open_engine(cfg, capacity=plen + new + 2 * k, max_batch=max_batch) as eng:
        if tap:
            _tap_replay(eng, prompts, recorded, vocab, corrupt)
        ids: list[list[int] | None] = [None] * n
        tables: list = [None] * n
        spans: list = [None] * n

        tpr: list = [None] * n  # each request's tokens a round (its last run's)

        def one(i, c, sink):
            res = eng.generate(prompts[i], c.with_(seed=i), stream=sink, sink=tables[i], span_sink=spans[i])
            ids[i], tpr[i] = res.token_ids, res.stats.get("tokens_per_round")

        def callers(c, sinks):
            threads = [threading.Thread(target=one, args=(i, c, sinks[i])) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        for lv in levels:  # warm-up at every level timed (a traced server's first requests meet the SDK's first use)
            tables[:], spans[:], close = _level_sinks(lv, n, spans_on)
            callers(cfg.with_(max_new_tokens=8, trace=TraceSettings(level=lv)), [None] * n)
            close()
        backend = getattr(eng, "_backend", None)
        batcher = getattr(backend, "batcher", None)
        if batcher is not None:
            rows = -(-(plen + new + k + 1) // batcher.pool.block) * batcher.pool.block
            kv_mb = round(batcher.kv.slot_bytes() * rows / 2**20, 2)
        bstats = None
        phases: dict[int, dict] = {}
        for rep in range(max(1, repeats)):
            for lv in levels:
                if batcher is not None and lv == levels[0]:
                    from ..batching.stats import BatchStats  # noqa: PLC0415

                    batcher.stats = BatchStats()  # the timed runs' counts only (the first level's)
                tables[:], spans[:], close = _level_sinks(lv, n, spans_on)
                stamps: list[list[tuple[float, int]]] = [[] for _ in range(n)]
                last = rep == max(1, repeats) - 1 and lv == levels[0]
                with profile() if profile is not None and last else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    callers(cfg.with_(trace=TraceSettings(level=lv)),
                            [lambda toks, i=i, st=stamps: st[i].append((time.perf_counter(), len(toks)))
                             for i in range(n)])
                close()
                runs[lv].append(_timed(stamps, t0))
                if lv > 0:  # the engine's own account of the run: every request's rounds, ms a round by phase
                    phases[lv] = _phases_ms(tables)
                if lv == levels[0] and hasattr(backend, "stats"):
                    bstats = backend.stats()
    first = runs[levels[0]]
    mid = sorted(first, key=lambda r: r["steady_tok_s"] or r["decode_tok_s"])[len(first) // 2]
    row = {"concurrency": n, "max_batch": max_batch, "drafter": drafter, "spec_k": spec_k, "prefix_cache": prefix_cache,
           **({"temperature": temperature} if temperature > 0 else {}),
           **mid, "repeats": len(first),
           "runs": [{key: r[key] for key in RUN_KEYS} for r in first],
           "kv_mb_per_request": kv_mb, "batcher": bstats, "ids": ids,
           "tokens_per_round": round(statistics.mean(t for t in tpr if t is not None), 3) if any(tpr) else None}
    if phases:  # the last traced run's
        row["phases_ms_a_round"] = {str(lv): ph for lv, ph in phases.items()}
    if len(levels) > 1:
        row["by_level"] = {str(lv): {"steady_tok_s": statistics.median(r["steady_tok_s"] or r["decode_tok_s"] for r in rs),
                                     "runs": [{key: r[key] for key in RUN_KEYS}
                                              for r in rs]} for lv, rs in runs.items()}
    return row


def _phases_ms(tables) -> dict:
    """Every request's share table of a traced run merged: ms a round by phase, and rounds."""
    from ..phase.share import ShareTable  # noqa: PLC0415

    job = ShareTable()
    for t in tables:
        if t is not None:
            job.merge(t)
    return {**job.ms_a_round(), "rounds": job.n_rounds}


def _timed(stamps: list[list[tuple[float, int]]], t0: float) -> dict:
    """One timed run's figures from each request's (time, tokens) stream stamps.

    Three views of the gaps between a request's deliveries: `itl` divides each gap by the
    tokens it delivered (a speculative round that accepted nothing gives one token after a
    whole step, the rounds that accepted more give a share of one: its p99 over p50 grows with
    the tokens a round, whatever the engine does); `gap` is the gap itself (vLLM's serving
    benchmark's ITL: one entry a streamed chunk, what a reader of the stream waits);
    `first_gap` is the gap after each request's first token (the steps it waited while the
    requests that came with it were prefilled: the ramp-up), left out of `gap`.

    >>> s = [[(0.010, 1), (0.020, 1), (0.030, 4)], [(0.012, 1), (0.040, 2), (0.050, 1)]]
    >>> r = _timed(s, 0.0)
    >>> r["itl_ms_p50"], r["itl_ms_p99"]       # 10/1, 10/4, 28/2, 10/1 ms over their tokens
    (10.0, 14.0)
    >>> r["gap_ms_p50"], r["gap_ms_p99"]       # the later gaps: 10 and 10 ms
    (10.0, 10.0)
    >>> r["first_gap_ms_p50"], r["first_gap_ms_p99"]
    (28.0, 28.0)
    """
    end = max(s[-1][0] for s in stamps)
    after_first = sum(sum(c for _, c in s[1:]) for s in stamps)
    itl = [(b[0] - a[0]) * 1e3 / b[1] for s in stamps for a, b in zip(s, s[1:])]
    gap = [(b[0] - a[0]) * 1e3 for s in stamps for a, b in zip(s[1:], s[2:])]
    first_gap = [(s[1][0] - s[0][0]) * 1e3 for s in stamps if len(s) > 1]
    ttft = [(s[0][0] - t0) * 1e3 for s in stamps]
    lo, hi = max(s[0][0] for s in stamps), min(s[-1][0] for s in stamps)
    steady = sum(c for s in stamps for t, c in s[1:] if lo < t <= hi)

    def pct(xs, q):
        return round(_pct(xs, q), 3) if xs else None

    return {"tokens": sum(sum(c for _, c in s) for s in stamps),
            "aggregate_tok_s": round(after_first / (end - t0), 1),
            "decode_tok_s": round(after_first / (end - min(s[0][0] for s in stamps)), 1),
            "steady_tok_s": round(steady / (hi - lo), 1) if hi > lo else None,
            "itl_ms_p50": pct(itl, 0.5), "itl_ms_p99": pct(itl, 0.99),
            "gap_ms_p50": pct(gap, 0.5), "gap_ms_p99": pct(gap, 0.99),
            "first_gap_ms_p50": pct(first_gap, 0.5), "first_gap_ms_p99": pct(first_gap, 0.99),
            "ttft_ms_p50": round(statistics.median(ttft), 1), "ttft_ms_p99": round(_pct(ttft, 0.99), 1)}


def graphed_ms(bs: dict):
    """The mean step that replayed a graph (the eager ones, prefill chunks, taken out)."""
    n = bs.get("steps", 0) - bs.get("eager_steps", 0)
    return round((bs["step_ms"] - bs["eager_step_ms"]) / n, 3) if bs.get("eager_step_ms") is not None and n > 0 else "-"


def per_step(bs: dict, key: str):
    return round(bs[key] / bs["steps"], 3) if bs.get(key) is not None and bs.get("steps") else "-"


def _level_cost(row: dict | None, level: str = "1") -> list | None:
    """[value, lo, hi, n]: the % of steady tok/s that trace `level` costs against level 0 (the
    row's interleaved runs, `by_level`), with its worst-case range."""
    by = (row or {}).get("by_level") or {}
    if "0" not in by or level not in by:
        return None
    f0, f1 = (Fig.of([r["steady_tok_s"] or r["decode_tok_s"] for r in by[lv]["runs"]]) for lv in ("0", level))
    return _row((f0 / f1).map(lambda x: (x - 1) * 100))


def draft_over_read(draft_ms: float, forwards: int, weight_bytes: int, kv_bytes_pos: int, requests: float,
                    ctx: float, bandwidth_bytes_s: float) -> dict:
    """A step's draft phase (`draft_ms`: the engine's level-1 clock, ms a round; every request of a
    step shares its draft forwards, so a round's draft phase is the step's) against what its
    forwards must read: each reads the network's weights once (`weight_bytes`) and every
    request's draft K/V over its context (`requests` x `ctx` positions x `kv_bytes_pos`), at
    the measured copy bandwidth. `forwards`: an EAGLE-3 chain of K drafts runs K (one a drafted
    position), a DFlash block forward drafts every position at once (1).

    >>> r = draft_over_read(1.2, 4, 700_000_000, 4096, 16, 640, 4.0e12)
    >>> r["read_ms"], r["over_read"]              # 4 x (700 MB + 16 x 640 x 4 KB) / 4 TB/s
    (0.74194, 1.6174)
    """
    read = forwards * (weight_bytes + requests * ctx * kv_bytes_pos)
    read_ms = read / bandwidth_bytes_s * 1e3
    return {"draft_ms_a_step": round(draft_ms, 4), "forwards": forwards, "read_bytes": int(read),
            "read_ms": round(read_ms, 5), "over_read": round(draft_ms / read_ms, 4),
            "formula": "draft ms a round (level 1) / (forwards x (weight bytes + requests x context x K/V bytes a "
                       "position) / copy bandwidth)"}


def figures(plain: dict, ngram: dict, replay: dict | None = None, dflash: dict | None = None,
            auto: dict | None = None) -> dict:
    """The section's figures from its rows (keyed by concurrency), each [value, lo, hi, n]:
    steady rate over one request's decode rate, ITL p50 over alone, ngram's (and replay's, and
    the DFlash replay's) steady rate over plain's at the same concurrency, the DFlash replay's
    over the replay's (what its draft forwards cost: the same acceptance, drafts free), and trace
    levels 1 and 2's costs in % of the steady rate where the row ran them interleaved with level 0
    (plain's and the DFlash replay's)."""
    alone = plain.get("1")
    out = {}
    for n in ("4", "16", "64"):
        row = plain.get(n)
        if row is None:
            continue
        out[f"x{n}"] = _ratio(_of(row, "steady_tok_s"), _of(alone, "decode_tok_s"))
        out[f"itl_ratio_{n}"] = _ratio(_of(row, "itl_ms_p50"), _of(alone, "itl_ms_p50"))
        if n in ngram:
            out[f"ngram_over_plain_{n}"] = _ratio(_of(ngram[n], "steady_tok_s"), _of(row, "steady_tok_s"))
        if n in (replay or {}):
            out[f"replay_over_plain_{n}"] = _ratio(_of(replay[n], "steady_tok_s"), _of(row, "steady_tok_s"))
        if n in (dflash or {}):
            out[f"dflash_replay_over_plain_{n}"] = _ratio(_of(dflash[n], "steady_tok_s"), _of(row, "steady_tok_s"))
            if n in (replay or {}):
                out[f"dflash_replay_over_replay_{n}"] = _ratio(_of(dflash[n], "steady_tok_s"),
                                                               _of(replay[n], "steady_tok_s"))
        out[f"l1_cost_pct_{n}"], out[f"l2_cost_pct_{n}"] = _level_cost(row), _level_cost(row, "2")
        if n in (dflash or {}):
            out[f"dflash_replay_l1_cost_pct_{n}"] = _level_cost(dflash[n])
            out[f"dflash_replay_l2_cost_pct_{n}"] = _level_cost(dflash[n], "2")
        for name, rows_ in (auto or {}).items():  # --spec-k auto: over plain, and over its fixed K
            if n in rows_:
                out[f"{name}_auto_over_plain_{n}"] = _ratio(_of(rows_[n], "steady_tok_s"), _of(row, "steady_tok_s"))
                fixed = {"ngram": ngram, "dflash_replay": dflash or {}}[name].get(n)
                out[f"{name}_auto_over_fixed_{n}"] = _ratio(_of(rows_[n], "steady_tok_s"), _of(fixed, "steady_tok_s"))
    return {k: v for k, v in out.items() if v is not None}


def batching(s) -> dict:
    """The suite's section (see the module doc)."""
    from .checkpoints import ensure_checkpoint  # noqa: PLC0415

    cuda = s.device.type == "cuda"
    levels = (1, 4, 16, 64) if cuda else (1, 4)
    at = 16 if cuda else 4
    new = NEW // 2 if s.opts.quick else NEW
    plen = s.p.ctx  # the suite's copy-with-edits prompt length (512 on a GPU): what ngram copies from
    model = str(ensure_checkpoint(s.opts.shape, s.cache, s.device, s.say, s.ckpt_dtype))
    dev = str(s.device)
    plain: dict = {}
    ngram: dict = {}
    replay: dict = {}
    dflash: dict = {}
    alone_ids: dict = {}
    plain_ids: dict = {}  # each concurrency's requests' greedy ids: the DFlash replay's recordings
    fixed_ids: dict = {}  # (drafter, concurrency) -> the fixed-K rows' ids (the auto rows' check)
    draft = None
    auto: dict = {"ngram": {}, "dflash_replay": {}}  # --spec-k auto at `at` (spec_k.py), beside each fixed K
    for drafter, ns, rows, spec_k in (("none", levels, plain, "fixed"), ("ngram", (1, at), ngram, "fixed"),
                                      ("replay", (1, at), replay, "fixed"), ("dflash-replay", (at,), dflash, "fixed"),
                                      ("ngram", (at,), auto["ngram"], "auto"),
                                      ("dflash-replay", (at,), auto["dflash_replay"], "auto")):
        for n in ns:
            if s.left() <= 0:
                rows[str(n)] = {"skipped": "budget"}
                continue
            kw = {}
            if drafter == "dflash-replay":  # the bench's random DFlash drafter over the target, drafting in full
                if draft is None:
                    from .tap_checkpoints import ensure_dflash  # noqa: PLC0415

                    draft = str(ensure_dflash(s.opts.shape, s.cache, s.device, s.say, s.ckpt_dtype)[1])
                kw = dict(draft_model=draft, recorded=plain_ids[n])
            # levels 1 and 2's costs where the targets state them: plain and the DFlash replay at `at`
            traced = (0, 1, 2) if drafter in ("none", "dflash-replay") and spec_k == "fixed" and n == at else (0,)
            r = concurrent(model, dev, n, n, new, plen, drafter, repeats=REPEATS_TRACED if len(traced) > 1 else REPEATS,
                           levels=traced, spec_k=spec_k, **kw)
            ids = r.pop("ids")
            if drafter == "none":
                plain_ids[n] = ids
            if n > 1 and spec_k == "fixed":
                fixed_ids[(drafter, n)] = ids
            if spec_k == "auto":  # the same ids whatever K each round took (bf16: as far as the rows allow)
                r["ids_equal_fixed"] = ids == fixed_ids.get((drafter, n))
                if drafter == "dflash-replay":
                    r["ids_equal_plain"] = ids == plain_ids[n]
            elif n == 1:
                alone_ids[drafter] = ids[0]
            elif drafter == "dflash-replay":  # lossless: every request's ids are its plain greedy ids
                r["ids_equal_plain"] = ids == plain_ids[n]
            else:  # the requests' prompts differ: request 0's is the one-request run's
                r["first_ids_equal_alone"] = ids[0] == alone_ids.get(drafter)
            rows[str(n)] = r
            s.say(f"  batching {drafter}{' (--spec-k auto)' if spec_k == 'auto' else ''} x{n}: steady "
                  f"{r['steady_tok_s']} tok/s, ITL p50 {r['itl_ms_p50']} ms")
    def ran(rows):
        return {k: v for k, v in rows.items() if "skipped" not in v}

    def run(n, b, drafter, **kw):  # one setting at the section's model and repeats (the sweep's, ttft_load's)
        return concurrent(model, dev, n, b, **{"new": new, "plen": plen, "drafter": drafter, "repeats": REPEATS, **kw})

    drafts = {"dflash-replay": draft}

    def draft_dir(drafter):
        if drafts.get(drafter) is None:
            from . import tap_checkpoints as tc  # noqa: PLC0415

            ensure = {"dflash-replay": tc.ensure_dflash, "eagle3-replay": tc.ensure_eagle3}[drafter]
            drafts[drafter] = str(ensure(s.opts.shape, s.cache, s.device, s.say, s.ckpt_dtype)[1])
        return drafts[drafter]

    from .batching_sweep import sweep as run_sweep  # noqa: PLC0415

    reuse = {(d, at): ran(auto[key]).get(str(at)) for d, key in (("ngram", "ngram"), ("dflash-replay", "dflash_replay"))}
    swept = run_sweep(s, run, plain, plain_ids, {k: v for k, v in reuse.items() if v is not None}, draft_dir)
    from .ttft_load import ttft_under_load  # noqa: PLC0415

    load = ttft_under_load(s, run)
    return {"new": new, "prompt": plen, "k": K, "replay_corrupt": REPLAY_CORRUPT, "plain": plain, "ngram": ngram,
            "replay": replay, "dflash_replay": dflash, "auto": auto, "sweep": swept, "ttft_load": load,
            "figures": {**figures(ran(plain), ran(ngram), ran(replay), ran(dflash),
                                  {name: ran(rows_) for name, rows_ in auto.items()}),
                        **{f"sweep_{k}": v for k, v in swept["figures"].items()},
                        **{f"ttft_load_{k}": v for k, v in load.items() if k.endswith("_over_alone")}}}


REPORT = {  # the report's batch_* figures (bench/report.py TARGETS) -> the section's figure keys
    "batch_x16": "x16", "batch_x64": "x64", "batch_itl_ratio_16": "itl_ratio_16",
    "batch_ngram_over_plain_16": "ngram_over_plain_16", "batch_l1_cost_pct_16": "l1_cost_pct_16",
    "batch_l2_cost_pct_16": "l2_cost_pct_16", "batch_dflash_l1_cost_pct_16": "dflash_replay_l1_cost_pct_16",
    "batch_dflash_l2_cost_pct_16": "dflash_replay_l2_cost_pct_16",
    "batch_dflash_auto_over_plain_16": "dflash_replay_auto_over_plain_16",
    "batch_ngram_auto_over_plain_16": "ngram_auto_over_plain_16",
    "batch_ngram_sweep_16": "sweep_ngram_auto_over_plain_16", "batch_auto_never_slower": "sweep_auto_never_slower",
    **{f"batch_tap_auto_over_plain_{n}": f"sweep_tap_auto_over_plain_{n}" for n in (1, 2, 16, 64)},
    **{f"batch_ttft_load_{d}": f"ttft_load_{d}_over_alone" for d in ("plain", "ngram")},
}


def fig(res: dict, key: str) -> Fig | None:
    """A figure of the section's results for the report, with its range."""
    v = ((res.get("batching") or {}).get("figures") or {}).get(key)
    return None if v is None else Fig(v[0], v[1], v[2], v[3])


def rows(res: dict) -> list[tuple[str, str]]:
    """The report's lines for the section: each setting's steady and decode rates, ITL and TTFT."""
    b = res.get("batching") or {}
    out = []
    sets = [(d, b.get(d)) for d in ("plain", "ngram", "replay", "dflash_replay")]
    sets += [(f"{d}_auto", r) for d, r in (b.get("auto") or {}).items()]
    for drafter, by_n in sets:
        for n, r in (by_n or {}).items():
            if not isinstance(r, dict) or "steady_tok_s" not in r:
                continue
            kv = f", KV {r['kv_mb_per_request']} MB a request" if r.get("kv_mb_per_request") is not None else ""
            if drafter != "plain" and r.get("tokens_per_round") is not None:
                kv += f", {r['tokens_per_round']} tokens a round"
            name = {"replay": f"replay (corrupt {b.get('replay_corrupt')})",
                    "dflash_replay": f"DFlash replay (its drafts paid, corrupt {b.get('replay_corrupt')})",
                    "ngram_auto": "ngram --spec-k auto",
                    "dflash_replay_auto": f"DFlash replay --spec-k auto (corrupt {b.get('replay_corrupt')})"}.get(
                drafter, drafter)
            if r.get("batcher") and r["batcher"].get("k_chosen"):
                kv += (f", K chosen {r['batcher']['k_chosen']} ({r['batcher'].get('k_cut_rounds', 0)} rounds cut "
                       f"below their bound)")
            out.append((f"{name}, {n} concurrent " + ("batched" if n != "1" else "(one request)"),
                        f"steady {r['steady_tok_s'] or '-'} tok/s, decode {r['decode_tok_s']} tok/s, ITL p50 / p99 "
                        f"{r['itl_ms_p50']} / {r['itl_ms_p99']} ms, gap p50 / p99 {r.get('gap_ms_p50', '-')} / "
                        f"{r.get('gap_ms_p99', '-')} ms (first gap p99 {r.get('first_gap_ms_p99', '-')} ms), "
                        f"TTFT p50 {r['ttft_ms_p50']} ms{kv} "
                        f"(median of {r.get('repeats', 1)} runs)"))
    from .plot import speedups  # noqa: PLC0415

    load = b.get("ttft_load") or {}
    for d in ("none", "ngram"):  # issue 44's first token under load
        if isinstance(load.get(d), dict) and isinstance(load.get("alone"), dict):
            out.append((f"first token, {load['requests']} prompts of {load['prompt']} together ({d}, no prefix cache)",
                        f"TTFT p50 {load[d]['ttft_ms_p50']} ms against one {load['alone_prompt']}-token prompt alone: "
                        f"{load['alone']['ttft_ms_p50']} ms"))
    for name, pts in speedups((b.get("sweep") or {}).get("rows") or []).items():  # issue 45's sweep, a line a series
        out.append((f"sweep: {name} over plain", ", ".join(f"{n}: {v:.2f}x" for n, v in pts)))
    return out
