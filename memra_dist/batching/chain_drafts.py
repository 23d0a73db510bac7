"""The drafter work of the step leader's chained rounds (chain.py), request by request or, for a
drafter that drafts many requests in one forward, the step's requests together.

Right after a step the leader settles every chained request's round (acceptance, commit,
rollback: host work), then maintains each one's drafter and proposes its next drafts. A host
drafter (none, ngram, replay) does that per request on host lists. A tap drafter whose class
says `batched = True` (DFlash: dflash_batch.py) has both done for every chained request of the
step that shares its network, in ONE draft forward each: one ingest of all their verified
rows, one block forward of all their blocks, one readback of all their drafts. Each request's
attention still reads only its own draft K/V, so its drafts are the drafts it makes alone.

A failure in a request's own drafter ends that request's chain only; a failure in a shared
forward ends the chains that took part in it (each session raises it as it would its own).
"""

from __future__ import annotations

import sys
import time

from ..device import device_mark
from ..specdec.drafters.base import PARK
from .chain import maint_end

__all__ = ["maintain_rounds", "pre_maintain", "draft_early", "propose_rounds", "drop_pre"]


def _groups(chains, proposing: bool) -> list[tuple[list, bool]]:
    """Chains in groups that draft together, each with whether it runs the shared forward: those
    whose drafters batch and share a network (first-seen order; one alone too, so it replays the
    shared forward's graphs rather than its eager solo path), each other chain alone. At K 0
    (--spec-k auto) a chain goes alone: it drafts nothing (`proposing`), and skips its
    maintenance where its drafter catches up; so does a round the n-gram lookup drafts
    (--ngram-first: on the host)."""
    out: list[tuple[list, bool]] = []
    by_net: dict[int, list] = {}
    for ch in chains:
        d = ch.drafter
        if d.batched and (ch.draft_k() > 0 and not ch.host_round() if proposing else not ch.skips_maint()):
            key = id(d.batch_key)
            if key not in by_net:
                by_net[key] = []
                out.append((by_net[key], True))
            by_net[key].append(ch)
        else:
            out.append(([ch], False))
    return out


def _fail(group, e: BaseException) -> None:
    for ch in group:
        ch.err, ch.ended = e, True


def _alone(chains) -> bool:
    """No chain's drafter drafts with others (host drafters: the common case at 64 requests a
    step, kept to a plain loop on the leader's path between steps)."""
    return not any(ch.drafter.batched for ch in chains)


def pre_maintain(jobs) -> int:
    """Right behind a step, before its readback: the chained rounds whose drafter
    maintains ahead (`pre_maintains`: DFlash, dflash_batch.py pre_ingest_many) have their verify
    rows ingested now, whatever the acceptance, one shared forward a drafter class; their
    maintenance after the accept then finds its rows done. An error here leaves the rounds to
    their usual maintenance (one warning).
    Returns the rounds pre-maintained. A traced round takes part where the device records timing
    events (`Chain.anchored`): its maint phase ends at an event behind the shared ingest."""
    groups: dict[type, list] = {}
    timed = []
    for j in jobs:
        ch = j.chain
        if (ch is None or ch.ended or j.void or (ch.timed and not ch.anchored) or j.n < 2
                or not ch.drafter.pre_maintains):
            continue
        groups.setdefault(type(ch.drafter), []).append((ch.drafter, (j.start, j.start + j.n)))
        if ch.timed:
            timed.append(ch)
    done = _ahead(groups, lambda cls, ds, rows: cls.pre_maintain_many(ds, rows), "pre-maintenance", "maintained")
    _events_behind(timed, early=False)
    return done


def _events_behind(chains, early: bool) -> None:
    """These traced chains' work made ahead (the maintenance, or `early`: the next drafts) ends at
    one event recorded now, behind it: where their phase ends (chain.py `_pre_ev` / `_early_ev`)."""
    made = [ch for ch in chains if getattr(ch.drafter, "early" if early else "pre", None) is not None]
    ev = device_mark() if made else None
    for ch in made:
        if early:
            ch._early_ev = ev
        else:
            ch._pre_ev = ev


def _ahead(groups: dict, run, what: str, after: str) -> int:
    """`run(cls, drafters, their items)` for each drafter class's group of work done ahead of the
    readback -> how many it did. A failure is an optimisation lost: the group's drafters forget
    what was made ahead, and their rounds are `after` their accept as usual (one warning a kind)."""
    done = 0
    for cls, items in groups.items():
        try:
            done += run(cls, [d for d, _ in items], [v for _, v in items])
        except Exception as e:  # noqa: BLE001 (the maintenance / proposal after the accept still runs)
            for d, _ in items:
                d.drop_pre()
            if what not in _WARNED:
                _WARNED.add(what)
                print(f"[memra] {what} failed ({type(e).__name__}: {e}); rounds {after} after their accept",
                      file=sys.stderr, flush=True)
    return done


_WARNED: set = set()


def draft_early(jobs, pred, ids) -> int:
    """Right behind `pre_maintain`, before the step's readback: the greedy rounds whose
    drafter drafts early (`drafts_early`: DFlash, whose verify rows pre_maintain ingested,
    dflash_batch.py draft_early_many; EAGLE-3, eagle3_batch.py) have
    their next round's drafts made now, the acceptance found on the device from the step's
    argmax rows `pred` and input ids `ids`, one shared forward a drafter class; the proposal
    after the accept takes them where the request goes on as the device accepted (an ended
    request's are dropped). The device then drafts while the loop reads back and accepts. An
    error here leaves the rounds to their usual proposal (one warning). Returns the rounds
    drafted."""
    if ids is None:
        return 0
    groups: dict[type, list] = {}
    timed = []
    p = i = 0
    for j in jobs:
        ch = j.chain
        if (ch is not None and not ch.ended and not j.void and ch.greedy and not (ch.timed and not ch.anchored)
                and j.n >= 2 and ch.drafter.drafts_early):
            groups.setdefault(type(ch.drafter), []).append((ch.drafter, (j.start, p, i, j.n - 1)))
            if ch.timed:
                timed.append(ch)
        p += 1 if j.last else j.n
        i += j.n
    done = _ahead(groups, lambda cls, ds, verify: cls.draft_early_many(ds, verify, pred, ids), "early drafting",
                  "drafted")
    _events_behind(timed, early=True)
    return done


def drop_pre(chains) -> None:
    """What `pre_maintain` and `draft_early` made for these chains' drafters served this step's
    maintenance and proposals only (a round that skipped them, K 0 next, catches up later on its
    rows as committed then)."""
    for ch in chains:
        if ch.drafter.pre_maintains or ch.drafter.drafts_early:
            ch.drafter.drop_pre()
        ch._pre_ev = ch._early_ev = None


def maintain_rounds(chains) -> list:
    """Each settled chain's drafter maintained and its round handed over (chain.Chain.maintained);
    returns the chains whose maintenance did not fail."""
    ok = []
    if _alone(chains):
        for ch in chains:
            try:
                ch.maintained()
                ok.append(ch)
            except BaseException as e:  # noqa: BLE001 (a drafter's error ends its own request only)
                ch.err, ch.ended = e, True
        return ok
    for group, shared in _groups(chains, False):
        try:
            if shared:
                t4 = time.perf_counter_ns()
                d0 = group[0].drafter
                type(d0).maintain_many([ch.drafter for ch in group], [ch.tokens for ch in group])
                ev = None
                if d0.device is not None and any(ch.timed for ch in group):  # (recorded rounds only: the
                    ev = maint_end(group)  # shared ingest's device time ends in the maint phase, not the next draft)
                for ch in group:
                    ch.maintained(t4, ev)
            else:
                group[0].maintained()
            ok.extend(group)
        except BaseException as e:  # noqa: BLE001 (a drafter's error ends its own requests only)
            _fail(group, e)
    return ok


def propose_rounds(chains, stats=None) -> list:
    """Each chain's next verify job (chain.Chain.next_job), its drafts proposed in its group's
    one forward; None for a chain whose proposal failed (its chain ended with the error).
    `stats` (the batcher's BatchStats) counts the shared draft forwards and the proposals in them."""
    if _alone(chains):
        out = []
        for ch in chains:
            try:
                out.append(ch.next_job())
            except BaseException as e:  # noqa: BLE001
                ch.err, ch.ended = e, True
                out.append(None)
        return out
    jobs: dict[int, object] = {}
    for group, shared in _groups(chains, True):
        try:
            if shared:
                t0 = time.perf_counter_ns()
                cls = type(group[0].drafter)
                # greedy drafts stay on the device for the next verify: the loop then packs and
                # launches it while the draft runs; a traced round's draft phase ends at an event
                # behind the forward (before its chain's first step is read back, or off CUDA: its
                # drafts read back first, so its draft phase ends with them on the host)
                defer = group[0].drafter.defers and all(ch.anchored for ch in group if ch.timed)
                props = cls.propose_many(
                    [ch.drafter for ch in group], [ch.tokens for ch in group], [ch.draft_k() for ch in group],
                    [ch.sp for ch in group], [ch.gen for ch in group], **({"defer": True} if defer else {}))
                drafted = device_mark() if defer and any(ch.timed for ch in group) else None
                for ch, prop in zip(group, props):
                    if prop is PARK:  # no room for its drafter's rows now: its session drafts this round
                        ch.park()
                        if stats is not None:
                            stats.parks += 1
                        continue
                    jobs[id(ch)] = ch.next_job(prop, t0, len(group), drafted)
                if stats is not None:
                    stats.draft_batches += 1
                    stats.draft_batched += len(group)
            else:
                jobs[id(group[0])] = group[0].next_job()
        except BaseException as e:  # noqa: BLE001
            _fail(group, e)
    return [jobs.get(id(ch)) for ch in chains]
