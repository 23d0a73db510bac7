"""The engine's metrics reach a real Prometheus: `prometheus` on 127.0.0.1 scrapes the
`--metrics-port` endpoint of a `memra-dist generate` run on a tiny checkpoint, and its HTTP
API then returns the phase histograms; every dashboard query evaluates there without error.
Skipped, with the reason, where the `prometheus` binary is absent (.ci/prometheus.sh installs it)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from ports import free_port as _free_port
from memra_dist.tracing.conventions import METRIC_ATTR, PHASES
from memra_dist.tracing.metrics import prometheus_name

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = shutil.which("prometheus")
pytestmark = [pytest.mark.slow,  # a Prometheus server scraping a traced CLI run
              pytest.mark.skipif(PROMETHEUS is None, reason="no `prometheus` binary on PATH "
                                 "(install it with .ci/prometheus.sh, i.e. apt-get install prometheus)")]




def _api(port: int, path: str, **params) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _wait(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            v = pred()
            if v:
                return v
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def prometheus(tmp_path):
    """(prometheus API port, engine metrics port): Prometheus scraping the engine every second."""
    prom_port, engine_port = _free_port(), _free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(f"global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
                   f"  - job_name: memra\n    static_configs:\n      - targets: ['127.0.0.1:{engine_port}']\n")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
    try:
        _wait(lambda: _api(prom_port, "status/buildinfo")["status"] == "success", 30, "prometheus to start")
        yield prom_port, engine_port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _series(prom_port: int, query: str) -> list:
    """Instant query; the run has exited, so its series are stale now: callers wrap selectors
    in last_over_time(...[5m]) to read the last scraped values."""
    res = _api(prom_port, "query", query=query)
    assert res["status"] == "success", res
    return res["data"]["result"]


def test_phase_histograms_reach_prometheus(prometheus, llama, tmp_path):
    prom_port, engine_port = prometheus
    cmd = [sys.executable, "-m", "memra_dist.cli", "generate", "--model", str(llama), "--prompt", "a b c a b c a b",
           "--max-new-tokens", "32", "--device", "cpu", "--trace-level", "2", "--prof", "--drafter", "ngram",
           "--burst-rounds", "4", "--run-dir", str(tmp_path / "run"),
           "--metrics-port", str(engine_port), "--metrics-hold", "6"]
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"127.0.0.1:{engine_port}/metrics" in run.stderr

    phase = prometheus_name("phase_duration")
    label = METRIC_ATTR["phase"].replace(".", "_")
    last = lambda sel: f"last_over_time({sel}[5m])"  # noqa: E731
    found = _wait(lambda: _series(prom_port, last(f"{phase}_count")), 20, f"{phase}_count in Prometheus")
    assert {s["metric"][label] for s in found} == set(PHASES)
    assert all(float(s["value"][1]) > 0 for s in found)
    buckets = _series(prom_port, last(f'{phase}_bucket{{{label}="verify"}}'))
    assert len(buckets) > 5 and any(s["metric"]["le"] == "+Inf" for s in buckets)
    for key in ("round_duration", "tokens_per_round", "first_token"):
        assert _series(prom_port, last(prometheus_name(key) + "_count")), key
    for key in ("drafted", "free_memory"):
        assert _series(prom_port, last(prometheus_name(key))), key

    # every dashboard query evaluates here (syntax and names agree with a real Prometheus)
    dash = json.loads((ROOT / "dashboards" / "memra-spec.json").read_text())
    for p in dash["panels"]:
        for t in p["targets"]:
            if t["datasource"]["type"] != "prometheus":
                continue
            q = t["expr"].replace("$__rate_interval", "1m").replace("$__range", "5m")
            assert _api(prom_port, "query", query=q)["status"] == "success", q
    # the phases tile the round: summed phase time equals summed round time (the share panel's
    # denominator); a short run is scraped after its last burst, so rates would be 0/0 here
    phases = _series(prom_port, f"sum({last(phase + '_sum')})")
    rounds = _series(prom_port, f"sum({last(prometheus_name('round_duration') + '_sum')})")
    assert float(phases[0]["value"][1]) == pytest.approx(float(rounds[0]["value"][1]), rel=1e-6)
