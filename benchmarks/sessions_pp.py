"""Sessions in flight at ppN, timed from the outside: aggregate throughput of S sessions
against one session on the SAME loaded pipeline, and the stage busy shares that explain it.

One engine is opened with S slots (the default path: `open_engine(cfg, sessions=S)`, the
default drafter, graphs and compile as on any CUDA run). The same R requests (random
prompts, greedy) then run
  one at a time (one caller thread: one session in flight), and
  from S caller threads at once (S sessions in flight),
each request timed as its tokens reach the caller; aggregate tok/s = tokens generated /
wall from the first request's call to the last one's end. The outputs of both passes must
be equal (sessions in flight change no token). A second engine at trace level 1 repeats
both passes into run dirs, whose `stage.forward` spans give each stage's busy share (the
product's own explanation of the figure; level 1 drains around each forward, so its
throughput is not the one reported).

    python benchmarks/sessions_pp.py OUT_DIR [--shape 8b] [--pp 2] [--sessions 2] [--requests 4]
        [--prompt-len 512] [--new 256] [--drafter ngram]
Results: OUT_DIR/sessions_pp.json (+ lines on stderr)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path


def _say(*a) -> None:
    print("[sessions_pp]", *a, file=sys.stderr, flush=True)


def _pass(engine, prompts, threads: int) -> dict:
    """Every prompt through the engine from `threads` caller threads; per-request stamps."""
    todo = list(enumerate(prompts))
    take = threading.Lock()
    out: dict[int, dict] = {}

    def work():
        while True:
            with take:
                if not todo:
                    return
                i, p = todo.pop(0)
            stamps = []
            t0 = time.perf_counter()
            res = engine.generate(p, stream=lambda toks: stamps.append((time.perf_counter(), len(toks))))
            out[i] = {"ids": res.token_ids, "t0": t0, "first": stamps[0][0], "end": stamps[-1][0],
                      "tokens": len(res.token_ids), "stats": res.stats}

    t_start = time.perf_counter()
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t_start
    tokens = sum(r["tokens"] for r in out.values())
    return {"threads": threads, "wall_s": round(wall, 3), "tokens": tokens, "agg_tok_per_s": round(tokens / wall, 2),
            "ttft_ms": [round((out[i]["first"] - out[i]["t0"]) * 1e3, 1) for i in sorted(out)],
            "decode_tok_per_s": [r["stats"]["tok_per_s"] for _, r in sorted(out.items())],
            "acceptance": [r["stats"]["acceptance"] for _, r in sorted(out.items())],
            "ids": [out[i]["ids"] for i in sorted(out)]}


def _median(passes: list[dict]) -> dict:
    return sorted(passes, key=lambda p: p["agg_tok_per_s"])[len(passes) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--repeats", type=int, default=3, help="level-0 passes of each kind (median and range reported)")
    ap.add_argument("--cache", default="/tmp/memra-bench-ckpt")
    a = ap.parse_args()

    import torch  # noqa: PLC0415

    from memra_dist.app import open_engine  # noqa: PLC0415
    from memra_dist.bench.checkpoints import ensure_checkpoint  # noqa: PLC0415
    from memra_dist.config import RunConfig  # noqa: PLC0415
    from memra_dist.phase.levels import TraceSettings  # noqa: PLC0415
    from memra_dist.tracing.stage_busy import busy_of_run_dir  # noqa: PLC0415

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = ensure_checkpoint(a.shape, Path(a.cache), dev, _say)
    g = torch.Generator().manual_seed(0)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = [torch.randint(10, vocab - 10, (a.prompt_len,), generator=g).tolist() for _ in range(a.requests)]
    cfg = RunConfig(model=str(model), pp=a.pp, max_new_tokens=a.new, drafter=a.drafter)
    cap = a.prompt_len + a.new + cfg.k + 1
    res: dict = {"shape": a.shape, "pp": a.pp, "sessions": a.sessions, "requests": a.requests,
                 "prompt_len": a.prompt_len, "new": a.new, "drafter": a.drafter,
                 "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"}
    t = time.perf_counter()
    with open_engine(cfg, cap, sessions=a.sessions) as engine:
        res["open_s"] = round(time.perf_counter() - t, 1)
        _say(f"engine open in {res['open_s']} s (pp={a.pp}, sessions={a.sessions})")
        _pass(engine, prompts[:1], 1)  # warm: first-request costs out of the figures
        ones, manys = [], []
        for r in range(a.repeats):  # interleaved, so drift hits both kinds alike
            ones.append(_pass(engine, prompts, 1))
            manys.append(_pass(engine, prompts, a.sessions))
            _say(f"repeat {r + 1}: one session {ones[-1]['agg_tok_per_s']} tok/s, {a.sessions} sessions "
                 f"{manys[-1]['agg_tok_per_s']} tok/s (aggregate)")
    one, many = _median(ones), _median(manys)
    res["ids_equal"] = all(p["ids"] == ones[0]["ids"] for p in ones + manys)
    res["one"] = {k: v for k, v in one.items() if k != "ids"}
    res["many"] = {k: v for k, v in many.items() if k != "ids"}
    res["one_tok_per_s_all"] = [p["agg_tok_per_s"] for p in ones]
    res["many_tok_per_s_all"] = [p["agg_tok_per_s"] for p in manys]
    ratios = sorted(m["agg_tok_per_s"] / o["agg_tok_per_s"] for o, m in zip(ones, manys))
    res["speedup"] = round(many["agg_tok_per_s"] / one["agg_tok_per_s"], 3)  # median over median
    res["speedup_range"] = [round(ratios[0], 3), round(ratios[-1], 3)]
    _say(f"speedup {res['speedup']}x (pairwise range {res['speedup_range']}), ids equal: {res['ids_equal']}")

    traced = cfg.with_(trace=TraceSettings(level=1))
    for name, threads in (("one", 1), ("many", a.sessions)):
        rd = out / "runs" / name
        with open_engine(traced, cap, sessions=a.sessions, run_dir=str(rd)) as engine:
            _pass(engine, prompts[:1], 1)  # warm, then the timed pass (the only one counted)
            since = time.time_ns()
            traced_pass = _pass(engine, prompts, threads)
        busy = busy_of_run_dir(rd, since)
        res[f"busy_{name}"] = {"share": busy.share, "overlap_ms": round(busy.overlap_ms, 1),
                               "window_ms": round(busy.window_ns / 1e6, 1),
                               "agg_tok_per_s_level1": traced_pass["agg_tok_per_s"]}
        _say(f"level 1, {name}: {busy.line()}")
    (out / "sessions_pp.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
