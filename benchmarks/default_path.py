"""What a user gets from `memra-dist generate` on CUDA with no flag, timed from the outside.

Each case runs in a FRESH process through `memra_dist.app.generate` with the default
RunConfig (the CLI's path), and stamps every token as the stream callback receives it:
  first token: from the call to the first streamed token (load, compile, capture, prefill);
  decode tok/s: tokens after the first / time from the first to the last.
Cases: plain (cold compile cache, then warm), plain with `--compile off` (the former default),
ngram, the model drafter at K=4 (plain and at trace level 1 with the phase-share table that
explains the figure), level 2 (the verify sub-split timed inside the graphs), and
ModelRunners built one after the other in one process.

    python benchmarks/default_path.py OUT_DIR [--shape 8b] [--cases plain,off,ngram,model,two]
Results: OUT_DIR/default_path.json (+ one line per case on stderr)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

PROMPT_LEN, NEW = 512, 256


def _say(*a) -> None:
    print("[default_path]", *a, file=sys.stderr, flush=True)


def child(spec: dict) -> dict:
    """One generate() call in this process, timed as the caller receives the tokens."""
    import torch  # noqa: PLC0415

    from memra_dist.app import generate  # noqa: PLC0415
    from memra_dist.config import RunConfig  # noqa: PLC0415
    from memra_dist.phase.levels import TraceSettings  # noqa: PLC0415
    from memra_dist.phase.report import FanOut  # noqa: PLC0415
    from memra_dist.phase.share import ShareTable  # noqa: PLC0415

    if spec["case"] == "two":
        return _two_runners(spec)
    kw = dict(model=spec["target"], max_new_tokens=NEW, drafter=spec.get("drafter", "none"), k=spec.get("k", 4))
    if spec.get("draft"):
        kw["draft_model"] = spec["draft"]
    if spec.get("compile"):
        kw["compile"] = spec["compile"]
    if spec.get("kernels"):
        kw["kernels"] = spec["kernels"]
    if spec.get("level"):
        kw["trace"] = TraceSettings(level=spec["level"])
    cfg = RunConfig(**kw)
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(PROMPT_LEN)]
    stamps: list[tuple[float, int]] = []
    share = ShareTable() if spec.get("level") else None
    t0 = time.perf_counter()
    res = generate(cfg, prompt, stream=lambda toks: stamps.append((time.perf_counter(), len(toks))),
                   sink=FanOut(share) if share else None)
    t_first, t_last = stamps[0][0], stamps[-1][0]
    n_after = sum(n for _, n in stamps[1:])
    out = {"case": spec["case"], "tokens": len(res.token_ids), "first_token_s": round(t_first - t0, 3),
           "decode_tok_s": round(n_after / (t_last - t_first), 2) if t_last > t_first else None,
           "engine_stats": res.stats, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "compile": cfg.compile, "graphs": cfg.graphs, "kernels": cfg.kernels}
    if share is not None:
        out["share_table"] = share.table()
        out["rounds"] = share.n_rounds
        out["phase_ms_per_round"] = {p: round(ns / 1e6 / max(share.n_rounds, 1), 4)
                                     for p, ns in zip(("draft", "verify", "accept", "rollback", "maint"), share.ns)}
    return out


def _two_runners(spec: dict) -> dict:
    """Build a graphed runner, drop it, build another: the second capture must not fail."""
    import gc  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from memra_dist.runner import ModelRunner  # noqa: PLC0415

    dev = torch.device("cuda")
    outs = []
    for i in range(3):
        r = ModelRunner(spec["draft"], dev, torch.bfloat16, max_pos=1024, graphs=True, compile=False, warm_rows=5)
        r.alloc(1024)
        logits = r.forward(torch.arange(1, 9, device=dev), 0)
        outs.append(int(logits[-1].argmax()))
        del r, logits  # dropped, not collected: its graphs sit in reference cycles
    gc.collect()
    return {"case": "two", "ok": True, "argmax_each_build": outs}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--cases", default="plain,off,ngram,model,model-l1,two")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return 0
    import torch  # noqa: PLC0415

    from memra_dist.bench.checkpoints import DRAFT_OF, ensure_checkpoint, shape_config, weight_bytes  # noqa: PLC0415
    from memra_dist.bench.roofline import roofline_tok_s  # noqa: PLC0415
    from memra_dist.bench.timing import copy_bandwidth  # noqa: PLC0415

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    cache = Path(os.environ.get("MEMRA_BENCH_CACHE", "/tmp/memra-bench-ckpt"))
    target = str(ensure_checkpoint(a.shape, cache, dev, _say))
    draft = str(ensure_checkpoint(DRAFT_OF[a.shape], cache, dev, _say))
    bw = copy_bandwidth(dev, 2 << 30)
    res = {"shape": a.shape, "prompt": PROMPT_LEN, "new_tokens": NEW, "bandwidth_tb_s": round(bw["bandwidth_tb_s"], 3),
           "roofline_tok_s": round(roofline_tok_s(bw["bandwidth_bytes_s"], weight_bytes(shape_config(a.shape))), 1),
           "draft_roofline_tok_s": round(roofline_tok_s(bw["bandwidth_bytes_s"],
                                                        weight_bytes(shape_config(DRAFT_OF[a.shape]))), 1),
           "cases": []}
    del torch
    ind = Path(os.environ.get("DEFAULT_PATH_INDUCTOR", "/tmp/memra-default-path-inductor"))
    shutil.rmtree(ind, ignore_errors=True)  # the first case starts cold
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(ind))
    specs = {"plain": [{"case": "plain-cold"}, {"case": "plain-warm"}],
             "off": [{"case": "compile-off", "compile": "off"}],
             "kernels-off": [{"case": "kernels-off", "kernels": "off"}],
             "repeats": [{"case": "plain-warm-2"}, {"case": "plain-warm-3"}],
             "ngram": [{"case": "ngram", "drafter": "ngram"}],
             "model": [{"case": "model-k4", "drafter": "model", "draft": draft}],
             "model-l1": [{"case": "model-k4-level1", "drafter": "model", "draft": draft, "level": 1},
                          {"case": "plain-level1", "level": 1}],
             "model-l1-only": [{"case": "model-k4-level1", "drafter": "model", "draft": draft, "level": 1}],
             "l2": [{"case": "plain-level2", "level": 2},
                    {"case": "model-k4-level2", "drafter": "model", "draft": draft, "level": 2}],
             "two": [{"case": "two", "draft": draft}]}
    for name in a.cases.split(","):
        for spec in specs[name]:
            spec["target"] = target
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, __file__, str(out), "--child", json.dumps(spec)], env=env,
                               capture_output=True, text=True, timeout=900)
            if p.returncode != 0:
                r = {"case": spec["case"], "error": p.stderr[-1500:]}
            else:
                r = json.loads(p.stdout.strip().splitlines()[-1])
            r["process_s"] = round(time.perf_counter() - t0, 1)
            if r.get("decode_tok_s"):
                r["of_roofline"] = round(r["decode_tok_s"] / res["roofline_tok_s"], 3)
            res["cases"].append(r)
            _say(json.dumps({k: v for k, v in r.items() if k not in ("share_table", "engine_stats")}))
            if "share_table" in r:
                _say("\n" + r["share_table"])
            (out / "default_path.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
