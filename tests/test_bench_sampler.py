"""The bench's loop sampler (memra_dist/bench/loop_sampler.py, `--loop-profile`): a thread's stack
sampled from another thread, each sample marked running or waiting by the thread's own CPU clock."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from memra_dist.bench.loop_sampler import Sampler, format_summary, summarize


def _spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def _block(stop: threading.Event) -> None:
    stop.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread CPU clocks: Linux")
def test_a_spinning_thread_samples_as_running_and_a_blocked_one_as_waiting_in_its_own_frame():
    out = {}
    for fn in (_spin, _block):
        stop = threading.Event()
        t = threading.Thread(target=fn, args=(stop,))
        t.start()
        s = Sampler(t.ident, interval_s=0.002).start()
        time.sleep(0.3)
        samples = s.stop()
        stop.set()
        t.join()
        out[fn.__name__] = summarize(samples)
    spin, block = out["_spin"], out["_block"]
    assert spin["n"] >= 20 and block["n"] >= 20, (spin["n"], block["n"])
    # the spinning thread shares the interpreter with this one and the sampler: mostly on the CPU
    assert spin["running"] >= 0.6, spin
    assert dict((n, sh) for n, sh, _ in spin["inclusive"])["test_bench_sampler.py:_spin"] == 1.0, spin
    assert block["running"] <= 0.1 and any(n.endswith(":_block") for n, _, _ in block["inclusive"]), block
    assert "on the CPU in" in format_summary(block) and "_block" in format_summary(block)


def test_the_sampling_stops_by_itself_once_the_thread_ends():
    t = threading.Thread(target=time.sleep, args=(0.05,))
    t.start()
    s = Sampler(t.ident, interval_s=0.001).start()
    t.join()
    s._thread.join(timeout=2)
    samples = s.stop()
    assert not s._thread.is_alive() and samples and not any(run for _, run in samples[-5:])  # (asleep)


@pytest.mark.slow  # a tiny batched run in a subprocess
def test_the_batching_bench_samples_each_rows_engine_loop(tmp_path):
    """`benchmarks/batching.py --loop-profile` on the CPU: the batched row's file is its engine
    loop's samples over its last timed run (the batcher's `_run` on the stacks)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "batching.py"), str(tmp_path), "--concurrency", "4",
                        "--max-batch", "4", "--only-batched", "--drafter", "ngram", "--prompt", "32", "--new", "24",
                        "--loop-profile"], capture_output=True, text=True, timeout=600, cwd=root)
    assert p.returncode == 0, p.stderr[-3000:]
    text = (tmp_path / "loop-4-fixed.txt").read_text()
    assert text.startswith("==== engine loop:") and "batcher.py:_run" in text, text[:2000]
    n = int(text.split("engine loop: ")[1].split(" samples")[0])
    assert n > 0, text[:500]
