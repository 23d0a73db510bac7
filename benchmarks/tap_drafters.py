"""The tap drafters (DFlash, MTP, EAGLE-3) on the default path, timed from the outside (issue 16).

Every run goes through `memra_dist.app.open_engine` / `Engine.generate` with a default RunConfig
(what `memra-dist generate` runs: CUDA graphs + compile on CUDA, no bench-only switch); each
case is a FRESH process (its own load, compile and capture); decode tok/s = tokens after the
first / time from the first streamed token to the last (median of --repeats runs, after a
warm-up request). Phase costs come from the engine's own level-1 clock: one more run of the
same request at trace level 1 with a ShareTable sink (ms per round of each phase).

  dflash  the bench's 8B Llama target + a random bf16 DFlash drafter (Llama-3.1-8B DFlash
          layout, block 16), k = 15 (verify 16 rows):
            draft / verify(16) per round (target <= 0.25), verify(16) / decode (<= 1.15);
            decode = a plain run's verify per round (its own process).
  mtp     a DeepSeek-V3-shaped slice (1 dense + 1 MoE layer + 1 MTP layer, real widths,
          memra_dist/bench/tap_checkpoints.py), K = 1, 2, 3: draft ms per drafted token
          (level-1 draft per round / K) over the time to read what one MTP step reads
          (tap_checkpoints.mtp_step_read_bytes at the measured copy bandwidth) (<= 1.5).
  eagle3  the bench's 8B Llama target + a random bf16 EAGLE-3 head (the public Llama-3.1-8B
          EAGLE-3 layout: one decoder layer, 4096 hidden, 32k draft vocabulary,
          memra_dist/bench/tap_checkpoints.py), K = 3, 7: draft ms per drafted token (level-1
          draft per round / K) over the time to read what a round reads per drafted token
          (tap_checkpoints.eagle3_read_bytes at the measured copy bandwidth) (<= 1.5).
  replay  each: the real drafter's propose runs in full, its drafts replaced by a recorded
          greedy continuation corrupted to the acceptance whose expected tokens per round
          is the published tau (memra_dist/bench/tap_replay.py): tok/s, acceptance, tokens per
          round, the bench's ideal speedup and the fraction of it (>= 0.9), and the projected
          speedup at tau (the output states the formulas).

    python benchmarks/tap_drafters.py OUT_DIR [--case dflash|mtp|eagle3|all] [--shape 8b|tiny] [--free-disk]
Results: OUT_DIR/tap_drafters.json and stdout (one JSON object), one line per figure on stderr."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

DFLASH_K, MTP_KS, EAGLE3_KS = 15, (1, 2, 3), (3, 7)
FAMILIES = ("dflash", "eagle3", "mtp")  # eagle3 before mtp: --free-disk then drops the 8B target
# published accepted lengths: DFlash b16 (Llama-3.1-8B), DeepSeek-V3 MTP K=3; EAGLE-3 chain k = 7: ~4 a round
TAU = {"dflash": 6.5, "mtp": 3.2, "eagle3": 4.0}
TAU_K = {"dflash": DFLASH_K, "mtp": 3, "eagle3": 7}
KS = {"dflash": (DFLASH_K,), "mtp": MTP_KS, "eagle3": EAGLE3_KS}
SIZES = {"8b": dict(prompt=512, new=256, repeats=3), "tiny": dict(prompt=48, new=120, repeats=2)}
PHASES = ("draft", "verify", "accept", "rollback", "maint")
FORMULAS = {
    "decode_tok_s": "tokens after the first / wall from the first streamed token to the last, median of repeats",
    "phase_ms_per_round": "engine level-1 phase clock (ShareTable ns / rounds), one run of the same request; "
                          "plain decoding runs one step ahead at level 1, so its verify is the replayed step's "
                          "device time, while a drafter's round loop times verify drain to drain (its launch "
                          "included): the since-removed benchmarks/dflash_profile.py (git history) timed both steps alike",
    "ideal": "ideal = E(a, K) * t_decode / (t_draft_round + t_verify(K+1)), E = (1 - a^(K+1)) / (1 - a); "
             "a = per-token acceptance recovered from the measured accepted drafts per round (bench/roofline.py); "
             "t_decode = the plain run's level-1 verify ms/round, t_draft_round and t_verify = the replay run's "
             "level-1 draft and verify ms/round (K * t_draft_step of the bench's formula = the draft per round)",
    "fraction_of_ideal": "(replay tok/s / plain tok/s) / ideal",
    "projected_speedup": "tau * t_decode_step / t_round, t_decode_step = 1 / plain decode tok/s, t_round = the "
                         "replay run's decode wall / its rounds (level 0, median run), measured at the acceptance "
                         "whose E(a, K) = tau; tau = tokens committed per round (accepted drafts + the bonus)",
    "mtp_draft_over_read": "(level-1 draft ms per round / K) / (mtp_step_read_bytes / copy bandwidth)",
    "eagle3_draft_over_read": "(level-1 draft ms per round / K) / (eagle3_read_bytes(K) / copy bandwidth)",
}


def _say(*a) -> None:
    print("[tap_drafters]", *a, file=sys.stderr, flush=True)


# ---- the child: one engine in this process ----------------------------------------------

def _run(engine, prompt, cfg, level: int = 0) -> dict:
    from memra_dist.phase.levels import TraceSettings  # noqa: PLC0415
    from memra_dist.phase.share import ShareTable  # noqa: PLC0415

    stamps: list[tuple[float, int]] = []
    share = ShareTable() if level else None
    c = cfg.with_(trace=TraceSettings(level=level)) if level else cfg
    res = engine.generate(prompt, c, stream=lambda t: stamps.append((time.perf_counter(), len(t))), sink=share)
    (t0, _), (t1, _) = stamps[0], stamps[-1]
    n_after = sum(n for _, n in stamps[1:])
    st = res.stats
    out = {"ids": res.token_ids, "decode_s": t1 - t0, "tok_s": n_after / (t1 - t0) if t1 > t0 else 0.0,
           "rounds": st["rounds"], "drafted": st["drafted"], "accepted": st["accepted"],
           "tokens": st["tokens"], "tokens_per_round": st["tokens_per_round"]}
    if share is not None:
        n = max(share.n_rounds, 1)
        out["phase_ms_per_round"] = {p: ns / 1e6 / n for p, ns in zip(PHASES, share.ns)}
        out["level1_rounds"] = share.n_rounds
        out["share_table"] = share.table()
    return out


def _measure(engine, prompt, cfg, repeats: int) -> dict:
    """A warm-up request, `repeats` level-0 runs (the median by decode wall), one level-1 run."""
    _run(engine, prompt, cfg.with_(max_new_tokens=min(8, cfg.max_new_tokens)))
    runs = sorted((_run(engine, prompt, cfg) for _ in range(repeats)), key=lambda r: r["decode_s"])
    med = dict(runs[len(runs) // 2])
    med["tok_s_all"] = [round(r["tok_s"], 3) for r in runs]
    med["same_ids"] = all(r["ids"] == runs[0]["ids"] for r in runs)
    l1 = _run(engine, prompt, cfg, level=1)
    med.update({k: l1[k] for k in ("phase_ms_per_round", "level1_rounds", "share_table")})
    med["level1_tokens_per_round"] = l1["tokens_per_round"]
    return med


def _slim(r: dict) -> dict:
    out = {k: v for k, v in r.items() if k != "ids"}
    for k in ("tok_s", "decode_s"):
        out[k] = round(out[k], 4)
    if "phase_ms_per_round" in out:
        out["phase_ms_per_round"] = {p: round(v, 4) for p, v in out["phase_ms_per_round"].items()}
    return out


def child(spec: dict) -> dict:
    import torch  # noqa: PLC0415

    from memra_dist.app import open_engine  # noqa: PLC0415
    from memra_dist.bench.roofline import per_token_acceptance  # noqa: PLC0415
    from memra_dist.bench.tap_replay import TapReplay, replaying  # noqa: PLC0415
    from memra_dist.config import RunConfig  # noqa: PLC0415
    from memra_dist.specdec.drafters.replay import ReplayDrafter  # noqa: PLC0415

    prompt, new, reps, fam = spec["prompt"], spec["new"], spec["repeats"], spec["family"]
    ks = [1] if spec["role"] == "plain" else list(KS[fam])
    kw = dict(model=spec["target"], max_new_tokens=new, k=max(ks), spec_k="fixed")  # each K as asked (the figures are per K)
    if spec["role"] == "plain":
        kw["drafter"] = "none"
    elif fam in ("dflash", "eagle3"):
        kw.update(drafter=fam, draft_model=spec["draft"])
    else:
        kw["drafter"] = "mtp"
    cfg = RunConfig(**kw)
    out: dict = {"role": spec["role"], "family": fam, "graphs": cfg.graphs, "compile": cfg.compile,
                 "torch": torch.__version__,
                 "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    t = time.perf_counter()
    with open_engine(cfg, len(prompt) + new + max(ks) + 1) as engine:
        out["open_s"] = round(time.perf_counter() - t, 1)
        if spec["role"] == "plain":
            r = _measure(engine, prompt, cfg, reps)
            out["plain"] = _slim(r)
            out["recorded"] = r["ids"]
            return out
        out["real"] = {}
        for k in ks:
            out["real"][str(k)] = _slim(_measure(engine, prompt, cfg.with_(k=k), reps))
        pool = getattr(engine._backend, "draft_pool", None)  # the loop's shared draft forwards
        out["drafter_graphs"] = getattr(pool, "graphs", None) is not None  # its rounds on CUDA graphs
        k = TAU_K[fam]
        a = per_token_acceptance(TAU[fam] - 1, k)  # E(a, K) = tau
        with replaying(engine, lambda d, _p: TapReplay(d, ReplayDrafter(spec["recorded"], len(prompt),
                                                                       engine.model.vocab_size, 1 - a, seed=1))):
            r = _measure(engine, prompt, cfg.with_(k=k), reps)
        rec = spec["recorded"]
        r["replay_follows_recording"] = r["ids"] == rec[:len(r["ids"])]
        out["replay"] = {"k": k, "tau": TAU[fam], "acceptance_set": round(a, 4), "corrupt": round(1 - a, 4),
                         **_slim(r)}
    return out


# ---- the driver ---------------------------------------------------------------------------

def _spawn(spec: dict, env: dict) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, __file__, "-", "--child", json.dumps(spec)], env=env, capture_output=True,
                       text=True, timeout=1500)
    if p.returncode != 0:
        raise RuntimeError(f"{spec['family']} {spec['role']} child failed:\n{p.stderr[-3000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["process_s"] = round(time.perf_counter() - t0, 1)
    return r


def _fig(name: str, value: float | None, op: str, thr: float, unit: str = "") -> dict:
    ok = None if value is None else (value <= thr if op == "<=" else value >= thr)
    return {"figure": name, "value": None if value is None else round(value, 4), "target": f"{op} {thr}",
            "status": "n/a" if ok is None else ("pass" if ok else "miss"), "unit": unit}


def _replay_figs(fam: str, plain: dict, rep: dict) -> tuple[dict, list[dict]]:
    from memra_dist.bench.roofline import expected_tokens, per_token_acceptance  # noqa: PLC0415

    k = rep["k"]
    a = per_token_acceptance(rep["accepted"] / rep["rounds"], k) if rep["rounds"] else 0.0
    ph, t_dec = rep["phase_ms_per_round"], plain["phase_ms_per_round"]["verify"]
    ideal = expected_tokens(a, k) * t_dec / (ph["draft"] + ph["verify"])
    achieved = rep["tok_s"] / plain["tok_s"]
    t_round = rep["decode_s"] / max(rep["rounds"], 1) * 1e3
    t_step = 1e3 / plain["tok_s"]
    d = {"k": k, "tau": rep["tau"], "acceptance_set": rep["acceptance_set"], "acceptance_measured": round(a, 4),
         "acceptance_drafted": round(rep["accepted"] / max(rep["drafted"], 1), 4),
         "tokens_per_round": rep["tokens_per_round"], "tok_s": rep["tok_s"], "plain_tok_s": plain["tok_s"],
         "achieved_speedup": round(achieved, 4), "ideal_speedup": round(ideal, 4),
         "fraction_of_ideal": round(achieved / ideal, 4), "decode_step_ms": round(t_step, 4),
         "round_ms": round(t_round, 4), "projected_speedup_at_tau": round(rep["tau"] * t_step / t_round, 4),
         "replay_follows_recording": rep["replay_follows_recording"]}
    return d, [_fig(f"{fam} replay fraction of ideal (a={a:.3f}, K={k})", achieved / ideal, ">=", 0.9)]


def run_family(fam: str, a, dev, cache: Path, env: dict) -> tuple[dict, list[dict]]:
    import torch  # noqa: PLC0415

    from memra_dist.bench import tap_checkpoints as tc  # noqa: PLC0415
    from memra_dist.bench.runs import make_prompt  # noqa: PLC0415

    sz = SIZES[a.shape]
    t0 = time.perf_counter()
    if fam == "dflash":
        target, draft = tc.ensure_dflash(a.shape, cache, dev, _say)
    elif fam == "eagle3":
        target, draft = tc.ensure_eagle3(a.shape, cache, dev, _say)
    else:
        target, draft = tc.ensure_dsv3_mtp(a.shape, cache, dev, _say), None
    ckpt_s = round(time.perf_counter() - t0, 1)
    vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    base = {"family": fam, "target": str(target), "draft": str(draft) if draft else None,
            "prompt": make_prompt(sz["prompt"], vocab), "new": sz["new"], "repeats": sz["repeats"]}
    plain = _spawn({**base, "role": "plain"}, env)
    _say(f"{fam} plain: {plain['plain']['tok_s']:.1f} tok/s, decode step {plain['plain']['phase_ms_per_round']['verify']:.3f} "
         f"ms (open {plain['open_s']} s, process {plain['process_s']} s)")
    spec = _spawn({**base, "role": "spec", "recorded": plain.pop("recorded")}, env)
    p = plain["plain"]
    res = {"target": str(target), "draft": base["draft"], "checkpoint_s": ckpt_s, "plain": p,
           "plain_process_s": plain["process_s"], "spec_process_s": spec["process_s"], "real": spec["real"],
           "device": spec["device"], "graphs": spec["graphs"], "compile": spec["compile"],
           "drafter_graphs": spec.get("drafter_graphs")}
    figs = []
    if fam == "dflash":
        r = spec["real"][str(DFLASH_K)]["phase_ms_per_round"]
        res["draft_ms_per_round"], res["verify16_ms_per_round"] = round(r["draft"], 4), round(r["verify"], 4)
        res["decode_ms_per_round"] = round(p["phase_ms_per_round"]["verify"], 4)
        figs += [_fig("dflash draft / verify(16) per round", r["draft"] / r["verify"], "<=", 0.25),
                 _fig("dflash verify(16) / decode step", r["verify"] / p["phase_ms_per_round"]["verify"], "<=", 1.15)]
    elif fam == "eagle3":
        figs += _eagle3_figs(spec, dev, res, json.loads((Path(draft) / "config.json").read_text()))
    else:
        from memra_dist.bench.roofline import roofline_tok_s  # noqa: PLC0415
        from memra_dist.bench.timing import copy_bandwidth  # noqa: PLC0415

        bw = copy_bandwidth(dev, (2 << 30) if dev.type == "cuda" else (64 << 20))
        rb = tc.mtp_step_read_bytes(tc.dsv3_config(a.shape))
        read_ms = 1e3 / roofline_tok_s(bw["bandwidth_bytes_s"], rb["bytes"])
        res.update(bandwidth_tb_s=round(bw["bandwidth_tb_s"], 4), mtp_step_read=rb, mtp_step_read_ms=round(read_ms, 5),
                   draft_per_token={})
        for k, r in spec["real"].items():
            per_tok = r["phase_ms_per_round"]["draft"] / int(k)
            res["draft_per_token"][k] = {"ms": round(per_tok, 5), "over_read": round(per_tok / read_ms, 4)}
            figs.append(_fig(f"mtp K={k} draft ms per drafted token / MTP step weight read", per_tok / read_ms,
                             "<=", 1.5))
        del torch
    res["replay"], f = _replay_figs(fam, p, {**spec["replay"], "tau": TAU[fam]})
    res["replay_run"] = spec["replay"]
    figs += f
    for x in figs:
        _say(f"{x['figure']}: {x['value']} (target {x['target']}): {x['status']}")
    _say(f"{fam} projected speedup at tau={TAU[fam]}: x{res['replay']['projected_speedup_at_tau']} "
         f"({FORMULAS['projected_speedup']})")
    return res, figs


def _eagle3_figs(spec: dict, dev, res: dict, cfg: dict) -> list[dict]:
    """Draft ms per drafted token over the weight read per drafted token, at each K."""
    from memra_dist.bench import tap_checkpoints as tc  # noqa: PLC0415
    from memra_dist.bench.roofline import roofline_tok_s  # noqa: PLC0415
    from memra_dist.bench.timing import copy_bandwidth  # noqa: PLC0415

    bw = copy_bandwidth(dev, (2 << 30) if dev.type == "cuda" else (64 << 20))
    res.update(bandwidth_tb_s=round(bw["bandwidth_tb_s"], 4), eagle3_read={}, draft_per_token={})
    figs = []
    for k, r in spec["real"].items():
        rb = tc.eagle3_read_bytes(cfg, int(k))
        read_ms = 1e3 / roofline_tok_s(bw["bandwidth_bytes_s"], rb["bytes"])
        per_tok = r["phase_ms_per_round"]["draft"] / int(k)
        res["eagle3_read"][k] = {**rb, "ms": round(read_ms, 5)}
        res["draft_per_token"][k] = {"ms": round(per_tok, 5), "over_read": round(per_tok / read_ms, 4),
                                     "draft_ms_per_round": round(r["phase_ms_per_round"]["draft"], 4)}
        figs.append(_fig(f"eagle3 K={k} draft ms per drafted token / weight read per drafted token",
                         per_tok / read_ms, "<=", 1.5))
    return figs


def _free_disk(cache: Path, keep: str) -> None:
    """Remove the checkpoints in `cache` but those named `keep*` (the MTP slice needs ~51 GB)."""
    for d in cache.iterdir() if cache.exists() else ():
        if d.is_dir() and not d.name.startswith(keep):
            _say(f"--free-disk: removing {d}")
            shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--case", default="all", choices=(*FAMILIES, "all"))
    ap.add_argument("--shape", default="8b", choices=tuple(SIZES))
    ap.add_argument("--cache", default=os.environ.get("MEMRA_BENCH_CACHE", "/tmp/memra-bench-ckpt"))
    ap.add_argument("--free-disk", action="store_true",
                    help="before writing the MTP slice, remove the other checkpoints in --cache")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return 0
    import torch  # noqa: PLC0415

    out, cache = Path(a.out), Path(a.cache)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = dict(os.environ)
    res: dict = {"shape": a.shape, "case": a.case, "sizes": SIZES[a.shape], "formulas": FORMULAS,
                 "tau": TAU, "figures": []}
    t0 = time.perf_counter()
    for fam in FAMILIES:
        if a.case not in (fam, "all"):
            continue
        if fam == "mtp" and a.free_disk:
            _free_disk(cache, "dsv3-mtp")
        try:
            res[fam], figs = run_family(fam, a, dev, cache, env)
            res["figures"] += figs
        except Exception as e:  # noqa: BLE001 (one family's failure is reported, the other still runs)
            res[fam] = {"error": str(e)[-3000:]}
            _say(f"{fam}: ERROR {str(e)[-1500:]}")
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    (out / "tap_drafters.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0 if all("error" not in res.get(f, {}) for f in FAMILIES) else 1


if __name__ == "__main__":
    sys.exit(main())
