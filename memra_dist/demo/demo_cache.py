"""Demo models on disk: a checkpoint directory written atomically, and a model built once
into the cache (a few seconds of training), then reused."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

__all__ = ["build_once", "write_checkpoint"]


def write_checkpoint(out: str | Path, tensors: dict[str, torch.Tensor], cfg: dict,
                     extra: Callable[[Path], None] | None = None) -> Path:
    """`out`/config.json + model.safetensors (+ whatever `extra(dir)` writes), atomically: built
    in a temp directory beside it and renamed into place, so a killed build leaves no half."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if extra is not None:
            extra(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


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
