"""A drafter graph's small integer inputs, token ids and a start row, loaded in ONE host-to-device
copy from a pinned host row, so a round's replay waits on no fill kernel or pageable copy.

The device row is [ids (n), start]: `ids` and `start` ((1,)) are views of it, which the graphs
read. The copy is asynchronous: the pinned row must not be rewritten before the copy has read
it. An event recorded after each copy guards the next write (its wait is nothing in a round,
whose readback has long passed it); on the CPU (tests, the graph emulator) the copy is
immediate."""

from __future__ import annotations

import torch

__all__ = ["HostRow"]


class HostRow:
    def __init__(self, n: int, device: torch.device):
        """`n` id entries, then the start (an even n keeps `start` 16-byte aligned)."""
        cuda = device.type == "cuda"
        self.n = n
        self.dev = torch.zeros(n + 1, dtype=torch.long, device=device)
        self.ids, self.start = self.dev[:n], self.dev[n:]
        self.host = torch.zeros(n + 1, dtype=torch.long, pin_memory=cuda)
        self._np = self.host.numpy()  # the pinned row's memory, written without a torch op
        self._copied = torch.cuda.Event() if cuda else None
        self._pending = False

    def load(self, ids, start: int) -> None:
        """ids[0 .. len(ids)) and the start written (the other ids keep their values), the row
        copied to the device."""
        self.writable()[:len(ids)] = ids
        self.send(start)

    def writable(self):
        """The pinned row as a numpy array to write in place (a graph's inputs filled by array
        ops, not from Python lists), once the last copy has read it; `send` copies it."""
        if self._pending:
            self._copied.synchronize()  # the last copy has read the row
            self._pending = False
        return self._np

    def send(self, start: int = 0) -> None:
        """The start written and the whole row copied to the device (asynchronously)."""
        self._np[self.n] = start
        self.dev.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
            self._pending = True
