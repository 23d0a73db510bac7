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

A graceful stop (`memra-dist serve` got SIGTERM): `drain(timeout_s, cut_asked)` tells the
replica to take no new completions (its `begin_drain`, through a Serve handle), waits until
its open ones ended (`drain_status`), and past the timeout (or when `cut_asked()`) ends what
is left (`cut`); `undeploy()` then stops Serve as on any other stop.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

from ray import serve

from ..batching.policy import AUTO_MAX_BATCH
from ..errors import UserError
from .api import build_app
from .drain import Drain
from .host import EngineHost
from .limits import DEFAULT_MAX_BODY_BYTES, OPEN_HEADROOM, parse_size

__all__ = ["MemraServer", "build", "deploy", "drain", "undeploy", "APP_NAME", "deployment_options", "engine_sessions",
           "http_options"]

APP_NAME = "memra-dist"
HEADROOM = 32  # beyond the app's open-request cap: GET /health, /metrics, /v1/models, which never wait
GCS_PROBE_S = 2.0  # undeploy: a GCS silent this long is not waited for
KEEP_ALIVE_S = 5  # the proxy closes a connection idle this long between requests (Ray's default: 90 s)
_PASS_ENV = ("OTEL_", "MEMRA_")
CALL_S = 5.0  # drain: one call to the replica answers within this, or the replica is taken as gone
POLL_S = 0.1  # drain: how often the replica's open requests are read
CUT_WAIT_S = 5.0  # drain: the cut requests get this long to send their last event
FLUSH_S = 0.3  # drain: the proxy's time to pass the last bytes on before Serve stops


@serve.deployment(name="MemraServer")
@serve.ingress()
class MemraServer:
    """One engine per replica. `options`: `memra-dist serve`'s parsed flags, as a dict."""

    def __init__(self, options: dict):
        from ..app import config_from_args  # noqa: PLC0415

        args = argparse.Namespace(**options)
        cfg = config_from_args(args, args.model, args.draft_model)
        # the model loads (the pipeline is placed) here, once
        self.host = EngineHost(cfg, args.sessions, max_batch=getattr(args, "max_batch", 1))
        self.max_queue = args.max_queue
        body = getattr(args, "max_body_bytes", DEFAULT_MAX_BODY_BYTES)
        self.max_body_bytes = body if isinstance(body, int) else parse_size(body)
        self.drain = Drain()

    def __serve_build_asgi_app__(self):  # its shutdown exits the engine
        return build_app(self.host, self.max_queue, max_body_bytes=self.max_body_bytes, drain=self.drain)

    # the graceful stop, called through a handle by `drain` below (never over HTTP)
    async def begin_drain(self) -> dict:
        self.drain.start()
        return self.drain.state()

    async def drain_status(self) -> dict:
        return self.drain.state()

    async def cut(self) -> dict:
        self.drain.cut()
        return self.drain.state()


def engine_sessions(args) -> int:
    """The sessions the engine keeps in flight (open_engine's rule: one per stage by default, 1 at pp=1,
    unless --max-batch batches requests; auto: at most AUTO_MAX_BATCH at pp=1, as the replica
    decides, and no batching at pp > 1)."""
    b = getattr(args, "max_batch", 1)
    if args.pp > 1:
        return b if b not in (None, 1) else args.sessions or args.pp
    return AUTO_MAX_BATCH if b is None else b


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
        # the replica decides who waits and who gets a 429 / 503: Serve must hand every request to it, and
        # requests it holds open (stalled uploads included, up to the app's cap) never keep /health waiting
        "max_ongoing_requests": engine_sessions(args) + args.max_queue + OPEN_HEADROOM + HEADROOM,
        "ray_actor_options": {"num_cpus": 1, "num_gpus": _gpus_for_replica(args), "runtime_env": {"env_vars": env}},
        "max_constructor_retry_count": 1,  # a model that does not load fails the deploy, not 20 retries
        "graceful_shutdown_wait_loop_s": 0.5,
        # in-flight requests get this long to end, then the engine (and its actors) go: within the 30 s
        # serve.shutdown gives the controller, so a stop never ends in "Controller failed to shut down"
        "graceful_shutdown_timeout_s": 20,
        "health_check_period_s": 10,
    }


def http_options(args) -> dict:
    """Serve's proxy: where it listens, and idle keep-alive connections closed after KEEP_ALIVE_S.
    It has no header-read timeout and no connection cap (serve/uvicorn_guard.py has both for
    plain uvicorn); no end-to-end `request_timeout_s` either, which would cut long streams.
    The app enforces the rest itself (serve/limits.py)."""
    return {"host": args.host, "port": args.port, "keep_alive_timeout_s": KEEP_ALIVE_S}


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
        serve.start(http_options=http_options(args))
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


def drain(timeout_s: float, cut_asked: Callable[[], bool] = lambda: False) -> str:
    """New completions refused; the open ones get `timeout_s` to end (0: cut at once), then
    what is left is cut (each stream ends with an error event and [DONE]). Returns what
    happened, in words. A replica or cluster that does not answer is not waited for."""
    if not _cluster_answers():
        return "the Ray cluster no longer answers (stopped with this process?): nothing to drain"
    t0 = time.monotonic()
    try:
        handle = serve.get_deployment_handle("MemraServer", APP_NAME)

        def call(method: str) -> dict:
            return getattr(handle, method).remote().result(timeout_s=CALL_S)

        st = call("begin_drain")
        begun = st["open"]
        while st["open"] and time.monotonic() - t0 < timeout_s and not cut_asked():
            time.sleep(POLL_S)
            st = call("drain_status")
        left = st["open"]
        if left:
            st = call("cut")
            end = time.monotonic() + CUT_WAIT_S
            while st["open"] and time.monotonic() < end:
                time.sleep(POLL_S)
                st = call("drain_status")
        if begun:
            time.sleep(FLUSH_S)
    except Exception as e:  # noqa: BLE001 (the replica or the controller gone, a call timed out: stop anyway)
        return f"the replica did not answer ({type(e).__name__}): not drained"
    took = time.monotonic() - t0
    if not left:
        return f"{begun} open request(s) ended in {took:.1f} s"
    if left == begun:
        return f"{left} open request(s) cut ({took:.1f} s)"
    return f"{begun - left} of {begun} open request(s) ended, {left} cut ({took:.1f} s)"


def _cluster_answers() -> bool:
    """`_gcs_answers`; a cluster found gone is not asked again in this stop (drain, then undeploy)."""
    import ray  # noqa: PLC0415

    if _STATE.get("gone"):
        return False
    ok = not ray.is_initialized() or _gcs_answers()
    _STATE["gone"] = not ok
    return ok


def _gcs_answers(timeout_s: float = GCS_PROBE_S) -> bool:
    """Whether the cluster's GCS answers within timeout_s. A SIGTERM to the whole process group
    (a service manager's stop, `kill -- -PGID`) also stops the local Ray this process started;
    Serve's controller can then never finish, and waiting for it would cost 30 s."""
    import ray  # noqa: PLC0415

    try:
        client = ray._private.worker.global_worker.gcs_client  # noqa: SLF001
        probe = client.get_all_node_info
    except AttributeError:  # another Ray's internals: assume it answers (the graceful way)
        return True
    try:
        probe(timeout=timeout_s)
        return True
    except Exception:  # noqa: BLE001 (RpcError, a timeout: the GCS is gone or going)
        return False


def undeploy() -> None:
    """Serve down (replicas drain, engines exit), then Ray if this process started it. A
    cluster that no longer answers (stopped with this process) is not waited for."""
    try:
        if _cluster_answers():
            serve.shutdown()
        else:
            print("[serve] the Ray cluster no longer answers (stopped with this process?): not draining",
                  file=sys.stderr, flush=True)
    finally:
        _STATE.pop("gone", None)
        ray = _STATE.pop("ray", None)
        if ray is not None:
            ray.shutdown()
