"""Read a checkpoint's weight files into the OS page cache while Ray starts (pp > 1).

At pp > 1 the stage actors load their layers only once Ray is up and they are placed (a few
seconds to tens of seconds), and on a cold machine that load is a disk read of the whole
checkpoint. The driver knows the files before Ray starts, so it asks the kernel to read them
ahead (`posix_fadvise(POSIX_FADV_WILLNEED)`: asynchronous readahead, no data copied into this
process) on a daemon thread; the actors on this node then load from memory. Only files that
fit in half the host's available memory are asked for (readahead beyond that would evict the
pages it just read, or others'), and only for a local cluster: with RAY_ADDRESS the actors
may sit on other nodes. Nothing here changes what is loaded, only when the disk is read.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

__all__ = ["prefetch_plan", "weight_files", "prefetch_weights"]

SHARE = 0.5  # of MemAvailable a readahead may take


def weight_files(model_dir: str | Path) -> list[tuple[Path, int]]:
    """(path, bytes) of the safetensors files the loader will read (model/loader.py
    `checkpoint_files`); none where the directory or its index is unreadable (the loader then
    says why, in its own words)."""
    from ..errors import UserError  # noqa: PLC0415
    from .loader import checkpoint_files  # noqa: PLC0415

    if not Path(model_dir).is_dir():
        return []
    try:
        return [(f, f.stat().st_size) for f in checkpoint_files(model_dir) if f.is_file()]
    except UserError:
        return []


def prefetch_plan(files: list[tuple[Path, int]], available: int, share: float = SHARE) -> list[Path]:
    """The files to read ahead: in order, while their total stays within share * available
    bytes (a file that would pass the bound is skipped, later smaller ones still fit).

    >>> prefetch_plan([(Path("a"), 40), (Path("b"), 30), (Path("c"), 5)], 100)
    [PosixPath('a'), PosixPath('c')]
    """
    out, total, budget = [], 0, share * available
    for f, size in files:
        if total + size <= budget:
            out.append(f)
            total += size
    return out


def _advise(paths: list[Path]) -> None:
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue  # the loader reports unreadable files in its own words
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def prefetch_weights(model_dirs, available: int) -> threading.Thread | None:
    """Start reading ahead the weight files of `model_dirs` (None entries skipped) that fit
    the bound; returns the daemon thread doing it, or None when there is nothing to do or the
    platform has no posix_fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return None
    files = [f for d in model_dirs if d for f in weight_files(d)]
    paths = prefetch_plan(files, available)
    if not paths:
        return None
    t = threading.Thread(target=_advise, args=(paths,), name="memra-prefetch", daemon=True)
    t.start()
    return t
