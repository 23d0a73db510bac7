"""`memra-dist serve`'s graceful stop (serve/drain.py). Quick: the app under uvicorn over the
fake engine of test_serve_api.py, drained (new completions 503 "draining", /health 503, the
open ones finish) and cut (a begun stream ends with an error event and [DONE], the rest get
503 "shutting_down"). Then a real `memra-dist serve` on the tiny llama, stopped by SIGTERM
while one stream generates and two wait: both first streams end with [DONE], a request in
the drain is a 503, a second SIGTERM cuts the third stream (error event, [DONE]), exit 0."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from contextlib import contextmanager

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_serve_api import FakeMcfg, FakeOpen, FakeTok, _until, _uvicorn  # noqa: E402

from memra_dist.config import RunConfig  # noqa: E402
from memra_dist.serve.api import build_app  # noqa: E402
from memra_dist.serve.drain import Drain  # noqa: E402
from memra_dist.serve.host import EngineHost  # noqa: E402


class Reader:
    """A streaming completion read on its own thread: its status, its events ([DONE] as the
    string), and its JSON body when it was not a stream."""

    def __init__(self, base: str, body: dict):
        self.status, self.events, self.body, self.error = None, [], None, None
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(base, body), daemon=True)
        self.thread.start()

    def _run(self, base, body):
        try:
            with httpx.Client(timeout=120) as c, c.stream("POST", f"{base}/v1/completions", json=body) as r:
                self.status = r.status_code
                if not r.headers.get("content-type", "").startswith("text/event-stream"):
                    self.body = json.loads(r.read())
                    return
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                        self.first.set()
        except Exception as e:  # noqa: BLE001 (the test asserts on it)
            self.error = e
        finally:
            self.first.set()

    def join(self, timeout: float) -> "Reader":
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.error is None, repr(self.error)
        return self

    @property
    def errors(self) -> list:
        return [e for e in self.events if isinstance(e, dict) and "error" in e]

    @property
    def text(self) -> str:
        return "".join(e["choices"][0]["text"] for e in self.events if isinstance(e, dict) and e.get("choices"))


@contextmanager
def _app(sessions: int, max_queue: int, delay: float = 0.02):
    drain, opener = Drain(), FakeOpen(delay)
    host = EngineHost(RunConfig(model="/models/fake", max_new_tokens=6), sessions, open_engine=opener,
                      tokenizer=FakeTok(), mcfg=FakeMcfg())
    with _uvicorn(build_app(host, max_queue, drain=drain)) as base, httpx.Client(timeout=30) as client:
        yield base, client, drain, opener
    assert opener.closed == 1


def test_a_drain_refuses_new_requests_and_lets_the_open_ones_finish():
    with _app(sessions=1, max_queue=2) as (base, client, drain, _):
        a = Reader(base, {"prompt": "Hello", "max_tokens": 40, "stream": True})
        assert a.first.wait(10) and a.status == 200
        b = Reader(base, {"prompt": "queued", "max_tokens": 10, "stream": True})
        _until(lambda: client.get(f"{base}/health").json()["queued"] == 1, 10, "b queued")
        drain.start()
        r = client.post(f"{base}/v1/completions", json={"prompt": "late", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining", r.text
        assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
        h = client.get(f"{base}/health")
        assert h.status_code == 503 and h.json()["status"] == "draining" and h.json()["queued"] == 1
        for s, n in ((a, 40), (b, 10)):
            s.join(20)
            assert s.events[-1] == "[DONE]" and not s.errors and len(s.text) == n, s.events[-3:]
        _until(lambda: drain.open == 0, 10, "nothing open")
        m = client.get(f"{base}/metrics").text
        assert 'memra_api_requests_total{outcome="rejected"} 1.0' in m and 'outcome="ok"} 2.0' in m


def test_a_cut_ends_begun_streams_with_an_error_event_and_the_rest_with_503():
    with _app(sessions=2, max_queue=2) as (base, client, drain, opener):
        d = Reader(base, {"prompt": "stream", "max_tokens": 2000, "stream": True})
        g = Reader(base, {"prompt": "plain", "max_tokens": 2000})
        assert d.first.wait(10)
        _until(lambda: client.get(f"{base}/health").json()["in_flight"] == 2, 10, "two generating")
        e = Reader(base, {"prompt": "queued stream", "max_tokens": 5, "stream": True})
        f = Reader(base, {"prompt": "queued plain", "max_tokens": 5})
        _until(lambda: client.get(f"{base}/health").json()["queued"] == 2, 10, "two queued")
        t = time.monotonic()
        drain.cut()  # from another thread than the app's loop, as the replica's method may be
        for r in (d, g, e, f):
            r.join(10)
        assert time.monotonic() - t < 3
        assert d.status == 200 and d.events[-1] == "[DONE]" and d.text, d.events[-3:]
        assert [x["error"]["code"] for x in d.errors] == ["shutting_down"] and d.events[-2] == d.errors[0]
        for r in (g, e, f):
            assert r.status == 503 and r.body["error"]["code"] == "shutting_down", (r.status, r.body)
        _until(lambda: client.get(f"{base}/health").json()["in_flight"] == 0, 10, "the sessions freed")
        assert opener.engines[0].aborted == 2 and drain.open == 0


# ---- the CLI's side: the signals (serve_cli.py) and the drain's loop (deployment.py), without Ray ----


class FakeReplica:
    """The deployment's drain methods through a handle: `open` requests end one per `ends_every` calls."""

    def __init__(self, open_: int, ends_every: int | None = None, fail: bool = False):
        self.open, self.ends_every, self.fail, self.calls = open_, ends_every, fail, []

    def __getattr__(self, method):
        replica = self

        class Call:
            def remote(self):
                return self

            def result(self, timeout_s=None):
                if replica.fail:
                    raise TimeoutError("no answer")
                replica.calls.append(method)
                if method == "cut":
                    replica.open = 0
                elif replica.ends_every and len(replica.calls) % replica.ends_every == 0:
                    replica.open = max(0, replica.open - 1)
                return {"open": replica.open}

        return Call()


@pytest.mark.parametrize("replica, timeout, cut_asked, said", [
    (FakeReplica(2, ends_every=2), 30, False, "2 open request(s) ended in"),
    (FakeReplica(2), 0.3, False, "2 open request(s) cut"),  # the timeout
    (FakeReplica(3, ends_every=3), 30, True, "1 of 3 open request(s) ended, 2 cut"),  # a second signal
    (FakeReplica(0), 30, False, "0 open request(s) ended in"),
    (FakeReplica(1, fail=True), 30, False, "the replica did not answer (TimeoutError): not drained"),
])
def test_the_drain_waits_for_the_open_requests_then_cuts_what_is_left(monkeypatch, replica, timeout, cut_asked,
                                                                      said):
    from memra_dist.serve import deployment

    monkeypatch.setattr(deployment.serve, "get_deployment_handle", lambda name, app: replica)
    monkeypatch.setattr(deployment, "FLUSH_S", 0)
    asked = iter([False, False] + [cut_asked] * 100)
    t = time.monotonic()
    got = deployment.drain(timeout, lambda: next(asked))
    assert said in got and time.monotonic() - t < 5, got
    assert replica.fail or replica.calls[0] == "begin_drain"
    assert ("cut" in replica.calls) == ("cut" in said)


def _serve_with(signals: list[int], timeout: float = 30.0):
    """serve_cli._serve over fakes, these signals sent to this process one by one (each once the
    one before was seen): (exit code, the drain's calls, the cut asked, undeployed)."""
    import argparse

    from memra_dist.serve.serve_cli import _serve, _Signals

    calls, undeployed = [], []
    sig = _Signals(True)
    args = argparse.Namespace(model="/m/tiny", pp=1, max_batch=1, max_queue=4, drain_timeout=timeout)

    def send_next():
        if signals:
            os.kill(os.getpid(), signals.pop(0))

    def drain(timeout_s, cut_asked=lambda: False):
        calls.append(timeout_s)
        if signals:  # the second signal, while the drain waits: it asks for the cut
            send_next()
            end = time.monotonic() + 5
            while not cut_asked() and time.monotonic() < end:
                time.sleep(0.01)
        return "drained"

    def first():  # once serve serves (a signal before that means a stop while starting)
        end = time.monotonic() + 30
        while sig.phase != "serving" and time.monotonic() < end:
            time.sleep(0.01)
        send_next()

    # Ctrl-C as a user's process has it, whatever an earlier test left in this one (a SIGINT
    # ignored or caught without raising would leave serve sleeping for good)
    prev = (signal.signal(signal.SIGTERM, sig.on_term), signal.signal(signal.SIGINT, signal.default_int_handler))
    sender = threading.Thread(target=first, daemon=True)
    try:
        sender.start()
        rc = _serve(args, lambda a: "http://127.0.0.1:1", lambda: undeployed.append(1), drain, 1, sig)
    finally:
        sender.join(5)
        put_back = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGTERM, prev[0])
        signal.signal(signal.SIGINT, prev[1])
    assert put_back is signal.default_int_handler  # serve put back the SIGINT handler it found
    return rc, calls, sig.cut, undeployed == [1]


def test_sigterm_drains_a_second_signal_cuts_and_ctrl_c_stops_at_once():
    assert _serve_with([signal.SIGTERM], 12) == (0, [12], False, True)
    assert _serve_with([signal.SIGTERM, signal.SIGTERM]) == (0, [30], True, True)
    assert _serve_with([signal.SIGTERM, signal.SIGINT]) == (0, [30], True, True)
    assert _serve_with([signal.SIGINT]) == (0, [0], False, True)  # Ctrl-C: cut at once


# ---- a real `memra-dist serve` stopped by SIGTERM ---------------------------------------------------


@pytest.mark.slow  # a real serve (Ray Serve) started and drained: ~20 s
def test_sigterm_drains_in_flight_and_queued_streams_then_a_second_cuts(ckpt_factory, tmp_path):
    pytest.importorskip("ray.serve")
    model = ckpt_factory("llama", seed=3, max_position_embeddings=4096, eos_token_id=None)[0]
    from serve_proc import serve

    with serve(model, "--max-batch", "1", "--drain-timeout", "120", cwd=tmp_path, up_s=120, stop=None) as srv:
        p, base = srv.p, srv.base
        with httpx.Client(timeout=30) as client:
            a = Reader(base, {"prompt": "Hello there", "max_tokens": 400, "stream": True})  # generating
            assert a.first.wait(60) and a.status == 200, (a.status, a.body, a.error)
            b = Reader(base, {"prompt": "Queued one", "max_tokens": 200, "stream": True})
            _until(lambda: client.get(f"{base}/health").json()["queued"] == 1, 30, "b queued")
            c = Reader(base, {"prompt": "Queued two", "max_tokens": 3000, "stream": True})  # outlives the drain
            _until(lambda: client.get(f"{base}/health").json()["queued"] == 2, 30, "c queued")
            os.kill(p.pid, signal.SIGTERM)
            _until(lambda: client.get(f"{base}/health").status_code == 503, 30, "/health to say draining")
            assert client.get(f"{base}/health").json()["status"] == "draining"
            late = client.post(f"{base}/v1/completions", json={"prompt": "late", "max_tokens": 2})
            assert late.status_code == 503 and late.json()["error"]["code"] == "draining", late.text
            for s in (a, b):
                s.join(120)
                assert s.events[-1] == "[DONE]" and not s.errors, s.events[-3:]
                assert s.events[-2]["choices"][0]["finish_reason"] == "length"
            assert c.first.wait(60) and c.status == 200 and p.poll() is None  # c runs now; the drain waits for it
        t = time.monotonic()
        os.kill(p.pid, signal.SIGTERM)  # the second: cut what is left
        c.join(30)
        assert c.events[-1] == "[DONE]" and [x["error"]["code"] for x in c.errors] == ["shutting_down"], c.events[-3:]
        rc = p.wait(60)
        took = time.monotonic() - t
    err = srv.stderr
    print(f"\n[drain] stopped {took:.1f} s after the second SIGTERM")
    assert rc == 0 and "[serve] stopped" in err and "2 of 3 open request(s) ended, 1 cut" in err, err[-3000:]
