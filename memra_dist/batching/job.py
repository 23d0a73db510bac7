"""One request's rows submitted to a batch step (`Job`), what its rows saw of the step
(`BatchStep`), and a step launched (`Launched`): the batcher's (batcher.py) and the step
graphs' (graphs.py) common records."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

__all__ = ["BatchStep", "Job", "Launched"]


@dataclass(slots=True)
class BatchStep:
    """What one request's rows saw of the step they rode in (its spans carry it: every request
    of a step names the same `id`). Made for every job of every step on the loop's path before
    the rounds, so slotted, not frozen (a frozen dataclass sets each field through
    object.__setattr__: ~6x the time); nothing writes it after."""

    id: int
    requests: int
    rows: int
    wait_ns: int  # from the request's submission to the step's start (waiting for the others, or a running step)
    forward_ns: int  # the step's forward, from its launch to its device work done
    kv_used: int = 0  # the pool's blocks in use / free after the step
    kv_free: int = 0
    preempted: int = 0  # requests the engine had preempted by then (swapped out), in all
    kv_cached: int = 0  # blocks the prefix cache holds (in use or evictable) after the step
    evictions: int = 0  # cached blocks evicted so far (prefix caching: the pool was short)
    t0: int = 0  # perf_counter ns when the step's forward was launched
    predicted_ns: int = 0  # --spec-k auto: the step's time its cost line predicted for its rows (0: none)
    # the device idle before the step: from the previous step's end to this one's launch, when a
    # request rode both (0: launched ahead, behind a running step) ...
    gap_ns: int = 0
    rounds_ns: int = 0  # ... of it, the loop's rounds after the previous step (accept, drafters, next drafts)
    held_ns: int = 0  # ... and the loop holding this step back for a request still on the host
    spans: object = None  # the engine's StepIds: the step's span ids, and which steps' spans are made


@dataclass
class Job:
    rid: object
    ids: torch.Tensor | list[int]  # a chained round's are a host list (no tensor made for a graphed step)
    start: int
    width: int
    last: bool
    t: int = field(default_factory=time.perf_counter_ns)  # submitted
    out: torch.Tensor | None = None
    err: BaseException | None = None
    done: bool = False
    step: BatchStep | None = None
    greedy: tuple[list, list] | None = None  # its rows' argmax and the logit at it (host)
    taps: object = None  # the request's TapSink (a tap drafter's), written by the step
    chain: object = None  # the request's Chain (chain.py) when the leader runs its rounds
    void: bool = False  # a row launched ahead past its request's end (ahead.py): its output is dropped
    timer: object = None  # level 2: the round's SubsplitTimer (chain.py lap_timer): its step's laps (graphs.py's timed twin, or laps.py)
    primes: bool = False  # its prompt's last chunk, and its drafter primes on the loop after it (primes.py)
    now: bool = False  # due at once (batcher.py submit_many: a chained drafter's step, no other rows to wait for)
    # its drafts (rows 1 ..) as a Proposal still on the device (`Proposal.dev`); `ids` holds
    # placeholders there until `host_ids` (the step writes them on the device: step_forward.py DraftPatch)
    drafts: object = None
    # a verify launched before the round it follows was read back (verify_ahead.py): (DeviceDrafts,
    # row, the start it was packed at), moved on the device by the acceptance found there
    ahead: object = None
    argmax: int = -1  # ... a plain row launched beside such verifies: its input's row of the step's argmax
    # (host ns when the step's readback wait returned, the readback's event): the device clock of
    # events the loop records behind the step, on the host's (phase/late_stamps.py); None off CUDA
    anchor: tuple | None = None

    def __post_init__(self):
        self.n = len(self.ids)  # its rows

    def host_ids(self) -> list:
        """Its ids with its drafts read back (a wait for their draft forward, where on the device)."""
        if self.drafts is not None:
            self.ids[1:] = self.drafts.host(self.n - 1)
            self.drafts = None
        return self.ids


@dataclass
class Launched:
    """A step launched: its logits, its rows' argmax and the logit at it as one float64 row
    (the readback), the argmax on the device (the ids of a step launched behind it), and
    whether it replayed a graph, and its rows' input ids on the device (None: not kept)."""

    logits: torch.Tensor
    pv: torch.Tensor
    pred: torch.Tensor
    graphed: bool
    ids: torch.Tensor | None = None
