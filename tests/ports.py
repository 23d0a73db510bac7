"""Free local ports for servers a test starts, away from the ports others pick on their own.

A port from ``bind(("127.0.0.1", 0))`` comes from the kernel's ephemeral range, the same range
Ray's raylet, GCS clients and gRPC channels draw their own sockets from while the server under
test starts: between the probe closing and the server binding, one of them can take it
("Failed to bind to address"). Ports here come from below the ephemeral range (32768 on Linux)
and above Ray's worker ports (10002-19999), probed free, each handed out once per process.
"""

from __future__ import annotations

import random
import socket

LOW, HIGH = 20000, 32000
_given: set[int] = set()


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that nothing listens on now and this process has not handed out."""
    out: list[int] = []
    rng = random.Random()
    while len(out) < n:
        port = rng.randrange(LOW, HIGH)
        if port in _given or port in out:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
    _given.update(out)
    return out


def free_port() -> int:
    return free_ports(1)[0]
