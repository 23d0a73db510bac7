"""Activations and commands between pipeline ranks over torch.distributed point-to-point:
NCCL on GPUs, gloo on CPU, one code path.

Topology (a ring): rank 0 is the HEAD actor (the last stage's layers + final norm, lm_head,
sampling, acceptance, the drafter, the session); ranks 1..N-1 hold stages 0..N-2. A forward
goes head -> rank 1 -> ... -> rank N-1 -> head. Rank 0 opens the TCP store (the group's
rendezvous) on a socket it binds to its node's Ray address itself (c10d's own store would
listen on every interface); the driver passes that address to every rank, which joins as the
store's client. gloo's pair sockets bind to the same address's interface. The group has an
explicit timeout, so a dead peer turns a receive into an error instead of a hang.

A command is one int64 vector [op, start, rows, flags, arg, slot, ids...]: a forward of at most
INLINE_IDS token rows (every decode and verify step) carries its ids inside the command, so a
step costs one message into the first stage, not two; a longer forward (a prefill) sends the
ids as a payload after the command. p2p order per pair is FIFO, so no tags are needed. The
command row is staged in pinned host memory and copied without blocking the host. `slot` names
the session's cache slot on every stage (sessions in flight, pipeline/ring.py); each session
sends from a `CmdBuffer` of its own, so one session's command is never overwritten while
another's is still being sent.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import MAX_K
from ..env import environment

__all__ = ["Link", "CmdBuffer", "Op", "Flag", "CMD_LEN", "INLINE_IDS", "listen_socket", "node_ip", "pg_timeout_s"]

CMD_HEAD = 6  # op, start, rows, flags, arg, slot
INLINE_IDS = MAX_K + 1  # a verify of K+1 rows fits the command
CMD_LEN = CMD_HEAD + INLINE_IDS


def pg_timeout_s() -> float:
    """Bound on the process group's bootstrap and on a receive from a dead peer (MEMRA_PG_TIMEOUT_S)."""
    return environment().pg_timeout_s


class Op:
    """No ROLLBACK op: a forward at `start` first rolls the stage back to `start` (a round's
    rollback always precedes the next round's forward at exactly that length), so a round
    sends no message of its own for it."""

    FORWARD = 1
    ALLOC = 3
    END = 4
    # a batched pipeline (batching/step_plan.py): each carries an int64 row behind it (its
    # length in `start`), which every stage passes on to the next
    BATCH_OPEN = 5  # start: the pool's rows, arg: its block; every stage makes its paged pool
    BATCH = 6  # a step: rows = its rows, the row its plan; then the stages' forwards as FORWARD's
    SWAP_OUT = 7  # a preempted request's rows to host memory (the row: rid, its slots)
    SWAP_IN = 8  # ... and back into its new slots
    LEAVE = 9  # arg: a request that ended (its recurrent states and any swapped rows go)


class Flag:
    TIMED = 1  # level-2: carry the sub-split ns vector along with the activations
    TRACED = 2  # level >= 1: stages record their forward for stage spans
    INLINE = 4  # the token ids ride in the command (rows <= INLINE_IDS)


def listen_socket(addr: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to (addr, port) (0: an ephemeral port) and listening: on this address
    only, not on every interface."""
    s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((addr, port))
        s.listen(128)
    except OSError:
        s.close()
        raise
    return s


def node_ip() -> str:
    """This node's Ray address (the loopback for a cluster memra_dist starts itself)."""
    try:
        import ray  # noqa: PLC0415

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (tests of the transport alone)
        return "127.0.0.1"


def _iface_of(addr: str) -> str | None:
    """The name of the network interface holding IPv4 `addr` (Linux), or None."""
    try:
        import fcntl  # noqa: PLC0415
        import struct  # noqa: PLC0415

        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:  # SIOCGIFADDR: the interface's IPv4 address
                    got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))[20:24]
                except OSError:
                    continue
            if socket.inet_ntoa(got) == addr:
                return name
    except (ImportError, OSError, AttributeError):
        pass
    return None


class CmdBuffer:
    """A command row on the device and its pinned host staging row."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.cmd = torch.zeros(CMD_LEN, dtype=torch.long, device=device)
        self.host = torch.zeros(CMD_LEN, dtype=torch.long, pin_memory=cuda)  # the staged command row
        self.host_np = self.host.numpy()
        self.copied = torch.cuda.Event() if cuda else None  # the last copy out of `host`


class Link:
    """This rank's end of the ring."""

    def __init__(self, rank: int, world: int, device: torch.device):
        self.rank, self.world, self.device = rank, world, device
        self.prev = (rank - 1) % world
        self.next = (rank + 1) % world
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self._listener: socket.socket | None = None  # rank 0's store socket, between listen and connect
        self.own = CmdBuffer(device)  # received commands (a stage) / a one-session head's sends
        self._cmd = self.own.cmd

    def listen(self, addr: str | None = None) -> tuple[str, int]:
        """Rank 0: bind the store's socket on `addr` (default: this node's Ray address) at an
        ephemeral port, kept until `connect`; returns (addr, port) for every rank's connect."""
        addr = addr or node_ip()
        self._listener = listen_socket(addr)
        return addr, self._listener.getsockname()[1]

    def connect(self, addr: str, port: int, timeout_s: float) -> None:
        """Join the group: rank 0 serves the TCP store on its `listen` socket (bound to `addr`,
        or bound here at `port`), the other ranks connect to it as clients."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        timeout = timedelta(seconds=timeout_s)
        if self.backend == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME"):
            iface = _iface_of(addr)  # gloo's listeners on addr's interface, not the hostname's
            if iface is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = iface
        if self.rank == 0:
            sock = self._listener or listen_socket(addr, port)
            self._listener = None
            # the store owns the fd from here (it closes it at teardown)
            store = dist.TCPStore(addr, port, self.world, True, timeout, master_listen_fd=sock.detach())
        else:
            store = dist.TCPStore(addr, port, self.world, False, timeout)
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world, timeout=timeout)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- commands ----
    def send_cmd(self, op: int, start: int = 0, rows: int = 0, flags: int = 0, arg: int = 0,
                 ids: torch.Tensor | None = None, slot: int = 0, buf: CmdBuffer | None = None) -> bool:
        """Send a command (from `buf`, default this link's own row); `ids` (rows,) ride inside
        it when they fit. Returns whether they did (if not, the caller sends them as a
        payload next)."""
        b = buf or self.own
        inline = ids is not None and ids.shape[0] <= INLINE_IDS
        if inline:
            flags |= Flag.INLINE
        if b.copied is not None:
            b.copied.synchronize()  # the previous command's copy out of the pinned row is done
        h = b.host_np
        h[:CMD_HEAD] = (op, start, rows, flags, arg, slot)
        host_ids = inline and ids.device.type == "cpu"
        if host_ids:
            h[CMD_HEAD:CMD_HEAD + rows] = ids.numpy()
        n = CMD_HEAD + rows if host_ids else CMD_HEAD
        b.cmd[:n].copy_(b.host[:n], non_blocking=True)
        if inline and not host_ids:
            b.cmd[CMD_HEAD:CMD_HEAD + rows].copy_(ids)  # device ids (a model drafter's): no host trip
        if b.copied is not None:
            b.copied.record()
        dist.send(b.cmd, self.next)
        return inline

    def forward_cmd(self) -> None:
        """Pass the command just received on to the next rank, unchanged (device to device)."""
        dist.send(self._cmd, self.next)

    def recv_cmd(self) -> list[int]:
        """The next command's head [op, start, rows, flags, arg, slot] (one sync: it decides shapes)."""
        dist.recv(self._cmd, self.prev)
        return self._cmd[:CMD_HEAD].tolist()

    def cmd_ids(self, rows: int) -> torch.Tensor:
        """The inline ids of the command just received (a view; valid until the next recv_cmd)."""
        return self._cmd[CMD_HEAD:CMD_HEAD + rows]

    # ---- payloads ----
    def send(self, t: torch.Tensor) -> None:
        dist.send(t.contiguous(), self.next)

    def recv(self, shape, dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(t, self.prev)
        return t
