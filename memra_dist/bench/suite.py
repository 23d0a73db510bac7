"""The suite: options -> parameters, lazily built runners, sections run in order under a time
budget (a section past the budget is recorded as skipped, never guessed), progress on stderr."""

from __future__ import annotations

import datetime as _dt
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import SECTIONS
from .checkpoints import DRAFT_OF, bench_cache_dir, ensure_checkpoint
from .fastpath import graphs_status, resolve_graphs

__all__ = ["Options", "Params", "Suite", "SECTIONS", "run_suite"]



@dataclass
class Options:
    shape: str = "tiny"
    device: str = "auto"
    dtype: str = "auto"
    quick: bool = False
    sections: tuple[str, ...] | None = None  # None = the default suite
    budget_s: float = 480.0
    hybrid: bool = False
    graphs: str = "auto"
    cache_dir: str | None = None
    ctx: int | None = None
    max_new: int | None = None


@dataclass
class Params:
    """Sizes and repeat counts. Every figure a target reads is a median over >= 3 repeats
    (gen_repeats generations per decode row, trace_repeats per trace level, step_repeats per
    step), so it comes with a range (noise.py); --quick shrinks the work per repeat instead."""
    ctx: int
    max_new: int
    step_repeats: int
    gen_repeats: int
    trace_repeats: int
    copy_bytes: int
    copy_repeats: int
    hop_iters: int
    hybrid_ctx: int
    phase_new: int | None = None  # tokens of each level-1 (draft phase) run; None = max_new
    ngram_ctx: int = 4096  # n-gram propose timing: context length, calls per repeat, repeats
    ngram_calls: int = 1000
    ngram_repeats: int = 5
    ks: tuple[int, ...] = (2, 4, 8)
    accs: tuple[float, ...] = (0.6, 0.8, 0.9)
    # the prefill section (prefill.py): prompt lengths, decoded tokens after each, the chunk sweep
    prefill_lens: tuple[int, ...] = (128, 1024, 4096)
    prefill_new: int = 16
    prefill_sweep_len: int = 4096
    prefill_chunks: tuple[int, ...] = (256, 1024, 4096)
    prefill_sweep_new: int = 16
    prefill_sweep_repeats: int = 2
    prefill_long_repeats: int = 3  # timed requests of a prompt past 32k (CUDA: 1, each is seconds)

    def prefill_repeats(self, n: int) -> int:
        """Timed requests per prompt length: 5 up to 1k tokens, 3 up to 32k, then prefill_long_repeats."""
        return 5 if n <= 1024 else (3 if n <= 32768 else self.prefill_long_repeats)

    @classmethod
    def make(cls, o: Options, cuda: bool) -> "Params":
        if cuda:
            p = cls(ctx=512, max_new=256, step_repeats=30, gen_repeats=3, trace_repeats=3, copy_bytes=2 << 30,
                    copy_repeats=20, hop_iters=200, hybrid_ctx=512, phase_new=128)
            p.prefill_lens, p.prefill_new, p.prefill_long_repeats = (512, 8192, 32768, 131072), 128, 1
            p.prefill_sweep_len, p.prefill_chunks = 32768, (2048, 4096, 8192, 16384, 32768)
            if o.quick:
                p.max_new, p.step_repeats, p.gen_repeats, p.trace_repeats = 96, 10, 3, 3
                p.prefill_lens, p.prefill_new = (512, 8192), 32
                p.prefill_sweep_len, p.prefill_chunks = 8192, (2048, 4096, 8192)
        else:
            p = cls(ctx=128, max_new=64, step_repeats=10, gen_repeats=3, trace_repeats=3, copy_bytes=256 << 20,
                    copy_repeats=5, hop_iters=50, hybrid_ctx=64)
            if o.quick:
                p.ctx, p.max_new, p.step_repeats, p.gen_repeats, p.trace_repeats = 48, 24, 5, 3, 3
                p.copy_bytes, p.copy_repeats, p.hop_iters, p.hybrid_ctx = 32 << 20, 3, 20, 24
                p.ngram_calls = 300
                p.prefill_lens, p.prefill_new, p.prefill_sweep_new = (48, 256, 1024), 8, 8
                p.prefill_sweep_len, p.prefill_chunks = 1024, (64, 256, 1024)
        p.ctx = o.ctx or p.ctx
        p.max_new = o.max_new or p.max_new
        p.phase_new = min(p.phase_new or p.max_new, p.max_new)
        return p


def _say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Suite:
    opts: Options
    say: callable = _say
    memo: dict = field(default_factory=dict)

    def __post_init__(self):
        from ..device import resolve_device, resolve_dtype  # noqa: PLC0415

        self.device = resolve_device(self.opts.device)
        self.dtype = resolve_dtype(None if self.opts.dtype == "auto" else self.opts.dtype, self.device)
        self.ckpt_dtype = torch.bfloat16 if self.device.type == "cuda" else self.dtype
        self.graphs = resolve_graphs(self.opts.graphs, self.device)
        self.p = Params.make(self.opts, self.device.type == "cuda")
        self.cache = bench_cache_dir(self.opts.cache_dir)
        self.t0 = time.perf_counter()
        self._bench = None
        self._prompt = None

    def left(self) -> float:
        return self.opts.budget_s - (time.perf_counter() - self.t0)

    @property
    def bench(self):
        if self._bench is None:
            from .runs import Bench  # noqa: PLC0415

            o = self.opts
            target = ensure_checkpoint(o.shape, self.cache, self.device, self.say, self.ckpt_dtype)
            draft = ensure_checkpoint(DRAFT_OF[o.shape], self.cache, self.device, self.say, self.ckpt_dtype)
            self.say(f"loading {o.shape} target + {DRAFT_OF[o.shape]} draft onto {self.device}")
            t = time.perf_counter()
            max_pos = max(self.p.ctx, self.p.ctx) + self.p.max_new + max(self.p.ks) + 16
            self._bench = Bench(target, draft, self.device, self.dtype, max_pos, self.graphs)
            self.say(f"loaded in {time.perf_counter() - t:.1f}s")
        return self._bench

    @property
    def prompt(self) -> list[int]:
        if self._prompt is None:
            from .runs import make_prompt  # noqa: PLC0415

            self._prompt = make_prompt(self.p.ctx, self.bench.vocab)
        return self._prompt

    def default_sections(self) -> tuple[str, ...]:
        cuda = self.device.type == "cuda"
        secs = ["bandwidth", "steps", "decode", "trace", "peer"]
        if cuda:
            secs.append("pp")
        if cuda or self.opts.hybrid:
            secs.append("hybrid")
        return tuple(secs)


def _section_fns() -> dict:
    from . import sections  # noqa: PLC0415
    from .dist_bench import pipeline  # noqa: PLC0415
    from .hybrid import hybrid  # noqa: PLC0415
    from .peer import peer  # noqa: PLC0415
    from .prefill import prefill  # noqa: PLC0415
    from .batching import batching  # noqa: PLC0415
    from .prefix import prefix  # noqa: PLC0415

    return {"bandwidth": sections.bandwidth, "steps": sections.steps, "decode": sections.decode,
            "trace": sections.trace_levels, "peer": peer, "pp": pipeline, "hybrid": hybrid, "prefill": prefill,
            "prefix": prefix, "batching": batching}


def _meta(s: Suite, root: Path) -> dict:
    from .report import git_commit  # noqa: PLC0415
    from .timing import device_name  # noqa: PLC0415

    return {"date": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"), "device": s.device.type,
            "device_name": device_name(s.device), "gpus": torch.cuda.device_count() if s.device.type == "cuda" else 0,
            "commit": git_commit(root), "shape": s.opts.shape, "dtype": str(s.dtype).removeprefix("torch."),
            "graphs": graphs_status(s.graphs), "quick": s.opts.quick, "ctx": s.p.ctx, "max_new": s.p.max_new,
            "ks": list(s.p.ks), "acceptances": list(s.p.accs), "torch": torch.__version__,
            "budget_s": s.opts.budget_s}


def run_suite(opts: Options, root: Path) -> dict:
    """Every section in SECTIONS has a key in the result: its figures, or {"skipped": why} /
    {"error": what}."""
    from .roofline import SPEC_FORMULA  # noqa: PLC0415
    from .report import evaluate  # noqa: PLC0415

    s = Suite(opts)
    chosen = opts.sections or s.default_sections()
    s.say(f"suite: {', '.join(chosen)} on {s.device} (shape {opts.shape}, budget {opts.budget_s:.0f}s)")
    res = {"meta": _meta(s, root), "formula": SPEC_FORMULA}
    fns = _section_fns()
    for name in SECTIONS:
        if name not in chosen:
            why = {"pp": "not in this machine's default suite (needs >= 2 GPUs; --sections pp forces it)",
                   "hybrid": "not selected (--hybrid, or the default suite on a GPU, runs it)",
                   "prefill": "not in the default suite (minutes on a GPU: prompts to 128k, the transformers "
                              "peer, a chunk sweep; --sections prefill runs it)",
                   "prefix": "not in the default suite (a chat's second turn, a shared header and a batch job with the "
                             "prefix cache off and on; --sections prefix runs it)",
                   "batching": "not in the default suite (engines of 1 to 64 concurrent requests; --sections "
                               "batching runs it)"}.get(name, "not selected")
            res[name] = {"skipped": why}
            continue
        if s.left() <= 0:
            res[name] = {"skipped": "budget"}
            s.say(f"section {name}: skipped (budget)")
            continue
        s.say(f"section {name}: start")
        t = time.perf_counter()
        try:
            res[name] = fns[name](s)
        except Exception as e:  # noqa: BLE001 (one section failing must not lose the others)
            res[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
            s.say(f"section {name}: ERROR {res[name]['error']}")
        res[name]["section_s"] = round(time.perf_counter() - t, 2)
        s.say(f"section {name}: done in {res[name]['section_s']:.1f}s")
    res["targets"] = evaluate(res)
    res["meta"]["wall_s"] = round(time.perf_counter() - s.t0, 2)
    return res
