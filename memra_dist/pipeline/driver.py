"""The driver of the ppN split: start or join Ray, place the actors (one GPU per stage,
placement-group based), bootstrap the process group from inside the actors, and hand the app
a `PipelineRequest`: the same start / burst / finish face as an in-process
`specdec.request.Request`, whose calls go to the head actor (which runs that very class).
Up to S requests are in flight at once, one per session slot (`Pipeline.request` waits for a
free one). Everything is torn down on a normal end, on errors and on Ctrl-C."""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import signal
import socket
import sys
import threading
import time

from contextlib import contextmanager

from ..errors import UserError
from ..specdec.request import BurstOut
from ..tracing.otel import default_run_dir, flush_timeout_s, otlp_endpoint
from .setup_hook import HOOK
from .transport import pg_timeout_s

__all__ = ["open_pipeline", "Pipeline", "PipelineRequest", "close_bound_s", "loss_lines"]

_OTEL_PASS = ("OTEL_", "MEMRA_")


def _runtime_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k.startswith(_OTEL_PASS)}
    rt = {"worker_process_setup_hook": HOOK, "env_vars": env}
    # Under `ray job submit` the job's runtime env (cluster/runtime_env.yaml) is already set, and
    # ray.init refuses to merge ours with it when a field or an env var is given in both: add only
    # what the job's lacks (its values are the same ones: the job's env_vars are this process's env)
    job = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if job:
        try:
            have = json.loads(job).get("runtime_env") or {}
        except (ValueError, AttributeError):
            have = {}
        if "worker_process_setup_hook" in have:
            rt.pop("worker_process_setup_hook")
        rt["env_vars"] = {k: v for k, v in env.items() if k not in (have.get("env_vars") or {})}
    return rt


RAY_CONNECT_S = 5.0  # bound on reaching RAY_ADDRESS before ray.init is asked to join it


def check_ray_address(addr: str, timeout_s: float = RAY_CONNECT_S) -> None:
    """A RAY_ADDRESS that names host:port (optionally ray://host:port) must answer a TCP
    connect within the bound: ray.init would otherwise retry for minutes. 'auto' and
    'local' are left to Ray."""
    if addr in ("auto", "local"):
        return
    rest = addr.split("://", 1)[1] if "://" in addr else addr
    host, _, port = rest.rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"RAY_ADDRESS '{addr}' is malformed (expected host:port, e.g. 10.0.0.1:6379, or auto)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        why = "timed out" if isinstance(e, socket.timeout) else (e.strerror or str(e))
        raise UserError(f"RAY_ADDRESS {addr}: no Ray cluster answers there ({why} within {timeout_s:.0f} s)") from None


LOOPBACK = "127.0.0.1"


def _loopback_only() -> None:
    """A Ray we start ourselves serves this machine only: its node address is the loopback,
    so the GCS, raylet, workers and agents listen on 127.0.0.1, not on every interface. Ray
    resolves a loopback node address to the machine's outward one unless multi-node clusters
    are off (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read at import, inherited by its processes)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:  # ray imported earlier in this process: the flag was read already
        from ray._private import ray_constants  # noqa: PLC0415

        ray_constants.ENABLE_RAY_CLUSTER = False
    except (ImportError, AttributeError):
        pass


def _ray_up():
    """(ray, started_here). Joins RAY_ADDRESS when set (left as it is); else a local
    single-node Ray that listens on the loopback only."""
    import ray  # noqa: PLC0415

    if ray.is_initialized():
        return ray, False
    if not os.environ.get("RAY_ADDRESS"):
        _loopback_only()  # before ray.init starts the cluster's processes (they inherit it)
    on_term = signal.getsignal(signal.SIGTERM)
    if os.environ.get("RAY_ADDRESS"):
        check_ray_address(os.environ["RAY_ADDRESS"])
        try:
            ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=_runtime_env(), log_to_driver=True)
        except ConnectionError as e:
            raise UserError(f"RAY_ADDRESS {os.environ['RAY_ADDRESS']}: {str(e).splitlines()[0][:200]}") from None
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, 8), include_dashboard=False, runtime_env=_runtime_env(),
                 log_to_driver=True, configure_logging=False, _node_ip_address=LOOPBACK)
    if callable(on_term) and threading.current_thread() is threading.main_thread():
        # ray.init replaces SIGTERM with sys.exit(15) (its C++ core logs and exits too), which
        # skips the CLI's flush-and-teardown path; keep the handler the caller had
        signal.signal(signal.SIGTERM, on_term)
    return ray, True


class Pipeline:
    """The actors of one ppN split, placed and connected."""

    def __init__(self, plan, run_dir: str | None, sessions: int = 1, batched: dict | None = None):
        import ray  # noqa: PLC0415
        from ray.util.placement_group import placement_group  # noqa: PLC0415
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415

        from .actors import HeadWorker, StageWorker  # noqa: PLC0415

        cfg = plan.cfg
        self.ray = ray
        gpus = int(ray.cluster_resources().get("GPU", 0))
        use_gpu = gpus > 0 and cfg.device != "cpu"
        if cfg.device.startswith("cuda") and gpus == 0:
            raise UserError("--device cuda: the Ray cluster has no GPUs")
        if use_gpu and gpus < cfg.pp:
            raise UserError(f"--pp {cfg.pp} needs {cfg.pp} GPUs (one per stage); the Ray cluster has {gpus}")
        self.pg = None
        if use_gpu:
            self.pg = placement_group([{"GPU": 1, "CPU": 1}] * cfg.pp, strategy="PACK")
            ray.get(self.pg.ready(), timeout=120)
            opts = [dict(num_gpus=1, num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=i)) for i in range(cfg.pp)]
        else:
            opts = [dict(num_cpus=1)] * cfg.pp
        world = cfg.pp
        # rank 0: the head, holding the last stage; ranks 1..N-1: stages 0..N-2
        # "control": close / span_count run beside a busy serve loop or burst (threaded actor);
        # the head's default group runs the sessions' calls (a start, two bursts and a finish
        # may wait for their turn per session)
        groups = {"concurrency_groups": {CONTROL: 2}}
        self.run_dir = run_dir
        self.sessions = sessions
        self.head = ray.remote(**groups, max_concurrency=4 * sessions)(HeadWorker).options(**opts[0]).remote(
            plan, 0, world, cfg.pp - 1, run_dir)
        self.stages = [ray.remote(**groups)(StageWorker).options(**opts[r]).remote(plan, r, world, r - 1, run_dir)
                       for r in range(1, world)]
        try:
            addr, port = ray.get(self.head.address.remote())
            ray.get([a.connect.remote(addr, port, pg_timeout_s()) for a in [self.head, *self.stages]])
        except ray.exceptions.ActorDiedError as e:  # an actor refused its stage (e.g. a cache that does not fit)
            raise _creation_error(e) from None
        self.serving = [s.serve.remote() for s in self.stages]  # one serve loop per stage, every request
        # every slot allocated (or, batched, every rank's paged pool made) before any request
        ray.get(self.head.prepare.remote(sessions, plan.capacity, batched))
        self._free: queue.Queue = queue.Queue()
        for i in range(sessions):
            self._free.put(i)
        self._seq = [0] * sessions  # the next call's sequence number, per slot
        self._index = itertools.count()  # request indices (the stages' and the head's trace contexts)

    def batch_stats(self) -> dict | None:
        return self.ray.get(self.head.batch_stats.options(concurrency_group=CONTROL).remote())

    def failure(self, e: BaseException) -> UserError:
        """One line for an error from the head: the stage that died, when one did."""
        return UserError(_stage_failure(self.ray, self.serving) or f"pipeline head failed: {_why(e)}")

    def request(self, plan, prompt: list[int], carrier: dict | None = None) -> "PipelineRequest":
        """The next request through the loaded pipeline, in the first free session slot
        (waits for one). Each stage learns its trace context first (its stage spans join
        that request's trace). The caller must `release()` it (done or not)."""
        carrier = carrier or {}
        slot = self._free.get()
        index = next(self._index)
        try:
            self.ray.get([s.begin_request.options(concurrency_group=CONTROL).remote(index, carrier)
                          for s in self.stages])
        except self.ray.exceptions.RayError as e:
            self._free.put(slot)
            raise self.failure(e) from None
        return PipelineRequest(self, plan, prompt, carrier, slot, index)

    def _next_seq(self, slot: int) -> int:
        seq = self._seq[slot]
        self._seq[slot] += 1
        return seq

    def all(self):
        return [self.head, *self.stages]

    def names(self) -> list[str]:
        """Role names as the run-dir files use them: head<rank>, stage<stage>."""
        return [f"head{len(self.stages)}"] + [f"stage{i}" for i in range(len(self.stages))]

    def close(self) -> list[dict]:
        """Every actor flushes its spans and writes its file (in parallel, each in its control
        group), the driver waiting at most `close_bound_s()`; then the process group's actors
        are killed. Returns one report per role: {"name", "made", "lost", "why"}; lost None =
        unknown (an actor that died or did not finish within the bound)."""
        ray, actors, names = self.ray, self.all(), self.names()
        bound = close_bound_s()
        refs = [a.close.options(concurrency_group=CONTROL).remote(STOP_WAIT_S) for a in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=bound)
        reports = []
        for name, a, ref in zip(names, actors, refs):
            if ref in ready:
                try:
                    r = ray.get(ref)
                    reports.append({"name": name, "made": r["made"], "lost": r["lost"], "why": ""})
                except Exception as e:  # noqa: BLE001 (a dead actor cannot flush)
                    reports.append({"name": name, "made": None, "lost": None, "why": f"actor died ({_why(e)})"})
                continue
            try:  # still writing: how much is at stake
                made = ray.get(a.span_count.options(concurrency_group=CONTROL).remote(), timeout=2)
            except Exception:  # noqa: BLE001
                made = None
            reports.append({"name": name, "made": made, "lost": made, "why": f"its flush did not finish within {bound:.0f} s"})
        for a in actors:
            ray.kill(a)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group  # noqa: PLC0415

            remove_placement_group(self.pg)
        if self.run_dir:
            from ..tracing.files import remove_partial  # noqa: PLC0415

            _wait_dead(ray, actors, KILL_WAIT_S)  # a killed writer runs on for a moment: let it end first
            remove_partial(self.run_dir)  # a writer killed at the bound leaves no temp file behind
        return reports


CONTROL = "control"
KILL_WAIT_S = 5.0  # how long close waits for killed actors to be gone before sweeping temp files


def _wait_dead(ray, actors, bound_s: float) -> None:
    """Wait (at most `bound_s`) until every killed actor answers a call with its death:
    `ray.kill` only asks, and a writer still alive could leave a temp file after the sweep."""
    from ray.exceptions import ActorDiedError, GetTimeoutError  # noqa: PLC0415

    end = time.monotonic() + bound_s
    for a in actors:
        while time.monotonic() < end:
            try:
                ray.get(a.span_count.options(concurrency_group=CONTROL).remote(),
                        timeout=max(0.01, min(0.5, end - time.monotonic())))
            except ActorDiedError:  # (not ActorUnavailableError, its sibling: that one may come back)
                break
            except GetTimeoutError:
                continue
            except Exception:  # noqa: BLE001 (any other answer: not dead yet)
                pass
            time.sleep(0.02)


STOP_WAIT_S = 5.0  # how long an actor's close waits for the work in flight before flushing


def close_bound_s() -> float:
    """How long the driver waits for the actors' flush: each actor's own flush bound
    (MEMRA_FLUSH_TIMEOUT_S) plus the wait for its work in flight and writing its file."""
    return flush_timeout_s() + STOP_WAIT_S + 20.0


def loss_lines(reports: list[dict]) -> list[str]:
    """One line per role whose spans did not all arrive."""
    out = []
    for r in reports:
        if r["lost"] == 0 and not r["why"]:
            continue
        what = ("an unknown number of" if r["lost"] is None
                else f"{r['lost']} of {r['made']}" if r["made"] is not None else str(r["lost"]))
        why = f": {r['why']}" if r["why"] else ""
        out.append(f"memra-dist: warning: {r['name']}: {what} spans lost{why}")
    return out


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
STAGE_DEATH_WAIT_S = 3.0  # how long a failed head waits to learn which stage died


def _why(e: BaseException) -> str:
    """One line for an error that came back from an actor: the actor's own exception (a
    RayTaskError's cause) when there is one, never the `ray::Class.method() (pid=..)` banner."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        e = cause
    lines = [ln.strip() for ln in _ANSI.sub("", str(e)).splitlines() if ln.strip()]
    msg = lines[0][:300] if lines else ""
    return msg if isinstance(e, UserError) else f"{type(e).__name__}: {msg}"


_USER_ERROR = re.compile(r"UserError: (.+)")


def _creation_error(e: BaseException) -> BaseException:
    """An actor whose constructor raised a UserError (its stage refused before loading): that
    one line; anything else as it came."""
    found = _USER_ERROR.findall(_ANSI.sub("", str(e)))
    return UserError(found[-1].strip()) if found else e


def _stage_failure(ray, serving) -> str | None:
    """Names the first stage whose serve loop died (None if all are alive). A killed stage
    usually breaks the head's receive before Ray marks the actor dead: wait a moment."""
    ray.wait(serving, num_returns=1, timeout=STAGE_DEATH_WAIT_S)
    done, _ = ray.wait(serving, num_returns=len(serving), timeout=0)
    for i, ref in enumerate(serving):
        if ref in done:
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 (report whatever killed it)
                return f"pipeline stage {i} failed: {_why(e)}"
    return None


class PipelineRequest:
    """The driver's handle on one session slot of the head actor. Two bursts are kept in
    flight: the head starts the next burst while the previous one's tokens travel back, so
    the Ray round trip (~1 ms) never idles the session; a burst asked for after the request
    ended returns no tokens. Tokens reach the caller at burst cadence. Every call names the
    slot and its sequence number (the head runs a slot's calls in that order)."""

    def __init__(self, pipe: Pipeline, plan, prompt: list[int], carrier: dict, slot: int, index: int):
        self.pipe, self.ray, self.plan, self.prompt, self.carrier = pipe, pipe.ray, plan, prompt, carrier
        self.slot, self.index = slot, index
        self.inflight: list = []
        self.done = False
        self.started = self.finished = self.released = False

    def _get(self, ref, timeout=None):
        try:
            return self.ray.get(ref, timeout=timeout)
        except self.ray.exceptions.RayError as e:
            raise self.pipe.failure(e) from None

    def _call(self, method, *args):
        return getattr(self.pipe.head, method).remote(self.slot, self.pipe._next_seq(self.slot), *args)

    def start(self) -> int:
        self.started = True
        first, self.done = self._get(self._call("start", self.index, self.carrier, self.prompt, self.plan))
        if not self.done:
            self.inflight = [self._call("burst"), self._call("burst")]
        return first

    def burst(self, hook=None) -> BurstOut:
        out: BurstOut = self._get(self.inflight.pop(0))
        self.done = out.done
        if not out.done:
            self.inflight.append(self._call("burst"))
        if hook is not None and out.tokens:
            hook(out.tokens)
        return out

    def finish(self) -> dict:
        self._get(self.inflight)  # the spare burst: empty
        self.inflight = []
        self.finished = True
        return self._get(self._call("finish"))

    def release(self) -> None:
        """Give the slot back for the next request. A request abandoned before its end (its
        caller raised, e.g. a client that went away) is finished first: the bursts in flight
        end, its spans are built, and the slot is clean for the next ALLOC."""
        if self.released:
            return
        self.released = True
        try:
            if self.started and not self.finished:
                self.finish()
        finally:
            self.pipe._free.put(self.slot)


@contextmanager
def open_pipeline(plan, run_dir: str | None = None, lost: list | None = None, sessions: int = 1,
                  batched: dict | None = None):
    """Ray up and the actors placed, for any number of requests, up to `sessions` of them in
    flight at once; everything torn down on the way out. `lost` gets one line per role whose
    spans did not all arrive (also printed)."""
    if not os.environ.get("RAY_ADDRESS"):  # a local cluster: its actors load from this node's disk
        import torch  # noqa: PLC0415

        from ..device import free_mb  # noqa: PLC0415
        from ..model.prefetch import prefetch_weights  # noqa: PLC0415

        prefetch_weights((plan.cfg.model, plan.cfg.draft_model), free_mb(torch.device("cpu")) << 20)
    ray, started = _ray_up()
    pipe = None
    try:
        if run_dir is None and plan.cfg.trace.clock_on and not otlp_endpoint():
            run_dir = default_run_dir()  # the actors' spans need somewhere to go (as the CLI's do)
        pipe = Pipeline(plan, str(run_dir) if run_dir else None, sessions, batched)
        yield pipe
    finally:
        if pipe is not None:
            for line in loss_lines(pipe.close()):
                print(line, file=sys.stderr, flush=True)
                if lost is not None:
                    lost.append(line)
        if started:
            ray.shutdown()
