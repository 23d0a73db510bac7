"""Speedup against concurrency, per drafter and --spec-k: an SVG (no plotting library: the
bench always writes it beside its JSON; GitHub renders SVG inline) and a PNG (matplotlib, the
`plot` extra: the bench writes it too where matplotlib is installed, and
`python -m memra_dist.bench.plot OUT/batching.json` draws it from a JSON measured elsewhere, as
for a GPU machine without matplotlib).

`speedups(rows)` turns the batching bench's rows (benchmarks/batching.py, bench/batching.py) into
one series per (drafter, spec_k): (concurrency, steady tok/s over plain decoding's at the same
concurrency); `svg(series)` draws them on a log2 concurrency axis with the 1.0x line (plain) and
a legend. Pure functions, tested on CPU.

>>> rows = [{"drafter": "none", "concurrency": 4, "spec_k": "fixed", "steady_tok_s": 100.0},
...         {"drafter": "ngram", "concurrency": 4, "spec_k": "fixed", "steady_tok_s": 150.0},
...         {"drafter": "ngram", "concurrency": 4, "spec_k": "auto", "steady_tok_s": 160.0}]
>>> speedups(rows)
{'ngram fixed': [(4, 1.5)], 'ngram auto': [(4, 1.6)]}
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

__all__ = ["png", "speedups", "svg"]

COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def _rate(r: dict) -> float | None:
    return r.get("steady_tok_s") or r.get("decode_tok_s")


def speedups(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{"<drafter> <spec_k>[ corrupt <c>]": [(concurrency, steady tok/s / plain's at that concurrency), ...]},
    concurrency ascending; rows without a plain row at their concurrency are left out. Plain's
    own rows (drafter none) are the baseline, not a series; with several plain rows at one
    concurrency (one per drafter's recording) their mean."""
    plain: dict[int, list[float]] = {}
    for r in rows:
        if r.get("drafter") == "none" and _rate(r):
            plain.setdefault(r["concurrency"], []).append(_rate(r))
    base = {n: sum(v) / len(v) for n, v in plain.items()}
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        n, rate = r.get("concurrency"), _rate(r)
        if r.get("drafter") == "none" or not rate or n not in base:
            continue
        key = f"{r['drafter']} {r.get('spec_k', 'fixed')}" + (f" corrupt {r['corrupt']:g}" if "corrupt" in r else "")
        out.setdefault(key, []).append((n, round(rate / base[n], 3)))
    return {k: sorted(v) for k, v in out.items()}


def svg(series: dict[str, list[tuple[int, float]]], title: str = "steady decode over plain decoding",
        width: int = 640, height: int = 400) -> str:
    """The series as an SVG line chart: x = concurrency (log2), y = speedup (plain = 1.0)."""
    pts = [p for s in series.values() for p in s]
    if not pts:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="80"><text x="10" y="40">'
                f'no rows with a plain baseline</text></svg>\n')
    left, right, top, bottom = 60, 170, 40, 50
    w, h = width - left - right, height - top - bottom
    xs = [math.log2(n) for n, _ in pts]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0 = min(0.0, min(y for _, y in pts))
    y1 = max(1.25, max(y for _, y in pts) * 1.1)

    def X(n):
        return left + (math.log2(n) - x0) / (x1 - x0) * w

    def Y(v):
        return top + (1 - (v - y0) / (y1 - y0)) * h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="20" font-size="14">{escape(title)}</text>',
           f'<line x1="{left}" y1="{top + h}" x2="{left + w}" y2="{top + h}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + h}" stroke="black"/>',
           f'<line class="plain" x1="{left}" y1="{Y(1.0):.1f}" x2="{left + w}" y2="{Y(1.0):.1f}" stroke="#888" '
           f'stroke-dasharray="4 3"/>', f'<text x="{left + w + 4}" y="{Y(1.0) + 4:.1f}">plain</text>']
    for n in sorted({n for n, _ in pts}):
        out.append(f'<text x="{X(n):.1f}" y="{top + h + 16}" text-anchor="middle">{n}</text>')
    out.append(f'<text x="{left + w / 2:.1f}" y="{height - 10}" text-anchor="middle">concurrent requests</text>')
    step = 0.25 if y1 - y0 <= 2 else 0.5
    v = math.ceil(y0 / step) * step
    while v <= y1 + 1e-9:
        out.append(f'<text x="{left - 6}" y="{Y(v) + 4:.1f}" text-anchor="end">{v:.2f}x</text>')
        v += step
    for i, (name, s) in enumerate(series.items()):
        c = COLORS[i % len(COLORS)]
        line = " ".join(f"{X(n):.1f},{Y(y):.1f}" for n, y in s)
        out.append(f'<polyline class="series" data-name="{escape(name)}" points="{line}" fill="none" stroke="{c}" '
                   f'stroke-width="2"/>')
        out += [f'<circle cx="{X(n):.1f}" cy="{Y(y):.1f}" r="3" fill="{c}"/>' for n, y in s]
        ly = top + 16 * i
        out.append(f'<line x1="{left + w + 40}" y1="{ly}" x2="{left + w + 60}" y2="{ly}" stroke="{c}" '
                   f'stroke-width="2"/>')
        out.append(f'<text x="{left + w + 64}" y="{ly + 4}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def png(series: dict[str, list[tuple[int, float]]], path, title: str = "steady decode over plain decoding") -> None:
    """The series as a PNG line chart at `path`, the SVG's axes (x = concurrency on a log2 axis,
    y = speedup, the dashed 1.0x line = plain). Needs matplotlib (`pip install 'memra_dist[plot]'`)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    try:
        ns = sorted({n for s in series.values() for n, _ in s})
        for i, (name, s) in enumerate(series.items()):
            ax.plot([n for n, _ in s], [y for _, y in s], marker="o", color=COLORS[i % len(COLORS)], label=name)
        ax.axhline(1.0, color="#888888", linestyle="--", linewidth=1, label="plain")
        ax.set_xscale("log", base=2)
        if ns:
            ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("steady tok/s over plain at the same concurrency")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.set_title(title, fontsize=11)
        ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """python -m memra_dist.bench.plot BATCHING_JSON [MORE_JSON ...] [-o OUT_PNG]: the chart of
    batching bench JSONs (benchmarks/batching.py's, or `memra-dist bench`'s: its batching
    section's sweep; several runs' rows drawn as one, each drafter row over the plain rows at its
    concurrency), as a PNG beside the first (speedup.png) unless -o says where."""
    import argparse  # noqa: PLC0415
    import json  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="python -m memra_dist.bench.plot", description=main.__doc__.split(":", 1)[1])
    ap.add_argument("json", nargs="+", help="batching bench JSONs (batching.json)")
    ap.add_argument("-o", "--out", help="the PNG to write (default: speedup.png beside the first JSON)")
    ap.add_argument("--title", help="the chart's title (default: the first JSON's shape and device)")
    a = ap.parse_args(argv)
    rows, first = [], None
    for src in map(Path, a.json):
        try:
            data = json.loads(src.read_text())
            if "rows" not in data and "batching" in data:  # `memra-dist bench`'s JSON: its batching sweep
                data = {**data.get("meta", {}), "rows": data["batching"]["sweep"]["rows"]}
                data["device"] = data.get("device_name", data.get("device"))
            rows += list(data["rows"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"error: {src}: not a batching bench's JSON ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
        first = first or data
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        print("error: the PNG needs matplotlib: pip install 'memra_dist[plot]'", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else Path(a.json[0]).with_name("speedup.png")
    png(speedups(rows), out, a.title or f"steady decode over plain, {first.get('shape', '?')} on "
                                         f"{first.get('device', '?')}")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
