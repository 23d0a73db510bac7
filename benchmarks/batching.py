"""Batched requests (memra_dist/batching/) against one at a time, timed from the outside.

N concurrent callers of one engine (`open_engine(..., max_batch=B)`, the Python API that `batch`
and `serve --max-batch` run) each generate one request; every token is stamped as the caller's
stream callback receives it. Per setting: aggregate decode tok/s (all tokens after each
request's first / the wall from the first caller's start to the last token), per-request
inter-token latency p50 / p99 (gaps between a request's stream callbacks, divided by the
tokens each delivered), time to first token p50 / p99, and the batcher's own counts (steps,
mean requests and rows a step, mean step ms, the share of the time the device ran steps while
requests were mid-generation ("busy": the rest went to their host work between steps), graph
replays). B = 1 is the one-at-a-time engine
(requests queue for it). Before the timed run the same n callers run 8 tokens each (the warm-up
every server gets from its first requests: kernel JIT, the graphs of the step sizes the run
takes); the batcher's counts cover the timed run only. "decode tok/s" counts from the first
request's first token (the aggregate from the callers' start, prefills included); "steady tok/s"
counts the tokens received while every request was in flight (from the last request's first
token to the first request's last): the batch's decode rate with no prefill step in it.

    python benchmarks/batching.py OUT_DIR [--shape tiny] [--device cpu] [--concurrency 1,4,16]
        [--max-batch 16] [--new 64] [--prompt 64] [--drafter none]
Results: OUT_DIR/batching.json and a markdown table on stdout."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(model: str, device: str, n: int, max_batch: int, new: int, plen: int, drafter: str) -> dict:
    from memra_dist.app import open_engine
    from memra_dist.config import RunConfig

    cfg = RunConfig(model=model, drafter=drafter, k=4, device=device, max_new_tokens=new)
    from memra_dist.bench.runs import make_prompt
    from memra_dist.model.config import load_config

    vocab = load_config(model).vocab_size  # the bench's copy-with-edits prompts, one seed per request
    prompts = [make_prompt(plen, vocab, seed=i) for i in range(n)]
    stamps: list[list[tuple[float, int]]] = [[] for _ in range(n)]
    with open_engine(cfg, capacity=plen + new + 8, max_batch=max_batch) as eng:
        ids: list[list[int] | None] = [None] * n

        def one(i, c, sink):
            ids[i] = eng.generate(prompts[i], c, stream=sink).token_ids

        def callers(c, sinks):
            threads = [threading.Thread(target=one, args=(i, c, sinks[i])) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        callers(cfg.with_(max_new_tokens=8), [None] * n)  # warm-up
        backend = getattr(eng, "_backend", None)
        if hasattr(backend, "batcher"):
            from memra_dist.batching.batcher import BatchStats

            backend.batcher.stats = BatchStats()  # the timed run's counts only
        t0 = time.perf_counter()
        callers(cfg, [lambda toks, i=i: stamps[i].append((time.perf_counter(), len(toks))) for i in range(n)])
        bstats = backend.stats() if hasattr(backend, "stats") else None
    end = max(s[-1][0] for s in stamps)
    after_first = sum(sum(k for _, k in s[1:]) for s in stamps)
    itl = [(b[0] - a[0]) * 1e3 / b[1] for s in stamps for a, b in zip(s, s[1:])]
    ttft = [(s[0][0] - t0) * 1e3 for s in stamps]
    # every request in flight: from the last request's first token to the first request's last
    # (no prefill, no request already done: the batch's steady decode rate as the callers see it)
    lo, hi = max(s[0][0] for s in stamps), min(s[-1][0] for s in stamps)
    steady = sum(k for s in stamps for t, k in s[1:] if lo < t <= hi)
    return {"concurrency": n, "max_batch": max_batch, "tokens": sum(sum(k for _, k in s) for s in stamps),
            "aggregate_tok_s": round(after_first / (end - t0), 1),
            "decode_tok_s": round(after_first / (end - min(s[0][0] for s in stamps)), 1),
            "steady_tok_s": round(steady / (hi - lo), 1) if hi > lo else None, "itl_ms_p50": round(_pct(itl, 0.5), 3),
            "itl_ms_p99": round(_pct(itl, 0.99), 3), "ttft_ms_p50": round(statistics.median(ttft), 1),
            "ttft_ms_p99": round(_pct(ttft, 0.99), 1), "batcher": bstats, "ids": ids}


def _graphed_ms(bs: dict):
    """The mean step that replayed a graph (the eager ones, prefill chunks, taken out)."""
    n = bs.get("steps", 0) - bs.get("eager_steps", 0)
    return round((bs["step_ms"] - bs["eager_step_ms"]) / n, 3) if bs.get("eager_step_ms") is not None and n > 0 else "-"


def _per_step(bs: dict, key: str):
    return round(bs[key] / bs["steps"], 3) if bs.get(key) is not None and bs.get("steps") else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="directory for batching.json")
    ap.add_argument("--shape", default="tiny", help="a bench shape (memra_dist/bench/shapes), random weights")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the default path there)")
    ap.add_argument("--concurrency", default="1,4,16", help="concurrent callers, comma-separated; each N runs "
                    "one at a time (max batch 1) and batched")
    ap.add_argument("--max-batch", type=int, default=16, help="the batched engine's --max-batch (at most N)")
    ap.add_argument("--new", type=int, default=64, help="tokens each request generates")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (copy-with-edits prompts)")
    ap.add_argument("--drafter", default="none", help="none, ngram (greedy; k = 4)")
    a = ap.parse_args()
    import torch

    from memra_dist.bench.checkpoints import bench_cache_dir, ensure_checkpoint

    model = str(ensure_checkpoint(a.shape, bench_cache_dir(), torch.device(a.device),
                                  lambda s: print(f"[batching] {s}", file=sys.stderr)))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in (int(x) for x in a.concurrency.split(",")):
        for b in (1, min(a.max_batch, n)) if n > 1 else (1,):
            r = run(model, a.device, n, b, a.new, a.prompt, a.drafter)
            if b == 1:
                alone = r["ids"]
            else:  # greedy: each request's ids against the one-at-a-time engine's (bf16 may differ in a near tie)
                r["ids_equal_alone"] = sum(x == y for x, y in zip(r["ids"], alone))
            del r["ids"]
            rows.append(r)
            print(f"[batching] {json.dumps(r)}", file=sys.stderr, flush=True)
            (out / "batching.json").write_text(json.dumps({"shape": a.shape, "device": a.device, "drafter": a.drafter,
                                                           "new": a.new, "prompt": a.prompt, "rows": rows}, indent=1))
    print("| concurrent | max batch | decode tok/s | steady tok/s | aggregate tok/s | ITL p50 / p99 ms | TTFT p50 / p99 ms "
          "| requests / rows a step | step ms | graphed step ms | busy | leader rounds ms a step | ids = alone |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bs = r["batcher"] or {}
        print(f"| {r['concurrency']} | {r['max_batch']} | {r['decode_tok_s']} | {r['steady_tok_s'] or '-'} | {r['aggregate_tok_s']} "
              f"| {r['itl_ms_p50']} / {r['itl_ms_p99']} | {r['ttft_ms_p50']} / {r['ttft_ms_p99']} "
              f"| {bs.get('mean_requests', 1.0)} / {bs.get('mean_rows', '-')} | {bs.get('mean_step_ms', '-')} "
              f"| {_graphed_ms(bs)} | {bs.get('busy', '-')} | {_per_step(bs, 'leader_rounds_ms')} | {r.get('ids_equal_alone', '-')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
