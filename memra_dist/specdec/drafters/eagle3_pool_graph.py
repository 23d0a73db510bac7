"""CUDA graphs of the step leader's batched EAGLE-3 chains over the draft and tap pools
(eagle3_batch.py `propose_many`, draft_pool.py, model/tap_pool.py), one per bucket of requests.

Eager, a round of 16 requests' chains is the first forward (every request's newly committed
rows) and K - 1 chained steps, each ~40 launches of the head plus its logits and pick: on an
H200 the step leader spent ~19 ms of host time a step drafting them (BENCHMARKS.md). Here the
whole round of b requests is one replay. Its inputs come in one pinned copy (host_row.py): each
request's committed rows padded to K + 1 (their tokens, their positions, which are also the tap
rows the features read, their pool slots and causal limits; pads read the tap pool's spare slot
and write the draft pool's), the index of each request's last committed row, its slot and its
first chain position. The graph runs the first forward, then K chain steps of one row a request
(the argmax mapped to target ids through d2t, fed back as the next row's token, the row's
pre-norm output as its hidden), and leaves the (b, K) picks: one readback gives every request's
greedy drafts. A round with sampled requests replays the bucket's sampled graph (captured at
the first such round): each chain step also draws every sampled row's draft on the device from
its own tempered, filtered distribution at a uniform its generator gave before the replay (as
its solo proposal draws one a step), and leaves the distributions for the acceptance. Used where
every request asks for at most K drafts, has at most K + 1 new rows, and its chain stays inside
its cache; else the eager chains.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from ...graphs import CapturedGraph
from ..sampling import draw_rows, non_finite_drafts, probs_rows, uniforms
from .dflash_pool_graph import _BucketGraphs
from .draft_pool import paged_pool_attention, pooled_attention
from .host_row import HostRow
from ...device import to_device

__all__ = ["PoolChainGraphs"]


class LazyGraph(CapturedGraph):
    """A graph captured while serving (a bucket's sampled graph, at its first round): other
    threads may call CUDA meanwhile, so the capture checks this thread's calls only."""

    mode = "thread_local"


class PoolChainGraphs(_BucketGraphs):
    def __init__(self, net, embed, pool, taps, K: int, max_n: int, graph_cls=CapturedGraph, paged: bool = False):
        """`paged`: the attention on our paged kernel (draft_pool.py `paged_pool_attention`)."""
        super().__init__(max_n, graph_cls)
        self.paged = paged
        self.net, self.embed, self.pool, self.taps, self.K = net, embed, pool, taps, K
        self.fold_rows = 0  # a step of at most this many rows runs folded (`Eagle3Net.step_folded`)
        if paged and getattr(net, "folded", False):  # installed (kernels/ops.py install_eagle3), as the solo drafter's steps
            from ...kernels.ops import BATCH_FOLD_ROWS  # noqa: PLC0415 (Triton: only where installed)

            self.fold_rows = BATCH_FOLD_ROWS
        self.R = K + 1
        n = self.max_n
        # [tokens, positions, tap slots, draft slots, limits] (n R each), then [last row, slot, chain position] (n each),
        # then a sampled round's (fp64 bits): [temperature, top-k, top-p, drafts] (n each), uniforms (n K)
        self.row = HostRow(5 * n * self.R + 7 * n + n * K, pool.device)
        self._sampled_ok = True
        self.sampled_replays = 0  # of the replays, those of a sampled graph

    def _views(self, b: int):
        N, d, m = self.max_n * self.R, self.row.ids, b * self.R
        rows = [d[i * N:i * N + m] for i in range(5)]
        t, n = 5 * N, self.max_n
        return (*rows, d[t:t + b], d[t + n:t + n + b], d[t + 2 * n:t + 2 * n + b])

    def _step(self, tokens, g, pos, row_slots, lim, idx, T: int):
        pool, b = self.pool, idx.shape[0]
        if b * T <= self.fold_rows:  # the norms, projections and FFN on our kernels; K/V written by the rotary kernel
            kc, vc = (x[0].view(-1, *x.shape[3:]) for x in (pool.k, pool.v))  # (slots + 1) rows, flat
            attend = lambda q: paged_pool_attention(q.view(b, T, *q.shape[1:]), pool.k[0], pool.v[0], idx,  # noqa: E731
                                                    lim.view(b, T), pool.rows).view(b * T, -1)
            return self.net.step_folded(self.embed(tokens), g, pos, kc, vc, row_slots * pool.rows + pos, attend)

        def kv_of(k, v):
            pool.k[0].index_put_((row_slots, pos), k)
            pool.v[0].index_put_((row_slots, pos), v)
            return pool.k[0], pool.v[0]

        def attend(q, kp, vp):
            fn = paged_pool_attention if self.paged else pooled_attention
            return fn(q.view(b, T, *q.shape[1:]), kp, vp, idx, lim.view(b, T), pool.rows).view(b * T, -1)

        return self.net.step(self.embed(tokens), g, pos, kv_of, None, attend)

    def _first(self, v) -> torch.Tensor:
        """The round's first forward over every request's new rows -> its last row's output (b, H)."""
        tok, pos, tslot, slot, lim, last_row, idx, _ = v
        g = self.net.features(self.taps.gather(tslot, pos, self.taps.layers))
        return self._step(tok, g, pos, slot, lim, idx, self.R)[last_row]

    def _pick(self, last):
        """A chain step's picks from its outputs (b, H): (the argmax as target ids (b,), a thunk
        of the target-vocabulary logits (b, V) a sampled row draws from)."""
        logits = self.net.logits(last)
        return self.net.hot[logits.argmax(-1)], lambda: self.net.target_logits(logits)

    def _body(self, b: int, sampled: bool = False):
        """The round: the first forward, then K chain steps. Greedy: the (b, K) picks. Sampled
        (`_sampling_views`; greedy rows and pads at temperature 0 keep the argmax): each row's
        draw at its uniform from its tempered, filtered distribution, fed on as the greedy pick
        is, and (picks, the distributions (b, K, V), a flag: a sampled row's was not finite)."""
        v = self._views(b)
        idx, cpos = v[6], v[7]
        last = self._first(v)
        if sampled:
            temp, top_k, top_p, ks, u = self._sampling_views(b)
            greedy = temp <= 0
            temp = torch.where(greedy, 1.0, temp)
        picks, qs = [], []
        for s in range(self.K):
            t, dist = self._pick(last)
            if sampled:
                qs.append(probs_rows(dist(), temp, top_k.long(), top_p))
                t = torch.where(greedy, t, draw_rows(qs[-1], u[:, s]))
            picks.append(t)
            if s + 1 < self.K:
                p = cpos + s
                last = self._step(t, last, p, idx, p + 1, idx, 1)
        if not sampled:
            return torch.stack(picks, 1)  # (b, K)
        q = torch.stack(qs, 1)
        drafted = torch.arange(self.K, device=q.device)[None, :] < ks[:, None]  # (a row's steps past its k: unread)
        return torch.stack(picks, 1), q, (~torch.isfinite(q.sum(-1)) & ~greedy[:, None] & drafted).any()

    def fits(self, ds, sinks, los: list[int], Ns: list[int], ks: list[int]) -> bool:
        """These requests' round can replay: few enough, at most K drafts and K + 1 new rows
        each, every chain row inside its cache, sinks of this tap pool."""
        return (len(ds) <= self.max_n and max(ks) <= self.K
                and all(N - 1 - lo <= self.R and N - 2 + self.K < self.pool.rows for lo, N in zip(los, Ns))
                and all(getattr(s, "pool", None) is self.taps for s in sinks))

    def _load(self, reqs: list, b: int) -> None:
        """`reqs`: (context, lo, tap slot, draft slot) a request."""
        R, N, n = self.R, self.max_n * self.R, self.max_n
        cols: list[list[int]] = [[] for _ in range(5)]
        last, idx, cpos = [], [], []
        for r, (c, lo, ts, ds) in enumerate(reqs):
            m = len(c) - 1 - lo
            pad = R - m
            cols[0] += list(c[lo + 1:]) + [0] * pad
            cols[1] += list(range(lo, lo + m)) + [0] * pad
            cols[2] += [ts] * m + [self.taps.scratch] * pad
            cols[3] += [ds] * m + [self.pool.scratch] * pad
            cols[4] += list(range(lo + 1, lo + m + 1)) + [1] * pad
            last.append(r * R + m - 1)
            idx.append(ds)
            cpos.append(len(c) - 1)
        for r in range(len(reqs), b):  # pad requests: one row at position 0 of the spare slots
            cols[0] += [0] * R
            cols[1] += [0] * R
            cols[2] += [self.taps.scratch] * R
            cols[3] += [self.pool.scratch] * R
            cols[4] += [1] * R
            last.append(r * R)
            idx.append(self.pool.scratch)
            cpos.append(0)
        fill, tail = [0] * (N - b * R), [0] * (n - b)
        vals = [x for col in cols for x in col + fill] + last + tail + idx + tail + cpos + tail
        self.row.load(vals, 0)

    def greedy_after(self, reqs: list[tuple[int, int, int]], verify: list[tuple[int, int, int, int]],
                     pred: torch.Tensor, ids: torch.Tensor):
        """Each request's K greedy drafts for the round after its verify, launched before that
        verify is read back (batching/chain_drafts.py draft_early): `reqs[r]` = (its cache's
        committed rows n, tap slot, draft slot), `verify[r]` = (lo, its first row in `pred`, its
        first row in `ids`, its drafts k) of its rows in the step just launched (lo == n: the
        verify's first row is the round's first row), `pred` / `ids` the step's argmax rows and
        input ids on the device. Its acceptance a
        (accepted_on_device) sets the round's rows on the device as `_load` would from the
        committed context: a + 1 rows at lo .. lo + a whose tokens are the argmax rows 0 .. a
        (the accepted drafts equal them, the last is the bonus), the chain from lo + a + 1.
        The drafts stay on the device (DeviceDrafts)."""
        from .dflash_pool_graph import DeviceDrafts, accepted_on_device  # noqa: PLC0415

        n, R = len(reqs), self.R
        b = self.bucket(n)
        # placeholders where the acceptance decides: one row each, at lo (rewritten below)
        self._load([(range(lo + 2), lo, ts, ds) for (lo, ts, ds) in reqs], b)
        v = torch.tensor([[x[1], x[2], x[3], lo, ts, ds] for x, (lo, ts, ds) in zip(verify, reqs)], dtype=torch.long)
        prow, irow, ks, lo, ts, ds = to_device(v.T.contiguous(), pred.device)
        acc, bonus = accepted_on_device(pred, ids, prow, irow, ks, max(x[3] for x in verify))
        tok, pos, tslot, slot, lim, last_row, idx, cpos = self._views(b)
        j = torch.arange(R, device=pred.device)
        live = j[None, :] <= acc[:, None]  # (n, R): the round's rows
        rows = lambda t: t[:n * R].view(n, R)  # noqa: E731
        rows(tok).copy_(torch.where(live, pred[(prow[:, None] + j).clamp(max=pred.shape[0] - 1)], 0))
        rows(pos).copy_(torch.where(live, lo[:, None] + j, 0))
        rows(tslot).copy_(torch.where(live, ts[:, None], self.taps.scratch))
        rows(slot).copy_(torch.where(live, ds[:, None], self.pool.scratch))
        rows(lim).copy_(torch.where(live, lo[:, None] + 1 + j, 1))
        last_row[:n] = torch.arange(n, device=pred.device) * R + acc
        cpos[:n] = lo + 1 + acc
        g = self._graph(b)
        g.replay()
        self.replays += 1
        return DeviceDrafts(g.out[:n], acc, bonus)

    def _sampling_views(self, b: int):
        n, K = self.max_n, self.K
        lo = 5 * n * self.R + 3 * n
        f = self.row.ids[lo:lo + 4 * n + n * K].view(torch.float64)
        return f[:b], f[n:n + b], f[2 * n:2 * n + b], f[3 * n:3 * n + b], f[4 * n:4 * n + n * K].view(n, K)[:b]

    def _load_sampling(self, sps, gens, ks: list[int]) -> None:
        """A sampled round's parameters and uniforms into the pinned row (sent with `_load`'s):
        a greedy request's temperature 0, a sampled one's k uniforms from its generator (as its
        solo proposal draws them, one a step)."""
        n, K = self.max_n, self.K
        lo = 5 * n * self.R + 3 * n
        f = self.row.writable()[lo:lo + 4 * n + n * K].view(np.float64)
        f[:] = 0.0
        f[2 * n:3 * n] = 1.0
        u = f[4 * n:4 * n + n * K].reshape(n, K)
        for r, (sp, gen, k) in enumerate(zip(sps, gens, ks)):
            if not sp.greedy:
                f[r], f[n + r], f[2 * n + r], f[3 * n + r] = sp.temperature, sp.top_k, sp.top_p, k
                u[r, :k] = uniforms(gen, k).numpy()

    def sampled(self, reqs: list, sps, gens, ks: list[int], name: str) -> list | None:
        """Each request's Proposal after its context, greedy and sampled requests together (`reqs`
        as `_load`'s; `sps` / `gens` / `ks` each request's sampling, generator and drafts), in one
        replay of the bucket's sampled graph (captured at the first such round); None where that
        capture failed (once, one warning line: the eager chains draw them)."""
        from .base import Proposal  # noqa: PLC0415

        if not self._sampled_ok:
            return None
        b = self.bucket(len(reqs))
        key = (b, "sampled")
        g = self.graphs.get(key)
        if g is None:  # captured over pads (no generator drawn from yet: a failure leaves them as they were)
            self._load_sampling([], [], [])
            self._load([], b)
            try:
                lazy = LazyGraph if self.graph_cls is CapturedGraph else None  # (the request threads run on)
                g = self.graphs[key] = self._capture(lambda: self._body(b, sampled=True), lazy)
            except Exception as e:  # noqa: BLE001 (a fast path: the eager chains draw the same drafts)
                self._sampled_ok = False
                line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                print(f"[memra] warning: sampled draft chains stay eager (their CUDA graph failed: {line})",
                      file=sys.stderr)
                return None
        self._load_sampling(sps, gens, ks)
        self._load(reqs, b)
        g.replay()
        self.replays += 1
        self.sampled_replays += 1
        picks, q, bad = g.out
        n = len(reqs)
        flat = torch.cat([picks[:n].flatten(), bad.long().view(1)]).tolist()
        if flat.pop():
            raise non_finite_drafts(name)
        K = self.K
        return [Proposal(ids=flat[r * K:r * K + k]) if sp.greedy else
                Proposal(torch.tensor(flat[r * K:r * K + k], dtype=torch.long), q[r, :k].clone())
                for r, (sp, k) in enumerate(zip(sps, ks))]

    def greedy(self, reqs: list) -> list[list[int]]:
        """Each request's K greedy drafts (host lists) after its context: `reqs` as `_load`'s."""
        b = self.bucket(len(reqs))
        self._load(reqs, b)
        g = self._graph(b)
        g.replay()
        self.replays += 1
        return g.out[:len(reqs)].tolist()
