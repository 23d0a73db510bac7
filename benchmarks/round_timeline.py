"""Where do the ~0.3 ms a token between two decode replays go? (no profiler: CUPTI inflates
graph launches tenfold, so torch.profiler timelines mislead here)

Plain greedy decode of the 8B shape on the default fast path (graphs, compiled blocks, our
kernels), one round at a time as SpecSession runs it, with host stamps (perf_counter_ns)
after each host step and CUDA events around the device work:
  host:   ids ready -> input loaded (pinned copy) -> positions written -> replay launched ->
          logits cloned -> argmax launched -> readback returned -> bookkeeping done
  device: replay start / end, argmax end; the idle gap = next replay start - this argmax end
Then the same rounds through SpecSession.burst, for the per-round wall it really takes (plain
greedy runs one step ahead of the host there, traced or not: specdec/ahead.py), a cProfile of those
rounds (session_profile.txt), and the rounds at trace levels 1 and 2 (one step ahead, each step
timed by its own events or stamps) with a cProfile of the level-1 rounds (session_level1_profile.txt).
usage: python benchmarks/round_timeline.py OUT_DIR [--shape 8b|tiny] [--rounds N]
On CPU (`--shape tiny`) it runs with host stamps only (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from memra_dist.bench.checkpoints import ensure_checkpoint
from memra_dist.phase.levels import TraceSettings
from memra_dist.runner import ModelRunner
from memra_dist.specdec.drafters.none import NoDrafter
from memra_dist.specdec.sampling import SamplingParams
from memra_dist.specdec.session import SpecSession

HOST = ("load", "pos", "replay_launch", "clone", "argmax_launch", "readback", "bookkeeping")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--rounds", type=int, default=200)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    ckpt = ensure_checkpoint(a.shape, Path(os.environ.get("MEMRA_BENCH_CACHE", "/tmp/memra-bench-ckpt")), dev, print)
    P, N = 512 if cuda else 32, a.rounds
    cap = P + 2 * N + 8
    r = ModelRunner(str(ckpt), dev, dtype, max_pos=cap, graphs=cuda, compile=cuda, kernels=cuda, warm_rows=2 if cuda else 0)
    r.alloc(cap)
    prompt = [int(x) for x in torch.arange(P) % 1000]
    r.forward(torch.tensor(prompt), 0)
    if cuda:
        torch.cuda.synchronize()
    tokens = prompt + [17]
    ids = torch.zeros(1, dtype=torch.long)
    host = {k: [] for k in HOST}
    dev_ms = {"replay": [], "argmax_after_replay": [], "idle_before_replay": []}
    prev_end = None
    g = r.graphs.graphs.get(1) if r.graphs is not None else None
    for i in range(N):
        n = len(tokens)
        t = [time.perf_counter_ns()]
        ids[0] = tokens[-1]
        r.cache.begin(n - 1, 1)
        if g is not None:
            g.load(ids)
            t.append(time.perf_counter_ns())
            torch.add(g.base, n - 1, out=g.pos)
            t.append(time.perf_counter_ns())
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record()
            g.graph.replay()
            e1 = torch.cuda.Event(enable_timing=True)
            e1.record()
            t.append(time.perf_counter_ns())
            logits = g.out.clone()
            t.append(time.perf_counter_ns())
        else:  # CPU smoke: the eager forward stands in for load .. clone
            logits = r.forward(ids, n - 1)
            t += [time.perf_counter_ns()] * 4
        am = logits.argmax(-1)
        e2 = None
        if cuda:
            e2 = torch.cuda.Event(enable_timing=True)
            e2.record()
        t.append(time.perf_counter_ns())
        nxt = am.tolist()[0]
        t.append(time.perf_counter_ns())
        r.rollback(n)
        tokens.append(nxt)
        t.append(time.perf_counter_ns())
        for k, (x0, x1) in zip(HOST, zip(t, t[1:])):
            host[k].append((x1 - x0) / 1e3)
        if cuda:
            dev_ms["replay"].append(e0.elapsed_time(e1))
            dev_ms["argmax_after_replay"].append(e1.elapsed_time(e2))
            if prev_end is not None:
                dev_ms["idle_before_replay"].append(prev_end.elapsed_time(e0))
            prev_end = e2
    res = {"shape": a.shape, "device": torch.cuda.get_device_name(0) if cuda else "cpu", "rounds": N,
           "host_us_median": {k: round(statistics.median(v[10:]), 1) for k, v in host.items()},
           "device_ms_median": {k: round(statistics.median(v[10:]), 4) for k, v in dev_ms.items() if v}}
    res["manual_round_us_median"] = round(statistics.median(
        [sum(host[k][i] for k in HOST) for i in range(10, N)]), 1)
    s = SpecSession(r, NoDrafter(), SamplingParams(), torch.Generator().manual_seed(0), 1)
    s.start(prompt, N + 1, cap)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    s.burst(N)
    if cuda:
        torch.cuda.synchronize()
    res["session_round_us"] = round((time.perf_counter() - t0) * 1e6 / N, 1)
    # where the session's host time goes: cProfile over more rounds (it inflates Python calls
    # evenly, so read the shares, not the absolute times)
    import cProfile
    import io
    import pstats
    s = SpecSession(r, NoDrafter(), SamplingParams(), torch.Generator().manual_seed(0), 1)
    s.start(prompt, N + 1, cap)
    prof = cProfile.Profile()
    prof.enable()
    s.burst(N)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    (out / "session_profile.txt").write_text(buf.getvalue())
    # the same rounds at trace level 1 (the phase clock drains at every boundary): the wall per
    # round, and where its host time goes
    for label, level, profile in (("level1", 1, False), ("level2", 2, False), ("level1_profiled", 1, True)):
        s = SpecSession(r, NoDrafter(), SamplingParams(), torch.Generator().manual_seed(0), 1,
                        TraceSettings(level=level))
        s.start(prompt, N + 4, cap)
        s.burst(3)  # a level-2 twin graph is captured on first use: not in the timed rounds
        if cuda:
            torch.cuda.synchronize()
        prof = cProfile.Profile() if profile else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        s.burst(N)
        if prof:
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
            (out / "session_level1_profile.txt").write_text(buf.getvalue())
        else:
            res[f"session_{label}_round_us"] = round((time.perf_counter() - t0) * 1e6 / N, 1)
    print(json.dumps(res, indent=1))
    (out / "round_timeline.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
