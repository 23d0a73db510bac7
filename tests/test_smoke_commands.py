"""benchmarks/smoke_commands.py's pure parts (memra_dist/bench/smoke.py): the figures read from
the lines the commands really print (app._report's `[memra]` line, batch's summary), the last
JSON object of a stdout, an SSE stream timed by http.client against a local stub server, and
the table."""

from __future__ import annotations

import contextlib
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

from memra_dist.bench.smoke import last_json, markdown_table, parse_batch_summary, parse_summary, stream_completion


def test_summary_line_as_the_cli_prints_it():
    from memra_dist.app import _report

    st = {"tokens": 96, "seconds": 0.2, "ttft_ms": 12.5, "tok_per_s": 812.34, "rounds": 24, "drafted": 96,
          "accepted": 72, "acceptance": 0.75, "tokens_per_round": 4.0, "fast_path": None}
    args = SimpleNamespace(json=False)
    cfg = SimpleNamespace(drafter="model", k=4, pp=1, trace=SimpleNamespace(level=0))
    plan = SimpleNamespace(model=SimpleNamespace(eos_token_ids=(2,)), capped=False)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        _report(args, cfg, plan, SimpleNamespace(token_ids=[5] * 96, stats=st), "", None,
                SimpleNamespace(run_dir=None))
    d = parse_summary("the prompt and its text\n" + buf.getvalue())
    assert d is not None, buf.getvalue()
    assert (d["tokens"], d["tok_per_s"], d["ttft_ms"], d["acceptance"], d["drafter"], d["k"]) == \
        (96, 812.34, 12.5, 0.75, "model", 4)
    assert parse_summary("no summary here\n[memra] spans written to x") is None


def test_batch_summary_as_the_job_prints_it():
    from memra_dist.serve.batch_progress import Progress

    t = [0.0]
    p = Progress(total=3, done=1, errors=0, out=io.StringIO(), clock=lambda: t[0])
    p.start()
    p.add_tokens(48)
    t[0] = 1.2
    for _ in range(2):
        p.finished()
    line = p.summary("/x/results.jsonl")
    assert parse_batch_summary("[batch] 2/3 done | 3.0 tok/s | ETA 0:09\n" + line + "\n") == \
        {"done": 3, "total": 3, "tokens": 48, "seconds": 1.2, "tok_per_s": 40.0}
    assert parse_batch_summary("[batch] done: 3/3 -> out.jsonl") == {"done": 3, "total": 3}
    assert parse_batch_summary("nothing") is None


def test_last_json_skips_noise():
    assert last_json('warming up\n{"stats": {"tokens": 3}}\n[memra] note\n') == {"stats": {"tokens": 3}}
    assert last_json("{not json\n") is None


class _SSE(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] is True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunks = [{"choices": [{"text": w}]} for w in ("a", "", "b", "c")]
        chunks.append({"choices": [], "usage": {"completion_tokens": 4}})
        for c in chunks:
            self._chunk(f"data: {json.dumps(c)}\n\n")
        self._chunk("data: [DONE]\n\n")
        self._chunk("")

    def _chunk(self, s: str) -> None:
        b = s.encode()
        self.wfile.write(f"{len(b):x}\r\n".encode() + b + b"\r\n")
        self.wfile.flush()

    def log_message(self, *a):
        pass


def test_stream_completion_reads_an_sse_stream():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _SSE)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        s = stream_completion(srv.server_address[1], {"prompt": "x"}, 10)
    finally:
        srv.shutdown()
    assert s["error"] is None and s["text"] == "abc" and s["tokens"] == 4 and s["chunks"] == 3, s
    assert s["ttft_s"] is not None and s["tok_per_s"] is not None and s["tok_per_s"] > 0


def test_table_marks_skips():
    t = markdown_table([{"name": "generate llama --drafter none", "rc": 0, "ttft_s": 0.01234, "tok_per_s": 1234.5,
                         "note": "a|b"}, {"name": "--pp 2 rows", "rc": None, "note": "skipped: one GPU"}])
    assert "| `generate llama --drafter none` | 0 | 0.0123 | 1234 | a/b |" in t
    assert "| `--pp 2 rows` | skip | - | - | skipped: one GPU |" in t
