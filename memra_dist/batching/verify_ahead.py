"""Speculative rounds one step ahead of the host: the next verify launched before this one is
read back.

Right behind a greedy verify of a tap drafter that drafts early (DFlash, EAGLE-3:
chain_drafts.py `draft_early`), the device already knows each request's next round: its
acceptance (`accepted_on_device`, the loop's own rule), so the round's first input (the bonus
token, the argmax row after the accepted drafts) and where the round starts (lo + 1 + accepted);
and its drafts (the early drafts, made from that acceptance). Only the host does not, until the
readback. So where every row of the step is such a round, the leader launches the next verify
right behind it, before reading it back, as plain greedy chains go one step ahead (ahead.py):
its rows are packed as if nothing were accepted (positions from lo + 1, the K/V slots through
each request's block table, grown first for the most the round can reach), and the device
moves them by its acceptance (`advance_rows`: the positions, the slots, the first id; the
drafts go in as `DraftPatch` puts them). The leader then reads step N back and settles its
rounds while the device runs N + 1, and N + 1's verify rows are ingested and its next drafts
made behind it before the leader settles it: the device's wait for the host between steps
(the readback, the rounds, packing and launching the next verify) leaves the critical path.

After the readback the leader settles N; each request's round then adopts the verify already
running (`Chain.adopt_ahead`), and as that round settles in turn, the start the device moved
it to is checked against the one the host accepted (the same rule on the same rows, so they
agree; a difference would fail the request rather than commit what rows at positions the host
did not accept gave). A request that ends at N (an EOS, its budget) leaves its
N + 1 rows void, as ahead.py does; one near its end may verify more drafts than its own round
would ask for there (the ids are the same; the tokens past its budget are dropped at the
commit, as ever). Plain rows (K 0 under --spec-k auto) ride the step too, their ids the step's
argmax. --spec-k auto's K for the round after N + 1 is chosen after N: one step late, as for
plain rounds ahead; a round gets at most the drafts made early. The leader goes ahead only on
graphed steps whose bucket is captured (its rows run as packed, then moved; a capture would run
them unmoved) or, without graphs (the CPU), with the acceptance read on the host first (the
tests' eager path); and not when a submission waits or a prime is queued, a step holds a
sampled round or a traced one off CUDA (its boundaries drained: chain.py `anchored`), or a
request's next round could reach past its capacity.
"""

from __future__ import annotations

import torch

from ..device import to_device
from ..specdec.drafters.base import Proposal
from .job import Job

__all__ = ["plan_verify_ahead", "Advance", "advance_rows"]


def plan_verify_ahead(b, take: list[Job]) -> list[Job] | None:
    """Called without the batcher's lock while step `take` runs, right behind its early drafts:
    the same requests' next rows, their blocks grown; None when the step cannot go ahead. A
    verify's next round: its first id and drafts left to the device, its rows moved there
    (`Job.ahead`); a plain round's (K 0 under --spec-k auto, drafter none) next row: its argmax,
    at the next position (`Job.argmax`: its row of the step's argmax)."""
    if not b.verify_ahead:
        return None
    plan, p, drafted = [], 0, False
    for j in take:
        ch = j.chain
        if (ch is None or not ch.greedy or ch.ended or (ch.timed and not ch.anchored) or j.void or j.last
                or ch.inflight is not None):
            return None
        if j.n == 1:  # a plain round: its next row is its argmax (as ahead.py's)
            if not ch.plain or len(ch.tokens) + 1 >= ch.capacity:
                return None  # (it drafts next: nothing drafted early for it)
            plan.append((j, None, p, 0))
            p += 1
            continue
        e = ch.drafter.early if ch.drafter.verifies_ahead else None
        if e is None or e[2] != j.start or e[3] != j.n - 1 or e[0].acc is None:
            return None  # (not drafted behind this verify)
        dd = e[0]
        # its next round's K (--spec-k auto's choice: one step late; 0: a plain row), its rows
        # within its capacity however many of this round's drafts are accepted (a round near the
        # request's end may draft more than the host would ask there: the ids are the same, the
        # tokens past the request's budget dropped at the commit, as ever)
        kk = min(ch.draft_k(), dd.k, ch.capacity - len(ch.tokens) - j.n)
        if kk < 0:
            return None
        plan.append((j, e, None, kk))
        drafted = True
        p += j.n
    if not drafted:
        return None  # (plain rows alone: ahead.py's)
    plan = _drafts_of(plan)
    g = b.graphs
    with b.cv:
        if b.pending or b.primes:
            return None  # someone waits to join: the next step takes them
        nxt = []
        for j, dd, row, kk in plan:
            end = j.start + j.n + kk + 1  # past the next round's last row, where all of this one's is accepted
            if j.chain.ended or not b.pool.holds(j.rid):
                return None  # left meanwhile
            if b.pool.capacity(j.rid) < end and not b.pool.grow(j.rid, end):
                return None
            drafts = Proposal(dev=(dd, row, kk)) if kk else None
            nxt.append(Job(j.rid, [0] * (kk + 1), j.start + (1 if dd is not None else j.n), j.width, False,
                           chain=j.chain, taps=j.taps, drafts=drafts, timer=j.chain.lap_timer()))
        if (g is None and b.device.type == "cuda") or (g is not None and not g.captured(nxt)):
            return None  # (an eager step's rows would wait for the readback; a capture would run them unmoved)
        for j, (_, dd, row, _) in zip(nxt, plan):
            if dd is not None:
                j.ahead = (dd, row, j.start)  # moved by the device's acceptance (Advance) from that start
            else:
                j.argmax = row  # (its row of the step's argmax)
            j.chain.inflight = j
    return nxt


def _drafts_of(plan: list) -> list:
    """The plan's verify entries (j, its drafter's early drafts, -, K) as (j, DeviceDrafts, row,
    K): the drafts its verify runs, one call a drafter class (Drafter.ahead_drafts_many)."""
    by: dict[type, list[int]] = {}
    for i, (j, e, _, _) in enumerate(plan):
        if e is not None:
            by.setdefault(type(j.chain.drafter), []).append(i)
    out = list(plan)
    for cls, idx in by.items():
        got = cls.ahead_drafts_many([plan[i][0].chain.drafter for i in idx], [plan[i][1] for i in idx],
                                    [plan[i][3] for i in idx])
        for i, (dd, row) in zip(idx, got):
            out[i] = (plan[i][0], dd, row, plan[i][3])
    return out


class Advance:
    """A step launched ahead with verifies among it: each verify's rows moved by the acceptance
    the device found for the round before (`Job.ahead` = (DeviceDrafts, row, the start it was
    packed at)), each plain row's id the step's argmax at its row (`Job.argmax`; `pred`).
    Graphed, on the device (`apply`, into the step's packed inputs behind their copy); eager (the
    CPU), on the host first (`resolve`)."""

    def __init__(self, jobs: list[Job], pred: torch.Tensor):
        self.jobs, self.pred = jobs, pred

    def resolve(self) -> None:
        """Each job's start and first id as the device's acceptance sets them, read on the host
        (a wait for the round's early drafts: the eager path's, which the CPU's tests take)."""
        for j in self.jobs:
            if j.ahead is None:
                j.ids[0] = int(self.pred[j.argmax])
                continue
            dd, row, _ = j.ahead
            j.start += dd.accepted(row)
            j.ids[0] = int(dd.bonus[row])

    def apply(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
              block: int) -> None:
        """Into a graphed step's packed inputs on the device (`table`: (segments, width), a job a
        segment): the plain rows' ids in one gather, then for each DeviceDrafts the verifies
        read, one index copy and `advance_rows`."""
        by: dict[int, tuple] = {}
        plain: list[int] = []
        r = 0
        for s, j in enumerate(self.jobs):
            if j.ahead is None:
                plain.extend((r, j.argmax))
                r += 1
                continue
            dd, row, _ = j.ahead
            rows, seg, src = by.setdefault(id(dd), (dd, [], [], []))[1:]
            rows.extend(range(r, r + j.n))
            seg.extend([s] * j.n)
            src.extend([row] * j.n)
            r += j.n
        if plain:
            at = to_device(plain, ids.device).view(-1, 2)
            ids[at[:, 0]] = self.pred[at[:, 1]]
        for dd, rows, seg, src in by.values():
            n = len(rows)
            at = to_device(rows + seg + src, ids.device)
            advance_rows(ids, pos, slots, table, block, at[:n], at[n:2 * n], dd.acc[at[2 * n:]],
                         dd.bonus[at[2 * n:]])


def advance_rows(ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, table: torch.Tensor, block: int,
                 rows: torch.Tensor, seg: torch.Tensor, acc: torch.Tensor, bonus: torch.Tensor) -> None:
    """Rows `rows` of a step, packed at positions as if nothing were accepted, moved by their
    request's acceptance `acc` (one entry a row): each position + acc, its K/V slot again
    through its segment's block table (`seg`: the row's segment), and each request's first
    row's id (the row whose position was the lowest of its segment's) the bonus token.

    >>> ids, pos = torch.tensor([0, 9, 9, 0, 9]), torch.tensor([5, 6, 7, 2, 3])
    >>> slots, table = torch.zeros(5, dtype=torch.long), torch.tensor([[3, 1, 5], [2, 0, 0]])
    >>> advance_rows(ids, pos, slots, table, 4, torch.arange(5), torch.tensor([0, 0, 0, 1, 1]),
    ...              torch.tensor([2, 2, 2, 0, 0]), torch.tensor([7, 7, 7, 8, 8]))
    >>> ids.tolist(), pos.tolist(), slots.tolist()   # rows 0-2 moved to 7..9 (blocks 1, 5, 5); 3-4 stay
    ([7, 9, 9, 8, 9], [7, 8, 9, 2, 3], [7, 20, 21, 10, 11])
    """
    p = pos[rows] + acc
    first = torch.ones_like(rows, dtype=torch.bool)
    first[1:] = seg[1:] != seg[:-1]
    pos[rows] = p
    slots[rows] = table[seg, p // block] * block + p % block
    ids[rows] = torch.where(first, bonus, ids[rows])
