"""CUDA graphs of the DFlash drafter's per-round work: the block forward (dflash.py
`block_logits`) and the maintenance ingest (dflash.py `_ingest` over the a + 1 verified rows);
one graph per row count each, captured on first use, replayed every round after.

Static shapes: the block is always B rows, [last, mask x (B - 1)]: the last committed token and
the block's start come in one pinned host-to-device copy a round (host_row.py), and the graph
leaves each row's argmax beside the logits (a greedy round launches nothing after the replay). Everything that
depends on the start is derived from that scalar ON the device (positions = block_base +
start, the mask `slot < start + B` over the drafter's whole K/V rows, the rotary rows), so no
Python value of a round is baked into the graph. The block's K/V is written at its positions
and dropped, as the eager forward does (the next ingest overwrites it); the logits land in the
graph's static output, which the caller consumes before the next replay.

The ingest of rows [n, n + rows) (rows 1 .. B: a round commits at most B - 1 drafts and the
pending token) is captured the same way: its start comes in a pinned row of its own, its positions
`ingest_base[:rows] + start` are derived on the device, and the taps are read from the
target's tap sink at those positions (`index_select`: static shapes) instead of by a Python
slice; the feature GEMM, each layer's k/v projections and the cache writes follow, as in the
eager `_ingest`. The graph bakes in the sink's buffers: a new sink (the target reallocated
its cache) drops every graph. The prime's long ingest (and its profiled laps) stays eager.

Where the target runs our Triton kernels, the block's attention is the split-sequence kernel
(kernels/decode_attention.py) with every row at the block's last position: the DFlash mask
(context and the whole block) over the live rows only, where the reference reads the whole
allocation under a boolean mask (three GEMM / softmax kernels and a mask fill per layer).

Behind the runner's graph switch: built only when the target runner captures its own steps
(`target.graphs`, CUDA with graphs on); the eager forward stays the reference (CPU, tests:
tests/test_dflash_graph_emulated.py replays an emulated capture and compares exactly).
"""

from __future__ import annotations

import torch

from ...graphs import CapturedGraph as _CudaGraph  # the drafters' graph sets capture through it
from ...graphs import hold_collector
from .dflash_compile import compiled_pieces, target_compiles, warn_fallback
from .host_row import HostRow

__all__ = ["BlockGraphs", "block_graphs", "kernel_attention"]


class BlockGraphs:
    def __init__(self, drafter, graph_cls=_CudaGraph):
        """`graph_cls(fn, pool)` captures fn and exposes `.out` and `.replay()` (tests pass an
        emulated one)."""
        self.d = drafter
        # [the block's B ids, its start]: the mask ids written once here, then each round's load
        # rewrites row 0 (the last committed token) and the start, one copy
        self.row = HostRow(drafter.B, drafter.device)
        self.row.load([drafter.dc.mask_token_id] * drafter.B, 0)
        self.ingest_row = HostRow(0, drafter.device)  # the ingest's first row, as the block's start comes
        self.ingest_base = torch.arange(drafter.B, device=drafter.device)
        self.graph_cls = graph_cls
        # the network's compiled pieces inside the captures, as the target's compiled blocks (dflash_compile.py)
        self.compiled = graph_cls is _CudaGraph and target_compiles(drafter.target)
        self.kernel_attn = kernel_attention(drafter)
        self.folded = self.kernel_attn and folds(drafter)  # the block's norms / residuals inside our GEMMs
        self.graphs: dict = {}  # block rows -> graph
        self.ingests: dict = {}  # ingest rows -> graph
        self.sink = None  # the tap sink the ingest graphs read (its buffers are baked in)
        self.pool = self._new_pool()

    def _new_pool(self):
        return torch.cuda.graph_pool_handle() if self.graph_cls is _CudaGraph else None

    def reset(self) -> None:
        """Drop every graph (a fresh pool: reusing the handle of destroyed graphs trips the allocator)."""
        self.graphs.clear()
        self.ingests.clear()
        self.sink = None
        self.pool = self._new_pool()

    def _body(self, rows: int):
        d = self.d
        start, ids = self.row.start, self.row.ids  # ids (B,): [last, mask x (B - 1)]
        pos = d.block_base + start  # (B,) start .. start + B - 1, on the device
        mask = (d.slots < start + d.B)[None, :]  # every context row and the whole block
        st = d.states

        def kv_of(i, kb, vb):
            st[i].k.index_copy_(0, pos, kb)  # the block's K/V, dropped: the next ingest overwrites it
            st[i].v.index_copy_(0, pos, vb)
            return st[i].k, st[i].v

        stage = d.target.stage
        h = d.net.block(stage.embed_tokens(ids), pos, kv_of, mask, self._attend(pos), self.folded)  # (B, H)
        if self.folded:  # the net's final norm inside the target's lm_head kernel (Stage.fused_head)
            logits = stage.logits(h[1:1 + rows], d.net.norm)
        else:
            logits = stage.lm_head(h[1:1 + rows]).float()
        return logits, logits.argmax(-1)  # the greedy drafts too: no argmax launch after the replay

    def _attend(self, pos: torch.Tensor):
        """The split-sequence kernel for the block's attention where the target runs our kernels:
        every block row reads slots 0 .. start + B - 1, the same mask as `slot < start + B`,
        as if each row sat at the block's last position; it reads only those live rows, not
        the whole allocation. None (the reference attention) elsewhere."""
        if not self.kernel_attn:
            return None
        last = pos * 0 + pos[-1]  # (B,) start + B - 1 for every row, derived on the device
        return lambda q, K, V: torch.ops.memra.decode_attention(q, K, V, last)

    @torch.inference_mode()
    def _replay(self, last: int, start: int, rows: int):
        self.row.load([last], start)
        g = self.graphs.get(rows)
        if g is None:
            g = self.graphs[rows] = self._capture(lambda: self._body(rows))
        g.replay()
        return g.out

    def logits(self, last: int, start: int, rows: int) -> torch.Tensor:
        """block_logits(last, start, rows), replayed: the static output (rows, V) fp32."""
        return self._replay(last, start, rows)[0]

    def greedy(self, last: int, start: int, rows: int) -> torch.Tensor:
        """The same replay's argmax of each row: (rows,) device ids, a static output."""
        return self._replay(last, start, rows)[1]

    def _capture(self, fn):
        """A block graph, captured with the compiled pieces swapped in (when on: one B-row
        shape, compiled once for all of them; the ingests' 1..B row counts stay eager, each would
        be a compile of its own); a compile failure (raised at the capture's eager warm-up,
        before the capture starts) turns them off."""
        if self.compiled:
            try:
                with compiled_pieces(self.d.net):
                    return self.graph_cls(fn, self.pool)
            except Exception as e:  # noqa: BLE001 (inductor / Triton errors of any kind)
                self.compiled = False
                warn_fallback(e)
        return self.graph_cls(fn, self.pool)

    # ---- the maintenance ingest ----
    def ingests_rows(self, rows: int) -> bool:
        """Whether an ingest of `rows` rows replays a graph (a round's: 1 .. B rows)."""
        return 1 <= rows <= self.d.B

    def _ingest_body(self, rows: int, taps) -> None:
        d = self.d
        pos = self.ingest_base[:rows] + self.ingest_row.start  # (rows,) n .. n + rows - 1, on the device
        C = d.net.features(taps.gather(pos))  # (rows, H): the taps at those positions, in tap order
        for st, (k, v) in zip(d.states, d.net.context_kv(C, pos)):
            st.k.index_copy_(0, pos, k)
            st.v.index_copy_(0, pos, v)

    @torch.inference_mode()
    def ingest(self, n: int, upto: int) -> None:
        """_ingest's rows [n, upto), replayed (the caller advances d.n)."""
        rows = upto - n
        taps = self.d._taps()
        if taps is not self.sink:  # a new sink (the target reallocated): graphs over the old buffers would read stale rows
            if self.sink is not None:
                self.reset()
            self.sink = taps
        self.ingest_row.load((), n)
        g = self.ingests.get(rows)
        if g is None:  # the warm-ups run at [n, upto): they write exactly what the replay will
            g = self.ingests[rows] = self.graph_cls(lambda: self._ingest_body(rows, taps), self.pool)
        g.replay()


    def warm(self) -> None:
        """Capture every round's graphs now (at allocation, rows 0 .. B-1 of a fresh state):
        the ingests of 1 .. B rows and the blocks of 1 .. B-1 drafts, so no capture lands in a
        round. What the warm-ups write there is rewritten before it is read: the prime ingests
        rows 0 .. P-1, and a block only reads rows below its start (ingested) and its own.
        One collection for all of them (graphs.hold_collector)."""
        with hold_collector():
            for rows in range(1, self.d.B + 1):
                self.ingest(0, rows)
            for rows in range(1, self.d.B):
                self.logits(0, 0, rows)


def kernel_attention(drafter) -> bool:
    """Whether the block graphs read the drafter's K/V with our split kernel: the target runs
    our Triton kernels (CUDA, `--kernels`) and the head size suits them (kernels/ops.py)."""
    hd = drafter.dc.base.head_dim
    if not getattr(drafter.target, "kernel_modules", 0) or hd < 16 or hd & (hd - 1):
        return False
    from ...kernels import ops  # noqa: F401, PLC0415 (registers torch.ops.memra.decode_attention)

    return True


def folds(drafter) -> bool:
    """Whether the block forward can run folded (DFlashNet.block): the net fused (q/k/v and
    gate/up) and a block within the row GEMM's rows (kernels/gemm_rows.py)."""
    from ...kernels.ops import MAX_ROWS  # noqa: PLC0415 (Triton, and it registers torch.ops.memra.*)

    layer = drafter.net.layers[0]
    return drafter.B <= MAX_ROWS and hasattr(layer.self_attn, "qkv_w") and hasattr(layer.mlp, "gate_up_proj")


def block_graphs(drafter) -> BlockGraphs | None:
    """The drafter's block graphs when its target captures its steps (CUDA, graphs on), else None."""
    if getattr(drafter.target, "graphs", None) is None or drafter.device.type != "cuda":
        return None
    return BlockGraphs(drafter)
