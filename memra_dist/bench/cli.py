"""`memra-dist bench`: the subparser (added by memra_dist/cli.py) and its handler."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import SECTIONS

__all__ = ["add_bench_parser", "run_bench"]

ROOT = Path(__file__).resolve().parents[2]  # the repository (BENCHMARKS.md, git commit)


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="measure decode / verify / spec / trace / pp against the roofline and transformers",
                       description="One run on this machine, so the ratios hold. Checkpoints are made here "
                                   "(random weights at real shapes) and cached. Progress goes to stderr.")
    b.add_argument("--shape", choices=["tiny", "mid", "8b"], default=None,
                   help="target shape (draft: tiny-draft / mid-draft / 1b); default 8b on CUDA, tiny on CPU")
    b.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto (default)")
    b.add_argument("--dtype", choices=["fp32", "bf16", "fp16", "auto"], default="auto", help="auto = bf16 on CUDA, fp32 on CPU")
    b.add_argument("--quick", action="store_true", help="fewer tokens and repeats (smoke run)")
    b.add_argument("--sections", metavar="A,B", help=f"comma list of {','.join(SECTIONS)} (default: the suite for this machine)")
    b.add_argument("--budget-s", type=float, default=480.0, metavar="S", help="cap on the total wall; later parts are skipped (default %(default)s)")
    b.add_argument("--hybrid", action="store_true", help="include the kimi_linear hybrid section (default on CUDA)")
    b.add_argument("--graphs", choices=["on", "off", "auto"], default="auto", help="CUDA-graph fast path (auto = on with CUDA)")
    b.add_argument("--cache-dir", metavar="DIR", help="checkpoint cache (default $MEMRA_BENCH_CACHE or ~/.cache/memra_dist/bench)")
    b.add_argument("--ctx", type=int, metavar="N", help="context rows for steps / prompt length (default 512 CUDA, 128 CPU)")
    b.add_argument("--max-new", type=int, metavar="N", help="tokens per generation (default 256 CUDA, 64 CPU)")
    b.add_argument("--out", metavar="JSON", help="result file (default: $OUT/bench.json if $OUT is set, else bench.json)")
    b.add_argument("--record", action="store_true", help="append the markdown table to BENCHMARKS.md (never by default)")
    b.add_argument("--from-json", metavar="FILE", help="measure nothing: render (and with --record append) the "
                                                      "table of an earlier result file, e.g. one fetched from the GPU machine")
    b.add_argument("--benchmarks-md", metavar="FILE", default=str(ROOT / "BENCHMARKS.md"), help=argparse.SUPPRESS)


def _options(args):
    from ..errors import UserError  # noqa: PLC0415
    from .suite import Options  # noqa: PLC0415

    secs = None
    if args.sections:
        secs = tuple(x.strip() for x in args.sections.split(",") if x.strip())
        bad = [x for x in secs if x not in SECTIONS]
        if bad:
            raise UserError(f"--sections: unknown {', '.join(bad)} (choose from {', '.join(SECTIONS)})")
    if args.budget_s <= 0:
        raise UserError(f"--budget-s must be > 0 (got {args.budget_s})")
    shape = args.shape
    if shape is None:
        import torch  # noqa: PLC0415

        cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
        shape = "8b" if cuda else "tiny"
    return Options(shape=shape, device=args.device, dtype=args.dtype, quick=args.quick, sections=secs,
                   budget_s=args.budget_s, hybrid=args.hybrid, graphs=args.graphs, cache_dir=args.cache_dir,
                   ctx=args.ctx, max_new=args.max_new)


def _load_result(path: str) -> dict:
    from ..errors import UserError  # noqa: PLC0415

    try:
        res = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"--from-json {path}: cannot read a result ({e})") from None
    if not isinstance(res, dict) or "meta" not in res or "targets" not in res:
        raise UserError(f"--from-json {path}: not a memra-dist bench result (no meta / targets)")
    return res


def _chart(res: dict, out: Path) -> None:
    """The batching section's sweep as a chart beside the JSON: OUT-speedup.svg, and .png where
    matplotlib is installed (bench/plot.py)."""
    rows = ((res.get("batching") or {}).get("sweep") or {}).get("rows")
    if not rows:
        return
    from .plot import png, speedups, svg  # noqa: PLC0415

    m = res.get("meta", {})
    title = f"--spec-k auto, steady decode over plain: {m.get('shape')} on {m.get('device_name')} ({m.get('commit')})"
    series = speedups(rows)
    paths = [out.with_name(f"{out.stem}-speedup.svg")]
    paths[0].write_text(svg(series, title))
    try:
        png(series, out.with_name(f"{out.stem}-speedup.png"), title)
        paths.append(out.with_name(f"{out.stem}-speedup.png"))
    except ImportError:
        pass  # (the SVG alone: pip install 'memra_dist[plot]' for the PNG)
    print(f"[bench] wrote {', '.join(map(str, paths))}", file=sys.stderr)


def run_bench(args) -> int:
    from .report import append_benchmarks, evaluate, markdown  # noqa: PLC0415
    from .suite import run_suite  # noqa: PLC0415

    if args.from_json:
        res = _load_result(args.from_json)
        res["targets"] = evaluate(res)  # the current rules: an older result without ranges is not passed
    else:
        res = run_suite(_options(args), ROOT)
        out = Path(args.out) if args.out else (Path(os.environ["OUT"]) / "bench.json" if os.environ.get("OUT")
                                              else Path("bench.json"))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2))
        print(f"[bench] wrote {out}", file=sys.stderr)
        _chart(res, out)
    md = markdown(res)
    print(md)
    if args.record:
        append_benchmarks(md, Path(args.benchmarks_md))
        print(f"[bench] appended to {args.benchmarks_md}", file=sys.stderr)
    return 0
