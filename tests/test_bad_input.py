"""Bad input the table in tests/test_cli_errors.py does not cover: unreadable model
directories and files, --pp beyond the layers or the GPUs, more malformed OTLP endpoints,
more malformed traceparents, and junk MEMRA_SPEC_TRACE (= off). Same contract: exit code 2,
exactly one stderr line, no traceback, nothing on stdout, nothing half-written.

Unreadable files: this suite often runs as root, for whom chmod 000 changes nothing
(CAP_DAC_OVERRIDE). Those cases therefore run the CLI as a subprocess under `setpriv` with
CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped from the bounding set (root without them
obeys file modes like anyone else); as a non-root user chmod 000 is enough. With neither,
the cases skip. A config.json that is a directory is unreadable for everyone and runs
in-process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from memra_dist.cli import main

from test_cli_errors import _assert_one_line_error, _gen, run_main

_DROP = "-dac_override,-dac_read_search"


def _unprivileged_prefix() -> list[str] | None:
    """A command prefix under which chmod 000 is honoured, or None."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    probe = subprocess.run([setpriv, f"--bounding-set={_DROP}", f"--inh-caps={_DROP}", "true"], capture_output=True)
    return [setpriv, f"--bounding-set={_DROP}", f"--inh-caps={_DROP}"] if probe.returncode == 0 else None


@pytest.fixture(scope="module")
def clone(llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input")
    made = []

    def make(name):
        d = root / name
        shutil.copytree(llama, d)
        made.append(d)
        return d

    yield make
    for d in made:  # give the modes back so pytest can clean up
        for p in [d, *d.rglob("*")]:
            if p.exists() and not p.is_symlink():
                os.chmod(p, 0o755)


def _cli(argv, prefix=(), env=None):
    return subprocess.run([*prefix, sys.executable, "-m", "memra_dist.cli", *argv], capture_output=True, text=True,
                          timeout=120, env=env)


# ---- unreadable model directory / files ------------------------------------------------

# (case, how to break the clone, substrings the one stderr line must contain)
UNREADABLE = [
    ("dir-mode-000", lambda d: os.chmod(d, 0o000), ["permission denied"]),
    ("config-mode-000", lambda d: os.chmod(d / "config.json", 0o000), ["config.json", "permission denied"]),
    ("weights-mode-000", lambda d: os.chmod(d / "model.safetensors", 0o000), ["model.safetensors"]),
    ("tokenizer-mode-000", lambda d: os.chmod(d / "tokenizer.json", 0o000), ["tokenizer.json"]),
]


# (a subprocess each, ~2.5 s: the quick tier keeps the directory's case, the slow tier every file's)
@pytest.mark.parametrize("case, breaker, needles",
                         [c if c[0] == "dir-mode-000" else pytest.param(*c, marks=pytest.mark.slow) for c in UNREADABLE],
                         ids=[c[0] for c in UNREADABLE])
def test_unreadable_model_files(clone, case, breaker, needles):
    prefix = _unprivileged_prefix()
    if prefix is None:
        pytest.skip("running as root without setpriv: file modes cannot be made to bite")
    d = clone(case)
    breaker(d)
    res = _cli(_gen(d), prefix)
    _assert_one_line_error(res.returncode, res.stdout, res.stderr, needles)


def test_config_json_is_a_directory(clone, capsys):
    d = clone("config-is-dir")
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    _assert_one_line_error(*run_main(_gen(d), capsys), ["config.json"])


def test_weights_file_is_a_directory(clone, capsys):
    d = clone("weights-is-dir")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()
    _assert_one_line_error(*run_main(_gen(d), capsys), ["model.safetensors"])


def test_tokenizer_json_is_malformed(clone, capsys):
    d = clone("tokenizer-bad")
    (d / "tokenizer.json").write_text("{not json")
    _assert_one_line_error(*run_main(_gen(d), capsys), ["tokenizer.json"])


# ---- pipeline sizes -------------------------------------------------------------------


def test_cli_pp_larger_than_layers(llama, capsys):
    """Refused before Ray starts (the tiny model has 4 layers)."""
    _assert_one_line_error(*run_main(_gen(llama, "--pp", "5"), capsys), ["--pp 5", "4 layers"])


@pytest.mark.parametrize("bounds, needles", [("1,1", ["--stage-bounds"]), ("0", ["--stage-bounds"]),
                                             ("2,x", ["--stage-bounds", "2,x"]), ("1,2,3", ["needs 1 values"])])
def test_cli_bad_stage_bounds(llama, capsys, bounds, needles):
    _assert_one_line_error(*run_main(_gen(llama, "--pp", "2", "--stage-bounds", bounds), capsys), needles)


@pytest.fixture(scope="module")
def ray_no_gpu():
    """A local Ray with zero GPUs (this machine's truth; also forced with num_gpus=0)."""
    ray = pytest.importorskip("ray")
    from memra_dist.pipeline.driver import _runtime_env

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, runtime_env=_runtime_env(),
                 configure_logging=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.slow  # a local Ray
def test_pp_needs_gpus_the_cluster_lacks(ray_no_gpu, llama, monkeypatch):
    """--device cuda on a cluster with 0 GPUs, and --pp 2 on a cluster that reports 1 GPU:
    both refused by name before any actor is placed."""
    from memra_dist.config import RunConfig
    from memra_dist.app import generate
    from memra_dist.errors import UserError

    import ray._private.state as gcs

    before = set(gcs.actors())
    cfg = RunConfig(model=str(llama), pp=2, device="cuda", max_new_tokens=4)
    with pytest.raises(UserError, match="the Ray cluster has no GPUs"):
        generate(cfg, [5, 9, 17])
    real = ray_no_gpu.cluster_resources
    monkeypatch.setattr(ray_no_gpu, "cluster_resources", lambda: {**real(), "GPU": 1.0})
    with pytest.raises(UserError, match=r"--pp 2 needs 2 GPUs .* has 1"):
        generate(cfg.with_(device="auto"), [5, 9, 17])
    assert set(gcs.actors()) == before  # nothing was placed


# ---- OTLP endpoint, traceparent, MEMRA_SPEC_TRACE ---------------------------------------


@pytest.mark.parametrize("endpoint", ["ftp://127.0.0.1:4317", "http://127.0.0.1:notaport", "http://127.0.0.1:99999",
                                      "http:///v1/traces", "://"])
def test_more_malformed_otlp_endpoints(llama, capsys, monkeypatch, endpoint):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    _assert_one_line_error(*run_main(_gen(llama, "--trace-level", "1"), capsys), ["OTEL_EXPORTER_OTLP_ENDPOINT"])


def test_unsupported_otlp_protocol(llama, capsys, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon")
    _assert_one_line_error(*run_main(_gen(llama, "--trace-level", "1"), capsys), ["carrier-pigeon"])


@pytest.mark.parametrize("tp", ["garbage", "00-" + "0" * 32 + "-" + "1" * 16 + "-01",  # all-zero trace id
                                "00-" + "a" * 32 + "-" + "0" * 16 + "-01"])  # all-zero span id
def test_malformed_traceparents_warn_once_and_run(llama, capsys, tmp_path, tp):
    rc, out, err = run_main(_gen(llama, "--json", "--trace-level", "1", "--run-dir", str(tmp_path / "r"),
                                 "--traceparent", tp), capsys)
    assert rc == 0, err
    assert len(json.loads(out)["token_ids"]) == 4
    warn = [ln for ln in err.splitlines() if "traceparent" in ln and not ln.startswith("[memra]")]
    assert len(warn) == 1 and "warning" in warn[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("junk", ["yes", "3", "-1", "1.0", " 1", "on", ""])
def test_junk_spec_trace_is_off_in_process(llama, tmp_path, capsys, monkeypatch, junk):
    """Junk MEMRA_SPEC_TRACE = off: the run succeeds, prints no phase lines, writes no run
    directory, and says once that the value was ignored. (The env is read once per process:
    the cache is cleared.)"""
    from memra_dist.env import environment as env_settings

    for k in [k for k in os.environ if k.startswith(("OTEL_", "MEMRA_", "TRACEPARENT"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("MEMRA_SPEC_TRACE", junk)
    monkeypatch.chdir(tmp_path)
    env_settings.cache_clear()
    try:
        rc, out, err = run_main(_gen(llama, "--json"), capsys)
    finally:
        env_settings.cache_clear()
    assert rc == 0, err
    assert len(json.loads(out)["token_ids"]) == 4
    _said_once_ignored(err, junk)
    assert not (tmp_path / "runs").exists()


def _said_once_ignored(err: str, junk: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if junk in ("", "0"):  # unset-like values are plain off, with nothing to say
        assert lines == [], err
        return
    assert len(lines) == 1 and lines[0].startswith("[spec-trace] ignoring MEMRA_SPEC_TRACE="), err
    assert "[spec-phase]" not in err


@pytest.mark.slow  # a CLI subprocess run
def test_junk_spec_trace_is_off_subprocess(llama, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MEMRA_", "TRACEPARENT"))}
    env["MEMRA_SPEC_TRACE"] = "verbose"
    res = subprocess.run([sys.executable, "-m", "memra_dist.cli", *_gen(llama, "--json")],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert len(json.loads(res.stdout)["token_ids"]) == 4
    _said_once_ignored(res.stderr, "verbose")
    assert not (tmp_path / "runs").exists()


def test_main_is_the_entry_point():
    """Guard: the in-process cases above call the function the console script runs: `cli.run`
    (SIGTERM handled as Ctrl-C) calls `main` with the process's arguments."""
    import inspect

    from importlib.metadata import entry_points

    from memra_dist.cli import run

    eps = [e for e in entry_points(group="console_scripts") if e.name == "memra-dist"]
    assert eps and eps[0].value == "memra_dist.cli:run" and main.__module__ == "memra_dist.cli"
    assert "main()" in inspect.getsource(run)


def test_every_command_builds_without_the_serve_extra():
    """A core install (no `serve` extra: no starlette / fastapi / uvicorn) still parses every
    command, `serve --help` included: the server's web stack is imported only when it runs."""
    import subprocess
    import sys

    code = ("import sys\nfor m in ('starlette', 'fastapi', 'uvicorn'):\n    sys.modules[m] = None\n"
            "from memra_dist.cli import build_parser\np = build_parser()\n"
            "for cmd in ('generate', 'demo', 'batch', 'serve', 'bench'):\n"
            "    try:\n        p.parse_args([cmd, '--help'])\n    except SystemExit as e:\n        assert e.code == 0, cmd\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
