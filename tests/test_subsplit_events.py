"""Level 2 on the graphed path: the laps a captured step records (device-clock stamps, or CUDA
events where Triton is missing) add up to the same buckets the drained eager timer gives for
the same walk."""

from __future__ import annotations

import memra_dist.phase.subsplit as subsplit
import pytest
import torch

from memra_dist.phase.subsplit import EventMarks, StampMarks, SubsplitTimer

# one verify walk over two blocks: a KDA block (with its scan) and an attention block;
# (call, argument, the device clock in ns when the call's boundary is reached)
WALK = [("begin", None, 0), ("scan_begin", None, 1_000), ("scan_end", None, 3_000), ("lap", "kda", 4_000),
        ("lap", "ffn", 6_000), ("begin", None, 6_000), ("lap", "attn", 9_000), ("lap", "ffn", 9_500)]
# (nothing runs between two blocks of a walk: a begin follows the lap before it at once)


class _FakeEvent:
    clock = 0
    synced = 0

    def record(self):
        self.t = _FakeEvent.clock

    def synchronize(self):
        _FakeEvent.synced += 1

    def elapsed_time(self, end) -> float:  # ms, as torch.cuda.Event gives it
        return (end.t - self.t) / 1e6


def _walk(timer, set_clock):
    for call, arg, t in WALK:
        set_clock(t)
        getattr(timer, call)(*([arg] if arg else []))


def test_event_laps_equal_the_drained_laps(monkeypatch):
    now = [0]
    monkeypatch.setattr(subsplit.time, "perf_counter_ns", lambda: now[0])
    drained = SubsplitTimer(drain=lambda: None)
    _walk(drained, lambda t: now.__setitem__(0, t))

    marks = EventMarks(_FakeEvent)
    _walk(marks, lambda t: setattr(_FakeEvent, "clock", t))  # the capture: events recorded in order
    replayed = SubsplitTimer(drain=lambda: None)
    _FakeEvent.synced = 0
    marks.add_to(replayed)  # after a replay
    assert _FakeEvent.synced == 1  # waits for the last event once, not per lap
    assert replayed.ns == drained.ns == {"kda": 4_000, "mla": 0, "attn": 3_000, "ffn": 2_500, "scan": 2_000}
    marks.add_to(replayed)  # every replay adds its laps
    assert replayed.ns["attn"] == 6_000


def test_no_marks_add_nothing():
    t = SubsplitTimer(drain=lambda: None)
    EventMarks(_FakeEvent).add_to(t)
    assert sum(t.ns.values()) == 0


def test_stamp_laps_equal_the_drained_laps(monkeypatch):
    now = [0]
    monkeypatch.setattr(subsplit.time, "perf_counter_ns", lambda: now[0])
    drained = SubsplitTimer(drain=lambda: None)
    _walk(drained, lambda t: now.__setitem__(0, t))

    clock = [10**12]  # the device's global timer: an absolute ns count
    writes = []

    def stamp(buf, i):  # what kernels/stamp.py does on the device, in stream order
        buf[i] = clock[0]
        writes.append(i)

    marks = StampMarks(torch.zeros(16, dtype=torch.int64), stamp)
    _walk(marks, lambda t: clock.__setitem__(0, 10**12 + t))
    # one slot per boundary, in walk order, but for a begin right after an FFN lap: it reads that lap's
    assert writes == list(range(len(WALK) - 1)) and marks.slots == [0, 1, 2, 3, 4, 4, 5, 6]
    replayed = SubsplitTimer(drain=lambda: None)
    marks.add_to(replayed)
    assert replayed.ns == drained.ns == {"kda": 4_000, "mla": 0, "attn": 3_000, "ffn": 2_500, "scan": 2_000}
    marks.add_to(replayed)
    assert replayed.ns["attn"] == 6_000


def test_stamps_refuse_more_boundaries_than_slots():
    marks = StampMarks(torch.zeros(2, dtype=torch.int64), lambda buf, i: None)
    marks.begin()
    marks.lap("attn")
    with pytest.raises(RuntimeError, match="stamp buffer"):
        marks.lap("ffn")
