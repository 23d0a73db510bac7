"""Plain greedy requests one step ahead of the host, in the batch.

A step whose every row is a chained request's decode row with no drafts (drafter `none`, or
K 0 chosen by --spec-k auto: its next input is the argmax of its row; a tap drafter's taps are
still written, for when it drafts again; a sampled request with drafter `none`: its row's token
drawn on the device at launch, step_forward.py `draw_at_launch`, stands where the argmax would)
does not need the host to know the next step's inputs: the
positions are the next ones, the blocks can be grown now, and the ids are the step's argmax,
which the device copies into the next step's input itself. So the leader launches step N + 1
right behind step N, before reading N back, and runs N's rounds (commit, stop rules) while the
device runs N + 1: the leader's host work leaves the critical path, as the one-request engine's
plain decoding runs one step ahead (specdec/ahead.py). N's readback is enqueued before N + 1 is
launched (into pinned memory, with an event) so it waits for N alone.

A request that ends at step N (an EOS: the count and context rules are checked first, so only
an EOS ends one here) leaves its N + 1 row void: its output is dropped and the K/V row it
wrote, past the request's end, goes back with its blocks. The leader stops going ahead when a
submission is waiting (a new request's prefill, a sampled request's round: they join the next
step), when a request's blocks cannot grow, or when a request is about to reach its last token.
Each request's ids are the ids it gets alone: its rows are the rows it runs step by step.
"""

from __future__ import annotations

import torch

from .job import Job

__all__ = ["plan_ahead", "stage_readback", "take_readback"]


def plan_ahead(b, take: list[Job]) -> list[Job] | None:
    """Called without the batcher's lock while step `take` runs: the same requests' next rows
    (ids left to the device), their blocks grown; None when the step cannot go ahead."""
    if not b.ahead:
        return None
    for j in take:
        ch = j.chain
        if ch is None or not ch.plain or ch.ended or j.n != 1 or j.last or ch.inflight is not None:
            return None
        if not (ch.produced + 1 < ch.max_new and len(ch.tokens) + 1 < ch.capacity):
            return None  # it may end at this step by count: no row past its end
    with b.cv:
        if b.pending:
            return None  # someone waits to join: the next step takes them
        for j in take:
            rid, end = j.rid, j.start + 2
            if j.chain.ended or not b.pool.holds(rid):
                return None  # left meanwhile
            if b.pool.capacity(rid) < end and not b.pool.grow(rid, end):
                return None
        nxt = [Job(j.rid, [0], j.start + 1, j.width, False, chain=j.chain, taps=j.taps, timer=j.chain.lap_timer())
               for j in take]
        for j in nxt:
            j.chain.inflight = j
    return nxt


def stage_readback(pv: torch.Tensor):
    """Enqueue the copy of a step's argmax rows to the host now (before the next step is
    launched behind it), so waiting for it waits for this step alone."""
    if pv.device.type != "cuda":
        return pv, None
    buf = torch.empty(pv.shape, dtype=pv.dtype, pin_memory=True)
    buf.copy_(pv, non_blocking=True)
    ev = torch.cuda.Event(enable_timing=True)  # (also where the step's device work ends: device_idle.py)
    ev.record()
    return buf, ev


def take_readback(staged) -> list:
    buf, ev = staged
    if ev is not None:
        ev.synchronize()  # the wait drops the GIL
    return buf.tolist()
