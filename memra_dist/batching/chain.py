"""Rounds the step's leader runs for a request: requests in a batched engine, greedy or sampled,
whose drafter allows it (`Drafter.chains`: the host drafters none, ngram, replay; DFlash,
EAGLE-3, MTP and the draft model, which the leader drafts for the step's requests together:
chain_drafts.py).

A batched request that runs its own rounds (specdec/session.py over a BatchSlot) brings its
next rows only after its thread has woken, taken the GIL and done its round's host work
(acceptance, commit, the next drafts): ~0.2 ms a request a step with 16-64 threads, serialised
by the GIL, so at 64 requests the device idled ~40 % of the time between steps (measured on an
H200 and reproduced on CPU with the forward stubbed). Such a request instead hands its rounds
to the batcher as a `Chain`: right after a step, under the batcher's lock, the step's leader
runs each chained request's round on the host lists the step read back (its argmax and the
logit at it), or for a sampled request on its rows' logits: the same acceptance (accept.py
`commit_rows`; `accept_sampled` with the request's own generator, which its proposals drew
from too, in the session's order), the same commit and stop rules as the session, the rollback as a block trim,
the drafter's maintenance and next proposal, and queues its next verify row for the very next
step. The request's thread only takes the rounds as they come (`take`), commits them into its
session (its tokens, stats and records, so the session ends exactly where the chain does) and
streams them; the device never waits for it.

A chain ends when the request does (an EOS, its last token, its context full), when the
forward failed or a row was not finite (`err`: the session raises it as it would), when the
request left, or when its next rows found no free block (`parked`): the session then runs one
round itself (its submission may wait for blocks or preempt another request) and chains again.

Each round keeps six host stamps (ns), as the session's phase clock stamps a round's
boundaries: the proposal started / the verify queued (the draft) / the step read back (the
verify: waiting for the step and its forward) / accepted / rolled back / maintained. When the
request's rounds are recorded (`timed`: trace level >= 1) a drafter's device work ends inside its
phase: an event is recorded behind its maintenance (DFlash's ingest) and behind a shared draft
forward whose drafts stay on the device, and the request's thread takes the later of the stamp
and the moment the stream reached the event (phase/late_stamps.py; the step's readback places the
device's clock on the host's), so each phase holds its own device time, as the session's event
clock has it, and nothing waits for the device on the loop's path: a traced round runs the
untraced path, its maintenance and next drafts made behind its verify before the readback
(chain_drafts.py; their events recorded right behind them) and its next verify launched ahead
(verify_ahead.py). Before a chain's first step is read back, and off CUDA, the stream is drained
there instead and none of those overlaps is taken (a proposal read back: its draft phase ends
with its drafts on the host). At level 0 nothing is recorded and nothing drains.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass


import torch

from ..device import device_mark, to_device
from ..phase.late_stamps import LateStamp
from ..phase.subsplit import SubsplitTimer, no_drain
from ..specdec.accept import NonFiniteRow, accept_sampled, accept_sampled_many, commit_rows
from ..specdec.drafters.none import NoDrafter
from ..specdec.sampling import probs, probs_rows, row_filters, uniforms
from ..specdec.spec_k import SHADOW_ALPHA, Acceptance
from ..specdec.stop import commit_tokens
from .job import BatchStep, Job

__all__ = ["Chain", "ChainRound", "maint_end", "accept_sampled_rounds"]


@dataclass
class ChainRound:
    new: list[int]  # the round's committed tokens as the acceptance returns them (the session's _commit trims)
    k: int  # drafted
    j: int  # accepted
    ctx: int  # the verify's first position (the pending token's)
    step: BatchStep | None
    t: tuple[int, int, int, int, int, int]
    draft_requests: int = 0  # requests whose drafts one draft forward made with this round's (chain_drafts.py)
    expected: float = -1.0  # --spec-k auto: the accepted drafts its K was chosen for (spec_k.py; -1: fixed K)
    laps: tuple | None = None  # level 2: its verify step's sub-split (ns by bucket, seq_rows)
    late: tuple = ()  # (boundary, LateStamp): where its drafter's device work ends (phase/late_stamps.py)


class Chain:
    """One greedy request's rounds, run by the batcher's step leader (see the module doc).
    `tokens`, `produced`, `max_new`, `capacity`, `eos` mirror the session's state and stop rules."""

    def __init__(self, slot, tokens: list[int], produced: int, max_new: int, capacity: int, eos, k: int,
                 drafter, sp, gen, timed: bool = True, laps: bool = False):
        self.slot, self.rid = slot, slot.rid
        # its rounds are recorded (trace level >= 1): a device drafter's maintenance is drained so
        # its device time ends inside the maint phase; untimed, nothing waits for it there
        self.timed = timed
        self.laps = laps  # level 2: each round's verify job carries a sub-split timer of its own (`lap_timer`)
        self.tokens = list(tokens)
        self.produced, self.max_new, self.capacity, self.eos = produced, max_new, capacity, set(eos)
        self.k, self.drafter, self.sp, self.gen = k, drafter, sp, gen
        self.rounds: deque[ChainRound] = deque()
        # a binary signal (held: nothing new): the leader releases it after a round, the request's
        # thread takes it to wait. A bare lock, not an Event: releasing it never waits for the
        # woken thread (an Event's set takes the lock that thread holds while it waits for the GIL)
        self._signal = threading.Lock()
        self._signal.acquire()
        self.ended = False  # no round will come after those queued
        self.done = False  # ... because the request ended
        self.parked = False  # ... because its next rows found no free block
        self.err: BaseException | None = None
        self.err_ids: tuple[list[int], int] | None = None  # a non-finite row's verify ids and start
        self._drafts: list[int] = []
        self._q = None  # a sampled round's draft probabilities (None: deterministic drafts)
        self._accepted = None  # a sampled round's acceptance, made with the step's others (accept_sampled_rounds)
        self._t0 = 0
        self._anchor: tuple | None = None  # its last step's readback on the host's clock (Job.anchor)
        self._late1: tuple = ()  # its pending round's draft end, an event behind its shared draft forward
        # traced, CUDA: events behind the maintenance / next drafts made behind its verify before the
        # readback (chain_drafts.py pre_maintain / draft_early), where those phases end
        self._pre_ev = self._early_ev = None
        self._pending: tuple = ()  # the settled round, handed over by `maintained`
        self._shared = 0  # requests the latest proposal's draft forward held (0: its own, or none)
        self._expected = -1.0  # the latest proposal's predicted accepted drafts (--spec-k auto)
        self.greedy = sp.greedy  # sampled: the leader accepts on the step's logits with the request's generator
        self.never_drafts = isinstance(drafter, NoDrafter)
        # sampled plain decoding: each row's token drawn on the device as the step is launched
        # (step_forward.py `draw_at_launch`), read back as a greedy row's argmax is: settled as
        # greedy rows are, and launched ahead as they are
        self.drawn = not self.greedy and self.never_drafts
        self.inflight: Job | None = None  # its next round's row, launched one step ahead (ahead.py)
        self.acc: Acceptance | None = None  # --spec-k auto: its running acceptance per draft position (start_chain)
        self.k_step: int | None = None  # the K the engine chose for its next round (--spec-k auto), else k
        self.remeasure = False  # --spec-k auto: its next drafting round drafts at its bound (loop_rounds.choose_k)
        self.remeasured = 0  # ... the engine's re-measure that last chose it (0: none yet)
        self._shadow: tuple[int, list[int]] | None = None  # a K-0 round's unverified drafts: (position, ids)

    @property
    def plain(self) -> bool:
        """Its next round drafts nothing (drafter none, or K 0 under --spec-k auto) and is greedy
        (or sampled plain decoding, drawn on the device): that row's input is this one's argmax
        (or draw), so the loop may launch it ahead (ahead.py)."""
        return self.drawn or (self.greedy and (self.never_drafts or self.k_step == 0))

    def skips_maint(self) -> bool:
        """--spec-k auto chose K 0 for its next round (or --ngram-first's lookup drafts it), or the
        request ended, and its drafter catches up on the rows it skips when it drafts again
        (base.py `catches_up`): no maintenance now, plain decoding's cost."""
        if not self.drafter.catches_up:
            return False
        if self.inflight is not None and self.inflight.ahead is not None and not self.done:
            return False  # its next verify already runs, drafted from this round's maintenance (verify_ahead.py)
        if self.done:  # the request ended: its drafter is primed afresh before it drafts again
            return True
        return self.k_step == 0 or self.host_round()

    def host_round(self) -> bool:
        """Its next round drafts on the host though its drafter has a network (--ngram-first: the
        lookup's round), apart from the network's shared forward."""
        pick = getattr(self.drafter, "host_round", None)
        return pick is not None and pick(self.tokens, self.draft_k())

    def draft_k(self) -> int:
        """The drafts the next round asks for, as the session's round asks (<= 0: none)."""
        return self.bound(self.k if self.k_step is None else self.k_step)

    def bound(self, k: int | None = None) -> int:
        """The most drafts a round may ask for now (`k`, default -k, within the request's room)."""
        return min(self.k if k is None else k, self.capacity - len(self.tokens), self.max_new - self.produced - 1)

    def shadow(self) -> bool:
        """--spec-k auto, a host drafter's K-0 round: its drafts at the bound proposed anyway and
        kept, not verified; as the next tokens commit they are scored against them (`_score`) and
        the request's acceptance (and the engine's) learns what drafting would have got. At K 0
        nothing else measures it (no draft reaches the verify), and a host proposal costs no
        device time: n-gram's drafts that start paying later in a request (a continuation that
        begins to repeat) are seen. One at a time; True when one was proposed."""
        if self._shadow is not None or self.acc is None or not self.drafter.host_only:
            return False
        k = self.bound()
        if k <= 0:
            return False
        drafts = self.drafter.propose(self.tokens, k, self.sp, self.gen).host(k)
        if drafts:
            self._shadow = (len(self.tokens), drafts)
        return bool(drafts)

    def _score(self) -> None:
        """The pending shadow's drafts against the tokens committed since: once one differs, or
        all are matched, the request's acceptance takes the round it would have been."""
        at, drafts = self._shadow
        got = self.tokens[at:at + len(drafts)]
        j = 0
        while j < len(got) and got[j] == drafts[j]:
            j += 1
        if j < len(got) or j == len(drafts):
            self._shadow = None
            self.acc.update(len(drafts), j, SHADOW_ALPHA)

    @property
    def anchored(self) -> bool:
        """A traced round's device work may end by an event, not a drain: a step read back on CUDA."""
        return self._anchor is not None

    def next_job(self, prop=None, t0: int | None = None, shared: int = 0, drafted=None) -> Job:
        """The next round's verify rows (the pending token, then this round's drafts), proposed
        as the session's round proposes them (drawn with the request's generator when sampled);
        or `prop`, proposed with other requests' in one draft forward that began at `t0` with
        `shared` requests' (chain_drafts.py), `drafted` an event behind that forward where a
        traced round's drafts stay on the device (its draft phase ends there). The rows carry the
        request's tap sink: the step writes its tap drafter's taps."""
        self._t0 = t0 if t0 is not None else time.perf_counter_ns()
        self._shared = shared
        if self._early_ev is not None:  # its drafts made behind the verify before (taken by the proposal)
            drafted, self._early_ev = self._early_ev, None
        self._late1 = ((1, LateStamp(drafted, self._anchor)),) if drafted is not None and self.timed else ()
        n, k = len(self.tokens), self.draft_k()
        if prop is None and k > 0:
            prop = self.drafter.propose(self.tokens, k, self.sp, self.gen)
        dev = prop if prop is not None and k > 0 and prop.on_device else None
        if dev is not None:  # left on the device (a shared forward's): read back at the accept
            kk = min(k, prop.count())
            self._drafts, ids = None, [self.tokens[-1]] + [0] * kk
        else:
            self._drafts = prop.host(k) if prop is not None and k > 0 else []
            kk, ids = len(self._drafts), [self.tokens[-1], *self._drafts]
        if kk:
            self._shadow, self.remeasure = None, False  # (measured by its own round now)
        self._expected = self.acc.expected(kk) if self.k_step is not None else -1.0
        self._q = prop.q[:kk] if prop is not None and prop.q is not None else None
        return Job(self.rid, ids, n - 1, self.capacity, False, chain=self, taps=self.slot.cache.taps, drafts=dev,
                   timer=self.lap_timer())

    def lap_timer(self):
        """A level-2 round's verify job's own sub-split timer (None below level 2): its step's laps
        (a graphed step's twin, batching/graphs.py; an eager step's drained walk, laps.py) land in
        it, and the round's record takes them (`ChainRound.laps`), whatever step runs ahead."""
        return SubsplitTimer(no_drain) if self.laps else None

    def adopt(self, job: Job) -> None:
        """Its next round is `job`, already launched one step ahead with the token just
        committed as its input (batching/ahead.py): the round began when that row was queued."""
        # (a K-0 round chosen by --spec-k auto counts as one: it expected nothing and drafted
        # nothing, whatever K was chosen since for the round after it)
        self._t0, self._drafts, self._shared, self._q, self._late1 = job.t, [], 0, None, ()
        self._expected = 0.0 if self.k_step is not None else -1.0
        self.slot.ahead_steps += 1
        job.ids[0] = self.tokens[-1]  # what the device read from the argmax (the error path's ids)

    def adopt_ahead(self, job: Job) -> bool:
        """Its next round is `job`, a verify already launched one step ahead (verify_ahead.py),
        its rows moved on the device by the acceptance found there; its drafts are its drafter's
        early drafts, taken as its proposal would take them (False: they do not fit the context
        the host accepted; the chain failed). Where the device's acceptance is checked against
        the host's: `settle`, as the round's drafts are read (the same copy: no wait here)."""
        dd, row, _ = job.ahead
        n = len(self.tokens)
        got = self.drafter.take_early(self.tokens, job.n - 1)
        if got is None or got[0] is not dd or got[1] != row:
            self._fail(RuntimeError("a verify launched ahead does not start where its round before was accepted"),
                       None)
            return False
        job.start, job.ids[0] = n - 1, self.tokens[-1]
        self._t0, self._drafts, self._shared, self._q = job.t, None, 0, None  # (its drafts: read at the accept)
        ev, self._early_ev = self._early_ev, None  # (its draft phase: the early drafts behind the verify before)
        self._late1 = ((1, LateStamp(ev, self._anchor)),) if ev is not None and self.timed else ()
        self._expected = self.acc.expected(job.n - 1) if self.k_step is not None else -1.0
        self._shadow, self.remeasure = None, False
        self.slot.ahead_steps += 1
        return True

    def settle(self, job: Job) -> int | None:
        """After the step `job` rode in (its greedy rows read back; a sampled round's logits):
        accept (greedy, or by rejection sampling with the request's generator, as the session
        accepts), commit, and the rows the request keeps (its rollback: the batcher trims its
        blocks to them; the rows it wrote when every draft was accepted); None when the round
        failed (`err` set)."""
        t2 = time.perf_counter_ns()
        got, self._accepted = self._accepted, None
        self._anchor = job.anchor
        if self._drafts is None:  # left on the device: the step ran behind their draft, read now
            self._drafts = job.host_ids()[1:]
        kk, n = len(self._drafts), len(self.tokens)
        if job.err is None and job.ahead is not None and not _ahead_where_accepted(job):
            job.err = RuntimeError("a verify launched ahead ran where the device accepted the round before, not the host")
        if job.err is not None:
            self._fail(job.err, None)
            return None
        try:
            if self.greedy or self.drawn:  # (drawn: its row's token and finiteness in the greedy rows)
                pred, val = job.greedy
                new = commit_rows(pred, self._drafts, val)
            elif got is None:
                j, nxt, _kind = accept_sampled(probs(job.out, self.sp), self._q,
                                               torch.tensor(self._drafts, dtype=torch.long), self.gen)
                new = self._drafts[:j] + [nxt]
            else:  # accepted with the step's other sampled rounds
                if isinstance(got, BaseException):
                    raise got
                j, nxt, _kind, bad = got
                if bad >= 0:
                    raise NonFiniteRow(bad)
                new = self._drafts[:j] + [nxt]
        except Exception as e:  # noqa: BLE001 (NonFiniteRow: the session names the layer)
            self._fail(e, (list(job.ids), job.start))
            return None
        t3 = time.perf_counter_ns()
        j = len(new) - 1
        if self.acc is not None:  # (--spec-k auto only: nothing on a fixed-K round's path)
            self.acc.update(kk, j)
        self.slot.length, self.slot.last_step = n + j, job.step
        kept, _, self.done = commit_tokens(new, self.produced, self.max_new, len(self.tokens), self.capacity,
                                           self.eos)  # the session's own rule: it ends where the chain does
        self.tokens.extend(kept)
        self.produced += len(kept)
        if self._shadow is not None:
            self._score()
        # level 2: the step's laps read now (its stamps came back before its readback: graphs.py)
        self._pending = (new, kk, j, n - 1, job.step, self._t0, job.t, t2, t3, self._shared, self._expected,
                         job.timer.take() if job.timer is not None else None)
        return n + j

    def maintained(self, t4: int | None = None, ev=None) -> None:
        """After the rollback: the drafter's maintenance, and the round handed to the request.
        `t4`: the maintenance already ran, with other requests' in one forward begun then (`ev`:
        an event behind that forward, where a traced round's maint phase ends: `maint_end`)."""
        if t4 is None:
            t4 = time.perf_counter_ns()
            if not self.skips_maint():
                self.drafter.maintain(self.tokens)
                if self.timed and self.drafter.device is not None:  # its device work ends inside its phase
                    ev = maint_end([self])
        elif ev is None and self.timed and self._pre_ev is not None:
            ev = self._pre_ev
        new, kk, j, ctx, step, t0, t1, t2, t3, shared, expected, laps = self._pending
        late = self._late1 + (((5, LateStamp(ev, self._anchor)),) if ev is not None and self.timed else ())
        self.rounds.append(ChainRound(new, kk, j, ctx, step, (t0, t1, t2, t3, t4, time.perf_counter_ns()), shared,
                                      expected, laps, late))
        if self.done:
            self.ended = True

    def wake(self) -> None:
        """Called by the leader (under the batcher's lock: one waker at a time)."""
        if self._signal.locked():
            self._signal.release()

    def wait(self) -> None:
        """The request's thread: until the leader's next wake (one may already be there)."""
        self._signal.acquire()

    def park(self) -> None:
        self.parked = self.ended = True

    def cancel(self) -> None:
        self.ended = True

    def _fail(self, e: BaseException, ids) -> None:
        self.err, self.err_ids, self.ended = e, ids, True


def maint_end(chains):
    """Where these traced chains' maintenance just launched (one shared forward, or one chain's)
    ends: the event behind the maintenance made ahead of their verify's readback where they all
    share it (chain_drafts.py pre_maintain); else None where their next step already runs
    (launched ahead: an event now would sit behind that step; their maintenance was host work
    then, EAGLE-3's); else an event recorded now (phase/late_stamps.py); else (off CUDA, or a
    chain with no step read back yet) None after draining the stream."""
    timed = [ch for ch in chains if ch.timed]
    pre = {id(ch._pre_ev): ch._pre_ev for ch in timed}
    if len(pre) == 1 and None not in pre.values():
        return next(iter(pre.values()))
    if all(ch.anchored for ch in timed):
        if any(ch.inflight is not None for ch in timed):
            return None
        ev = device_mark()
        if ev is not None:
            return ev
    chains[0].drafter.drain()
    return None


def _ahead_where_accepted(job: Job) -> bool:
    """A verify launched ahead (verify_ahead.py) started where the host accepted the round
    before: the start it was packed at, moved by the device's acceptance, is the start the host
    gave it (`Chain.adopt_ahead`). Else its rows were written at positions the host did not
    accept, and the request fails."""
    dd, row, packed = job.ahead
    return packed + dd.accepted(row) == job.start


def accept_sampled_rounds(rounds: list) -> None:
    """The step's sampled rounds (`rounds`: (chain, job) of every settling round) accepted
    together on the device before each settles: their target distributions in one pass
    (`probs_rows`, each row its request's parameters), each request's K + 1 uniforms from its
    generator (as `accept_sampled` takes them alone), `accept_sampled_many`'s one readback for
    all, not K + 1 logit rows and K draft rows copied to the host a request. Each chain's
    `settle` takes its result (an error: every one of these rounds fails with it)."""
    todo = [(ch, job) for ch, job in rounds if not ch.greedy and not ch.drawn and job.err is None and job.ahead is None
            and job.out is not None and ch._drafts is not None and job.out.shape[0] > len(ch._drafts)]
    if not todo:
        return
    try:
        ks = [len(ch._drafts) for ch, _ in todo]
        sps = [ch.sp for ch, _ in todo]
        dev = todo[0][1].out.device
        rows = to_device(torch.tensor([[sp.temperature, sp.top_k, sp.top_p] for sp, k in zip(sps, ks)
                                       for _ in range(k + 1)], dtype=torch.float64), dev)
        P = probs_rows(torch.cat([job.out[:k + 1] for (_, job), k in zip(todo, ks)]), rows[:, 0], rows[:, 1].long(),
                       rows[:, 2], filters=row_filters(sps))
        got = accept_sampled_many(list(P.split([k + 1 for k in ks])), [ch._q for ch, _ in todo],
                                  [torch.tensor(ch._drafts, dtype=torch.long) for ch, _ in todo],
                                  [uniforms(ch.gen, k + 1) for (ch, _), k in zip(todo, ks)])
    except BaseException as e:  # noqa: BLE001 (each of these rounds fails with it, in its settle)
        got = [e] * len(todo)
    for (ch, _), g in zip(todo, got):
        ch._accepted = g
