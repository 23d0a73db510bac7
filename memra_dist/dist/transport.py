"""Activations and commands between pipeline ranks over torch.distributed point-to-point:
NCCL on GPUs, gloo on CPU, one code path.

Topology (a ring): rank 0 is the HEAD actor (the last stage's layers + final norm, lm_head,
sampling, acceptance, the drafter, the session); ranks 1..N-1 hold stages 0..N-2. A forward
goes head -> rank 1 -> ... -> rank N-1 -> head. Rank 0 opens the TCP store; the driver
passes its address to every rank. The group has an explicit timeout, so a dead peer turns
a receive into an error instead of a hang.

A command is a small int64 vector [op, start, rows, flags, arg]; it travels ahead of its
payload on the same pair, and p2p order per pair is FIFO, so no tags are needed.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["Link", "Op", "CMD_LEN", "free_port", "PG_TIMEOUT_S"]

CMD_LEN = 5
PG_TIMEOUT_S = float(os.environ.get("MEMRA_PG_TIMEOUT_S", "60"))


class Op:
    FORWARD = 1
    ROLLBACK = 2
    ALLOC = 3
    END = 4


class Flag:
    TIMED = 1  # level-2: carry the sub-split ns vector along with the activations
    TRACED = 2  # level >= 1: stages record their forward for stage spans


def free_port() -> tuple[str, int]:
    """This node's address and a free TCP port on it (for rank 0's store)."""
    ip = _node_ip()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return ip, s.getsockname()[1]


def _node_ip() -> str:
    try:
        import ray  # noqa: PLC0415

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (tests of the transport alone)
        return "127.0.0.1"


class Link:
    """This rank's end of the ring."""

    def __init__(self, rank: int, world: int, device: torch.device):
        self.rank, self.world, self.device = rank, world, device
        self.prev = (rank - 1) % world
        self.next = (rank + 1) % world
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self._cmd = torch.zeros(CMD_LEN, dtype=torch.long, device=device)

    def connect(self, addr: str, port: int, timeout_s: float = PG_TIMEOUT_S) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(self.backend, init_method=f"tcp://{addr}:{port}", rank=self.rank,
                                world_size=self.world, timeout=timedelta(seconds=timeout_s))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- commands ----
    def send_cmd(self, op: int, start: int = 0, rows: int = 0, flags: int = 0, arg: int = 0) -> None:
        self._cmd.copy_(torch.tensor([op, start, rows, flags, arg]))
        dist.send(self._cmd, self.next)

    def forward_cmd(self, cmd: list[int]) -> None:
        self._cmd.copy_(torch.tensor(cmd))
        dist.send(self._cmd, self.next)

    def recv_cmd(self) -> list[int]:
        dist.recv(self._cmd, self.prev)
        return self._cmd.tolist()  # host values: one sync, the command decides the shapes

    # ---- payloads ----
    def send(self, t: torch.Tensor) -> None:
        dist.send(t.contiguous(), self.next)

    def recv(self, shape, dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(t, self.prev)
        return t
