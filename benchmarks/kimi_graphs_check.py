"""Kimi hybrid on CUDA graphs (bf16, the bench's hybrid shape): greedy ids with graphs equal
the eager ids (plain and n-gram K=4: captured KDA steps at every position, rollbacks
included), and step / rollback costs with graphs against eager.
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
from memra_dist.spec.drafters.ngram import NgramDrafter
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


runners = {}
for mode in ("eager", "graphs"):
    try:
        runners[mode] = ModelRunner(str(path), dev, DT, max_pos=1024, graphs=mode == "graphs",
                                    warm_rows=9 if mode == "graphs" else 0)
        runners[mode].alloc(1024)
        log(mode, "loaded; graphs active:", runners[mode].graphs is not None,
            "captured rows:", sorted(runners[mode].graphs.graphs) if runners[mode].graphs else None)
    except Exception as e:  # report and go on
        res[f"{mode}_error"] = repr(e)[:600]
        log(mode, "failed:", repr(e)[:600])
prompt = [(7 * i) % 90 + 3 for i in range(40)] * 3
gens = {}
for mode, r in runners.items():
    for name, mk in (("plain", NoDrafter), ("ngram", NgramDrafter)):
        try:
            gens[(mode, name)] = generate(r, mk(), prompt)
            log(mode, name, gens[(mode, name)][1])
        except Exception as e:
            res[f"{mode}_{name}_error"] = repr(e)[:600]
            log(mode, name, "failed:", repr(e)[:600])
if ("eager", "plain") in gens and ("graphs", "plain") in gens:
    e, g = gens[("eager", "plain")][0], gens[("graphs", "plain")][0]
    res["graphs_plain_eq_eager"] = e == g
    res["first_diff"] = next((i for i, (a, b) in enumerate(zip(e, g)) if a != b), None)
if ("graphs", "ngram") in gens and ("graphs", "plain") in gens:
    res["graphs_ngram_eq_plain"] = gens[("graphs", "ngram")][0] == gens[("graphs", "plain")][0]
    res["graphs_ngram_stats"] = gens[("graphs", "ngram")][1]
if ("eager", "ngram") in gens and ("graphs", "ngram") in gens:
    res["graphs_ngram_eq_eager_ngram"] = gens[("eager", "ngram")][0] == gens[("graphs", "ngram")][0]
log({k: v for k, v in res.items() if k.startswith("graphs_")})
ctx = 512
for mode, r in runners.items():
    try:
        r.alloc(1024)
        r.forward(torch.tensor([(7 * i) % 90 + 3 for i in range(ctx)]), 0)
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
(out / "kimi_graphs.json").write_text(json.dumps(res, indent=1))
log("done")
