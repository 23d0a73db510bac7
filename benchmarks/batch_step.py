"""One batched forward, timed and profiled from a single thread (no sessions, no waits).

Where `benchmarks/batching.py` times what callers receive, this isolates the batcher's forward
(`Batcher._forward`, what every step of a batched engine runs): n requests of `--prompt` rows,
each prefilled, then steps of `rows` rows per request (1: decode; K + 1: verify), timed with
the device drained around `--steps` steps. So a slow batched rate can be split into the
forward itself (this script) and what surrounds it (threads, waits, the sessions' host work).
`--profile` adds torch.profiler's top operators (host and device time) of one step per setting.

    python benchmarks/batch_step.py OUT_DIR [--shape tiny] [--device cpu] [--requests 1,4,16]
        [--rows 1,5] [--prompt 64] [--steps 20] [--profile]
Results: OUT_DIR/batch_step.json and a table on stdout."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(batcher, n: int, rows: int, plen: int, steps: int, vocab: int, profile: bool) -> dict:
    import torch

    from memra_dist.batching.job import Job
    from memra_dist.batching.step_forward import forward

    cap = plen + steps * rows + rows + 8
    rids = [("bs", n, rows, i) for i in range(n)]
    for r in rids:
        batcher.admit(r, cap)
    gen = torch.Generator().manual_seed(0)
    try:
        for r in rids:  # each request's prompt as one prefill step
            forward(batcher, [Job(r, torch.randint(0, vocab, (plen,), generator=gen), 0, cap, True)])
        ids = torch.randint(0, vocab, (rows,), generator=gen)

        def step(s):
            return forward(batcher, [Job(r, ids, plen + s * rows, cap, False) for r in rids])

        step(0)  # a first step of this shape (kernel variants, allocator)
        _sync(batcher.device)
        t0 = time.perf_counter()
        for s in range(1, steps):
            step(s)
        host = time.perf_counter() - t0
        _sync(batcher.device)
        wall = time.perf_counter() - t0
        out = {"requests": n, "rows_each": rows, "step_ms": round(wall * 1e3 / (steps - 1), 3),
               "host_ms": round(host * 1e3 / (steps - 1), 3)}
        if profile:
            from torch.profiler import ProfilerActivity, profile as prof

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if batcher.device.type == "cuda" else [])
            with prof(activities=acts) as p:
                step(steps - 1)
                _sync(batcher.device)
            key = "self_cuda_time_total" if batcher.device.type == "cuda" else "self_cpu_time_total"
            out["profile_cpu"] = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
            out["profile_dev"] = p.key_averages().table(sort_by=key, row_limit=12)
        return out
    finally:
        for r in rids:
            batcher.leave(r)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="directory for batch_step.json")
    ap.add_argument("--shape", default="tiny", help="a bench shape (memra_dist/bench/shapes), random weights")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the default path: graphs and kernels on CUDA)")
    ap.add_argument("--requests", default="1,4,16", help="requests a step, comma-separated")
    ap.add_argument("--rows", default="1,5", help="rows each request brings (1: decode, K + 1: verify)")
    ap.add_argument("--prompt", type=int, default=64, help="each request's prompt rows (its cache before the steps)")
    ap.add_argument("--steps", type=int, default=20, help="steps timed per setting (the first is not)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler's top operators of one step per setting")
    a = ap.parse_args()
    import torch

    from memra_dist.app import open_engine
    from memra_dist.bench.checkpoints import bench_cache_dir, ensure_checkpoint
    from memra_dist.config import RunConfig
    from memra_dist.model.config import load_config

    say = lambda s: print(f"[batch_step] {s}", file=sys.stderr, flush=True)  # noqa: E731
    model = str(ensure_checkpoint(a.shape, bench_cache_dir(), torch.device(a.device), say))
    reqs = [int(x) for x in a.requests.split(",")]
    rows = [int(x) for x in a.rows.split(",")]
    cap = a.prompt + a.steps * max(rows) + max(rows) + 8
    cfg = RunConfig(model=model, device=a.device, max_new_tokens=8)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = []
    from memra_dist.batching.backend import BLOCK

    per = -(-cap // BLOCK) * BLOCK  # a request holds whole blocks: n requests need n * per rows
    with open_engine(cfg, capacity=cap, max_batch=max(reqs + [2]), kv_rows=max(reqs) * per + 64) as eng:
        b = eng._backend.batcher
        say(f"kernels={b.kernels} device={b.device} dtype={b.dtype}")
        for n in reqs:
            for r in rows:
                m = measure(b, n, r, a.prompt, a.steps, load_config(model).vocab_size, a.profile)
                res.append(m)
                say(json.dumps({k: v for k, v in m.items() if not k.startswith("profile")}))
                for k in ("profile_cpu", "profile_dev"):
                    if k in m:
                        print(f"--- n={n} rows={r} {k}\n{m[k]}", file=sys.stderr, flush=True)
    (out / "batch_step.json").write_text(json.dumps({"shape": a.shape, "device": a.device, "rows": res}, indent=1))
    print("| requests | rows each | step ms | host ms (launches) |")
    print("|---|---|---|---|")
    for m in res:
        print(f"| {m['requests']} | {m['rows_each']} | {m['step_ms']} | {m['host_ms']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
