"""What the engine loop does for the chained requests right after each step (batcher.py
`_end_step` calls `chain_rounds` holding the batcher's lock): each round settled (accept,
commit, rollback as a block trim: chain.py), every settled chain's drafter maintained and its
next drafts proposed (chain_drafts.py: a batched drafter's requests in one forward), with
--spec-k auto each request's K chosen first (`choose_k`: specdec/spec_k.py; a request at K 0
whose drafter catches up later skips its maintenance: plain decoding's cost), and the next
verify rows queued for the very next step, or the chain parked where its blocks cannot grow.
`b`: the Batcher."""

from __future__ import annotations

import time

from ..device import device_mark
from ..specdec.spec_k import Others, choose
from .chain import accept_sampled_rounds
from .chain_drafts import drop_pre, maintain_rounds, propose_rounds
from .job import Job

__all__ = ["chain_rounds", "choose_k", "choose_first_k", "queue_or_park", "CHOOSE_SAMPLED", "REMEASURE_STEPS", "REMEASURE_MAX"]

# A sampled request's draws depend on its K (each draft and each acceptance takes its generator's
# next numbers), so a K chosen by the step's load would make its seeded output depend on what
# else the engine runs. It keeps -k every round; greedy requests, whose ids are the target's
# whatever K, are the ones auto chooses for. (True: sampled requests choose too, still keeping
# the target's distribution: tests/test_sampling_distribution.py.)
CHOOSE_SAMPLED = False


def chain_rounds(b, jobs: list[Job]) -> None:
    """Called holding the lock, right after a step: each chained job's round (accept,
    commit, rollback as a block trim), then every settled chain's drafter maintained and its
    next verify rows proposed (chain_drafts.py: the step's DFlash requests in one forward
    each) and queued for the next step, or the chain parked where its blocks cannot grow
    (chain.py)."""
    if b.draft_seen is not None:  # the drafting before this step, left on the device: its cost now
        _observe_deferred(b)
    settled, touched = [], []
    accept_sampled_rounds([(j.chain, j) for j in jobs if j.chain is not None and not j.chain.ended and not j.void])
    for j in jobs:
        ch = j.chain
        if ch is None or ch.ended or j.void:  # not chained, its request left, or a row past its end
            continue
        touched.append(ch)
        try:
            keep = ch.settle(j)
            if keep is None:
                continue
            if b.pool.holds(ch.rid) and ch.inflight is None:  # (ahead: its next row is the kept one)
                b.pool.shrink(ch.rid, keep)
            settled.append(ch)
        except BaseException as e:  # noqa: BLE001 (ends its own request only)
            ch.err, ch.ended = e, True
    going = []
    if b.auto_k:  # the next rounds' K first: a K-0 round's drafter may skip its maintenance (chain.py)
        live = [ch for ch in settled if not ch.done]
        choose_k(b, live)  # (one launched ahead: for the round after it)
        for ch in live:  # a host drafter's K-0 round still measures what drafting would get
            if ch.k_step == 0 and ch.shadow():
                b.stats.shadows += 1
    t = time.perf_counter_ns()
    # where the drafting's device work begins (the device's wait for the loop ends: device_idle.py;
    # --spec-k auto: the cost of a drafting whose drafts stay on the device)
    mark = device_mark() if any(not ch.drafter.host_only for ch in settled) else None
    b.idle.drafting(mark)
    maintained = maintain_rounds(settled)
    t2 = time.perf_counter_ns()
    b.stats.maint_ns += t2 - t
    for ch in maintained:
        b.stats.chained += 1
        if ch.ended:
            b.finished.add(ch.rid)
        elif ch.inflight is not None:  # its next round already runs, one step ahead (ahead.py)
            job, ch.inflight = ch.inflight, None
            if job.ahead is not None:  # ... a verify (verify_ahead.py)
                if not ch.adopt_ahead(job):  # (the device accepted otherwise: the request fails)
                    job.void = True
                    b.stats.voids += 1
                elif b.auto_k:
                    count_k(b, ch, job.n - 1)
                continue
            ch.adopt(job)
            if b.auto_k and not ch.never_drafts:  # a K-0 round (counted now: its K is the one it runs)
                count_k(b, ch, 0)
        else:
            going.append(ch)
    if b.auto_k:  # each round counted once, under the K it drafts with (a K chosen while the
        for ch in going:  # round before ran ahead was chosen again once that round came in)
            if ch.k_step is not None:
                count_k(b, ch, max(ch.draft_k(), 0))
    proposed = propose_rounds(going, b.stats)
    drop_pre(settled)
    if mark is not None:
        b.idle.drafted(device_mark())  # (on the device: fires as the drafting's last kernel is done)
    t3 = time.perf_counter_ns()
    b.stats.draft_ns += t3 - t2
    if b.auto_k:  # drafting's time: the maintenance (skipped at K 0) and the proposals
        seen = (sum(ch.k_step or 0 for ch in going), t3 - t, sum(bool(ch.k_step) for ch in going))
        left = {id(j.drafts.dev[0]): j.drafts.dev[0] for j in proposed if j is not None and j.drafts is not None}
        if left and mark is not None:  # drafts left on the device: their time is the device's, read
            b.draft_seen = (*seen, mark, list(left.values()))  # after the next step (nothing waits now)
        else:
            b.cost.observe_draft(*seen)
    for ch, nxt in zip(going, proposed):
        if nxt is None:
            continue  # its proposal failed: the chain ended with the error
        queue_or_park(b, ch, nxt, b.pending.append)
    for ch in touched:
        if ch.inflight is not None and ch.ended:  # its row launched ahead runs past its end: dropped
            ch.inflight.void, ch.inflight = True, None
            b.stats.voids += 1
        b._wakes.append(ch)  # woken once the next step is launched (Batcher._flush_wakes)


def _observe_deferred(b) -> None:
    """--spec-k auto: the drafting after the step before left its drafts on the device, so the
    loop's host time did not wait for it; its cost is the longer of that host time and the
    device's, from the maintenance's start to the drafts' copy (their events are done: the step
    just read back ran behind them)."""
    tokens, host_ns, reqs, mark, left = b.draft_seen
    b.draft_seen = None
    dev = [ns for ns in (dd.ns_since(mark) for dd in left) if ns is not None]
    b.cost.observe_draft(tokens, max([host_ns, *dev]), reqs)


def queue_or_park(b, ch, job: Job, add) -> None:
    """Called holding the lock: chain `ch`'s next verify rows `job` handed to `add` where its
    request's blocks hold them or grow to (never waiting: the loop's own path), else the chain
    parks: its thread submits that round itself (waits for blocks, or preempts; swaps back in
    a request preempted meanwhile)."""
    end = job.start + job.n
    if b.pool.holds(ch.rid) and (b.pool.capacity(ch.rid) >= end or b.pool.grow(ch.rid, end)):
        add(job)
    else:
        b.stats.parks += 1
        ch.park()


def choose_first_k(b, chains: list) -> None:
    """Called holding the lock as new chains start (their first rounds proposed before any step
    of the loop holds them: by the loop after their drafters' prime, primes.py `start_chains`,
    else on the request's thread, `start_chain`): their K chosen together, as requests joining
    the step of the others as those run now (`_others`: their queued rows, their drafting), from
    each one's acceptance (the engine's, for a new request), counted as the loop counts each
    round's K. A request the engine would not draft for starts plainly (its first verify is its
    pending token alone). Weighed against the others at K 0 instead, one new request's drafts
    had to pay the whole drafting step alone: at 64 DFlash requests every request's first round
    went plain."""
    new = [ch for ch in chains if not ch.never_drafts and (ch.greedy or CHOOSE_SAMPLED)]
    if not new:
        return
    ks = choose([(ch.acc, max(ch.draft_k(), 0)) for ch in new], b.cost, _others(b, {ch.rid for ch in new}))
    for ch, k in zip(new, ks):
        ch.k_step = k
        count_k(b, ch, k)


def _others(b, mine: set) -> Others:
    """The step the new requests `mine` join: every other admitted request's rows queued for the
    next step (else running now; else one decode row), the tokens they are expected to give
    and drafting's x for them (StepCost.per_request: the drafting requests, else the drafts)."""
    rows, tokens, drafting = 0, 0.0, 0
    seen = set(mine)
    for j in (*b.pending, *b.running_jobs):
        if j.rid in seen:
            continue
        seen.add(j.rid)
        ch, k = j.chain, j.n - 1
        rows += j.n
        if ch is None or ch.never_drafts or ch.acc is None or k <= 0:
            tokens += 1.0
            continue
        tokens += 1.0 + ch.acc.expected(k)
        drafting += 1 if b.cost.per_request else k
    n = sum(1 for rid in b.admitted if rid not in seen)  # (prefilling, or between submissions)
    return Others(rows + n, tokens + n, drafting)


def count_k(b, ch, k: int) -> None:
    """A round's K counted as it starts (--spec-k auto); apart, a round the engine cut below its
    bound (-k within the request's room: `k_cut_rounds`, `k_cut_drafts`), its own choice, unlike
    a request's last rounds, which draft less because fewer tokens are left."""
    b.stats.k_chosen[k] = b.stats.k_chosen.get(k, 0) + 1
    cut = max(ch.bound(), 0) - k
    if cut > 0:
        b.stats.k_cut += 1
        b.stats.k_cut_drafts += cut


# After this many steps in a row whose every chosen K was 0 (a network drafter's requests among
# them), up to REMEASURE_MAX such requests (those re-measured longest ago first) draft their next
# round at their bound: at K 0 a network's drafts are never made, so nothing measures them (a
# request's average moves only on drafted rounds), and an acceptance learned low (a
# continuation's first tokens, a drafter that became worth it) would hold every request at K 0
# for good; where the step is a full graph bucket, a probe request alone never pays the next
# bucket's jump. They draft together, in one shared forward (a chain whose K-0 round already runs
# ahead keeps the flag until it drafts), and their rounds feed the engine's acceptance, which
# later requests start from. Its cost: at most one drafting step in this many, and each drafter's
# catch-up on the rows it skipped (hence the cap: 64 DFlash requests' catch-ups in one step stalled
# it ~100 ms on an H100). A host drafter (n-gram) needs none: its K-0 rounds propose anyway,
# unverified, and score the drafts against the tokens that come (chain.py `shadow`).
REMEASURE_STEPS = 128
REMEASURE_MAX = 8


def choose_k(b, chains) -> None:
    """--spec-k auto: each chain's K for its next round, by the step's expected goodput
    (specdec/spec_k.py choose), its bound the K it would take otherwise; after REMEASURE_STEPS
    all-K-0 steps, up to REMEASURE_MAX network drafters' requests at their bound (`b.k0_steps`
    counts those steps; the stats count the re-measures)."""
    drafting = [ch for ch in chains if not ch.never_drafts and (ch.greedy or CHOOSE_SAMPLED)]  # (drafter none: a plain row)
    for ch in drafting:
        ch.k_step = None
    # --ngram-first's lookup rounds draft at their bound: their drafts cost no drafting time and
    # their acceptance is not the network's, which may have taught the chooser K 0 (the lookup
    # would then never draft); their rows count as the step's others
    lookup = [ch for ch in drafting if ch.host_round()]
    if lookup:
        drafting = [ch for ch in drafting if ch not in lookup]
        for ch in lookup:
            ch.k_step = max(ch.draft_k(), 0)
    others = Others(sum(ch.k_step + 1 for ch in lookup), sum(1.0 + ch.acc.expected(ch.k_step) for ch in lookup), 0)
    bounds = [max(ch.draft_k(), 0) for ch in drafting]
    ks = choose([(ch.acc, bound) for ch, bound in zip(drafting, bounds)], b.cost, others if lookup else None)
    if any(ks):
        b.k0_steps = 0
    elif any(bound for ch, bound in zip(drafting, bounds) if not ch.drafter.host_only):
        b.k0_steps += 1
        if b.k0_steps >= REMEASURE_STEPS:
            b.k0_steps = 0
            b.stats.remeasures += 1
            net = [ch for ch, bound in zip(drafting, bounds) if bound and not ch.drafter.host_only]
            for ch in sorted(net, key=lambda c: c.remeasured)[:REMEASURE_MAX]:  # (stable: the earliest first)
                ch.remeasure, ch.remeasured = True, b.stats.remeasures
    for ch, k, bound in zip(drafting, ks, bounds):
        ch.k_step = bound if ch.remeasure and bound > 0 else k  # (counted by chain_rounds as the round starts with it)
