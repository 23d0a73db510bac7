"""A drafter graph's pinned input row (specdec/drafters/host_row.py): a load writes the listed
entries (a list from entry 0, or {entry: value}), keeps the others, and the device row holds
exactly the host row after each load, back to back."""

from __future__ import annotations

import torch

from memra_dist.specdec.drafters.host_row import HostRow


def test_loads_write_the_entries_they_name_and_keep_the_rest():
    row = HostRow(3, torch.device("cpu"))
    row.load([7, 8])
    assert row.dev.tolist() == [7, 8, 0]
    row.load({2: 41})
    assert row.dev.tolist() == [7, 8, 41]
    row.load({0: 5, 2: 6})
    row.load([9])  # back to back: the device row follows the latest load
    assert row.dev.tolist() == [9, 8, 6]
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

    row = HostRow(2, torch.device("cpu"))
    row._copied = Event()
    row.load([3, 4])
    row.load({1: 9})
    assert calls == [("record", [3, 4]), ("sync", [3, 4]), ("record", [3, 9])]
