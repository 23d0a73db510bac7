"""A drafter graph's small integer inputs (token ids, a start row) loaded in ONE host-to-device
copy from a pinned host row, so a round's replay waits on no fill kernel or pageable copy.

The copy is asynchronous: the pinned row must not be rewritten before the copy has read it. An
event recorded after each copy guards the next write (its wait is nothing in a round, whose
readback has long passed it); on the CPU (tests, the graph emulator) the copy is immediate."""

from __future__ import annotations

import torch

__all__ = ["HostRow"]


class HostRow:
    def __init__(self, n: int, device: torch.device):
        cuda = device.type == "cuda"
        self.dev = torch.zeros(n, dtype=torch.long, device=device)  # what the graphs read
        self.host = torch.zeros(n, dtype=torch.long, pin_memory=cuda)
        self._np = self.host.numpy()  # the pinned row's memory, written without a torch op
        self._copied = torch.cuda.Event() if cuda else None
        self._pending = False

    def load(self, values: dict[int, int] | list[int]) -> None:
        """Write `values` (a list from entry 0, or {entry: value}) and copy the row to the device."""
        if self._pending:
            self._copied.synchronize()  # the last copy has read the row
        if isinstance(values, dict):
            for i, v in values.items():
                self._np[i] = v
        else:
            self._np[:len(values)] = values
        self.dev.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
            self._pending = True
