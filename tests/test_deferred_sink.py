"""tracing/deferred.py: spans built a round at a time from the session's pump, none lost at close."""

from __future__ import annotations

from memra_dist.tracing.deferred import DeferredSink


class _Inner:
    def __init__(self):
        self.count, self.built = 0, []

    def burst_steps(self, rec):
        for r in rec:
            if r == "boom":
                raise RuntimeError("a tracing bug")
            self.built.append(r)
            self.count += 1
            yield

    def first_token_steps(self, prof):
        self.built.append(("ttft", prof))
        yield


def test_pump_builds_one_round_at_a_time_and_close_builds_the_rest():
    inner = _Inner()
    d = DeferredSink(inner)
    d.burst([1, 2, 3])
    d.first_token("p")
    assert inner.built == []  # nothing built at hand-over
    d.pump(budget_ns=0)
    assert inner.built == [1]  # at least one round per pump, no more past the budget
    d.pump(budget_ns=0)
    assert inner.built == [1, 2]
    d.close()
    assert inner.built == [1, 2, 3, ("ttft", "p")] and d.count == 3 and not d.work


def test_a_failing_burst_is_dropped_and_the_next_still_built():
    inner = _Inner()
    d = DeferredSink(inner)
    d.burst([1, "boom", 2])
    d.burst([4])
    d.flush()
    assert inner.built == [1, 4]


def test_session_pumps_spans_during_the_run():
    """A level-1 local run: spans of early bursts exist before the request ends (the session
    pumps them while verifies run), and every burst's spans exist after it."""
    import torch  # noqa: PLC0415

    from memra_dist.phase.levels import TraceSettings  # noqa: PLC0415
    from memra_dist.specdec.drafters.none import NoDrafter  # noqa: PLC0415
    from memra_dist.specdec.sampling import SamplingParams  # noqa: PLC0415
    from memra_dist.specdec.session import SpecSession  # noqa: PLC0415

    class Target:
        label, device = "cpu", torch.device("cpu")

        def alloc(self, c):
            pass

        def forward(self, ids, start, timer=None, last=False):
            out = torch.zeros(ids.shape[0], 11)
            out[:, (start + 1) % 11] = 1.0
            return out

        def rollback(self, n):
            pass

        def drain(self):
            pass

        def free_mb(self):
            return 1

    class Spans(_Inner):
        def burst_steps(self, rec):
            for r in rec.live():
                self.built.append(r.index)
                self.count += 1
                yield

    inner = Spans()
    d = DeferredSink(inner)
    s = SpecSession(Target(), NoDrafter(), SamplingParams(), torch.Generator(), 1, TraceSettings(level=1), d)
    s.start([1, 2, 3], 40, 64)
    s.burst(8)
    assert inner.built == []  # handed over at the burst's end
    s.burst(8)
    assert inner.built == list(range(8))  # the first burst's rounds, pumped during the second's verifies
    d.close()
    assert inner.built == list(range(16))


def test_tracing_bounds_the_gil_handoff_and_restores_it(tmp_path, monkeypatch):
    """A tracing session lowers the switch interval while it is open (the exporter thread
    cannot hold the GIL for 5 ms against the round loop), never raises a lower one, and puts
    the caller's value back when it closes."""
    import sys  # noqa: PLC0415

    from memra_dist.config import RunConfig  # noqa: PLC0415
    from memra_dist.phase.levels import TraceSettings  # noqa: PLC0415
    from memra_dist.tracing.otel import GIL_SWITCH_S, TracingSession  # noqa: PLC0415

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    cfg = RunConfig(model="m", trace=TraceSettings(level=1))
    old = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        ts = TracingSession.open(cfg, run_dir=str(tmp_path / "a"))
        assert sys.getswitchinterval() <= GIL_SWITCH_S
        ts.close()
        assert abs(sys.getswitchinterval() - 0.005) < 5e-6
        sys.setswitchinterval(1e-4)
        ts = TracingSession.open(cfg, run_dir=str(tmp_path / "b"))
        assert abs(sys.getswitchinterval() - 1e-4) < 5e-6
        ts.close()
        assert abs(sys.getswitchinterval() - 1e-4) < 5e-6
    finally:
        sys.setswitchinterval(old)
