"""The Ray cluster memra_dist starts on its own (`generate --pp`, `batch`, `serve` with no
RAY_ADDRESS) listens on the loopback only: every TCP listener of its processes (GCS,
raylet, workers, dashboard and runtime-env agents) is bound to 127.0.0.1; and so, during a
`--pp 2` run on it, is the pipeline's own (the head's c10d TCP store, gloo's pair sockets)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("ray")

_SCAN = textwrap.dedent("""
    import os

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

    def listeners():
        # the local addresses (hex, as /proc/net/tcp writes them) of every listening socket of
        # this process and its descendants (the cluster's processes, the actors among them)
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
        return listen
""")

_PROBE = _SCAN + textwrap.dedent("""
    from memra_dist.pipeline.driver import _ray_up

    ray, started = _ray_up()
    assert started

    @ray.remote
    def pid():
        return os.getpid()

    ray.get(pid.remote())  # a worker up and serving
    listen = listeners()
    ray.shutdown()
    print(" ".join(listen))
""")

# a --pp 2 generate on the cluster we start: the listeners taken once the pipeline is up (its
# group joined: the head's store serving, gloo's pairs connected), and before, to tell them apart
_PROBE_PP = _SCAN + textwrap.dedent("""
    import sys
    from memra_dist.app import generate
    from memra_dist.config import RunConfig
    from memra_dist.pipeline import driver

    ray, started = driver._ray_up()
    assert started
    before = listeners()
    during = []
    init = driver.Pipeline.__init__

    def up(self, *a, **k):
        init(self, *a, **k)
        during.extend(listeners())

    driver.Pipeline.__init__ = up
    cfg = RunConfig(model=sys.argv[1], pp=2, device="cpu", drafter="none", max_new_tokens=4)
    out = generate(cfg, [5, 9, 17, 5]).token_ids
    assert len(out) == 4 and during, (out, during)
    ray.shutdown()
    print(" ".join(before))
    print(" ".join(during))
""")

LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


@pytest.mark.slow  # a local Ray cluster started: ~9-11 s on 2 cores
def test_a_cluster_we_start_listens_on_the_loopback_only():
    p = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=_env(), timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    addrs = p.stdout.split()
    assert len(addrs) >= 3, p.stdout  # GCS, raylet, a worker at least
    assert _outward(addrs) == [], f"listeners beyond the loopback: {_outward(addrs)}"


def _outward(addrs: list[str]) -> list[str]:
    return [a for a in addrs if a.split(":")[0] not in LOOPBACK]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "OTEL_", "MEMRA_"))}


@pytest.mark.slow  # a --pp 2 run on a local Ray cluster
def test_a_pp2_run_listens_on_the_loopback_only(llama):
    """The head's TCP store binds the node's Ray address (here the loopback), not *:PORT."""
    p = subprocess.run([sys.executable, "-c", _PROBE_PP, str(llama)], capture_output=True, text=True, env=_env(),
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    before, during = (line.split() for line in p.stdout.strip().splitlines()[-2:])
    assert set(during) - set(before), p.stdout  # the pipeline's own: the store at least
    assert _outward(during) == [], f"listeners beyond the loopback during a --pp 2 run: {_outward(during)}"
