"""Generate the Grafana dashboard (dashboards/memra-spec.json) and docs/metrics.md from the
one name registry (memra_dist.tracing.conventions), so neither can name a metric, label or
span the engine does not emit.

    python dashboards/generate.py          # rewrite both files
    python dashboards/generate.py --check  # exit 1 if either is stale (tests/test_dashboards.py)

Datasource uids `prometheus` and `tempo` are the ones cluster/observability provisions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from memra_dist.tracing.conventions import (ATTR, METRIC_ATTR, METRIC_META, METRICS, PHASE_SPANS, PHASES,
                                            SPAN_ROUND, SPAN_STAGE_FORWARD, SPANMETRICS, TTFT_BUCKETS,
                                            VERIFY_SUB_SPANS)
from memra_dist.serve.api_metrics import API_METRIC_META, API_METRICS, OUTCOME_LABEL, OUTCOMES, api_prometheus_name
from memra_dist.tracing.metrics import SLOW_FACTOR, prometheus_name

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "dashboards" / "memra-spec.json"
DOC = ROOT / "docs" / "metrics.md"
PROM = {"type": "prometheus", "uid": "prometheus"}
TEMPO = {"type": "tempo", "uid": "tempo"}
RI = "$__rate_interval"


def label(key: str) -> str:
    """A metric attribute's Prometheus label name."""
    return METRIC_ATTR[key].replace(".", "_")


def m(key: str, suffix: str = "") -> str:
    return prometheus_name(key) + suffix


def spanmetric(key: str, suffix: str) -> str:
    base = SPANMETRICS[key].replace(".", "_")
    return base + ("_milliseconds" + suffix if key == "duration" else "_total")


def rate_sum(key: str, by: str = "", sel: str = "", part: str = "_sum") -> str:
    grp = f" by ({by})" if by else ""
    return f"sum{grp} (rate({m(key, part)}{sel}[{RI}]))"


def target(expr: str, legend: str = "", ref: str = "A", exemplar: bool = False, instant: bool = False) -> dict:
    t = {"datasource": PROM, "refId": ref, "expr": expr, "legendFormat": legend or "__auto",
         "exemplar": exemplar, "range": not instant, "instant": instant}
    return t


def panel(pid: int, title: str, targets: list, grid: tuple, kind: str = "timeseries", unit: str = "",
          desc: str = "", stack: str | None = None, ds: dict = PROM, options: dict | None = None,
          draw: str = "line") -> dict:
    x, y, w, h = grid
    custom = {"drawStyle": draw, "fillOpacity": 60 if stack else 10, "lineWidth": 1, "showPoints": "never"}
    if stack:
        custom["stacking"] = {"mode": stack, "group": "A"}
    p = {"id": pid, "type": kind, "title": title, "description": desc, "datasource": ds,
         "gridPos": {"x": x, "y": y, "w": w, "h": h}, "targets": targets,
         "fieldConfig": {"defaults": {"unit": unit, "custom": custom if kind == "timeseries" else {}}, "overrides": []},
         "options": options or {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                                "tooltip": {"mode": "multi", "sort": "desc"}}}
    return p


def _phase_panels() -> list:
    ph, b = label("phase"), label("bucket")
    share = (f"{rate_sum('phase_duration', ph)} / on() group_left() "
             f"{rate_sum('round_duration')}")
    mean = f"{rate_sum('phase_duration', ph)} / {rate_sum('phase_duration', ph, part='_count')}"
    verify = f'{{{ph}="verify"}}'
    sub = (f"{rate_sum('verify_sub_duration', b)} / on() group_left() "
           f"{rate_sum('phase_duration', sel=verify)}")
    return [
        panel(1, "Phase share of round time", [target(share, f"{{{{{ph}}}}}")], (0, 0, 12, 8),
              unit="percentunit", stack="normal",
              desc="Each phase's share of round wall time (draft, verify, accept, rollback, maint), "
                   "from the per-phase duration histograms; stacks to 100 %."),
        panel(2, "Mean phase time per round", [target(mean, f"{{{{{ph}}}}}")], (12, 0, 12, 8), unit="ms",
              desc="Mean wall time of each phase per round."),
        panel(3, "Verify sub-bucket share of verify (trace level 2)", [target(sub, f"{{{{{b}}}}}")],
              (0, 8, 12, 8), unit="percentunit", stack="normal",
              desc="Level-2 verify sub-split by mixer class (kda, mla, attn), ffn and rest, as a share of verify."),
    ]


def _spec_panels() -> list:
    acc = f"sum(rate({m('accepted')}[{RI}])) / sum(rate({m('drafted')}[{RI}]))"
    acc_med = f"histogram_quantile(0.5, sum by (le) (rate({m('acceptance', '_bucket')}[{RI}])))"
    tpr = f"{rate_sum('tokens_per_round')} / {rate_sum('tokens_per_round', part='_count')}"
    slow = f"sum(increase({m('slow_rounds')}[{RI}]))"
    slow_frac = f"sum(rate({m('slow_rounds')}[{RI}])) / sum(rate({m('round_duration', '_count')}[{RI}]))"
    q = lambda p: (f"histogram_quantile({p}, sum by (le) (rate({m('round_duration', '_bucket')}[{RI}])))")  # noqa: E731
    return [
        panel(4, "Acceptance", [target(acc, "accepted / drafted"), target(acc_med, "median burst acceptance", "B")],
              (12, 8, 12, 8), unit="percentunit", desc="Accepted drafted tokens over drafted tokens."),
        panel(5, "Tokens per round", [target(tpr, "mean tokens / round")], (0, 16, 8, 8), unit="none",
              desc="Tokens committed per round: accepted drafts + 1."),
        panel(6, f"Slow rounds (> {SLOW_FACTOR}x the burst median)",
              [target(slow, "slow rounds"), target(slow_frac, "share of rounds", "B")], (8, 16, 8, 8),
              unit="none", draw="bars",
              desc="Rounds whose wall time is past 1.5x the median round of their burst."),
        panel(7, "Round duration (exemplars link to the trace)",
              [target(q(0.5), "p50", "A", True), target(q(0.9), "p90", "B", True), target(q(0.99), "p99", "C", True)],
              (16, 16, 8, 8), unit="ms",
              desc="Round wall-time quantiles. Exemplar points carry the request's trace id: click one to open it in Tempo."),
    ]


def _first_token_panel() -> dict:
    b = label("bucket")
    targets = []
    for i, bucket in enumerate(TTFT_BUCKETS):
        sel = f'{{{b}="{bucket}"}}'
        expr = (f"sum(increase({m('first_token', '_sum')}{sel}[$__range])) / "
                f"sum(increase({m('first_token', '_count')}{sel}[$__range]))")
        targets.append(target(expr, bucket, chr(ord("A") + i), instant=True))
    opts = {"orientation": "horizontal", "displayMode": "basic", "showUnfilled": True,
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
    return panel(8, "First-token waterfall (mean per request, in route order)", targets, (0, 24, 12, 10),
                 kind="bargauge", unit="ms", options=opts,
                 desc="The first-token profile buckets (MEMRA_SPEC_PROF=1 / --prof), in the order the route runs them.")


def _memory_panel() -> dict:
    d = label("device")
    return panel(9, "Free memory per device", [target(f"max by ({d}) ({m('free_memory')})", f"{{{{{d}}}}}")],
                 (12, 24, 12, 10), unit="decmbytes",
                 desc="Free memory per device at the last phase boundary of each burst (cuda0, cuda1, ... or cpu).")


def _span_panels() -> list:
    spans = "|".join(s.replace(".", "\\\\.") for s in [*PHASE_SPANS.values(), *VERIFY_SUB_SPANS.values()])
    p90 = (f"histogram_quantile(0.9, sum by (le, span_name) (rate({spanmetric('duration', '_bucket')}"
           f'{{span_name=~"{spans}"}}[{RI}])))')
    round_attrs = ", ".join(f"span.{ATTR[k]}" for k in ("round", "k", "accepted", "ctx"))
    slow = f'{{ name = "{SPAN_ROUND}" && duration > ${{slow_round_ms}}ms }} | select({round_attrs})'
    verify = f'{{ name = "{PHASE_SPANS["verify"]}" && duration > ${{slow_verify_ms}}ms }} | select({round_attrs})'
    tempo = lambda q, ref: {"datasource": TEMPO, "refId": ref, "queryType": "traceql", "query": q,  # noqa: E731
                            "limit": 20, "spss": 5, "tableType": "spans"}
    table_opts = {"showHeader": True, "sortBy": [{"displayName": "Duration", "desc": True}]}
    return [
        panel(10, "Phase span p90 (collector span metrics; exemplars link to traces)",
              [target(p90, "{{span_name}}", exemplar=True)], (0, 34, 24, 8), unit="ms",
              desc="p90 of each phase and verify sub-span, from the Collector's spanmetrics connector. A "
                   "batched request's rounds run by the step's leader have no phase spans at level 1 (one "
                   "spec.round each): their phases are in the phase-duration panels."),
        panel(11, "Slowest rounds (Tempo: spec.round past $slow_round_ms ms)", [tempo(slow, "A")], (0, 42, 12, 10),
              kind="table", ds=TEMPO, options=table_opts,
              desc="Round spans slower than the threshold variable; click a trace id to open the trace."),
        panel(12, "Slowest verifies (Tempo: spec.verify past $slow_verify_ms ms)", [tempo(verify, "A")],
              (12, 42, 12, 10), kind="table", ds=TEMPO, options=table_opts,
              desc="Verify spans slower than the threshold variable, with their round's k and accepted."),
    ]


def _api_panels() -> list:
    """`memra-dist serve`: its /metrics endpoint (scraped by a Prometheus of yours: the job's
    target is the server's host:port)."""
    api = api_prometheus_name
    load = [target(f"sum({api('in_flight')})", "in flight (sessions held)"),
            target(f"sum({api('queue_depth')})", "queue depth (waiting)", "B")]
    outcomes = f"sum by ({OUTCOME_LABEL}) (rate({api('requests')}[{RI}]))"
    tokens = f"sum(rate({api('tokens')}[{RI}]))"
    return [
        panel(13, "API: sessions in flight and queue depth", load, (0, 52, 8, 8), unit="none",
              desc="memra-dist serve: requests holding an engine session, and requests waiting for one "
                   "(at most --max-queue; beyond it the API answers 429)."),
        panel(14, "API: requests/s by outcome", [target(outcomes, f"{{{{{OUTCOME_LABEL}}}}}")], (8, 52, 8, 8),
              unit="reqps", stack="normal",
              desc="Completion requests answered per second: " + ", ".join(OUTCOMES)
                   + " (rejected = 429, queue full; aborted = the client went away)."),
        panel(15, "API: completion tokens/s", [target(tokens, "tokens/s")], (16, 52, 8, 8), unit="none",
              desc="Completion tokens generated per second across the server's sessions."),
    ]


def _stage_busy_panel() -> dict:
    """Each pipeline stage's busy share: the seconds of `stage.forward` spans it ran per
    second (the collector's span metrics, dimension memra.stage). ~1/N at one session on a
    ppN split; towards 1 with sessions in flight."""
    stage = ATTR["stage"].replace(".", "_")
    busy = (f"sum by ({stage}) (rate({spanmetric('duration', '_sum')}"
            f'{{span_name="{SPAN_STAGE_FORWARD}"}}[{RI}])) / 1000')
    return panel(16, "Pipeline: stage busy share (stage.forward span seconds per second)",
                 [target(busy, f"stage {{{{{stage}}}}}")], (0, 60, 24, 8), unit="percentunit",
                 desc="How much of each second every pipeline stage spent in its forwards (trace level >= 1, pp > 1). "
                      "One session in flight keeps each of N stages busy about 1/N of the time; sessions in flight "
                      "(--sessions, default one per stage) fill the gaps. A stage far below the others waits on them.")


def _host_panel() -> dict:
    """Each phase's host part against its whole, ms a round: a phase whose host part is most
    of it waited on the host (its launches), with the device idle meanwhile."""
    ph = label("phase")
    host = f"{rate_sum('phase_host_duration', ph)} / {rate_sum('phase_host_duration', ph, part='_count')}"
    return panel(17, "Host part of each phase (mean ms per round, before the drain)",
                 [target(host, f"{{{{{ph}}}}} host")], (0, 68, 24, 8), unit="ms",
                 desc="Per phase, the ms a round until the host reached the phase's end, before its drain: launches, "
                      "host work and waits inside it such as the accept's readback. Set it beside 'Mean phase time "
                      "per round': the rest of each phase is the device finishing what was launched. A phase whose "
                      "host part is nearly all of it is bound by the host.")


def _batch_panels() -> list:
    """Batched engines (--max-batch > 1): how full the steps are, what a verify waits for its
    step, the paged KV pool's blocks, and how many requests a shared draft forward drafts."""
    kv = label("kv_state")
    size = f"{rate_sum('batch_requests')} / {rate_sum('batch_requests', part='_count')}"
    wait = lambda p: (f"histogram_quantile({p}, sum by (le) (rate({m('batch_wait', '_bucket')}[{RI}])))")  # noqa: E731
    shared = f"{rate_sum('batch_draft_requests')} / {rate_sum('batch_draft_requests', part='_count')}"
    pt = label("part")
    idle = f"{rate_sum('batch_idle', pt)} / {rate_sum('batch_idle', pt, part='_count')}"
    return [
        panel(18, "Batch: requests per step (mean over rounds)", [target(size, "requests a step")], (0, 76, 8, 8),
              unit="none", desc="Batched engines: requests whose rows shared the batch step of a round's verify. "
                                "Far below --max-batch: the requests are not concurrent, or the row budget splits them."),
        panel(19, "Batch: verify's wait for its step", [target(wait(0.5), "p50"), target(wait(0.99), "p99", "B")],
              (8, 76, 8, 8), unit="ms",
              desc="The part of a batched verify spent waiting for its step to start: the other requests' "
                   "submissions (at most 5 ms) or a step already running. The rest of the verify is the step."),
        panel(20, "Batch: paged KV blocks", [target(f"max by ({kv}) ({m('kv_blocks')})", f"{{{{{kv}}}}}")],
              (16, 76, 8, 8), unit="none", stack="normal",
              desc="Blocks of the paged KV pool in use and free. Free near 0: new requests wait for blocks."),
        panel(21, "Batch: preemptions and prefix-cache evictions",
              [target(f"max({m('batch_preemptions')})", "preempted so far"),
               target(f"max({m('prefix_evictions')})", "cached blocks evicted so far", "B")],
              (0, 84, 8, 8), unit="none",
              desc="Requests the batched engine has preempted (K/V swapped to host so another could grow; "
                   "each resumes bitwise), and blocks its prefix cache had to evict (least recently used first, "
                   "only when no free block was left). Rising: the paged KV pool (--kv-rows) is short for the load."),
        panel(22, "Batch: requests per shared draft forward", [target(shared, "requests a draft forward")],
              (8, 84, 8, 8), unit="none",
              desc="Batched engines with a tap drafter (DFlash, EAGLE-3, MTP): requests whose drafts the step "
                   "leader made in one draft forward (mean over the rounds drafted that way). Near the requests "
                   "per step: every request's draft shares one forward."),
        panel(24, "Speculation: K chosen (--spec-k auto)",
              [target(f"{rate_sum('spec_k_chosen')} / {rate_sum('spec_k_chosen', part='_count')}", "mean K"),
               target(f"sum(rate({m('spec_k_accepted')}[{RI}])) / sum(rate({m('spec_k_expected')}[{RI}]))",
                      "accepted / expected", "B")],
              (0, 92, 8, 8), unit="none",
              desc="Batched engines with --spec-k auto: the mean number of drafts the engine chose per round (by "
                   "the step's expected tokens per second; 0 = plain decoding for that request), and the accepted "
                   "drafts those rounds brought over what the acceptance model expected (near 1: it forecasts well)."),
        panel(23, "API: prefix cache hit rate (prompt tokens)",
              [target(f"sum(rate({api_prometheus_name('prefix_hits')}[{RI}])) / "
                      f"sum(rate({api_prometheus_name('prefix_queries')}[{RI}]))", "cached / prompt tokens")],
              (16, 84, 8, 8), unit="percentunit",
              desc="memra-dist serve on a batched engine: the share of completed requests' prompt tokens whose KV "
                   "blocks came from the prefix cache (a shared header, a chat's earlier turns) instead of being "
                   "prefilled. 0 with --no-prefix-cache or kimi_linear (the engine says so at start)."),
        panel(25, "Batch: device idle before a step, by cause (mean ms per round)",
              [target(idle, f"{{{{{pt}}}}}")], (8, 92, 16, 8), unit="ms", stack="normal",
              desc="Batched engines: how long the device sat idle before the step each round's verify rode in "
                   "(0 when the step was launched behind a running one), split by cause: rounds, the engine loop's "
                   "host work after the previous step (acceptance, the drafters' maintenance and next drafts); "
                   "held, the loop holding the step for a request still on the host; other, the rest (readback, "
                   "launch). Compare with the step's own time: large idle means the host, not the device, sets "
                   "the pace."),
        panel(26, "Speculation: step time, forecast vs measured (--spec-k auto)",
              [target(f"{rate_sum('batch_step')} / {rate_sum('batch_step', part='_count')}", "measured"),
               target(f"{rate_sum('batch_step_predicted')} / {rate_sum('batch_step_predicted', part='_count')}",
                      "forecast", "B")],
              (0, 100, 12, 8), unit="ms",
              desc="Batched engines with --spec-k auto: the mean forward of the steps rounds rode in, and what the "
                   "engine's step cost model forecast for their rows before they ran (by CUDA-graph bucket where "
                   "steps replay graphs: each bucket's time at open plus an offset the steps move). The K choice "
                   "weighs plans with this model: a forecast well below the measured time makes it draft where "
                   "drafts do not pay."),
        panel(27, "Speculation: acceptance by draft position",
              [target(f"sum by ({label('position')}) (rate({m('position_accepted')}[{RI}])) / "
                      f"sum by ({label('position')}) (rate({m('position_reached')}[{RI}]))",
                      f"draft {{{{{label('position')}}}}}")],
              (12, 100, 12, 8), unit="percentunit",
              desc="The share of drafts accepted at each position of a round (1 = the first draft), among those "
                   "that reached it (every draft before them accepted): the per-position chance --spec-k auto "
                   "weighs. A steep fall after the first positions says a shorter K pays; a flat one, a longer."),
    ]


def _textbox(name: str, default: str, label_: str) -> dict:
    return {"type": "textbox", "name": name, "label": label_, "query": default,
            "current": {"text": default, "value": default}, "hide": 0}


def dashboard() -> dict:
    panels = [*_phase_panels(), *_spec_panels(), _first_token_panel(), _memory_panel(), *_span_panels(),
              *_api_panels(), _stage_busy_panel(), _host_panel(), *_batch_panels()]
    return {
        "uid": "memra-spec", "title": "memra-dist: speculative phases", "tags": ["memra-dist", "speculative"],
        "description": "Generated by dashboards/generate.py from memra_dist.tracing.conventions; do not edit by hand.",
        "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"}, "timezone": "",
        "templating": {"list": [_textbox("slow_round_ms", "5", "slow round (ms)"),
                                _textbox("slow_verify_ms", "5", "slow verify (ms)")]},
        "annotations": {"list": []},
        "links": [{"title": "Jaeger", "type": "link", "url": "http://127.0.0.1:16686/search?service=memra-dist",
                   "targetBlank": True}],
        "panels": panels,
    }


def metrics_doc() -> str:
    lines = ["# Metrics", "",
             "Generated by `dashboards/generate.py` from `memra_dist/tracing/conventions.py` "
             "(`METRICS`, `METRIC_META`, `METRIC_ATTR`); a test fails when this file is stale.", "",
             "The engine records them from each burst's record, in a verify's shadow (never between a readback and the next launch), when the trace level is "
             ">= 1, `--metrics-port` is given or `OTEL_EXPORTER_OTLP_ENDPOINT` is set. Export: OTLP with the "
             "traces' `OTEL_*` settings (`OTEL_METRIC_EXPORT_INTERVAL` sets the period), and with "
             "`--metrics-port N` a Prometheus endpoint on `127.0.0.1:N/metrics` (`--metrics-hold S` keeps it "
             "up S seconds after the run for a last scrape).", "",
             "| OpenTelemetry name | Prometheus series | kind | unit | labels | meaning |",
             "|---|---|---|---|---|---|"]
    labels = {"phase_duration": "phase", "phase_host_duration": "phase", "verify_sub_duration": "bucket", "first_token": "bucket",
              "free_memory": "device"}
    for key, name in METRICS.items():
        kind, unit, desc = METRIC_META[key]
        prom = prometheus_name(key)
        series = f"`{prom}_bucket`, `_sum`, `_count`" if kind == "histogram" else f"`{prom}`"
        lab = f"`{METRIC_ATTR[labels[key]]}`" if key in labels else ""
        lines.append(f"| `{name}` | {series} | {kind} | `{unit}` | {lab} | {desc} |")
    lines += ["", "Label values: `memra.phase` is one of " + ", ".join(f"`{p}`" for p in PHASES)
              + "; `memra.bucket` on the verify sub-split is one of " + ", ".join(f"`{b}`" for b in VERIFY_SUB_SPANS)
              + ", on the first-token histogram one of " + ", ".join(f"`{b}`" for b in TTFT_BUCKETS)
              + "; `memra.device` is `cuda0`, `cuda1`, ... or `cpu`.", "",
              f"Slow rounds: a round counts when its wall time is past {SLOW_FACTOR}x the median round wall time of "
              "its burst (the sorted middle element, as the [spec-prof-summary] line takes it). The request-wide count "
              "stays on the `[spec-prof-summary]` line.", "",
              "Exemplars: with tracing on, histogram points carry the request's trace id, so a Grafana panel "
              "with exemplars links to the trace in Tempo.", "",
              "Span metrics: the Collector in `cluster/observability` also derives "
              + ", ".join(f"`{spanmetric('duration', '_bucket')}`" if k == "duration" else f"`{spanmetric(k, '')}`"
                          for k in SPANMETRICS)
              + " from the spans (label `span_name`), with exemplars.", "",
              "## The HTTP API (`memra-dist serve`)", "",
              "Served as Prometheus text at the server's `GET /metrics` (one replica's counts; point a "
              "Prometheus scrape job at the server's host:port).", "",
              "| name | Prometheus series | kind | labels | meaning |", "|---|---|---|---|---|"]
    for key, name in API_METRICS.items():
        kind, _, desc = API_METRIC_META[key]
        lab = f"`{OUTCOME_LABEL}`" if key == "requests" else ""
        lines.append(f"| `{name}` | `{api_prometheus_name(key)}` | {kind} | {lab} | {desc} |")
    lines += ["", f"`{OUTCOME_LABEL}` is one of " + ", ".join(f"`{o}`" for o in OUTCOMES) + ".", ""]
    return "\n".join(lines)


def render() -> dict[Path, str]:
    return {DASHBOARD: json.dumps(dashboard(), indent=2) + "\n", DOC: metrics_doc()}


def main(argv: list[str]) -> int:
    stale = [p for p, text in render().items() if not p.exists() or p.read_text() != text]
    if "--check" in argv:
        for p in stale:
            print(f"{p.relative_to(ROOT)} is stale: run python dashboards/generate.py", file=sys.stderr)
        return 1 if stale else 0
    for p, text in render().items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
