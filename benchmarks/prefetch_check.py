"""Does reading the weights ahead during Ray's start-up pay? (model/prefetch.py)

Writes a checkpoint-sized safetensors file (default 2 GB of fp32), then loads every tensor of
it (safetensors, as the loader does) three ways, each after evicting the file's pages from the
OS cache (posix_fadvise DONTNEED; a file with dirty pages is synced first):
  cold       load at once
  overlap    prefetch_weights, then a wait standing for Ray's start-up (--wait-s), then load
  wait only  the same wait with no prefetch, then load (the default path before)
and prints the load times. usage: python benchmarks/prefetch_check.py DIR [--gb 2] [--wait-s 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from memra_dist.model.prefetch import prefetch_weights


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def load_all(path: Path) -> float:
    t = time.perf_counter()
    with safe_open(str(path), "pt") as f:
        for k in f.keys():
            f.get_tensor(k)  # a copy out of the mapping: every page read
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--wait-s", type=float, default=3.0)
    a = ap.parse_args()
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    f = d / "model.safetensors"
    n = int(a.gb * 2**30 / 4 / 64)
    if not f.exists() or abs(f.stat().st_size - a.gb * 2**30) > 2**24:
        save_file({f"w{i}": torch.randn(n // 64, 64) for i in range(64)}, str(f))
    out = {}
    evict(f)
    out["cold_s"] = load_all(f)
    evict(f)
    time.sleep(a.wait_s)
    out["wait_only_s"] = load_all(f)
    evict(f)
    t = prefetch_weights([d], 64 * 2**30)
    time.sleep(a.wait_s)
    out["overlap_s"] = load_all(f)
    out["prefetch_thread_done"] = t is not None and not t.is_alive()
    out.update(gb=round(f.stat().st_size / 2**30, 2), wait_s=a.wait_s)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
