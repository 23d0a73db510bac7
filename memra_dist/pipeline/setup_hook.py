"""Ray `worker_process_setup_hook` (runtime_env): runs once in every worker process before
any actor of ours, on every node, whether Ray was started here or joined. It prepares the
process for tracing; each actor then builds its own TracerProvider for its role from the
same OTEL_* settings (the runtime env's env_vars), see pipeline/actor_tracing.py."""

from __future__ import annotations

import os

HOOK = "memra_dist.pipeline.setup_hook.setup"


def setup() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OTEL_SERVICE_NAME", "memra-dist")
    # W3C trace context is the propagation format; the driver injects it into every command
    os.environ.setdefault("OTEL_PROPAGATORS", "tracecontext")
