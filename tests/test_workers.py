"""A job's worker threads (memra_dist/serve/workers.py): a signal that interrupts the main
thread's wait never lets the job go on (and the engine close) under a worker still running."""

from __future__ import annotations

import signal
import time

import pytest

from memra_dist.serve.workers import Workers, signals_held


def _interrupt_in(seconds: float):
    def raise_it(signum, frame):
        raise KeyboardInterrupt

    prev = signal.signal(signal.SIGALRM, raise_it)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    return prev


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs SIGALRM")
def test_finish_waits_for_a_worker_whose_wait_a_signal_interrupted():
    # Thread.join(timeout) interrupted while the thread runs marks it stopped on Python < 3.13,
    # and a later join returns at once: the worker would still run while the engine closes
    finished = []
    w = Workers(poll_s=0.2)
    w.start(lambda me: (time.sleep(0.8), finished.append(me.name)), "slow")
    prev = _interrupt_in(0.3)
    try:
        with pytest.raises(KeyboardInterrupt):
            w.wait()
        assert not finished
        w.finish()
        assert finished == ["slow"]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, prev)


def test_a_workers_error_is_kept_for_the_main_thread_and_the_others_finish():
    done = []
    w = Workers(poll_s=0.05)
    w.start(lambda me: (_ for _ in ()).throw(ValueError("bad request")), "fails")
    w.start(lambda me: (time.sleep(0.1), done.append(1)), "ok")
    w.wait()
    assert done == [1]
    assert isinstance(w.first_error(), ValueError) and str(w.first_error()) == "bad request"
    assert [t.error is None for t in w.threads] == [False, True]


def test_sigint_waits_for_the_held_block_then_raises():
    got = []
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job starts with it ignored)
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals_held():
                signal.raise_signal(signal.SIGINT)  # Python's default handler: KeyboardInterrupt
                got.append("block done")
    finally:
        signal.signal(signal.SIGINT, prev)
    assert got == ["block done"]
