"""A pipeline stage's part of a batched pipeline (pp > 1, `--max-batch B` > 1; the head's part:
pipeline/batch_head.py).

BATCH_OPEN gives the head's pool geometry: the stage makes a paged pool of as many slots for
its own layers (batching/paged.py). Each BATCH step's plan row names every request's rows and
block table (batching/step_plan.py); the stage rebuilds the head's `BatchView` from it, runs
its layers over all the rows in one forward (stage 0 embeds the ids), and sends the hidden
rows on, the taps it holds appended behind those it received, and at level 2 the sub-split
vector with its own laps added. A request's recurrent states are made at its first step here
and dropped at its LEAVE; a preempted request's rows go to host memory at SWAP_OUT and come
back into its new slots at SWAP_IN, bitwise."""

from __future__ import annotations

import time

import torch

from ..batching.paged import BatchView, PagedKV
from ..batching.step_forward import stage_layers
from ..batching.step_plan import TablePool, unpack, unswap_row
from ..device import free_mb
from ..phase.subsplit import SUB_BUCKETS, SubsplitTimer
from ..tracing.conventions import ATTR
from .transport import Flag, Op

__all__ = ["StageBatch", "BATCH_OPS"]

BATCH_OPS = (Op.BATCH_OPEN, Op.BATCH, Op.SWAP_OUT, Op.SWAP_IN, Op.LEAVE)


class StageBatch:
    def __init__(self, worker, rows: int, block: int):
        run = worker.runner
        self.w, self.run = worker, run
        self.rows, self.block = rows, block
        self.kv = PagedKV(run.stage, TablePool(rows, block), run.device, run.dtype)
        self.kernels = all(getattr(b.self_attn, "fast_attn_rows", 0) > 0 and b.self_attn.rope_kernel_ok()
                           for b in run.stage.layers.values())
        self.known: set = set()  # requests whose recurrent states this stage holds
        self.saved: dict = {}  # preempted requests' rows in host memory
        self.mine = worker.own_taps  # the tap layers this stage holds, in tap order

    def op(self, op: int, row: list[int], rows: int, flags: int, arg: int = -1, slot: int = 0) -> int:
        """One batched command; returns the forwards it served. A traced step (arg: the request
        whose trace its span joins, slot: the step's id) is recorded between drains."""
        if op == Op.BATCH:
            if not flags & Flag.TRACED:
                self._step(row, rows, flags)
                return 1
            run = self.run
            run.drain()
            t0 = time.perf_counter_ns()
            nseg = self._step(row, rows, flags)
            run.drain()
            self.w.records.append((t0, time.perf_counter_ns(), 0, rows, -1, free_mb(run.device), run.label, arg, -1,
                                   {ATTR["batch_step"]: slot, ATTR["batch_requests"]: nseg, ATTR["batch_rows"]: rows}))
            return 1
        if op == Op.SWAP_OUT:
            rid, slots = unswap_row(row)
            self.saved[rid] = self.kv.save(slots)
        elif op == Op.SWAP_IN:
            rid, slots = unswap_row(row)
            self.kv.restore(slots, self.saved.pop(rid))
        elif op == Op.LEAVE:
            rid = row[0]
            self.kv.leave(rid)
            self.known.discard(rid)
            self.saved.pop(rid, None)
        return 0

    @torch.inference_mode()
    def _step(self, row: list[int], rows: int, flags: int) -> int:
        w, run, link = self.w, self.run, self.w.link
        parts, ids = unpack(row)
        dev = run.device
        for p in parts:
            if p[0] not in self.known:
                self.kv.admit(p[0])
                self.known.add(p[0])
        view = BatchView.build(TablePool(self.rows, self.block, parts), [p[:4] for p in parts], dev,
                               kernels=self.kernels)
        pos = torch.cat([torch.arange(s, s + n) for _, s, n, _, _ in parts]).to(dev)
        H, up = run.cfg.hidden_size, None
        first = run.stage.has_embed
        if first:
            x = torch.tensor(ids, dtype=torch.long, device=dev)
        else:
            x = link.recv((rows, H), run.dtype)
            if w.remote_taps:
                up = link.recv((rows, len(w.remote_taps) * H), run.dtype)
        timer = SubsplitTimer(run.drain) if flags & Flag.TIMED else None
        h, tapped = stage_layers(run.stage, self.kv, self.mine, x, pos, view, timer, embed=first)
        link.send(h)
        if w.taps_out:
            mine = torch.cat([tapped[t] for t in self.mine], dim=-1) if self.mine else None
            link.send(mine if up is None else up if mine is None else torch.cat([up, mine], dim=-1))
        if timer is not None:
            sub = link.recv((len(SUB_BUCKETS),), torch.long) if w.rank > 1 else torch.zeros(
                len(SUB_BUCKETS), dtype=torch.long, device=dev)
            ns, _rows = timer.take()
            sub += torch.tensor([ns[b] for b in SUB_BUCKETS], device=dev)
            link.send(sub)
        return len(parts)
