"""`memra-dist serve` over real HTTP (httpx). Quick: the API app under uvicorn over a fake,
slow engine (queue, 429, 400s, disconnects, S sessions at once, the engine closed at
shutdown). Slow: the tiny llama behind a real local Ray Serve, started once for the module:
a streamed completion equals the non-streamed one and the engine's greedy output, a
traceparent parents the request span at an OTLP receiver, 400 / 429 / a disconnect leave the
request in flight undisturbed, /v1/models, /health, /metrics answer, and the app's limits
hold behind Serve's proxy (stalled uploads, a 20 MB body, text/plain, disconnects at every
stage: counted, no traceback in the replica's log). More hostile clients: test_serve_hostile.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from ports import free_port as _free_port  # noqa: E402
from memra_dist.cli import _add_run_args  # noqa: E402
from memra_dist.config import RunConfig  # noqa: E402
from memra_dist.errors import UserError  # noqa: E402
from memra_dist.serve.api import build_app  # noqa: E402
from memra_dist.serve.host import EngineHost  # noqa: E402
from memra_dist.specdec.request import Result  # noqa: E402

# ---- helpers --------------------------------------------------------------------------------


def _events(resp) -> list:
    """The JSON objects of an SSE body ([DONE] as the string)."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _text(events) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))


def _until(cond, timeout=20.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def _stream(client, base, body, headers=None):
    """A streamed completion, its events read lazily: (response, event iterator)."""
    with client.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, headers=headers) as r:
        lines = (json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]" for x in r.iter_lines() if x.startswith("data: "))
        yield r, lines




# ---- a fake engine under uvicorn (quick) -------------------------------------------------------


class FakeTok:
    vocab_size = 100

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 30 for c in text]  # printable ASCII -> 2..96

    def decode(self, ids) -> str:
        return "".join(chr(i + 30) for i in ids if i != 1)  # 1 is end-of-text


class FakeMcfg:
    vocab_size = 100
    eos_token_ids = (1,)
    max_position_embeddings = 4096


class FakeEngine:
    """One token per 'round', `delay` s apart; a raising stream aborts, as the contract says."""

    def __init__(self, sessions: int, delay: float):
        self.sessions, self.capacity, self.delay = sessions, 4096, delay
        self.lock = threading.Lock()
        self.running = self.most = 0
        self.aborted = 0

    def plan(self, n, cfg):
        if cfg.max_new_tokens == 777:
            raise UserError("the engine refuses\nthis request")

    def generate(self, ids, cfg, stream=None, span_sink=None, carrier=None):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            out = []
            for i in range(cfg.max_new_tokens):
                t = 1 if "end" in FakeTok().decode(ids) and i == 2 else (sum(ids) + i) % 90 + 2
                out.append(t)
                time.sleep(self.delay)
                if stream is not None:
                    stream([t])
                if t == 1:
                    break
            return Result(out, {"tokens": len(out)})
        except BaseException:
            self.aborted += 1
            raise
        finally:
            with self.lock:
                self.running -= 1


class FakeOpen:
    def __init__(self, delay):
        self.delay, self.engines, self.closed = delay, [], 0

    @contextmanager
    def __call__(self, cfg, capacity=None, sessions=None):
        e = FakeEngine(sessions or 1, self.delay)
        self.engines.append(e)
        try:
            yield e
        finally:
            self.closed += 1


@contextmanager
def _uvicorn(app):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    _until(lambda: server.started, 10, "uvicorn to start")
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        th.join(10)


@contextmanager
def _fake_server(sessions=1, max_queue=1, delay=0.01, opener=None):
    opener = opener or FakeOpen(delay)
    host = EngineHost(RunConfig(model="/models/fake", max_new_tokens=6), sessions, open_engine=opener,
                      tokenizer=FakeTok(), mcfg=FakeMcfg())
    with _uvicorn(build_app(host, max_queue)) as base, httpx.Client(timeout=30) as client:
        yield base, client, host
    assert opener.closed == 1  # the app's shutdown exited the engine


def _health(client, base):
    return client.get(f"{base}/health").json()


def test_fake_stream_equals_the_completion_and_ends_with_done():
    with _fake_server() as (base, client, host):
        r = client.post(f"{base}/v1/completions", json={"prompt": "Hello", "max_tokens": 5})
        assert r.status_code == 200
        full = r.json()
        assert full["object"] == "text_completion" and full["model"] == "fake"
        assert full["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        assert full["choices"][0]["finish_reason"] == "length"
        with client.stream("POST", f"{base}/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "stream": True,
                                                                   "stream_options": {"include_usage": True}}) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            ev = _events(s)
        assert ev[-1] == "[DONE]" and ev[-2]["usage"]["completion_tokens"] == 5 and ev[-2]["choices"] == []
        assert ev[-3]["choices"][0]["finish_reason"] == "length"
        assert len({e["id"] for e in ev[:-1]}) == 1
        assert _text(ev) == full["choices"][0]["text"] and len(full["choices"][0]["text"]) == 5
        stop = client.post(f"{base}/v1/completions", json={"prompt": "the end", "max_tokens": 9}).json()
        assert stop["choices"][0]["finish_reason"] == "stop" and stop["usage"]["completion_tokens"] == 3


def test_fake_queue_429_400_and_disconnect_leave_the_running_request_alone():
    with _fake_server(max_queue=1, delay=0.02) as (base, client, host):
        engine = host.engine
        with _stream(client, base, {"prompt": "first", "max_tokens": 400}) as (ra, a):
            first = [next(a) for _ in range(3)]  # A holds the one session
            got_b = {}

            def b():
                with httpx.Client(timeout=30) as c2, _stream(c2, base, {"prompt": "second", "max_tokens": 3}) as (rb, it):
                    got_b["events"] = list(it)

            tb = threading.Thread(target=b)
            tb.start()
            _until(lambda: _health(client, base)["queued"] == 1, what="B queued")
            r = client.post(f"{base}/v1/completions", json={"prompt": "third"})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full" and "--max-queue 1" in r.json()["error"]["message"]
            for body, param in (({"prompt": "x", "top_p": 3}, "top_p"), ({"prompt": "x" * 4096}, "prompt"),
                                ({"prompt": "x", "bogus": 1}, "bogus")):
                r = client.post(f"{base}/v1/completions", json=body)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            r = client.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 777})  # the engine's refusal
            assert r.status_code == 400 and "\n" not in r.json()["error"]["message"]
            more = [next(a) for _ in range(3)]  # A went on undisturbed
            assert all(e["id"] == first[0]["id"] for e in first + more)
        # A's client went away: its session goes to B at the engine's next round
        tb.join(10)
        assert got_b["events"][-1] == "[DONE]" and _text(got_b["events"])
        _until(lambda: _health(client, base)["in_flight"] == 0, what="sessions freed")
        assert engine.aborted == 1 and engine.most == 1
        metrics = client.get(f"{base}/metrics").text
        for outcome, n in (("ok", 1), ("rejected", 1), ("bad_request", 4), ("aborted", 1)):
            assert f'memra_api_requests_total{{outcome="{outcome}"}} {n}.0' in metrics, metrics
        assert client.post(f"{base}/v1/completions", json={"prompt": "after"}).status_code == 200


def test_fake_a_client_gone_while_queued_leaves_the_queue():
    """A queued client that closes its connection leaves the queue while the running request
    goes on (the server polls a queued request's connection: it does not cancel the handler)."""
    with _fake_server(max_queue=2, delay=0.05) as (base, client, host):
        # up to 50 s: in flight past the checks even on a loaded machine; leaving the block ends it
        with _stream(client, base, {"prompt": "first", "max_tokens": 1000}) as (_, a):
            next(a)
            body = json.dumps({"prompt": "queued", "max_tokens": 3}).encode()
            addr = base.removeprefix("http://").split(":")
            raw = socket.create_connection((addr[0], int(addr[1])))  # a client that just hangs up
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            _until(lambda: _health(client, base)["queued"] == 1, what="queued")
            raw.close()  # the queued client goes away
            _until(lambda: _health(client, base)["queued"] == 0, what="left the queue")
            assert _health(client, base)["in_flight"] == 1  # the first request still runs
        _until(lambda: _health(client, base)["in_flight"] == 0, what="sessions freed")


def test_fake_sessions_run_at_once():
    with _fake_server(sessions=2, max_queue=0, delay=0.02) as (base, client, host):
        assert host.sessions == 2 and _health(client, base)["sessions"] == 2
        with _stream(client, base, {"prompt": "a", "max_tokens": 50}) as (_, a), \
                _stream(client, base, {"prompt": "b", "max_tokens": 50}) as (_, b):
            next(a), next(b)
            assert host.engine.most == 2
            assert client.post(f"{base}/v1/completions", json={"prompt": "c"}).status_code == 429  # queue 0


def test_an_engine_without_sessions_serves_one_at_a_time():
    class OldOpen(FakeOpen):
        @contextmanager
        def __call__(self, cfg, capacity=None):  # noqa: D102 (the engine before the sessions contract)
            with FakeOpen.__call__(self, cfg, capacity, 3) as e:
                yield e

    with _fake_server(sessions=3, opener=OldOpen(0.01)) as (base, client, host):
        assert host.sessions == 1 and not host.concurrent
        assert client.post(f"{base}/v1/completions", json={"prompt": "hi"}).status_code == 200


def test_fake_models_health_metrics_and_unknown_routes():
    with _fake_server() as (base, client, host):
        assert client.get(f"{base}/v1/models").json()["data"][0]["id"] == "fake"
        assert client.get(f"{base}/health").json()["status"] == "ok"
        m = client.get(f"{base}/metrics")
        assert m.status_code == 200 and "memra_api_queue_depth 0.0" in m.text
        r = client.get(f"{base}/v2/nothing")
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert client.get(f"{base}/v1/completions").status_code == 405


# ---- the tiny llama on a real Ray Serve (slow) ---------------------------------------------------


TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def served(ckpt_factory):
    """Serve once for the module: the tiny llama (4096 positions, no end-of-text id, so a
    request runs as long as asked), one session, a queue of one, spans to an OTLP receiver."""
    pytest.importorskip("ray.serve")
    from otlp_receiver import OTLPReceiver

    model = ckpt_factory("llama", seed=3, max_position_embeddings=4096, eos_token_id=None)[0]
    rx = OTLPReceiver().start()
    mp = pytest.MonkeyPatch()
    for k, v in rx.env().items():
        mp.setenv(k, v)
    mp.delenv("RAY_ADDRESS", raising=False)
    mp.setenv("MEMRA_FLUSH_TIMEOUT_S", "5")
    from memra_dist.serve.deployment import deploy, undeploy
    from memra_dist.serve.serve_cli import parse_serve_argv

    port = _free_port()
    argv = ["--model", str(model), "--device", "cpu", "--dtype", "fp32", "--max-new-tokens", "24",
            "--trace-level", "1", "--max-queue", "1", "--port", str(port)]
    args = parse_serve_argv(argv, _add_run_args)
    try:
        base = deploy(args)
        with httpx.Client(timeout=60) as client:
            yield base, client, model, argv, rx
    finally:
        undeploy()
        rx.stop()
        mp.undo()


def _reference(model, argv, prompt, **over):
    """What the engine itself gives (app.generate, in this process), as the API's text."""
    from memra_dist.app import config_from_args, generate
    from memra_dist.model.tokenizer import load_tokenizer
    from memra_dist.serve.host import completion_text
    from memra_dist.serve.serve_cli import parse_serve_argv

    i = argv.index("--trace-level")
    args = parse_serve_argv(argv[:i] + argv[i + 2:], _add_run_args)  # the same flags, no spans in this process
    cfg = config_from_args(args, args.model, args.draft_model).with_(**over)
    tok = load_tokenizer(model)
    ids = tok.encode(prompt)
    res = generate(cfg, ids)
    return completion_text(tok, ids, res.token_ids), len(res.token_ids)


@pytest.mark.slow
def test_stream_equals_completion_equals_the_engine(served):
    base, client, model, argv, _ = served
    prompt = "A speculative round has five phases."
    full = client.post(f"{base}/v1/completions", json={"model": model.name, "prompt": prompt}).json()
    with client.stream("POST", f"{base}/v1/completions", json={"prompt": prompt, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        ev = _events(r)
    assert ev[-1] == "[DONE]" and len(ev) > 3  # several chunks, then the finish, then [DONE]
    text, n = _reference(model, argv, prompt)
    assert _text(ev) == full["choices"][0]["text"] == text
    assert full["usage"]["completion_tokens"] == n == 24 and full["choices"][0]["finish_reason"] == "length"
    from memra_dist.specdec.sampling import SamplingParams

    sampled = client.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 9, "temperature": 0.8,
                                                          "top_k": 20, "seed": 5}).json()
    text, _ = _reference(model, argv, prompt, max_new_tokens=9, sampling=SamplingParams(0.8, 20, 1.0), seed=5)
    assert sampled["choices"][0]["text"] == text


@pytest.mark.slow
def test_traceparent_parents_the_request_span(served):
    base, client, _, _, rx = served
    tp = f"00-{TRACE_ID}-{PARENT_ID}-01"
    assert client.post(f"{base}/v1/completions", json={"prompt": "Hello", "max_tokens": 4},
                       headers={"traceparent": tp}).status_code == 200
    assert client.post(f"{base}/v1/completions", json={"prompt": "Hello again", "max_tokens": 4}).status_code == 200

    def done(spans):
        reqs = [s for s in spans if s.name == "memra.request"]
        return any(s.trace_id == TRACE_ID for s in reqs) and any(s.parent_span_id == "" for s in reqs)

    spans = rx.wait_for_spans(done, timeout=20)
    reqs = [s for s in spans if s.name == "memra.request"]
    mine = [s for s in reqs if s.trace_id == TRACE_ID]
    assert len(mine) == 1 and mine[0].parent_span_id == PARENT_ID, reqs
    assert mine[0].attributes["memra.prompt_tokens"] > 0
    assert any(s.name == "spec.burst" and s.trace_id == TRACE_ID for s in spans)  # the rounds join that trace
    roots = [s for s in reqs if s.parent_span_id == ""]
    assert roots and all(s.trace_id != TRACE_ID for s in roots)  # no header: a trace of its own
    assert len({s.trace_id for s in reqs}) == len(reqs)  # one trace per request


@pytest.mark.slow
def test_400_429_and_a_disconnect_leave_the_request_in_flight_alone(served):
    base, client, _, _, rx = served
    long = {"prompt": "The phase clock drains the streams", "max_tokens": 3000}
    with _stream(client, base, long) as (_, a):
        first = [next(a) for _ in range(3)]
        got_b: dict = {}

        def b():  # queued behind A; reads two chunks, then goes away mid-stream
            with httpx.Client(timeout=60) as c2, _stream(c2, base, {**long, "prompt": "Hello"}) as (rb, it):
                got_b["status"] = rb.status_code
                got_b["events"] = [next(it), next(it)]
                got_b["t"] = time.monotonic()

        tb = threading.Thread(target=b)
        tb.start()
        _until(lambda: client.get(f"{base}/health").json()["queued"] == 1, what="B queued")
        r = client.post(f"{base}/v1/completions", json={"prompt": "one too many"})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        r = client.post(f"{base}/v1/completions", content=b'{"prompt": "x", "temperature": "hot"}',
                        headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        r = client.post(f"{base}/v1/completions", json={"prompt": "word " * 5000})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        metrics = client.get(f"{base}/metrics").text
        assert "memra_api_in_flight 1.0" in metrics and "memra_api_queue_depth 1.0" in metrics
        more = [next(a) for _ in range(5)]  # A streams on, undisturbed
        assert all(isinstance(e, dict) and e["id"] == first[0]["id"] for e in first + more)
        t_close = time.monotonic()
    tb.join(60)  # A went away: B gets the session at A's next round, then goes away itself
    assert got_b["status"] == 200 and len(got_b["events"]) == 2 and got_b["t"] - t_close < 10
    _until(lambda: client.get(f"{base}/health").json()["in_flight"] == 0, 30, "both sessions freed")
    after = client.post(f"{base}/v1/completions", json={"prompt": "Hello", "max_tokens": 6})
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 6
    metrics = client.get(f"{base}/metrics").text
    assert 'memra_api_requests_total{outcome="aborted"} 2.0' in metrics
    assert 'memra_api_requests_total{outcome="rejected"} 1.0' in metrics
    aborted = rx.wait_for_spans(lambda s: sum(x.name == "memra.request" and x.status_code == 2 for x in s) >= 2, 20)
    assert sum(x.name == "memra.request" and x.status_code == 2 for x in aborted) >= 2  # marked as errors


@pytest.mark.slow
def test_models_health_and_metrics_answer(served):
    base, client, model, _, _ = served
    models = client.get(f"{base}/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [model.name]
    h = client.get(f"{base}/health")
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["sessions"] == 1
    m = client.get(f"{base}/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    for name in ("memra_api_in_flight", "memra_api_queue_depth", "memra_api_requests_total", "memra_api_tokens_total"):
        assert name in m.text


@pytest.mark.slow
def test_stalled_uploads_huge_bodies_and_wrong_types_behind_ray_serves_proxy(served):
    """The app's limits hold behind Serve's proxy: 64 stalled uploads (more than the replica's
    old max_ongoing_requests) leave /health answering; each gets its 408 and its connection
    closed after the read timeout; a 20 MB body is a 413 at once; text/plain is a 415."""
    from memra_dist.serve.limits import READ_TIMEOUT_S

    base, client, _, _, _ = served
    host, port = base.removeprefix("http://").split(":")
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n")
    t0 = time.monotonic()
    stalled = []
    for _ in range(64):
        s = socket.create_connection((host, int(port)), timeout=READ_TIMEOUT_S + 20)
        s.sendall(head % 100 + b'{"prompt": ')
        stalled.append(s)
    worst = 0.0
    while time.monotonic() - t0 < 3:
        t = time.monotonic()
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        worst = max(worst, time.monotonic() - t)
        time.sleep(0.1)
    assert worst < 1.0, worst
    big = socket.create_connection((host, int(port)), timeout=10)
    t = time.monotonic()
    big.sendall(head % (20 * 1024 * 1024) + b"x" * 65536)
    answer = b""
    while b"}}" not in answer:  # the JSON error ends the answer; the proxy closes the connection
        part = big.recv(65536)
        if not part:
            break
        answer += part
    assert answer.startswith(b"HTTP/1.1 413") and b"body_too_large" in answer and time.monotonic() - t < 1.0, answer
    big.close()
    r = client.post(f"{base}/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    for s in stalled:  # each: a 408, then the proxy closes the connection
        got = b""
        while True:
            part = s.recv(65536)
            if not part:
                break
            got += part
        assert got.startswith(b"HTTP/1.1 408") and b"request_timeout" in got, got[:300]
        s.close()
    assert time.monotonic() - t0 < READ_TIMEOUT_S + 15
    ok = client.post(f"{base}/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    assert ok.status_code == 200


def _replica_tracebacks() -> tuple[int, list[str]]:
    """(files read, those with a traceback): the Serve replicas' logs of this Ray session
    (their stderr files and Serve's own)."""
    import glob
    import os

    import ray

    logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")  # noqa: SLF001
    read, found = 0, []
    for path in glob.glob(os.path.join(logs, "worker-*.err")) + glob.glob(os.path.join(logs, "serve", "replica_*.log")):
        with open(path, errors="replace") as f:
            text = f.read()
        if "ServeReplica" in text[:2000] or "/replica_" in path:
            read += 1
            found += [path for marker in ("Traceback", "never retrieved") if marker in text]
    return read, found


@pytest.mark.slow
def test_disconnects_at_every_stage_behind_ray_are_counted_and_leave_no_traceback(served):
    base, client, _, _, _ = served
    host, port = base.removeprefix("http://").split(":")

    def aborted() -> float:
        text = client.get(f"{base}/metrics").text
        return float(text.split('memra_api_requests_total{outcome="aborted"} ')[1].split()[0])

    def raw(body: bytes, cut: int | None = None) -> socket.socket:
        s = socket.create_connection((host, int(port)), timeout=30)
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n")
        s.sendall(head % len(body) + (body if cut is None else body[:cut]))
        return s

    before = aborted()
    plain = json.dumps({"prompt": "Hello there", "max_tokens": 3000}).encode()
    streamed = json.dumps({"prompt": "Hello there", "max_tokens": 3000, "stream": True}).encode()
    for cut in (0, 5):  # head only, mid-body (held long enough to reach the replica)
        s = raw(plain, cut)
        time.sleep(0.5)
        s.close()
    held = raw(streamed)
    held.recv(300)  # it holds the one session, streaming
    queued = raw(plain)
    _until(lambda: client.get(f"{base}/health").json()["queued"] == 1, 20, "queued")
    queued.close()
    _until(lambda: client.get(f"{base}/health").json()["queued"] == 0, 20, "left the queue")
    held.close()  # mid-stream
    for body in (plain, streamed):  # gone while generating (not streamed; streamed, nothing read)
        _until(lambda: client.get(f"{base}/health").json()["in_flight"] == 0, 30, "the session free")
        s = raw(body)
        _until(lambda: client.get(f"{base}/health").json()["in_flight"] == 1, 20, "generating")
        s.close()
    _until(lambda: client.get(f"{base}/health").json()["in_flight"] == 0, 30, "the session free")
    _until(lambda: aborted() - before == 6, 20, "six aborted requests counted")
    time.sleep(1)  # the replica's log reaches its files
    read, found = _replica_tracebacks()
    assert read >= 2 and found == [], found
