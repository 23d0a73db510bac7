"""Figures against their targets with noise-aware statuses (noise.py: pass / miss only when the
whole range of the repeats is on one side; within noise; impossible / unreliable / off label
flags), the markdown table appended to BENCHMARKS.md (only with --record), and the run's
provenance (date, device, commit)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import NamedTuple

from .batching import REPORT as BATCH_FIGURES, fig as batch_fig, rows as batch_rows
from .noise import ACC_TOL, Fig, verdict

__all__ = ["evaluate", "markdown", "append_benchmarks", "git_commit", "TARGETS", "Target", "row_flags",
           "row_label"]


class Target(NamedTuple):
    op: str  # ">=" or "<="
    threshold: float
    what: str  # what the figure measures: the target's name in the markdown
    bound: tuple | None = None  # (op, limit, flag, why): the physically possible side (noise.verdict)
    issue: int = 0  # the tracker issue that set it: kept in the JSON rows' "issue" key, never shown


_ABOVE_IDEAL = ("<=", 1.0, "impossible", "faster than the ideal speedup")
_ROWS_FASTER = (">=", 1.0, "unreliable", "K+1 rows timed faster than 1 row")
TARGETS = {
    "plain_roofline_fraction": Target(">=", 0.85, "plain batch-1 decode / roofline (target stated for the 8b shape)",
                                      ("<=", 1.0, "impossible", "faster than the roofline"), 7),
    "verify_ratio_k2": Target("<=", 1.15, "verify(3) / decode(1) step cost", _ROWS_FASTER, 7),
    "verify_ratio_k4": Target("<=", 1.15, "verify(5) / decode(1) step cost", _ROWS_FASTER, 7),
    "spec_fraction_acc0.6": Target(">=", 0.90, "spec tok/s fraction of ideal speedup, replay drafter at "
                                               "acceptance 0.6 (worst K)", _ABOVE_IDEAL, 7),
    "spec_fraction_acc0.8": Target(">=", 0.90, "spec tok/s fraction of ideal speedup, replay drafter at "
                                               "acceptance 0.8 (worst K)", _ABOVE_IDEAL, 7),
    "spec_fraction_acc0.9": Target(">=", 0.90, "spec tok/s fraction of ideal speedup, replay drafter at "
                                               "acceptance 0.9 (worst K)", _ABOVE_IDEAL, 7),
    "over_transformers": Target(">=", 5.0, "memra plain decode / transformers generate() tok/s", None, 7),
    "pp2_over_pp1_step": Target("<=", 1.05, "pp=2 / pp=1 decode step",
                                (">=", 1.0, "unreliable", "a pp=2 step timed faster than a pp=1 step"), 4),
    "hop_one_way_us": Target("<=", 50.0, "per-hop activation transfer, one way, us", None, 4),
    "trace_l1_overhead_pct": Target("<=", 2.0, "trace level 1 wall overhead vs level 0, %, worst drafter",
                                    (">=", 0.0, "unreliable", "level 1 timed faster than level 0"), 3),
    "trace_l2_overhead_pct": Target("<=", 5.0, "trace level 2 wall overhead vs level 0, %, worst drafter",
                                    (">=", 0.0, "unreliable", "level 2 timed faster than level 0"), 3),
    "model_draft_over_weight_read": Target("<=", 1.5, "model drafter: draft cost per drafted token / its "
                                                      "weight-read time (worst K)"),
    "ngram_propose_us": Target("<=", 50.0, "n-gram propose per round, us (worst K)"),
    "prefill_ttft_512_ms": Target("<=", 30.0, "time to first token, 512-token prompt, warm engine, ms"),
    "batch_x16": Target(">=", 12.0, "plain greedy, 16 concurrent requests batched: steady decode tok/s / one "
                                    "request's", None, 29),
    "batch_x64": Target(">=", 35.0, "plain greedy, 64 concurrent requests batched: steady decode tok/s / one "
                                    "request's", None, 29),
    "batch_itl_ratio_16": Target("<=", 1.3, "inter-token latency p50 at 16 concurrent requests / a request alone",
                                 None, 29),
    "batch_ngram_over_plain_16": Target(">=", 1.3, "ngram (K = 4) at 16 concurrent requests / plain at 16, steady "
                                                   "tok/s", None, 29),
    "batch_l1_cost_pct_16": Target("<=", 3.0, "trace level 1 at 16 concurrent requests batched: steady tok/s lost "
                                              "against level 0, %", None, 29),
    "batch_l2_cost_pct_16": Target("<=", 5.0, "trace level 2 at 16 concurrent requests batched, plain: steady tok/s "
                                              "lost against level 0, %", None, 44),
    **{f"batch_dflash_l{lv}_cost_pct_16": Target("<=", v, f"trace level {lv} at 16 concurrent requests batched, the "
                                                         f"DFlash replay: steady tok/s lost against level 0, %", None, 44)
       for lv, v in ((1, 2.0), (2, 5.0))},
    "batch_dflash_auto_over_plain_16": Target(">=", 0.97, "DFlash replay with --spec-k auto at 16 concurrent / "
                                                          "plain at 16, steady tok/s (never slower)", None, 45),
    "batch_ngram_auto_over_plain_16": Target(">=", 0.97, "ngram with --spec-k auto at 16 concurrent / plain at 16, "
                                                         "steady tok/s (never slower)", None, 45),
    **{f"batch_tap_auto_over_plain_{n}": Target(">=", v, f"the worse of the DFlash and EAGLE-3 replays (~0.8 right), "
                                                          f"--spec-k auto, {n} concurrent / plain at {n}", None, 45)
       for n, v in ((1, 2.0), (2, 2.0), (16, 1.6), (64, 1.4))},
    "batch_ngram_sweep_16": Target(">=", 1.6, "ngram, --spec-k auto, 16 concurrent / plain at 16", None, 45),
    **{f"batch_ttft_load_{d}": Target("<=", 1.3, f"TTFT p50, 16 prompts of 512 together ({d}, no prefix cache) / one "
                                                 f"8k prompt's alone", None, 44) for d in ("plain", "ngram")},
    "batch_auto_never_slower": Target(">=", 0.97, "the lowest of the sweep's rows over plain (every drafter, "
                                                  "concurrency and acceptance, none right included)", None, 45),
    "prefill_ttft_8k_over_sdpa": Target("<=", 1.0, "time to first token at 8k / transformers' SDPA forward of the "
                                                   "prompt (goal 1 / 1.1)"),
    "prefill_ttft_32k_over_sdpa": Target("<=", 1.0, "time to first token at 32k / transformers' SDPA forward of the "
                                                    "prompt (goal 1 / 1.1)"),
    "prefill_tflops_32k": Target(">=", 650.0, "prefill TFLOP/s at 32k (2 P T + causal attention)",
                                 ("<=", 1000.0, "impossible", "above the bf16 matrix peak")),
    "prefill_128k_over_weights_kv_gb": Target("<=", 4.0, "peak memory over weights + KV cache, 128k prompt, GB"),
    "decode_after_32k_kv_roofline": Target(">=", 0.85, "decode after a 32k prompt / roofline counting the KV reads",
                                           ("<=", 1.0, "impossible", "faster than the roofline")),
}
# targets stated for the 8b shape (the Llama-3-8B figures they were set from)
SHAPE_8B_ONLY = ("plain_roofline_fraction", "prefill_ttft_512_ms", "prefill_ttft_8k_over_sdpa",
                 "prefill_ttft_32k_over_sdpa", "prefill_tflops_32k", "prefill_128k_over_weights_kv_gb",
                 "decode_after_32k_kv_roofline", *(k for k in TARGETS if k.startswith("batch_")))  # (every batching one)

RULE = ("pass / miss only when the whole range of the repeats lies on one side of the target, else within "
        "noise; range = min-max of the repeats (10 % trimmed at each end from 10 repeats on), worst case "
        "through ratios")


def _get(d: dict, *path):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def row_label(row: dict) -> str:
    """A spec row named by its MEASURED acceptance (the replay label in brackets, flagged when off)."""
    tag = f"{row.get('drafter')} K={row.get('k')}"
    a, ta = row.get("acceptance"), row.get("target_acceptance")
    if a is not None:
        tag += f" a={a:.3f}"
    if ta is not None:
        off = a is not None and abs(a - ta) > ACC_TOL
        tag += f" (label {ta:g}{', off label' if off else ''})"
    return tag


def row_flags(row: dict) -> list[str]:
    """What is wrong with one spec row: a fraction of ideal above 1 (impossible when its whole
    range is), an acceptance more than ACC_TOL off its replay label, greedy ids off plain."""
    out = []
    v = row.get("fraction_of_ideal")
    if v is not None and v > 1:
        f = Fig.from_json(v, row.get("fraction_of_ideal_range"), row.get("repeats"))
        if not f.known:
            out.append(f"unreliable: {v:.2f} of ideal (above 1), spread not measured")
        elif f.lo > 1:
            out.append(f"impossible: {v:.2f} of ideal, whole range {f.lo:.2f}-{f.hi:.2f} above 1")
        else:
            out.append(f"within noise: {v:.2f} of ideal is above 1 only within its range {f.lo:.2f}-{f.hi:.2f}")
    a, ta = row.get("acceptance"), row.get("target_acceptance")
    if a is not None and ta is not None and abs(a - ta) > ACC_TOL:
        out.append(f"off label: measured acceptance {a:.3f} vs label {ta:g} (tolerance {ACC_TOL:g})")
    if row.get("greedy_mismatch"):
        out.append("greedy mismatch: spec ids differ from plain")
    return out


def _spec_figure(res: dict, acc: str) -> tuple[Fig | None, str | None]:
    """(worst-K figure, flag status or None) of the replay rows labelled `acc`: the row flags
    impossible / unreliable / off label decide the status before any comparison."""
    rows = [r for r in _get(res, "decode", "spec") or [] if r.get("drafter") == "replay"
            and f"{r.get('target_acceptance')}" == acc and r.get("fraction_of_ideal") is not None]
    if not rows:
        return None, None
    figs = [Fig.from_json(r["fraction_of_ideal"], r.get("fraction_of_ideal_range"), r.get("repeats")) for r in rows]
    known = all(f.known for f in figs)  # min over K: [min lo, min hi], fewest repeats
    fig = Fig(min(f.value for f in figs), min(f.lo for f in figs) if known else None,
              min(f.hi for f in figs) if known else None, min(f.n for f in figs))
    bad = {"impossible": [], "unreliable": [], "off label": []}
    for r in rows:
        kinds = {fl.partition(": ")[0] for fl in row_flags(r)}
        if "impossible" in kinds or "unreliable" in kinds:
            rr = r.get("fraction_of_ideal_range")
            rs = f" (range {rr[0]:.3g}-{rr[1]:.3g})" if rr else ""
            bad["impossible" if "impossible" in kinds else "unreliable"].append(
                f"{r['fraction_of_ideal']:.3g} of ideal at K={r.get('k')}{rs}")
        if "off label" in kinds:
            bad["off label"].append(f"a={r['acceptance']:.3f} at K={r.get('k')}")
    why = {"impossible": "above 1 beyond the noise", "unreliable": "above 1, spread not measured",
           "off label": f"measured acceptance vs label {acc} ± {ACC_TOL:g}"}
    status = "; ".join(f"{k} ({', '.join(v)}: {why[k]})" for k, v in bad.items() if v) or None
    return fig, status


def _worst_row(res: dict, drafter: str, key: str, n_key: str) -> Fig | None:
    """The largest `key` over the spec rows of `drafter` (the worst K of a "<=" target) with
    [max lo, max hi] and the fewest repeats; None when no row has it."""
    figs = [Fig.from_json(r[key], r.get(f"{key}_range"), r.get(n_key)) for r in _get(res, "decode", "spec") or []
            if r.get("drafter") == drafter and r.get(key) is not None]
    if not figs:
        return None
    known = all(f.known for f in figs)
    return Fig(max(f.value for f in figs), max(f.lo for f in figs) if known else None,
               max(f.hi for f in figs) if known else None, min(f.n for f in figs))


def _worst_trace(res: dict, level: str) -> Fig | None:
    """A trace level's overhead with its worst drafter (the trace section's `by_drafter`; a
    result without it: its one replay case)."""
    tr = res.get("trace") or {}
    cases = [c for c in tr.get("by_drafter") or [tr] if _get(c, "overhead_pct", level) is not None]
    figs = [Fig.from_json(c["overhead_pct"][level], _get(c, "overhead_pct_range", level), c.get("repeats"))
            for c in cases]
    if not figs:
        return None
    return max(figs, key=lambda f: f.value)


def _figures(res: dict) -> dict:
    """name -> (Fig or None, status forced by a flag or None)."""
    f = {"plain_roofline_fraction": Fig.from_json(_get(res, "decode", "plain", "roofline_fraction"),
                                                  _get(res, "decode", "plain", "roofline_fraction_range"),
                                                  _get(res, "decode", "plain", "repeats")),
         "over_transformers": Fig.from_json(_get(res, "peer", "memra_over_transformers"),
                                            _get(res, "peer", "memra_over_transformers_range"),
                                            _get(res, "peer", "plain", "repeats")),
         "pp2_over_pp1_step": Fig.from_json(_get(res, "pp", "pp2_over_pp1_step"),
                                            _get(res, "pp", "pp2_over_pp1_step_range"),
                                            len(_get(res, "pp", "pp2", "tok_s_segments") or []) or None),
         "hop_one_way_us": Fig.from_json(_get(res, "pp", "hop", "one_way_us"),
                                         _get(res, "pp", "hop", "one_way_us_range"), _get(res, "pp", "hop", "iters")),
         "trace_l1_overhead_pct": _worst_trace(res, "1"), "trace_l2_overhead_pct": _worst_trace(res, "2")}
    for k in ("2", "4"):
        f[f"verify_ratio_k{k}"] = Fig.from_json(_get(res, "steps", "verify", k, "ratio_vs_decode"),
                                                _get(res, "steps", "verify", k, "ratio_range"),
                                                _get(res, "steps", "repeats"))
    f["model_draft_over_weight_read"] = _worst_row(res, "model", "draft_cost_over_weight_read",
                                                   "draft_cost_over_weight_read_repeats")
    f["ngram_propose_us"] = _worst_row(res, "ngram", "ngram_propose_us", "ngram_propose_repeats")
    f.update(_prefill_figures(res))
    f.update({name: batch_fig(res, key) for name, key in BATCH_FIGURES.items()})
    out = {name: (fig, None) for name, fig in f.items()}
    for acc in ("0.6", "0.8", "0.9"):
        out[f"spec_fraction_acc{acc}"] = _spec_figure(res, acc)
    return out


def _prefill_figures(res: dict) -> dict:
    """The prefill section's figures at their prompt lengths (512, 8k, 32k, 128k tokens)."""
    def ours(n: int, key: str, n_key: str = "repeats"):
        return Fig.from_json(_get(res, "prefill", "ours", str(n), key), _get(res, "prefill", "ours", str(n), f"{key}_range"),
                             _get(res, "prefill", "ours", str(n), n_key))

    def peer(n: int):
        row = _get(res, "prefill", "peer", "lengths", str(n)) or {}
        return Fig.from_json(row.get("ours_ttft_over_sdpa"), row.get("ours_ttft_over_sdpa_range"), row.get("repeats"))

    mem = _get(res, "prefill", "ours", "131072", "overhead_gb")
    return {"prefill_ttft_512_ms": ours(512, "ttft_ms"), "prefill_ttft_8k_over_sdpa": peer(8192),
            "prefill_ttft_32k_over_sdpa": peer(32768), "prefill_tflops_32k": ours(32768, "tflops"),
            # memory is not a timing: one request gives it exactly
            "prefill_128k_over_weights_kv_gb": None if mem is None else Fig.exact(mem),
            "decode_after_32k_kv_roofline": ours(32768, "decode_kv_roofline_fraction")}


def _l0_noise_row(res: dict) -> dict:
    v = _get(res, "trace", "level0_noise_pct")
    if v is not None:
        status = "n/a (no hook-free build in the same run; the value is the level-0 noise floor)"
    elif isinstance(res.get("trace"), dict) and "overhead_pct" in res["trace"]:
        status = f"not measured ({_get(res, 'trace', 'level0_noise_why') or 'fewer than 2 level-0 runs'})"
    else:
        status = "not measured (trace section not run)"
    return {"name": "trace_l0_noise_pct", "what": "trace level 0 vs a build without the hooks (level-0 run spread, %)",
            "value": v, "target": "within noise", "issue": 3, "status": status, "lo": None, "hi": None,
            "n": _get(res, "trace", "repeats"), "spread_pct": None, "range_note": "the value is itself a spread"}


def evaluate(res: dict) -> list[dict]:
    """One row per target: measured value (the median; None = not measured in this run), its
    range (lo, hi), repeats (n), relative half-range (spread_pct) and the status (noise.py)."""
    out = []
    shape = _get(res, "meta", "shape")
    for name, (fig, flag) in _figures(res).items():
        t = TARGETS[name]
        if fig is None:
            status = "n/a (not measured)"
        elif name in SHAPE_8B_ONLY and shape != "8b":
            status = "n/a (target is for the 8b shape)"
        else:
            status = flag or verdict(fig, t.op, t.threshold, t.bound)
        known = fig is not None and fig.known
        sp = fig.spread_pct() if known else None
        out.append({"name": name, "what": t.what, "value": None if fig is None else fig.value,
                    "target": f"{t.op} {t.threshold:g}", "issue": t.issue, "status": status,
                    "op": t.op, "threshold": t.threshold, "lo": fig.lo if known else None,
                    "hi": fig.hi if known else None, "n": fig.n if fig is not None and fig.n < 1 << 30 else None,
                    "spread_pct": None if sp is None else round(sp, 2)})
    out.append(_l0_noise_row(res))
    return out


def _rng(rng, fmt: str = ".3g", unit: str = "") -> str:
    """' (range lo-hi)' from a "_range" key, or '' when none was recorded."""
    if not (isinstance(rng, (list, tuple)) and len(rng) == 2 and None not in rng):
        return ""
    return f" (range {rng[0]:{fmt}}-{rng[1]:{fmt}}{unit})"


def _info_rows(res: dict) -> list[tuple[str, str]]:
    rows = []
    bw = res.get("bandwidth") or {}
    if "bandwidth_tb_s" in bw:
        br = bw.get("bandwidth_bytes_s_range")
        rows.append(("copy bandwidth", f"{bw['bandwidth_tb_s']:.3f} TB/s" + _rng([x / 1e12 for x in br] if br else None,
                                                                                 ".3f")))
        rows.append(("weights / roofline", f"{bw['weight_bytes'] / 1e9:.2f} GB / {bw['roofline_tok_s']:.1f} tok/s"))
    pl = _get(res, "decode", "plain")
    if isinstance(pl, dict) and pl.get("tok_s") is not None:
        rows.append(("plain decode", f"{pl['tok_s']:.1f} tok/s" + _rng(pl.get("tok_s_range"), ".1f")
                     + (f", {pl['repeats']} runs" if pl.get("repeats") else "")))
    for r in _get(res, "decode", "spec") or []:
        if "ideal_speedup" in r:
            flags = row_flags(r)
            rows.append((f"spec {row_label(r)}",
                         f"{r['tok_s']:.1f} tok/s{_rng(r.get('tok_s_range'), '.1f')}, x{r['achieved_speedup']:.2f} of "
                         f"ideal x{r['ideal_speedup']:.2f} = {r['fraction_of_ideal']:.2f}"
                         f"{_rng(r.get('fraction_of_ideal_range'), '.2f')}" + "".join(f"; **{f}**" for f in flags)))
        if r.get("draft_ms_per_round") is not None:
            rows.append((f"draft phase {row_label(r)}", _draft_cost(r)))
    for kind in ("plain", "assisted"):
        v = _get(res, "peer", kind, "tok_s")
        if v is not None:
            rows.append((f"transformers generate() {kind}",
                         f"{v:.1f} tok/s" + _rng(_get(res, "peer", kind, "tok_s_range"), ".1f")))
    tr = res.get("trace") or {}
    if tr.get("overhead_pct"):
        why = tr.get("level0_noise_why") or "fewer than 2 level-0 runs"
        for c in tr.get("by_drafter") or [tr]:
            if "overhead_pct" not in c:
                rows.append((f"trace levels, {c['drafter']}", f"skipped ({c.get('skipped', 'not run')})"))
                continue
            n0 = c.get("level0_noise_pct")
            rows.append((f"trace levels 1 / 2, {c.get('drafter', 'replay')} K={c.get('k', 4)}",
                         f"{c['overhead_pct']['1']:+.2f} %{_rng(_get(c, 'overhead_pct_range', '1'), '.2f', ' %')} / "
                         f"{c['overhead_pct']['2']:+.2f} %{_rng(_get(c, 'overhead_pct_range', '2'), '.2f', ' %')}"
                         + (f"; level-0 noise {n0:.2f} % over {c.get('repeats')} runs" if n0 is not None
                            else f"; level-0 noise not measured ({c.get('level0_noise_why') or why})")))
        if tr.get("clock"):
            rows.append(("trace clock", tr["clock"]))
    for pp in (2, 4):
        r = _get(res, "pp", f"pp{pp}")
        if isinstance(r, dict) and r.get("tok_s"):
            ratio = _get(res, "pp", f"pp{pp}_over_pp1_step")
            rows.append((f"pp={pp} decode", f"{r['tok_s']:.1f} tok/s, step x{ratio}"
                                             f"{_rng(_get(res, 'pp', f'pp{pp}_over_pp1_step_range'))} of pp=1, "
                                             f"greedy ids equal pp=1: {r.get('greedy_ids_equal_pp1')}"))
    rows += _prefill_rows(res)
    rows += _prefix_rows(res)
    rows += batch_rows(res)
    for k, h in (_get(res, "hybrid", "k") or {}).items():
        rows.append((f"hybrid {res['hybrid']['shape']} K={k}", f"verify/decode {h['ratio_vs_decode']:.2f}, "
                                                             f"KDA rollback {h['rollback_share_of_verify'] * 100:.2f} % of verify"))
    return rows


def _prefix_rows(res: dict) -> list[tuple[str, str]]:
    """The prefix cache: TTFT at the caller with it off / on, for a chat's second turn and a
    shared header, the tokens it shared, and whether the ids stayed the same."""
    p = res.get("prefix") or {}
    rows = []
    for key, what in (("turn2", "chat turn 2"), ("shared", f"shared header x{p.get('requests')}"),
                      ("together", f"one header, {p.get('requests')} arriving together")):
        if p.get(f"{key}_ttft_ms_on") is None:
            continue
        rows.append((f"prefix cache, {what} ({p['header']} tokens)",
                     f"TTFT {p[f'{key}_ttft_ms_off']:.1f}{_rng(p.get(f'{key}_ttft_ms_off_range'), '.1f')} -> "
                     f"{p[f'{key}_ttft_ms_on']:.1f}{_rng(p.get(f'{key}_ttft_ms_on_range'), '.1f')} ms "
                     f"(x{p[f'{key}_speedup']}), cached tokens {p.get('cached_tokens_on')}, ids equal "
                     f"{p.get('ids_equal')}"))
    j = p.get("job")
    if j and p.get("job_speedup") is not None:
        rows.append((f"prefix cache, batch job of {j['prompts']} ({j['header']}-token header + {j['own']} own, "
                     f"{j['inflight']} in flight)",
                     f"{p['job_tok_s_off']:.1f} -> {p['job_tok_s_on']:.1f} generated tok/s ({p['job_s_off']:.2f} -> "
                     f"{p['job_s_on']:.2f} s, x{p['job_speedup']}), cached tokens {p.get('job_cached_tokens_on')}"
                     f"{_job_steps(p.get('job_steps_off'), p.get('job_steps_on'))}"))
    if j and p.get("unshared_on_over_off") is not None:
        rows.append(("prefix cache, the same job with nothing shared",
                     f"{p['unshared_tok_s_off']:.1f} -> {p['unshared_tok_s_on']:.1f} generated tok/s "
                     f"(on / off x{p['unshared_on_over_off']}, the median of the pairs' "
                     f"{p.get('unshared_pairs', [])}; bound >= 0.98), cached tokens "
                     f"{p.get('unshared_cached_tokens_on')}"))
    return rows


def _job_steps(off: dict | None, on: dict | None) -> str:
    """The engine's steps of a job, off -> on (bench/prefix.py job_steps): eager ones and the
    graphed ones that carried a prefill chunk, and the device's busy share."""
    if not off or not on:
        return ""
    return (f"; steps {off['steps']} -> {on['steps']} (eager {off['eager_steps']} -> {on['eager_steps']}, "
            f"prefill on graphs {off['prefill_graph_steps']} -> {on['prefill_graph_steps']}), busy "
            f"{off['busy']} -> {on['busy']}")


def _prefill_rows(res: dict) -> list[tuple[str, str]]:
    """Per prompt length: our TTFT, tok/s, TFLOP/s, peak memory, decode against the KV roofline
    and transformers' SDPA forward; the chunk sweep."""
    pf = res.get("prefill") or {}
    rows = []
    for n, o in (pf.get("ours") or {}).items():
        try:
            rows.append((f"prefill {n} tokens (ours)", _prefill_ours(o)))
        except (KeyError, TypeError, ValueError):
            rows.append((f"prefill {n} tokens (ours)", "not measured" + (
                f" ({o.get('skipped') or o.get('error')})" if isinstance(o, dict) and (o.get("skipped") or o.get("error"))
                else "")))
        h = _get(pf, "peer", "lengths", n)
        if isinstance(h, dict) and h.get("oom"):
            rows.append((f"prefill {n} tokens (transformers sdpa)", "out of memory"))
        elif isinstance(h, dict) and "forward_ms" in h:
            ratio = (f"; ours / sdpa x{h['ours_ttft_over_sdpa']:.3f}{_rng(h.get('ours_ttft_over_sdpa_range'))}"
                     if h.get("ours_ttft_over_sdpa") is not None else "")
            rows.append((f"prefill {n} tokens (transformers sdpa)",
                         f"forward {h['forward_ms']:.4g} ms{_rng(h.get('forward_ms_range'), '.4g')} (n={h.get('repeats')}), "
                         f"{h.get('tflops', 0):.4g} TFLOP/s" + (f", peak {h['peak_gb']:.2f} GB" if h.get("peak_gb") is not None
                                                                else "") + ratio))
    sw = pf.get("sweep") or {}
    if sw.get("rows"):
        cells = [f"{c}: {r['ttft_ms']:.4g} ms" + (f", {r['peak_gb']:.2f} GB" if r.get("peak_gb") is not None else "")
                 if "ttft_ms" in r else f"{c}: {'OOM' if r.get('oom') else r.get('skipped') or r.get('error')}"
                 for c, r in sw["rows"].items()]
        eq = sw.get("greedy_ids_equal") or {}
        rows.append((f"prefill chunk sweep at {sw.get('prompt')} tokens", "; ".join(cells)
                     + f"; best {sw.get('best_chunk')}" + (f", default / best x{sw['default_over_best']:.3f}"
                                                           if sw.get("default_over_best") else "")
                     + f"; greedy ids equal across chunks: {all(eq.values()) if eq else 'n/a'}"))
    return rows


def _prefill_ours(o: dict) -> str:
    mem = (f"; peak {o['peak_gb']:.2f} GB = weights {o['weights_gb']:.2f} + KV cache {o['kv_cache_gb']:.2f} "
           f"+ {o['overhead_gb']:.2f}" if o.get("peak_gb") is not None else "")
    return (f"TTFT {o['ttft_ms']:.4g} ms{_rng(o.get('ttft_ms_range'), '.4g')} (n={o['repeats']}), "
            f"{o['prefill_tok_s']:.0f} tok/s, {o['tflops']:.4g} TFLOP/s{mem}; decode {o['decode_tok_s']:.1f} "
            f"tok/s = {o['decode_kv_roofline_fraction']:.3f} of {o['decode_kv_roofline_tok_s']:.1f} (KV roofline)")


def _draft_cost(r: dict) -> str:
    """A spec row's draft cost: ms per round and per drafted token (phase clock), the model
    drafter's weight-read time and ratio, the n-gram propose time."""
    out = f"{r['draft_ms_per_round']:.4g} ms/round{_rng(r.get('draft_ms_per_round_range'), '.4g')}"
    if r.get("draft_ms_per_drafted_token") is not None:
        out += (f", {r['draft_ms_per_drafted_token']:.4g} ms/drafted token"
                f"{_rng(r.get('draft_ms_per_drafted_token_range'), '.4g')}")
    if r.get("draft_cost_over_weight_read") is not None:
        out += (f"; weight read {r['draft_weight_read_ms']:.4g} ms"
                f"{_rng(r.get('draft_weight_read_ms_range'), '.4g')}, cost / read "
                f"x{r['draft_cost_over_weight_read']:.3g}{_rng(r.get('draft_cost_over_weight_read_range'))}")
    if r.get("ngram_propose_us") is not None:
        out += (f"; propose {r['ngram_propose_us']:.3g} us{_rng(r.get('ngram_propose_us_range'))} "
                f"at ctx {r.get('ngram_propose_ctx')}")
    return out


def _fmt(v) -> str:
    return "—" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))


def _spread(t: dict) -> str:
    """The range column: 'lo-hi, ±x % (n repeats)', or why there is none."""
    if t.get("lo") is None or t.get("hi") is None:
        return "—" if t.get("value") is None else t.get("range_note", "not measured")
    sp = f", ±{t['spread_pct']:.3g} %" if t.get("spread_pct") is not None else ""
    n = f" (n={t['n']})" if t.get("n") else ""
    return f"{t['lo']:.4g}-{t['hi']:.4g}{sp}{n}"


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"### memra-dist bench · {m['date']} · {m['device_name']} · commit {m['commit']} · shape {m['shape']}",
             "",
             f"device {m['device']}, dtype {m['dtype']}, graphs {m['graphs']['active']}, quick {m['quick']}, "
             f"ctx {m['ctx']}, {m['max_new']} new tokens, torch {m['torch']}; one run, so the ratios hold.",
             "",
             "| figure | measured (median) | range of repeats | target | status |",
             "|---|---|---|---|---|"]
    for t in res["targets"]:
        lines.append(f"| {t['what']} | {_fmt(t['value'])} | {_spread(t)} | {t['target']} | {t['status']} |")
    lines += ["", f"Status: {RULE}; a replay row is off label when its measured acceptance is more than "
                  f"{ACC_TOL:g} from its label."]
    info = _info_rows(res)
    if info:
        lines += ["", "| measured (no target) | value |", "|---|---|"]
        lines += [f"| {a} | {b} |" for a, b in info]
    lines += ["", f"Spec formula: {res.get('formula', '')}", ""]
    if isinstance(res.get("prefill"), dict) and res["prefill"].get("flops_formula"):
        lines[-1:] = [f"Prefill: {res['prefill']['flops_formula']}; {res['prefill']['decode_formula']}; TTFT = "
                      f"{res['prefill']['ttft']}.", ""]
    return "\n".join(lines)


def append_benchmarks(md: str, path: Path) -> None:
    head = "" if path.exists() else "# Benchmarks\n\nAppended by `memra-dist bench --record` (see benchmarks/README.md).\n\n"
    with path.open("a") as f:
        f.write(head + md + "\n")


def git_commit(root: Path) -> str:
    from ..env import environment  # noqa: PLC0415

    if environment().commit:  # a copied tree without .git (the GPU machine)
        return environment().commit
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=root, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
