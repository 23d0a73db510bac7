"""Bad input through the CLI: exit code 2, exactly one line on stderr (no traceback), nothing
on stdout. The table runs `memra_dist.cli.main` in-process (the same entry point the console
script calls); a few cases also run as real subprocesses to pin the process-level contract."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from memra_dist.cli import main

PROMPT = "the drafter proposes"


@pytest.fixture(scope="module")
def bad_dirs(llama, ckpt_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")

    def clone(name):
        d = root / name
        shutil.copytree(llama, d)
        return d

    dirs = {"good": llama, "missing": root / "does-not-exist"}
    (root / "empty").mkdir()
    dirs["empty"] = root / "empty"

    d = clone("badjson")
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": 32,')
    dirs["badjson"] = d

    d = clone("nokey")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    dirs["nokey"] = d

    d = clone("arch")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    dirs["arch"] = d

    d = clone("notensor")
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.2.mlp.up_proj.weight"]
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    dirs["notensor"] = d

    d = clone("shape")
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.1.self_attn.k_proj.weight"] = t["model.layers.1.self_attn.k_proj.weight"][:, :-1].contiguous()
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    dirs["shape"] = d

    d = clone("notok")
    (d / "tokenizer.json").unlink()
    dirs["notok"] = d

    dirs["draft64"] = ckpt_factory("llama", seed=9, vocab_size=64, num_hidden_layers=1)[0]
    return dirs


def _gen(model, *extra, prompt=PROMPT):
    return ["generate", "--model", str(model), "--prompt", prompt, "--max-new-tokens", "4", "--device", "cpu",
            *extra]


# (case id, argv builder over the dirs, substrings the one stderr line must contain)
CASES = [
    ("missing-dir", lambda d: _gen(d["missing"]), ["not found", "does-not-exist"]),
    ("empty-dir", lambda d: _gen(d["empty"]), ["config.json"]),
    ("malformed-config", lambda d: _gen(d["badjson"]), ["malformed JSON"]),
    ("missing-key", lambda d: _gen(d["nokey"]), ["hidden_size"]),
    ("unsupported-arch", lambda d: _gen(d["arch"]), ["gpt2", "llama", "qwen2", "qwen3"]),
    ("missing-tensor", lambda d: _gen(d["notensor"]), ["model.layers.2.mlp.up_proj.weight"]),
    ("misshaped-tensor", lambda d: _gen(d["shape"]), ["model.layers.1.self_attn.k_proj.weight", "(16, 31)", "(16, 32)"]),
    ("vocab-mismatch", lambda d: _gen(d["good"], "--draft-model", str(d["draft64"])), ["64", "128", "vocab"]),
    ("draft-missing", lambda d: _gen(d["good"], "--draft-model", str(d["missing"])), ["not found"]),
    ("empty-prompt", lambda d: _gen(d["good"], prompt=""), ["prompt is empty"]),
    ("prompt-over-ctx", lambda d: _gen(d["good"], "--ctx", "4", prompt=PROMPT * 3), ["prompt", "context"]),
    ("k-zero", lambda d: _gen(d["good"], "-k", "0"), ["-k"]),
    ("k-negative", lambda d: _gen(d["good"], "-k", "-3"), ["-k"]),
    ("k-absurd", lambda d: _gen(d["good"], "-k", "1000"), ["1000"]),
    ("max-new-zero", lambda d: _gen(d["good"], "--max-new-tokens", "0"), ["--max-new-tokens"]),
    ("temperature-negative", lambda d: _gen(d["good"], "--temperature", "-0.5"), ["--temperature"]),
    ("top-p-zero", lambda d: _gen(d["good"], "--top-p", "0"), ["--top-p"]),
    ("top-p-over-one", lambda d: _gen(d["good"], "--top-p", "1.5"), ["--top-p"]),
    ("top-k-negative", lambda d: _gen(d["good"], "--top-k", "-1"), ["--top-k"]),
    ("dtype-unsupported", lambda d: _gen(d["good"], "--dtype", "int8"), ["int8"]),
    ("no-tokenizer", lambda d: _gen(d["notok"]), ["tokenizer.json"]),
    ("not-an-int", lambda d: _gen(d["good"], "-k", "four"), ["four"]),
]


def run_main(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse errors exit through sys.exit
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_one_line_error(rc, out, err, needles):
    assert rc == 2, (rc, out, err)
    assert out == "", out
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.mark.parametrize("case, argv, needles", CASES, ids=[c[0] for c in CASES])
def test_bad_input_one_line_exit_2(bad_dirs, case, argv, needles, capsys):
    _assert_one_line_error(*run_main(argv(bad_dirs), capsys), needles)


def test_malformed_otlp_endpoint(bad_dirs, capsys, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://:x")
    _assert_one_line_error(*run_main(_gen(bad_dirs["good"], "--trace-level", "1"), capsys),
                           ["OTEL_EXPORTER_OTLP_ENDPOINT", "http://:x"])
    # validated even with tracing off: a bad variable is bad input whatever the level
    _assert_one_line_error(*run_main(_gen(bad_dirs["good"]), capsys), ["OTEL_EXPORTER_OTLP_ENDPOINT"])


def test_good_input_is_not_an_error(bad_dirs, capsys):
    """The control for the table: the same argv builder with a good directory succeeds."""
    rc, out, err = run_main(_gen(bad_dirs["good"], "--json"), capsys)
    assert rc == 0, err
    assert len(json.loads(out)["token_ids"]) == 4


def _cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "memra_dist.cli", *argv], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.mark.parametrize("case", ["missing-dir", pytest.param("misshaped-tensor", marks=pytest.mark.slow),
                                  pytest.param("k-absurd", marks=pytest.mark.slow)])  # (a subprocess each)
def test_bad_input_subprocess(bad_dirs, case):
    argv, needles = {c[0]: (c[1], c[2]) for c in CASES}[case]
    res = _cli(*argv(bad_dirs))
    _assert_one_line_error(res.returncode, res.stdout, res.stderr, needles)


@pytest.mark.slow  # a whole CLI run in a subprocess: ~4 s on 2 cores
def test_malformed_traceparent_is_only_a_warning(bad_dirs, tmp_path):
    res = _cli(*_gen(bad_dirs["good"], "--json", "--trace-level", "1", "--run-dir", str(tmp_path / "run"),
                     "--traceparent", "00-nothex-zz-01"))
    assert res.returncode == 0, res.stderr
    assert len(json.loads(res.stdout)["token_ids"]) == 4
    warn = [ln for ln in res.stderr.splitlines() if "traceparent" in ln and not ln.startswith("[memra]")]
    assert len(warn) == 1 and "warning" in warn[0] and "00-nothex-zz-01" in warn[0]
    assert "Traceback" not in res.stderr
    # the run still traced: a root memra.request in a fresh trace
    spans = json.loads((tmp_path / "run" / "spans.otlp.json").read_text())
    names = [s["name"] for rs in spans["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    assert names.count("memra.request") == 1


def test_plain_output_streams_text_then_one_summary_line(bad_dirs, capsys, tmp_path):
    """Without --json: the prompt, then the streamed continuation (--json's text, joined to the
    prompt as the tokenizer joins them), then why it stopped, then one [memra] summary line;
    at trace level 1 the phase-share table and the run directory go to stderr."""
    rc, out_json, _ = run_main(_gen(bad_dirs["good"], "--json", "--max-new-tokens", "12"), capsys)
    assert rc == 0
    want = json.loads(out_json)
    rc, out, err = run_main(_gen(bad_dirs["good"], "--max-new-tokens", "12", "--trace-level", "1",
                                 "--run-dir", str(tmp_path / "run")), capsys)
    assert rc == 0, err
    text, summary = out.rstrip("\n").rsplit("\n", 1)
    assert text.startswith(PROMPT) and text.endswith(" [stopped at 12 new tokens]"), text
    cont = text[len(PROMPT):-len(" [stopped at 12 new tokens]")]
    assert cont.strip() == want["text"].strip()
    st = want["stats"]
    assert summary.startswith(f"[memra] tokens={st['tokens']} tok/s=")
    for key in ("rounds", "drafted", "accepted"):
        assert f" {key}={st[key]} " in summary
    assert " acceptance=" in summary and " tokens/round=" in summary
    # the fast path the steps really ran: on CPU none of graphs / compile / kernels
    assert st["fast_path"] == {"graphs": False, "compile": False, "kernels": False, "ahead": False}
    assert summary.endswith(" path=eager")
    assert "phase shares over" in err and str(tmp_path / "run") in err
    doc = json.loads((tmp_path / "run" / "spans.otlp.json").read_text())
    (req,) = [s for rs in doc["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]
              if s["name"] == "memra.request"]
    attrs = {a["key"]: next(iter(a["value"].values())) for a in req["attributes"]}
    assert attrs["memra.fast_path"] == "eager"  # the request span says which path its steps ran
    assert int(attrs["memra.tokens"]) == st["tokens"] and int(attrs["memra.drafted"]) == st["drafted"]


def test_seed_makes_sampling_reproducible(bad_dirs, capsys):
    def ids(seed):
        rc, out, err = run_main(_gen(bad_dirs["good"], "--json", "--temperature", "1.0", "--max-new-tokens", "16",
                                     "--seed", str(seed)), capsys)
        assert rc == 0, err
        return json.loads(out)["token_ids"]

    a, b = ids(1), ids(1)
    assert a == b
    assert any(ids(s) != a for s in (2, 3, 4))
