"""`memra-dist serve`'s pure parts, no Ray, no model, no server: OpenAI body validation (a 400
naming the field), the error / chunk / completion shapes, SSE framing, the session queue
(admission order, 429 when full, a waiter that gives up), the metrics text, the flags a
RayService's `args` become, and the CLI's one-line errors (missing Ray Serve, bad flags)."""

from __future__ import annotations

import asyncio
import json

import pytest

from memra_dist.serve.protocol import (SSE_DONE, ApiError, chunk, completion, error_body, finish_reason,
                                       models_list, parse_completion, sse)


def _err(body, served="llama") -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_completion(body if isinstance(body, (bytes, str)) else json.dumps(body), served)
    return e.value


def test_a_good_body_maps_openai_fields_to_the_engines():
    r = parse_completion(json.dumps({"model": "llama", "prompt": "Hi", "max_tokens": 5, "temperature": 0.5,
                                     "top_p": 0.9, "seed": 7, "top_k": 3, "stream": True, "n": 1, "echo": False,
                                     "stop": None, "user": "u", "stream_options": {"include_usage": True}}), "llama")
    assert (r.prompt, r.stream, r.include_usage, r.model) == ("Hi", True, True, "llama")
    assert r.fields == {"max_new_tokens": 5, "temperature": 0.5, "top_p": 0.9, "seed": 7, "top_k": 3}
    r = parse_completion(b'{"prompt": "x", "max_tokens": null, "temperature": null}', "llama")
    assert (r.fields, r.stream, r.model) == ({}, False, "llama")  # null = the server's flag


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 8}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "seed": 2 ** 64}, "seed"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": {"other": 1}}, "stream_options"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "stop": ["\n"]}, "stop"),
    ({"prompt": "x", "logprobs": 2}, "logprobs"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "max_new_tokens": 5}, "max_new_tokens"),  # the batch job's name is not OpenAI's
    ({"prompt": "x", "model": 5}, "model"),
])
def test_a_bad_field_is_a_400_naming_it(body, param):
    e = _err(body)
    assert e.status == 400 and e.param == param and e.outcome == "bad_request", e.message
    assert param in e.message and "\n" not in e.message
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}
    assert e.body()["error"]["type"] == "invalid_request_error"


def test_malformed_json_and_an_unknown_model():
    for raw in (b'{"prompt": ', b"[1, 2]", b"\xff\xfe", b"null"):
        e = _err(raw)
        assert e.status == 400 and e.param is None and e.code == "invalid_json", raw
    e = _err({"prompt": "x", "model": "gpt-4"})
    assert (e.status, e.param, e.code) == (404, "model", "model_not_found")
    assert "llama" in e.message


def test_shapes_and_sse_framing():
    c = chunk("cmpl-1", 5, "llama", " wor\nld")
    assert c == {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "llama",
                 "choices": [{"text": " wor\nld", "index": 0, "logprobs": None, "finish_reason": None}]}
    framed = sse(c)
    assert framed.startswith(b"data: ") and framed.endswith(b"\n\n") and framed.count(b"\n") == 2
    assert json.loads(framed[6:]) == c
    assert SSE_DONE == b"data: [DONE]\n\n"
    last = chunk("cmpl-1", 5, "llama", "", "length")
    assert last["choices"][0]["finish_reason"] == "length"
    u = chunk("cmpl-1", 5, "llama", "", use={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3})
    assert u["choices"] == [] and u["usage"]["total_tokens"] == 3
    full = completion("cmpl-2", 6, "llama", "abc", "stop", 4, 3)
    assert full["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert full["choices"][0] == {"text": "abc", "index": 0, "logprobs": None, "finish_reason": "stop"}
    assert models_list("llama", 9)["data"] == [{"id": "llama", "object": "model", "created": 9, "owned_by": "memra-dist"}]
    assert error_body("m", "t") == {"error": {"message": "m", "type": "t", "param": None, "code": None}}
    assert finish_reason([3, 2], (2,)) == "stop" and finish_reason([2, 3], (2,)) == "length"
    assert finish_reason([], (2,)) == "length"
    assert ApiError(429, "full").outcome == "rejected" and ApiError(429, "full").type == "rate_limit_error"


# ---- the session queue -------------------------------------------------------------------


def test_admission_hands_sessions_out_in_order_and_refuses_when_full():
    from memra_dist.serve.admission import Admission, QueueFull

    async def main():
        adm = Admission(sessions=2, max_queue=2)
        a, b = adm.enter(), adm.enter()
        await a.wait()
        await b.wait()
        assert (adm.active, adm.waiting) == (2, 0)
        c, d = adm.enter(), adm.enter()
        assert adm.waiting == 2
        with pytest.raises(QueueFull, match="--max-queue 2"):
            adm.enter()
        tc = asyncio.create_task(c.wait())
        td = asyncio.create_task(d.wait())
        await asyncio.sleep(0)
        adm.release()
        await asyncio.wait_for(tc, 1)  # the oldest waiter first
        assert not td.done() and (adm.active, adm.waiting) == (2, 1)  # handed over, not put back
        td.cancel()  # d's client went away while queued: it leaves the queue
        with pytest.raises(asyncio.CancelledError):
            await td
        assert adm.waiting == 0
        adm.release()
        adm.release()
        assert (adm.active, adm.waiting) == (0, 0)
        e = adm.enter()  # free at once again
        await e.wait()
        assert adm.active == 1

    asyncio.run(main())


def test_a_waiter_cancelled_as_it_is_handed_a_session_passes_it_on():
    from memra_dist.serve.admission import Admission

    async def main():
        adm = Admission(sessions=1, max_queue=3)
        await adm.enter().wait()
        b, c = adm.enter(), adm.enter()
        tb, tc = asyncio.create_task(b.wait()), asyncio.create_task(c.wait())
        await asyncio.sleep(0)
        adm.release()  # b's future gets its result ...
        tb.cancel()  # ... and b's task is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await tb
        await asyncio.wait_for(tc, 1)  # b passed its session on to c
        assert adm.active == 1 and adm.waiting == 0

    asyncio.run(main())


def test_metrics_text_names_the_registry_series():
    from memra_dist.serve.api_metrics import OUTCOMES, ApiMetrics, api_prometheus_name

    m = ApiMetrics(lambda: 2, lambda: 3)
    m.outcome("ok")
    m.outcome("rejected")
    m.tokens(5)
    text = m.render().decode()
    assert f"{api_prometheus_name('in_flight')} 2.0" in text
    assert f"{api_prometheus_name('queue_depth')} 3.0" in text
    assert f'{api_prometheus_name("requests")}{{outcome="rejected"}} 1.0' in text
    assert f"{api_prometheus_name('tokens')} 5.0" in text
    for o in OUTCOMES:
        assert f'outcome="{o}"' in text


# ---- flags ---------------------------------------------------------------------------------


def test_rayservice_args_are_the_cli_flags():
    from memra_dist.errors import UserError
    from memra_dist.cli import _add_run_args
    from memra_dist.serve.serve_cli import parse_serve_argv, spec_argv

    argv = spec_argv({"model": "/m", "pp": 2, "max-queue": 8, "max_new_tokens": 9, "k": 3, "trace_content": True,
                      "prof": False, "ctx": None})
    assert argv == ["--model", "/m", "--pp", "2", "--max-queue", "8", "--max-new-tokens", "9", "-k", "3",
                    "--trace-content"]
    args = parse_serve_argv(argv, _add_run_args)
    assert (args.pp, args.max_queue, args.max_new_tokens, args.k, args.trace_content) == (2, 8, 9, 3, True)
    assert (args.host, args.port, args.sessions, args.burst_rounds) == ("127.0.0.1", 8000, None, 8)
    for bad in (["--model", "/m", "--sessions", "0"], ["--model", "/m", "--max-queue", "-1"],
                ["--model", "/m", "--port", "70000"], ["--pp", "2"], ["--model", "/m", "--bogus"]):
        with pytest.raises(UserError):
            parse_serve_argv(bad, _add_run_args)
    with pytest.raises(UserError, match="'model'"):
        spec_argv({"model": ["/a"]})


def test_body_limit_and_request_defaults_are_checked_as_requests_are():
    from memra_dist.cli import _add_run_args
    from memra_dist.errors import UserError
    from memra_dist.serve.limits import DEFAULT_MAX_BODY_BYTES, parse_size
    from memra_dist.serve.serve_cli import parse_serve_argv

    assert parse_serve_argv(["--model", "/m"], _add_run_args).max_body_bytes == DEFAULT_MAX_BODY_BYTES == 4 << 20
    for text, n in (("4194304", 4 << 20), ("4MiB", 4 << 20), ("4mb", 4 << 20), ("512k", 512 << 10), ("1 GiB", 1 << 30)):
        assert parse_size(text) == n
        assert parse_serve_argv(["--model", "/m", "--max-body-bytes", text], _add_run_args).max_body_bytes == n
    for bad, word in ((["--max-body-bytes", "lots"], "byte count"), (["--max-body-bytes", "-5"], "byte count"),
                      (["--max-body-bytes", "100"], "1KiB"), (["--max-body-bytes", "2GiB"], "1GiB"),
                      (["--temperature", "5"], "--temperature 5.0: expected 0..2"),
                      (["--temperature", "nan"], "--temperature"), (["--top-p", "0"], "--top-p"),
                      (["--top-p", "1.5"], "--top-p"), (["--top-k", "-1"], "--top-k"), (["--seed", "-1"], "--seed")):
        with pytest.raises(UserError, match=word) as e:
            parse_serve_argv(["--model", "/m", *bad], _add_run_args)
        assert "\n" not in str(e.value)


def test_error_outcomes_and_lone_surrogates():
    assert [ApiError(s, "m").outcome for s in (400, 404, 408, 413, 415, 429, 499, 500, 503)] == \
        ["bad_request", "bad_request", "aborted", "bad_request", "bad_request", "rejected", "aborted", "error",
         "rejected"]
    e = _err(b'{"prompt": "ok \\ud83d then"}')  # half of a surrogate pair: no character
    assert (e.status, e.param, e.code) == (400, "prompt", "invalid_encoding") and "\\ud83d" in e.message
    e = _err({"prompt": "x", "bogus" * 100: 1})
    assert e.code == "unknown_parameter" and len(e.message) < 300
    assert parse_completion(b'{"prompt": "\\ud83d\\ude00"}', "llama").prompt == "\U0001f600"  # a pair is fine


def test_serve_deployment_never_keeps_health_behind_open_requests():
    pytest.importorskip("ray.serve")
    import argparse

    from memra_dist.serve.deployment import HEADROOM, deployment_options, http_options
    from memra_dist.serve.limits import OPEN_HEADROOM

    args = argparse.Namespace(pp=1, sessions=None, max_queue=4, device="cpu", host="127.0.0.1", port=8000)
    opts = deployment_options(args)
    # the app answers 503 past sessions + queue + OPEN_HEADROOM open requests; Serve hands it that many
    # and HEADROOM more, so stalled uploads never leave GET /health waiting at Serve's router
    assert opts["max_ongoing_requests"] == 1 + 4 + OPEN_HEADROOM + HEADROOM
    assert opts["graceful_shutdown_timeout_s"] < 30  # within the 30 s serve.shutdown gives the controller
    assert http_options(args) == {"host": "127.0.0.1", "port": 8000, "keep_alive_timeout_s": 5}


def _main(argv, capsys):
    from memra_dist.cli import main

    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def test_missing_ray_serve_is_one_line_naming_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "fastapi", None)  # as if ray[serve]'s web stack were absent
    code, err = _main(["serve", "--model", str(tmp_path)], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("memra-dist: error:") and "pip install 'memra_dist[serve]'" in err[0]


def test_bad_serve_input_is_one_line_and_exit_2(llama, tmp_path, capsys, monkeypatch):
    pytest.importorskip("ray.serve")
    from memra_dist.serve import deployment

    def slipped(args):  # a case past validation must fail here, not start a real server and hang
        raise AssertionError("serve started: validation let the input through")

    monkeypatch.setattr(deployment, "deploy", slipped)
    for argv, word in ((["--model", str(tmp_path / "nope")], "not found"),
                       (["--model", str(llama), "--sessions", "0"], "--sessions"),
                       (["--model", str(llama), "--port", "99999"], "--port"),
                       (["--model", str(llama), "--ctx", "100000"], "--ctx"),
                       (["--model", str(llama), "--temperature", "5"], "--temperature"),
                       (["--model", str(llama), "--max-body-bytes", "huge"], "--max-body-bytes"),
                       (["--model", str(llama), "--trace-level", "1"], "OTEL_EXPORTER_OTLP_ENDPOINT")):
        code, err = _main(["serve", *argv], capsys)
        assert code == 2 and len(err) == 1, (argv, err)
        assert err[0].startswith("memra-dist: error:") and word in err[0], err


def test_serve_help_explains(capsys):
    from memra_dist.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in ("/v1/completions", "--max-queue", "429", "--sessions", "traceparent", "127.0.0.1", "[DONE]"):
        assert word in out, word
