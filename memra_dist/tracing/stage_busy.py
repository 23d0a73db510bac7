"""Stage busy shares of a run, read back from its run directory's OTLP span files (the
stage actors' and the head's `stage.forward` spans; phase/busy.py does the arithmetic)."""

from __future__ import annotations

from pathlib import Path

from ..phase.busy import StageBusy, stage_busy
from .conventions import ATTR, SPAN_STAGE_FORWARD
from .files import OTLP_NAME
from .otlp_json import attr_value, read_spans

__all__ = ["busy_of_items", "busy_of_run_dir"]


def busy_of_items(items, since_ns: int = 0) -> StageBusy:
    """items: (resource attributes, OTLP JSON span) pairs (otlp_json.read_spans); only the
    forwards that started at or after `since_ns` (Unix ns) count."""
    by_stage: dict[int, list[tuple[int, int]]] = {}
    for _res, s in items:
        if s.get("name") != SPAN_STAGE_FORWARD or int(s["startTimeUnixNano"]) < since_ns:
            continue
        attrs = {a["key"]: attr_value(a["value"]) for a in s.get("attributes", [])}
        stage = attrs.get(ATTR["stage"])
        if stage is None:
            continue
        by_stage.setdefault(int(stage), []).append((int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"])))
    return stage_busy(by_stage)


def busy_of_run_dir(run_dir, since_ns: int = 0) -> StageBusy:
    return busy_of_items(read_spans(sorted(Path(run_dir).glob(f"*{OTLP_NAME}"))), since_ns)
