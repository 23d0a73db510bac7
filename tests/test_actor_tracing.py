"""The spans an actor has at stake, counted while another thread builds them: the driver asks
for that count when an actor's close runs past the bound, which may be mid-build."""

import threading

from memra_dist.pipeline.actor_tracing import ActorTracing


class _BlockingTracer:
    """Wraps the real tracer; the first span waits until the test has looked."""

    def __init__(self, inner, started: threading.Event, go: threading.Event):
        self.inner, self.started, self.go, self.calls = inner, started, go, 0

    def start_span(self, *a, **kw):
        self.calls += 1
        if self.calls == 1:
            self.started.set()
            self.go.wait(10)
        return self.inner.start_span(*a, **kw)


def _records(n: int) -> list[tuple]:
    return [(1_000 * i, 1_000 * i + 500, i, 1, i, 100, "cuda:0", 0, 0) for i in range(n)]


def test_spans_being_built_count_as_at_stake(tmp_path, monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    tr = ActorTracing("stage", 0, str(tmp_path), enabled=True)
    started, go = threading.Event(), threading.Event()
    tr.tracer = _BlockingTracer(tr.tracer, started, go)
    records = _records(6)
    t = threading.Thread(target=tr.stage_spans, args=({}, records))
    t.start()
    assert started.wait(10)
    try:
        assert tr.at_stake(records) == 6  # taken for spans, none built yet: all at stake
        records.extend(_records(2))  # forwards recorded meanwhile
        assert tr.at_stake(records) == 8
    finally:
        go.set()
        t.join(10)
    assert tr.made == 6 and tr.at_stake(records) == 8
    tr.stage_spans({}, records)  # a later call builds only the rest
    assert tr.made == 8 and tr.at_stake(records) == 8
    assert tr.close() == 0


def test_off_counts_nothing(tmp_path):
    tr = ActorTracing("stage", 0, str(tmp_path), enabled=False)
    tr.stage_spans({}, _records(3))
    assert tr.made == 0 and tr.at_stake(_records(3)) == 0 and tr.close() == 0
