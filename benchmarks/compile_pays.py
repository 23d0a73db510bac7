"""Where torch.compile pays: decode tok/s with `--compile on` against `--compile off`, per path,
each run a FRESH process through the public API (benchmarks/default_path.py's child: the
default RunConfig plus the one switch, tokens stamped as the stream callback receives them).
What `--compile auto` means comes from this table (memra_dist/compile_policy.py): a path
compiles under auto only where compile gains >= 3 % in decode.

Paths (random bf16 checkpoints from memra_dist/bench/checkpoints.py / tap_checkpoints.py):
  plain-8b      the 8B Llama shape, plain greedy decoding
  plain-1b      the 1B Llama shape (the 8B's draft shape), plain greedy
  model-8b      8B target + the 1B draft model, K = 4 (both runners compile, or neither)
  dflash-8b     8B target + a random DFlash drafter (Llama-3.1-8B DFlash layout), K = 15; with
                random weights nearly nothing is accepted, so decode tok/s is the inverse of a
                round's cost (draft block + verify of 16 rows): what compile changes
Order per path: on with a cold inductor cache (its first token states compile's cold cost),
on again (warm cache: compile's cost once cached), off. Gains compare warm-on with off.

    python benchmarks/compile_pays.py OUT_DIR [--paths plain-8b,plain-1b,model-8b,dflash-8b]
Results: OUT_DIR/compile_pays.json, one line per run on stderr, the table on stdout."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
PATHS = ("plain-8b", "plain-1b", "model-8b", "dflash-8b")
THRESHOLD = 0.03


def _say(*a) -> None:
    print("[compile_pays]", *a, file=sys.stderr, flush=True)


def _specs(path: str, ckpt: dict) -> dict:
    if path == "plain-8b":
        return {"target": ckpt["8b"]}
    if path == "plain-1b":
        return {"target": ckpt["1b"]}
    if path == "model-8b":
        return {"target": ckpt["8b"], "drafter": "model", "draft": ckpt["1b"], "k": 4}
    if path == "dflash-8b":
        return {"target": ckpt["dflash-target"], "drafter": "dflash", "draft": ckpt["dflash"], "k": 15}
    raise KeyError(path)


def _child(spec: dict, env: dict) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, str(HERE / "default_path.py"), "-", "--child", json.dumps(spec)], env=env,
                       capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        r = {"case": spec["case"], "error": p.stderr[-1500:]}
    else:
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r.pop("engine_stats", None)
    r["process_s"] = round(time.perf_counter() - t0, 1)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--paths", default=",".join(PATHS))
    a = ap.parse_args()
    paths = [p for p in a.paths.split(",") if p]
    for p in paths:
        if p not in PATHS:
            print(f"compile_pays: unknown path {p!r} (known: {', '.join(PATHS)})", file=sys.stderr)
            return 2
    import torch  # noqa: PLC0415

    from memra_dist.bench import tap_checkpoints as tc  # noqa: PLC0415
    from memra_dist.bench.checkpoints import bench_cache_dir, ensure_checkpoint  # noqa: PLC0415

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    cache = bench_cache_dir()
    ckpt = {}
    if any(p in ("plain-8b", "model-8b") for p in paths):
        ckpt["8b"] = str(ensure_checkpoint("8b", cache, dev, _say))
    if any(p in ("plain-1b", "model-8b") for p in paths):
        ckpt["1b"] = str(ensure_checkpoint("1b", cache, dev, _say))
    if "dflash-8b" in paths:
        t, d = tc.ensure_dflash("8b", cache, dev, _say)
        ckpt["dflash-target"], ckpt["dflash"] = str(t), str(d)
    del torch
    res = {"threshold": THRESHOLD, "runs": [], "paths": {}}
    for path in paths:
        ind = out / f"inductor-{path}"
        shutil.rmtree(ind, ignore_errors=True)  # this path's first compile is cold
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(ind))
        got = {}
        for case, comp in (("on-cold", "on"), ("on-warm", "on"), ("off", "off")):
            spec = {**_specs(path, ckpt), "case": f"{path}:{case}", "compile": comp}
            r = _child(spec, env)
            got[case] = r
            res["runs"].append(r)
            _say(json.dumps(r))
            (out / "compile_pays.json").write_text(json.dumps(res, indent=1))
        on, off = got["on-warm"].get("decode_tok_s"), got["off"].get("decode_tok_s")
        gain = round(on / off - 1, 4) if on and off else None
        res["paths"][path] = {"decode_on": on, "decode_off": off, "gain": gain,
                              "pays": gain is not None and gain >= THRESHOLD,
                              "first_token_s": {c: got[c].get("first_token_s") for c in got}}
        (out / "compile_pays.json").write_text(json.dumps(res, indent=1))
    print("| path | decode on (tok/s) | off | gain | pays (>= 3 %) | first token: on cold / on warm / off (s) |")
    print("|---|---|---|---|---|---|")
    for path, r in res["paths"].items():
        f = r["first_token_s"]
        gain = f"{100 * r['gain']:+.1f} %" if r["gain"] is not None else "-"
        print(f"| {path} | {r['decode_on']} | {r['decode_off']} | {gain} | {'yes' if r['pays'] else 'no'} | "
              f"{f['on-cold']} / {f['on-warm']} / {f['off']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
