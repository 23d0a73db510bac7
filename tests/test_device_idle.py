"""The device's waits for the engine loop between steps (batching/device_idle.py), wired into the
loop: each step read back opens a record, a drafting on the device marks its start and end, the
next launch closes it. On the CPU no CUDA event exists, so these tests stand fake events in
(each one's time: when it was made, as an event recorded on an idle stream fires)."""

from __future__ import annotations

import time

import pytest

from test_batching import _batched, _prompts, _tap_drafter


class _Ev:

    def __init__(self):
        self.ms = time.perf_counter_ns() / 1e6

    def elapsed_time(self, other: "_Ev") -> float:
        return other.ms - self.ms

    def synchronize(self) -> None:  # (the readback's wait: done on the CPU)
        pass


def _fake_events(monkeypatch, seen: list):
    import memra_dist.batching.batcher as bt
    import memra_dist.batching.loop_rounds as lr
    import memra_dist.batching.step_forward as sf
    from memra_dist.batching.device_idle import DeviceIdle

    real_stage = bt.stage_readback
    monkeypatch.setattr(bt, "stage_readback", lambda pv: (real_stage(pv)[0], _Ev()))
    monkeypatch.setattr(lr, "device_mark", _Ev)
    monkeypatch.setattr(bt, "device_mark", _Ev)
    monkeypatch.setattr(sf, "device_mark", _Ev)
    real_fold = DeviceIdle.fold

    def fold(self):
        seen.extend(self._closed)
        real_fold(self)

    monkeypatch.setattr(DeviceIdle, "fold", fold)


@pytest.mark.parametrize("drafter", ["ngram", "dflash"])
def test_each_step_read_back_is_timed_to_the_next_launch(llama, tmp_path_factory, monkeypatch, drafter):
    """Every record runs readback -> (drafting start -> drafting end) -> next launch in that
    order; a host drafter (n-gram) drafts on the host, so its records have no drafting and its
    idle is all "after the step"; DFlash's maintenance and shared draft forward mark theirs.
    The counters are the records' sums, per step measured; the ids stay the solo ids."""
    from test_batching import _solo

    seen: list = []
    kw = {"draft_model": str(_tap_drafter(drafter, llama, tmp_path_factory))} if drafter == "dflash" else {}
    reqs = _prompts(6)
    solo = _solo(llama, drafter, reqs, **kw)  # (one at a time: the loop of one request, its records not counted)
    _fake_events(monkeypatch, seen)
    got, stats = _batched(llama, drafter, reqs, max_batch=3, **kw)
    assert got == solo
    assert seen and stats["device_idle_steps"] == len(seen) <= stats["steps"] - stats["ahead_steps"], stats
    after = before = 0.0
    each = []
    for ready, drafting, drafted, verify in seen:
        assert ready.ms <= verify.ms
        if drafter == "ngram":
            assert drafting is None and drafted is None
        else:
            assert drafting is None or ready.ms <= drafting.ms <= drafted.ms
        each.append(((drafting or verify).ms - ready.ms, max(0.0, verify.ms - drafted.ms) if drafted is not None else 0.0))
        after += each[-1][0]
        before += each[-1][1]
    n = len(seen)
    assert stats["device_idle_after_step_p50_ms"] == pytest.approx(sorted(a for a, _ in each)[n // 2], abs=1e-3)
    assert stats["device_idle_before_verify_p50_ms"] == pytest.approx(sorted(b for _, b in each)[n // 2], abs=1e-3)
    assert stats["device_idle_after_step_ms"] == pytest.approx(after / n, abs=1e-3)
    assert stats["device_idle_before_verify_ms"] == pytest.approx(before / n, abs=1e-3)
    if drafter == "dflash":
        assert any(d is not None for _, d, _, _ in seen)
