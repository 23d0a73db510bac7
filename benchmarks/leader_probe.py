"""Where a batched step leader's host time goes: `benchmarks/batching.py` (one batched row, the
tap drafter's replay at N concurrent) with timers wrapped around the calls on the leader's path
(the drafters' shared maintenance and proposal, the graph replay, the tap gathers and
scatters, the step's launch and readback). A diagnostic: the wrappers add a little host time.

    python benchmarks/leader_probe.py OUT [--drafter dflash-replay] [--shape 8b] [--device cuda]
        [--concurrency 16]
Prints each wrapped call's total ms, calls and ms a call (the whole process: the plain recording
run and the warm-ups included)."""

from __future__ import annotations

import argparse
import collections
import functools
import runpy
import sys
import time
from pathlib import Path

TOT: dict[str, float] = collections.defaultdict(float)
CNT: collections.Counter = collections.Counter()


def _timed(f, label):
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            TOT[label] += time.perf_counter() - t
            CNT[label] += 1
    return w


def _wrap(owner, name: str, label: str, static: bool = False) -> None:
    f = getattr(owner, name)
    w = _timed(f, label)
    setattr(owner, name, staticmethod(w) if static else w)


def install() -> None:
    from memra_dist import device
    from memra_dist.batching import batcher, chain, step_forward
    from memra_dist.bench import tap_replay
    from memra_dist.model import taps
    from memra_dist.specdec.drafters import dflash, dflash_pool_graph, eagle3, replay

    _wrap(tap_replay.TapReplay, "propose_many", "drafts (TapReplay.propose_many)", static=True)
    _wrap(tap_replay.TapReplay, "maintain_many", "maintenance (TapReplay.maintain_many)", static=True)
    for cls in (dflash.DFlashDrafter, eagle3.Eagle3Drafter):
        _wrap(cls, "propose_many", f"{cls.name}.propose_many", static=True)
        _wrap(cls, "maintain_many", f"{cls.name}.maintain_many", static=True)
    _wrap(dflash_pool_graph.PoolBlockGraphs, "greedy", "DFlash graph: load, replay, readback")
    _wrap(replay.ReplayDrafter, "propose", "replay drafter propose (host)")
    _wrap(taps.TapSink, "rows", "TapSink.rows (a request's tap gather)")
    _wrap(device.Drainer, "__call__", "drain")
    _wrap(chain.Chain, "settle", "Chain.settle")
    _wrap(chain.Chain, "next_job", "Chain.next_job")
    _wrap(batcher.Batcher, "_chain_rounds", "the leader's rounds (_chain_rounds)")
    _wrap(batcher, "launch", "step launch")
    _wrap(batcher, "take_readback", "step readback")
    _wrap(step_forward, "scatter_taps", "scatter_taps (a step's taps into each sink)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--drafter", default="dflash-replay")
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", type=int, default=16)
    a = ap.parse_args()
    install()
    sys.argv = ["batching.py", a.out, "--shape", a.shape, "--device", a.device, "--concurrency", str(a.concurrency),
                "--max-batch", str(a.concurrency), "--only-batched", "--drafter", a.drafter, "--repeats", "1"]
    try:
        runpy.run_path(str(Path(__file__).with_name("batching.py")), run_name="__main__")
    except SystemExit:
        pass
    for k in sorted(TOT, key=lambda k: -TOT[k]):
        print(f"{k:48s} {TOT[k] * 1e3:10.1f} ms {CNT[k]:7d} calls {TOT[k] * 1e3 / CNT[k]:8.3f} ms a call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
