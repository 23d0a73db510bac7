"""The dashboard and docs/metrics.md are generated from the registry and committed fresh; every
query names only metrics, labels and spans the engine (or the Collector's span metrics of its
spans) emits, checked against memra_dist.tracing.conventions, not a copied list."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from memra_dist.tracing.conventions import (ATTR, METRIC_ATTR, METRICS, PHASE_SPANS, PHASES, SPAN_BURST,
                                            SPAN_FIRST_TOKEN, SPAN_REQUEST, SPAN_ROUND, SPAN_STAGE_FORWARD,
                                            SPANMETRICS, TTFT_BUCKETS, VERIFY_SUB_SPANS, ttft_span)
from memra_dist.serve.api_metrics import API_METRICS, OUTCOME_LABEL, OUTCOMES, api_prometheus_name
from memra_dist.tracing.metrics import prometheus_name

ROOT = Path(__file__).resolve().parent.parent
DASH = ROOT / "dashboards" / "memra-spec.json"


def _generate_module():
    spec = importlib.util.spec_from_file_location("dash_generate", ROOT / "dashboards" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _dash():
    return json.loads(DASH.read_text())


def _targets(kind: str):
    for p in _dash()["panels"]:
        for t in p["targets"]:
            if t["datasource"]["type"] == kind:
                yield p, t


# ---- what the registry allows ----

def _allowed_series() -> set[str]:
    out = set()
    for key in METRICS:
        base = prometheus_name(key)
        out |= {base, base + "_bucket", base + "_sum", base + "_count"}
    for key, name in SPANMETRICS.items():
        base = name.replace(".", "_")
        out |= {base + "_total"} if key == "calls" else {base + "_milliseconds" + s for s in ("_bucket", "_sum", "_count")}
    out |= {api_prometheus_name(key) for key in API_METRICS}  # memra-dist serve's /metrics
    return out


SPANS = {SPAN_REQUEST, SPAN_BURST, SPAN_ROUND, SPAN_FIRST_TOKEN, SPAN_STAGE_FORWARD, *PHASE_SPANS.values(),
         *VERIFY_SUB_SPANS.values(), *(ttft_span(b) for b in TTFT_BUCKETS)}
LABEL_VALUES = {  # Prometheus label -> values the engine writes
    METRIC_ATTR["phase"].replace(".", "_"): set(PHASES),
    METRIC_ATTR["bucket"].replace(".", "_"): set(VERIFY_SUB_SPANS) | set(TTFT_BUCKETS),
    "span_name": SPANS,
    OUTCOME_LABEL: set(OUTCOMES),
}
def _spanmetric_dims() -> set[str]:
    """The span attributes the collector's spanmetrics connector keeps as labels."""
    import yaml

    col = yaml.safe_load((ROOT / "cluster/observability/otel-collector.yaml").read_text())
    return {d["name"].replace(".", "_") for d in col["connectors"]["spanmetrics"].get("dimensions", [])}


LABELS = {*(a.replace(".", "_") for a in METRIC_ATTR.values()), "le", "span_name", OUTCOME_LABEL, *_spanmetric_dims()}
PROMQL_WORDS = {"sum", "max", "min", "avg", "count", "rate", "increase", "histogram_quantile", "by", "on",
                "group_left", "ignoring", "without", "scalar", "clamp_min", "topk", "le"}

_STR = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!=|!~|=)\s*"((?:[^"\\]|\\.)*)"')


def _check_promql(expr: str) -> None:
    allowed = _allowed_series()
    for lab, op, val in _MATCHER.findall(expr):
        assert lab in LABELS, f"label {lab} not in the registry: {expr}"
        vals = set(val.replace("\\\\.", ".").split("|")) if op == "=~" else {val}
        assert vals <= LABEL_VALUES[lab], f"{lab} values {vals - LABEL_VALUES[lab]} never emitted: {expr}"
    bare = re.sub(r"\{[^}]*\}", "", _STR.sub('""', expr))  # drop matchers and strings
    bare = re.sub(r"\[[^\]]*\]", "", bare)  # drop range selectors ($__rate_interval, $__range)
    for grp in re.findall(r"\b(?:by|on|ignoring|without)\s*\(([^)]*)\)", bare):
        for lab in filter(None, (x.strip() for x in grp.split(","))):
            assert lab in LABELS, f"grouping label {lab} not in the registry: {expr}"
    bare = re.sub(r"\b(?:by|on|ignoring|without)\s*\([^)]*\)", "", bare)
    for ident in re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", bare):
        if ident in PROMQL_WORDS:
            continue
        assert ident in allowed, f"series {ident} is not a registry metric in Prometheus form: {expr}"


def _check_traceql(q: str) -> None:
    names = re.findall(r'\bname\s*=\s*"([^"]+)"', q)
    assert names, q
    assert set(names) <= SPANS, f"span names {set(names) - SPANS} not emitted: {q}"
    attrs = set(re.findall(r"\bspan\.([a-zA-Z0-9_.]+)", q))
    assert attrs <= set(ATTR.values()), f"attributes {attrs - set(ATTR.values())} not in the registry: {q}"


# ---- tests ----

def test_generated_files_are_fresh():
    files = _generate_module().render()
    assert files, "the generator renders no file"
    for path, text in files.items():
        assert path.exists(), f"{path} missing: run python dashboards/generate.py"
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run python dashboards/generate.py"


def test_every_prometheus_query_names_registry_metrics_only():
    exprs = [t["expr"] for _, t in _targets("prometheus")]
    assert exprs
    for e in exprs:
        _check_promql(e)


def test_every_registry_metric_has_a_panel():
    text = " ".join(t["expr"] for _, t in _targets("prometheus"))
    for key in METRICS:
        assert prometheus_name(key) in text, f"no panel shows {METRICS[key]}"


def test_the_api_panels_show_queue_depth_in_flight_and_outcomes():
    panels = {p["title"]: p for p in _dash()["panels"]}
    text = " ".join(t["expr"] for _, t in _targets("prometheus"))
    for key in API_METRICS:
        assert api_prometheus_name(key) in text, f"no panel shows {API_METRICS[key]}"
    load = " ".join(t["expr"] for t in panels["API: sessions in flight and queue depth"]["targets"])
    assert api_prometheus_name("in_flight") in load and api_prometheus_name("queue_depth") in load
    by = panels["API: requests/s by outcome"]["targets"][0]["expr"]
    assert f"by ({OUTCOME_LABEL})" in by and api_prometheus_name("requests") in by
    with pytest.raises(AssertionError):  # an outcome the API never writes
        _check_promql(f'sum(rate({api_prometheus_name("requests")}{{{OUTCOME_LABEL}="timeout"}}[1m]))')


def test_the_stage_busy_panel_reads_stage_forward_span_seconds_per_stage():
    """Busy share = stage.forward span seconds per second, per memra.stage (the collector's
    spanmetrics dimension), so the collector must keep that dimension."""
    import yaml

    panel = next(p for p in _dash()["panels"] if p["title"].startswith("Pipeline: stage busy share"))
    expr = panel["targets"][0]["expr"]
    assert 'span_name="stage.forward"' in expr and "by (memra_stage)" in expr and expr.endswith("/ 1000")
    assert panel["fieldConfig"]["defaults"]["unit"] == "percentunit"
    col = yaml.safe_load((ROOT / "cluster/observability/otel-collector.yaml").read_text())
    assert {"name": "memra.stage"} in col["connectors"]["spanmetrics"]["dimensions"]


def test_every_tempo_query_names_registry_spans_only():
    qs = [t["query"] for _, t in _targets("tempo")]
    assert any(SPAN_ROUND in q for q in qs), "a trace search for the slowest rounds"
    for q in qs:
        _check_traceql(q)


def test_the_checker_rejects_strangers():
    with pytest.raises(AssertionError):
        _check_promql("sum(rate(vllm_spec_decode_draft_acceptance_rate[5m]))")
    with pytest.raises(AssertionError):
        _check_promql(f'sum(rate({prometheus_name("phase_duration")}_sum{{memra_phase="prefill"}}[1m]))')
    with pytest.raises(AssertionError):
        _check_promql(f"sum by (gpu) ({prometheus_name('free_memory')})")
    with pytest.raises(AssertionError):
        _check_traceql('{ name = "spec.prefill" }')


def test_panels_link_to_traces():
    dash = _dash()
    assert any(t.get("exemplar") for _, t in _targets("prometheus")), "exemplars link points to traces"
    assert {v["name"] for v in dash["templating"]["list"]} >= {"slow_round_ms"}
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24


def test_promql_parses_with_promtool(tmp_path):
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool not installed (.ci/prometheus.sh installs it with prometheus)")
    rules = {"groups": [{"name": "dash", "rules": [
        {"record": f"memra:check_{i}", "expr": t["expr"].replace("$__rate_interval", "1m").replace("$__range", "1h")}
        for i, (_, t) in enumerate(_targets("prometheus"))]}]}
    f = tmp_path / "rules.json"  # JSON is YAML
    f.write_text(json.dumps(rules))
    r = subprocess.run([promtool, "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
