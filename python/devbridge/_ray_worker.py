"""The worker's side of devbridge.ray: the ``_DeviceWorker`` class a ``DeviceWorker`` Ray actor runs (one
Bridge in one actor process), the ``TensorRef`` tokens it issues and checks, and the helpers only it uses
(its identity from Ray's GCS, reading object-store buffers in place).

The caller's side (``DeviceWorker``, the Ray actor class over ``_DeviceWorker``, ``start_worker``,
``wait_until_ready``, ``init_local``) and the module doc are in ``ray.py``, which re-exports ``TensorRef``
and ``_DeviceWorker``. Both classes keep ``devbridge.ray`` as their ``__module__``: their public (and
documented) names, and the names they are pickled under, are those of ``devbridge.ray``.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable, Iterable, Mapping, NoReturn, Sequence

import numpy as np
import ray

import devbridge
from ._devbridge import TransferPlanner, _alloc_owned
from ._intake import _bits_dtype, _dtype_name, _intake, _numpy_dtype
from ._staging import DeviceTensor
from ._checkpoint_write import _remove_interrupted_checkpoint_files
from ._portable import PortableTensor


class TensorRef:
    """A worker's token for one of its named tensors: ``(domain, generation, name, version, incarnation)``.

    Small and picklable: it crosses the actor boundary (and the object store)
    where a bridge handle could not. ``domain`` is the worker's (its Ray actor
    id, stable across restarts), ``generation`` the worker's generation when
    the token was issued, ``incarnation`` a random id of the worker process that
    issued it (a process Ray starts after a crash has a new one, whatever its
    generation). ``shape`` and ``dtype`` describe the tensor (for the caller's
    information; the worker checks the token, not these)."""

    # Public as devbridge.ray.TensorRef (re-exported there): its name in reprs, docs and pickles.
    __module__ = "devbridge.ray"

    __slots__ = ("domain", "generation", "name", "version", "shape", "dtype", "incarnation")

    def __init__(self, domain: str, generation: int, name: str, version: int,
                 shape: tuple[int, ...], dtype: str, incarnation: str = "") -> None:
        self.domain, self.generation, self.name, self.version = domain, generation, name, version
        self.shape, self.dtype, self.incarnation = tuple(shape), dtype, incarnation

    def __reduce__(self):
        return (TensorRef, (self.domain, self.generation, self.name, self.version, self.shape, self.dtype,
                            self.incarnation))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorRef):
            return NotImplemented
        return self.__reduce__()[1] == other.__reduce__()[1]

    def __hash__(self) -> int:
        return hash(self.__reduce__()[1])

    def __repr__(self) -> str:
        return (f"TensorRef({self.name!r}, worker {self.domain[:12]}, generation {self.generation}, "
                f"version {self.version}, {self.dtype}{list(self.shape)})")


def _flat_bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8) if a.size else np.empty(0, np.uint8)


def _in_object_store(a: np.ndarray) -> bool:
    """Whether ``a`` is a read-only view of a buffer in Ray's object store (what ray.get and a resolved
    argument give for an array): sealed, so immutable for as long as anything references it."""
    if a.flags.writeable:
        return False
    base = a
    for _ in range(8):  # ndarray views of views, then Ray's buffer
        base = getattr(base, "base", None)
        if base is None:
            return False
        if type(base).__module__ == "ray._raylet" and type(base).__name__.endswith("Buffer"):
            return True
        if not isinstance(base, np.ndarray):
            return False
    return False


def _actor_identity() -> tuple[str, int]:
    """(domain, generation) of the calling actor: its actor id, and 1 + Ray's restart count. Outside an
    actor (the plain class used in a process), a ``local-...`` domain at generation 1; Ray is never started
    for it (``ray.get_runtime_context()`` would start a local instance in a process that has none)."""
    if not ray.is_initialized():
        return f"local-{uuid.uuid4().hex}", 1
    context = ray.get_runtime_context()
    actor_id = context.get_actor_id()
    if actor_id is None:  # not in an actor (a driver using the class directly)
        return f"local-{uuid.uuid4().hex}", 1
    restarts = None
    try:  # Ray's own count, kept by the GCS
        from ray._private import state

        info = state.actors(actor_id)
        restarts = int(info.get("NumRestarts"))
    except Exception:  # noqa: BLE001 - another Ray version: fall back to the public flag
        restarts = None
    if restarts is None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            restarts = 1 if context.was_current_actor_reconstructed else 0
    return actor_id, 1 + restarts


def _callable_name(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return f"fn {name}" if name else f"fn {fn!r}"


def _not_numbers(value: Any) -> bool:
    """Whether numpy reads ``value`` as objects or text rather than numbers."""
    try:
        return np.asarray(value).dtype.kind in "OUS"
    except Exception:  # noqa: BLE001 - not even that (ragged...)
        return True


class _Tensor:
    __slots__ = ("tensor", "version")

    def __init__(self, tensor: DeviceTensor, version: int) -> None:
        self.tensor, self.version = tensor, version


class _DeviceWorker:
    """One Bridge in one Ray actor; see devbridge.ray's module doc. Use ``DeviceWorker`` (the Ray actor class)
    or ``start_worker(...)``; this plain class also runs in-process (domain ``local-...``, generation 1)."""

    # Named where Ray (and docs/RAY.md) know it, devbridge.ray._DeviceWorker: Ray pickles the actor class by
    # reference to it, so a worker process imports devbridge.ray, where the TensorRefs it returns are
    # then found by name (cloudpickle pickles a class by value when its module is not imported).
    __module__ = "devbridge.ray"

    def __init__(self, backend: str = "host", device: str | None = None, *, ring_bytes: int = 64 << 20,
                 checkpoint: str | os.PathLike | None = None, restore_on_restart: bool = True,
                 tinygrad_device: str | None = None, direct: bool = True, adopt: bool = True,
                 **options: Any) -> None:
        self.domain, self.generation = _actor_identity()
        # Generations alone do not tell this process from an earlier one of the same worker: a hand-made bridge
        # restart moves a process past Ray's count, and the process Ray starts next numbers from that count again.
        self.incarnation = uuid.uuid4().hex
        kwargs: dict[str, Any] = dict(options)
        if device is not None:
            kwargs["device"] = device
        self.bridge = devbridge.Bridge(backend=backend, generation=self.generation, ring_bytes=ring_bytes, **kwargs)
        self.backend = self.bridge.backend  # the backend "auto" resolved to, not "auto"
        self._device = self.bridge.device
        self._closed = False
        info = self.bridge.backend_info()
        self._view_device = str(info.get("device_string", ""))
        # Exports read the allocation in place where numpy can (a view on the CPU; see _portable), and
        # another worker's export that arrives in Ray's object store is adopted as the tensor, no copy,
        # where the device takes host memory (Bridge.adopt; Unsupported elsewhere, then copied).
        self._direct = direct
        self._adopt = adopt
        self._tinygrad_device = tinygrad_device
        self._checkpoint_path = os.fspath(checkpoint) if checkpoint is not None else None
        self._tensors: dict[str, _Tensor] = {}
        self._lost: dict[str, tuple[int, int]] = {}  # name: (old, new generation) of a bridge restart that took it
        self._version = 0
        self._counts = {"puts": 0, "runs": 0, "gets": 0, "exports": 0, "imports": 0, "checkpoints": 0,
                        "restores": 0, "bytes_in": 0, "bytes_out": 0, "refused_handles": 0}
        self._restored_from: str | None = None
        self._restored_names: list[str] = []
        self._stale_removed: list[str] = []
        if self.generation > 1 and self._checkpoint_path is not None:
            # The previous process may have died in the middle of a checkpoint(): its temporary file (and
            # the replaced file's second name) would stay beside the checkpoint for good.
            self._stale_removed = _remove_interrupted_checkpoint_files(self._checkpoint_path)
        if (restore_on_restart and self.generation > 1 and self._checkpoint_path is not None
                and os.path.exists(self._checkpoint_path)):
            try:
                self.restore()
            except BaseException as error:
                # The worker does not come up: starting empty would silently drop the state it was started to
                # keep (and its next checkpoint would overwrite the file). Ray does not restart an actor whose
                # constructor raised, so this fails once, and wait_until_ready raises it at the driver.
                self.close()
                if isinstance(error, devbridge.CheckpointError):
                    raise devbridge.CheckpointError(
                        f"worker {self.domain} (generation {self.generation}, restarted by Ray) cannot restore "
                        f"its checkpoint: {error}. The worker stays down and the file is left as it is; start "
                        f"a new worker (with restore_on_restart=False or another checkpoint= to start empty)"
                    ) from error
                raise

    # ------------------------------------------------------------------------------- names and tokens

    def _ref(self, name: str) -> TensorRef:
        entry = self._tensors[name]
        return TensorRef(self.domain, self.generation, name, entry.version, entry.tensor.shape, entry.tensor.dtype,
                         self.incarnation)

    def _refuse(self, error: devbridge.BridgeError) -> devbridge.BridgeError:
        self._counts["refused_handles"] += 1
        return error

    def _follow_bridge(self) -> None:
        """Catches up with a restart of the worker's bridge made behind its back (``worker.bridge.restart(g)``):
        the restart retired every allocation of the old generation, so every named tensor is gone. The names
        are dropped (a later lookup says what took them; a ``put`` allocates anew) and the worker moves to the
        bridge's generation, so that its tokens and ``identity()`` agree with the bridge, and tokens issued
        before are refused (``OldGenerationHandle``)."""
        if self._closed or self.bridge.closed:
            return
        generation = self.bridge.generation
        if generation == self.generation:
            return
        for name, entry in self._tensors.items():
            entry.tensor.free()  # its handle is retired: marks it freed (and lets an adopted region go)
            self._lost[name] = (self.generation, generation)
        self._tensors.clear()
        self.generation = generation

    def _check_open(self, what: str) -> None:
        self._follow_bridge()
        if self._closed:
            raise devbridge.Closed(f"worker {self.domain} (generation {self.generation}) is closed (close() was "
                                   f"called) and holds nothing: {what} refused; start a new worker")

    def _check_name(self, name: Any, what: str) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"worker {self.domain}: {what}: a tensor name must be a non-empty str, not {name!r} "
                            f"({type(name).__name__})")

    def _lookup(self, key: Any) -> tuple[str, DeviceTensor]:
        self._follow_bridge()
        if self._closed:
            self._check_open(f"looking up {key!r}")
        if isinstance(key, str):
            entry = self._tensors.get(key)
            if entry is None:
                lost = self._lost.get(key)
                why = (f" (it was lost when the worker's bridge was restarted from generation {lost[0]} to "
                       f"{lost[1]}: a restart retires every allocation)" if lost else "")
                raise devbridge.UnknownDeviceHandle(
                    f"worker {self.domain} (generation {self.generation}) has no tensor named {key!r}{why}")
            return key, entry.tensor
        if isinstance(key, TensorRef):
            if key.domain != self.domain:
                raise self._refuse(devbridge.ForeignDomain(
                    f"{key!r} was issued by worker {key.domain}, not by this worker ({self.domain})"))
            if key.incarnation != self.incarnation:
                raise self._refuse(devbridge.OldGenerationHandle(
                    f"{key!r} was issued by an earlier process of worker {self.domain} (incarnation "
                    f"{key.incarnation or 'unknown'}); this process (incarnation {self.incarnation}, generation "
                    f"{self.generation}) was started since, by Ray after the earlier one died"))
            if key.generation < self.generation:
                raise self._refuse(devbridge.OldGenerationHandle(
                    f"{key!r} is from generation {key.generation}; worker {self.domain} is at generation "
                    f"{self.generation} (restarted since)"))
            if key.generation > self.generation:
                raise self._refuse(devbridge.ForeignDomain(
                    f"{key!r} is from generation {key.generation}, which this worker ({self.domain}, generation "
                    f"{self.generation}) never had"))
            entry = self._tensors.get(key.name)
            if entry is None or entry.version != key.version:
                raise self._refuse(devbridge.UnknownDeviceHandle(
                    f"{key!r}: the tensor has been {'deleted' if entry is None else 'replaced'} since"))
            return key.name, entry.tensor
        raise TypeError(f"worker {self.domain}: a tensor is named by a str or a devbridge.ray.TensorRef, not "
                        f"{type(key).__name__} ({key!r})")

    def _store(self, name: str, tensor: DeviceTensor) -> TensorRef:
        if not isinstance(name, str) or not name:
            tensor.free()
            raise TypeError(f"a tensor name must be a non-empty str, not {name!r}")
        old = self._tensors.get(name)
        self._version += 1
        self._tensors[name] = _Tensor(tensor, self._version)
        self._lost.pop(name, None)
        if old is not None and old.tensor is not tensor:
            old.tensor.free()  # deferred by the bridge while a view or tinygrad tensor still reads it
        return self._ref(name)

    # ------------------------------------------------------------------------------------ bytes in/out

    def _ingest(self, value: Any, dtype: Any = None, reuse: str | None = None, adopt: bool = False,
                what: str = "put") -> DeviceTensor:
        """A new DeviceTensor holding ``value`` (numpy array, PortableTensor, buffer), read in place; with
        ``adopt``, an object-store buffer becomes the tensor itself where the device shares host memory."""
        if isinstance(value, ray.ObjectRef):
            value = ray.get(value)
        if isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], ray.ObjectRef):
            value = ray.get(value[0])  # [ref]: Ray does not resolve a nested ref by itself
        if isinstance(value, TensorRef):
            raise self._refuse(devbridge.ForeignDomain(
                f"{what} takes a tensor's data (an array, or another worker's export: worker.export.remote(name)), "
                f"not the token {value!r}"))
        if value is None or isinstance(value, (str, Mapping)):
            raise TypeError(f"worker {self.domain}: {what} takes a numpy array, a PortableTensor or an ObjectRef of "
                            f"one, not {type(value).__name__}")
        if isinstance(value, PortableTensor):
            shape, name, src = value.shape, value.dtype if dtype is None else dtype, value._bytes
        else:
            try:
                a = _intake(value, what, any_layout=True)
            except ValueError as error:
                if isinstance(value, int) and not isinstance(value, bool) and _not_numbers(value):
                    raise ValueError(f"worker {self.domain}: {what} {reuse!r}: the int {value} is out of the range of "
                                     "every integer dtype (int64, uint64)") from error
                if not isinstance(value, np.ndarray) and _not_numbers(value):
                    raise TypeError(f"worker {self.domain}: {what} takes a numpy array, a PortableTensor or an "
                                    f"ObjectRef of one, not {type(value).__name__}") from error
                raise
            shape, name, src = a.shape, _dtype_name(a.dtype) if dtype is None else dtype, _flat_bytes(a)
        try:
            spec, extent = devbridge.spec_for_array(shape, name)
            source = PortableTensor(shape, spec.dtype, src)  # checks that the bytes are those of the shape and dtype
        except ValueError as error:
            if dtype is None:
                raise
            raise ValueError(f"worker {self.domain}: {what} {reuse!r}: dtype={dtype!r} does not fit the data "
                             f"({src.nbytes} bytes of shape {tuple(shape)}): {error}") from error
        shape, name = source.shape, source.dtype
        if adopt and self._adopt and shape and _in_object_store(src):
            # No copy at all: the object-store buffer (sealed, immutable) is the tensor's memory, read in
            # place by views, kernels and downloads, held until the tensor is replaced or deleted.
            try:
                return self.bridge.adopt(src.view(_numpy_dtype(name)).reshape(shape), dtype=name)
            except devbridge.Unsupported:
                self._adopt = False  # this device's memory is not host memory after all: copy
        # By the transfer planner's route (one copy from a registration of the source where that is cheap,
        # else through the ring in chunks), straight from the (shared-memory) source. Over the tensor of that
        # name when it has the same shape and dtype and nothing reads any allocation (no view, tinygrad tensor
        # or export alive): no new allocation to fault in.
        entry = self._tensors.get(reuse) if reuse is not None else None
        if (entry is not None and entry.tensor.shape == shape and entry.tensor.dtype == name
                and not entry.tensor.read_only and shape and not entry.tensor.freed
                and entry.tensor.handle.generation == self.bridge.generation and entry.tensor.ready()
                and self.bridge.stats()["live_views"] == 0):
            TransferPlanner(self.bridge).upload_into(entry.tensor.handle, 0, src)
            return entry.tensor
        return self.bridge.import_tensor(source)

    def _portable(self, tensor: DeviceTensor) -> PortableTensor:
        """The tensor's bytes as a PortableTensor: over device memory itself where numpy can read it (the
        copy into the object store is then the only one), else read out through the ring."""
        if self._direct and tensor.shape:
            try:
                view = tensor.view()
                if view.__dlpack_device__()[0] != 1:  # kDLCPU: numpy cannot read it in place
                    view.close()
                    return self.bridge.export(tensor)
                try:
                    a = np.from_dlpack(view)  # holds its own lease until Ray has serialized it
                finally:
                    view.close()
                if a.dtype == _numpy_dtype(tensor.dtype):
                    return PortableTensor(tensor.shape, tensor.dtype, _flat_bytes(a))
            except (BufferError, TypeError, RuntimeError, ValueError):
                pass
        return self.bridge.export(tensor)

    # ----------------------------------------------------------------------------------------- methods

    def identity(self) -> dict[str, Any]:
        """``{"domain", "generation", "incarnation", "backend", "device", "pid", "node_id"}`` (``incarnation``:
        this process's random id, also in its tokens; ``node_id`` None outside Ray; ``backend`` the one the bridge
        runs, what ``"auto"`` resolved to)."""
        self._follow_bridge()
        node = None
        if ray.is_initialized():  # else get_runtime_context() would start a local Ray instance
            try:
                node = ray.get_runtime_context().get_node_id()
            except Exception:  # noqa: BLE001 - not in a worker of this Ray version
                pass
        return {"domain": self.domain, "generation": self.generation, "incarnation": self.incarnation,
                "backend": self.backend,
                "device": self._device, "pid": os.getpid(), "node_id": node}

    def put(self, name: str, value: Any, *, dtype: Any = None) -> TensorRef:
        """Stores ``value`` (a numpy array, a PortableTensor, an ObjectRef of either) on the device as ``name``.

        An ObjectRef passed as the argument itself is resolved by Ray before the call: the array is then a
        zero-copy view of the object store's shared memory, and is staged from there (no host copy first).
        Copied, never adopted: what a worker is loaded with (weights, state) lives as long as the worker and
        must not hold object-store memory that long. A ``TensorRef`` is refused (``devbridge.ForeignDomain``:
        the token is not the data), as is what is no array (``None``, a str: ``TypeError``) and an empty array
        (``ValueError``: a device allocation cannot be empty). A bytes-like object is stored as ``uint8``."""
        self._check_open("put")
        self._check_name(name, "put")
        tensor = self._ingest(value, dtype, reuse=name)
        ref = self._store(name, tensor)
        self._counts["puts"] += 1  # counted once stored: a refused put counts nothing
        self._counts["bytes_in"] += tensor.nbytes
        return ref

    def import_(self, name: str, value: Any) -> TensorRef:
        """Stores a PortableTensor (typically another worker's ``export``, passed as its ObjectRef) as
        ``name``; any backend to any backend, bit-exact. A ``TensorRef`` is refused: hand over the export.

        Where the device takes host memory in place (``Bridge.adopt``: host; OpenCL over host memory) the
        object-store buffer is adopted: it becomes the tensor, read-only, with no copy, and stays pinned in the store until
        the tensor is replaced or deleted (hand-offs are replaced step by step). ``adopt=False`` at start copies."""
        self._check_open("import_")
        self._check_name(name, "import_")
        tensor = self._ingest(value, reuse=name, adopt=True, what="import_")
        ref = self._store(name, tensor)
        self._counts["imports"] += 1
        self._counts["bytes_in"] += tensor.nbytes
        return ref

    def get(self, key: Any) -> np.ndarray:
        """The tensor's contents as a numpy array (downloaded through the ring)."""
        _, tensor = self._lookup(key)
        self._counts["gets"] += 1
        self._counts["bytes_out"] += tensor.nbytes
        return self.bridge.download(tensor)

    def export(self, key: Any) -> PortableTensor:
        """The tensor as a PortableTensor. Called as ``worker.export.remote(name)``, the result is an
        ObjectRef to it in the object store, owned by the caller (it outlives this worker)."""
        _, tensor = self._lookup(key)
        self._counts["exports"] += 1
        self._counts["bytes_out"] += tensor.nbytes
        return self._portable(tensor)

    def handle(self, key: Any) -> TensorRef:
        """A token for the tensor ``key`` names (a name, or a TensorRef: checked, then its name) now (this
        generation, its current version)."""
        name, _ = self._lookup(key)
        return self._ref(name)

    def tensors(self) -> dict[str, dict[str, Any]]:
        """``{name: {"shape", "dtype", "nbytes", "version"}}``."""
        self._follow_bridge()
        return {name: {"shape": e.tensor.shape, "dtype": e.tensor.dtype, "nbytes": e.tensor.nbytes,
                       "version": e.version} for name, e in sorted(self._tensors.items())}

    def delete(self, key: Any) -> None:
        """Frees the tensor (deferred while anything still reads it); its tokens are refused afterwards."""
        name, tensor = self._lookup(key)
        del self._tensors[name]
        tensor.free()

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any] | Any, outputs: Sequence[str] | str,
            **kwargs: Any) -> list[TensorRef] | TensorRef:
        """``fn(*tensors, **kwargs)`` over tinygrad tensors of the named ``inputs`` (names, TensorRefs, or
        ObjectRefs of a TensorRef or a list of them: an earlier ``import_``'s or ``run``'s result, so calls chain
        without waiting); its results (one
        tinygrad Tensor, or a tuple/list of them) are stored on this worker's device as ``outputs``.

        On the host backend (and CUDA) the inputs are zero-copy views of device memory and each result is
        computed straight into a new allocation of this bridge (``assign``); elsewhere (OpenCL, whose
        buffers tinygrad cannot adopt) the inputs are read out through the ring and the results staged
        back. tinygrad's default device is set to the tensors' device for the call, so tensors ``fn``
        creates without ``device=`` land beside them. Returns a TensorRef (``outputs`` a str) or a list.

        All or nothing: the output names are checked (each a non-empty str, no two alike) before ``fn`` is
        called, and when ``fn`` raises, returns the wrong number of tensors or anything else (``None``:
        ``TypeError``), or a result cannot be stored, no output is stored and the run is not counted. (A
        ``ray.cancel`` of a run already running is no failure: Ray does not interrupt it, so it stores its
        outputs, while the caller's ``ray.get`` raises ``TaskCancelledError``.)"""
        self._check_open("run")
        if not callable(fn):
            raise TypeError(f"worker {self.domain}: run: fn must be callable (a function of tinygrad Tensors), not "
                            f"{type(fn).__name__}")
        single_in = isinstance(inputs, (str, TensorRef, ray.ObjectRef))
        if not single_in and not isinstance(inputs, (list, tuple)):
            raise TypeError(f"worker {self.domain}: run: inputs is a name, a TensorRef, an ObjectRef of tokens or a "
                            f"list of them, not {type(inputs).__name__}")
        keys = [inputs] if single_in else list(inputs)
        single_out = isinstance(outputs, str)
        try:
            names = [outputs] if single_out else list(outputs)
        except TypeError:
            raise TypeError(f"worker {self.domain}: run: outputs is a name (str) or a list of names, not "
                            f"{type(outputs).__name__}") from None
        for name in names:
            self._check_name(name, "run (outputs)")
        if len(set(names)) != len(names):
            raise ValueError(f"worker {self.domain}: run: outputs {names} name a tensor twice")
        expanded: list[Any] = []
        for key in keys:  # an ObjectRef of a list of tokens (an earlier run's outputs) stands for all of them
            key = ray.get(key) if isinstance(key, ray.ObjectRef) else key
            expanded.extend(key if isinstance(key, list) else [key])
        sources = [self._lookup(k) for k in expanded]
        from tinygrad import Tensor
        from tinygrad.helpers import Context

        zero_copy = self._view_device.upper().partition(":")[0] in ("CPU", "CUDA")
        device = self._tinygrad_device or (devbridge._tinygrad._tinygrad_device(self._view_device)
                                           if zero_copy else "CPU")
        what = f"worker {self.domain}: run: {_callable_name(fn)} for outputs {names}"
        args: list[Any] = []
        results: Any = None
        with Context(DEV=device):
            args = [self._tinygrad_input(name, tensor, device, zero_copy) for name, tensor in sources]
            try:
                results = fn(*args, **kwargs)
            except Exception as error:
                self._raise_run_failure(error, what, sources)
            if isinstance(results, Tensor):
                results = [results]
            elif isinstance(results, (list, tuple)):
                results = list(results)
            else:
                got = "None" if results is None else type(results).__name__
                raise TypeError(f"{what}: {_callable_name(fn)} returned {got}; it must return a tinygrad Tensor for "
                                f"each of the outputs {names} (one Tensor, or a tuple/list of them)")
            if len(results) != len(names):
                raise ValueError(f"{what}: {_callable_name(fn)} returned {len(results)} tensors")
            for result in results:
                if not isinstance(result, Tensor):
                    raise TypeError(f"{what}: fn must return tinygrad Tensors, not {type(result).__name__}")
            made: list[DeviceTensor] = []
            try:
                for result in results:
                    if zero_copy and result.shape:
                        dtype = devbridge.dtype_info(result.dtype)["name"]
                        spec, extent = devbridge.spec_for_array(result.shape, dtype)
                        out = DeviceTensor(self.bridge, _alloc_owned(self.bridge, spec, extent), result.shape, dtype)
                        made.append(out)
                        target = out.to_tinygrad()
                        target.assign(result.to(target.device)).realize()
                        devbridge.tinygrad_synchronize(target)
                        del target
                    else:
                        made.append(self._upload_result(result))
            except BaseException as error:
                for tensor in made:
                    tensor.free()
                if isinstance(error, Exception):  # fn's kernels run here, lazily: say whose they are
                    self._raise_run_failure(error, what, sources)
                raise
            finally:
                del args, results
        # The names were checked before fn ran: storing cannot fail halfway.
        refs = [self._store(name, tensor) for name, tensor in zip(names, made)]
        self._counts["runs"] += 1
        return refs[0] if single_out else refs

    def _tinygrad_input(self, name: str, tensor: DeviceTensor, device: str, zero_copy: bool) -> Any:
        """The tinygrad Tensor ``fn`` gets for the input ``name``: a zero-copy view, or a copy on ``device``. A dtype
        tinygrad cannot take here is ``devbridge.Unsupported`` naming the worker, the input and the dtype."""
        try:
            return tensor.to_tinygrad() if zero_copy else self._tinygrad_copy(tensor, device)
        except (devbridge.UnsupportedDType, devbridge.Unsupported) as error:
            raise devbridge.Unsupported(
                f"worker {self.domain}: run: input {name!r} is {tensor.dtype}, which tinygrad cannot take on "
                f"{device} here: {error.message}") from error

    def _raise_run_failure(self, error: Exception, what: str, sources: list[tuple[str, DeviceTensor]]) -> NoReturn:
        """Raises, for an exception out of ``fn`` or its kernels, one of the same type whose message starts with
        ``what`` (worker, fn, outputs), chained from it; where the type cannot be made from a message, the
        exception itself with ``what`` as a note. A kernel tinygrad's CPU device could not compile (its clang)
        over an input of a dtype numpy lacks (bfloat16, float8: clang lacks them on some targets) is
        ``devbridge.Unsupported`` naming those inputs and their dtypes."""
        import subprocess

        odd = [f"{name!r} ({tensor.dtype})" for name, tensor in sources if _bits_dtype(tensor.dtype) is not None]
        if isinstance(error, subprocess.CalledProcessError) and odd:
            compiler = error.cmd[0] if isinstance(error.cmd, (list, tuple)) and error.cmd else error.cmd
            raise devbridge.Unsupported(
                f"{what}: tinygrad could not compile a kernel over input {', '.join(odd)} for its CPU device "
                f"({compiler} exited with status {error.returncode}): this tinygrad lacks that dtype on this "
                "machine; cast it first (put it as another dtype)") from error
        try:
            again = type(error)(f"{what}: {error.message if isinstance(error, devbridge.BridgeError) else error}")
        except Exception:  # noqa: BLE001 - a type made from other arguments
            again = None
        if again is None:
            error.add_note(what)
            raise error
        raise again from error

    def _tinygrad_copy(self, tensor: DeviceTensor, device: str) -> Any:
        """A tinygrad Tensor on ``device`` holding a copy of ``tensor`` (read out through the ring), of its
        dtype bit for bit, whatever the dtype: one numpy lacks (bfloat16, float8), which tinygrad cannot take
        from numpy (ml_dtypes' types, or their raw bits where ml_dtypes is missing), goes in as its raw bits
        (the unsigned integers of its size) and is ``bitcast`` to tinygrad's dtype, as ``_upload_result``
        brings it back. A dtype this tinygrad lacks is ``devbridge.Unsupported`` naming it and the backend."""
        from tinygrad import Tensor, dtypes

        name = tensor.dtype
        tinygrad_name = devbridge.dtype_info(name).get("tinygrad_name")
        tinygrad_dtype = getattr(dtypes, tinygrad_name, None) if tinygrad_name else None
        if tinygrad_dtype is None:
            raise devbridge.Unsupported(
                f"worker {self.domain}: run: an input is {name}, for which this tinygrad has no dtype "
                f"(tinygrad.dtypes.{tinygrad_name}); a {self.backend} worker hands its inputs to tinygrad on "
                f"{device}: cast it first (put it as another dtype)")
        a = self.bridge.download(tensor)
        bits = _bits_dtype(name)
        if bits is None:
            return Tensor(a, device=device)
        return Tensor(a.view(bits), device=device).bitcast(tinygrad_dtype)

    def _upload_result(self, result: Any) -> DeviceTensor:
        """A tinygrad result staged onto the device through the ring, with its shape (a 0-d result stays 0-d)
        and its dtype bit for bit: one numpy lacks (bfloat16, float8), which tinygrad's ``numpy()`` converts
        to float32, is read as its raw bits (``bitcast`` to the unsigned integers of its size)."""
        from tinygrad import dtypes

        name = devbridge.dtype_info(result.dtype)["name"]
        a = result.numpy() if _bits_dtype(name) is None else None
        if a is None or _dtype_name(a.dtype) != name:
            unsigned = {1: dtypes.uint8, 2: dtypes.uint16, 4: dtypes.uint32, 8: dtypes.uint64}
            a = result.bitcast(unsigned[devbridge.dtype_info(name)["itemsize"]]).numpy()
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # not np.ascontiguousarray: that makes a 0-d array 1-d
        return self.bridge.upload(a, dtype=name, wait=True)

    def checkpoint(self, path: str | os.PathLike | None = None, *, names: Iterable[str] | str | None = None,
                   metadata: Mapping[str, str] | None = None) -> str:
        """Writes the named tensors (all by default; a str is one name) to a safetensors file
        (``devbridge.checkpoint``: atomic, checksummed); ``path`` defaults to the worker's ``checkpoint=``.
        ``metadata`` may not set the worker's own keys (``devbridge_ray_domain``, ``devbridge_ray_generation``:
        ``ValueError``). Returns the path."""
        self._check_open("checkpoint")
        target = self._path(path)
        if names is None:
            chosen = sorted(self._tensors)
        elif isinstance(names, (str, TensorRef)):
            chosen = [names]
        else:
            chosen = list(names)
        # Each key (a name or a TensorRef) checked, and stored under its tensor's name (never the token).
        tensors = dict(self._lookup(key) for key in chosen)
        extra = {"devbridge_ray_domain": self.domain, "devbridge_ray_generation": str(self.generation)}
        for key in (metadata or {}):
            if key in extra:
                raise ValueError(f"worker {self.domain}: checkpoint: metadata key {key!r} is the worker's own (it "
                                 f"records which worker and generation wrote the file); use another key")
        extra.update(metadata or {})
        self.bridge.checkpoint(target, tensors, metadata=extra)
        self._counts["checkpoints"] += 1
        return target

    def restore(self, path: str | os.PathLike | None = None) -> list[str]:
        """Loads a checkpoint (``path`` defaults to the worker's ``checkpoint=``): each tensor replaces the
        one of its name, in this generation (tokens issued before are refused). Returns the names."""
        self._check_open("restore")
        target = self._path(path)
        restored = self.bridge.restore(target)
        for name, tensor in restored.items():
            self._store(name, tensor)
        self._counts["restores"] += 1
        self._restored_from = target
        self._restored_names = sorted(restored)
        return self._restored_names

    def _path(self, path: str | os.PathLike | None) -> str:
        if path is None:
            if self._checkpoint_path is None:
                raise ValueError("no checkpoint path: pass one, or start the worker with checkpoint=PATH")
            return self._checkpoint_path
        return os.fspath(path)

    def stats(self) -> dict[str, Any]:
        """The worker's counters, identity and what it holds, with its bridge's ``stats()`` under ``"bridge"``
        (``{"closed": True}`` once ``close()`` was called: nothing held any more). ``stale_removed``: the
        temporary files of an interrupted checkpoint this worker removed when Ray restarted it."""
        return {**self.identity(), **self._counts, "restored_from": self._restored_from,
                "restored_names": list(self._restored_names), "tensors": len(self._tensors),
                "tensor_bytes": sum(e.tensor.nbytes for e in self._tensors.values()),
                "checkpoint_path": self._checkpoint_path, "stale_removed": list(self._stale_removed),
                "closed": self._closed, "bridge": {"closed": True} if self._closed else self.bridge.stats()}

    def ping(self) -> int:
        """The worker's generation (a cheap call to wait for a worker, or for its restart)."""
        self._follow_bridge()
        return self.generation

    def close(self) -> None:
        """Frees every tensor and closes the bridge (the actor itself stays until killed). Idempotent; then
        ``stats()``, ``identity()``, ``tensors()`` and ``ping()`` still answer, every other call raises
        ``devbridge.Closed`` naming the worker."""
        for entry in self._tensors.values():
            entry.tensor.free()
        self._tensors.clear()
        self._closed = True
        self.bridge.close()
