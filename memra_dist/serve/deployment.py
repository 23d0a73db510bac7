"""The Ray Serve deployment: one replica holds one engine. It enters `open_engine` once, in
its constructor (EngineHost), serves the API (serve/api.py) as its ASGI ingress, and exits
the engine when Serve stops it (the app's lifespan shutdown, which Serve runs in the
replica's `__del__`).

Two ways in:
  * `memra-dist serve ...`: `deploy(args)` starts (or joins, RAY_ADDRESS) Ray, starts Serve's
    HTTP proxy on --host / --port and runs the application; `undeploy()` takes it down.
  * the import path `memra_dist.serve.entry:app_builder` (`serve run`, a KubeRay RayService),
    which parses `memra-dist serve`'s flags and calls `build`.
The replica gets the parsed flags as a plain dict (vars of the Namespace).
"""

from __future__ import annotations

import argparse
import os

from ray import serve

from ..errors import UserError
from .api import build_app
from .host import EngineHost

__all__ = ["MemraServer", "build", "deploy", "undeploy", "APP_NAME", "deployment_options", "engine_sessions"]

APP_NAME = "memra-dist"
HEADROOM = 32  # requests beyond sessions + queue that reach the replica (health, metrics, the 429s themselves)
_PASS_ENV = ("OTEL_", "MEMRA_")


@serve.deployment(name="MemraServer")
@serve.ingress()
class MemraServer:
    """One engine per replica. `options`: `memra-dist serve`'s parsed flags, as a dict."""

    def __init__(self, options: dict):
        from ..app import config_from_args  # noqa: PLC0415

        args = argparse.Namespace(**options)
        cfg = config_from_args(args, args.model, args.draft_model)
        self.host = EngineHost(cfg, args.sessions)  # the model loads (the pipeline is placed) here, once
        self.max_queue = args.max_queue

    def __serve_build_asgi_app__(self):
        return build_app(self.host, self.max_queue)  # its shutdown exits the engine


def engine_sessions(args) -> int:
    """The sessions the engine keeps in flight (open_engine's rule: one per stage by default, 1 at pp=1)."""
    return 1 if args.pp == 1 else (args.sessions or args.pp)


def _gpus_for_replica(args) -> float:
    """pp = 1 on a GPU cluster: the replica's engine needs a GPU; at pp > 1 the stages hold them."""
    if args.pp > 1 or args.device == "cpu":
        return 0
    import ray  # noqa: PLC0415

    has_gpu = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    return 1 if (has_gpu or args.device.startswith("cuda")) else 0


def deployment_options(args) -> dict:
    env = {k: v for k, v in os.environ.items() if k.startswith(_PASS_ENV)}
    return {
        "num_replicas": 1,
        # the replica decides who waits and who gets a 429: Serve must hand every request to it
        "max_ongoing_requests": engine_sessions(args) + args.max_queue + HEADROOM,
        "ray_actor_options": {"num_cpus": 1, "num_gpus": _gpus_for_replica(args), "runtime_env": {"env_vars": env}},
        "max_constructor_retry_count": 1,  # a model that does not load fails the deploy, not 20 retries
        "graceful_shutdown_wait_loop_s": 0.5,
        "graceful_shutdown_timeout_s": 60,  # in-flight requests end, then the engine (and its actors) go
        "health_check_period_s": 10,
    }


def build(args):
    """The Serve application of parsed serve flags."""
    return MemraServer.options(**deployment_options(args)).bind(dict(vars(args)))


_STATE: dict = {}


def deploy(args) -> str:
    """Ray up (joined or local), Serve's proxy on --host / --port, the app running and
    healthy (its model loaded). Returns the base URL."""
    from ..pipeline.driver import _ray_up  # noqa: PLC0415 (joins RAY_ADDRESS, or starts a local Ray)

    ray, started = _ray_up()
    _STATE["ray"] = ray if started else None
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build(args), name=APP_NAME, route_prefix="/")
    except (RuntimeError, ValueError) as e:
        undeploy()
        raise UserError(f"the server did not start: {_first_reason(e)}") from None
    except BaseException:
        undeploy()
        raise
    host = f"[{args.host}]" if ":" in args.host else args.host
    return f"http://{host}:{args.port}"


def _first_reason(e: BaseException) -> str:
    """The replica's own error line out of Serve's wrapped traceback text."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    for x in reversed(lines):
        if "UserError:" in x:
            return x.split("UserError:", 1)[1].strip()
    return (lines[-1] if lines else type(e).__name__)[:300]


def undeploy() -> None:
    """Serve down (replicas drain, engines exit), then Ray if this process started it."""
    try:
        serve.shutdown()
    finally:
        ray = _STATE.pop("ray", None)
        if ray is not None:
            ray.shutdown()
