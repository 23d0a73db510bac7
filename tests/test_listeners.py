"""The Ray cluster memra_dist starts on its own (`generate --pp`, `batch`, `serve` with no
RAY_ADDRESS) listens on the loopback only: every TCP listener of its processes (GCS,
raylet, workers, dashboard and runtime-env agents) is bound to 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("ray")

_PROBE = textwrap.dedent("""
    import os, sys
    from memra_dist.pipeline.driver import _ray_up

    ray, started = _ray_up()
    assert started

    @ray.remote
    def pid():
        return os.getpid()

    ray.get(pid.remote())  # a worker up and serving
    def children(pid):
        out = set()
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    stat = open(f"/proc/{p}/stat").read()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    out.add(int(p))
        return out
    mine, todo = {os.getpid()}, [os.getpid()]
    while todo:
        for c in children(todo.pop()):
            if c not in mine:
                mine.add(c)
                todo.append(c)
    inodes = set()
    for p in mine:
        try:
            for fd in os.listdir(f"/proc/{p}/fd"):
                link = os.readlink(f"/proc/{p}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            pass
    listen = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN, one of ours
                listen.append(f[1])
    ray.shutdown()
    print(" ".join(listen))
""")

LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def test_a_cluster_we_start_listens_on_the_loopback_only():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "OTEL_", "MEMRA_"))}
    p = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    addrs = p.stdout.split()
    assert len(addrs) >= 3, p.stdout  # GCS, raylet, a worker at least
    outward = [a for a in addrs if a.split(":")[0] not in LOOPBACK]
    assert outward == [], f"listeners beyond the loopback: {outward}"
