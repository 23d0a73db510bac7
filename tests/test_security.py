"""Nobody let in, nothing let out:

- OTLP over TLS with an auth header, through the standard OTEL_EXPORTER_OTLP_* variables only:
  a receiver that REQUIRES the header (and serves a self-signed certificate) gets the spans;
  without the header it refuses them and the run says how many were lost.
- Prompt and output text never reach span attributes (OTLP JSON, Perfetto) or metric
  labels unless --trace-content.
- The Ray runtime env carries OTEL_* and MEMRA_* only: no local credential rides along.
- No private keys or cloud tokens are committed.

Ray token authentication staying on in every file is tests/test_cluster_files.py's
test_no_file_disables_ray_token_auth (not repeated here)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import pytest
from otlp_receiver import OTLPReceiver
from test_cli_errors import run_main

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Zebra quartz wizard jumps"  # distinctive: a substring hit cannot be an accident
TOKEN = "s3cret-token-1f2e"


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MEMRA_", "RAY_ADDRESS", "TRACEPARENT"))}
    env["MEMRA_FLUSH_TIMEOUT_S"] = "2"
    env.update(extra)
    return env


def _generate(model, env, cwd, *flags):
    argv = [sys.executable, "-m", "memra_dist.cli", "generate", "--model", str(model), "--prompt", PROMPT,
            "--max-new-tokens", "12", "--device", "cpu", "--trace-level", "1", "--json", *flags]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


# ---- OTLP over TLS with a required auth header ---------------------------------------------


@pytest.fixture(scope="module")
def tls_cert(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (cert.pem, key.pem)."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (d / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return d / "cert.pem", d / "key.pem"


class TLSReceiver(OTLPReceiver):
    """The test receiver behind TLS (grpc ssl_server_credentials)."""

    def __init__(self, cert: Path, key: Path, **kw):
        super().__init__(**kw)
        self.cert, self.key = cert, key

    @property
    def endpoint(self) -> str:
        return f"https://{self.host}:{self.port}"

    def start(self) -> "TLSReceiver":
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        from otlp_receiver import _Servicer

        creds = grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self._server)
        self.port = self._server.add_secure_port(f"{self.host}:0", creds)
        self._server.start()
        return self


def _has_request(spans):
    return any(s.name == "memra.request" for s in spans)


@pytest.mark.slow  # a CLI subprocess run
def test_otlp_tls_with_required_auth_header(llama, tls_cert, tmp_path):
    cert, key = tls_cert
    with TLSReceiver(cert, key, required_headers={"authorization": f"Bearer {TOKEN}"}) as rx:
        env = _env(OTEL_EXPORTER_OTLP_ENDPOINT=rx.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
                   OTEL_EXPORTER_OTLP_CERTIFICATE=str(cert),
                   OTEL_EXPORTER_OTLP_HEADERS=f"authorization=Bearer%20{TOKEN}")  # W3C baggage-style encoding
        p = _generate(llama, env, tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
        spans = rx.wait_for_spans(_has_request, timeout=10)
        assert _has_request(spans), p.stderr[-2000:]
        assert rx.rejected == 0
        assert all(md.get("authorization") == f"Bearer {TOKEN}" for md in rx.metadata)
    assert "not delivered" not in p.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # a CLI subprocess run
def test_otlp_tls_without_the_header_is_refused_and_counted(llama, tls_cert, tmp_path):
    cert, key = tls_cert
    with TLSReceiver(cert, key, required_headers={"authorization": f"Bearer {TOKEN}"}) as rx:
        env = _env(OTEL_EXPORTER_OTLP_ENDPOINT=rx.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
                   OTEL_EXPORTER_OTLP_CERTIFICATE=str(cert))
        p = _generate(llama, env, tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
        assert rx.rejected >= 1 and rx.snapshot() == []
    lost = [ln for ln in p.stderr.splitlines() if "spans were not delivered" in ln]
    assert len(lost) == 1, p.stderr[-2000:]


@pytest.mark.slow  # a CLI subprocess run
def test_otlp_tls_with_an_untrusted_certificate_sends_nothing(llama, tls_cert, tmp_path):
    """No OTEL_EXPORTER_OTLP_CERTIFICATE: the system roots do not trust the self-signed cert,
    so the exporter never completes a handshake (no plaintext fallback)."""
    cert, key = tls_cert
    with TLSReceiver(cert, key) as rx:
        env = _env(OTEL_EXPORTER_OTLP_ENDPOINT=rx.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
        p = _generate(llama, env, tmp_path)
        assert p.returncode == 0, p.stderr[-2000:]
        assert rx.requests == 0 and rx.snapshot() == []
    assert len([ln for ln in p.stderr.splitlines() if "spans were not delivered" in ln]) == 1


# ---- prompt and output text stay out of telemetry -------------------------------------------


@pytest.fixture
def metric_capture(monkeypatch):
    """Every metric data point the run's MetricsSession records, read before it shuts down."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from memra_dist.tracing import metrics as m

    got = []

    def provider(role, port):
        reader = InMemoryMetricReader()
        got.append(reader)
        return MeterProvider(metric_readers=[reader]), None

    points = []
    real_close = m.MetricsSession.close

    def close(self, *a, **k):
        if self.provider is not None and got:
            data = got[-1].get_metrics_data()
            for rm in data.resource_metrics if data else ():
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        points.extend(dict(p.attributes) for p in metric.data.data_points)
        return real_close(self, *a, **k)

    monkeypatch.setattr(m, "make_meter_provider", provider)
    monkeypatch.setattr(m.MetricsSession, "close", close)
    return points


def _texts(run_dir: Path) -> str:
    return "\n".join(f.read_text() for f in sorted(run_dir.glob("*.json")))


@pytest.mark.parametrize("content", [False, True], ids=["default", "trace-content"])
def test_prompt_and_output_only_with_trace_content(llama, tmp_path, capsys, metric_capture, content):
    run_dir = tmp_path / "run"
    argv = ["generate", "--model", str(llama), "--prompt", PROMPT, "--max-new-tokens", "16", "--device", "cpu",
            "--trace-level", "2", "--json", "--run-dir", str(run_dir), *(["--trace-content"] if content else [])]
    rc, out, err = run_main(argv, capsys)
    assert rc == 0, err
    text = json.loads(out)["text"]
    assert len(text.strip()) >= 6, text  # long enough that a hit is not a coincidence
    exported = _texts(run_dir)
    assert "memra.request" in exported and "spec.verify" in exported
    assert (PROMPT in exported) is content
    assert (json.dumps(text)[1:-1] in exported) is content  # as JSON-escaped in the files
    assert metric_capture, "the run recorded no metrics"
    labels = json.dumps([{k: str(v) for k, v in p.items()} for p in metric_capture])
    assert PROMPT not in labels and text.strip() not in labels  # never metric labels, even with content


# ---- runtime env and repository contents ----------------------------------------------------


def test_runtime_env_passes_otel_and_memra_only(monkeypatch):
    from memra_dist.pipeline.driver import _runtime_env

    secrets = {"AWS_SECRET_ACCESS_KEY": "aws", "AWS_ACCESS_KEY_ID": "AKIA", "HF_TOKEN": "hf", "GITHUB_TOKEN": "gh",
               "RAY_AUTH_TOKEN": "ray", "RAY_AUTH_TOKEN_PATH": "/root/.ray/auth_token",
               "GOOGLE_APPLICATION_CREDENTIALS": "/k.json", "SSH_AUTH_SOCK": "/tmp/ssh", "HOME": "/root",
               "KUBECONFIG": "/root/.kube/config", "OPENAI_API_KEY": "sk"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20t")  # by design: actors export too
    monkeypatch.setenv("MEMRA_SPEC_TRACE", "1")
    env = _runtime_env()["env_vars"]
    assert all(k.startswith(("OTEL_", "MEMRA_")) for k in env), sorted(env)
    assert not set(secrets) & set(env)
    assert env["OTEL_EXPORTER_OTLP_HEADERS"] == "authorization=Bearer%20t"


def test_cluster_runtime_env_file_excludes_credentials():
    yaml = pytest.importorskip("yaml")
    renv = yaml.safe_load((ROOT / "cluster" / "runtime_env.yaml").read_text())
    plain = {"TOKENIZERS_PARALLELISM", "RAY_JOB_STOP_WAIT_TIME_S"}  # settings, not credentials
    assert all(k.startswith(("OTEL_", "MEMRA_")) or k in plain for k in renv.get("env_vars", {}))
    for must in (".env", "*.pem", "*.key", ".netrc", ".ray", "auth_token", ".git"):
        assert must in renv["excludes"], must


_SECRET = re.compile(
    r"-----BEGIN (?:RSA |EC |OPENSSH |DSA )?PRIVATE KEY-----"
    r"|\bAKIA[0-9A-Z]{16}\b"
    r"|\bgh[pousr]_[A-Za-z0-9]{36}\b"
    r"|\bhf_[A-Za-z0-9]{34}\b"
    r"|\bxox[abpr]-[A-Za-z0-9-]{10,}"
    r"|\bsk-[A-Za-z0-9]{32,}")


def test_no_secrets_committed():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    hits = []
    for rel in out.stdout.splitlines():
        p = ROOT / rel
        if not p.is_file() or p.stat().st_size > 2_000_000 or p.suffix in (".safetensors", ".png", ".bin"):
            continue
        if _SECRET.search(p.read_text(errors="ignore")):
            hits.append(rel)
    assert hits == [], hits


def test_the_secret_guard_catches_the_shapes():
    for s in ("-----BEGIN " + "PRIVATE KEY-----", "AKIA" + "ABCDEFGHIJKLMNOP", "ghp_" + "a" * 36, "hf_" + "b" * 34):
        assert _SECRET.search(s), s
    assert not _SECRET.search("OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer%20t")
