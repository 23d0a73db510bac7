"""One request's trace across every actor: reads a run dir's OTLP JSON span files (driver,
head and stage processes) and says how many traces they hold (one is right), which roles
emitted spans, which stages emitted stage.forward, which devices' free memory the spans carry,
and which processes the run dir's one trace.perfetto.json shows.
usage: python benchmarks/trace_roles.py RUN_DIR [--pp N]   exit 1 if not one trace covering
the driver, the head and N-1 stages."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from memra_dist.tracing.conventions import ATTR, FREE_MB_PREFIX, RESOURCE


def _attrs(kvs) -> dict:
    return {kv["key"]: next(iter(kv["value"].values()), None) for kv in kvs}


def summarize(run_dir: Path) -> dict:
    traces, roles, devices, stages = Counter(), Counter(), Counter(), set()
    for f in sorted(run_dir.glob("*spans.otlp.json")):
        for rs in json.loads(f.read_text()).get("resourceSpans", []):
            res = _attrs(rs.get("resource", {}).get("attributes", []))
            role = res.get(RESOURCE["role"], "?")
            for ss in rs.get("scopeSpans", []):
                for sp in ss.get("spans", []):
                    traces[sp["traceId"]] += 1
                    roles[role] += 1
                    a = _attrs(sp.get("attributes", []))
                    devices.update(k[len(FREE_MB_PREFIX):] for k in a if k.startswith(FREE_MB_PREFIX))
                    if ATTR["stage"] in a:
                        stages.add(str(a[ATTR["stage"]]))
    tracks = []
    pf = run_dir / "trace.perfetto.json"
    if pf.exists():
        tracks = [e["args"]["name"] for e in json.loads(pf.read_text())["traceEvents"]
                  if e.get("ph") == "M" and e.get("name") == "process_name"]
    return {"traces": dict(traces), "roles": dict(roles), "stages": sorted(stages),
            "free_mb_devices": dict(devices), "perfetto_processes": tracks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--pp", type=int, default=1)
    a = ap.parse_args()
    s = summarize(a.run_dir)
    print(json.dumps(s, indent=1))
    ok = len(s["traces"]) == 1
    if a.pp > 1:  # the driver, the head and every stage (the head's own included) in that one trace
        ok = ok and {"driver", "head", "stage"} <= set(s["roles"]) and len(s["stages"]) >= a.pp
        ok = ok and len(s["perfetto_processes"]) == a.pp + 1  # one Perfetto file: driver + head + stages
    print("one trace, every role" if ok else "NOT one trace covering every role", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
