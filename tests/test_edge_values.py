"""Edge values and failures that must not take a whole job down.

Sampling values: every value the validation accepts runs in every front end (a temperature
below GREEDY_BELOW = 1e-5 is greedy: 1e-38 and 1e-45 overflowed fp32 logits into NaN before),
non-finite and out-of-range values are refused in one line (CLI: exit 2) / a 400 (the
server's parsing) / an error record (batch). Logits holding NaN / inf (a checkpoint with a NaN
weight) are one line naming the layer, never a token. In a batch job a request that fails
inside the engine gets an error record and the job goes on; a resume does not run it again.
And batch's smaller items: no metrics flags, --trace-level 1 at pp = 1 writes spans, an
output holding other prompts' results is refused, the OTLP warning says what the flush cost."""

from __future__ import annotations

import io
import json
import math
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from memra_dist.cli import main
from memra_dist.config import RunConfig
from memra_dist.errors import UserError
from memra_dist.serve.batch import ENGINE_FAILURES_TO_STOP, EngineFailing, run_job
from memra_dist.serve.batch_input import Request, prompt_hash, request_cfg
from memra_dist.serve.protocol import ApiError, parse_completion
from memra_dist.specdec.accept import NonFiniteRow, accept_sampled, greedy_commit
from memra_dist.specdec.request import Result
from memra_dist.specdec.sampling import GREEDY_BELOW, SamplingParams, probs

PROMPT = "the drafter proposes"


def run_main(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _gen(model, *extra, n=6):
    return ["generate", "--model", str(model), "--prompt", PROMPT, "--max-new-tokens", str(n), "--device", "cpu",
            "--json", *extra]


def _one_line_error(rc, out, err, *needles, code=2):
    assert rc == code, (rc, out, err)
    assert out == "", out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memra-dist: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ---- the one rule -----------------------------------------------------------------------


def test_a_temperature_below_the_threshold_is_greedy_and_probs_stay_finite():
    for t in (1e-38, 1e-45, 5e-324, GREEDY_BELOW / 2):
        sp = SamplingParams(temperature=t)
        assert sp.greedy and sp.temperature == 0.0
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
    logits = torch.tensor([[30.0, 29.999, -5.0, 0.0]])
    p = probs(logits, SamplingParams(temperature=GREEDY_BELOW))
    assert torch.isfinite(p).all() and int(p.argmax()) == 0
    # the failure this replaces: fp32 logits divided by 1e-45 overflow, and softmax turns inf into NaN
    assert not torch.isfinite(torch.softmax(logits / 1e-45, -1)).all()


@pytest.mark.parametrize("kw", [dict(temperature=math.nan), dict(temperature=math.inf), dict(temperature=-1e-9),
                                dict(top_p=math.nan), dict(top_p=math.inf), dict(top_k=-1), dict(top_k=2.5)])
def test_non_finite_and_out_of_range_values_are_refused(kw):
    with pytest.raises(UserError):
        SamplingParams(**kw)


@pytest.mark.parametrize("seed", [-1, 2 ** 64, True])
def test_the_seed_has_the_batch_and_server_range(seed):
    with pytest.raises(UserError, match="--seed"):
        RunConfig(model="m", seed=seed)
    RunConfig(model="m", seed=2 ** 64 - 1)


# ---- the CLI ------------------------------------------------------------------------------


@pytest.mark.parametrize("t", ["1e-38", "1e-45"])
def test_cli_tiny_temperature_runs_as_greedy(llama, t, capsys):
    rc, out, err = run_main(_gen(llama, "--temperature", t), capsys)
    assert rc == 0, err
    rc0, out0, _ = run_main(_gen(llama, "--temperature", "0"), capsys)
    assert rc0 == 0 and json.loads(out)["token_ids"] == json.loads(out0)["token_ids"]


@pytest.mark.parametrize("argv, flag", [
    (("--temperature", "nan"), "--temperature"), (("--temperature", "inf"), "--temperature"),
    (("--temperature=-inf",), "--temperature"), (("--top-p", "nan"), "--top-p"),
    (("--seed", str(2 ** 64)), "--seed"), (("--seed", "-1"), "--seed")])
def test_cli_refuses_non_finite_and_out_of_range_in_one_line(llama, argv, flag, capsys):
    _one_line_error(*run_main(_gen(llama, *argv), capsys), flag)


# ---- the server's parsing -----------------------------------------------------------------


def test_protocol_takes_a_tiny_temperature_as_greedy_and_refuses_non_finite():
    r = parse_completion(b'{"prompt": "x", "temperature": 1e-38}', "llama")
    assert r.fields == {"temperature": 1e-38}
    cfg = request_cfg(RunConfig(model="m"), Request(0, "api", r.prompt, r.fields))
    assert cfg.sampling.greedy
    for body in (b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "temperature": Infinity}',
                 b'{"prompt": "x", "temperature": 1e999}', b'{"prompt": "x", "top_p": NaN}'):
        with pytest.raises(ApiError) as e:
            parse_completion(body, "llama")
        assert e.value.status == 400 and e.value.param in ("temperature", "top_p"), body


# ---- batch lines --------------------------------------------------------------------------


def _parser():
    from memra_dist.cli import _add_run_args, _Parser
    from memra_dist.serve import add_batch_parser

    p = _Parser(prog="memra-dist")
    add_batch_parser(p.add_subparsers(dest="cmd", required=True, parser_class=_Parser), _add_run_args)
    return p


def _batch(*argv) -> int:
    from memra_dist.serve import run_batch

    return run_batch(_parser().parse_args(["batch", *map(str, argv), "--device", "cpu", "--dtype", "fp32"]))


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_batch_line_values(llama, tmp_path, capsys):
    """1e-38 / 1e-45 run (as greedy); NaN, Infinity and 1e999 (= inf in JSON) are error records."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join([
        json.dumps({"id": "greedy", "prompt": PROMPT}),
        json.dumps({"id": "tiny", "prompt": PROMPT, "temperature": 1e-38}),
        json.dumps({"id": "tinier", "prompt": PROMPT, "temperature": 1e-45}),
        '{"id": "nan", "prompt": "x", "temperature": NaN}',
        '{"id": "inf", "prompt": "x", "temperature": Infinity}',
        '{"id": "big", "prompt": "x", "temperature": 1e999}',
        '{"id": "top_p", "prompt": "x", "top_p": NaN}']) + "\n")
    out = tmp_path / "out.jsonl"
    assert _batch("--model", llama, "--input", inp, "--output", out, "--max-new-tokens", 6) == 0
    recs = {r["id"]: r for r in _records(out)}
    assert recs["tiny"]["token_ids"] == recs["greedy"]["token_ids"] == recs["tinier"]["token_ids"]
    for k in ("nan", "inf", "big", "top_p"):
        assert set(recs[k]) == {"id", "error"} and ("temperature" in recs[k]["error"] or "top_p" in recs[k]["error"])
    assert "[batch] done: 7/7, 4 errors" in capsys.readouterr().err


# ---- non-finite logits --------------------------------------------------------------------


def _poisoned(src: Path, dst: Path, name: str, row: int | None = None) -> Path:
    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    if row is None:
        t[name][0, 0] = float("nan")
    else:
        t[name][row] = float("nan")
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def nan_llama(llama, tmp_path_factory):
    return _poisoned(llama, tmp_path_factory.mktemp("nan") / "m", "model.layers.2.mlp.down_proj.weight")


@pytest.mark.parametrize("extra", [(), ("--temperature", "0.8"), ("--drafter", "none")])
def test_cli_a_nan_weight_is_one_line_naming_the_layer(nan_llama, extra, capsys):
    line = _one_line_error(*run_main(_gen(nan_llama, *extra), capsys), "non-finite logits", "layer 2",
                           "layers.2.mlp.down_proj.weight")
    assert "the prompt's last row" in line


def test_a_batched_greedy_first_token_from_a_nan_row_is_the_same_error_as_alone(nan_llama):
    """On a batched engine a greedy request's first token comes from the step's readback (its
    argmax and the logit there, no device op of its own): a NaN there is the error a request
    alone gets, naming the layer; a sampled one beside it fails the same way."""
    from memra_dist.app import open_engine

    msgs = {}
    for batch in (1, 2):
        for temp in (0.0, 0.8):
            cfg = RunConfig(model=str(nan_llama), drafter="none", device="cpu", dtype="fp32", max_new_tokens=4,
                            sampling=SamplingParams(temperature=temp))
            with open_engine(cfg, capacity=64, max_batch=batch) as eng:
                with pytest.raises(Exception) as e:
                    eng.generate([5, 6, 7, 8, 9, 10], cfg)
            msgs[batch, temp] = str(e.value)
    assert all("non-finite logits" in m and "layer 2" in m and "the prompt's last row" in m for m in msgs.values()), msgs
    assert msgs[1, 0.0] == msgs[2, 0.0]


def test_a_nan_at_a_later_position_is_caught_in_the_round(llama, tmp_path, capsys):
    """NaN embedding rows of the first generated tokens: the prime is finite, the first round's
    verify is not; greedy must not turn it into a token (argmax of an all-NaN row is 0)."""
    from memra_dist.model.tokenizer import load_tokenizer

    prompt_ids = load_tokenizer(llama).encode(PROMPT)
    runs = [("--drafter", "none"), ("--temperature", "0.7", "--seed", "0"), ()]
    anchors = set()
    for extra in runs:  # the anchor each run draws from the (finite) prompt's logits
        rc, out, err = run_main(_gen(llama, *extra), capsys)
        assert rc == 0, err
        anchors.add(json.loads(out)["token_ids"][0])
    assert not anchors & set(prompt_ids)
    bad = tmp_path / "m"
    shutil.copytree(llama, bad)
    t = load_file(str(bad / "model.safetensors"))
    for a in anchors:
        t["model.embed_tokens.weight"][a] = float("nan")
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    for extra in runs:
        line = _one_line_error(*run_main(_gen(bad, *extra), capsys), "non-finite logits", "embed_tokens")
        assert f"position {len(prompt_ids)} (round 0, verify row 0)" in line, line


def test_batch_a_nan_weight_is_an_error_record_not_token_0(nan_llama, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt": PROMPT}) + "\n"
                   + json.dumps({"id": 2, "prompt": PROMPT, "temperature": 0.9}) + "\n")
    out = tmp_path / "out.jsonl"
    assert _batch("--model", nan_llama, "--input", inp, "--output", out, "--max-new-tokens", 4) == 0
    recs = _records(out)
    assert [set(r) for r in recs] == [{"id", "error", "prompt_sha256"}] * 2, recs
    assert all("non-finite logits" in r["error"] and "layer 2" in r["error"] for r in recs)


def test_accept_raises_on_a_non_finite_row_it_uses_only():
    nan = float("nan")
    logits = torch.zeros(3, 5)
    logits[0, 2] = 1.0
    logits[1, 3] = 1.0
    logits[2] = nan
    # drafts [2, 0]: row 0 accepts 2, row 1 rejects 0 and commits 3: row 2 (NaN) is never used
    assert greedy_commit(logits, torch.tensor([2, 0])) == [2, 3]
    with pytest.raises(NonFiniteRow) as e:
        greedy_commit(logits, torch.tensor([2, 3]))  # row 2 is used now: its argmax would be a NaN's index
    assert e.value.row == 2
    logits[1, 1] = float("inf")
    with pytest.raises(NonFiniteRow):
        greedy_commit(logits, torch.tensor([2, 0]))
    p = torch.softmax(torch.tensor([[0.0, 9.0, 0.0], [nan, 0.0, 0.0]]), -1)
    with pytest.raises(NonFiniteRow):
        accept_sampled(p, None, torch.tensor([1]), torch.Generator().manual_seed(0))


# ---- a request that fails inside the engine -----------------------------------------------


class FakeTok:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 90 + 1 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(32 + i % 90) for i in ids)


class FakeEngine:
    def __init__(self, log, fail, sessions=1):
        self.log, self.fail, self.sessions = log, fail, sessions

    def generate(self, prompt, cfg=None, stream=None):
        self.log.append(prompt)
        if self.fail(prompt):
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        toks = [sum(prompt) % 97] * cfg.max_new_tokens
        if stream is not None:
            stream(toks)
        return Result(toks, {"tokens": len(toks)})


BAD = FakeTok().encode("bad")


def _bad(ids) -> bool:
    return ids[:3] == BAD


def _job(inp, out, fail=lambda ids: False, sessions=None):
    log: list = []

    @contextmanager
    def open_engine(cfg, capacity, sessions=None):
        yield FakeEngine(log, fail, sessions or 1)

    err = io.StringIO()
    code = run_job(RunConfig(model="unused", max_new_tokens=3), inp, out, tokenizer=FakeTok(), max_pos=512,
                   open_engine=open_engine, err=err, sessions=sessions)
    return code, log, err.getvalue()


def _rows(tmp_path, n=7, bad=3):
    rows = [{"id": i, "prompt": ("bad" if i == bad else "p") + "q" * i} for i in range(n)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return inp, rows


@pytest.mark.parametrize("sessions", [None, 3])
def test_a_middle_request_failing_in_the_engine_fails_alone_and_is_not_rerun(tmp_path, sessions):
    inp, rows = _rows(tmp_path)
    out = tmp_path / "out.jsonl"
    code, log, err = _job(inp, out, fail=_bad, sessions=sessions)
    assert code == 0 and len(log) == 7
    recs = {r["id"]: r for r in _records(out)}
    assert len(recs) == 7 and all("token_ids" in recs[i] for i in range(7) if i != 3)
    assert recs[3]["error"].startswith("the engine failed: RuntimeError: probability tensor")
    assert recs[3]["prompt_sha256"] == prompt_hash(rows[3]["prompt"])
    assert "request 3 (line 4)" in err and "7/7, 1 error" in err
    code, log, err = _job(inp, out, fail=_bad, sessions=sessions)  # resume
    assert code == 0 and log == [] and len(_records(out)) == 7  # the failed one is not run again


def test_an_engine_failing_every_request_stops_the_job(tmp_path):
    inp, _ = _rows(tmp_path, n=6)
    out = tmp_path / "out.jsonl"
    with pytest.raises(EngineFailing) as e:
        _job(inp, out, fail=lambda ids: True)
    assert e.value.exit_code == 1 and "in a row" in str(e.value) and "\n" not in str(e.value)
    assert len(_records(out)) == ENGINE_FAILURES_TO_STOP  # the rest is left to a resume
    code, log, _ = _job(inp, out)
    assert code == 0 and len(log) == 6 - ENGINE_FAILURES_TO_STOP


def test_an_output_with_other_prompts_for_its_ids_is_refused(tmp_path):
    inp, rows = _rows(tmp_path, n=4, bad=-1)
    out = tmp_path / "out.jsonl"
    assert _job(inp, out)[0] == 0
    before = out.read_bytes()
    rows[2]["prompt"] = "changed text"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError) as e:
        _job(inp, out)
    assert "id 2" in str(e.value) and "changed text" not in str(e.value) and "\n" not in str(e.value)
    assert out.read_bytes() == before  # nothing ran, nothing written
    out.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "prompt_sha256"}) + "\n"
                           for r in _records(out)))
    assert _job(inp, out)[0] == 0  # records without a hash (an older job's): kept as they are


# ---- batch's flags -------------------------------------------------------------------------


def test_batch_has_no_metrics_flags_and_its_run_dir_is_real(capsys):
    p = _parser()
    with pytest.raises(SystemExit):
        p.parse_args(["batch", "--help"])
    help_text = capsys.readouterr().out
    assert "--metrics-port" not in help_text and "--metrics-hold" not in help_text and "--run-dir" in help_text
    with pytest.raises(SystemExit) as e:
        p.parse_args(["batch", "--model", "m", "--input", "i", "--output", "o", "--metrics-port", "0"])
    assert e.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_batch_trace_level_1_at_pp1_writes_spans(llama, tmp_path, capsys, monkeypatch):
    for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "TRACEPARENT"):
        monkeypatch.delenv(k, raising=False)
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt": PROMPT}) + "\n" + json.dumps({"id": "b", "prompt": "Hello"}) + "\n")
    run = tmp_path / "run"
    assert _batch("--model", llama, "--input", inp, "--output", tmp_path / "o.jsonl", "--max-new-tokens", 8,
                  "--trace-level", 1, "--run-dir", run) == 0
    err = capsys.readouterr().err
    assert f"spans written to {run}" in err and "does not use" not in err
    doc = json.loads((run / "spans.otlp.json").read_text())
    names = [s["name"] for rs in doc["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    assert names.count("memra.request") == 2 and names.count("spec.burst") >= 2, names


# ---- the OTLP warning ----------------------------------------------------------------------


def test_the_dropped_spans_warning_says_what_the_flushes_cost(monkeypatch, capsys):
    from memra_dist.tracing import otel

    def slow(provider, counting, made, bound):
        return made  # every span lost

    monkeypatch.setattr(otel, "shutdown_bounded", slow)
    monkeypatch.setattr(otel, "flush_timeout_s", lambda: 5.0)
    ts = otel.TracingSession(True, None, None)
    ts.ended, ts.burst_spans = 1, 9
    assert ts.close(metrics_follow=True) == 10
    line = capsys.readouterr().err.strip()
    assert line.startswith("memra-dist: warning: 10 of 10 spans were not delivered")
    assert "bounded at 5s" not in line
    assert "MEMRA_FLUSH_TIMEOUT_S=5 s, plus up to 1 s" in line and "metrics flush that follows waits up to 5 s" in line
    ts = otel.TracingSession(True, None, None)
    ts.ended = 1
    ts.close(metrics_follow=False)
    assert "metrics" not in capsys.readouterr().err


def test_the_one_ahead_path_reports_a_later_nan_instead_of_token_0(llama, tmp_path):
    """Greedy, no drafter, a graphed one-row step (emulated on the CPU): the steps run one ahead
    of the host, the argmax never leaves the device; the logit at each argmax rides back with
    the token, so a NaN row is reported, not committed as token 0 (or a NaN's index)."""
    from test_ahead import CAP, PROMPT, _graphed

    from memra_dist.phase.levels import TraceSettings
    from memra_dist.runner import ModelRunner
    from memra_dist.specdec.drafters.none import NoDrafter
    from memra_dist.specdec.sampling import NonFiniteLogits
    from memra_dist.specdec.session import SpecSession

    def session(target):
        s = SpecSession(target, NoDrafter(), SamplingParams(), torch.Generator(), 1, TraceSettings())
        out = [s.start(PROMPT, 12, CAP)]
        while not s.done:
            out.extend(s.burst(4))
        return out, s

    clean, _ = session(ModelRunner(str(llama), torch.device("cpu"), torch.float32))
    i, t = next((i, t) for i, t in enumerate(clean) if i >= 2 and t not in PROMPT and t not in clean[:i])
    bad = _poisoned(llama, tmp_path / "m", "model.embed_tokens.weight", row=t)
    r = _graphed(str(bad))
    s = SpecSession(r, NoDrafter(), SamplingParams(), torch.Generator(), 1, TraceSettings())
    got = [s.start(PROMPT, 12, CAP)]
    with pytest.raises(NonFiniteLogits) as e:
        while not s.done:
            s.burst(4, got.extend)  # the tokens as they commit
    assert s.ran_ahead and got == clean[:i + 1] and 0 not in got[1:]  # nothing drawn from the NaN row
    assert "one step ahead" in str(e.value) and "embed_tokens" in str(e.value), str(e.value)


def test_the_largest_seed_runs_with_the_replay_drafter(llama):
    """The replay drafter draws from its own generator seeded one past the request's: the
    largest accepted seed wraps instead of overflowing."""
    from memra_dist.app import generate

    cfg = RunConfig(model=str(llama), drafter="replay", max_new_tokens=6, device="cpu", seed=2**64 - 1)
    plain = RunConfig(model=str(llama), drafter="none", max_new_tokens=6, device="cpu")
    assert generate(cfg, [5, 9, 17, 5]).token_ids == generate(plain, [5, 9, 17, 5]).token_ids


def test_a_nan_draft_checkpoint_is_one_line_when_sampling(llama, draft_llama, tmp_path, capsys):
    """The drafter's own distribution is non-finite (a NaN in the draft checkpoint): the
    sampled path refuses it in one line instead of sampling into a traceback."""
    bad = _poisoned(draft_llama, tmp_path / "draft", "model.layers.0.mlp.down_proj.weight")
    _one_line_error(*run_main(_gen(llama, "--draft-model", str(bad), "--temperature", "0.8"), capsys),
                    "non-finite logits", "model drafter")
