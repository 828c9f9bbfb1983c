"""devbridge on Ray: a fleet of device workers, each a Ray actor owning one Bridge.

``pip install devbridge[ray]``. See docs/RAY.md for a walk-through and the
multi-node setup.

    import ray, numpy as np
    from devbridge.ray import DeviceWorker, init_local, start_worker

    init_local()                     # ray.init() on 127.0.0.1; ray.init(address=...) joins a cluster
    a = start_worker("host", checkpoint="/shared/a.safetensors")     # a Ray actor handle
    b = start_worker("opencl")
    a.put.remote("x", np.ones((64, 64), np.float32))
    a.run.remote(lambda x: (x * 2).relu(), ["x"], ["y"])              # tinygrad, on the worker's device
    b.import_.remote("y", a.export.remote("y"))                      # hand-off through the object store
    print(ray.get(b.get.remote("y"), timeout=60))

Handles across the actor boundary
---------------------------------
A worker never hands out a device pointer or a bridge ``DeviceHandle``: those
mean nothing in another process. ``put``, ``run`` and ``import_`` return a
``TensorRef``, a small picklable token naming (worker domain, generation,
name, version). Every method taking a tensor accepts a name (``str``: the
tensor of that name now) or a ``TensorRef``, checked as the bridge checks its
handles: a token of another worker raises ``devbridge.ForeignDomain``, one of
an older generation (issued before the actor was restarted) raises
``devbridge.OldGenerationHandle``, one whose tensor has since been replaced or
deleted raises ``devbridge.UnknownDeviceHandle``. None is ever silently
accepted.

Generations: a worker's generation is 1 + the number of times Ray has
restarted its actor (Ray's own count, from the GCS), so a restarted worker
starts at a new generation, its bridge too. A worker started with
``checkpoint=PATH`` restores the last checkpoint written there when it is
restarted (names come back, in the new generation; tokens do not), after removing
the temporary files a checkpoint interrupted by the crash left beside it. A
checkpoint that cannot be restored (damaged, truncated) stops the worker for
good instead: the restart fails once with a ``devbridge.CheckpointError``,
which ``wait_until_ready`` raises at once.

This module is the caller's side: the actor class, starting workers and waiting
for them, a Ray instance on loopback. The worker's side, the class each actor
runs (``_DeviceWorker``) and the ``TensorRef`` tokens it issues, is in
``_ray_worker.py``; both are re-exported here, under their names in this module.
"""

from __future__ import annotations

import os
import time
from typing import Any, Mapping

try:
    import ray
except ImportError as _error:  # pragma: no cover - exercised only without the extra
    raise ImportError("devbridge.ray needs Ray: pip install 'devbridge[ray]' (or pip install ray)") from _error

# The worker's side: the class each actor runs and the tokens it issues (public here, devbridge.ray.TensorRef).
from ._ray_worker import TensorRef, _DeviceWorker

__all__ = ["DeviceWorker", "TensorRef", "init_local", "non_loopback_addresses", "start_worker", "wait_until_ready",
           "DEFAULT_MAX_RESTARTS"]

DEFAULT_MAX_RESTARTS = 4

# What a Ray instance started by init_local, and every process it starts, runs with.
LOOPBACK_ENVIRONMENT = {
    # Ray's switch for local-only instances (the default on Windows and macOS, honoured on Linux): the GCS,
    # raylet, workers and the driver's own core worker listen on 127.0.0.1 and name it as the node's address,
    # instead of the machine's routable address.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    # And no usage report leaves the machine.
    "RAY_USAGE_STATS_ENABLED": "0",
}


def init_local(**ray_init_kwargs: Any) -> Any:
    """Starts a new Ray instance on this machine with all its traffic on loopback (127.0.0.1), as
    ``ray.init(**ray_init_kwargs)`` would start one on the machine's network address; returns ray.init's result.

    What the tests, ``examples/ray_pipeline.py`` and ``bench/ray_bench.py`` start Ray with. Sets
    ``LOOPBACK_ENVIRONMENT`` in ``os.environ`` (inherited by every process Ray starts, and left set for this
    one), starts the instance (never joins one: no ``address``), then checks ``non_loopback_addresses()``:
    should this Ray ignore the setting, it shuts the instance down and raises ``RuntimeError`` naming the
    address. For a cluster of several machines call ``ray.init(address=...)`` instead (docs/RAY.md)."""
    for key in ("address", "_node_ip_address"):
        if key in ray_init_kwargs:
            raise TypeError(f"init_local starts a new instance on 127.0.0.1 and takes no {key}=; "
                            "to join a cluster call ray.init(address=...)")
    os.environ.update(LOOPBACK_ENVIRONMENT)
    try:
        # Ray reads the switch from the environment once, when it is first imported, and this module has
        # imported it: this process's copy must be set too, or ray.init maps 127.0.0.1 back to the
        # routable address.
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    except (ImportError, AttributeError):  # pragma: no cover - another Ray: the check below decides
        pass
    context = ray.init(address="local", _node_ip_address="127.0.0.1", **ray_init_kwargs)
    try:
        found = non_loopback_addresses()
    except BaseException:
        ray.shutdown()
        raise
    if found:
        ray.shutdown()
        raise RuntimeError(f"Ray {ray.__version__} started off loopback despite {LOOPBACK_ENVIRONMENT}: "
                           + ", ".join(f"{what} {address}" for what, address in found) + "; shut down")
    return context


def non_loopback_addresses() -> list[tuple[str, str]]:
    """``[(what, address)]`` for each address of the running Ray instance not on loopback: this process's node
    address, the GCS's, and each live node's (its raylet and object manager); empty when all are loopback."""
    import ipaddress

    def host(address: str) -> str:
        name = address.rpartition(":")[0] if address.count(":") == 1 or address.startswith("[") else address
        return name.strip("[]")

    def loopback(name: str) -> bool:
        try:
            ip = ipaddress.ip_address(name)
            return (ip.ipv4_mapped or ip).is_loopback if ip.version == 6 else ip.is_loopback
        except ValueError:
            return name == "localhost"

    candidates = [("node address", ray.util.get_node_ip_address()),
                  ("GCS", host(ray.get_runtime_context().gcs_address))]
    candidates += [(f"node {n['NodeID'][:12]}", n["NodeManagerAddress"]) for n in ray.nodes() if n.get("Alive")]
    return [(what, address) for what, address in candidates if not loopback(address)]


# The Ray actor class. Restarted by Ray on failure (max_restarts); a call in flight when the process
# died fails with a RayActorError (not retried: the caller decides, see examples/ray_pipeline.py).
DeviceWorker = ray.remote(max_restarts=DEFAULT_MAX_RESTARTS, max_task_retries=0)(_DeviceWorker)


def start_worker(backend: str = "host", device: str | None = None, *, checkpoint: str | os.PathLike | None = None,
                 max_restarts: int = DEFAULT_MAX_RESTARTS, num_gpus: float | None = None,
                 ray_options: Mapping[str, Any] | None = None, actor_class: Any = None, **options: Any) -> Any:
    """A ``DeviceWorker`` actor for ``backend``: ``num_gpus=1`` for ``"cuda"`` (Ray then places it on a GPU
    node and makes that GPU its device 0), none otherwise. ``options`` go to the worker (``ring_bytes``,
    the backend's own options); ``ray_options`` to ``DeviceWorker.options`` (``name``, ``resources``,
    ``scheduling_strategy``, ...). ``actor_class``: a Ray actor class over a ``_DeviceWorker`` subclass
    (``devbridge.ray_transport.RDTDeviceWorker``) instead of ``DeviceWorker``."""
    for key, value in (ray_options or {}).items():
        # tinygrad (run) and the bridge's staging layer are used from one thread: calls run side by side on a
        # threaded actor failed inside tinygrad (its sqlite cache objects used from another thread).
        if (key == "max_concurrency" and value != 1) or (key == "concurrency_groups" and value):
            raise ValueError(f"start_worker: ray_options {key}={value!r}: a device worker runs one call at a time "
                             "(tinygrad and the bridge are used from one thread); start more workers for "
                             "parallelism")
    if num_gpus is None:
        num_gpus = 1 if backend == "cuda" else 0
    if backend == "cuda" and "cuda_context" not in options and "context" not in options:
        options["cuda_context"] = "tinygrad"  # run() hands views to tinygrad
    settings: dict[str, Any] = {"max_restarts": max_restarts, "max_task_retries": 0}
    if num_gpus:
        # Only when asked for: an actor given any resource explicitly also holds a CPU for its lifetime
        # (Ray's rule), where a plain actor holds none once placed.
        settings["num_gpus"] = num_gpus
    settings.update(ray_options or {})
    checkpoint = os.fspath(checkpoint) if checkpoint is not None else None
    return (actor_class or DeviceWorker).options(**settings).remote(backend, device, checkpoint=checkpoint, **options)


def wait_until_ready(worker: Any, *, timeout: float = 60.0, min_generation: int = 1,
                     replacing: str | TensorRef | None = None) -> int:
    """Waits (up to ``timeout`` seconds) until ``worker`` answers at ``min_generation`` or later, retrying
    while Ray restarts it (``ActorUnavailableError``, or a ``RayActorError`` other than ``ActorDiedError``);
    returns its generation. ``replacing``: the incarnation of a process of the worker that is going away
    (``identity()["incarnation"]``, or a ``TensorRef`` it issued): an answer from that process does not count.
    After a hand-made bridge restart (``worker.bridge.restart(g)``) generations no longer grow from one process
    to the next (Ray numbers the next process from its own restart count), so ``min_generation`` cannot tell the
    new process from the dying one there; ``replacing`` can. Raises ``TimeoutError``; and at once, without
    waiting, the error a start or restart of the worker raised (a damaged checkpoint's
    ``devbridge.CheckpointError``, an unavailable backend's ``devbridge.Unavailable``, ...), chained from Ray's
    ``ActorDiedError``: Ray does not restart an actor whose constructor raised; and Ray's ``ActorDiedError``,
    naming the worker, for a worker dead for good (killed with ``no_restart=True``, or out of ``max_restarts``)."""
    if isinstance(replacing, TensorRef):
        replacing = replacing.incarnation
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"worker {_worker_name(worker)} did not answer at generation >= {min_generation}"
                               + (f" from a process other than incarnation {replacing}" if replacing else "")
                               + f" within {timeout} s" + (f" (last: {last!r})" if last else ""))
        try:
            answer_timeout = max(0.1, min(left, 30.0))
            if replacing is None:
                generation = ray.get(worker.ping.remote(), timeout=answer_timeout)
                answered_by_replaced = False
            else:
                identity = ray.get(worker.identity.remote(), timeout=answer_timeout)
                generation, answered_by_replaced = identity["generation"], identity["incarnation"] == replacing
            if generation >= min_generation and not answered_by_replaced:
                return generation
        except ray.exceptions.ActorDiedError as error:
            if error.actor_init_failed:
                raise _constructor_error(error) from error
            if not _restarting(worker):
                raise _dead_for_good(worker, error) from error
            last = error  # the ping reached the process that died; Ray is starting the next one
        except ray.exceptions.RayActorError as error:  # ActorUnavailableError: restarting, or unreachable for now
            if error.actor_init_failed:
                raise _constructor_error(error) from error
            last = error
        except ray.exceptions.GetTimeoutError as error:
            last = error
        time.sleep(0.05)


def _worker_name(worker: Any) -> str:
    actor_id = getattr(worker, "_actor_id", None)
    return actor_id.hex() if hasattr(actor_id, "hex") else repr(worker)


def _restarting(worker: Any) -> bool:
    """Whether the GCS says Ray is restarting ``worker`` (or has already: its state is not ``DEAD``)."""
    try:
        from ray._private import state

        info = state.actors(_worker_name(worker))
        return bool(info) and info.get("State") not in (None, "DEAD")
    except Exception:  # noqa: BLE001 - another Ray version: trust the ActorDiedError
        return False


def _dead_for_good(worker: Any, error: BaseException) -> BaseException:
    """Ray's ActorDiedError for ``worker``, its message naming the worker and saying it will not come back."""
    dead = ray.exceptions.ActorDiedError()
    dead.actor_id = getattr(error, "actor_id", None) or _worker_name(worker)
    dead.error_msg = (f"worker {_worker_name(worker)} is dead for good (killed with no_restart=True, or out of "
                      f"its max_restarts): Ray will not restart it; start a new worker. {error}")
    return dead


def _constructor_error(error: BaseException) -> BaseException:
    """The exception a worker's constructor raised, from Ray's ActorDiedError for it (which holds the
    worker's RayTaskError, whose ``cause`` it is); ``error`` itself where this Ray keeps no such cause."""
    task_error = error.args[0] if error.args else None
    cause = getattr(task_error, "cause", None)
    return cause if isinstance(cause, Exception) else error
