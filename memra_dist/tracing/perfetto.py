"""One Chrome/Perfetto trace for a whole run: every role's spans (driver, pipeline head,
every stage) from their OTLP/JSON files, as separate tracks, so one file opened in
ui.perfetto.dev shows where a round's time went on every process.

Tracks: a process per role (driver first, then the head, then stages in order) and a thread
per stream of work inside it (the driver's request; the head's round loop and the forward
of the layers it holds; a stage's forward). One metadata event names each process and each
thread. Times are the spans' own epoch nanoseconds (each process maps its monotonic clock to
the epoch once), so tracks of one host line up."""

from __future__ import annotations

from typing import Iterable

from .conventions import ATTR, SPAN_STAGE_FORWARD
from .otlp_json import attr_value

__all__ = ["perfetto_trace", "track_of"]

_ROLE_ORDER = {"driver": 0, "head": 1, "stage": 2}


def track_of(res: dict, span: dict) -> tuple[str, str]:
    """(process role, thread name) of a span."""
    role = str(res.get("memra.role", "driver"))
    if role == "driver":
        return role, "request"
    if span.get("name") == SPAN_STAGE_FORWARD:
        return role, "forward (its layers)"
    return role, "round loop"


def _stage_of(span: dict) -> int | None:
    for a in span.get("attributes", []):
        if a["key"] == ATTR["stage"]:
            return int(attr_value(a["value"]))
    return None


def perfetto_trace(items: Iterable[tuple[dict, dict]]) -> dict:
    """items: (resource attributes, OTLP/JSON span). Returns {"traceEvents": [...]}."""
    items = list(items)
    procs: dict[int, dict] = {}  # pid -> {"role", "stage"}
    for res, s in items:
        pid = int(res.get("process.pid", 0))
        p = procs.setdefault(pid, {"role": str(res.get("memra.role", "driver")), "stage": None})
        if s.get("name") == SPAN_STAGE_FORWARD and p["stage"] is None:
            p["stage"] = _stage_of(s)
    events: list[dict] = []
    threads: dict[tuple[int, str], int] = {}
    for res, s in items:
        pid = int(res.get("process.pid", 0))
        _role, thread = track_of(res, s)
        tid = threads.setdefault((pid, thread), len(threads) + 1)
        start, end = int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"])
        args = {a["key"]: attr_value(a["value"]) for a in s.get("attributes", [])}
        events.append({"name": s["name"], "ph": "X", "ts": start / 1e3, "dur": (end - start) / 1e3,
                       "pid": pid, "tid": tid, "args": args})
    events.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]))  # parents before children
    meta = []
    for pid, p in procs.items():
        role, stage = p["role"], p["stage"]
        name = {"driver": "memra driver", "head": f"memra head (holds stage {stage})" if stage is not None
                else "memra head"}.get(role, f"memra stage {stage}" if stage is not None else "memra stage")
        order = _ROLE_ORDER.get(role, 3) * 1000 + (stage or 0)
        meta.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{name} [pid {pid}]"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": order}})
    for (pid, thread), tid in threads.items():
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread}})
    return {"traceEvents": meta + events, "displayTimeUnit": "ms"}
