"""The Ray executor: the judge's workers on the GPUs (or CPU bundles) of a Ray cluster.

Each device is one bundle of a placement group (a GPU, or as many CPUs as the deployment's threads); every
worker of a device is a Ray actor in that bundle, and the actor launches and owns the same subprocess
worker as the local executor (core.workers.Worker), so candidate code runs in that subprocess only: never
in the judge, never in the actor's own interpreter. The actor's environment holds no API key (a cluster
the judge starts is started without them, and the actor drops any it inherits). The judge times each call
from its own side; the actor only relays the worker's reply, and the judge checks the tokens it carries. A
workspace's plugin files travel with the call that starts the actor (the node may be another machine);
checkpoints and the request set must be at the same paths on every node. A dead actor or node is that
worker's error: the candidate fails with the reason, the run goes on.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from specpilot.core.deployment import Deployment
from specpilot.core.executors.base import Device, ExecutorError
from specpilot.core.recipe import Recipe
from specpilot.core.workers import SECRET_ENV, START_LIMIT_S, Worker, WorkerBase, WorkerError, WorkerTimeout, \
    deployment_dict, recipe_text, track, untrack

REPO = Path(__file__).resolve().parent.parent.parent
WORKERS_PER_DEVICE = 4  # a device's bundle is shared by its workers: baseline, candidate, incumbent, one dying
SCHEDULE_S = 120.0  # placing an actor and starting its interpreter may take this long, on top of the engine's load
READY_S = 60.0  # a placement group the cluster cannot satisfy in this long never will


def require_ray() -> Any:
    """The `ray` module, or a one-line error saying how to get it."""
    try:
        import ray
    except ImportError:
        raise ExecutorError("--executor ray needs Ray, which is not installed: pip install 'specpilot[ray]' "
                            "(or pip install ray)") from None
    return ray


@contextmanager
def _without_secrets() -> Iterator[None]:
    """API keys out of this process's environment while it starts a local cluster, so no Ray process (and
    no actor it forks) ever has them; they are put back once the cluster runs."""
    saved = {k: os.environ.pop(k) for k in SECRET_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _check_reachable(address: str) -> None:
    """A host:port that nobody listens on fails here in seconds (ray.init would retry for many minutes)."""
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rsplit("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ExecutorError(f"--ray-address {address}: expected HOST:PORT of the cluster's head node (e.g. "
                            "10.0.0.5:6379), or auto")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise ExecutorError(f"--ray-address {address}: no Ray cluster answers there ({exc.strerror or exc}); start "
                            "one with `ray start --head` or pass the head node's address") from None


class RayExecutor:
    """Workers as Ray actors, one placement-group bundle per device. Connects to `address` (a cluster that
    is already running), or uses the Ray this process already initialised, or starts a local one."""

    name = "ray"

    def __init__(self, deployment: Deployment, devices: str | None = None, address: str | None = None) -> None:
        ray = require_ray()
        from ray.util.placement_group import placement_group

        self.ray = ray
        self._started = False
        if not ray.is_initialized():
            if address:
                _check_reachable(address)
            options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                       "logging_level": "ERROR"}
            if not address:
                options["object_store_memory"] = 200 << 20  # replies are small; the default takes 30% of RAM
            try:
                with _without_secrets():
                    ray.init(address=address, **options)
            except Exception as exc:  # ConnectionError, RuntimeError: Ray's own words, on one line
                raise ExecutorError(f"--executor ray: could not {'reach ' + address if address else 'start Ray'}: "
                                    f"{' '.join(str(exc).split())[:300]}") from None
            self._started = True
        gpu = deployment.device.startswith("cuda")
        threads = max(1, deployment.threads or 1)
        self.bundle = {"GPU": 1.0, "CPU": 1.0} if gpu else {"CPU": float(threads)}
        total = ray.cluster_resources()
        have = int(total.get("GPU", 0)) if gpu else int(total.get("CPU", 0) // threads)
        what = "GPU(s)" if gpu else f"CPU bundle(s) of {threads} core(s)"
        if devices is not None and not str(devices).strip().isdigit():
            self.close()
            raise ExecutorError(f"--devices {devices}: with --executor ray, --devices is how many of the cluster's "
                                f"devices to use (a number; the cluster has {have} {what})")
        count = int(devices) if devices is not None else have
        if count < 1 or count > have:
            self.close()
            raise ExecutorError(f"--executor ray: {count} device(s) asked, the cluster has {have} {what}; add "
                                "nodes or ask for fewer")
        self.group = placement_group([dict(self.bundle) for _ in range(count)], strategy="SPREAD")
        try:
            ray.get(self.group.ready(), timeout=READY_S)
        except Exception:
            self.close()
            raise ExecutorError(f"--executor ray: the cluster could not reserve {count} device(s) of {self.bundle} "
                                f"within {READY_S:.0f} s (busy with other jobs?)") from None
        torch_device = "cuda:0" if gpu else "cpu"  # Ray sets CUDA_VISIBLE_DEVICES to the bundle's GPU
        self.devices = [Device(f"ray:{i}", torch_device, None, i) for i in range(count)]
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        # this checkout's core in the actor and its worker; API keys blanked in the actor's very environment,
        # whatever the cluster's processes were started with
        self.runtime_env = {"env_vars": {"PYTHONPATH": path, **{k: "" for k in SECRET_ENV}}}
        self.actor_class = ray.remote(WorkerActor)

    def start(self, deployment: Deployment, recipe: Recipe | None, workspace: str | Path | None, device: Device,
              limit_s: float, start_limit_s: float | None) -> "RayWorker":
        return RayWorker(self, deployment, recipe, workspace, device, limit_s, start_limit_s)

    def actor_options(self, device: Device) -> dict:
        """Resources of one worker's actor: its share of the device's bundle, placed in that bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        share = {k: v / WORKERS_PER_DEVICE for k, v in self.bundle.items()}
        return {"num_cpus": share.get("CPU", 0.0), "num_gpus": share.get("GPU", 0.0), "max_concurrency": 2,
                "max_restarts": 0, "runtime_env": self.runtime_env,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.group,
                                                                        placement_group_bundle_index=device.index)}

    def close(self) -> None:
        """Release the devices, and end the cluster if this executor started it."""
        group = getattr(self, "group", None)
        if group is not None and self.ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(group)
            except Exception:  # the cluster is already gone: nothing left to release
                pass
            self.group = None
        if self._started and self.ray.is_initialized():
            self.ray.shutdown()
            self._started = False


class WorkerActor:
    """Runs inside a Ray actor: owns one subprocess worker and relays calls to it. Errors come back as
    values (a WorkerError is not something the actor's caller should have to unpickle)."""

    def __init__(self, deployment: dict, recipe: str | None, plugins: dict[str, str] | None, limit_s: float,
                 start_limit_s: float | None) -> None:
        for key in SECRET_ENV:
            os.environ.pop(key, None)
        self.workspace = None
        if plugins is not None:
            self.workspace = Path(tempfile.mkdtemp(prefix="specpilot-ray-")) / "workspace"
            (self.workspace / "plugins").mkdir(parents=True)
            for rel, text in plugins.items():
                (self.workspace / rel).write_text(text)
        self.worker = Worker(deployment, recipe, self.workspace, limit_s, False, start_limit_s)

    def _relay(self, fn: Any) -> dict:
        try:
            return {"reply": fn()}
        except WorkerError as exc:
            return {"error": str(exc), "timeout": isinstance(exc, WorkerTimeout)}

    def ready(self) -> dict:
        return self._relay(lambda: self.worker.ready() and {"ok": True})

    def call(self, msg: dict, timeout: float) -> dict:
        return self._relay(lambda: self.worker.call(msg, timeout))

    def pids(self) -> tuple[int, int]:
        """(the actor's process, its worker subprocess): for tests that kill one or look at its environment."""
        return os.getpid(), self.worker.pid

    def kill(self) -> None:
        self.worker.kill()
        self._forget_workspace()

    def close(self) -> None:
        self.worker.close()
        self._forget_workspace()

    def _forget_workspace(self) -> None:
        if self.workspace is not None:
            shutil.rmtree(self.workspace.parent, ignore_errors=True)


def _plugin_files(workspace: str | Path | None) -> dict[str, str] | None:
    if workspace is None:
        return None
    return {f"plugins/{p.name}": p.read_text() for p in sorted((Path(workspace) / "plugins").glob("*.py"))}


def _why(exc: BaseException) -> str:
    """Ray's long error text as one short line: what happened to the actor, and why if Ray says."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    first = lines[0] if lines else type(exc).__name__
    cause = next((ln for ln in lines[1:] if "because" in ln), "")
    return " ".join(f"{first} {cause}".split())[:300]


class RayWorker(WorkerBase):
    """The judge's side of one worker in a Ray actor: every call is timed here, around `ray.get`."""

    def __init__(self, executor: RayExecutor, deployment: Deployment, recipe: Recipe | None,
                 workspace: str | Path | None, device: Device, limit_s: float, start_limit_s: float | None) -> None:
        self.ray = executor.ray
        self.device = device
        self.limit_s = limit_s
        self.start_limit_s = start_limit_s if start_limit_s is not None else max(limit_s, START_LIMIT_S)
        here = deployment_dict(deployment) | {"device": device.torch}
        self.actor = executor.actor_class.options(**executor.actor_options(device)).remote(
            here, recipe_text(recipe), _plugin_files(workspace), limit_s, start_limit_s)
        self._closed = self._dead = False
        self._starting = True
        track(self)

    def ready(self) -> "RayWorker":
        """Wait for the actor to be placed and its worker's engine to load; a failure closes it first."""
        try:
            self._get(self.actor.ready.remote(), self.start_limit_s + SCHEDULE_S, "start")
        except WorkerError:
            self.close()
            raise
        self._starting = False
        return self

    def call(self, msg: dict, timeout: float | None = None) -> dict:
        """One request, relayed by the actor; the actor's worker enforces the limit, and a silent actor is
        killed a little after it."""
        limit = timeout or self.limit_s
        try:
            return self._get(self.actor.call.remote(msg, limit), limit + 30.0, "answer")
        except WorkerError as exc:
            exc.worker = self
            raise

    def _get(self, ref: Any, timeout: float, doing: str) -> dict:
        from ray import exceptions

        try:
            out = self.ray.get(ref, timeout=timeout)
        except exceptions.GetTimeoutError:
            self.kill()
            raise WorkerTimeout(f"the Ray actor did not {doing} within {timeout:.0f} s and was killed") from None
        except (exceptions.RayActorError, exceptions.ActorUnavailableError) as exc:
            self._dead = True
            self.kill()
            raise WorkerError(f"the Ray actor running this worker died: {_why(exc)}") from None
        except exceptions.RayError as exc:
            self.kill()
            raise WorkerError(f"Ray failed the call: {_why(exc)}") from None
        if "error" in out:
            raise (WorkerTimeout if out.get("timeout") else WorkerError)(out["error"])
        return out["reply"]

    def pids(self) -> tuple[int, int]:
        return tuple(self.ray.get(self.actor.pids.remote(), timeout=30))  # type: ignore[return-value]

    @property
    def alive(self) -> bool:
        return not self._closed and not self._dead

    def kill(self) -> None:
        """Kill the worker's process group through its actor (so nothing it spawned survives), then the actor."""
        if not self._dead:
            try:
                self.ray.get(self.actor.kill.remote(), timeout=10)
            except Exception:  # the actor is gone or stuck: killing it below is all that is left
                pass
        try:
            self.ray.kill(self.actor, no_restart=True)
        except Exception:  # already dead, or the cluster is gone
            pass
        self._dead = True
        untrack(self)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._dead and not self._starting:
            try:
                self.ray.get(self.actor.close.remote(), timeout=20)
            except Exception:  # a stuck or dead actor is killed below
                pass
        self.kill()
