"""Kimi hybrid on CUDA graphs (bf16, the bench's hybrid shape). ONE runner (fused weights),
run with its graphs and with them switched off, so the ids compare the capture itself (two
runners differ in bf16 rounding: the graphed one fuses gate-up): greedy ids with graphs equal
the eager ids, plain and with the replay drafter at K=4 (partial accepts, so captured KDA
steps run after rollbacks at every position); then step and rollback costs both ways.
The prompt stays under the snapshot ring (33 rows), so no chunked prefill (and its
first-call Triton autotune) is timed.
usage: python benchmarks/kimi_graphs_check.py OUT_DIR"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from memra_dist.bench.checkpoints import bench_cache_dir, ensure_checkpoint
from memra_dist.engine import ModelRunner
from memra_dist.spec.drafters.none import NoDrafter
from memra_dist.spec.sampling import SamplingParams
from memra_dist.spec.session import SpecSession

out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/out")
out.mkdir(parents=True, exist_ok=True)
# KIMI_CHECK_DRY=1: the tiny shape on CPU (graphs inactive), to check the script itself
DRY = os.environ.get("KIMI_CHECK_DRY") == "1"
dev, T0 = torch.device("cpu" if DRY else "cuda"), time.perf_counter()
path = ensure_checkpoint("kimi-tiny" if DRY else "kimi", bench_cache_dir(), dev, print)
DT = torch.float32 if DRY else torch.bfloat16
sync = (lambda: None) if DRY else torch.cuda.synchronize
res: dict = {}


def log(*a):
    print(f"[kimi_graphs {time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def generate(r, drafter, prompt, n=48, k=4):
    s = SpecSession(r, drafter, SamplingParams(), torch.Generator().manual_seed(0), k)
    ids = [s.start(prompt, n, 1024)]
    while not s.done:
        ids.extend(s.burst(16))
    return ids, s.stats.as_dict()


def step_ms(r, rows, ctx, n=30):
    ids = torch.full((rows,), 7)
    xs = []
    for i in range(n + 10):
        sync()
        t = time.perf_counter()
        r.forward(ids, ctx)
        sync()
        xs.append(time.perf_counter() - t)
        r.rollback(ctx)
    return sorted(xs[10:])[n // 2] * 1e3


def rollback_ms(r, rows, ctx, keep, n=15):
    ids, xs = torch.full((rows,), 7), []
    for _ in range(n):
        r.forward(ids, ctx)
        sync()
        t = time.perf_counter()
        r.rollback(ctx + keep)
        sync()
        xs.append(time.perf_counter() - t)
        r.rollback(ctx)
    return sorted(xs)[n // 2] * 1e3


from memra_dist.spec.drafters.replay import ReplayDrafter  # noqa: E402

r = ModelRunner(str(path), dev, DT, max_pos=1024, graphs=True, warm_rows=9)
r.alloc(1024)
graphs = r.graphs
log("loaded; graphs active:", graphs is not None, "captured rows:", sorted(graphs.graphs) if graphs else None)


def both(fn):
    """fn() with the runner's graphs, then with them off (same weights)."""
    g = fn()
    r.graphs = None
    try:
        e = fn()
    finally:
        r.graphs = graphs
    return g, e


prompt = [(7 * i) % 90 + 3 for i in range(30)]
(gp, gs), (ep, es) = both(lambda: generate(r, NoDrafter(), prompt))
res["plain_graphs_eq_eager"] = gp == ep
res["first_diff"] = next((i for i, (a, b) in enumerate(zip(gp, ep)) if a != b), None)
log("plain", res["plain_graphs_eq_eager"], gs)
V = r.cfg.vocab_size
(gr, grs), (er, ers) = both(lambda: generate(r, ReplayDrafter(gp, len(prompt), V, 0.3, seed=3), prompt, k=4))
res["replay_graphs_eq_plain"] = gr == gp
res["replay_eager_eq_plain"] = er == ep
res["replay_stats"] = grs
log("replay K=4", res["replay_graphs_eq_plain"], res["replay_eager_eq_plain"], grs)
ctx = len(prompt)
for mode in ("graphs", "eager"):
    r.graphs = graphs if mode == "graphs" else None
    try:
        r.alloc(1024)
        r.forward(torch.tensor(prompt), 0)
        d = {f"rows_{n}_ms": round(step_ms(r, n, ctx), 3) for n in (1, 3, 5, 9)}
        for rows in (3, 5, 9):
            d[f"verify_{rows}_over_decode"] = round(d[f"rows_{rows}_ms"] / d["rows_1_ms"], 3)
        d["rollback_ms_k4_keep2"] = round(rollback_ms(r, 5, ctx, 2), 4)
        d["rollback_share_of_verify_k4"] = round(d["rollback_ms_k4_keep2"] / d["rows_5_ms"], 4)
        res[mode] = d
        log(mode, d)
    except Exception as e:
        res[f"{mode}_timing_error"] = repr(e)[:600]
        log(mode, "timing failed:", repr(e)[:600])
r.graphs = graphs
(out / "kimi_graphs.json").write_text(json.dumps(res, indent=1))
log("done")
