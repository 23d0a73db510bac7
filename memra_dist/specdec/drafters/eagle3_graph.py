"""CUDA graphs of the EAGLE-3 drafter's round (eagle3.py `step_logits`): the round's first forward
per row count and the chained one-row step, all captured when the drafter allocates (`warm`),
replayed every round after: no capture ever lands inside a round.

Two graph kinds (eagle3.py's module docstring has the rows):
  ("first", rows)  the committed rows [lo, N - 1) not yet in the drafter's cache (rows = a + 1
                   after a round that committed a + 1 tokens; 1 in the first round after the
                   prime, which recomputes row N - 2): token ids and the start `lo` in one
                   pinned host-to-device copy (host_row.py), positions `base[:rows] + start` ON
                   the device, the hidden rows fc(taps) index_selected from the target's tap
                   sink at those positions; its last row gives draft 1.
  ("chain",)       one row further on, fed the previous step's draft and pre-norm output.

Each graph ends with the greedy pick inside it (argmax over the draft vocabulary, mapped to
target ids through d2t) and leaves its results in the chain's static inputs: `tok` (the draft),
`hid` (the pre-norm output), `pos` (the next chain row's position: the first graph sets it to
lo + rows, each chain step adds 1) and `drafts[sidx]` (the first graph sets sidx = 1 after
drafts[0], each chain step writes drafts[sidx] and adds 1). So a greedy round is one row copy,
one first replay and k - 1 chain replays, with nothing launched between them and the k drafts
left on the device in `drafts` (read back once, with the verify's, by the accept). The step's
fp32 draft-vocabulary logits land in the static `logits` too: the sampled path replays the same
graphs, draws each draft on the host from them and overwrites `tok` with it before the next
chain replay (the chain graph's greedy `tok` is then simply replaced; `hid` and `pos` are
right either way).

Which graphs a run asks for, with K its chain length (the target's `warm_rows` - 1, as
config.runner_kwargs sets it): ("first", rows) for rows 1 .. K + 1 and ("chain",) when K >= 2.
A round near the end of a request (k < K) replays the same graphs, fewer chain steps. `warm`
captures them all at allocation over a fresh state at rows 0 .. (the first graphs at their own
rows, idempotently; the chain at rows 0, 1 (2 with the emulated capture, which runs the body
once more): it advances itself) and then zeroes the K/V: the state is exactly a fresh
allocation's. A round outside that set (a first forward of more rows, more than
PREFIX_MIN_ROWS rows: the eager path's prefix attention; a longer chain than the drafts buffer)
runs eager as a whole. A target that warms no rows (`warm_rows` 0) gets no graphs here: the
chain graph advances itself, so a first-use capture inside a round (whose warm-ups run its body)
would step past the round's rows.

Behind the runner's graph switch, as mtp_graph.py: built only when the target captures its
steps (CUDA, graphs on); the eager steps stay the reference (CPU, tests:
tests/test_eagle3_graph_emulated.py). The graphs bake in the tap sink's buffers: a new sink (the
target reallocated) drops them until the next alloc recaptures them. The captured forward is
the drafter's `_rows`: where the target runs our kernels, the folded step (kernels/ops.py
install_eagle3: both input norms in one kernel, the QKV GEMV, rotary with the K/V write, the
split attention over the live rows, o_proj with the residual, the FFN's two folded GEMVs, the
final norm inside the lm_head GEMV: ~12 kernels a chained step), else the eager one (its fp32
norms and rotary as small kernels, the attention over the whole K/V allocation under a mask).
"""

from __future__ import annotations

import torch

from ...graphs import MAX_GRAPH_ROWS, hold_collector
from ...model.prefix_attention import PREFIX_MIN_ROWS
from .dflash_graph import _CudaGraph
from .host_row import HostRow
from .mtp_graph import run_k

__all__ = ["Eagle3Graphs", "eagle3_graphs"]

CHAIN_WARM_ROWS = 3  # the chain's warm-ups write rows 0 .. 2 at most (two warm-ups, the emulator's capture run)


class Eagle3Graphs:
    def __init__(self, drafter, graph_cls=_CudaGraph, max_rows: int = MAX_GRAPH_ROWS):
        """`graph_cls(fn, pool)` captures fn and exposes `.out` and `.replay()` (tests pass an
        emulated one)."""
        d = self.d = drafter
        dev, h = d.device, d.ec.hidden_size
        self.k = run_k(d.target)  # every round of up to k drafts replays graphs captured by `warm`
        self.max_rows = min(max_rows, PREFIX_MIN_ROWS)  # more rows: the eager prefix attention
        # [the first forward's token ids ..., its start row] (an even length keeps the start aligned)
        self.row = HostRow(self.max_rows + self.max_rows % 2, dev)
        self.base = torch.arange(self.max_rows, device=dev)
        # the chain's static inputs, which every graph leaves for the next
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.hid = torch.zeros(1, h, dtype=d.target.dtype, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.sidx = torch.zeros(1, dtype=torch.long, device=dev)
        self.drafts = torch.zeros(max(self.k or 0, CHAIN_WARM_ROWS), dtype=torch.long, device=dev)
        self.logits = torch.zeros(1, d.ec.draft_vocab_size, dtype=torch.float32, device=dev)
        self.graph_cls = graph_cls
        self.graphs: dict = {}
        self.sink = None  # the tap sink the graphs read (its buffers are baked in)
        self.pool = self._new_pool()

    def _new_pool(self):
        return torch.cuda.graph_pool_handle() if self.graph_cls is _CudaGraph else None

    def reset(self) -> None:
        self.graphs.clear()
        self.sink = None
        self.pool = self._new_pool()  # a fresh pool: reusing the handle of destroyed graphs trips the allocator

    def keys(self) -> list[tuple]:
        """Every graph a run of up to k drafts replays (the module docstring), at this capacity."""
        k, cap = self.k, self.d.capacity
        first = [("first", rows) for rows in range(1, min(k + 1, self.max_rows, cap) + 1)]
        return first + ([("chain",)] if k >= 2 and cap >= CHAIN_WARM_ROWS else [])

    def replays(self, N: int, lo: int, k: int) -> bool:
        """Whether a round of k drafts after a context of N tokens, its first forward from row
        lo, replays graphs captured at allocation (over the current tap sink)."""
        return (lo >= 0 and ("first", N - 1 - lo) in self.graphs and (k < 2 or ("chain",) in self.graphs)
                and k <= self.drafts.shape[0] and self.sink is self.d._taps())

    # ---- the graphs' bodies ----
    def _pick(self, h: torch.Tensor) -> torch.Tensor:
        """The step's logits and greedy draft into the static outputs; returns the draft (1,)."""
        net = self.d.net
        lg = net.logits(h)  # (1, Vd) fp32
        t = net.hot.index_select(0, lg.argmax(-1))  # (1,) target id (d2t)
        self.logits.copy_(lg)
        self.hid.copy_(h)
        self.tok.copy_(t)
        return t

    def _first(self, rows: int, taps):
        d = self.d
        pos = self.base[:rows] + self.row.start  # (rows,) lo .. lo + rows - 1, on the device
        h = d._rows(self.row.ids[:rows], d.net.features(taps.gather(pos)), pos)[-1:]
        t = self._pick(h)
        self.drafts[:1].copy_(t)
        self.sidx.fill_(1)
        self.pos.copy_(pos[-1:] + 1)  # the first chain row
        return self.drafts

    def _chain(self):
        h = self.d._rows(self.tok, self.hid, self.pos)  # reads tok, hid, pos before the updates below
        t = self._pick(h)
        self.drafts.index_copy_(0, self.sidx, t)
        self.sidx.add_(1)
        self.pos.add_(1)
        return self.drafts

    # ---- capture and replay ----
    def _capture(self, key: tuple, taps) -> None:
        if key[0] == "first":
            self.graphs[key] = self.graph_cls(lambda: self._first(key[1], taps), self.pool)
        else:
            self.graphs[key] = self.graph_cls(self._chain, self.pool)

    @torch.inference_mode()
    def warm(self) -> None:
        """Capture every graph of the run now (at allocation; nothing without the run's K or a
        tap sink), then leave the K/V as a fresh allocation has it (zeros). The first graphs'
        warm-ups write rows 0 .. rows - 1 at start 0 (the same values each time), the chain's
        rows 0 .. from position 0 (module docstring)."""
        d = self.d
        taps = d.target.cache.taps if d.target.cache is not None else None
        if self.k is None or taps is None:
            return
        taps = d._taps()
        if self.sink is not None and self.sink is not taps:
            self.reset()
        self.sink = taps
        self.row.load((), 0)  # ids: whatever the row holds (zeros at first); start 0
        with hold_collector():  # one collection for every capture (graphs.hold_collector)
            for key in self.keys():
                if key in self.graphs:
                    continue
                self.pos.zero_()
                self.sidx.zero_()
                self._capture(key, taps)
        for t in (d.state.k, d.state.v):
            t.zero_()

    @torch.inference_mode()
    def first(self, context: list[int], lo: int) -> None:
        """The round's first forward over rows [lo, N - 1) (tokens context[lo + 1:]), replayed:
        draft 1 in drafts[0] and `tok`, its logits in `logits`, the chain's inputs set."""
        ids = context[lo + 1:]
        self.row.load(ids, lo)
        self.graphs[("first", len(ids))].replay()

    @torch.inference_mode()
    def chain(self) -> None:
        """One chained step, replayed: fed `tok` and `hid` at `pos`; the next draft in drafts[sidx]."""
        self.graphs[("chain",)].replay()

    def greedy(self, context: list[int], lo: int, k: int) -> torch.Tensor:
        """The round's k greedy drafts: (k,) target ids, a view of the static `drafts` (read it
        before the next round's replays)."""
        self.first(context, lo)
        for _ in range(k - 1):
            self.chain()
        return self.drafts[:k]

    @torch.inference_mode()
    def step_logits(self, context: list[int], lo: int, k: int, pick) -> list[torch.Tensor]:
        """eagle3.py `step_logits` through the graphs: each step's logits (copies of the static
        output), `pick`'s draft fed to the next chain step."""
        self.first(context, lo)
        out = []
        for s in range(k):
            out.append(self.logits.clone())
            tok = pick(s, out[-1])
            if s + 1 < k:
                self.tok.copy_(tok)  # the picked draft (the graph left its greedy one), in stream order
                self.chain()
        return out


def eagle3_graphs(drafter) -> Eagle3Graphs | None:
    """The drafter's round graphs when its target captures its steps (CUDA, graphs on) and warms
    its run's rows (the run's K known at allocation), else None."""
    if getattr(drafter.target, "graphs", None) is None or drafter.device.type != "cuda":
        return None
    if run_k(drafter.target) is None:
        return None
    return Eagle3Graphs(drafter)
