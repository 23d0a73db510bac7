"""Faults survived, each bounded in time, on CPU with a local Ray where needed:

1. collector down (a closed port) or stalling (Export never answers): output correct, the
   run not held hostage, exit within the flush bound, one stderr line counting lost spans;
2. a stage actor killed mid-request: a bounded UserError naming the stage, the driver's
   spans flushed, and the next request in the same Ray completes with the right tokens;
3. SIGINT / SIGTERM of `memra-dist generate` (pp=1 and pp=2 with its own Ray): exit 130,
   spans flushed, no process of that run left behind;
4. a cache larger than free memory: refused with the size and the free MB before anything
   is allocated or generated;
5. trace files atomic under kill -9: complete JSON files or none.
See docs/reliability.md."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import pytest

from memra_dist.config import RunConfig
from memra_dist.errors import UserError
from memra_dist.app import generate

PROMPT = "the drafter proposes"
FLUSH_S = 1.0  # MEMRA_FLUSH_TIMEOUT_S for the subprocesses below


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MEMRA_", "RAY_ADDRESS", "TRACEPARENT"))}
    env["MEMRA_FLUSH_TIMEOUT_S"] = str(FLUSH_S)
    env.update(extra)
    return env


def _argv(model, *extra, n=48):
    return [sys.executable, "-m", "memra_dist.cli", "generate", "--model", str(model), "--prompt", PROMPT,
            "--max-new-tokens", str(n), "--device", "cpu", *extra]


def _run(argv, env, cwd, timeout=120):
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    return p, time.monotonic() - t0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: connections are refused


def _dropped_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "spans were not delivered" in ln]


def _otlp_spans(path: Path) -> list[dict]:
    doc = json.loads(path.read_text())
    return [s for rs in doc["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]


# ---- 1. collector down / stalling -------------------------------------------------------


class _Stall:
    """An OTLP/gRPC trace receiver whose Export never answers (until the test ends)."""

    def __enter__(self):
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        release = self.release = threading.Event()
        self.calls = 0
        outer = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                outer.calls += 1
                release.wait(60)
                context.abort(grpc.StatusCode.UNAVAILABLE, "stalled")

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.server.stop(grace=0).wait()


@pytest.fixture(scope="module")
def baseline(llama, tmp_path_factory):
    """A traced run with no endpoint (run directory): the output and wall time to compare to."""
    cwd = tmp_path_factory.mktemp("baseline")
    p, wall = _run(_argv(llama, "--json", "--trace-level", "1", "--run-dir", str(cwd / "run")), _env(), cwd)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)["token_ids"], wall


def _assert_not_hostage(p, wall, baseline):
    ids, base_wall = baseline
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["token_ids"] == ids  # generation unaffected
    lines = _dropped_lines(p.stderr)
    assert len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith("memra-dist: warning: ") and " of " in lines[0]
    assert int(lines[0].split()[2]) > 0
    # traces then metrics each flush within FLUSH_S; the rest is start-up noise on 2 cores
    assert wall <= base_wall + 2 * FLUSH_S + 4.0, (wall, base_wall)


@pytest.mark.slow  # a CLI subprocess run (+ the baseline run)
def test_collector_down_run_completes_and_exits_in_bound(llama, baseline, tmp_path):
    env = _env(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    p, wall = _run(_argv(llama, "--json", "--trace-level", "1"), env, tmp_path)  # OTLP timeout left at 10 s
    _assert_not_hostage(p, wall, baseline)
    assert not (tmp_path / "runs").exists()  # an endpoint was configured: no run directory


@pytest.mark.slow  # a CLI subprocess run
def test_collector_down_over_http_protobuf(llama, baseline, tmp_path):
    env = _env(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",
               OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
    p, wall = _run(_argv(llama, "--json", "--trace-level", "1"), env, tmp_path)
    _assert_not_hostage(p, wall, baseline)


@pytest.mark.slow  # a CLI subprocess run
def test_collector_stalling_run_completes_and_exits_in_bound(llama, baseline, tmp_path):
    with _Stall() as rx:
        env = _env(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{rx.port}", OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
        p, wall = _run(_argv(llama, "--json", "--trace-level", "1"), env, tmp_path)
        assert rx.calls >= 1  # it really reached the stalling Export
    _assert_not_hostage(p, wall, baseline)


# ---- processes of one run ----------------------------------------------------------------


def _ppid_map() -> dict[int, int]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    out[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def _descendants(root: int) -> set[int]:
    ppid = _ppid_map()
    kids: dict[int, list[int]] = {}
    for pid, pp in ppid.items():
        kids.setdefault(pp, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _wait_gone(pids: set[int], timeout: float) -> set[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        left = {p for p in pids if _alive(p)}
        if not left:
            return left
        time.sleep(0.2)
    return {p for p in pids if _alive(p)}


def _wait_stderr(p: subprocess.Popen, marker: str, timeout: float) -> str:
    """Read p's stderr until a line containing `marker` (the run is mid-generation)."""
    end, buf = time.monotonic() + timeout, b""
    fd = p.stderr.fileno()
    while time.monotonic() < end:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
            if marker.encode() in buf:
                return buf.decode(errors="replace")
    raise AssertionError(f"never saw {marker!r}: {buf.decode(errors='replace')[-2000:]}")


def _kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# ---- 2. a stage actor dies mid-request ---------------------------------------------------


def _cfg(model, **kw):
    return RunConfig(**{**dict(model=str(model), max_new_tokens=16, device="cpu", k=3), **kw})


TOKS = [5, 9, 17, 5, 9, 23, 40, 5, 9]


def test_stage_actor_killed_mid_request(ray_local, llama, monkeypatch):
    import ray._private.state as gcs

    from memra_dist.pipeline import driver as engine

    monkeypatch.setattr(engine, "pg_timeout_s", lambda: 15.0)  # the worst case is bounded by this
    before = set(gcs.actors())
    killed = {}

    def stream(toks):
        if killed or len(stream.seen) < 8:
            stream.seen.extend(toks)
            return
        stage = [v for k, v in gcs.actors().items() if k not in before and v["ActorClassName"] == "StageWorker"
                 and v["State"] == "ALIVE"]
        assert len(stage) == 1
        killed["pid"], killed["t"] = stage[0]["Pid"], time.monotonic()
        os.kill(stage[0]["Pid"], signal.SIGKILL)

    stream.seen = []
    cfg = _cfg(llama, pp=2, drafter="none", max_new_tokens=400, burst_rounds=2)
    with pytest.raises(UserError) as ei:
        generate(cfg, TOKS, stream)
    took = time.monotonic() - killed["t"]
    assert "stage 0" in str(ei.value), str(ei.value)
    assert "\n" not in str(ei.value)
    assert took < 15.0 + 5.0, took
    assert not _alive(killed["pid"])
    # the same Ray serves the next request, token-identical to the in-process engine
    ref = generate(_cfg(llama, drafter="ngram"), TOKS).token_ids
    assert generate(_cfg(llama, drafter="ngram", pp=2), TOKS).token_ids == ref
    # and nothing of either run is left alive
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            v["State"] != "DEAD" for k, v in gcs.actors().items() if k not in before):
        time.sleep(0.2)
    new = {k: v["State"] for k, v in gcs.actors().items() if k not in before}
    assert new and all(st == "DEAD" for st in new.values()), new  # both runs' actors, all dead


@pytest.mark.slow  # the CLI starts its own Ray
def test_cli_stage_killed_flushes_driver_spans(llama, tmp_path):
    """The CLI (its own local Ray, pp=2, level 1): kill -9 the stage actor after the first
    burst; exit 2 with one error line naming the stage, the driver's spans on disk (the
    request span marked ERROR), and no process of the run left."""
    run_dir = tmp_path / "run"
    p = subprocess.Popen(_argv(llama, "--pp", "2", "--trace-level", "1", "--burst-rounds", "2", "--drafter", "none",
                               "--run-dir", str(run_dir), n=400),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=tmp_path)
    procs: set[int] = set()
    try:
        _wait_stderr(p, "[spec-phase]", 90)
        procs = _descendants(p.pid)
        stage = [q for q in procs if _cmdline(q).startswith("ray::StageWorker")]
        assert len(stage) == 1, [_cmdline(q) for q in procs]
        t0 = time.monotonic()
        os.kill(stage[0], signal.SIGKILL)
        _out, err_rest = p.communicate(timeout=90)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    err = err_rest.decode(errors="replace")
    assert p.returncode == 2, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("memra-dist: error:")]
    assert len(errors) == 1 and "stage 0" in errors[0], err[-3000:]
    assert "Traceback" not in err
    assert took < 60, took
    spans = _otlp_spans(run_dir / "spans.otlp.json")
    req = [s for s in spans if s["name"] == "memra.request"]
    assert len(req) == 1 and req[0]["status"].get("code") == "STATUS_CODE_ERROR"
    left = _wait_gone(procs, 20)
    assert not left, {q: _cmdline(q) for q in left}


# ---- 3. interrupts ---------------------------------------------------------------------


@pytest.mark.slow  # CLI subprocess runs (pp=2: its own Ray)
@pytest.mark.parametrize("sig, pp", [(signal.SIGINT, 1), (signal.SIGTERM, 1), (signal.SIGINT, 2),
                                     (signal.SIGTERM, 2)],
                         ids=["sigint-pp1", "sigterm-pp1", "sigint-pp2", "sigterm-pp2"])
def test_interrupt_flushes_and_leaves_no_process(llama, tmp_path, sig, pp):
    run_dir = tmp_path / "run"
    extra = ["--pp", str(pp)] if pp > 1 else []
    p = subprocess.Popen(_argv(llama, "--trace-level", "1", "--burst-rounds", "2", "--drafter", "none",
                               "--run-dir", str(run_dir), *extra, n=450),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=tmp_path)
    procs: set[int] = set()
    try:
        _wait_stderr(p, "[spec-phase]", 90)
        procs = _descendants(p.pid)
        if pp > 1:
            names = {_cmdline(q).split(" ")[0] for q in procs}
            assert any("raylet" in n for n in names) and "ray::HeadWorker" in " ".join(names), names
        t0 = time.monotonic()
        os.kill(p.pid, sig)
        _out, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    err = err.decode(errors="replace")
    assert p.returncode == 130, err[-3000:]
    assert "memra-dist: interrupted" in err and "Traceback" not in err, err[-3000:]
    assert took < 30, took
    spans = _otlp_spans(run_dir / "spans.otlp.json")  # complete, valid JSON
    assert [s["name"] for s in spans].count("memra.request") == 1
    left = _wait_gone(procs, 20)
    _kill_all(left)  # never leave them to the next test
    assert not left, {q: _cmdline(q) for q in left}


# ---- 4. cache larger than free memory ----------------------------------------------------


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable")


@pytest.fixture(scope="module")
def wide(ckpt_factory):
    """Many KV heads of a tiny head_dim: 32 KiB of fp32 cache per row, rotary tables 32 B per
    row, so a context past host memory is cheap to *ask* for."""
    return ckpt_factory("llama", seed=3, hidden_size=256, num_attention_heads=64, num_key_value_heads=64,
                        num_hidden_layers=16, intermediate_size=32, max_position_embeddings=1 << 24)[0]


def test_planned_bytes_is_what_alloc_takes(llama):
    import torch

    from memra_dist.runner import ModelRunner

    r = ModelRunner(str(llama), torch.device("cpu"), torch.float32, max_pos=64)
    planned = r.planned_bytes(64)
    r.alloc(64)
    assert planned == r.cache.nbytes() == 4 * 2 * 64 * 2 * 8 * 4  # layers, K+V, rows, kv heads, head_dim, fp32


@pytest.mark.slow  # a CLI subprocess run
def test_cache_beyond_free_memory_refused_before_allocating(wide, tmp_path):
    per_row = 16 * 2 * 64 * 4 * 4  # layers * (K, V) * kv heads * head_dim * fp32
    ctx = 2 * _mem_available() // per_row + 1
    assert ctx < 1 << 24
    code = ("import resource, sys\nfrom memra_dist.cli import main\nrc = main(sys.argv[1:])\n"
            "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\nsys.exit(rc)")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code, "generate", "--model", str(wide), "--prompt", PROMPT,
                        "--max-new-tokens", "4", "--device", "cpu", "--ctx", str(ctx), "--trace-level", "1",
                        "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120)
    took = time.monotonic() - t0
    lines = [ln for ln in p.stderr.splitlines() if not ln.startswith("MAXRSS_KB")]
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stdout == ""  # no token was generated
    assert len(lines) == 1 and lines[0].startswith("memra-dist: error: out of memory"), p.stderr[-2000:]
    need_mb = ctx * per_row / (1 << 20)
    assert f"{ctx} rows" in lines[0] and f"needs {need_mb:.0f} MB on cpu" in lines[0] and "free " in lines[0]
    maxrss_mb = int(p.stderr.split("MAXRSS_KB")[1].split()[0]) / 1024
    assert maxrss_mb < 2048, maxrss_mb  # nothing near the requested size was touched
    assert took < 60


def test_cache_beyond_free_memory_on_a_stage_actor(ray_local, wide):
    """pp=2: the error surfaces from the actors as one line with the size and free MB."""
    from memra_dist.app import generate

    per_row = 16 * 2 * 64 * 4 * 4
    ctx = 2 * _mem_available() // per_row + 1
    with pytest.raises(UserError, match=r"out of memory: the cache for \d+ rows needs \d+ MB on cpu, free \d+ MB"):
        generate(_cfg(wide, pp=2, ctx=ctx, max_new_tokens=4), TOKS)


# ---- 5. trace files are atomic -----------------------------------------------------------


def test_write_atomic_failure_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    from memra_dist.tracing import files

    target = tmp_path / "spans.otlp.json"
    files.write_atomic(target, json.dumps({"v": 1}))

    def boom(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", boom)
    with pytest.raises(OSError):
        files.write_atomic(target, json.dumps({"v": 2, "pad": "x" * 100000}))
    assert json.loads(target.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spans.otlp.json"]


@pytest.mark.slow  # ~2-4 s on 2 cores: the quick tier keeps its margin under 5 minutes
def test_kill9_during_write_never_leaves_a_truncated_file(tmp_path):
    """A child writes a ~40 MB JSON through write_atomic once, then rewrites it in a loop;
    kill -9 lands mid-rewrite (the loop does nothing else). The visible file is the complete
    previous version every time, and the kills did land inside a write (a hidden temp left)."""
    target = tmp_path / "spans.otlp.json"
    code = ("import json, sys\nfrom pathlib import Path\nfrom memra_dist.tracing.files import write_atomic\n"
            "doc = json.dumps({'resourceSpans': [{'pad': 'x' * 40_000_000}]})\n"
            "write_atomic(Path(sys.argv[1]), doc)\n"
            "print('ready', flush=True)\n"
            "while True:\n    write_atomic(Path(sys.argv[1]), doc)\n")
    mid_write = 0
    for delay in (0.0, 0.15, 0.4):
        target.unlink(missing_ok=True)
        p = subprocess.Popen([sys.executable, "-c", code, str(target)], stdout=subprocess.PIPE, env=_env())
        try:
            assert p.stdout.readline().strip() == b"ready"
            time.sleep(delay)
            p.send_signal(signal.SIGKILL)
            p.wait(10)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == -signal.SIGKILL
        # the first write completed before 'ready': the name always holds a complete file
        assert len(json.loads(target.read_text())["resourceSpans"][0]["pad"]) == 40_000_000
        visible = [q.name for q in tmp_path.iterdir() if not q.name.startswith(".")]
        assert visible == ["spans.otlp.json"]
        temps = list(tmp_path.glob(".spans.otlp.json.*"))  # a kill mid-write leaves at most a hidden temp
        assert len(temps) <= 1, temps
        mid_write += len(temps)
        for tmp in temps:
            tmp.unlink()
    # the window between a rename and the next temp is microseconds wide: a kill almost
    # always lands inside a write, so at least one of three must have
    assert mid_write >= 1, "no kill landed inside a write: the test exercised nothing"


@pytest.mark.slow  # a CLI subprocess run
def test_kill9_of_a_traced_run_leaves_complete_files_or_none(llama, tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.Popen(_argv(llama, "--trace-level", "1", "--burst-rounds", "2", "--drafter", "none",
                               "--run-dir", str(run_dir), n=450),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=tmp_path)
    try:
        _wait_stderr(p, "[spec-phase]", 60)
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == -signal.SIGKILL  # killed mid-generation, not after a normal exit
    visible = sorted(f for f in run_dir.glob("*") if not f.name.startswith(".")) if run_dir.exists() else []
    for f in visible:
        json.loads(f.read_text())  # complete, or it would not be there
