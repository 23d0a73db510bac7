"""The EAGLE-3 drafter's round graphs (specdec/drafters/eagle3_graph.py) on the GPU: the graphed
drafts against the eager ones, and the draft phase's time (issue 28 item 4).

One engine (the default path: graphs, compile and our kernels on CUDA) over the bench's Llama
target and a random bf16 EAGLE-3 head (tap_checkpoints.ensure_eagle3: the public Llama-3.1-8B
EAGLE-3 layout at --shape 8b), K = --k:
  same     a greedy request whose drafts are replaced after each propose by the request's own
           greedy continuation, corrupted at a rate per round (bench/tap_replay.py), so the
           acceptance varies round to round (every first-forward row count runs); run once
           through the drafter's graphs and once with them switched off (its eager steps):
           every round's own drafts must be equal (same kernels, same shapes), and both
           outputs equal the request's greedy continuation (lossless).
  timing   propose(k) at the request's end context (rows = 1: the round after a rejection),
           graphed and eager, k = 1, 3, K: wall per round with a device sync on both sides
           (launches included, as a round pays them) and device ms by events, per drafted token,
           and over the weight read per drafted token (tap_checkpoints.eagle3_read_bytes at the
           measured copy bandwidth; target <= 1.5).
  kernels  the kernels of one graphed greedy round of K drafts (the profiler), largest first.

    python benchmarks/eagle3_graph_check.py OUT_DIR [--shape 8b|tiny] [--k 7] [--cache DIR]
Writes OUT_DIR/eagle3_graph_check.json and prints it; exit 1 when the drafts differ or the
output is not lossless. On a CPU (no graphs) it runs the eager half only (a smoke run)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from memra_dist.app import open_engine
from memra_dist.bench import tap_checkpoints as tc
from memra_dist.bench.roofline import roofline_tok_s
from memra_dist.bench.runs import make_prompt
from memra_dist.bench.tap_replay import TapReplay
from memra_dist.bench.timing import copy_bandwidth, time_call
from memra_dist.config import RunConfig
from memra_dist.specdec.drafters.replay import ReplayDrafter
from memra_dist.specdec.sampling import SamplingParams

SIZES = {"8b": dict(prompt=512, new=192, iters=50), "tiny": dict(prompt=48, new=48, iters=5)}


def _say(*a) -> None:
    print("[eagle3_graph_check]", *a, file=sys.stderr, flush=True)


def _spied(d):
    """Record each propose's own drafts (a readback a round: this check's, not the engine's)."""
    seen, real = [], d.propose

    def propose(context, k, sp, gen):
        p = real(context, k, sp, gen)
        seen.append((len(context), p.tokens.tolist()))
        return p

    d.propose = propose
    return seen, real


def _drafts_run(engine, local, d, prompt, cfg, recorded, graphed: bool) -> dict:
    keep = d.graph
    d.graph = keep if graphed else None
    seen, real = _spied(d)
    local.drafter = TapReplay(d, ReplayDrafter(recorded, len(prompt), engine.model.vocab_size, 0.35, seed=1))
    try:
        res = engine.generate(prompt, cfg)
    finally:
        local.drafter, d.propose, d.graph = d, real, keep
    return {"ids": res.token_ids, "rounds": seen, "stats": res.stats}


def _time_propose(d, context, k, graphed: bool, iters: int, dev) -> dict:
    keep = d.graph
    d.graph = keep if graphed else None
    sp, gen = SamplingParams(), torch.Generator()
    try:
        d.propose(context, k, sp, gen)  # rows [n, N - 1) ingested; every call after: one row
        wall = time_call(lambda: d.propose(context, k, sp, gen), dev, iters, warmup=3)
        dev_ms = None
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            e0.record()
            for _ in range(iters):
                d.propose(context, k, sp, gen)
            e1.record()
            torch.cuda.synchronize()
            dev_ms = e0.elapsed_time(e1) / iters  # back to back: the device's time when it keeps up
    finally:
        d.graph = keep
    ms = wall["median_s"] * 1e3
    return {"wall_ms_per_round": round(ms, 4), "wall_ms_per_token": round(ms / k, 4),
            "back_to_back_ms_per_round": None if dev_ms is None else round(dev_ms, 4)}


def _kernels(d, context, k) -> list:
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    g, N = d.graph, len(context)
    lo = min(d.n, N - 2)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.greedy(context, lo, k)
        torch.cuda.synchronize()
    rows = [(e.device_time_total, e.count, e.key) for e in prof.key_averages() if e.device_time_total > 0]
    return [{"us": round(t, 2), "calls": c, "name": n[:120]} for t, c, n in sorted(rows, reverse=True)[:40]]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="8b", choices=tuple(SIZES))
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--cache", default=os.environ.get("MEMRA_BENCH_CACHE", "/tmp/memra-bench-ckpt"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sz, K = SIZES[a.shape], a.k
    target, draft = tc.ensure_eagle3(a.shape, Path(a.cache), dev, _say)
    ecfg = json.loads((draft / "config.json").read_text())
    prompt = make_prompt(sz["prompt"], ecfg["vocab_size"])
    cfg = RunConfig(model=str(target), drafter="eagle3", draft_model=str(draft), k=K, max_new_tokens=sz["new"])
    res: dict = {"shape": a.shape, "k": K, "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
                 "torch": torch.__version__, "graphs": cfg.use_graphs(dev)}
    t0 = time.perf_counter()
    with open_engine(cfg, len(prompt) + sz["new"] + K + 1) as engine:
        res["open_s"] = round(time.perf_counter() - t0, 1)
        # the greedy continuation (speculative greedy output is plain decoding's: tests/test_eagle3.py)
        recorded = engine.generate(prompt, cfg).token_ids
        local = engine._backend  # the pp=1 backend keeps the drafter between requests (loaded by the first)
        d = local.drafter
        g = d.graph
        res["drafter_graphs"] = None if g is None else sorted(str(key) for key in g.graphs)
        _say(f"open {res['open_s']} s; drafter graphs: {res['drafter_graphs']}")
        runs = {"eager": _drafts_run(engine, local, d, prompt, cfg, recorded, False)}
        if g is not None:
            runs["graphed"] = _drafts_run(engine, local, d, prompt, cfg, recorded, True)
        e = runs["eager"]
        res["same"] = {"rounds": len(e["rounds"]), "accepted": e["stats"]["accepted"],
                       "drafted": e["stats"]["drafted"],
                       "row_counts": sorted(set(_first_rows(e["rounds"]))),
                       "eager_lossless": e["ids"] == recorded}
        ok = res["same"]["eager_lossless"]
        if "graphed" in runs:
            gr = runs["graphed"]
            diff = [i for i, (x, y) in enumerate(zip(gr["rounds"], e["rounds"])) if x != y]
            res["same"].update(graphed_lossless=gr["ids"] == recorded, rounds_equal=gr["rounds"] == e["rounds"],
                               first_differing_rounds=diff[:10], differing=len(diff))
            ok = ok and gr["ids"] == recorded and gr["rounds"] == e["rounds"]
        _say(f"drafts: {res['same']}")
        context = prompt + recorded[:-1]
        bw = copy_bandwidth(dev, (2 << 30) if dev.type == "cuda" else (64 << 20))
        res["bandwidth_tb_s"] = round(bw["bandwidth_tb_s"], 4)
        res["timing"] = {}
        for k in sorted({1, 3, K}):
            rb = tc.eagle3_read_bytes(ecfg, k)
            read_ms = 1e3 / roofline_tok_s(bw["bandwidth_bytes_s"], rb["bytes"])
            row = {"read_ms_per_token": round(read_ms, 5)}
            for mode in (("eager", "graphed") if g is not None else ("eager",)):
                t = _time_propose(d, context, k, mode == "graphed", sz["iters"], dev)
                t["over_read"] = round(t["wall_ms_per_token"] / read_ms, 4)
                row[mode] = t
            res["timing"][str(k)] = row
            _say(f"k={k}: {row}")
        if g is not None and dev.type == "cuda":
            res["kernels_of_a_round"] = _kernels(d, context, K)
    res["ok"] = bool(ok)
    (out / "eagle3_graph_check.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0 if ok else 1


def _first_rows(rounds) -> list[int]:
    """Each round's first-forward row count (committed rows since the round before, + 1)."""
    out, prev = [], None
    for N, _ in rounds:
        out.append(1 if prev is None else N - prev)
        prev = N
    return out


if __name__ == "__main__":
    sys.exit(main())
