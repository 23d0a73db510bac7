"""The head's end of the ring, shared by the sessions in flight.

Several sessions run at once in the head actor (one thread each), so that while stage 0
runs session a's forward, the head runs session b's last stage, acceptance and drafting.
Every stage serves commands strictly in the order they arrive, and point-to-point messages
between two ranks arrive in the order they were sent; so the results come back to the head
in the order their commands left it. The ring keeps that promise across threads:

- a send takes a ticket (sends are serialized: the command and a prefill's payload go out
  back to back);
- a receive waits for its ticket's turn, so each session takes its own forward's hidden
  rows (and the level-2 vector behind them), never another's.

NCCL: the head sends to and receives from the same communicator (a pp=2 ring has one peer),
and calls into one communicator must not overlap across threads; they only enqueue work, so
one lock covers both without ever blocking the host. gloo (CPU): a receive blocks the host
until the data is there, so sends go on beside it (a send lock and the receive turn only).
"""

from __future__ import annotations

import threading
from contextlib import nullcontext

import torch

from .transport import CmdBuffer, Link, Op

__all__ = ["Ring"]


class Ring:
    def __init__(self, link: Link):
        self.link = link
        self.device = link.device
        self._io = threading.Lock() if link.backend == "nccl" else nullcontext()
        self._send = threading.Lock()
        self._turn = threading.Condition()
        self._issued = 0  # tickets handed out (forwards sent)
        self._next = 0  # the ticket whose results are received next
        self._row_buf = CmdBuffer(self.device)  # the batched pipeline's commands (sent under _send)

    def buffer(self) -> CmdBuffer:
        """A command row for one session (each sends from its own)."""
        return CmdBuffer(self.device)

    def command(self, op: int, start: int = 0, arg: int = 0, slot: int = 0, buf: CmdBuffer | None = None) -> None:
        """A command that returns nothing to the head (ALLOC, END)."""
        with self._send, self._io:
            self.link.send_cmd(op, start, 0, 0, arg, slot=slot, buf=buf)

    def command_row(self, op: int, row: list[int], rows: int = 0, flags: int = 0, arg: int = 0, slot: int = 0) -> int:
        """A command with an int64 row behind it (a batched pipeline's: batching/step_plan.py);
        returns its ticket (a BATCH step's results are received with it; others return none
        and take no ticket)."""
        t = torch.tensor(row, dtype=torch.long).to(self.device)
        with self._send:
            with self._io:
                self.link.send_cmd(op, len(row), rows, flags, arg, slot=slot, buf=self._row_buf)
                self.link.send(t)
            if op != Op.BATCH:
                return -1
            ticket = self._issued
            self._issued += 1
        return ticket

    def forward(self, ids: torch.Tensor, start: int, flags: int, rnd: int, slot: int, buf: CmdBuffer) -> int:
        """Send a forward's command (and its ids as a payload when they do not fit it);
        returns the ticket its results are received with."""
        rows = ids.shape[0]
        with self._send:
            with self._io:
                if not self.link.send_cmd(Op.FORWARD, start, rows, flags, rnd, ids=ids, slot=slot, buf=buf):
                    self.link.send(ids.to(self.device))
            ticket = self._issued
            self._issued += 1
        return ticket

    def receive(self, ticket: int, shapes: list[tuple[tuple, torch.dtype]]) -> list[torch.Tensor]:
        """The results of the forward sent with `ticket`, one tensor per (shape, dtype), once
        every earlier ticket has taken its own."""
        with self._turn:
            self._turn.wait_for(lambda: self._next == ticket)
        try:
            with self._io:
                return [self.link.recv(shape, dtype) for shape, dtype in shapes]
        finally:
            with self._turn:
                self._next += 1
                self._turn.notify_all()
