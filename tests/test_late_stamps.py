"""A traced round on the engine loop whose drafter works on the device (DFlash's shared ingest and
block forward, EAGLE-3's chains): its maint and draft phases end at timing events the loop records
behind that work (phase/late_stamps.py), not at a drain. On the CPU the stream is the host, so the
events here are host-clock fakes with CUDA's interface, and the steps' readbacks carry one too (the
anchor)."""

from __future__ import annotations

import time

import pytest

from memra_dist.phase.late_stamps import LateStamp, monotone

from test_batching import _prompts, _solo, _tap_drafter, traced_batched


class _Ev:
    """A CUDA timing event's interface on the host clock: reached when recorded."""

    made = 0

    def __init__(self):
        self.t = time.perf_counter_ns()
        _Ev.made += 1

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "_Ev") -> float:
        return (other.t - self.t) / 1e6


def test_a_late_boundary_is_the_later_of_the_host_and_the_stream():
    a = _Ev()
    anchor = (a.t, a)
    done = _Ev()  # the stream reached it after the host's stamp below
    assert LateStamp(done, anchor).at(a.t) == done.t
    assert LateStamp(a, anchor).at(done.t) == done.t  # reached before the host got there
    assert monotone([5, 9, 7, 7, 12, 11], floor=6) == [6, 9, 9, 9, 12, 12]


@pytest.mark.parametrize("drafter", ["dflash", "eagle3"])
def test_traced_rounds_end_their_device_work_at_events_without_a_drain(llama, tmp_path_factory, monkeypatch, drafter):
    """Level 1 on a batched engine with a tap drafter whose shared forwards replay graphs (an
    emulated capture, installed as the GPU path installs them), where the device records timing
    events: the loop never drains the stream and runs the untraced path (the next drafts made
    behind the verify before its readback, DFlash's maintenance too, the next verify launched
    before that readback, the greedy drafts left on the device; each piece of drafter work gets
    an event behind it, where its phase ends), every
    request gets its solo ids, and every round's record has its boundaries in clock order, each
    round after the one before, none before the event it waits for."""
    import memra_dist.batching.batcher as bm
    import memra_dist.batching.chain as chain_mod
    import memra_dist.batching.chain_drafts as cd
    from memra_dist.device import Drainer
    from memra_dist.specdec.drafters.base import Drafter

    from test_ahead import _Bursts
    from test_draft_pool import _chain_graphs, _dflash_pool_graphs

    drains, stamps = [], []
    real = Drainer.__call__
    monkeypatch.setattr(Drainer, "__call__", lambda self: drains.append(1) or real(self))
    monkeypatch.setattr(Drafter, "drain", lambda self: drains.append(2))
    real_at = LateStamp.at
    monkeypatch.setattr(LateStamp, "at", lambda self, host: stamps.append((self.ev.t, real_at(self, host)))
                        or stamps[-1][1])
    monkeypatch.setattr(bm, "stage_readback", lambda pv: (pv, _Ev()))
    monkeypatch.setattr(chain_mod, "device_mark", _Ev)
    monkeypatch.setattr(cd, "device_mark", _Ev)
    ddir = str(_tap_drafter(drafter, llama, tmp_path_factory))
    reqs = _prompts(4)
    solo = _solo(llama, drafter, reqs, draft_model=ddir)
    drains.clear()
    sink = _Bursts()
    graphs = _dflash_pool_graphs if drafter == "dflash" else _chain_graphs
    def on_open(eng):
        graphs(eng._backend)
        eng._backend.batcher.verify_ahead = True  # (as where the steps replay graphs)

    got, _, stats = traced_batched(llama, drafter, reqs, 1, sink=sink, draft_model=ddir, spec_k="fixed",
                                   on_open=on_open)
    assert got == solo
    assert stats["draft_batches"] > 0 and not drains, (len(drains), stats["draft_batches"])
    assert stats["early_drafted_rounds"] > 0 and (stats["pre_maintained_rounds"] > 0) == (drafter == "dflash"), stats
    assert stats["ahead_verify_steps"] > 0, stats  # ... and the next verify launched before the readback
    rounds = [r for rec in sink.recs for r in rec.live()]
    assert rounds and stamps
    assert all(list(r.t) == sorted(r.t) for r in rounds)
    assert all(t >= ev for ev, t in stamps)  # no boundary before the stream reached its event
    by_burst = [list(rec.live()) for rec in sink.recs]
    assert all(b.t[0] >= a.t[5] for rs in by_burst for a, b in zip(rs, rs[1:]))
