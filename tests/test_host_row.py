"""A drafter graph's pinned input row (specdec/drafters/host_row.py): [ids ..., start] on the
device; a load writes the ids it is given (the others keep theirs) and the start, and the device
row holds exactly the host row after each load, back to back; on CUDA a load waits for the last
copy before it rewrites the pinned row."""

from __future__ import annotations

import torch

from memra_dist.specdec.drafters.host_row import HostRow


def test_loads_write_the_ids_they_are_given_and_the_start():
    row = HostRow(2, torch.device("cpu"))
    row.load([7, 8], 40)
    assert row.dev.tolist() == [7, 8, 40]
    assert row.ids.tolist() == [7, 8] and row.start.tolist() == [40]  # views of the device row
    row.load((), 41)
    assert row.dev.tolist() == [7, 8, 41]
    row.load([5, 6], 2)
    row.load([9], 3)  # back to back: the device row follows the latest load
    assert row.dev.tolist() == [9, 6, 3]
    assert not row.host.is_pinned()  # CPU: no pinned memory, no events


def test_a_load_waits_for_the_last_copy_before_rewriting_the_row():
    """On CUDA the copy is asynchronous: the pinned row is rewritten only once the event recorded
    after the last copy has completed (a stand-in event records the order of the calls)."""
    calls = []

    class Event:
        def record(self):
            calls.append(("record", row.host.tolist()))

        def synchronize(self):
            calls.append(("sync", row.host.tolist()))  # the row still holds what the last copy read

    row = HostRow(1, torch.device("cpu"))
    row._copied = Event()
    row.load([3], 4)
    row.load((), 9)
    assert calls == [("record", [3, 4]), ("sync", [3, 4]), ("record", [3, 9])]
