"""CUDA graphs of the MTP drafter's chained steps (mtp.py `step_logits`): one graph per step kind
and row count, all captured when the drafter allocates (`warm`), replayed every round after: no
capture ever lands inside a round (nor beside another session's work on the device).

Two kinds of step (mtp.py's module docstring):
  ("first", j, rows)  layer j's first forward of a round over rows [lo, lo + rows): the
                      committed rows it has not settled, then its j draft rows (rows = a + 1 + j
                      after a round that accepted a drafts)
  ("chain", j)        layer j one row further on, fed the previous step's output and draft

Static shapes: the rows' token ids and the start row live in one static row (host_row.py: the
committed ids and the start in one pinned host-to-device copy, then the drafts copied on the
device from the previous steps' picks), the positions are `base[:rows] + start` ON the device, and the hidden rows of a first
forward are index_selected at those positions from the target's FINAL tap (layer 0) or from
layer j - 1's kept outputs; a chained step's hidden is copied into a static (1, H) row. Each
graph writes the layer's K/V (and, layers 0 .. n-2, its kept outputs) at its positions, as the
eager step does, and leaves the last row's normed output and its fp32 logits in static outputs;
the caller copies them before the same graph replays again. Warm-ups run at the step's own
positions with its own inputs: every write is idempotent there.

Which steps a run asks for, with K its chain length (the target's `warm_rows` - 1, as
config.runner_kwargs sets it) and n layers: layer j's first forward of a round has
rows = a + 1 + j after a round that committed a + 1 tokens (0 <= a <= K), 1 + j in the first
round after the prime (P, at most j + 1, when the prompt of P tokens was too short for layer
j's prime rows; never below its j draft rows). So ("first", j, rows) for j < min(n, K) and
rows in max(1, j) .. K + 1 + j, and ("chain", j) for j < K - n. A round near the end of a
request asks for k < K drafts: its steps are among these (k only shrinks once below K: a
layer it skips never runs again in that request). `warm` captures them at allocation, at rows
0 .. of a fresh state, then zeroes the layers' K/V and kept outputs: the state is exactly a
fresh allocation's. Any other step (a context too small for its rows, a longer chain than the
run's K) runs eager: a warmed set never captures inside a round. A target that warms no rows
(`warm_rows` 0: it captures its own steps on first use) leaves these graphs on first use too.

Behind the runner's graph switch, as dflash_graph.py: built only when the target captures its
steps (CUDA, graphs on) and every MTP layer is capturable (its MoE in the grouped form); the
eager steps stay the reference (CPU, tests: tests/test_mtp_graph_emulated.py). The graphs bake
in the FINAL tap's buffer: a new sink drops them.
"""

from __future__ import annotations

import torch

from ...graphs import MAX_GRAPH_ROWS, hold_collector
from .dflash_graph import _CudaGraph
from .host_row import HostRow

__all__ = ["MTPGraphs", "mtp_graphs"]


def run_k(target) -> int | None:
    """The run's chain length K from the target's warm rows (K + 1 verify rows), None when it warms none."""
    warm = getattr(target, "warm_rows", 0)
    return warm - 1 if warm else None


class MTPGraphs:
    def __init__(self, drafter, graph_cls=_CudaGraph, max_rows: int = MAX_GRAPH_ROWS):
        """`graph_cls(fn, pool)` captures fn and exposes `.out` and `.replay()` (tests pass an
        emulated one)."""
        d = self.d = drafter
        h = d.head.cfg.hidden_size
        self.max_rows = max_rows
        self.k = run_k(d.target)  # every step of up to k drafts captured by `warm`; None: on first use
        # [the rows' token ids ..., the first row's position]: one pinned host-to-device copy a step
        self.row = HostRow(max_rows, d.device)
        self.tok, self.start = self.row.ids, self.row.start
        self.hid = torch.zeros(1, h, dtype=d.target.dtype, device=d.device)  # a chained step's hidden
        self.base = torch.arange(max_rows, device=d.device)
        self.graph_cls = graph_cls
        self.graphs: dict = {}
        self.sink = None  # the FINAL tap buffer the graphs read
        self.pool = self._new_pool()

    def _new_pool(self):
        return torch.cuda.graph_pool_handle() if self.graph_cls is _CudaGraph else None

    def reset(self) -> None:
        self.graphs.clear()
        self.sink = None
        self.pool = self._new_pool()  # a fresh pool: reusing the handle of destroyed graphs trips the allocator

    def fits(self, rows: int) -> bool:
        return 1 <= rows <= self.max_rows

    def keys(self) -> list[tuple]:
        """Every step a run of up to k drafts asks for (the module docstring), at this capacity."""
        d, k = self.d, self.k
        top = min(self.max_rows, d.capacity)
        first = [("first", j, rows) for j in range(min(d.n, k))
                 for rows in range(max(1, j), min(k + 1 + j, top) + 1)]
        return first + [("chain", j) for j in range(min(d.n, k - d.n))]

    def replays(self, key: tuple) -> bool:
        """Whether this step replays a graph: warmed, only one captured at allocation (over the
        current FINAL tap buffer; any other step runs eager); unwarmed, any that fits."""
        if self.k is None:
            return key[0] == "chain" or self.fits(key[2])
        return key in self.graphs and self.sink is self.d._final()

    @torch.inference_mode()
    def warm(self) -> None:
        """Capture every step of the run now (at allocation; nothing without the run's K), then
        leave the layers' K/V and kept outputs as a fresh allocation has them (zeros: every
        state kind is zero-filled). The warm-ups wrote rows 0 .. of them, each capture's eager
        runs and its replay the same values at the same rows (idempotent)."""
        if self.k is None:
            return
        d = self.d
        if self.sink is not None and self.sink is not d._final():
            self.reset()
        tok, hid = torch.zeros(1, dtype=torch.long, device=d.device), torch.zeros_like(self.hid)
        with hold_collector():  # one collection for every capture (graphs.hold_collector)
            for key in self.keys():
                if key in self.graphs:
                    continue
                if key[0] == "first":  # token 0 at rows 0 .. rows - 1 (the graph reads every row's id alike)
                    self.first(key[1], 0, [0] * key[2], [])
                else:
                    self.chain(key[1], 0, tok, hid)
        for st in d.states:
            for t in vars(st).values():
                if isinstance(t, torch.Tensor):
                    t.zero_()
        for o in d.outs:
            o.zero_()

    def _step(self, j: int, rows: int, hidden, keep: bool):
        d = self.d
        pos = self.base[:rows] + self.start  # (rows,) on the device
        emb = d.target.stage.embed_tokens(self.tok[:rows])
        out = d.head.layer(j).step(emb, hidden(pos), d.head.step_ctx(pos, d.capacity), d.states[j])
        if keep:
            d.outs[j].index_copy_(0, pos, out)
        last = out[-1:]
        return last, d.target.stage.lm_head(last).float()

    def _replay(self, key, fn):
        final = self.d._final()
        if final is not self.sink:  # a new sink (the target reallocated): the graphs read the old buffer
            if self.sink is not None:
                self.reset()
            self.sink = final
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self.graph_cls(fn, self.pool)
        g.replay()
        return g.out

    @torch.inference_mode()
    def first(self, j: int, lo: int, real: list[int], drafts: list[torch.Tensor]):
        """Layer j over rows [lo, lo + len(real) + len(drafts)): tokens `real` (host ids) then
        `drafts` ((1,) device ids) -> (last output (1, H), logits (1, V) fp32), static outputs."""
        m = len(real)
        rows = m + len(drafts)
        self.row.load(real, lo)
        for i, t in enumerate(drafts):  # after the row's copy, in stream order
            self.tok[m + i:m + i + 1].copy_(t)
        d = self.d
        buf = d._final() if j == 0 else d.outs[j - 1]  # the hidden rows' source, read at the positions
        return self._replay(("first", j, rows),
                            lambda: self._step(j, rows, lambda pos: buf.index_select(0, pos), j < d.n - 1))

    @torch.inference_mode()
    def chain(self, j: int, p: int, token: torch.Tensor, hidden: torch.Tensor):
        """Layer j's one row at position p, fed `token` (1,) and `hidden` (1, H)."""
        self.row.load((), p)
        self.tok[:1].copy_(token)  # after the row's copy, in stream order
        self.hid.copy_(hidden)
        return self._replay(("chain", j), lambda: self._step(j, 1, lambda pos: self.hid, False))


def mtp_graphs(drafter) -> MTPGraphs | None:
    """The drafter's step graphs when its target captures its steps (CUDA, graphs on) and every
    MTP layer is capturable, else None."""
    if getattr(drafter.target, "graphs", None) is None or drafter.device.type != "cuda":
        return None
    blocks = [drafter.head.layer(j) for j in range(drafter.n)]
    if not all(getattr(b.self_attn, "graph_safe", False) and getattr(b.mlp, "graph_safe", True) for b in blocks):
        return None
    return MTPGraphs(drafter)
