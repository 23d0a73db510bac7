"""CUDA graphs of the step leader's shared DFlash block forward over the draft pool
(dflash_batch.py `propose_many`, draft_pool.py), one per bucket of requests.

Eager, a shared block forward of 16 requests launched ~300 kernels (five layers of norms,
projections, the pooled attention, the lm_head): on an H200 its host time, not the device's,
set the step leader's draft phase (15 ms a step against ~2 ms of device work, 8B shape). Here
the forward of b requests (b a bucket: 1, 2, 4, ... up to the engine's --max-batch) is one
replay. Its inputs are small integer rows loaded in ONE pinned host-to-device copy (host_row.py):
each request's block ids [last, mask x (B - 1)], its block's positions, the pool slot of each
row, each request's slot and its mask limit (start + B). A bucket's rows past the real requests
are pads: mask ids at positions 0 .. B - 1 in the pool's spare slot (`DraftPool.scratch`), whose
outputs nobody reads. The attention reads each request's whole slot (every row of it, static)
under its limit, so no length of a round is baked in. The graph leaves the argmax of rows
1 .. K of every block (K = the engine's k, at most B - 1): one readback gives every request's
greedy drafts. Past the last layer's K/V only those rows run (its attention, o_proj and FFN:
`DFlashNet.block` `keep`), since nothing reads the others' outputs. Where `--compile` compiles the
dflash path, the captures run the network's compiled pieces (dflash_compile.py, compiled once
for every bucket's row counts): eager, the norms, q / k norms and rotary were ~300 small kernels
a forward, and a bucket of 2 took 2.39 ms on an H100 against the solo drafter's ~1.1 ms block.
A sampled request's rows take the same replay: the graph leaves every kept row's logits
too (held by its memory pool anyway), and its drafts are drawn from its own rows with its own
generator after the replay, as alone. Steps of more requests than the largest bucket stay eager.

The maintenance (dflash_batch.py `ingest_many`: each request's newly verified rows, a + 1 <=
K + 1 of them) is graphed the same way (`PoolIngestGraphs`) where the requests' tap sinks are
slots of the batcher's tap pool (model/tap_pool.py): each request's rows padded to K + 1, the
pads reading the tap pool's spare slot and writing the draft pool's, the tap gather, the
feature GEMM, each layer's k / v projections and the K/V writes in one replay. A request back
from K-0 rounds (--spec-k auto skips a K-0 round's maintenance) catches up on the rows it skipped
as several entries of K + 1 rows, so a step's catch-ups replay too (up to CATCHUP_REPLAYS
replays) instead of an eager ingest on the loop's path (on an H100 at 64 requests, eager
catch-ups held the device idle for ~80 ms of a 1.8 s run).

Built by the batched backend where its steps replay graphs (CUDA, graphs on). On our kernels (the
target's fast path) the attention is the paged kernel over each request's live rows
(`paged_pool_attention`), whatever the capacity; otherwise it reads each slot whole, so the graphs
are built only where each pool slot is short enough that this pays (`pays`). Tests replay an
emulated capture on the CPU.
"""

from __future__ import annotations

import numpy as np
import torch

from ...graphs import CapturedGraph
from .dflash_compile import compiled_pieces, warn_fallback
from .draft_pool import paged_pool_attention, pooled_attention
from .host_row import HostRow

__all__ = ["PoolBlockGraphs", "PoolIngestGraphs", "DeviceDrafts", "pays", "buckets", "accepted_on_device"]

CATCHUP_REPLAYS = 4  # ingest replays a step's maintenance may take (PoolIngestGraphs.segments)
MAX_GATHER_ROWS = 1 << 17  # slot rows x requests a layer's attention may gather whole (~0.5 GB at 8 x 128 bf16)


def pays(rows: int, max_n: int) -> bool:
    """The graphs' whole-slot gather stays cheap against the launches it saves."""
    return rows * max_n <= MAX_GATHER_ROWS


def buckets(max_n: int) -> list[int]:
    """1, 2, 4, ... below max_n, then max_n. Bucket 1 is a request alone on the loop (an
    engine of one request at a time has only it): padded to 2, its round paid a pad request's
    rows (on an H100, 8B: +0.3 ms a DFlash round)."""
    out, b = [], 1
    while b < max_n:
        out.append(b)
        b *= 2
    return out + [max_n]


class _BucketGraphs:
    """One graph per bucket of requests (`_body(b)`), its inputs loaded by `_load(reqs, b)`
    (one tuple a request; none: every request a pad)."""

    def __init__(self, max_n: int, graph_cls):
        self.buckets = buckets(max_n)
        self.max_n = self.buckets[-1] if self.buckets else 0
        self.graph_cls = graph_cls
        self.graphs: dict[int, object] = {}
        self.replays = 0
        self.mem = torch.cuda.graph_pool_handle() if graph_cls is CapturedGraph else None

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def warm(self) -> int:
        """Every bucket captured now (the pools allocated), none inside a round; returns the count."""
        for b in self.buckets:
            self._load([], b)
            self._graph(b)
        return len(self.graphs)

    def timed(self, device) -> dict[int, float]:
        """Each bucket's replay timed (ns, the best of a few; every request a pad): what a
        shared draft forward of that many requests costs (--spec-k auto's first fit, calibrate.py)."""
        from ...batching.calibrate import best_ns  # noqa: PLC0415

        out = {}
        for b in self.buckets:
            self._load([], b)
            out[b] = best_ns(self._graph(b).replay, device)
        return out

    def _graph(self, b: int):
        g = self.graphs.get(b)
        if g is None:
            g = self.graphs[b] = self._capture(lambda: self._body(b))
        return g

    compiled = False  # the network's compiled pieces swapped in while capturing (dflash_compile.py)

    def _capture(self, fn, graph_cls=None):
        """A bucket's graph, with the compiled pieces where on; a compile failure (raised at the
        capture's eager warm-up, before the capture starts) turns them off, one warning line.
        `graph_cls`: another capture than the set's (a lazy one while serving: thread-local mode)."""
        cls = graph_cls or self.graph_cls
        if self.compiled:
            try:
                with compiled_pieces(self.net, dynamic=True):
                    return cls(fn, self.mem)
            except Exception as e:  # noqa: BLE001 (inductor / Triton errors of any kind)
                self.compiled = False
                warn_fallback(e)
        return cls(fn, self.mem)

    def _body(self, b: int):
        raise NotImplementedError

    def _load(self, reqs: list, b: int) -> None:
        raise NotImplementedError


class PoolBlockGraphs(_BucketGraphs):
    def __init__(self, net, stage, pool, B: int, K: int, mask_id: int, max_n: int, graph_cls=CapturedGraph,
                 paged: bool = False, compiled: bool = False):
        """`K` drafts a block (rows 1 .. K), `max_n` requests at most (the engine's --max-batch);
        `paged`: the attention on our paged kernel (draft_pool.py `paged_pool_attention`: each
        request's live rows only), where the target runs our kernels; `compiled`: the network's
        norms, q / k / v and FFN pieces compiled inside the captures (where `--compile` compiles
        the dflash path, as the solo drafter's block graphs do)."""
        super().__init__(max_n, graph_cls)
        self.paged, self.compiled = paged, compiled
        self.net, self.stage, self.pool = net, stage, pool
        self.B, self.K, self.mask_id = B, min(K, B - 1), mask_id
        self.fold_rows = 0  # a bucket of at most this many block rows runs folded (`DFlashNet.block`)
        if paged and hasattr(net.layers[0].self_attn, "qkv_w") and hasattr(net.layers[0].mlp, "gate_up_proj"):
            from ...kernels.ops import BATCH_FOLD_ROWS  # noqa: PLC0415 (Triton: only where installed)

            self.fold_rows = BATCH_FOLD_ROWS
        # [ids (n B), pos (n B), each row's slot (n B), each request's slot (n), its limit (n)]
        self.row = HostRow(3 * self.max_n * B + 2 * self.max_n, pool.device)
        # `greedy_after`'s verify layout: [each request's pred row, its ids row, its drafts, its lo] (n each)
        self.after = HostRow(4 * self.max_n, pool.device)
        self._block = torch.arange(B, device=pool.device)

    def _views(self, b: int):
        n, B, d = self.max_n, self.B, self.row.ids
        return (d[:b * B], d[n * B:n * B + b * B], d[2 * n * B:2 * n * B + b * B],
                d[3 * n * B:3 * n * B + b], d[3 * n * B + n:3 * n * B + n + b])

    def _body(self, b: int):
        ids, pos, row_slot, idx, lim = self._views(b)
        net, pool, B, K = self.net, self.pool, self.B, self.K
        at = (row_slot, pos)

        def kv_of(li, kb, vb):
            pool.k[li].index_put_(at, kb)
            pool.v[li].index_put_(at, vb)
            return pool.k[li], pool.v[li]

        def attend(q, kp, vp):  # a request's B block rows, or in the last layer its K drafted ones
            R = q.shape[0] // b
            fn = paged_pool_attention if self.paged else pooled_attention
            return fn(q.view(b, R, *q.shape[1:]), kp, vp, idx, lim[:, None].expand(b, R), pool.rows).view(b * R, -1)

        # rows 1 .. K of each block only, past the last layer's K/V (DFlashNet.block `keep`); a few requests'
        # blocks folded, as the solo drafter's graphs run them (the norms and residual adds inside our row GEMMs,
        # the net's final norm inside the lm_head's: a lone request's block ran on cuBLAS at +0.3 ms a round)
        folded = b * B <= self.fold_rows
        h = net.block(self.stage.embed_tokens(ids), pos, kv_of, None, attend=attend, folded=folded,
                      keep=(B, 1, K + 1))  # (b K, H)
        # the logits at the model's dtype are an output too (a sampled request's rows: `greedy(logits=True)`),
        # so every bucket keeps b K V of them alive in the pool: ~130 MB in all at --max-batch 64, 128k vocab, bf16
        if folded:
            st = self.stage
            logits = torch.ops.memra.gemv(h, st.lm_head.weight, st.lm_head.bias, False, net.norm.weight, net.norm.eps,
                                          None)
        else:
            logits = self.stage.lm_head(h)  # (b K, V)
        return logits.float().argmax(-1).view(b, K), logits.view(b, K, -1)

    def _load(self, reqs: list[tuple[int, int, int]], b: int) -> None:
        """`reqs`: (slot, start, last token) a request; the bucket's rows past them pads. Filled
        by array ops in the pinned row (64 requests' 16-row blocks: ~3k entries a round, which
        Python lists built on the loop's path between two steps)."""
        n, B, r = self.max_n, self.B, len(reqs)
        slots, starts, lasts = (np.array(x, dtype=np.int64) for x in zip(*reqs)) if reqs else (np.zeros(0, np.int64),) * 3
        a = self.row.writable()
        ids, pos, row_slot = (a[i * n * B:(i + 1) * n * B].reshape(n, B)[:b] for i in range(3))
        idx, lim = a[3 * n * B:3 * n * B + b], a[3 * n * B + n:3 * n * B + n + b]
        block = np.arange(B)
        ids[:] = self.mask_id
        ids[:r, 0] = lasts
        pos[:r] = np.add.outer(starts, block)
        pos[r:] = block
        row_slot[:r] = slots[:, None]
        row_slot[r:] = idx[r:] = self.pool.scratch
        idx[:r] = slots
        lim[:r] = starts + B
        lim[r:] = B
        self.row.send()

    def greedy(self, slots: list[int], starts: list[int], lasts: list[int], defer: bool = False,
               logits: bool = False):
        """Each request's K greedy drafts (host lists): its block [lasts[r], mask ...] at
        starts[r] over its slot slots[r], in one replay and one readback. `defer`: no readback
        now; the drafts stay on the device (`DeviceDrafts`), their copy to the host enqueued.
        `logits`: (drafts, each request's K rows' logits (n, K, V), the model's dtype): a sampled
        request's rows to draw from (the graph's static output: read before the bucket's next replay)."""
        n = len(slots)
        b = self.bucket(n)
        self._load(list(zip(slots, starts, lasts)), b)
        g = self._graph(b)
        g.replay()
        self.replays += 1
        ids = DeviceDrafts(g.out[0][:n]) if defer else g.out[0][:n].tolist()
        return (ids, g.out[1][:n]) if logits else ids


    def greedy_after(self, slots: list[int], verify: list[tuple[int, int, int, int]], pred: torch.Tensor,
                     ids: torch.Tensor) -> "DeviceDrafts":
        """Each request's K greedy drafts for the round after its verify, launched before that
        verify is read back: `verify[r]` = (lo, its first row in `pred`, its first row in `ids`,
        its drafts k) of request r's rows in the step just launched (`pred`: the step's argmax
        rows, `ids`: its input ids, both on the device). Its acceptance is found on the device
        (`accepted_on_device`, the greedy rule the loop applies after the readback), so its
        block is [the bonus token, mask ...] at lo + 1 + accepted, as `greedy` would be asked
        after the accept (its context rows: the verify's, ingested behind it by the ingest
        graphs: dflash_batch.py pre_ingest_many). The drafts stay on the device."""
        n, B = len(slots), self.B
        b = self.bucket(n)
        los = [v[0] for v in verify]
        self._load(list(zip(slots, los, [self.mask_id] * n)), b)  # the start and the first id: rewritten below
        a = self.after.writable()
        m = self.max_n
        for i, col in enumerate(zip(*verify)):
            a[i * m:i * m + n] = col
        self.after.send()
        lo, prow, irow, ks = (self.after.ids[i * m:i * m + n] for i in (0, 1, 2, 3))
        kmax = max(v[3] for v in verify)
        acc, bonus = accepted_on_device(pred, ids, prow, irow, ks, kmax)
        start = lo + 1 + acc
        vid, vpos, _, _, vlim = self._views(b)
        vid.view(b, B)[:n, 0] = bonus
        vpos.view(b, B)[:n] = start[:, None] + self._block
        vlim[:n] = start + B
        g = self._graph(b)
        g.replay()
        self.replays += 1
        return DeviceDrafts(g.out[0][:n], acc, bonus)


def accepted_on_device(pred: torch.Tensor, ids: torch.Tensor, prow: torch.Tensor, irow: torch.Tensor,
                       ks: torch.Tensor, kmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of n verify rounds on the device: round r's target argmax rows are
    pred[prow[r] .. + ks[r]], its drafts ids[irow[r] + 1 .. + ks[r]] -> (the drafts accepted:
    the longest prefix equal to the argmax, the bonus: the argmax row after them), as
    accept.py / chain.py accept them on the host.

    >>> pred = torch.tensor([7, 8, 9, 4, 5, 6])   # two rounds: rows 0-2 and 3-5
    >>> ids = torch.tensor([1, 7, 3, 2, 4, 5])    # round 0 drafts [7, 3]; round 1 drafts [4, 5]
    >>> acc, bonus = accepted_on_device(pred, ids, torch.tensor([0, 3]), torch.tensor([0, 3]), torch.tensor([2, 2]), 2)
    >>> acc.tolist(), bonus.tolist()
    ([1, 2], [8, 6])
    """
    ar = torch.arange(kmax + 1, device=pred.device)
    p = pred[(prow[:, None] + ar).clamp(max=pred.shape[0] - 1)]  # (n, kmax + 1)
    d = ids[(irow[:, None] + 1 + ar[:kmax]).clamp(max=ids.shape[0] - 1)]  # (n, kmax)
    ok = (p[:, :kmax] == d) & (ar[:kmax] < ks[:, None])
    acc = ok.long().cumprod(1).sum(1)
    return acc, p.gather(1, acc[:, None]).squeeze(1)


class DeviceDrafts:
    """A shared draft forward's greedy drafts left on the device: `ids` (n, K), a copy of the
    graph's static output made behind the replay (the next replay of that bucket, a new
    request's first proposal before the step, rewrites the output), and its copy to pinned host
    memory enqueued behind it with an event, so `rows()` waits for the draft alone. The engine
    loop queues the next verify with these drafts still on the device and launches it while the
    draft runs (batching/step_forward.py `DraftPatch`); the rounds read them at their accept."""

    def __init__(self, out: torch.Tensor, acc: torch.Tensor | None = None, bonus: torch.Tensor | None = None):
        """`acc`, `bonus` (n,): where the drafts were made before their verify's readback
        (`greedy_after`), the acceptance the device found for each request's verify and its
        bonus token, the input of the round the drafts are for (a verify launched ahead:
        batching/verify_ahead.py); `acc` comes back to the host with the drafts."""
        self.ids = out.clone()  # (n, K) int64, stream-ordered behind the replay
        if acc is not None:
            self.ids = torch.cat((self.ids, acc[:, None]), 1)  # (one copy back: the drafts and the acceptance)
        self.acc, self.bonus = acc, bonus
        self.k = int(out.shape[1])
        self._rows: list[list[int]] | None = None
        self.event = None
        if self.ids.device.type == "cuda":
            self.host = torch.empty(self.ids.shape, dtype=self.ids.dtype, pin_memory=True)
            self.host.copy_(self.ids, non_blocking=True)
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.host = self.ids

    def ns_since(self, mark) -> float | None:
        """Device ns from event `mark` (device_mark) to these drafts on the host side of their
        copy; None where either is not a CUDA event. Waits for them."""
        if mark is None or self.event is None:
            return None
        self.event.synchronize()
        return mark.elapsed_time(self.event) * 1e6

    def rows(self) -> list[list[int]]:
        """Every request's drafts as host lists (waits for the draft's copy, once); with `acc`,
        each row's last entry is its acceptance (`accepted`)."""
        if self._rows is None:
            if self.event is not None:
                self.event.synchronize()
            self._rows = self.host.tolist()
        return self._rows

    def accepted(self, row: int) -> int | None:
        """The acceptance the device found for request `row`'s verify (None: not made after one)."""
        return self.rows()[row][self.k] if self.acc is not None else None


class PoolIngestGraphs(_BucketGraphs):
    def __init__(self, net, pool, taps, R: int, max_n: int, graph_cls=CapturedGraph):
        """`taps`: the batcher's TapPool (allocated); `R` rows a request at most (K + 1)."""
        super().__init__(max_n, graph_cls)
        self.net, self.pool, self.taps, self.R = net, pool, taps, R
        self.row = HostRow(3 * self.max_n * R, pool.device)  # [tap slot, draft slot, position] of every row

    def _views(self, b: int):
        N, d = self.max_n * self.R, self.row.ids
        m = b * self.R
        return d[:m], d[N:N + m], d[2 * N:2 * N + m]

    def _body(self, b: int):
        tap_slot, slot, pos = self._views(b)
        C = self.net.features(self.taps.gather(tap_slot, pos, self.taps.layers))
        for li, (k, v) in enumerate(self.net.context_kv(C, pos)):
            self.pool.k[li].index_put_((slot, pos), k)
            self.pool.v[li].index_put_((slot, pos), v)
        return C

    def segments(self, sinks, slots: list[int], ranges: list[tuple[int, int]]) -> list[tuple] | None:
        """These requests' rows as the replays' entries, (tap slot, draft slot, (lo, hi)) of at
        most R rows each: a request back from K-0 rounds (--spec-k auto), whose drafter skipped
        their maintenance, brings more than R and takes an entry for every R of them (a row's
        K/V depends on its own taps alone). None where the rows would take more than
        CATCHUP_REPLAYS replays (a prime: its long chunks run eager, as one GEMM each) or a
        sink is not a slot of this tap pool."""
        if not all(getattr(s, "pool", None) is self.taps for s in sinks):
            return None
        R = self.R
        segs = [(s.pool_slot, d, (a, min(a + R, hi))) for s, d, (lo, hi) in zip(sinks, slots, ranges)
                for a in range(lo, hi, R)]
        return segs if len(segs) <= CATCHUP_REPLAYS * self.max_n else None

    def _load(self, reqs: list, b: int) -> None:
        """`reqs`: (tap slot, draft slot, (lo, hi)) an entry, hi - lo <= R; each entry's rows
        past hi and the bucket's entries past them pads (array ops in the pinned row)."""
        R, N, m = self.R, self.max_n * self.R, len(reqs)
        a = self.row.writable()
        ts, ds, ps = (a[i * N:i * N + b * R].reshape(b, R) for i in range(3))
        ts[m:], ds[m:], ps[m:] = self.taps.scratch, self.pool.scratch, 0
        if m:
            t, d, lo, hi = np.array([(e[0], e[1], *e[2]) for e in reqs], dtype=np.int64).T
            rows = np.add.outer(lo, np.arange(R))
            live = rows < hi[:, None]
            ts[:m] = np.where(live, t[:, None], self.taps.scratch)
            ds[:m] = np.where(live, d[:, None], self.pool.scratch)
            ps[:m] = np.where(live, rows, 0)
        self.row.send()

    def ingest(self, segs: list[tuple]) -> None:
        """Every entry's rows from its tap slot into its draft slot (`segments`), max_n entries
        a replay."""
        for i in range(0, len(segs), self.max_n):
            part = segs[i:i + self.max_n]
            b = self.bucket(len(part))
            self._load(part, b)
            self._graph(b).replay()
            self.replays += 1
