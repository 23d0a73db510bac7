"""End to end on CPU: a real Ray head on this machine (token authentication ON), `ray job
submit` of `memra-dist demo --pp 2` through cluster/submit.sh with cluster/runtime_env.yaml,
the job reaches SUCCEEDED, and an in-test OTLP/gRPC receiver gets the run's spans from the
driver AND the head and stage actors, in one trace.

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
- every subprocess has a timeout: about a minute alone on 2 cores, at most ~10 minutes
  when the machine is saturated.

Test-only override, the one difference from a user's run: cluster/runtime_env.yaml asks Ray
to `pip install` the uploaded working_dir into a fresh virtualenv; that builds the package
with build isolation, i.e. downloads setuptools from an index (offline-unsafe, and slow on a
2-core CI box). A `ray` shim on PATH drops that `pip` field from the runtime env that
submit.sh built (everything else is kept and checked) and adds MEMRA_CACHE_DIR; the job then
imports memra_dist from the uploaded working_dir, which Ray puts first on the driver's and
every worker's sys.path.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from otlp_receiver import OTLPReceiver

ROOT = Path(__file__).resolve().parents[1]
SUBMIT = ROOT / "cluster" / "submit.sh"
MARKER = "RJTEST_RAY_CLUSTER_ID"  # in the env of every process of the test's head
START_TIMEOUT_S = 90
BUILD_TIMEOUT_S = 300  # ~25 s alone on 2 cores; minutes when the rest of the suite runs beside it
JOB_TIMEOUT_S = 300  # ~20 s alone
ROLES = {"driver", "stage", "head"}

pytestmark = pytest.mark.skipif(shutil.which("ray") is None, reason="the `ray` CLI is not on PATH")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


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
# drops its `pip` field (an offline-unsafe package build) and adds MEMRA_CACHE_DIR, then runs
# the real `ray` with the same arguments.
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
    with open({override!r}, "w") as f:
        json.dump(env, f)
    args[i] = {override!r}
os.execv({real!r}, [{real!r}, *args])
"""


def test_driver_runtime_env_merges_with_the_jobs(monkeypatch):
    """Inside a submitted job, ray.init refuses a runtime env that repeats a field or an env var
    of the job's (cluster/runtime_env.yaml): the driver adds only what the job's lacks."""
    from ray.runtime_env.runtime_env import _merge_runtime_env

    from memra_dist.dist.engine import _runtime_env

    job_rt = {"worker_process_setup_hook": "memra_dist.dist.setup_hook.setup",
              "env_vars": {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "MEMRA_CACHE_DIR": "/c"}}
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317")
    monkeypatch.setenv("MEMRA_CACHE_DIR", "/c")
    monkeypatch.setenv("MEMRA_SPEC_TRACE", "2")
    alone = _runtime_env()
    assert alone["worker_process_setup_hook"] == "memra_dist.dist.setup_hook.setup"
    assert alone["env_vars"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://c:4317"
    assert _merge_runtime_env(job_rt, alone) is None  # what failed before
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": job_rt}))
    merged = _merge_runtime_env(job_rt, _runtime_env())
    assert merged is not None
    assert merged["worker_process_setup_hook"] == "memra_dist.dist.setup_hook.setup"
    assert merged["env_vars"]["MEMRA_SPEC_TRACE"] == "2"
    assert merged["env_vars"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://c:4317"


def test_ray_job_submit_demo_pp2_spans_in_one_trace(tmp_path):
    t_start = time.monotonic()
    real_ray = shutil.which("ray")
    tag = secrets.token_hex(4)
    temp_dir = Path(tempfile.mkdtemp(prefix=f"rj-{tag}-", dir="/tmp"))  # short: socket paths
    token_file = temp_dir / "auth_token"
    token_file.write_text(secrets.token_hex(32))
    token_file.chmod(0o600)
    cache = tmp_path / "cache"

    # the demo's tiny checkpoints, built while the head starts (the job then only loads them)
    build_log = tmp_path / "build.log"
    with open(build_log, "w") as log:
        build = subprocess.Popen(
            [sys.executable, "-c", "from memra_dist.model.tiny import demo_checkpoints; demo_checkpoints()"],
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

        address = f"http://127.0.0.1:{dash}"
        # token auth is ON: the job API refuses a wrong token
        wrong = subprocess.run([real_ray, "job", "list", "--address", address],
                               env=_clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32)),
                               capture_output=True, text=True, timeout=60)
        said = wrong.stdout + wrong.stderr
        assert wrong.returncode != 0 and "Invalid authentication token" in said, said[-2000:]

        assert build.wait(timeout=BUILD_TIMEOUT_S) == 0, build_log.read_text()[-3000:]

        shim_dir = tmp_path / "shim"
        shim_dir.mkdir()
        record, override = tmp_path / "runtime_env.submitted.json", tmp_path / "runtime_env.used.json"
        shim = shim_dir / "ray"
        shim.write_text(SHIM.format(python=sys.executable, record=str(record), override=str(override),
                                    cache=str(cache), real=real_ray))
        shim.chmod(0o755)

        sub_id = f"memra-test-{tag}"
        with OTLPReceiver() as rx:
            job_env = _clean_env(
                RAY_ADDRESS=address, RAY_AUTH_TOKEN_PATH=str(token_file), **rx.env(),
                OTEL_SERVICE_NAME="memra-dist", RAY_SUBMIT_ARGS=f"--submission-id {sub_id}",
                PATH=f"{shim_dir}{os.pathsep}{os.environ.get('PATH', '')}")
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
                env=_clean_env(RAY_AUTH_TOKEN_PATH=str(token_file), RAY_AUTH_MODE="token"),
                capture_output=True, text=True, timeout=60)
            assert status.stdout.strip().splitlines()[-1:] == ["SUCCEEDED"], (status.stdout + status.stderr)[-2000:]

            def one_trace_all_roles(spans):
                by_trace: dict[str, set] = {}
                for s in spans:
                    by_trace.setdefault(s.trace_id, set()).add(s.resource.get("memra.role"))
                return any(ROLES <= roles for roles in by_trace.values())

            spans = rx.wait_for_spans(one_trace_all_roles, timeout=30)

        # what submit.sh built from cluster/runtime_env.yaml (before the shim's override)
        submitted = json.loads(record.read_text())
        assert Path(submitted["working_dir"]).resolve() == ROOT
        assert submitted["worker_process_setup_hook"] == "memra_dist.dist.setup_hook.setup"
        assert submitted["pip"]["packages"] == ["${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}"]
        assert submitted["env_vars"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == rx.endpoint
        # the token never travels in the runtime env
        assert not any(k.startswith("RAY_AUTH") for k in submitted["env_vars"])
        assert token_file.read_text() not in json.dumps(submitted)

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
        assert time.monotonic() - t_start < 600
    finally:
        if build.poll() is None:
            build.kill()
            build.wait(timeout=10)
        left = _kill_cluster(tag)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"Ray processes of the test's head still alive: {left}"
