"""New requests' drafters allocated and primed by the engine loop, many in one forward.

A batched request's tap drafter (DFlash, EAGLE-3, MTP: `Drafter.loop_prime`) reads the target's
hidden states of its prompt, which the prefill steps wrote; its allocation (a slot of the draft
pool) and its prime (each prompt row's features and draft K/V) are device work. Run by each
request's own thread, 64 requests' primes were 64 threads launching small kernels beside the
loop (an H100 profile of DFlash at 64 concurrent showed the device idle 0.38 of the run, the
primes' launches on request threads between the steps). Here the request queues a `Prime` and
waits; the loop, before it leads the next step, takes every queued prime, allocates each
drafter and primes those of one class and network together (`prime_all`: DFlash's ingests and
EAGLE-3's K/V rows packed across requests up to the largest chunk's rows, specdec/chunks.py
`pack_chunks`), then wakes their threads. A prime that fails ends its own request only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..specdec.drafters.base import prime_all

__all__ = ["Prime", "run_primes", "groups"]


@dataclass(eq=False)
class Prime:
    rid: object
    drafter: object
    prompt: list[int]
    chunks: list[tuple[int, int]] | None
    capacity: int
    chain: object = None  # its request's chain (chain.py), whose first round the loop proposes after the prime
    kv_mb: float = 0.0  # what the drafter's allocation returned (the profile's draft_kv_mb)
    err: BaseException | None = None
    done: bool = False
    t: int = field(default_factory=time.perf_counter_ns)


def groups(primes: list[Prime]) -> list[list[Prime]]:
    """The primes whose drafters share a class and a network (`batch_key`), in arrival order
    of each group's first.

    >>> class A:
    ...     batch_key = "net"
    >>> class B:
    ...     batch_key = "net"
    >>> ps = [Prime(i, d, [1], None, 8) for i, d in enumerate([A(), B(), A()])]
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
            p.kv_mb = p.drafter.alloc(p.capacity)
        except BaseException as e:  # noqa: BLE001 (its own request's error)
            p.err = e
    for g in groups([p for p in primes if p.err is None]):
        try:
            prime_all([p.drafter for p in g], [p.prompt for p in g], [p.chunks for p in g])
        except BaseException as e:  # noqa: BLE001
            if len(g) == 1:
                g[0].err = e
                continue
            for p in g:
                try:
                    p.drafter.prime(p.prompt, p.chunks)
                except BaseException as e:  # noqa: BLE001
                    p.err = e
    for p in primes:
        p.done = True

