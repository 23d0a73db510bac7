"""End to end on CPU: a real Ray head on this machine (token authentication ON), `ray job
submit` of `memra-dist demo --pp 2` through cluster/submit.sh with cluster/runtime_env.yaml,
the job reaches SUCCEEDED, and an in-test OTLP/gRPC receiver gets the run's spans from the
driver AND the head and stage actors, in one trace. Then `ray job stop` of a long
`demo --pp 2` mid-request: STOPPED, the driver's request span flushed (ERROR), no process of
the job left, the cluster still runs jobs (docs/reliability.md, fault 3b). Both tests share
one head (the `ray_head` fixture, started once for the module).

How it stays isolated and bounded:
- the head's temp dir is a short private /tmp/rj-<random> (Ray's socket paths are length
  limited); every port is a free one picked here, the dashboard (the job API) listens on
  127.0.0.1 only; the token is a fresh random one in a 0600 file under that dir, given to Ray
  with RAY_AUTH_MODE=token + RAY_AUTH_TOKEN_PATH (cluster/README.md, section 2), never
  ~/.ray/auth_token;
- teardown ends exactly the processes of THIS head: every process carrying the test's marker
  variable in its environment (Ray passes its environment down to gcs_server, raylet, agents,
  the job supervisor, the job's driver and the actors), found through /proc and killed by pid.
  It does not run `ray stop --force`: that kills every Ray process on the machine by name,
  other test runs' included;
- every wait returns on its event: a job state from the job API, a span at the receiver, a
  process gone from /proc. Each also has a backstop deadline (minutes) so that a hung run
  fails instead of hanging; a merely slow one (a loaded 2-core box) only waits longer. No
  step assumes that something has happened after a fixed time.

Test-only overrides, the only differences from a user's run: cluster/runtime_env.yaml asks
Ray to `pip install` the uploaded working_dir into a fresh virtualenv; that builds the
package with build isolation, i.e. downloads setuptools from an index (offline-unsafe, and
slow on a 2-core CI box). A `ray` shim on PATH drops that `pip` field from the runtime env
that submit.sh built (everything else is kept and checked) and adds MEMRA_CACHE_DIR and a
longer MEMRA_FLUSH_TIMEOUT_S; the job then imports memra_dist from the uploaded
working_dir, which Ray puts first on the driver's and every worker's sys.path.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from otlp_receiver import OTLPReceiver
from ports import free_ports as _free_ports

ROOT = Path(__file__).resolve().parents[1]
SUBMIT = ROOT / "cluster" / "submit.sh"
MARKER = "RJTEST_RAY_CLUSTER_ID"  # in the env of every process of the test's head
START_TIMEOUT_S = 300
# Backstops only: every wait below returns on its event (a job state, a span, a log line), so
# these bound a hung run, not a slow one. Alone on 2 cores the build takes ~25 s and a job
# ~20 s; with the rest of the suite beside them, many times that.
BUILD_TIMEOUT_S = 900
JOB_TIMEOUT_S = 900
CLI_TIMEOUT_S = 300  # backstop for one `ray` CLI call (seconds alone)
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
# the job's span flush at exit, bounded by MEMRA_FLUSH_TIMEOUT_S (5 s by default): a loaded
# machine can need longer to encode and send the spans, so the test's jobs get 10 s (the
# actors' flush + the driver's traces and metrics flushes still fit inside the 45 s that
# cluster/runtime_env.yaml gives `ray job stop` before Ray's SIGKILL)
JOB_FLUSH_TIMEOUT_S = "10"
ROLES = {"driver", "stage", "head"}

pytestmark = [pytest.mark.slow,  # a Ray head and `ray job submit`: minutes on 2 cores
              pytest.mark.skipif(shutil.which("ray") is None, reason="the `ray` CLI is not on PATH")]




def _marked_pids(marker_value: str) -> list[int]:
    want = f"{MARKER}={marker_value}".encode()
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    pids.append(int(d))
        except OSError:  # gone, or not ours
            continue
    return pids


def _kill_cluster(marker_value: str, timeout: float = 20.0) -> list[int]:
    """SIGKILL every process of this head (by pid, repeatedly: a dying raylet may still spawn
    a worker); returns the pids still alive at the end (empty when all are gone)."""
    end = time.monotonic() + timeout
    while True:
        pids = _marked_pids(marker_value)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if not pids or time.monotonic() > end:
            return pids
        time.sleep(0.3)
        try:  # reap zombies that are our own children (none expected: ray start daemonizes)
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass


def _clean_env(**extra) -> dict:
    """os.environ without any Ray address/auth or OTEL/MEMRA settings of the outer shell."""
    drop = ("RAY_", "OTEL_", "MEMRA_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


SHIM = """#!{python}
# test-only `ray` shim (tests/test_job_submit.py): records the runtime env submit.sh built,
# drops its `pip` field (an offline-unsafe package build) and adds MEMRA_CACHE_DIR and
# MEMRA_FLUSH_TIMEOUT_S, then runs the real `ray` with the same arguments.
import json, os, sys
args = sys.argv[1:]
if args[:2] == ["job", "submit"] and "--runtime-env" in args:
    i = args.index("--runtime-env") + 1
    with open(args[i]) as f:
        env = json.load(f)
    with open({record!r}, "w") as f:
        json.dump(env, f)
    env.pop("pip", None)
    env.setdefault("env_vars", {{}})["MEMRA_CACHE_DIR"] = {cache!r}
    env["env_vars"]["MEMRA_FLUSH_TIMEOUT_S"] = {flush!r}
    with open({override!r}, "w") as f:
        json.dump(env, f)
    args[i] = {override!r}
os.execv({real!r}, [{real!r}, *args])
"""


def test_driver_runtime_env_merges_with_the_jobs(monkeypatch):
    """Inside a submitted job, ray.init refuses a runtime env that repeats a field or an env var
    of the job's (cluster/runtime_env.yaml): the driver adds only what the job's lacks."""
    from ray.runtime_env.runtime_env import _merge_runtime_env

    from memra_dist.pipeline.driver import _runtime_env

    job_rt = {"worker_process_setup_hook": "memra_dist.pipeline.setup_hook.setup",
              "env_vars": {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "MEMRA_CACHE_DIR": "/c"}}
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317")
    monkeypatch.setenv("MEMRA_CACHE_DIR", "/c")
    monkeypatch.setenv("MEMRA_SPEC_TRACE", "2")
    alone = _runtime_env()
    assert alone["worker_process_setup_hook"] == "memra_dist.pipeline.setup_hook.setup"
    assert alone["env_vars"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://c:4317"
    assert _merge_runtime_env(job_rt, alone) is None  # what failed before
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": job_rt}))
    merged = _merge_runtime_env(job_rt, _runtime_env())
    assert merged is not None
    assert merged["worker_process_setup_hook"] == "memra_dist.pipeline.setup_hook.setup"
    assert merged["env_vars"]["MEMRA_SPEC_TRACE"] == "2"
    assert merged["env_vars"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://c:4317"


@dataclass
class Head:
    """The Ray head this module's tests share (started once: ~10-20 s of the budget)."""

    tag: str  # the value of MARKER in every process of this head
    address: str  # the job API (dashboard), 127.0.0.1 only
    token_file: Path
    real_ray: str
    cache: Path
    shim_dir: Path
    record: Path  # the runtime env submit.sh built for the latest submission (before the shim's override)
    build: subprocess.Popen
    build_log: Path
    temp_dir: Path

    def job_log(self, sub_id: str, supervisor: bool = False) -> str:
        """The tail of the job's driver log (or its supervisor's log) on the head."""
        name = f"jobs/supervisor-{sub_id}.log" if supervisor else f"job-driver-{sub_id}.log"
        logs = sorted(self.temp_dir.glob(f"session_*/logs/{name}"))
        return logs[-1].read_text(errors="replace")[-4000:] if logs else f"(no {name})"

    def checkpoints(self) -> None:
        """Wait for the demo's checkpoints (built while the head started)."""
        assert self.build.wait(timeout=BUILD_TIMEOUT_S) == 0, self.build_log.read_text()[-3000:]

    def job_env(self, rx: OTLPReceiver, sub_id: str, *submit_args: str) -> dict:
        """The submitting shell of cluster/submit.sh: address, token file, OTEL_* to `rx`."""
        return _clean_env(
            RAY_ADDRESS=self.address, RAY_AUTH_TOKEN_PATH=str(self.token_file), **rx.env(),
            OTEL_SERVICE_NAME="memra-dist", RAY_SUBMIT_ARGS=" ".join(["--submission-id", sub_id, *submit_args]),
            PATH=f"{self.shim_dir}{os.pathsep}{os.environ.get('PATH', '')}")

    def auth_env(self) -> dict:
        """What submit.sh gives the ray CLI: token auth, the token file."""
        return _clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_file))

    def job_status(self, sub_id: str) -> str:
        """GET /api/jobs/<id> of the job API, with the token (a plain HTTP call: no ray import)."""
        req = urllib.request.Request(f"{self.address}/api/jobs/{sub_id}",
                                     headers={"authorization": f"Bearer {self.token_file.read_text().strip()}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.load(r)["status"]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    base = tmp_path_factory.mktemp("rj")
    real_ray = shutil.which("ray")
    tag = secrets.token_hex(4)
    temp_dir = Path(tempfile.mkdtemp(prefix=f"rj-{tag}-", dir="/tmp"))  # short: socket paths
    token_file = temp_dir / "auth_token"
    token_file.write_text(secrets.token_hex(32))
    token_file.chmod(0o600)
    cache = base / "cache"

    # the demo's tiny checkpoints, built while the head starts (the jobs then only load them)
    build_log = base / "build.log"
    with open(build_log, "w") as log:
        build = subprocess.Popen(
            [sys.executable, "-c", "from memra_dist.demo.tiny import demo_checkpoints; demo_checkpoints()"],
            env=_clean_env(MEMRA_CACHE_DIR=str(cache), TOKENIZERS_PARALLELISM="false"),
            stdout=log, stderr=subprocess.STDOUT)

    gcs, dash, client, nm, om, mx, agent_grpc, agent_http, rt_agent = _free_ports(9)
    ray_env = _clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file),
                         RAY_USAGE_STATS_ENABLED="0", **{MARKER: tag})
    try:
        try:
            up = subprocess.run(
                [real_ray, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
                 "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
                 "--ray-client-server-port", str(client), "--node-manager-port", str(nm),
                 "--object-manager-port", str(om), "--metrics-export-port", str(mx),
                 "--dashboard-agent-grpc-port", str(agent_grpc), "--dashboard-agent-listen-port", str(agent_http),
                 "--runtime-env-agent-port", str(rt_agent),
                 "--num-cpus", "4", "--num-gpus", "0", "--temp-dir", str(temp_dir), "--disable-usage-stats"],
                env=ray_env, capture_output=True, text=True, timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.skip(f"`ray start --head` did not finish in {START_TIMEOUT_S}s on this machine")
        if up.returncode != 0:
            # `ray start` runs none of memra_dist's code: its failures are the machine's (ports,
            # /dev/shm, sockets, sandbox limits)
            pytest.skip(f"`ray start --head` failed here (environment): {(up.stdout + up.stderr)[-1500:]}")

        shim_dir = base / "shim"
        shim_dir.mkdir()
        record, override = base / "runtime_env.submitted.json", base / "runtime_env.used.json"
        shim = shim_dir / "ray"
        shim.write_text(SHIM.format(python=sys.executable, record=str(record), override=str(override),
                                    cache=str(cache), flush=JOB_FLUSH_TIMEOUT_S, real=real_ray))
        shim.chmod(0o755)
        yield Head(tag=tag, address=f"http://127.0.0.1:{dash}", token_file=token_file, real_ray=real_ray,
                   cache=cache, shim_dir=shim_dir, record=record, build=build, build_log=build_log,
                   temp_dir=temp_dir)
    finally:
        if build.poll() is None:
            build.kill()
            build.wait(timeout=10)
        left = _kill_cluster(tag)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"Ray processes of the test's head still alive: {left}"


def test_ray_job_submit_demo_pp2_spans_in_one_trace(ray_head, tmp_path):
    t_start = time.monotonic()
    head = ray_head
    address, real_ray = head.address, head.real_ray
    # token auth is ON: the job API refuses a wrong token
    wrong = subprocess.run([real_ray, "job", "list", "--address", address],
                           env=_clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32)),
                           capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    said = wrong.stdout + wrong.stderr
    assert wrong.returncode != 0 and "Invalid authentication token" in said, said[-2000:]

    head.checkpoints()

    sub_id = f"memra-test-{head.tag}"
    with OTLPReceiver() as rx:
        job_env = head.job_env(rx, sub_id)
        try:
            job = subprocess.run(["bash", str(SUBMIT), "demo", "--pp", "2", "--max-new-tokens", "16"],
                                 cwd=str(tmp_path), env=job_env, capture_output=True, text=True,
                                 timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"the job did not finish in {JOB_TIMEOUT_S}s: {str(e.stdout)[-3000:]}")
        out = job.stdout + job.stderr
        assert job.returncode == 0, out[-5000:]

        # the job's status from the job API itself (a subprocess: Ray caches the token per process)
        status = subprocess.run(
            [sys.executable, "-c", "import sys; from ray.job_submission import JobSubmissionClient as C; "
             "print(C(sys.argv[1]).get_job_status(sys.argv[2]).value)", address, sub_id],
            env=head.auth_env(), capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
        assert status.stdout.strip().splitlines()[-1:] == ["SUCCEEDED"], (status.stdout + status.stderr)[-2000:]

        def one_trace_all_roles(spans):
            by_trace: dict[str, set] = {}
            for s in spans:
                by_trace.setdefault(s.trace_id, set()).add(s.resource.get("memra.role"))
            return any(ROLES <= roles for roles in by_trace.values())

        # the job has ended: its driver and actors flushed (or dropped) their spans before
        # exiting, so what is not here by now is not coming; the wait covers the receiver only
        spans = rx.wait_for_spans(one_trace_all_roles, timeout=60)

    # what submit.sh built from cluster/runtime_env.yaml (before the shim's override)
    submitted = json.loads(head.record.read_text())
    assert Path(submitted["working_dir"]).resolve() == ROOT
    assert submitted["worker_process_setup_hook"] == "memra_dist.pipeline.setup_hook.setup"
    assert submitted["pip"]["packages"] == ["${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}"]
    assert submitted["env_vars"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == rx.endpoint
    # the token never travels in the runtime env
    assert not any(k.startswith("RAY_AUTH") for k in submitted["env_vars"])
    assert head.token_file.read_text() not in json.dumps(submitted)

    # the run's spans: driver + head + stage, in ONE trace, under the driver's request span
    roles_by_trace: dict[str, set] = {}
    for s in spans:
        roles_by_trace.setdefault(s.trace_id, set()).add(s.resource.get("memra.role"))
    full = [t for t, r in roles_by_trace.items() if ROLES <= r]
    assert full, f"no trace with spans from {sorted(ROLES)}: {roles_by_trace}"
    trace = [s for s in spans if s.trace_id == full[0]]
    names = {s.name for s in trace}
    assert "memra.request" in names, sorted(names)
    root = [s for s in trace if s.name == "memra.request"]
    assert len(root) == 1 and root[0].resource.get("memra.role") == "driver"
    pids = {(s.resource.get("memra.role"), s.resource.get("process.pid")) for s in trace}
    assert len({p for _, p in pids}) >= 3, pids  # three processes: the job's driver and two actors
    ids = {s.span_id for s in trace}
    orphans = [s.name for s in trace if s.parent_span_id and s.parent_span_id not in ids]
    assert not orphans, orphans
    print(f"job submitted, run and traced in {time.monotonic() - t_start:.1f}s")


GONE_BOUND_S = 120  # backstop: STOPPED -> no process of the job left (seconds alone)
JOB_PROCS = ("memra_dist.cli", "ray::HeadWorker", "ray::StageWorker", "ray::JobSupervisor")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _job_processes(tag: str) -> dict[int, str]:
    """The job's processes on this head: its driver (and the shell Ray runs it under), its
    actors and its supervisor, found by the head's marker and their command lines (Ray sets
    a worker's title to ray::Class.method)."""
    procs = {pid: _cmdline(pid) for pid in _marked_pids(tag)}
    return {pid: c for pid, c in procs.items() if any(k in c for k in JOB_PROCS)}


def _wait_status(head: Head, sub_id: str, want: set[str], timeout: float) -> str:
    end = time.monotonic() + timeout
    while True:
        status = head.job_status(sub_id)
        if status in want or time.monotonic() > end:
            return status
        time.sleep(0.2)


def _wait_spans_while_running(head: Head, sub_id: str, rx: OTLPReceiver, done, timeout: float):
    """(spans, job status) once `done(spans)` holds, or as soon as the job has ended without it
    (it never will then), or at the backstop deadline."""
    end = time.monotonic() + timeout
    while True:
        spans = rx.snapshot()
        if done(spans):
            return spans, head.job_status(sub_id)
        status = head.job_status(sub_id)
        if status in TERMINAL or time.monotonic() > end:
            return rx.snapshot(), status
        time.sleep(0.2)


def test_ray_job_stop_flushes_spans_and_leaves_no_process(ray_head, tmp_path):
    """`ray job stop` of a submitted `demo --pp 2` mid-request: Ray SIGTERMs the entrypoint,
    the CLI's handler unwinds through the same flush-and-teardown path as Ctrl-C (actors
    closed and killed, spans flushed), the job is STOPPED, no process of it is left, and the
    cluster runs the next job."""
    t_start = time.monotonic()
    head = ray_head
    head.checkpoints()
    sub_id = f"memra-stop-{head.tag}"
    with OTLPReceiver() as rx:
        # ~1900 plain-decoding rounds (~30 s at pp=1 alone on 2 cores, longer at pp=2), a burst
        # every 2 rounds: bursts (with their spans) from the first second of generation
        sub = subprocess.run(["bash", str(SUBMIT), "demo", "--pp", "2", "--max-new-tokens", "1900",
                              "--drafter", "none", "--burst-rounds", "2", "--trace-level", "1"],
                             cwd=str(tmp_path), env=head.job_env(rx, sub_id, "--no-wait"),
                             capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
        assert sub.returncode == 0, (sub.stdout + sub.stderr)[-3000:]
        status = _wait_status(head, sub_id, {"RUNNING"} | TERMINAL, JOB_TIMEOUT_S)
        assert status == "RUNNING", (status, head.job_log(sub_id))

        def head_burst(spans):
            return any(s.name == "spec.burst" and s.resource.get("memra.role") == "head" for s in spans)

        # mid-request = the head has finished a burst and its spans have arrived: wait for
        # exactly that (the job's start-up, actors and first rounds take as long as they take)
        spans, status = _wait_spans_while_running(head, sub_id, rx, head_burst, JOB_TIMEOUT_S)
        assert head_burst(spans), (f"no spec.burst span from the head; job {status}", head.job_log(sub_id))
        assert status == "RUNNING", (status, head.job_log(sub_id))  # mid-request
        assert not any(s.name == "memra.request" for s in rx.snapshot())  # the request span is still open
        during = _job_processes(head.tag)
        kinds = " ".join(during.values())
        assert "memra_dist.cli" in kinds and "ray::HeadWorker" in kinds and "ray::StageWorker" in kinds, during

        t0 = time.monotonic()
        stop = subprocess.run([head.real_ray, "job", "stop", "--address", head.address, sub_id],
                              env=head.auth_env(), capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
        assert stop.returncode == 0, (stop.stdout + stop.stderr)[-3000:]
        # `ray job stop` waits for a final state itself; the job API says which one it is
        status = _wait_status(head, sub_id, TERMINAL, JOB_TIMEOUT_S)
        took_stop = time.monotonic() - t0
        log = head.job_log(sub_id)
        assert status == "STOPPED", (status, log)

        # the driver's request span, flushed by the SIGTERM path (not by a normal end: ERROR)
        def request_span(spans):
            return [s for s in spans if s.name == "memra.request" and s.resource.get("memra.role") == "driver"]

        req = request_span(rx.wait_for_spans(lambda s: bool(request_span(s)), timeout=60))
        assert len(req) == 1, ([s.name for s in rx.snapshot()], log)
        assert req[0].status_code == 2 and req[0].status_message == "KeyboardInterrupt", (req[0], log)
        assert req[0].trace_id in {s.trace_id for s in rx.snapshot() if s.resource.get("memra.role") == "head"}
        # the driver ran its flush-and-teardown to the end inside Ray's grace window (the
        # bound on the stop); Ray did not have to SIGKILL it
        sup = head.job_log(sub_id, supervisor=True)
        assert "memra-dist: interrupted" in log, log
        assert "terminated gracefully" in sup and "SIGKILL" not in sup, sup
        print(f"ray job stop -> STOPPED in {took_stop:.1f}s; memra.request status "
              f"{req[0].status_code} {req[0].status_message!r}")

    # no driver, shell or actor process of the job is left (the ones seen mid-run included)
    end = time.monotonic() + GONE_BOUND_S
    while True:
        left = _job_processes(head.tag)
        left.update({p: c for p, c in during.items() if _cmdline(p) == c})
        if not left or time.monotonic() > end:
            break
        time.sleep(0.2)
    assert not left, left
    print(f"job processes gone {time.monotonic() - t0:.1f}s after `ray job stop`")

    # the cluster still runs a job
    with OTLPReceiver() as rx:
        again = subprocess.run(["bash", str(SUBMIT), "demo", "--pp", "2", "--max-new-tokens", "4",
                                "--trace-level", "0"],
                               cwd=str(tmp_path), env=head.job_env(rx, f"{sub_id}-again"),
                               capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert head.job_status(f"{sub_id}-again") == "SUCCEEDED"
    print(f"stop test done in {time.monotonic() - t_start:.1f}s")
