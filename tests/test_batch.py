"""`memra-dist batch`: every request's output is what it gives alone; a job stopped any way
(SIGKILL, Ctrl-C, SIGTERM, a crash mid-write) resumes to the file an uninterrupted run
writes, nothing lost and no id twice; bad lines become error records and the job goes on;
bad arguments are one line and exit 2.

The quick tests drive the job over a fake engine and tokenizer (the file handling, the
input checks, the capacity, the progress lines); the rest run the tiny llama on CPU."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from memra_dist.config import RunConfig
from memra_dist.errors import UserError
from memra_dist.serve.batch import choose_capacity, run_job
from memra_dist.serve.batch_input import Refused, Request, parse_input, prompt_hash
from memra_dist.serve.batch_progress import Progress
from memra_dist.serve.results_file import Output
from memra_dist.specdec.request import Result
from memra_dist.specdec.sampling import SamplingParams

# the stats that differ run to run: the times, and under --spec-k auto (the default, at every
# --max-batch) what each round drafted, which the engine chooses from the step times it measures
TIMING = ("seconds", "ttft_ms", "tok_per_s", "rounds", "drafted", "accepted", "acceptance", "tokens_per_round")


def _write(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _records(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), "a partial last line"
    return [json.loads(x) for x in data.decode().splitlines()]


def _canon(path: Path) -> list[str]:
    """The file's lines without the timing stats, sorted: the same job gives the same list."""
    out = []
    for r in _records(path):
        if "stats" in r:
            r = {**r, "stats": {k: v for k, v in r["stats"].items() if k not in TIMING}}
        out.append(json.dumps(r, sort_keys=True))
    return sorted(out)


def _assert_unique(path: Path) -> None:
    keys = [json.dumps(r["id"]) if "id" in r else f"line {r['line']}" for r in _records(path)]
    assert len(keys) == len(set(keys)), keys


# ---- a fake engine: the job's own logic, no model ---------------------------------------


class FakeTok:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 90 + 1 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(32 + i % 90) for i in ids)


class FakeEngine:
    def __init__(self, log: dict, stop_after: int | None, sessions: int = 1):
        self.log, self.stop_after, self.sessions = log, stop_after, sessions

    def generate(self, prompt, cfg=None, stream=None):
        if self.stop_after is not None and len(self.log["prompts"]) >= self.stop_after:
            raise KeyboardInterrupt  # Ctrl-C in the middle of a request
        self.log["prompts"].append(prompt)
        if prompt == FakeTok().encode("refuse me"):
            raise UserError("the engine refuses\nthis one")
        toks = [(sum(prompt) + i * 7 + cfg.seed) % 97 for i in range(cfg.max_new_tokens)]
        if stream is not None:
            stream(toks[:1])
            stream(toks[1:])
        return Result(toks, {"tokens": len(toks), "seconds": 0.01, "temperature": cfg.sampling.temperature})


def _fake_open(log: dict, stop_after: int | None = None):
    @contextmanager
    def open_engine(cfg, capacity, sessions=None):
        log["capacity"].append(capacity)
        yield FakeEngine(log, stop_after, sessions or 1)

    return open_engine


def _fake_job(inp, out, stop_after=None, ctx=None, max_pos=512, cfg=None, err=None, sessions=None):
    log = {"prompts": [], "capacity": []}
    cfg = cfg or RunConfig(model="unused", max_new_tokens=5, k=4)
    code = run_job(cfg, inp, out, tokenizer=FakeTok(), max_pos=max_pos, open_engine=_fake_open(log, stop_after),
                   ctx=ctx, err=err or io.StringIO(), sessions=sessions)
    return code, log


def test_parse_input_refuses_each_bad_line_with_its_id_or_line():
    lines = [
        '{"id": 1, "prompt": "fine", "temperature": null, "seed": 3}',
        "",
        '{"id": 2, "prompt": "x"',
        '[1, 2]',
        '{"prompt": "no id"}',
        '{"id": 1.5, "prompt": "float id"}',
        '{"id": true, "prompt": "bool id"}',
        '{"id": 1, "prompt": "again"}',
        '{"id": "1", "prompt": "a string id is another id"}',
        '{"id": 3}',
        '{"id": 4, "prompt": 7}',
        '{"id": 5, "prompt": ""}',
        '{"id": 6, "prompt": "p", "temperature": -0.5}',
        '{"id": 7, "prompt": "p", "top_p": 0}',
        '{"id": 8, "prompt": "p", "top_k": 1.5}',
        '{"id": 9, "prompt": "p", "max_new_tokens": 0}',
        '{"id": 10, "prompt": "p", "max_new_tokens": true}',
        '{"id": 11, "prompt": "p", "seed": "x"}',
        '{"id": 12, "prompt": "p", "max_tokens": 5}',
        '{"id": 13, "prompt": "p", "top_p": 0.9, "top_k": 5, "temperature": 0.7, "max_new_tokens": 3}',
    ]
    data = ("\n".join(lines) + "\n").encode() + b'\xff\xfe{"id": 14}\n'
    got = {e.line: e for e in parse_input(data)}
    assert 2 not in got  # a blank line is no request
    ok = [e for e in got.values() if isinstance(e, Request)]
    assert [(r.id, r.fields) for r in ok] == [
        (1, {"seed": 3}), ("1", {}),
        (13, {"top_p": 0.9, "top_k": 5, "temperature": 0.7, "max_new_tokens": 3})]
    by_line = {n: e.record() for n, e in got.items() if isinstance(e, Refused)}
    assert set(by_line[3]) == {"line", "error"} and "malformed JSON" in by_line[3]["error"]
    assert "JSON object" in by_line[4]["error"]
    assert by_line[5] == {"line": 5, "error": "missing 'id'"}
    assert "string or an integer" in by_line[6]["error"] and "string or an integer" in by_line[7]["error"]
    assert by_line[8] == {"line": 8, "error": "duplicate id 1 (first on line 1)"}  # the id stays its first line's
    assert by_line[10] == {"id": 3, "error": "missing 'prompt'"}
    for n, word in ((11, "prompt"), (12, "empty"), (13, "temperature"), (14, "top_p"), (15, "top_k"),
                    (16, "max_new_tokens"), (17, "max_new_tokens"), (18, "seed"), (19, "max_tokens")):
        rec = by_line[n]
        assert set(rec) == {"id", "error"} and word in rec["error"], rec
        assert "\n" not in rec["error"]
    assert "UTF-8" in by_line[21]["error"]


def test_output_cuts_a_partial_last_line_and_appends_whole_lines(tmp_path):
    f = tmp_path / "out.jsonl"
    whole = '{"id": 1, "token_ids": [1], "text": "a", "stats": {}}\n{"line": 4, "error": "bad"}\n'
    f.write_text(whole + '{"id": 2, "token_ids": [3, 4')
    out = Output(f)
    try:
        assert out.done == {'id 1': False, 'line 4': True} and out.cut > 0
        assert f.read_text() == whole
        out.append({"id": "é", "token_ids": [], "text": "ü\n", "stats": {}})
    finally:
        out.close()
    assert f.read_text().endswith('{"id": "é", "token_ids": [], "text": "ü\\n", "stats": {}}\n')


def test_ctrl_c_during_a_write_comes_after_the_whole_line(tmp_path, monkeypatch):
    f = tmp_path / "out.jsonl"
    out = Output(f)
    real = os.write
    calls = []

    def write(fd, data):  # Ctrl-C in the middle of a line written 5 bytes at a time
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)
        return real(fd, bytes(data[:5]))

    try:
        with pytest.raises(KeyboardInterrupt):
            with monkeypatch.context() as m:
                m.setattr(os, "write", write)
                out.append({"id": 1, "token_ids": [1, 2, 3], "text": "abc", "stats": {}})
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        out.close()
    assert len(calls) > 5 and f.read_text() == '{"id": 1, "token_ids": [1, 2, 3], "text": "abc", "stats": {}}\n'


def test_fake_job_interrupted_then_resumed_equals_one_run(tmp_path):
    rows = [{"id": i, "prompt": "p" * (i + 1)} for i in range(15)]
    rows[3]["max_new_tokens"] = 9
    rows[5]["prompt"] = "refuse me"  # the fake engine refuses it: an error record, the job goes on
    rows.insert(7, "{not json")
    rows.append({"id": 2, "prompt": "duplicate"})
    inp = _write(tmp_path / "in.jsonl", rows)
    ref = tmp_path / "ref.jsonl"
    assert _fake_job(inp, ref)[0] == 0
    recs = _records(ref)
    assert len(recs) == 17
    assert {"line": 8, "error": recs[0]["error"]} == recs[0] and recs[1]["line"] == 17  # refused first, at once
    assert {"id": 5, "error": "the engine refuses this one", "prompt_sha256": prompt_hash("refuse me")} in recs
    assert next(r for r in recs if r.get("id") == 3)["stats"]["tokens"] == 9

    out = tmp_path / "out.jsonl"
    code, log = _fake_job(inp, out, stop_after=4)  # Ctrl-C in the fifth request
    assert code == 130 and len(log["prompts"]) == 4
    assert len(_records(out)) == 2 + 4  # refused lines, then four finished: complete lines only
    code, log = _fake_job(inp, out)
    assert code == 0 and len(log["prompts"]) == 15 - 4  # the finished ones never run again
    assert _canon(out) == _canon(ref)
    _assert_unique(out)
    code, log = _fake_job(inp, out)  # all done: no engine opened
    assert code == 0 and log["capacity"] == [] and _canon(out) == _canon(ref)


def test_fake_job_with_sessions_writes_each_request_once(tmp_path):
    """Requests run from one thread per session; every one is written once, interrupted or not."""
    rows = [{"id": i, "prompt": "q" * (i + 2)} for i in range(20)]
    inp = _write(tmp_path / "in.jsonl", rows)
    ref = tmp_path / "ref.jsonl"
    assert _fake_job(inp, ref)[0] == 0
    out = tmp_path / "out.jsonl"
    code, log = _fake_job(inp, out, sessions=4)
    assert code == 0 and len(log["prompts"]) == 20
    assert _canon(out) == _canon(ref)
    _assert_unique(out)
    out2 = tmp_path / "out2.jsonl"
    code, log = _fake_job(inp, out2, sessions=3, stop_after=7)  # Ctrl-C in a worker's request
    assert code == 130
    assert 1 <= len(_records(out2)) <= 7
    assert _fake_job(inp, out2, sessions=3)[0] == 0
    assert _canon(out2) == _canon(ref)
    _assert_unique(out2)


def test_capacity_fits_the_remaining_requests(tmp_path):
    inp = _write(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "x" * 30}, {"id": "b", "prompt": "y" * 5, "max_new_tokens": 40},
        {"id": "c", "prompt": "z" * 600}])
    code, log = _fake_job(inp, tmp_path / "o1.jsonl")
    assert code == 0 and log["capacity"] == [30 + 40 + 4 + 1]
    rec = _records(tmp_path / "o1.jsonl")[0]
    assert rec == {"id": "c", "error": "the prompt (600 tokens) is too long for the model's 512 positions"}
    code, log = _fake_job(inp, tmp_path / "o2.jsonl", max_pos=60)  # cut to the model's positions
    assert log["capacity"] == [60]
    code, log = _fake_job(inp, tmp_path / "o3.jsonl", ctx=20)  # --ctx wins; "a" no longer fits
    assert log["capacity"] == [20] and log["prompts"] == [FakeTok().encode("y" * 5)]
    assert {"id": "a", "error": "the prompt (30 tokens) is too long for the context (--ctx 20 rows)"} in \
        _records(tmp_path / "o3.jsonl")
    with pytest.raises(UserError, match="exceeds"):
        _fake_job(inp, tmp_path / "o4.jsonl", ctx=600)
    out = tmp_path / "o5.jsonl"  # a resumed job sizes the context for what is left
    _write(out, [{"id": "a", "token_ids": [], "text": "", "stats": {}}])
    assert _fake_job(inp, out)[1]["capacity"] == [5 + 40 + 4 + 1]
    assert choose_capacity(None, 512, [3, 9], [4, 2], 4) == 9 + 4 + 4 + 1


def test_bad_paths_are_user_errors(tmp_path):
    inp = _write(tmp_path / "in.jsonl", [{"id": 1, "prompt": "p"}])
    with pytest.raises(UserError, match="no such file"):
        _fake_job(tmp_path / "missing.jsonl", tmp_path / "o.jsonl")
    with pytest.raises(UserError, match="cannot write"):
        _fake_job(inp, tmp_path / "no-dir" / "o.jsonl")
    with pytest.raises(UserError, match="is a directory"):
        _fake_job(inp, tmp_path)
    with pytest.raises(UserError, match="is the input file"):
        _fake_job(inp, inp)
    held = Output(tmp_path / "held.jsonl")  # another job writing it
    try:
        with pytest.raises(UserError, match="another batch job"):
            _fake_job(inp, tmp_path / "held.jsonl")
    finally:
        held.close()
    assert _fake_job(inp, tmp_path / "held.jsonl")[0] == 0


def test_progress_prints_at_most_a_line_a_second():
    now = [0.0]
    buf = io.StringIO()
    p = Progress(10, 2, 1, out=buf, clock=lambda: now[0])
    p.start()
    for _ in range(5):
        now[0] += 0.3
        p.add_tokens(30)
        p.finished()
    lines = buf.getvalue().splitlines()
    assert lines == ["[batch] 5/10 done, 1 error | 100.0 tok/s | ETA 0:02"]  # at t = 1.2 s only
    assert p.summary("o.jsonl") == "[batch] done: 7/10 (2 before this run), 1 error, 150 tokens in 1.5 s " \
                                   "(100.0 tok/s) -> o.jsonl"
    assert "interrupted at 7/10" in p.summary("o.jsonl", interrupted=True)


# ---- the tiny llama ---------------------------------------------------------------------


PROMPTS = ["The phase clock drains the streams", "A speculative round has five phases.", "Hello",
           "Drafts are verified in one forward pass of the target", "tokens"]


def _parser():
    """memra-dist's parser with `batch` registered as cli.py registers it."""
    from memra_dist.cli import _add_run_args, _Parser
    from memra_dist.serve import add_batch_parser

    p = _Parser(prog="memra-dist")
    add_batch_parser(p.add_subparsers(dest="cmd", required=True, parser_class=_Parser), _add_run_args)
    return p


def _batch(*argv) -> int:
    from memra_dist.serve import run_batch

    return run_batch(_parser().parse_args(["batch", *map(str, argv), "--device", "cpu", "--dtype", "fp32"]))


def test_each_request_equals_the_same_prompt_run_alone(llama, tmp_path, capsys):
    _each_alone(llama, tmp_path, capsys)


def test_pp2_sessions_in_flight_each_request_equals_it_alone(ray_local, llama, tmp_path, capsys):
    _each_alone(llama, tmp_path, capsys, "--pp", 2, "--sessions", 3)


def _each_alone(llama, tmp_path, capsys, *extra):
    from memra_dist.app import generate
    from memra_dist.model.tokenizer import load_tokenizer

    rows = [{"id": i, "prompt": p} for i, p in enumerate(PROMPTS)]
    rows[1]["max_new_tokens"] = 7
    rows[3]["max_new_tokens"] = 33
    rows.append({"id": "sampled", "prompt": PROMPTS[0], "temperature": 0.8, "top_k": 20, "seed": 11})
    inp = _write(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert _batch("--model", llama, "--input", inp, "--output", out, "--max-new-tokens", 20, *extra) == 0
    err = capsys.readouterr().err
    assert "[batch] done: 6/6" in err
    recs = {r["id"]: r for r in _records(out)}
    assert len(recs) == 6
    tok = load_tokenizer(llama)
    base = RunConfig(model=str(llama), device="cpu", dtype="fp32", max_new_tokens=20)
    for row in rows:
        cfg = base.with_(max_new_tokens=row.get("max_new_tokens", 20))
        if "temperature" in row:
            cfg = cfg.with_(sampling=SamplingParams(row["temperature"], row["top_k"], 1.0), seed=row["seed"])
        alone = generate(cfg, tok.encode(row["prompt"]))
        rec = recs[row["id"]]
        assert rec["token_ids"] == alone.token_ids, row
        assert rec["text"] == tok.decode(alone.token_ids)
        assert rec["stats"]["tokens"] == len(alone.token_ids)
    assert len(recs[1]["token_ids"]) <= 7 and len(recs[3]["token_ids"]) > 20  # the per-request lengths
    assert recs["sampled"]["token_ids"] != recs[0]["token_ids"]  # the per-request sampling (same prompt)


def test_bad_lines_get_error_records_and_the_rest_run(llama, tmp_path, capsys):
    inp = _write(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": PROMPTS[0]}, '{"id": "b", "prompt": ', {"id": "c", "prompt": "word " * 40},
        {"id": "d", "prompt": PROMPTS[1], "top_p": 2}, {"id": "a", "prompt": "dup"}, {"id": "e", "prompt": PROMPTS[2]}])
    out = tmp_path / "out.jsonl"
    assert _batch("--model", llama, "--input", inp, "--output", out, "--max-new-tokens", 5, "--ctx", 32) == 0
    recs = _records(out)
    errs = {r.get("id", r.get("line")): r["error"] for r in recs if "error" in r}
    assert set(errs) == {2, "c", "d", 5}, errs
    assert "too long for the context" in errs["c"] and "top_p" in errs["d"] and "duplicate" in errs[5]
    assert sorted(r["id"] for r in recs if "token_ids" in r) == ["a", "e"]
    assert "[batch] done: 6/6, 4 errors" in capsys.readouterr().err


def test_a_truncated_last_line_is_rewritten_on_resume(llama, tmp_path, capsys):
    inp = _write(tmp_path / "in.jsonl", [{"id": i, "prompt": p} for i, p in enumerate(PROMPTS[:3])])
    ref = tmp_path / "ref.jsonl"
    assert _batch("--model", llama, "--input", inp, "--output", ref, "--max-new-tokens", 12) == 0
    data = ref.read_bytes()
    out = tmp_path / "out.jsonl"
    cut = len(data.splitlines()[-1]) // 2 + 1
    out.write_bytes(data[:-cut])  # a crash in the middle of the last line
    capsys.readouterr()
    assert _batch("--model", llama, "--input", inp, "--output", out, "--max-new-tokens", 12) == 0
    err = capsys.readouterr().err
    assert "cut off an unfinished last line" in err and "2 done before, 1 to run" in err
    assert _canon(out) == _canon(ref)
    _assert_unique(out)


def test_bad_arguments_exit_2_with_one_line(llama, tmp_path, capsys):
    inp = _write(tmp_path / "in.jsonl", [{"id": 1, "prompt": "p"}])
    for argv, word in (
            (("--model", llama, "--input", tmp_path / "nope.jsonl", "--output", tmp_path / "o.jsonl"), "no such file"),
            (("--model", llama, "--input", inp, "--output", tmp_path / "no" / "o.jsonl"), "cannot write"),
            (("--model", tmp_path / "no-model", "--input", inp, "--output", tmp_path / "o.jsonl"), "not found"),
            (("--model", llama, "--input", inp, "--output", tmp_path / "o.jsonl", "--ctx", 100000), "exceeds")):
        assert _batch(*argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("memra-dist: error:") and word in err[0], err
    with pytest.raises(SystemExit) as e:
        _batch("--model", llama, "--output", tmp_path / "o.jsonl")  # --input missing
    assert e.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def _registered() -> bool:
    from memra_dist.cli import build_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return build_parser().parse_args(["batch", "--model", "m", "--input", "i", "--output", "o"]).cmd == "batch"
    except SystemExit:
        return False


def test_the_cli_registers_batch():
    if not _registered():
        pytest.skip("memra_dist/cli.py does not register `batch` yet")
    from memra_dist.cli import build_parser

    args = build_parser().parse_args(["batch", "--model", "m", "--input", "i", "--output", "o"])
    assert args.max_new_tokens == 64 and args.burst_rounds == 8 and not hasattr(args, "prompt")


def test_the_batch_flags_are_generates():
    args = _parser().parse_args(["batch", "--model", "m", "--input", "i", "--output", "o"])
    assert (args.max_new_tokens, args.burst_rounds, args.k, args.temperature, args.ctx) == (64, 8, 4, 0.0, None)
    assert not hasattr(args, "prompt")


# ---- stopped jobs (subprocesses) --------------------------------------------------------


N_LONG = 12


@pytest.fixture(scope="module")
def long_llama(ckpt_factory):
    """The tiny llama with room for long requests and no end-of-text id to stop them early."""
    return ckpt_factory("llama", seed=3, max_position_embeddings=4096, eos_token_id=None)[0]


@pytest.fixture(scope="module")
def long_job(long_llama, tmp_path_factory):
    """(model, input, the output of one uninterrupted run)."""
    d = tmp_path_factory.mktemp("batch-long")
    inp = _write(d / "in.jsonl", [{"id": f"r{i}", "prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}"}
                                  for i in range(N_LONG)])
    ref = d / "ref.jsonl"
    p = subprocess.run(_cmd(long_llama, inp, ref), capture_output=True, text=True, env=_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert len(_records(ref)) == N_LONG
    return long_llama, inp, ref


def _env():
    return {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "RAY_ADDRESS", "MEMRA_", "TRACEPARENT"))}


# Until memra_dist/cli.py registers `batch`: the same registration and the same SIGTERM
# handling as `memra-dist` (cli.run), in a few lines.
_MAIN = """import signal, sys
from memra_dist.cli import _Parser, _add_run_args, _on_sigterm
from memra_dist.serve import add_batch_parser, run_batch
p = _Parser(prog="memra-dist")
add_batch_parser(p.add_subparsers(dest="cmd", required=True, parser_class=_Parser), _add_run_args)
signal.signal(signal.SIGTERM, _on_sigterm)
sys.exit(run_batch(p.parse_args()))
"""


def _cmd(model, inp, out, *extra):
    prog = ["-m", "memra_dist.cli"] if _registered() else ["-c", _MAIN]
    return [sys.executable, *prog, "batch", "--model", str(model), "--input", str(inp), "--output", str(out),
            "--device", "cpu", "--max-new-tokens", "300", *extra]


def _start_and_wait_lines(cmd, out: Path, n: int) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= n:
            return proc
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"the job ended (or stalled) before {n} lines: {proc.communicate()[1][-2000:]}")


@pytest.mark.slow
def test_a_killed_job_resumes_to_the_uninterrupted_output(long_job, tmp_path):
    model, inp, ref = long_job
    out = tmp_path / "out.jsonl"
    proc = _start_and_wait_lines(_cmd(model, inp, out), out, 3)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    left = out.read_bytes().count(b"\n")
    assert 3 <= left < N_LONG
    p = subprocess.run(_cmd(model, inp, out), capture_output=True, text=True, env=_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"{left} done before" in p.stderr
    assert _canon(out) == _canon(ref)
    _assert_unique(out)


@pytest.mark.slow
@pytest.mark.parametrize("sig,extra", [(signal.SIGINT, ()), (signal.SIGTERM, ()),
                                       (signal.SIGTERM, ("--pp", "2", "--sessions", "2"))],
                         ids=["ctrl-c", "sigterm", "sigterm-pp2-sessions2"])
def test_an_interrupted_job_exits_130_with_complete_lines(long_job, tmp_path, sig, extra):
    model, inp, ref = long_job
    out = tmp_path / "out.jsonl"
    proc = _start_and_wait_lines(_cmd(model, inp, out, *extra), out, 1)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted at" in err and "Traceback" not in err
    recs = _records(out)  # every line complete
    assert 1 <= len(recs) < N_LONG
    assert _canon(out) == sorted(set(_canon(ref)) & set(_canon(out)))  # each line as the full run writes it
    p = subprocess.run(_cmd(model, inp, out), capture_output=True, text=True, env=_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert _canon(out) == _canon(ref)
    _assert_unique(out)


@pytest.mark.slow
def test_a_batched_job_stopped_at_any_moment_exits_130_never_by_an_abort(long_job, tmp_path):
    """`batch --max-batch 4` stopped by SIGTERM or SIGINT at many points of the job (while the
    model loads, between lines, mid-steps): always exit 130 with complete lines, never an abort
    of the interpreter while the step leader still runs torch code (it is joined at close)."""
    model, inp, ref = long_job
    points = [(signal.SIGTERM, 0, 0.0), (signal.SIGINT, 0, 0.3), (signal.SIGTERM, 1, 0.0), (signal.SIGTERM, 1, 0.05),
              (signal.SIGINT, 2, 0.01), (signal.SIGTERM, 3, 0.2)]
    for i, (sig, lines, after_s) in enumerate(points):
        out = tmp_path / f"out{i}.jsonl"
        # (each record as the one-at-a-time ref's: fixed K, and no prompt shared from the prefix cache,
        # whose hits depend on which line finished first)
        cmd = _cmd(model, inp, out, "--max-batch", "4", "--spec-k", "fixed", "--no-prefix-cache")
        if lines:
            proc = _start_and_wait_lines(cmd, out, lines)
        else:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), text=True)
            time.sleep(3.0)  # while it loads (the handlers are set before the heavy imports)
        time.sleep(after_s)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode in (130, 0), (i, proc.returncode, err[-2000:])  # 0: it finished before the signal
        assert "terminate called" not in err and "Traceback" not in err, (i, err[-2000:])
        if out.exists():
            assert _canon(out) == sorted(set(_canon(ref)) & set(_canon(out))), i  # each line whole, as the full run's
