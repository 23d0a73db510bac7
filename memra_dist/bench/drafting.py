"""What drafting costs, per spec row: the draft phase per round and per drafted token read off
the engine's own phase clock (level-1 generations of the row, draft ns summed by the product's
ShareTable), the model drafter against the time to read its weights once at the measured copy
bandwidth, and the n-gram drafter's propose() timed directly at a long context. Every figure
is a median over repeats with their range (noise.Fig); derived ones carry the worst case."""

from __future__ import annotations

import time

import torch

from ..phase.levels import TraceSettings
from .checkpoints import DRAFT_OF, shape_config, weight_bytes
from .noise import Fig
from .timing import copy_bandwidth

__all__ = ["bandwidth_run", "draft_phase", "draft_weight_read", "ngram_propose", "phase_fields"]

DRAFT = 0  # the draft phase's index in a round's clock (tracing.conventions.PHASES)


def bandwidth_run(s) -> dict:
    """The run's copy bandwidth (timing.copy_bandwidth), measured once and shared by the
    bandwidth section and the draft weight-read time."""
    if "bw" not in s.memo:
        s.memo["bw"] = copy_bandwidth(s.device, s.p.copy_bytes, repeats=s.p.copy_repeats)
    return s.memo["bw"]


def draft_weight_read(s) -> dict:
    """The draft checkpoint's weight bytes at the run's dtype and the time to read them once
    at the measured bandwidth (ms; range from the bandwidth's range), memoized."""
    if "draft_read" not in s.memo:
        bw = bandwidth_run(s)
        name = DRAFT_OF[s.opts.shape]
        wb = weight_bytes(shape_config(name), s.dtype)
        lo, hi = bw["bandwidth_bytes_s_range"]
        fig = Fig.exact(wb * 1e3) / Fig(bw["bandwidth_bytes_s"], lo, hi, bw["repeats"])
        s.memo["draft_read"] = {"shape": name, "weight_bytes": wb, "bandwidth_bytes_s": bw["bandwidth_bytes_s"],
                                "read_ms": round(fig.value, 6), "read_ms_range": fig.rng(6), "repeats": fig.n,
                                "fig": fig, "formula": "draft weight-read ms = draft weight bytes / copy bandwidth"}
    return s.memo["draft_read"]


def draft_phase(s, name: str, k: int, corrupt: float | None) -> dict:
    """gen_repeats generations of one spec row (phase_new tokens: the row's max_new, capped on
    CUDA to bound the added wall) at trace level 1, each with a ShareTable sink (the product's
    phase-share table): its draft-phase ns over the run's rounds and over the tokens the run
    drafted. Returns the two Figs (ms), the repeat count and the tokens per run."""
    from ..phase.share import ShareTable  # noqa: PLC0415

    b, prompt, n = s.bench, s.prompt, s.p.phase_new
    rec = s.memo["plain"]["result"].tokens
    mk = (lambda: b.drafter(name, rec, len(prompt), corrupt or 0.0, k=k))
    level1 = TraceSettings(level=1)
    warm = s.memo.setdefault("warm", set())
    if (name, k, 1) not in warm:  # warm-up of this drafter at this K with the clock on
        b.generate(mk(), prompt, min(8, n), k, level1, ShareTable())
        warm.add((name, k, 1))
    per_round, per_tok = [], []
    for _ in range(s.p.gen_repeats):
        table = ShareTable()
        r = b.generate(mk(), prompt, n, k, level1, table)
        ms = table.ns[DRAFT] / 1e6
        if table.n_rounds:
            per_round.append(ms / table.n_rounds)
        if r.drafted:
            per_tok.append(ms / r.drafted)
    return {"per_round": Fig.of(per_round) if per_round else None,
            "per_tok": Fig.of(per_tok) if per_tok else None, "runs": s.p.gen_repeats, "tokens": n}


def phase_fields(s, name: str, k: int, corrupt: float | None) -> dict:
    """The row's draft-cost keys: draft_ms_per_round, draft_ms_per_drafted_token (with ranges);
    for the model drafter its weight-read time and the cost / weight-read ratio; for ngram the
    directly timed propose (us)."""
    d = draft_phase(s, name, k, corrupt)
    out = {"draft_phase_repeats": d["runs"], "draft_phase_tokens": d["tokens"],
           "draft_clock": "phase clock, trace level 1 (ShareTable draft ns)"}
    for key, f in (("draft_ms_per_round", d["per_round"]), ("draft_ms_per_drafted_token", d["per_tok"])):
        if f is not None:
            out[key], out[f"{key}_range"] = round(f.value, 6), f.rng(6)
    if name == "model" and d["per_tok"] is not None:
        w = draft_weight_read(s)
        ratio = d["per_tok"] / w["fig"]
        out.update(draft_weight_bytes=w["weight_bytes"], draft_weight_read_ms=w["read_ms"],
                   draft_weight_read_ms_range=w["read_ms_range"],
                   draft_cost_over_weight_read=round(ratio.value, 4), draft_cost_over_weight_read_range=ratio.rng(),
                   draft_cost_over_weight_read_repeats=ratio.n)
    if name == "ngram":
        p = ngram_propose(s.prompt, k, s.p.ngram_ctx, s.p.ngram_calls, s.p.ngram_repeats)
        out.update(ngram_propose_us=round(p["fig"].value, 3), ngram_propose_us_range=p["fig"].rng(3),
                   ngram_propose_repeats=p["fig"].n, ngram_propose_calls=p["calls"], ngram_propose_ctx=p["ctx"])
    return out


def ngram_propose(prompt: list[int], k: int, ctx: int, calls: int, repeats: int) -> dict:
    """Mean wall (us) of NgramDrafter.propose(k) over `calls` calls, `repeats` times (Fig of the
    repeats' means). The context is the prompt repeated to `ctx` tokens; it grows by one token
    (the repetition's next) between calls, untimed, as a round's commit grows it, so each call
    also indexes the new n-grams. The first call (indexing the whole context) is untimed."""
    from ..specdec.drafters import NgramDrafter  # noqa: PLC0415
    from ..specdec.sampling import SamplingParams  # noqa: PLC0415

    need = ctx + calls * repeats + 1
    src = prompt * (need // len(prompt) + 1)
    context = src[:ctx]
    d, sp, gen = NgramDrafter(), SamplingParams(), torch.Generator()
    d.propose(context, k, sp, gen)  # builds the index over the whole context
    means = []
    for _ in range(repeats):
        tot = 0
        for _ in range(calls):
            context.append(src[len(context)])
            t0 = time.perf_counter_ns()
            d.propose(context, k, sp, gen)
            tot += time.perf_counter_ns() - t0
        means.append(tot / calls / 1e3)
    return {"fig": Fig.of(means), "calls": calls, "ctx": ctx}
