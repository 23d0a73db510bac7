"""`memra-dist serve`'s API under hostile clients, over loopback only, bounded in count and
time: the app (serve/limits.py) under uvicorn with the guarded protocol
(serve/uvicorn_guard.py), over the fake engine of test_serve_api.py.

Stalled uploads, slow headers, slow readers, huge bodies, bad encodings, wrong content
types, disconnects at every stage of a request, an engine failure, mixed with well-behaved
clients whose answers must equal their solo runs; /health answers within a second
throughout, every refused or abandoned request is counted, and no client's end leaves a
traceback in the log."""

from __future__ import annotations

import json
import logging
import random
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from test_serve_api import FakeMcfg, FakeOpen, FakeTok, _events, _text, _until  # noqa: E402

from memra_dist.config import RunConfig  # noqa: E402
from memra_dist.serve.api import build_app  # noqa: E402
from memra_dist.serve.host import EngineHost  # noqa: E402
from memra_dist.serve.uvicorn_guard import uvicorn_config  # noqa: E402

GUARD_KEYS = ("header_timeout_s", "max_header_bytes", "max_connections")


class Srv:
    def __init__(self, base: str, host, client):
        self.base, self.host, self.client = base, host, client
        self.port = int(base.rsplit(":", 1)[1])

    def health(self) -> tuple[float, dict]:
        """(seconds, body) of GET /health on a new connection."""
        t = time.monotonic()
        r = httpx.get(f"{self.base}/health", timeout=10)
        assert r.status_code == 200
        return time.monotonic() - t, r.json()

    def outcomes(self) -> dict:
        text = self.client.get(f"{self.base}/metrics").text
        return {m[0]: float(m[1]) for m in re.findall(r'memra_api_requests_total\{outcome="(\w+)"\} ([\d.]+)', text)}

    def stream_text(self, prompt: str, max_tokens: int) -> tuple[str, str]:
        """A well-behaved streaming client: (text, finish_reason); the stream ends with [DONE]."""
        with httpx.Client(timeout=30) as c, c.stream("POST", f"{self.base}/v1/completions",
                                                     json={"prompt": prompt, "max_tokens": max_tokens,
                                                           "stream": True}) as r:
            assert r.status_code == 200, r.read()
            ev = _events(r)
        assert ev[-1] == "[DONE]", ev[-3:]
        return _text(ev), ev[-2]["choices"][0]["finish_reason"]


@contextmanager
def _server(sessions=2, max_queue=16, delay=0.003, opener=None, tokenizer=None, mcfg=None, sndbuf=None, **limits):
    opener = opener or FakeOpen(delay)
    guard = {k: limits.pop(k) for k in GUARD_KEYS if k in limits}
    host = EngineHost(RunConfig(model="/models/fake", max_new_tokens=6), sessions, open_engine=opener,
                      tokenizer=tokenizer or FakeTok(), mcfg=mcfg or FakeMcfg())
    cfg = uvicorn_config(build_app(host, max_queue, **limits), "127.0.0.1", 0, timeout_graceful_shutdown=5, **guard)
    if sndbuf:  # a small kernel send buffer: a client that does not read blocks the server's writes soon
        class SmallSendBuffer(cfg.http):
            def connection_made(self, transport):
                transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
                super().connection_made(transport)

        cfg.http = SmallSendBuffer
    server = uvicorn.Server(cfg)
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    _until(lambda: server.started, 10, "uvicorn to start")
    base = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        with httpx.Client(timeout=30) as client:
            yield Srv(base, host, client)
    finally:
        server.should_exit = True
        th.join(15)
    assert opener.closed == 1


# ---- raw sockets ------------------------------------------------------------------------------


def _head(port, length: int | None = None, ctype="application/json", path="/v1/completions", extra="") -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}"]
    if ctype:
        lines.append(f"Content-Type: {ctype}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def _raw(port, data: bytes = b"", rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    if data:
        s.sendall(data)
    return s


def _response(s: socket.socket, timeout=10.0) -> tuple[int, dict, bytes, bool]:
    """(status, headers, body, closed) of one answer; closed: the server then closed the connection."""
    s.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        got = s.recv(65536)
        if not got:
            return 0, {}, buf, True
        buf += got
    head, body = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
    n = int(headers.get("content-length", 0))
    while len(body) < n:
        got = s.recv(65536)
        if not got:
            break
        body += got
    closed = False
    try:
        s.settimeout(2.0)
        closed = s.recv(1) == b""
    except (TimeoutError, socket.timeout):
        pass
    except OSError:
        closed = True
    return int(lines[0].split()[1]), headers, body, closed


def _closed_within(s: socket.socket, timeout: float) -> bool:
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
        return True
    except (TimeoutError, socket.timeout):
        return False
    except OSError:
        return True


def _error(body: bytes) -> dict:
    e = json.loads(body)["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["code"], e
    return e


@pytest.fixture
def quiet_log(caplog, capfd):
    """Asserts at the end that nothing logged a traceback (a client's end is never one), by
    logging or on stderr (uvicorn's own loggers write there)."""
    caplog.set_level(logging.WARNING)
    yield caplog
    bad = [r.getMessage() for r in caplog.records if r.exc_info or "never retrieved" in r.getMessage()]
    err = capfd.readouterr().err
    bad += [x for x in err.splitlines() if "Traceback" in x or "never retrieved" in x or "Exception in ASGI" in x]
    assert not bad, (bad, err[-3000:])


# ---- the targets --------------------------------------------------------------------------------


@pytest.mark.slow
def test_64_stalled_uploads_leave_16_streaming_clients_and_health_alone(quiet_log):
    prompts = [f"client {i} asks" for i in range(16)]
    with _server(sessions=4, max_queue=16, read_timeout_s=60) as s:
        solo = [s.stream_text(p, 40) for p in prompts]
        stalled = [_raw(s.port, _head(s.port, 100) + b'{"prompt": "') for _ in range(64)]
        worst = [0.0]
        stop = threading.Event()

        def probe():
            while not stop.is_set():
                worst[0] = max(worst[0], s.health()[0])
                time.sleep(0.05)

        th = threading.Thread(target=probe)
        th.start()
        try:
            t0 = time.monotonic()
            with ThreadPoolExecutor(16) as ex:
                got = list(ex.map(lambda p: s.stream_text(p, 40), prompts))
            wall = time.monotonic() - t0
        finally:
            stop.set()
            th.join(10)
        assert got == solo and all(r == "length" and len(t) == 40 for t, r in got)
        assert worst[0] < 1.0, worst
        print(f"\n[hostile] 64 stalled uploads + 16 streams: streams done in {wall:.2f} s, worst /health "
              f"{worst[0] * 1000:.0f} ms")
        for sock in stalled:
            sock.close()  # the uploads give up: each counted aborted
        _until(lambda: s.outcomes()["aborted"] == 64, 10, "64 aborted uploads counted")
        assert s.outcomes()["ok"] == 32


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024


def test_a_20mb_body_is_refused_413_at_once_and_never_kept(quiet_log):
    big = b'{"prompt": "' + b"x" * (20 * 1024 * 1024) + b'"}'
    part = b"x" * (1024 * 1024)
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for _ in range(20))  # (the client's bytes: made first)
    with _server() as s:
        s.health()
        rss0 = _rss_mb()
        t = time.monotonic()
        sock = _raw(s.port, _head(s.port, len(big)))
        sender = threading.Thread(target=lambda: _sendall_quietly(sock, big))  # it tries to send it all
        sender.start()
        status, headers, body, closed = _response(sock)
        dt = time.monotonic() - t
        sender.join(10)
        sock.close()
        assert status == 413 and _error(body)["code"] == "body_too_large" and headers["connection"] == "close"
        assert closed and dt < 1.0, dt
        # no Content-Length (chunked): refused once the limit is passed, the rest unread
        sock = _raw(s.port, _head(s.port, None, extra="Transfer-Encoding: chunked\r\n"))
        sender = threading.Thread(target=lambda: _sendall_quietly(sock, chunked))
        sender.start()
        status, _, body, closed = _response(sock)
        sender.join(10)
        sock.close()
        assert status == 413 and _error(body)["code"] == "body_too_large" and closed
        grew = _rss_mb() - rss0
        print(f"\n[hostile] 20 MB body: 413 in {dt * 1000:.0f} ms; RSS grew {grew:.1f} MB")
        assert grew < 100, grew
        assert s.outcomes()["bad_request"] == 2
        assert s.stream_text("after", 5)[1] == "length"


def _sendall_quietly(sock, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # the server answered and closed: the rest is never read


def test_long_prompts_are_refused_without_stalling_health(quiet_log, llama):
    """Three 3 MB prompts at once (under the body limit, over the context) with the real
    tokenizer: each a 400 in well under a second, /health never waits."""
    from memra_dist.model.config import load_config
    from memra_dist.model.tokenizer import load_tokenizer

    tok, mcfg = load_tokenizer(llama), load_config(llama)
    prompt = ("The phase clock drains the streams. " * 90000)[:3_000_000]
    with _server(tokenizer=tok, mcfg=mcfg) as s:
        worst = [0.0]
        stop = threading.Event()

        def probe():
            while not stop.is_set():
                worst[0] = max(worst[0], s.health()[0])
                time.sleep(0.02)

        th = threading.Thread(target=probe)
        th.start()
        t = time.monotonic()
        try:
            with ThreadPoolExecutor(3) as ex:
                rs = list(ex.map(lambda _: httpx.post(f"{s.base}/v1/completions", json={"prompt": prompt},
                                                      timeout=30), range(3)))
        finally:
            stop.set()
            th.join(10)
        dt = time.monotonic() - t
        for r in rs:
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        print(f"\n[hostile] three 3 MB prompts: 400s in {dt:.2f} s, worst /health {worst[0] * 1000:.0f} ms")
        assert worst[0] < 1.0 and dt < 5.0
        ok = httpx.post(f"{s.base}/v1/completions", json={"prompt": "word " * 500, "max_tokens": 4}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


# ---- stalled and slow clients -------------------------------------------------------------------


@pytest.mark.slow  # ~2-4 s on 2 cores: the quick tier keeps its margin under 5 minutes
def test_stalled_uploads_and_heads_are_dropped_and_counted(quiet_log):
    with _server(read_timeout_s=1.0, header_timeout_s=1.0) as s:
        t = time.monotonic()
        uploads = [_raw(s.port, _head(s.port, 100) + b'{"prompt": ') for _ in range(5)]
        heads = [_raw(s.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(3)]
        idle = [_raw(s.port) for _ in range(3)]
        assert s.health()[0] < 1.0
        for sock in uploads:
            status, headers, body, closed = _response(sock)
            assert status == 408 and _error(body)["code"] == "request_timeout" and closed
        for sock in heads:
            status, _, body, closed = _response(sock)
            assert status == 408 and _error(body)["code"] == "request_timeout" and closed
        assert all(_closed_within(sock, 5) for sock in idle)
        assert time.monotonic() - t < 6
        big_head = _raw(s.port, b"GET /health HTTP/1.1\r\nX-Junk: " + b"a" * 70000)
        status, _, body, closed = _response(big_head)
        assert status == 431 and _error(body)["code"] == "headers_too_large" and closed
        for sock in uploads + heads + idle + [big_head]:
            sock.close()
        assert s.outcomes()["aborted"] == 5  # the uploads (heads never reached the app)
        assert s.stream_text("after", 5)[1] == "length"


def test_open_request_and_connection_caps_answer_503_and_health_still_answers(quiet_log):
    with _server(sessions=1, max_queue=1, max_open=4, max_connections=12, read_timeout_s=30) as s:
        stalled = [_raw(s.port, _head(s.port, 100) + b"{") for _ in range(4)]
        _until(lambda: s.health()[1]["open_requests"] == 4, 5, "uploads open")
        r = s.client.post(f"{s.base}/v1/completions", json={"prompt": "one more"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded" and r.headers["retry-after"] == "1"
        assert s.health()[0] < 1.0  # /health never counts toward the cap
        extra = [_raw(s.port) for _ in range(12)]  # past the connection cap: 503, closed
        status, _, body, closed = _response(extra[-1])
        assert status == 503 and _error(body)["code"] == "too_many_connections" and closed
        for sock in stalled + extra:
            sock.close()
        _until(lambda: s.outcomes()["aborted"] == 4, 10, "uploads counted")
        assert s.outcomes()["rejected"] == 1
        assert s.stream_text("after", 5)[1] == "length"


@pytest.mark.slow  # ~2-4 s on 2 cores: the quick tier keeps its margin under 5 minutes
def test_a_slow_reader_is_dropped_and_frees_its_session(quiet_log):
    with _server(sessions=1, delay=0.002, write_timeout_s=1.0, sndbuf=4096) as s:
        body = json.dumps({"prompt": "slow", "max_tokens": 4000, "stream": True}).encode()
        sock = _raw(s.port, _head(s.port, len(body)) + body, rcvbuf=4096)  # reads nothing
        _until(lambda: s.health()[1]["in_flight"] == 1, 10, "generating")
        _until(lambda: s.health()[1]["in_flight"] == 0, 20, "the slow reader dropped")
        assert s.host.engine.aborted == 1, "it ran to its end: never dropped"
        assert s.outcomes()["aborted"] == 1 and s.host.engine.aborted == 1
        assert s.stream_text("a reader", 10)[1] == "length"
        sock.close()


# ---- bad bodies -----------------------------------------------------------------------------------


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                   "application/json; charset=latin-1", "application/jsonp"])
def test_only_json_bodies_are_taken(ctype, quiet_log):
    with _server() as s:
        body = b'{"prompt": "hi"}'
        sock = _raw(s.port, _head(s.port, len(body), ctype=ctype) + body)
        status, headers, resp, _ = _response(sock)
        sock.close()
        assert status == 415 and _error(resp)["code"] == "unsupported_media_type", resp
        assert s.outcomes()["bad_request"] == 1
        for good in ("application/json; charset=utf-8", "Application/JSON"):
            assert s.client.post(f"{s.base}/v1/completions", content=body,
                                 headers={"content-type": good}).status_code == 200


@pytest.mark.parametrize("raw, code, param", [
    (b'{"prompt": "ab\\ud800c"}', "invalid_encoding", "prompt"),
    (b'{"prompt": "x", "user": "\\udfff"}', "invalid_encoding", "user"),
    (b'{"prompt": "\xff\xfe bad utf-8"}', "invalid_json", None),
    (b'{"prompt": "x", "max_tokens": 1000000000}', "context_length_exceeded", "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b'}', "invalid_json", None),
    (b'[' * 100000, "invalid_json", None),
])
def test_bad_bodies_are_400s_with_a_code(raw, code, param, quiet_log):
    with _server() as s:
        r = s.client.post(f"{s.base}/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param), r.text
        assert len(r.json()["error"]["message"]) < 400
        assert s.outcomes()["bad_request"] == 1


def test_a_malformed_traceparent_is_ignored_with_one_short_warning(capfd):
    with _server() as s:
        for _ in range(3):
            r = s.client.post(f"{s.base}/v1/completions", json={"prompt": "hi"}, headers={"traceparent": "z" * 10000})
            assert r.status_code == 200
        assert s.host  # the requests ran, each with a trace of its own
    err = capfd.readouterr().err
    lines = [x for x in err.splitlines() if "traceparent" in x]
    assert len(lines) == 1 and len(lines[0]) < 200, lines


# ---- disconnects, failures ---------------------------------------------------------------------------


def test_disconnects_at_every_stage_are_counted_and_quiet(quiet_log):
    with _server(sessions=1, max_queue=4, delay=0.02) as s:
        body = json.dumps({"prompt": "stay", "max_tokens": 5}).encode()
        _raw(s.port, b"POST /v1/compl").close()  # mid-head: never reaches the app
        _raw(s.port, _head(s.port, len(body))).close()  # head whole, no body
        _raw(s.port, _head(s.port, len(body)) + body[:5]).close()  # mid-body
        _until(lambda: s.outcomes()["aborted"] == 2, 10, "two uploads counted")
        with s.client.stream("POST", f"{s.base}/v1/completions",
                             json={"prompt": "hold", "max_tokens": 1000, "stream": True}) as held:
            lines = held.iter_lines()  # (kept: a dropped iterator closes the stream)
            next(lines)  # it holds the one session
            queued = _raw(s.port, _head(s.port, len(body)) + body)
            _until(lambda: s.health()[1]["queued"] == 1, 10, "queued")
            queued.close()  # gone while queued
            _until(lambda: s.health()[1]["queued"] == 0, 10, "left the queue")
        _until(lambda: s.health()[1]["in_flight"] == 0, 10, "mid-stream end freed")
        long = json.dumps({"prompt": "long", "max_tokens": 1000}).encode()
        waiting = _raw(s.port, _head(s.port, len(long)) + long)  # not streamed: gone while generating
        _until(lambda: s.health()[1]["in_flight"] == 1, 10, "generating")
        waiting.close()
        _until(lambda: s.health()[1]["in_flight"] == 0, 10, "freed")
        streamed = json.dumps({"prompt": "long", "max_tokens": 1000, "stream": True}).encode()
        unread = _raw(s.port, _head(s.port, len(streamed)) + streamed)  # streamed, gone before reading any
        _until(lambda: s.health()[1]["in_flight"] == 1, 10, "generating")
        unread.close()
        _until(lambda: s.health()[1]["in_flight"] == 0, 10, "freed")
        assert s.outcomes() == {"ok": 0, "bad_request": 0, "rejected": 0, "aborted": 6, "error": 0}
        assert s.host.engine.aborted == 3
        assert s.stream_text("after", 5)[1] == "length"


class FailingOpen(FakeOpen):
    """The fake engine, failing inside generate on a prompt that says 'boom' (after 2 tokens)."""

    @contextmanager
    def __call__(self, cfg, capacity=None, sessions=None):
        with FakeOpen.__call__(self, cfg, capacity, sessions) as e:
            real = e.generate

            def generate(ids, cfg, stream=None, **kw):
                if "boom" in FakeTok().decode(ids):
                    stream([5])
                    stream([6])
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")
                return real(ids, cfg, stream=stream, **kw)

            e.generate = generate
            yield e


def test_a_request_that_fails_in_the_engine_fails_alone(caplog):
    with _server(sessions=2, opener=FailingOpen(0.003)) as s:
        solo = s.stream_text("steady", 30)
        with ThreadPoolExecutor(1) as ex:
            steady = ex.submit(s.stream_text, "steady", 30)
            r = s.client.post(f"{s.base}/v1/completions", json={"prompt": "boom"})
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
            assert "illegal memory" not in r.text  # the client gets the kind, the log the details
            with s.client.stream("POST", f"{s.base}/v1/completions", json={"prompt": "boom", "stream": True}) as st:
                ev = _events(st)
            assert steady.result(30) == solo
        assert ev[-1] == "[DONE]" and ev[-2]["error"]["code"] == "engine_error" and _text(ev[:-2]) == "#$"
        assert s.outcomes()["error"] == 2 and s.outcomes()["ok"] == 2
        assert s.stream_text("after", 5)[1] == "length"
    assert sum("failed in the engine" in r.getMessage() for r in caplog.records) == 2


# ---- everything at once -----------------------------------------------------------------------------


def _hostile(port: int, kind: str) -> None:
    body = json.dumps({"prompt": "hostile", "max_tokens": 200, "stream": True}).encode()
    try:
        if kind == "huge":
            s = _raw(port, _head(port, 50_000_000) + b"x" * 65536)
            _response(s, 5)
        elif kind == "text":
            s = _raw(port, _head(port, len(body), ctype="text/plain") + body)
            _response(s, 5)
        elif kind == "surrogate":
            raw = b'{"prompt": "\\ud800"}'
            s = _raw(port, _head(port, len(raw)) + raw)
            _response(s, 5)
        elif kind == "mid-body":
            s = _raw(port, _head(port, len(body)) + body[:7])
        elif kind == "mid-stream":
            s = _raw(port, _head(port, len(body)) + body)
            s.recv(200)
        else:  # "slow-head"
            s = _raw(port, b"POST /v1/completions HTTP/1.1\r\n")
            time.sleep(0.2)
        s.close()
    except OSError:
        pass


@pytest.mark.slow
def test_hostile_clients_mixed_with_well_behaved_ones(quiet_log):
    kinds = ["huge", "text", "surrogate", "mid-body", "mid-stream", "slow-head"] * 5
    random.Random(7).shuffle(kinds)
    prompts = [f"polite {i}" for i in range(8)]
    with _server(sessions=3, max_queue=40, read_timeout_s=2, header_timeout_s=2) as s:
        solo = [s.stream_text(p, 30) for p in prompts]
        with ThreadPoolExecutor(8) as polite, ThreadPoolExecutor(6) as rude:
            bad = [rude.submit(_hostile, s.port, k) for k in kinds]
            got = list(polite.map(lambda p: s.stream_text(p, 30), prompts))
            for f in bad:
                f.result(30)
        assert got == solo
        assert s.health()[0] < 1.0
        _until(lambda: s.health()[1]["in_flight"] == 0, 10, "sessions freed")
        out = s.outcomes()
        assert out["ok"] >= 16 and out["bad_request"] == 15 and out["error"] == 0, out


# ---- stopping ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_to_serves_process_group_stops_it_in_bound(ckpt_factory, tmp_path):
    """A service manager's stop signals the whole process group, the local Ray it started
    included: serve does not wait 30 s for a controller that can no longer answer."""
    import os
    import signal
    import subprocess

    pytest.importorskip("ray.serve")
    from serve_proc import serve

    model = ckpt_factory("llama", seed=3, max_position_embeddings=4096, eos_token_id=None)[0]
    with serve(model, cwd=tmp_path, up_s=120) as srv:
        p = srv.p
        assert httpx.post(f"{srv.base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                          timeout=30).status_code == 200
        t = time.monotonic()
        os.killpg(p.pid, signal.SIGTERM)
        rc = p.wait(60)
        took = time.monotonic() - t
        _until(lambda: subprocess.run(["pgrep", "-s", str(p.pid)], capture_output=True).returncode != 0, 30,
               "every process of the session gone")
    err = srv.stderr
    print(f"\n[hostile] serve stopped by a process-group SIGTERM in {took:.1f} s")
    assert rc == 0 and "[serve] stopped" in err and took < 20, err[-3000:]
    assert "Controller failed to shut down" not in err
