"""`memra-dist batch` with lines and prompts far over its limits: a line over --max-line-bytes
is an error record, read past in bounded pieces (never parsed nor held whole); a prompt far
over the context is refused after about the context's worth of tokenizing; the lines around
them run. A 24 MB line once cost the job 4.9 GB and 41 s (tokenized whole before it was
refused); now the job's peak RSS stays that of a job without it."""

from __future__ import annotations

import doctest
import io
import json
import subprocess
import sys
from contextlib import contextmanager

import pytest

from memra_dist.config import RunConfig
from memra_dist.serve import batch_input
from memra_dist.serve.batch import run_job
from memra_dist.serve.batch_input import Refused, Request, parse_input
from memra_dist.serve.prompt_pieces import PIECE_CHARS

PROMPT = "the drafter proposes"


def _records(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


# ---- the reader ---------------------------------------------------------------------------


def test_a_line_over_the_limit_is_refused_unread_and_its_neighbours_parse():
    lim = 1024
    ok = json.dumps({"id": "fits", "prompt": "x" * (lim - 30)})
    exact = json.dumps({"id": "exact", "prompt": ""})
    exact = exact[:-2] + "y" * (lim - len(exact)) + '"}'  # exactly `lim` bytes
    over = json.dumps({"id": "over", "prompt": "z" * (lim - 25)})  # a byte or two over
    assert len(exact) == lim and len(over) > lim
    lines = [json.dumps({"id": 1, "prompt": "a"}), ok, exact + "\r", over, " " * (3 * lim), "",
             json.dumps({"id": "big", "prompt": "w" * (10 * lim)}), json.dumps({"id": 2, "prompt": "b"}),
             json.dumps({"id": "last", "prompt": "q" * (5 * lim)})]  # the last, without its newline
    got = {e.line: e for e in parse_input("\n".join(lines).encode(), max_line_bytes=lim)}
    assert sorted(got) == [1, 2, 3, 4, 7, 8, 9]  # blank lines (one of them long) are no requests
    assert [got[n].id for n in (1, 2, 3, 8) if isinstance(got[n], Request)] == [1, "fits", "exact", 2]
    for n, size in ((4, len(over)), (7, len(lines[6])), (9, len(lines[8]))):
        e = got[n]
        assert isinstance(e, Refused) and not e.has_id, e
        assert e.record() == {"line": n, "error": f"the line is {size} bytes, over the limit of {lim} "
                                                  "(--max-line-bytes): refused unread"}


class _Tracked(io.BytesIO):
    """A file that keeps the size of every read it is asked for."""

    def __init__(self, data):
        super().__init__(data)
        self.asked: list[int] = []

    def readline(self, size=-1):
        self.asked.append(size)
        return super().readline(size)

    def read(self, size=-1):
        self.asked.append(size)
        return super().read(size)


def test_the_reader_never_asks_for_more_than_the_limit_at_once(monkeypatch):
    lim = 4096
    f = _Tracked(b'{"id": 1, "prompt": "a"}\n' + b"x" * (3 * batch_input.SKIP_BYTES + 17) + b'\n{"id": 2, "prompt": "b"}\n')
    got = batch_input._entries(f, lim)  # noqa: SLF001
    assert [type(e).__name__ for e in got] == ["Request", "Refused", "Request"]
    assert f.asked and all(0 < n <= max(lim + 2, batch_input.SKIP_BYTES) for n in f.asked), f.asked


# ---- the prompt's length, counted in pieces -------------------------------------------------


class _CountingTok:
    def __init__(self):
        self.encoded: list[int] = []  # the length of each text encoded

    def encode(self, text: str) -> list[int]:
        self.encoded.append(len(text))
        return [ord(c) % 90 + 1 for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(32 + i % 90) for i in ids)


class _Engine:
    sessions = 1

    def __init__(self):
        self.prompts: list[int] = []

    def generate(self, prompt, cfg=None, stream=None):
        from memra_dist.specdec.request import Result

        self.prompts.append(len(prompt))
        return Result([7] * cfg.max_new_tokens, {"tokens": cfg.max_new_tokens, "seconds": 0.01})


def test_a_prompt_far_over_the_context_is_refused_after_one_piece(tmp_path):
    """2M characters (a 2 MB line, under the 4 MiB line limit) for 512 positions: one piece of
    PIECE_CHARS is tokenized, never the whole prompt; the lines around it run."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "before", "prompt": PROMPT}, {"id": "huge", "prompt": "word " * 400_000},
        {"id": "after", "prompt": PROMPT}]))
    tok, engine = _CountingTok(), _Engine()

    @contextmanager
    def open_engine(cfg, capacity, sessions=None):
        yield engine

    cfg = RunConfig(model="unused", max_new_tokens=3, k=2)
    assert run_job(cfg, inp, out, tokenizer=tok, max_pos=512, open_engine=open_engine, err=io.StringIO()) == 0
    recs = {r["id"]: r for r in _records(out)}
    assert recs["before"]["token_ids"] == recs["after"]["token_ids"] == [7, 7, 7]
    assert set(recs["huge"]) == {"id", "error"}
    assert recs["huge"]["error"].startswith("the prompt (at least ") and "model's 512 positions" in recs["huge"]["error"]
    assert max(tok.encoded) <= PIECE_CHARS and sum(tok.encoded) <= PIECE_CHARS + 2 * len(PROMPT), tok.encoded
    assert engine.prompts == [len(PROMPT)] * 2


def test_the_piece_counter_has_working_examples():
    import memra_dist.serve.prompt_pieces as pp

    res = doctest.testmod(pp, report=True)
    assert res.attempted > 0 and res.failed == 0


# ---- the CLI --------------------------------------------------------------------------------


def _batch(*argv):
    from memra_dist.cli import _add_run_args, _Parser
    from memra_dist.serve import add_batch_parser, run_batch

    p = _Parser(prog="memra-dist")
    add_batch_parser(p.add_subparsers(dest="cmd", required=True, parser_class=_Parser), _add_run_args)
    return run_batch(p.parse_args(["batch", *map(str, argv), "--device", "cpu", "--dtype", "fp32"]))


@pytest.mark.parametrize("value, word", [("lots", "byte count"), ("100", "1KiB"), ("2GiB", "1GiB"), ("-5", "byte")])
def test_a_bad_max_line_bytes_is_one_line_and_exit_2(llama, tmp_path, capsys, value, word):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt": PROMPT}) + "\n")
    assert _batch("--model", llama, "--input", inp, "--output", tmp_path / "o.jsonl", "--max-line-bytes", value) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memra-dist: error: --max-line-bytes") and word in err[0], err


def test_max_line_bytes_takes_sizes(llama, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt": PROMPT}) + "\n" + json.dumps({"id": 2, "prompt": "x" * 2000}) + "\n")
    assert _batch("--model", llama, "--input", inp, "--output", out, "--max-line-bytes", "1k", "--max-new-tokens", 4) == 0
    recs = sorted(_records(out), key=lambda r: "line" in r)
    assert [set(r) for r in recs] == [{"id", "token_ids", "text", "stats", "prompt_sha256"}, {"line", "error"}]
    assert recs[1]["line"] == 2 and "over the limit of 1024" in recs[1]["error"]


# ---- a 24 MB line, in a job of its own --------------------------------------------------------

_MEASURE = """import resource, subprocess, sys
p = subprocess.run(sys.argv[1:], capture_output=True, text=True)
kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux, bytes on macOS
sys.stdout.write(str(kib * 1024 if sys.platform != "darwin" else kib) + "\\n" + str(p.returncode) + "\\n")
sys.stderr.write(p.stderr)
"""


@pytest.mark.slow  # ~2-4 s on 2 cores: the quick tier keeps its margin under 5 minutes
def test_a_24mb_line_is_an_error_record_and_the_job_stays_small(llama, tmp_path):
    """The job runs in a fresh process (its peak RSS measured by a parent of its own, so no
    other test's child counts): the lines before and after the 24 MB one run, it gets its
    record, and the job's peak RSS stays under 1.5 GB (it was 4.9 GB)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    big = json.dumps({"id": "big", "prompt": "word " * 4_800_000})
    assert len(big) > 24_000_000
    inp.write_text("\n".join([json.dumps({"id": "before", "prompt": PROMPT}), big,
                              json.dumps({"id": "after", "prompt": PROMPT})]) + "\n")
    cmd = [sys.executable, "-m", "memra_dist.cli", "batch", "--model", str(llama), "--input", str(inp),
           "--output", str(out), "--device", "cpu", "--dtype", "fp32", "--max-new-tokens", "4"]
    p = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True, timeout=300)
    peak, rc = map(int, p.stdout.split())
    assert rc == 0, p.stderr[-2000:]
    assert peak < 1.5e9, f"peak RSS {peak / 1e9:.2f} GB"
    recs = {r.get("id", r.get("line")): r for r in _records(out)}  # refusals are written before requests run
    assert sorted(recs, key=str) == [2, "after", "before"], recs
    assert recs["before"]["token_ids"] == recs["after"]["token_ids"] and len(recs["after"]["token_ids"]) == 4
    assert recs[2] == {"line": 2, "error": f"the line is {len(big)} bytes, over the limit of 4194304 "
                                           "(--max-line-bytes): refused unread"}
