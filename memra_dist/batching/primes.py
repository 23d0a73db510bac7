"""New requests' drafters allocated and primed by the engine loop, many in one forward.

A batched request's tap drafter (DFlash, EAGLE-3, MTP: `Drafter.loop_prime`) reads the target's
hidden states of its prompt, which the prefill steps wrote; its allocation (a slot of the draft
pool) and its prime (each prompt row's features and draft K/V) are device work. Run by each
request's own thread, 64 requests' primes were 64 threads launching small kernels beside the
loop (an H100 profile of DFlash at 64 concurrent showed the device idle 0.38 of the run, the
primes' launches on request threads between the steps). Here the request queues a `Prime` and
waits for its rounds (it streams its first token meanwhile); the loop, before it leads the next
step, takes every queued prime, allocates each drafter and primes those of one class and network
together (`prime_all`: DFlash's ingests and EAGLE-3's K/V rows packed across requests up to the
target's prefill chunk of rows, specdec/chunks.py `pack_chunks`), then proposes their chains'
first rounds together (`start_chains`). A prime that fails ends its own request only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..specdec.drafters.base import prime_all
from .chain_drafts import propose_rounds
from .loop_rounds import choose_first_k, queue_or_park

__all__ = ["Prime", "run_primes", "groups", "run_due", "start_chains", "due_in"]


@dataclass(eq=False)
class Prime:
    rid: object
    drafter: object
    prompt: list[int]
    chunks: list[tuple[int, int]] | None
    capacity: int
    chain: object  # its request's chain (chain.py), whose first round the loop proposes after the prime
    rows: int = 0  # a shared prime's forwards take at most this many prompt rows (the target's prefill chunk)
    err: BaseException | None = None
    t: int = field(default_factory=time.perf_counter_ns)


def groups(primes: list[Prime]) -> list[list[Prime]]:
    """The primes whose drafters share a class and a network (`batch_key`), in arrival order
    of each group's first.

    >>> class A:
    ...     batch_key = "net"
    >>> class B:
    ...     batch_key = "net"
    >>> ps = [Prime(i, d, [1], None, 8, None) for i, d in enumerate([A(), B(), A()])]
    >>> [[p.rid for p in g] for g in groups(ps)]
    [[0, 2], [1]]
    """
    out: dict = {}
    for p in primes:
        out.setdefault((type(p.drafter), id(p.drafter.batch_key)), []).append(p)
    return list(out.values())


def run_primes(primes: list[Prime]) -> None:
    """Every prime's drafter allocated, then each group primed together; an error ends its own
    prime (a group that fails is primed again one by one, so only the one at fault fails)."""
    for p in primes:
        try:
            p.drafter.alloc(p.capacity)
        except BaseException as e:  # noqa: BLE001 (its own request's error)
            p.err = e
    for g in groups([p for p in primes if p.err is None]):
        try:
            prime_all([p.drafter for p in g], [p.prompt for p in g], [p.chunks for p in g], min(p.rows for p in g))
        except BaseException as e:  # noqa: BLE001
            if len(g) == 1:
                g[0].err = e
                continue
            for p in g:
                try:
                    p.drafter.prime(p.prompt, p.chunks)
                except BaseException as e:  # noqa: BLE001
                    p.err = e


def due_in(b) -> float:
    """Seconds until batcher `b`'s queued primes should run (<= 0: now): once every request whose
    prompt's last chunk ran (`b.priming`) has queued its prime (they come back from that step
    one after another: primed together, one forward), or after the batcher's wait without a
    new one."""
    if b.priming <= {p.rid for p in b.primes}:
        return 0.0
    quiet = max(b.last_prime, b.last_end)
    return (quiet + b.max_wait_s * 1e9 - time.perf_counter_ns()) / 1e9


def run_due(b) -> None:
    """Called by batcher `b`'s loop holding its lock, no step running: every queued prime run
    (unlocked), its request woken, then the chains handed with them started (`start_chains`)."""
    primes, b.primes = b.primes, []
    b.priming -= {p.rid for p in primes}
    b.priming_now = {p.rid for p in primes}  # (a request leaving meanwhile waits: Residency.leave)
    t = time.perf_counter_ns()
    b.cv.release()
    try:
        run_primes(primes)
    finally:
        b.cv.acquire()
        b.priming_now = set()
    b.stats.primes += len(primes)
    b.stats.prime_runs += 1
    b.stats.prime_ns += time.perf_counter_ns() - t
    for p in primes:
        if p.err is not None:  # its request raises it from its next take
            p.chain.err, p.chain.ended = p.err, True
            b._wakes.append(p.chain)
    b.cv.notify_all()  # (a request leaving waits for its prime: Residency.leave)
    start_chains(b, [p.chain for p in primes if p.err is None])


def start_chains(b, chains: list) -> None:
    """Called holding batcher `b`'s lock (as the rounds after a step are, loop_rounds.py): new
    requests' chains, their drafters primed: each one's K (--spec-k auto), their first rounds
    proposed together (chain_drafts.py) and queued for the next step, or a chain parked where
    its request cannot hold the rows (preempted meanwhile, no free block): its thread runs that
    round itself. A bug on the way (their K, their proposals) ends these requests with it: their
    rounds are in no queue the loop's own failure path reaches, so they would wait for good."""
    chains = [ch for ch in chains if not ch.ended and ch.rid in b.admitted]
    if not chains:
        return
    try:
        if b.auto_k:
            for ch in chains:
                ch.acc = b.acceptance.start(ch.rid, ch.k)
            choose_first_k(b, chains)
        jobs = propose_rounds(chains, b.stats)
    except BaseException as e:  # noqa: BLE001 (ends these requests only)
        for ch in chains:
            ch.err, ch.ended = e, True
            b._wakes.append(ch)
        return
    for ch, job in zip(chains, jobs):
        if job is not None:  # (else its proposal failed: the chain ended with the error)
            try:
                queue_or_park(b, ch, job, b._queue)
                if not ch.parked:
                    continue
            except BaseException as e:  # noqa: BLE001 (the engine closed meanwhile: its request ends with it)
                ch.err, ch.ended = e, True
        b._wakes.append(ch)
