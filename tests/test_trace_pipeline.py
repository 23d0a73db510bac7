"""Traces that are never lost and never false, at pp > 1: every role's spans reach the run
directory on a long run and on Ctrl-C (or the CLI names what was lost), one Perfetto file
holds every process, failures are refused early with one line, tables print each row once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memra_dist.tracing.conventions import PHASE_SPANS, SPAN_ROUND, SPAN_STAGE_FORWARD

PROMPT = "The phase clock drains the streams"


def _env(**over):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "RAY_ADDRESS", "MEMRA_", "TRACEPARENT"))}
    env.update(over)
    return env


def _cmd(model, *extra):
    return [sys.executable, "-m", "memra_dist.cli", "generate", "--model", str(model), "--prompt", PROMPT,
            "--device", "cpu", *extra]


@pytest.fixture(scope="module")
def long_llama(ckpt_factory):
    """A tiny llama with room for a few thousand tokens and no end-of-text id to stop early."""
    return ckpt_factory("llama", seed=3, max_position_embeddings=4096, eos_token_id=None)[0]


def _spans_by_role(run_dir: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for f in sorted(run_dir.glob("*spans.otlp.json")):
        for rs in json.loads(f.read_text())["resourceSpans"]:
            res = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}
            for ss in rs["scopeSpans"]:
                out.setdefault(res["memra.role"]["stringValue"], []).extend(ss["spans"])
    return out


def _attr(span: dict, key: str):
    for a in span.get("attributes", []):
        if a["key"] == key:
            v = a["value"]
            return int(v["intValue"]) if "intValue" in v else v.get("stringValue", v.get("doubleValue"))
    return None


def _assert_one_perfetto_file(run_dir: Path, roles: set[str]) -> dict:
    assert not list(run_dir.glob("*-trace.perfetto.json")), "per-role Perfetto files: one file is the promise"
    trace = json.loads((run_dir / "trace.perfetto.json").read_text())
    ev = trace["traceEvents"]
    procs = [e for e in ev if e["ph"] == "M" and e["name"] == "process_name"]
    names = " | ".join(e["args"]["name"] for e in procs)
    assert len(procs) == len({e["pid"] for e in procs}) == len(roles), names  # one metadata event per process
    for role in roles:
        assert f"memra {role}" in names, names
    threads = [(e["pid"], e["tid"]) for e in ev if e["ph"] == "M" and e["name"] == "thread_name"]
    assert len(threads) == len(set(threads))  # one per track
    spans = [e for e in ev if e["ph"] == "X"]
    assert {(e["pid"], e["tid"]) for e in spans} <= set(threads)
    return trace


def _assert_no_temp_files(run_dir: Path) -> None:
    left = [p.name for p in run_dir.iterdir() if p.name.startswith(".")]
    assert left == [], left


def _assert_phases_tile_rounds(trace: dict) -> None:
    """In the merged file, each round's five phase spans lie end to end inside it."""
    ev = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    rounds = [e for e in ev if e["name"] == SPAN_ROUND]
    phases = [e for e in ev if e["name"] in PHASE_SPANS.values()]
    assert rounds and len(phases) == 5 * len(rounds)
    phases.sort(key=lambda e: e["ts"])
    by_round = {}
    for r in rounds:
        by_round[(r["pid"], r["args"]["memra.round"])] = r
    for i in range(0, len(phases), 5):
        five = phases[i:i + 5]
        r = by_round[(five[0]["pid"], five[0]["args"]["memra.round"])]
        assert [p["name"] for p in five] == list(PHASE_SPANS.values())
        assert abs(five[0]["ts"] - r["ts"]) < 2.0  # microseconds
        for a, b in zip(five, five[1:]):
            assert abs(a["ts"] + a["dur"] - b["ts"]) < 2.0
        assert abs(five[-1]["ts"] + five[-1]["dur"] - (r["ts"] + r["dur"])) < 2.0


@pytest.mark.slow
def test_long_pp2_run_keeps_every_roles_spans_in_one_trace_file(long_llama, tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.run(_cmd(long_llama, "--pp", "2", "--trace-level", "1", "--max-new-tokens", "3000",
                            "--burst-rounds", "64", "--run-dir", str(run_dir), "--json"),
                       capture_output=True, text=True, env=_env(), timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert len(out["token_ids"]) == 3000 and out["trace_complete"] and out["run_dir"] == str(run_dir)
    assert "lost" not in p.stderr and "INCOMPLETE" not in p.stderr
    busy = out["stage_busy"]  # from the stage spans: one session keeps one stage busy at a time
    assert set(busy) == {"0", "1"} and 0 < busy["0"] + busy["1"] <= 1.0 + 1e-3, busy
    rounds = out["stats"]["rounds"]
    spans = _spans_by_role(run_dir)
    assert set(spans) == {"driver", "head", "stage"}
    head = spans["head"]
    assert sum(s["name"] == SPAN_ROUND for s in head) == rounds
    for name in PHASE_SPANS.values():
        assert sum(s["name"] == name for s in head) == rounds, name
    # one stage.forward per target forward (the prime + one verify per round) on EVERY stage,
    # the last one included (the head runs its layers)
    for role, stage in (("stage", 0), ("head", 1)):
        fw = [s for s in spans[role] if s["name"] == SPAN_STAGE_FORWARD]
        assert len(fw) == rounds + 1, role
        assert {_attr(s, "memra.stage") for s in fw} == {stage}
    _assert_no_temp_files(run_dir)
    _assert_phases_tile_rounds(_assert_one_perfetto_file(run_dir, {"driver", "head", "stage"}))


@pytest.mark.slow
def test_sigint_mid_burst_at_pp2_keeps_or_counts_every_roles_spans(long_llama, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_cmd(long_llama, "--pp", "2", "--trace-level", "1", "--max-new-tokens", "3500",
                                 "--burst-rounds", "4", "--run-dir", str(run_dir)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), text=True)
    try:
        got = ""
        deadline = time.monotonic() + 240
        while len(got) < len(PROMPT) + 40 and time.monotonic() < deadline:  # tokens are streaming: mid-request
            ch = proc.stdout.read(1)
            if not ch:
                break
            got += ch
        assert len(got) >= len(PROMPT) + 40, "the run never streamed tokens"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    spans = _spans_by_role(run_dir)
    lost = [ln for ln in err.splitlines() if "spans lost" in ln]
    for role in ("head", "stage"):
        named = [ln for ln in lost if f" {role}" in ln]
        if named:  # lost: said, with the role, and never "written"
            assert "spans written" not in err
            continue
        assert spans.get(role), f"{role}: no spans and no word of a loss\n{err[-2000:]}"
    assert any(s["name"] == SPAN_ROUND for s in spans.get("head", [])) or lost
    assert any(s["name"] == SPAN_STAGE_FORWARD for s in spans.get("stage", [])) or lost
    _assert_no_temp_files(run_dir)
    _assert_one_perfetto_file(run_dir, set(spans))


@pytest.mark.slow
def test_prof_rounds_printed_once_per_round_at_pp2(llama, tmp_path):
    p = subprocess.run(_cmd(llama, "--pp", "2", "--prof", "--max-new-tokens", "40", "--burst-rounds", "2",
                            "--run-dir", str(tmp_path / "run"), "--json"),
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rounds = json.loads(p.stdout)["stats"]["rounds"]
    rows = [ln for ln in p.stderr.splitlines() if ln.startswith("[spec-prof-rounds]")]
    idx = [int(ln.split()[1].removeprefix("r=")) for ln in rows]
    assert idx == list(range(min(rounds, 64))), idx
    assert sum(ln.startswith("[spec-prof-summary]") for ln in p.stderr.splitlines()) == 1


# ---- failures named early: one line, exit 2, nothing written ----------------------------


def _one_line_refusal(p, *needles):
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("memra-dist: error:"), p.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    assert p.stdout == "" and "written" not in p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "proc"])
def test_unwritable_run_dir_is_refused_before_loading(llama, tmp_path, kind):
    if kind == "file":
        target = tmp_path / "a-file"
        target.write_text("x")
    else:
        target = Path("/proc/self/memra-run")
    p = subprocess.run(_cmd(llama, "--trace-level", "1", "--run-dir", str(target), "--max-new-tokens", "4"),
                       capture_output=True, text=True, env=_env(), timeout=120, cwd=tmp_path)
    _one_line_refusal(p, "--run-dir", "cannot write there")
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_unreachable_ray_address_is_refused_within_a_bound(llama, tmp_path):
    t0 = time.monotonic()
    p = subprocess.run(_cmd(llama, "--pp", "2", "--max-new-tokens", "4"), capture_output=True, text=True,
                       env=_env(RAY_ADDRESS="127.0.0.1:1"), timeout=120, cwd=tmp_path)
    _one_line_refusal(p, "RAY_ADDRESS 127.0.0.1:1")
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["garbage", "localhost", "http://", "ftp://x:4317"])
def test_malformed_otlp_endpoint_is_refused(llama, tmp_path, endpoint):
    p = subprocess.run(_cmd(llama, "--max-new-tokens", "4"), capture_output=True, text=True,
                       env=_env(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint), timeout=120, cwd=tmp_path)
    _one_line_refusal(p, "OTEL_EXPORTER_OTLP_ENDPOINT")


@pytest.mark.slow
def test_a_request_past_the_models_positions_says_it_is_capped(llama, tmp_path):
    """The tiny llama holds 512 positions: 600 new tokens are capped, and the run says so."""
    p = subprocess.run(_cmd(llama, "--max-new-tokens", "600", "--drafter", "none", "--json"), capture_output=True,
                       text=True, env=_env(), timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["capped"] is True and len(out["token_ids"]) < 600
    warn = [ln for ln in p.stderr.splitlines() if "512 positions" in ln]
    assert len(warn) == 1 and "warning" in warn[0]


# ---- the bound hit: losses are counted per role, never called written --------------------


def test_loss_lines_name_each_role_and_count():
    from memra_dist.pipeline.driver import loss_lines

    lines = loss_lines([{"name": "head1", "made": 120, "lost": 0, "why": ""},
                        {"name": "stage0", "made": 40, "lost": 40, "why": "its flush did not finish within 30 s"},
                        {"name": "stage1", "made": None, "lost": None, "why": "actor died (ActorDiedError: x)"}])
    assert lines == ["memra-dist: warning: stage0: 40 of 40 spans lost: its flush did not finish within 30 s",
                     "memra-dist: warning: stage1: an unknown number of spans lost: actor died (ActorDiedError: x)"]


def test_flush_bound_hit_names_the_roles_and_leaves_no_temp_file(ray_local, llama, tmp_path, monkeypatch):
    """With a zero bound the driver cannot wait for any actor's flush: every role is named
    with the spans at stake, and the run directory holds no half-written file."""
    from memra_dist.app import generate
    from memra_dist.config import RunConfig
    from memra_dist.phase.levels import TraceSettings
    from memra_dist.pipeline import driver

    monkeypatch.setattr(driver, "close_bound_s", lambda: 0.0)
    cfg = RunConfig(model=str(llama), drafter="ngram", pp=2, max_new_tokens=24, device="cpu",
                    trace=TraceSettings(level=1))
    lost: list[str] = []
    res = generate(cfg, [5, 9, 17, 5, 9, 23], run_dir=str(tmp_path), lost=lost)
    assert len(res.token_ids) == 24
    names = {ln.split(": ")[2] for ln in lost}
    assert names == {"head1", "stage0"}, lost
    for ln in lost:
        assert "did not finish within 0 s" in ln
        counted = ln.split(": ")[3]
        assert counted.endswith("spans lost") and counted.split()[0].isdigit() and int(counted.split()[0]) > 0, ln
    _assert_no_temp_files(tmp_path)
