"""A demo model built once into the cache (a few seconds of training), then reused."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

__all__ = ["build_once"]


def build_once(out: Path, what: str, train: Callable[[Path, Callable[[int, int, float], None]], object],
               progress: Callable[[str], None] | None = None) -> Path:
    """`out` when it holds a config.json, else `train(out, on_step)` first; `progress` gets a
    line per training report and one when it is built (`what` names the model in them)."""
    out = Path(out)
    if (out / "config.json").exists():
        return out
    say = progress or (lambda s: None)
    t0 = time.perf_counter()
    train(out, lambda i, n, loss: say(f"training {what}: step {i}/{n} loss {loss:.3f}"))
    say(f"built {what} in {time.perf_counter() - t0:.1f}s -> {out}")
    return out
