"""The INSTALLED `memra-dist` program (the console script pip writes, not `python -m
memra_dist.cli`) takes SIGTERM as Ctrl-C: exit 130, the interrupt line, spans flushed, at
pp = 1 and pp = 2 (its own Ray); `batch` ends with its summary line."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).with_name("memra-dist")

pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="memra-dist is not installed next to this Python")


def _env():
    return {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "RAY_ADDRESS", "MEMRA_", "TRACEPARENT"))}


def _wait_stderr(p: subprocess.Popen, marker: str, timeout: float) -> None:
    end, buf = time.monotonic() + timeout, b""
    while time.monotonic() < end:
        r, _, _ = select.select([p.stderr], [], [], 0.2)
        if r:
            chunk = os.read(p.stderr.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            if marker.encode() in buf:
                return
    p.kill()
    raise AssertionError(f"never saw {marker!r}: {buf.decode(errors='replace')[-2000:]}")


def _sigterm(p: subprocess.Popen) -> tuple[int, str]:
    p.send_signal(signal.SIGTERM)
    try:
        _out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, err.decode(errors="replace")


def test_the_console_script_is_the_signal_handling_entry():
    text = SCRIPT.read_text()
    assert "from memra_dist.cli import run" in text, text


@pytest.mark.parametrize("pp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_generate_sigterm_exits_130_and_flushes(llama, tmp_path, pp):
    run_dir = tmp_path / "run"
    argv = [str(SCRIPT), "generate", "--model", str(llama), "--prompt", "The phase clock drains",
            "--max-new-tokens", "450", "--device", "cpu", "--drafter", "none", "--trace-level", "1",
            "--burst-rounds", "2", "--run-dir", str(run_dir), "--pp", str(pp)]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=tmp_path)
    _wait_stderr(p, "[spec-phase]", 120)
    code, err = _sigterm(p)
    assert code == 130, err[-3000:]
    assert "memra-dist: interrupted" in err and "Traceback" not in err, err[-3000:]
    spans = json.loads((run_dir / "spans.otlp.json").read_text())  # complete, valid JSON
    names = [s["name"] for rs in spans["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    assert names.count("memra.request") == 1


@pytest.mark.slow  # ~2-4 s on 2 cores: the quick tier keeps its margin under 5 minutes
def test_batch_sigterm_exits_130_with_its_summary(llama, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"line {i} of the job"}) + "\n" for i in range(40)))
    argv = [str(SCRIPT), "batch", "--model", str(llama), "--input", str(inp), "--output", str(out),
            "--device", "cpu", "--max-new-tokens", "300"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=tmp_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None and not (out.exists() and out.read_bytes().count(b"\n")):
        time.sleep(0.05)
    assert p.poll() is None, p.communicate()[1][-2000:]
    code, err = _sigterm(p)
    assert code == 130, err[-3000:]
    assert "interrupted at" in err and "Traceback" not in err, err[-3000:]


def test_an_interrupt_during_the_trace_write_leaves_the_files_whole(tmp_path, monkeypatch):
    """Ctrl-C lands while the run directory's files are being written: both files are
    complete on disk, and the interrupt is delivered after them."""
    from memra_dist.tracing import files

    real = files.write_merged_perfetto

    def interrupted(run_dir):
        os.kill(os.getpid(), signal.SIGINT)  # mid-write: the OTLP file done, the Perfetto file next
        time.sleep(0.05)
        return real(run_dir)

    monkeypatch.setattr(files, "write_merged_perfetto", interrupted)
    exp = files.RunDirExporter(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        exp.write()
    assert json.loads((tmp_path / files.OTLP_NAME).read_text())["resourceSpans"] == []
    assert "traceEvents" in json.loads((tmp_path / files.PERFETTO_NAME).read_text())
