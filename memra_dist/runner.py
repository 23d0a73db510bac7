"""ModelRunner: one Stage, its cache and its device. The local engine and every pipeline
stage actor run their layers through one of these."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from .cache import StageCache
from .device import Drainer, device_label, free_mb, room_mb, stream_marks
from .errors import UserError
from .kernels import available as kernels_available
from .kernels import install as install_kernels
from .graphs import StepGraphs, compile_blocks, compile_supported, graph_rows_limit, graphs_supported, stage_compiles
from .model.config import ModelConfig, load_config
from .model.loader import load_stage
from .model.transformer import Stage
from .model.taps import FINAL, TapSink

__all__ = ["ModelRunner", "check_fits_before_load"]


def check_fits_before_load(cfg: ModelConfig, first: int, last: int, has_embed: bool, has_head: bool,
                           device: torch.device, dtype: torch.dtype, capacity: int, label: str) -> None:
    """Refuse, before a byte is read, a stage whose weights and cache of `capacity` rows
    would not fit the device's free memory (host MemAvailable on CPU): one line with the
    bytes each needs and what is free. Sizes come from the stage built on the meta device."""
    with torch.device("meta"):
        stage = Stage(cfg, first, last, has_embed, has_head)
    size = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.numel() for p in stage.parameters()) * size
    cache = stage.new_cache(capacity, torch.device("meta"), dtype).nbytes()
    free = room_mb(device)
    if weights + cache > free * (1 << 20):
        mb = lambda b: f"{b / (1 << 20):.0f} MB"  # noqa: E731
        raise UserError(f"out of memory: the cache for {capacity} rows needs {mb(cache)} on {label}, free {free} MB, "
                        f"and the weights need {mb(weights)} of it (lower --ctx)")


class ModelRunner:
    """Layers [first, last) (+ embed / head where owned) on one device, with a static cache.

    `forward` writes its rows at [start, start + T) and returns hidden (T, H) or, on a runner
    that owns the head, fp32 logits (T, V). `rollback(n)` keeps n rows. Both are single calls
    over static-shaped tensors (positions are a tensor, the mask spans the whole capacity)."""

    takes_device_ids = True  # forward reads ids already on its device (a session's verify row stays there)
    # rollback only moves the cache's lengths (KV / latent rows past it are masked, a KDA layer's
    # state is in its snapshot rings already): no device work, so the event clock records no
    # event at its end (phase/clock.py)
    rollback_on_host = True

    def __init__(self, model_dir: str | Path, device: torch.device, dtype: torch.dtype,
                 first: int = 0, last: int | None = None, has_embed: bool = True,
                 has_head: bool = True, cfg: ModelConfig | None = None, max_pos: int = 4096,
                 graphs: bool = False, compile: bool = False, kernels: bool = False, warm_rows: int = 0,
                 warm_timed: bool = False, progress=None, compile_drafter: bool = False):
        self.cfg = cfg or load_config(model_dir)
        last = self.cfg.num_layers if last is None else last
        self.device, self.dtype = device, dtype
        self.label = device_label(device)
        check_fits_before_load(self.cfg, first, last, has_embed, has_head, device, dtype, max_pos, self.label)
        self.stage = load_stage(model_dir, first, last, has_embed, has_head, device, dtype, self.cfg, progress)
        self.max_pos = max_pos
        self.cache: StageCache | None = None
        self.graphs = None
        self.kernel_modules = 0  # modules switched onto our Triton kernels (kernels/ops.py)
        if graphs and device.type == "cuda" and graphs_supported(self.stage):
            for blk in self.stage.layers.values():  # fused QKV and gate-up GEMMs on the fast path
                for m in (blk.self_attn, blk.mlp):
                    if hasattr(m, "fuse"):
                        m.fuse()
            self.graphs = StepGraphs(self)
            if kernels and kernels_available(device):
                self.kernel_modules = install_kernels(self.stage)
            if compile and compile_supported(self.stage):
                compile_blocks(self.stage)
        self.graph_rows = graph_rows_limit(self.stage)
        self.compile_drafter = bool(graphs and compile_drafter)  # a tap drafter's graphs compile their pieces (compile_policy.py)
        self.warm_rows = warm_rows  # capture graphs for 1..warm_rows rows at allocation
        self.warm_timed = warm_timed  # and their level-2 twins (trace level 2)
        self.drain = Drainer(device)
        self.tap_layers: tuple[int, ...] = ()  # layers whose outputs a forward keeps (keep_taps)
        self.tap_all = False  # a pipeline head's sink holds the remote stages' taps too (they ship them)
        self.ttft_depth = None  # the profile's DepthTimer during a profiled alloc (phase/first_token.py)

    def alloc(self, capacity: int) -> None:
        """Allocate the cache for a session of `capacity` rows; a clear error if it cannot fit."""
        if self.cache is not None and self.cache.capacity == capacity and self._taps_match():
            self.cache.rollback(0)  # reuse: no reallocation, captured graphs stay valid
            if self.ttft_depth is not None and self.cache.taps is not None:
                self.ttft_depth.prof.tap_sink_mb = self.cache.taps.nbytes() / 2**20  # reused: ~0 ms
            return
        if capacity > self.max_pos:
            raise UserError(f"context {capacity} exceeds this runner's limit ({self.max_pos} rows)")
        self._check_fits(capacity)
        d = self.ttft_depth  # profiled: each part below is a drained share of cache_alloc
        try:
            self.cache = None
            if self.graphs is not None:
                self.graphs.reset()
            t = d.stamp() if d is not None else 0
            self.cache = self.stage.new_cache(capacity, self.device, self.dtype)
            if d is not None:
                d.lap("cache_kv_alloc_ms", t)
            if self._local_taps():  # before any capture: the graphs then write the taps too
                t = d.stamp() if d is not None else 0
                self.cache.taps = TapSink.alloc(self._local_taps(), capacity, self.cfg.hidden_size, self.device,
                                                self.dtype)
                if d is not None:
                    d.lap("tap_sink_alloc_ms", t)
                    d.prof.tap_sink_mb = self.cache.taps.nbytes() / 2**20
            if self.graphs is not None and self.warm_rows:
                # every decode/verify row count up front (vLLM's habit): no capture or compile
                # ever lands inside a round
                # (the captures' warm-ups leave the cache empty: length 0, and every step is
                # idempotent at its positions, graphs.py)
                self.graphs.warm(range(1, min(self.warm_rows, capacity, self.graph_rows) + 1), self.warm_timed, d)
        except torch.OutOfMemoryError:
            raise UserError(
                f"out of memory allocating the cache for {capacity} rows on {self.label} "
                f"(free {free_mb(self.device)} MB)"
            ) from None

    def planned_bytes(self, capacity: int) -> int:
        """Bytes the cache for `capacity` rows will take, from the states' shapes built on the
        meta device (nothing allocated)."""
        return self.stage.new_cache(capacity, torch.device("meta"), self.dtype).nbytes()

    def _check_fits(self, capacity: int) -> None:
        """Refuse a cache larger than the device's free memory (host MemAvailable on CPU)
        before allocating: on CPU an oversized allocation would swap or meet the OOM killer,
        not raise. The old cache counts as free: it is dropped first."""
        need = self.planned_bytes(capacity)
        free = room_mb(self.device)
        reclaim = self.cache.nbytes() if self.cache is not None else 0
        if need > free * (1 << 20) + reclaim:
            raise UserError(
                f"out of memory: the cache for {capacity} rows needs {need / (1 << 20):.0f} MB on {self.label}, "
                f"free {free} MB (lower --ctx)"
            )

    def keep_taps(self, layers) -> None:
        """From the next `alloc` on, every forward (prime, decode, verify; eager or graphed)
        keeps the outputs of these layers (those this stage holds) in `cache.taps`."""
        self.tap_layers = tuple(int(t) for t in layers)

    def _local_taps(self) -> tuple[int, ...]:
        """The tapped layers this stage holds, in tap order (a stage-local tap set at pp > 1);
        every one on a pipeline's head (`tap_all`: the stages ship theirs to it)."""
        if self.tap_all:
            return self.tap_layers
        return tuple(t for t in self.tap_layers if self.stage.first <= t < self.stage.last
                     or (t == FINAL and self.stage.has_head))

    def _taps_match(self) -> bool:
        return (self.cache.taps.layers if self.cache.taps is not None else ()) == self._local_taps()

    @property
    def length(self) -> int:
        return self.cache.length if self.cache is not None else 0

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, start: int, timer=None, last: bool = False) -> torch.Tensor:
        """`last`: a runner with the head returns only the last row's logits (1, V): a prefill
        chunk, whose other rows' logits nobody reads, skips their lm_head."""
        rows = x.shape[0]
        self.cache.begin(start, rows)
        if self.graphs is not None and rows <= self._graphed_rows():
            out = self.graphs.run(x, start, timer)  # level 2 too: the graph records its laps
            return out[-1:] if last and self.stage.has_head else out
        pos = torch.arange(start, start + rows, device=self.device)
        h = self.stage(x.to(self.device), pos, self.cache, timer, start)
        if not self.stage.has_head:
            return h
        return self.stage.logits(h[-1:] if last else h)

    def _graphed_rows(self) -> int:
        """Rows that replay a graph: the warmed row counts when graphs are warmed at
        allocation (a longer forward, a prefill, runs eager: no capture ever lands inside a
        request, where another session's work may be on the device), else any up to the limit."""
        return min(self.warm_rows, self.graph_rows) if self.warm_rows else self.graph_rows

    def rollback(self, new_len: int) -> None:
        self.cache.rollback(new_len)

    def slot_view(self) -> "ModelRunner":
        """Another cache slot over the same weights: a runner sharing this one's stage (no
        weight is copied) with its own cache, graphs and drain. Sessions in flight at once
        each run in a slot of their own (pipeline stages keep one per session)."""
        view = copy.copy(self)
        view.cache = None
        view.graphs = StepGraphs(view) if self.graphs is not None else None
        view.drain = Drainer(self.device)
        return view

    def kv_mb(self) -> float:
        """The allocated cache (MB)."""
        return self.cache.nbytes() / 2**20 if self.cache is not None else 0.0

    def free_mb(self) -> int:
        return free_mb(self.device)

    def warm_timed_rows(self, rows: int) -> None:
        """Level 2 asked of a runner built without its twins (`warm_timed` off: an engine opened
        at another level): capture the timed twins of 1..rows rows now, in the request's start
        (the first-token profile's cache_alloc), so none is captured inside a traced round."""
        if self.graphs is None or self.cache is None or rows < 1:
            return
        n = min(rows, self.graph_rows)
        if any(r not in self.graphs.timed for r in range(1, n + 1)):
            self.graphs.warm(range(1, n + 1), timed=True, depth=self.ttft_depth)

    def stream_marks(self):
        """The event clock's marks on this runner's stream (None on CPU: phase/clock.py)."""
        return stream_marks(self.device)

    def fast_path(self) -> dict[str, bool]:
        """What this runner's decode / verify steps actually run: CUDA graphs, torch.compile'd
        blocks inside them, our Triton kernels (each can be asked for and still be off: a CPU
        device, a family that does not capture, Triton missing)."""
        return {"graphs": self.graphs is not None,
                "compile": stage_compiles(self.stage),
                "kernels": self.kernel_modules > 0}
