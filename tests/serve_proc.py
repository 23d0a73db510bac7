"""A real `memra-dist serve` in a subprocess of its own session (tests that stop it with signals,
or drive it with hostile clients): started on a free port from a clean environment, waited for
until it says it is up, its stderr kept, and on leaving, whatever of its process group is left
(its Ray) stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

from ports import free_port

CLEAN = ("OTEL_", "RAY_ADDRESS", "TRACEPARENT")  # the caller's settings the server must not see


class Serve:
    def __init__(self, p: subprocess.Popen, port: int, lines: list[str]):
        self.p, self.port, self.lines = p, port, lines
        self.base = f"http://127.0.0.1:{port}"

    @property
    def stderr(self) -> str:
        return "".join(self.lines)


@contextmanager
def serve(model, *flags: str, cwd, up_s: float = 180.0, stop=signal.SIGTERM, clean: tuple[str, ...] = CLEAN,
          stop_wait_s: float = 60.0):
    """`memra-dist serve --model MODEL --device cpu --dtype fp32 --port P FLAGS...` -> a Serve once
    it is up, its environment without the variables starting with `clean`. On leaving: `stop` to
    its process group (None: none), up to `stop_wait_s` for it to exit, then SIGKILL to what is left."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(clean)}
    p = subprocess.Popen([sys.executable, "-m", "memra_dist.cli", "serve", "--model", str(model), "--device", "cpu",
                          "--dtype", "fp32", "--port", str(port), *flags], start_new_session=True, env=env,
                         cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True)
    reader.start()
    try:
        t = time.monotonic()
        while not any("Ctrl-C stops" in x for x in lines) and p.poll() is None:
            assert time.monotonic() - t < up_s, f"serve did not start in {up_s:.0f} s: {''.join(lines)[-3000:]}"
            time.sleep(0.05)
        assert p.poll() is None, "".join(lines)[-3000:]
        yield Serve(p, port, lines)
    finally:
        try:
            if stop is not None and p.poll() is None:
                os.killpg(p.pid, stop)
                p.wait(stop_wait_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # whatever of its group is left (its Ray)
            except ProcessLookupError:
                pass
            p.wait(10)
        reader.join(5)
