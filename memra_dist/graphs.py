"""CUDA graphs for the decode (1 row) and verify (K+1 rows) steps: the fast path.

One graph per row count, captured lazily on first use over static buffers (token ids or
hidden rows, positions) against the runner's cache; replays write the cache rows at the
positions in the static buffer, exactly as the eager forward does. The eager forward stays
the reference (CPU, tests). At trace level 2 a twin graph per row count records the device
clock at the sub-split's boundaries (phase/subsplit.py StampMarks), so level 2 times the same
graphed step. A new cache (a different capacity) drops the graphs.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .phase.subsplit import EventMarks, StampMarks

__all__ = ["StepGraphs", "CapturedGraph", "step_marks", "STAMP_SLOTS", "hold_collector", "graphs_supported", "graph_rows_limit", "compile_supported", "compile_blocks",
           "compiled_blocks", "stage_compiles", "compile_inference", "MAX_GRAPH_ROWS"]

MAX_GRAPH_ROWS = 64  # decode and verify rows; a prefill runs eager (one graph per prompt length would not pay)

_held = {"depth": 0, "was_on": False}  # hold_collector's nesting


@contextmanager
def hold_collector():
    """Collect once, then keep Python's cyclic collector off until the outermost block exits.

    Graphs of a runner dropped earlier sit in reference cycles until the collector runs;
    collected mid-capture, their teardown is an illegal call on a capturing stream (and
    invalidates the capture). So every capture runs inside this block. A warm-up of many
    captures wraps them all in one (nested blocks neither collect nor switch anything): one
    collection per warm-up instead of one per capture, which cost ~0.1 s each in a process
    holding torch, Ray and transformers (a DFlash drafter captures 31 graphs)."""
    if _held["depth"] == 0:
        gc.collect()
        _held["was_on"] = gc.isenabled()
        gc.disable()
    _held["depth"] += 1
    try:
        yield
    finally:
        _held["depth"] -= 1
        if _held["depth"] == 0 and _held["was_on"]:
            gc.enable()


class CapturedGraph:
    """fn captured into a torch.cuda.CUDAGraph, with `.out` (fn's output, static) and
    `.replay()`: two eager warm-ups on a side stream first (kernel JIT, autotuning, the
    allocator), then the capture with the collector off (`hold_collector`). `mode`: CUDA's
    capture error mode ("thread_local" where other threads keep launching meanwhile)."""

    mode = "global"

    def __init__(self, fn, pool):
        cur = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        cur.wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with hold_collector(), torch.cuda.graph(self.graph, pool=pool, capture_error_mode=self.mode):
            self.out = fn()

    def replay(self) -> None:
        self.graph.replay()


def _timing_event():
    """A CUDA timing event that may be recorded inside a graph capture and read after replays."""
    return torch.cuda.Event(enable_timing=True, external=True)


STAMP_SLOTS = 4096  # boundaries a level-2 step may record (an 8B step: 96)


def step_marks(device, turns: int = 2) -> EventMarks | StampMarks:
    """Level-2 marks whose calls torch.compile leaves to Python (a graph break at each boundary):
    the compiled blocks' kernels stay fused between boundaries, and each boundary is recorded
    on the capturing stream in walk order. Device-clock stamps where Triton imports (one copy
    back per replay, into `turns` pinned host rows used in turn), else CUDA timing events."""
    from .kernels import available  # noqa: PLC0415

    if available(device):
        from .kernels.stamp import stamp  # noqa: PLC0415

        m = StampMarks(torch.zeros(STAMP_SLOTS, dtype=torch.int64, device=device), stamp,
                       host=[torch.zeros(STAMP_SLOTS, dtype=torch.int64, pin_memory=True) for _ in range(turns)],
                       copied=[torch.cuda.Event() for _ in range(turns)])
    else:
        m = EventMarks(_timing_event)
    for name in ("begin", "lap", "scan_begin", "scan_end"):
        setattr(m, name, torch.compiler.disable(getattr(m, name)))
    return m


def graphs_supported(stage) -> bool:
    """Every mixer and FFN of the stage declares itself capturable (static shapes, no host
    syncs): attention, MLA and KDA always; an MoE FFN in its grouped form (bf16 CUDA)."""
    return all(getattr(b.self_attn, "graph_safe", False) and getattr(b.mlp, "graph_safe", True)
               for b in stage.layers.values())


def graph_rows_limit(stage) -> int:
    """The most rows a step graph may take: KDA's captured step keeps a snapshot per row,
    so its ring length bounds it (longer forwards are prefills, which run eager)."""
    return min([MAX_GRAPH_ROWS] + [getattr(b.self_attn, "max_graph_rows", MAX_GRAPH_ROWS)
                                   for b in stage.layers.values()])


def compile_supported(stage) -> bool:
    """--compile covers the attention families (the hybrid's kernels are Triton already)."""
    return all(getattr(b.self_attn, "compile_safe", False) for b in stage.layers.values())


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor  # (rows,) ids or (rows, H) hidden
    base: torch.Tensor  # (rows,) 0..rows-1
    pos: torch.Tensor  # (rows,) absolute positions
    out: torch.Tensor  # (rows, V) logits or (rows, H) hidden
    host: torch.Tensor | None = None  # pinned staging row for host ids (token-id graphs)
    marks: EventMarks | StampMarks | None = None  # level-2 twins: the boundaries recorded at every replay
    copied: torch.cuda.Event | None = None  # the last copy out of `host` (before it is rewritten)

    def load(self, x: torch.Tensor) -> None:
        """Write the step's input into the static buffer without blocking the host: one host id
        as a fill (its value travels as the kernel's argument), more through the pinned row (a
        pageable copy would wait for the whole stream)."""
        if x.device.type != "cpu" or self.host is None:
            self.x.copy_(x, non_blocking=True)
            return
        if x.numel() == 1:  # a decode row, a drafter's catch-up: no staging row, no event (~0.1 ms of host less)
            self.x.fill_(int(x))
            return
        self.copied.synchronize()  # the previous step's copy out of the row is done (it is, by now)
        self.host.copy_(x)
        self.x.copy_(self.host, non_blocking=True)
        self.copied.record()

    def replay_at(self, start: int) -> None:
        """Replay the step with its rows at positions start .. start + rows - 1 (the input
        already in `x`)."""
        torch.add(self.base, start, out=self.pos)
        self.graph.replay()


class StepGraphs:
    def __init__(self, runner):
        self.runner = runner
        self.graphs: dict[int, _Graph] = {}
        self.timed: dict[int, _Graph] = {}  # level-2 twins: the same step with event marks recorded in it
        self.pool = None
        # a capture runs the step eagerly first (warm-up), at the step's own positions: every
        # mixer's step must be idempotent there. Caches written by position are; so is KDA's
        # (it reads the state of slot pos[0] and writes only the slots after it).

    def reset(self) -> None:
        self.graphs.clear()
        self.timed.clear()
        self.pool = None  # a fresh pool: reusing the handle of destroyed graphs trips the allocator

    def _eager(self, x: torch.Tensor, pos: torch.Tensor, timer=None) -> torch.Tensor:
        st = self.runner.stage
        with compiled_blocks(st):
            h = st(x, pos, self.runner.cache, timer)
        return st.logits(h) if st.has_head else h

    def _capture(self, x: torch.Tensor, start: int, timed: bool = False, depth=None) -> _Graph:
        """`depth` (the first-token profile's DepthTimer): the eager warm-up runs (where kernel
        JIT, autotuning and torch.compile land) and the recording are drained laps apart."""
        dev = self.runner.device
        t = depth.stamp() if depth is not None else 0
        marks = (lambda: step_marks(dev)) if timed else (lambda: None)
        rows = x.shape[0]
        sx = x.to(dev).clone()
        base = torch.arange(rows, device=dev)
        pos = base + start
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up: writes the same rows the real step will
            for _ in range(2):
                self._eager(sx, pos, marks())
        torch.cuda.current_stream(dev).wait_stream(side)
        if depth is not None:
            t = depth.lap("graph_warmup_ms", t)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        kept = marks()  # the events this graph records at every replay
        with hold_collector(), torch.cuda.graph(g, pool=self.pool):
            out = self._eager(sx, pos, kept)
        if depth is not None:
            depth.lap("graph_record_ms", t)
        graph = _Graph(g, sx, base, pos, out, marks=kept)
        if not sx.is_floating_point():
            graph.host = torch.zeros(sx.shape, dtype=sx.dtype, pin_memory=True)
            graph.copied = torch.cuda.Event()
            graph.copied.record()
        return graph

    def warm(self, rows_list, timed: bool = False, depth=None) -> None:
        """Capture the graphs for these row counts now (at position 0 of a fresh cache);
        `timed`: their level-2 twins too, so no capture lands inside the request's rounds.
        `depth` (the first-token profile's DepthTimer): each capture is a drained lap, the
        first apart (it pays torch.compile and the kernels' JIT, or reads their caches), kept
        per row count too, and split into its warm-up runs and its recording."""
        with hold_collector():
            self._warm(rows_list, timed, depth)

    def _warm(self, rows_list, timed: bool, depth) -> None:
        st = self.runner.stage
        tables = [(self.graphs, False)] + ([(self.timed, True)] if timed else [])
        for rows in rows_list:
            if st.has_embed:
                x = torch.zeros(rows, dtype=torch.long, device=self.runner.device)
            else:
                x = torch.zeros(rows, st.cfg.hidden_size, dtype=self.runner.dtype, device=self.runner.device)
            for table, t in tables:
                if rows not in table:
                    t0 = depth.stamp() if depth is not None else 0
                    table[rows] = self._capture(x, 0, timed=t, depth=depth)
                    if depth is not None:
                        first = depth.prof.graph_captures == 0
                        t1 = depth.lap("graph_first_capture_ms" if first else "graph_capture_ms", t0)
                        depth.prof.graph_row_ms[rows] = depth.prof.graph_row_ms.get(rows, 0.0) + (t1 - t0) / 1e6
                        depth.prof.graph_captures += 1

    def run(self, x: torch.Tensor, start: int, timer=None) -> torch.Tensor:
        """Replay the step graph of x's row count (captured on first use). With a level-2
        `timer`, the twin graph that records the sub-split's events runs instead, and its
        laps are added to the timer after the replay."""
        rows = x.shape[0]
        table = self.graphs if timer is None else self.timed
        g = table.get(rows)
        if g is None:
            g = table[rows] = self._capture(x, start, timed=timer is not None)
        else:
            g.load(x)
        g.replay_at(start)
        if timer is not None:
            g.marks.add_to(timer)
        return g.out.clone()  # the static buffer is rewritten by the next replay


def inductor_cache_dir() -> str:
    """Where compiled kernels persist between runs: TORCHINDUCTOR_CACHE_DIR when the user set
    it, else the package's cache directory (so a reboot's /tmp cleanup does not make the next
    start-up cold)."""
    import os  # noqa: PLC0415

    from .env import cache_root  # noqa: PLC0415

    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(cache_root(), "inductor")


def compile_inference(fn, **kw):
    """torch.compile(fn, **kw) whose every call runs under torch.no_grad(): dynamo then traces
    with grad off and AOTAutograd builds an inference graph, so no backward is traced whatever
    the parameters' requires_grad (our custom ops, kernels/ops.py, define no backward; tracing
    one raises). no_grad rather than inference_mode: a capture's outputs stay ordinary tensors
    (the eager walk may update them in place outside inference mode)."""
    import functools  # noqa: PLC0415

    compiled = torch.compile(fn, **kw)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.no_grad():
            return compiled(*args, **kwargs)

    return run


def compile_blocks(stage) -> None:
    """torch.compile each block's forward (the CUDA default; `--compile off` skips it): fuses
    the norms, rotary and gating elementwise work that dominates after the GEMMs. One compiled
    function is shared by every block (parameters are graph inputs), specialised per row
    count; CUDA graphs are then captured over the compiled kernels. Compiled kernels persist
    in `inductor_cache_dir()`. Grad is off inside (`compile_inference`)."""
    import os  # noqa: PLC0415
    import types  # noqa: PLC0415

    from .model.transformer import Block  # noqa: PLC0415

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())  # read by inductor when it compiles

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    fn = compile_inference(Block.forward, dynamic=False)
    for blk in stage.layers.values():
        blk._compiled = types.MethodType(fn, blk)  # used only while capturing (small row counts)


def stage_compiles(stage) -> bool:
    """Whether compile_blocks ran on this stage (its graphs capture the compiled blocks)."""
    return any(hasattr(b, "_compiled") for b in stage.layers.values())


@contextmanager
def compiled_blocks(stage):
    """While inside, the stage's blocks run their compiled forward (where compile_blocks gave
    them one): what every capture over the stage's walk records. Restored on exit."""
    blocks = [b for b in stage.layers.values() if hasattr(b, "_compiled")]
    for b in blocks:
        b.forward = b._compiled
    try:
        yield
    finally:
        for b in blocks:
            del b.forward  # back to the class's eager forward
