"""Refusals a client can read: a request refused before its body is read (413, 415, 503 at the
open-request cap, and under plain uvicorn the 503 at the connection cap and the 431) is
answered with a lingering close (serve/limits.py, serve/uvicorn_guard.py), so a client still
sending its body reads the status and the JSON error instead of a connection reset.

Over loopback, under plain uvicorn with the guarded protocol and the fake engine (the server
of test_serve_hostile.py); each test takes a few seconds at most."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
requests = pytest.importorskip("requests")

from test_serve_api import _until  # noqa: E402
from test_serve_hostile import _error, _head, _raw, _response, _server, quiet_log  # noqa: E402, F401 (a fixture)

from memra_dist.serve.limits import LINGER_IDLE_S  # noqa: E402

BIG = 20 * 1024 * 1024  # over the default 4 MiB body limit


def _post(port: int, body, headers: dict, chunked: bool = False) -> tuple[int, bytes]:
    """(status, body) as Python's http.client reads them: the whole request is sent first."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("POST", "/v1/completions", body=body, headers=headers, encode_chunked=chunked)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _json_body(n: int) -> bytes:
    return b'{"prompt": "' + b"x" * n + b'"}'


def test_http_client_reads_the_413_of_a_20mb_json_body(quiet_log):
    big = _json_body(BIG)
    part = b"x" * (1024 * 1024)
    with _server() as s:
        t = time.monotonic()
        status, body = _post(s.port, big, {"Content-Type": "application/json"})
        dt = time.monotonic() - t
        assert status == 413 and _error(body)["code"] == "body_too_large", body
        # chunked (no Content-Length): refused once past the limit, the rest read and dropped
        status, body = _post(s.port, (part for _ in range(20)), {"Content-Type": "application/json"}, chunked=True)
        assert status == 413 and _error(body)["code"] == "body_too_large", body
        print(f"\n[linger] http.client, 20 MB JSON body: 413 read in {dt * 1000:.0f} ms")
        assert s.outcomes()["bad_request"] == 2
        assert s.stream_text("after", 5)[1] == "length"


def test_requests_and_curl_read_the_413(quiet_log, tmp_path):
    big = _json_body(BIG)
    with _server() as s:
        r = requests.post(f"{s.base}/v1/completions", data=big, headers={"Content-Type": "application/json"},
                          timeout=20)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
        if shutil.which("curl"):  # curl asks `Expect: 100-continue` first: it gets the 413 without sending
            path = tmp_path / "big.json"
            path.write_bytes(big)
            out = subprocess.run(["curl", "-sS", "--max-time", "20", "-H", "Content-Type: application/json",
                                  "--data-binary", f"@{path}", "-w", "\n%{http_code}", f"{s.base}/v1/completions"],
                                 capture_output=True, text=True, timeout=30)
            text, _, code = out.stdout.rpartition("\n")
            assert out.returncode == 0 and code == "413", (out.returncode, out.stdout[-500:], out.stderr[-500:])
            assert json.loads(text)["error"]["code"] == "body_too_large"


def test_http_client_reads_the_415_of_a_big_body(quiet_log):
    with _server() as s:
        status, body = _post(s.port, b"x" * BIG, {"Content-Type": "text/plain"})
        assert status == 415 and _error(body)["code"] == "unsupported_media_type", body
        assert s.outcomes()["bad_request"] == 1


def test_http_client_reads_the_503_at_the_open_request_cap(quiet_log):
    with _server(max_open=1, read_timeout_s=30) as s:
        stalled = _raw(s.port, _head(s.port, 100) + b"{")
        _until(lambda: s.health()[1]["open_requests"] == 1, 5, "the upload open")
        status, body = _post(s.port, _json_body(BIG), {"Content-Type": "application/json"})
        assert status == 503 and _error(body)["code"] == "overloaded", body
        stalled.close()


@pytest.mark.slow  # ~2-4 s on 2 cores: the quick tier keeps its margin under 5 minutes
def test_http_client_reads_the_503_at_the_connection_cap_and_the_431(quiet_log):
    with _server(max_connections=2) as s:
        held = [_raw(s.port) for _ in range(2)]
        time.sleep(0.3)  # (both accepted: each counts toward the cap)
        status, body = _post(s.port, _json_body(8 * 1024 * 1024), {"Content-Type": "application/json"})
        assert status == 503 and _error(body)["code"] == "too_many_connections", body
        for sock in held:
            sock.close()
        time.sleep(0.3)
        for junk in ("a" * 70_000, "a" * 400_000):  # a head over the cap read whole, and over several reads
            status, body = _post(s.port, _json_body(8 * 1024 * 1024), {"Content-Type": "application/json",
                                                                          "X-Junk": junk})
            assert status == 431 and _error(body)["code"] == "headers_too_large", (len(junk), body)
        # a small head whose blank line straddles two reads, then a big body: the body is no head
        body = _json_body(1024 * 1024)
        head = _head(s.port, len(body))
        sock = _raw(s.port, head[:-1])
        time.sleep(0.2)
        sock.sendall(head[-1:] + body)
        status, _, _, _ = _response(sock)
        sock.close()
        assert status != 431, status
        assert s.stream_text("after", 5)[1] == "length"


def test_the_lingering_read_is_bounded(quiet_log):
    """A client that declares 50 MB, sends 64 KB and waits gets its 413 at once; the server
    stops reading after its idle bound and closes the connection."""
    with _server() as s:
        t = time.monotonic()
        sock = _raw(s.port, _head(s.port, 50_000_000) + b"x" * 65536)
        sock.recv(1, socket.MSG_PEEK)
        first = time.monotonic() - t
        status, headers, body, closed = _response(sock, timeout=5)
        whole = time.monotonic() - t
        sock.close()
        assert status == 413 and _error(body)["code"] == "body_too_large" and headers["connection"] == "close"
        assert first < 1.0 and closed and whole < LINGER_IDLE_S + 2, (first, closed, whole)
