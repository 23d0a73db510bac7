"""Render a traced run's Perfetto files as a static PNG timeline (a doc-generation tool, not
part of the package; needs matplotlib: `pip install matplotlib`).

    memra-dist demo --pp 2 --trace-level 2 --run-dir /tmp/run
    python docs/render_timeline.py /tmp/run docs/img/timeline-pp2.png

It reads the run directory's `trace.perfetto.json` (every process in one file; older run
directories hold one file per process, which it reads too) and draws one row group per process (driver,
head, stage), one lane per span level, the phases coloured. Top: the whole request (Ray start-up
and actor placement included); bottom: the rounds, zoomed. Nothing is drawn that is not a span
of those files.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

PHASE_COLORS = {
    "draft": "#4C72B0", "verify": "#DD8452", "accept": "#55A868", "rollback": "#C44E52",
    "maint": "#8172B3", "prime": "#937860",
    "verify.attn": "#F1A340", "verify.ffn": "#FEE0B6", "verify.rest": "#B35806",
    "verify.kda": "#998EC3", "verify.mla": "#542788", "verify.scan": "#D8DAEB",
}
OTHER = "#BBBBBB"
ROLE_ORDER = {"driver": 0, "head": 1, "stage": 2}


def lane_of(name: str) -> tuple[int, str]:
    """(lane inside the process's row group, colour key) for a span name."""
    if name == "memra.request":
        return 0, ""
    if name == "spec.burst" or name == "memra.first_token":
        return 0, ""
    if name == "spec.round" or name.startswith("ttft."):
        return 1, ""
    if name.startswith("spec.verify."):
        return 3, name[len("spec."):]
    if name.startswith("spec."):
        return 2, name[len("spec."):]
    return 0, ""


def load(run_dir: str) -> list[dict]:
    """The run's spans, each with "tid" set to its process's role (driver | head | stage),
    read from the one trace.perfetto.json (process names in its metadata events)."""
    events, roles = [], {}
    for path in sorted(glob.glob(os.path.join(run_dir, "*trace.perfetto.json"))):
        with open(path) as f:
            evs = json.load(f)["traceEvents"]
        for e in evs:
            if e.get("ph") == "M" and e.get("name") == "process_name":
                roles[e["pid"]] = e["args"]["name"].split()[1]  # "memra <role> ..."
        events += [e for e in evs if e.get("ph") == "X"]
    if not events:
        raise SystemExit(f"no *trace.perfetto.json with spans in {run_dir}")
    for e in events:
        e["tid"] = roles.get(e["pid"], str(e["tid"]))
    return events


def render(run_dir: str, out: str, title: str | None = None) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415

    events = load(run_dir)
    procs = sorted({(e["tid"], e["pid"]) for e in events}, key=lambda p: (ROLE_ORDER.get(p[0], 9), p[1]))
    # row y: each process gets as many lanes as it uses
    lanes_used = {p: sorted({lane_of(e["name"])[0] for e in events if (e["tid"], e["pid"]) == p}) for p in procs}
    rows, y, labels = {}, 0, []
    for p in procs:
        for lane in lanes_used[p]:
            rows[(p, lane)] = y
            y += 1
        labels.append((y - len(lanes_used[p]) / 2 - 0.5, f"{p[0]}\npid {p[1]}"))
        y += 0.6
    t0 = min(e["ts"] for e in events)
    req = [e for e in events if e["name"] == "memra.request"]
    work = [e for e in events if e["name"] != "memra.request"]
    z0 = min(e["ts"] for e in work) if work else t0
    z1 = max(e["ts"] + e["dur"] for e in work) if work else max(e["ts"] + e["dur"] for e in events)

    fig, (ax_all, ax_zoom) = plt.subplots(2, 1, figsize=(12, 7), gridspec_kw={"height_ratios": [1, 2]})
    for ax, (lo, hi), unit, scale in ((ax_all, (t0, max(e["ts"] + e["dur"] for e in events)), "s", 1e6),
                                      (ax_zoom, (z0, z1), "ms", 1e3)):
        for e in events:
            lane, key = lane_of(e["name"])
            if key == "" and e["name"] == "stage.forward":
                key = str(e.get("args", {}).get("memra.phase", ""))
            color = PHASE_COLORS.get(key, OTHER)
            yy = rows[((e["tid"], e["pid"]), lane)]
            ax.barh(yy, e["dur"] / scale, left=(e["ts"] - lo) / scale, height=0.8, color=color,
                    edgecolor="black" if key == "" else "none", linewidth=0.3)
        ax.set_xlim(0, (hi - lo) / scale * 1.01)
        ax.set_ylim(y - 0.3, -0.7)
        ax.set_yticks([c for c, _ in labels], [t for _, t in labels], fontsize=8)
        since = "the request began" if ax is ax_all else "the first span of an actor"
        ax.set_xlabel(f"{unit} since {since}")
        ax.grid(axis="x", alpha=0.3)
    n_rounds = sum(1 for e in events if e["name"] == "spec.round")
    total_s = req[0]["dur"] / 1e6 if req else (z1 - t0) / 1e6
    ax_all.set_title(title or f"memra-dist demo --pp 2 --trace-level 2: one request, {total_s:.1f} s "
                     f"(Ray start-up and actor placement included)", fontsize=10)
    ax_zoom.set_title(f"the {n_rounds} rounds, zoomed: burst / round / phases / verify sub-buckets "
                      "(head), stage.forward by phase (stage)", fontsize=10)
    used = sorted({lane_of(e["name"])[1] for e in events} | {str(e.get("args", {}).get("memra.phase", ""))
                                                             for e in events if e["name"] == "stage.forward"})
    handles = [Patch(color=PHASE_COLORS[k], label=k) for k in PHASE_COLORS if k in used]
    handles.append(Patch(facecolor=OTHER, edgecolor="black", label="request / burst / round"))
    ax_zoom.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=min(len(handles), 7),
                   fontsize=8, frameon=False)
    fig.text(0.99, 0.005, f"rendered by docs/render_timeline.py from {len(events)} spans of a real run",
             ha="right", fontsize=7, color="#666666")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a traced run's directory (memra-dist ... --run-dir DIR)")
    ap.add_argument("out", help="the PNG to write")
    ap.add_argument("--title", default=None)
    a = ap.parse_args()
    render(a.run_dir, a.out, a.title)


if __name__ == "__main__":
    main()
