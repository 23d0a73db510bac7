"""The cluster files: launcher YAML against Ray's own schema, the KubeRay RayJob's and
RayService's structure, the runtime env and submit script, the compose stack's bindings, and
Ray token auth never off."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from memra_dist.tracing.conventions import SPANMETRICS_NAMESPACE

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "cluster"
OBS = CLUSTER / "observability"


def _yaml(p: Path):
    return yaml.safe_load(p.read_text())


# ---- cluster launcher ----

def test_cluster_yaml_validates_against_rays_schema():
    jsonschema = pytest.importorskip("jsonschema")
    import ray

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    cfg = _yaml(CLUSTER / "cluster.yaml")
    jsonschema.validate(cfg, schema)
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    gpu_groups = [n for n, t in types.items() if t["resources"].get("GPU", 0) > 0 and n != cfg["head_node_type"]]
    assert gpu_groups, "a GPU worker group"
    starts = cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if "ray start" in c)
    assert any("--head" in c and "--dashboard-host=127.0.0.1" in c for c in starts)


# ---- runtime env and submit script ----

def test_runtime_env_installs_the_package_and_sets_the_hook():
    from ray.runtime_env import RuntimeEnv

    from memra_dist.pipeline.setup_hook import HOOK

    env = _yaml(CLUSTER / "runtime_env.yaml")
    RuntimeEnv(**env)  # Ray's own validation of the fields
    assert env["worker_process_setup_hook"] == HOOK
    assert env["pip"]["packages"] == ["${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}"]
    assert env["working_dir"] == "."
    assert any(k.startswith("OTEL_") for k in env["env_vars"])
    for secret in (".env", "*.pem", "*.key", ".netrc", ".ray", "auth_token", ".git"):
        assert secret in env["excludes"]
    assert not any(re.search(r"RAY_AUTH|_TOKEN$|SECRET|PASSWORD|HEADERS", k) for k in env["env_vars"])


def _submit(tmp_path, extra_env):
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **extra_env}
    return subprocess.run(["bash", str(CLUSTER / "submit.sh")], env=env, capture_output=True, text=True, timeout=60)


def test_submit_refuses_without_a_token(tmp_path):
    r = _submit(tmp_path, {})
    assert r.returncode == 2
    assert "RAY_AUTH_TOKEN" in r.stderr


def test_submit_passes_otel_and_runs_the_cli(tmp_path):
    """A fake `ray` on PATH records the command and the runtime env file it was given."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ray").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$HOME/args"\n'
                              'while [ $# -gt 0 ]; do [ "$1" = --runtime-env ] && cp "$2" "$HOME/env.json"; shift; done\n'
                              'echo "$RAY_AUTH_MODE" > "$HOME/mode"\n')
    (fake / "ray").chmod(0o755)
    env = {"PATH": f"{fake}:{os.environ['PATH']}", "RAY_AUTH_TOKEN": "t0k3n",
           "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_SERVICE_NAME": "svc"}
    r = _submit(tmp_path, env)
    assert r.returncode == 0, r.stderr
    args = (tmp_path / "args").read_text().split("\n")
    assert args[:1] == ["job"] and "submit" in args
    assert args[args.index("--") + 1:][:6] == ["python", "-m", "memra_dist.cli", "demo", "--pp", "2"]
    renv = json.loads((tmp_path / "env.json").read_text())
    assert renv["working_dir"] == str(ROOT)
    assert renv["env_vars"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4317"
    assert renv["env_vars"]["OTEL_SERVICE_NAME"] == "svc"
    assert "t0k3n" not in (tmp_path / "env.json").read_text()  # the token never rides along
    assert (tmp_path / "mode").read_text().strip() == "token"


# ---- KubeRay ----

def test_rayjob_structure():
    job = _yaml(CLUSTER / "kuberay" / "rayjob.yaml")
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    assert re.search(r"memra_dist\.cli (demo|generate)\b.*--pp 2", spec["entrypoint"])
    rc = spec["rayClusterSpec"]
    assert rc["authOptions"]["mode"] == "token"
    assert rc["rayVersion"].startswith("2.")
    head = rc["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})
    groups = rc["workerGroupSpecs"]
    assert groups
    gpus = 0
    for g in groups:
        c = g["template"]["spec"]["containers"][0]
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        gpus += int(c["resources"]["limits"]["nvidia.com/gpu"]) * g["replicas"]
    assert gpus >= 2, "--pp 2 needs two GPUs"
    renv = yaml.safe_load(spec["runtimeEnvYAML"])
    from memra_dist.pipeline.setup_hook import HOOK

    assert renv["worker_process_setup_hook"] == HOOK
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in renv["env_vars"]


def test_rayservice_structure():
    """The RayService: Ray's own schema for its Serve config, the import path builds the
    application from its args (memra-dist serve's flags), token auth on, a GPU group, the
    serve port on the head, spans to the collector, the image installs the serve extra."""
    from ray.serve.schema import ServeDeploySchema

    from memra_dist.cli import _add_run_args
    from memra_dist.serve.entry import app_builder
    from memra_dist.serve.serve_cli import parse_serve_argv, spec_argv

    svc = _yaml(CLUSTER / "kuberay" / "rayservice.yaml")
    assert svc["apiVersion"] == "ray.io/v1" and svc["kind"] == "RayService"
    spec = svc["spec"]
    serve_cfg = ServeDeploySchema(**yaml.safe_load(spec["serveConfigV2"]))  # Ray's validation of the fields
    (app,) = serve_cfg.applications
    assert app.import_path == "memra_dist.serve.entry:app_builder" and app.route_prefix == "/"
    args = parse_serve_argv(spec_argv(app.args), _add_run_args)
    assert args.model.startswith("/") and args.max_queue >= 1
    from ray.serve.deployment import Application

    assert isinstance(app_builder(app.args), Application)
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in app.runtime_env["env_vars"]
    rc = spec["rayClusterConfig"]
    assert rc["authOptions"]["mode"] == "token"
    assert rc["rayVersion"] == _yaml(CLUSTER / "kuberay" / "rayjob.yaml")["spec"]["rayClusterSpec"]["rayVersion"]
    head = rc["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert serve_cfg.http_options.port in [p["containerPort"] for p in head["ports"]]
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})
    gpus = sum(int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) * g["replicas"]
               for g in rc["workerGroupSpecs"])
    assert gpus >= args.pp, "a GPU per pipeline stage (pp 1: the replica's)"
    model_dir = args.model.rsplit("/", 1)[0]
    for pod in (rc["headGroupSpec"], *rc["workerGroupSpecs"]):
        c = pod["template"]["spec"]["containers"][0]
        assert c["image"] == head["image"]
        assert any(m["mountPath"] == model_dir for m in c.get("volumeMounts", [])), "the checkpoint on every node"
    assert "memra_dist[serve]" in (CLUSTER / "kuberay" / "Dockerfile").read_text()


# ---- compose stack ----

SERVICES = {"otel-collector", "jaeger", "tempo", "prometheus", "grafana"}


def _compose():
    return _yaml(OBS / "docker-compose.yml")


def test_compose_services_and_pinned_images():
    svcs = _compose()["services"]
    assert SERVICES <= set(svcs)
    for name, s in svcs.items():
        image = s["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and re.search(r"\d", tag), f"{name}: image {image} not pinned"


def test_compose_binds_every_published_port_to_loopback():
    published = 0
    for name, s in _compose()["services"].items():
        assert s.get("network_mode") != "host", name
        for p in s.get("ports", []):
            published += 1
            spec = p if isinstance(p, str) else f"{p.get('host_ip', '')}:{p.get('published')}:{p.get('target')}"
            assert spec.startswith("127.0.0.1:"), f"{name}: port {p} not bound to 127.0.0.1"
    assert published >= 5


def test_compose_mounts_exist_and_grafana_provisions_the_dashboards():
    svcs = _compose()["services"]
    checked = 0
    for name, s in svcs.items():
        for v in s.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith((".", "/")):
                assert (OBS / src).exists(), f"{name}: mount source {src} missing"
                checked += 1
    assert checked, "no bind mount checked: the compose file mounts no host path"
    graf = " ".join(svcs["grafana"]["volumes"])
    assert "../../dashboards:/var/lib/grafana/dashboards" in graf
    prov = _yaml(OBS / "grafana/provisioning/dashboards/dashboards.yaml")
    assert prov["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert list((ROOT / "dashboards").glob("*.json"))
    env = svcs["grafana"].get("environment", {})
    assert str(env.get("GF_AUTH_ANONYMOUS_ENABLED", "false")).lower() == "false"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env  # only Grafana's documented local admin


def test_collector_pipelines():
    col = _yaml(OBS / "otel-collector.yaml")
    assert col["connectors"]["spanmetrics"]["namespace"] == SPANMETRICS_NAMESPACE
    assert col["connectors"]["spanmetrics"]["exemplars"]["enabled"] is True
    pipes = col["service"]["pipelines"]
    assert set(pipes["traces"]["exporters"]) >= {"otlp/jaeger", "otlp/tempo", "spanmetrics"}
    assert "spanmetrics" in pipes["metrics"]["receivers"] and "prometheus" in pipes["metrics"]["exporters"]
    assert col["exporters"]["otlp/jaeger"]["endpoint"].startswith("jaeger:")
    assert col["exporters"]["otlp/tempo"]["endpoint"].startswith("tempo:")
    port = col["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    prom = _yaml(OBS / "prometheus.yml")
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert f"otel-collector:{port}" in targets


def test_grafana_datasource_uids_match_the_dashboard():
    ds = {d["uid"]: d for d in _yaml(OBS / "grafana/provisioning/datasources/datasources.yaml")["datasources"]}
    assert {"prometheus", "tempo", "jaeger"} <= set(ds)
    assert ds["prometheus"]["jsonData"]["exemplarTraceIdDestinations"][0]["datasourceUid"] == "tempo"
    dash = json.loads((ROOT / "dashboards" / "memra-spec.json").read_text())
    used = {p["datasource"]["uid"] for p in dash["panels"]} | {
        t["datasource"]["uid"] for p in dash["panels"] for t in p["targets"]}
    assert used <= set(ds)


# ---- Ray token auth stays on, everywhere ----

_OFF = re.compile(r"RAY_AUTH_MODE['\"]?\s*[:=]\s*['\"]?disabled|auth[_-]?mode['\"]?\s*[:=]\s*['\"]?disabled"
                  r"|authOptions:\s*\{?\s*mode:\s*['\"]?disabled", re.I)


def _repo_files():
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    for rel in out.stdout.splitlines():
        p = ROOT / rel
        if p.is_file() and p.stat().st_size < 2_000_000 and p.suffix not in (".safetensors", ".png", ".bin"):
            yield rel, p


def test_no_file_disables_ray_token_auth():
    offenders = []
    for rel, p in _repo_files():
        try:
            text = p.read_text(errors="ignore")
        except OSError:
            continue
        if _OFF.search(text):
            offenders.append(rel)
    assert offenders == [], f"these files turn Ray token auth off: {offenders}"


def test_the_guard_itself_catches_the_spellings():
    off = "dis" + "abled"  # spelled apart so this file does not trip its own guard
    for s in (f"RAY_AUTH_MODE={off}", f"RAY_AUTH_MODE: {off}", f'"RAY_AUTH_MODE": "{off}"',
              f"authOptions: {{mode: {off}}}", f"RAY_AUTH_MODE='{off}'", f"auth_mode = '{off}'"):
        assert _OFF.search(s), s
    assert not _OFF.search("RAY_AUTH_MODE=token")
