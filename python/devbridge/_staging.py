"""The staging layer: one-call upload/download, automatic safe release of ring ranges.

Everything here is pure Python over the bound ``Bridge``; see the "Staging"
section of docs/PYTHON.md.

* ``spec_for_array(shape, dtype, alignment=256)`` -> ``(ObjectSpec, extent)``,
  the extent rounded up to the alignment (also ``ObjectSpec.for_array``).
* ``upload(bridge, array, ...)`` / ``bridge.upload(array, ...)`` -> ``DeviceTensor``:
  the C++ transfer planner (``TransferPlanner``) moves the bytes by the route
  the backend makes cheapest: one copy from the array registered for the call
  where registering is cheap, else through the ring in chunks (so an array
  larger than the ring works), each chunk's range released by the bridge
  (``release_host_after``) once its copy completes.
* ``download(bridge, x, out=None, ...)`` / ``bridge.download(...)`` -> ``numpy.ndarray``,
  through the planner likewise.
* ``ReleaseQueue(bridge)``: a thin layer over ``bridge.release_host_after``
  (the core's one release-after-completion mechanism; ``release_when_safe`` is
  the same bound call) that remembers the events, to raise a failure once.
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import math
import numbers
import operator
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Iterable

import numpy as np

from ._devbridge import (MAX_RANK, Bridge, CopyEvent, DeviceHandle, HostRange, ObjectSpec, TransferPlanner,
                         _adopt_owned, _alloc_owned, _OwnedAllocation, _without_waiting_for_a_restart, dtype_info)
from ._errors import AllocationStillInUse, BridgeError, Closed, InvalidAlignment, InvalidRange, UnknownDeviceHandle
from ._intake import _bits_dtype, _dtype_name, _intake, _numpy_dtype

_U64_MAX = (1 << 64) - 1
_I64_MAX = (1 << 63) - 1
# How long cleanup after a failure waits for this call's own copies still in flight before leaving
# their ranges to the bridge (release_host_after: released once their copies end) and the allocation to a
# deferred free.
_CLEANUP_WAIT_S = 30.0


# ------------------------------------------------------------------------------------------- arguments
#
# What the bindings' argument helpers (python/src/arguments.hpp) check in C++, for the arguments the
# Python layer reads itself: TypeError for the wrong type, ValueError for a refused value.


def _checked_timeout(timeout: Any, what: str = "timeout") -> float | None:
    """Seconds to wait: None (or infinity) for as long as it takes; a negative or NaN number is refused."""
    if timeout is None:
        return None
    if isinstance(timeout, (bool, np.bool_)) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds or None, not {type(timeout).__name__}")
    seconds = float(timeout) if not isinstance(timeout, numbers.Integral) or timeout < 2**53 else math.inf
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"{what} must be a non-negative number of seconds, not {timeout!r}")
    return None if math.isinf(seconds) else seconds


def _checked_flag(value: Any, what: str) -> bool:
    """A bool (numpy's too); anything else is a TypeError, not read as true or false."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be a bool, not {type(value).__name__}")
    return bool(value)


def _checked_bridge(bridge: Any) -> None:
    if not isinstance(bridge, Bridge):
        raise TypeError(f"bridge must be a devbridge.Bridge, not {type(bridge).__name__}")


class _NotCopyable:
    """For Python objects that own device memory or a place in a stream: a copy would free, or consume,
    what the original still uses (copy.copy shares the handle), so copying and pickling are refused."""

    def __copy__(self):
        raise TypeError(f"a {type(self).__name__} cannot be copied: it owns its device memory (share the object)")

    def __deepcopy__(self, memo):
        self.__copy__()

    def __reduce__(self):
        raise TypeError(f"a {type(self).__name__} cannot be pickled: it owns device memory in this process "
                        f"(export it: bridge.export(...), or PortableTensor)")


# ------------------------------------------------------------------------------------------------ spec


def _checked_shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (str, bytes, bool, np.bool_, dict, set, frozenset)) or not (
            hasattr(type(shape), "__index__") or isinstance(shape, (collections.abc.Sequence, np.ndarray))):
        raise TypeError(f"shape must be an int or a sequence of ints, not {type(shape).__name__}")
    if isinstance(shape, (list, tuple)) and any(isinstance(d, (bool, np.bool_)) for d in shape):
        raise TypeError(f"shape {shape!r}: a dimension is a bool, not an int")
    try:
        dims = (operator.index(shape),)
    except TypeError:
        dims = tuple(operator.index(d) for d in shape)
    for d in dims:
        if d < 0:
            raise ValueError(f"shape {dims}: dimension {d} is negative")
        if d > _I64_MAX:  # as the bindings' dimensions (signed 64-bit): an int that does not fit
            raise OverflowError(f"shape {dims}: dimension {d} is past 2**63 - 1")
    return dims


def spec_for_array(shape: Any, dtype: Any, alignment: int = 256) -> tuple[ObjectSpec, int]:
    """An ``ObjectSpec`` for one array of ``shape`` and ``dtype`` and the extent to allocate.

    The extent is the array's byte size rounded up to ``alignment`` (a power of
    two), and is the spec's ``max_extent``. A shape whose byte size (or rounded
    extent) passes 2**64 - 1 raises ``OverflowError``; an empty shape (a zero
    dimension) raises ``ValueError`` (the contract allows no empty allocation), and so does one of more than
    ``MAX_RANK`` (8) dimensions (no view could be taken);
    an alignment that is not a power of two raises ``InvalidAlignment``, one that is no int ``TypeError``
    and one outside 0..2**64 - 1 ``OverflowError`` (as ``ObjectSpec``'s own).
    """
    dims = _checked_shape(shape)
    if len(dims) > MAX_RANK:
        # Refused here, where every tensor gets its shape: its views (DLPack, tinygrad) could never be taken.
        raise ValueError(f"an array of shape {dims} has {len(dims)} dimensions; a devbridge tensor has at most "
                         f"{MAX_RANK} (its views, DLPack and tinygrad take no more): reshape it first")
    name = _dtype_name(dtype)
    # The bindings' one conversion of a byte count (TypeError, OverflowError); the power of two is ours.
    alignment = ObjectSpec(max_extent=0, alignment=alignment, dtype=name).alignment
    if alignment == 0 or alignment & (alignment - 1):
        raise InvalidAlignment(f"alignment {alignment} is not a power of two")
    nbytes = math.prod(dims) * dtype_info(name)["itemsize"]
    if nbytes > _U64_MAX:
        raise OverflowError(f"an array of shape {dims} and dtype {name} is {nbytes} bytes, past 2**64 - 1")
    if nbytes == 0:
        raise ValueError(f"an array of shape {dims} is empty: a device allocation cannot be empty")
    extent = -(-nbytes // alignment) * alignment
    if extent > _U64_MAX:
        raise OverflowError(f"{nbytes} bytes rounded up to alignment {alignment} pass 2**64 - 1")
    return ObjectSpec(max_extent=extent, alignment=alignment, dtype=name), extent


# ----------------------------------------------------------------------------------------- ReleaseQueue


class ReleaseQueue(_NotCopyable):
    """Host ranges handed to the bridge (``bridge.release_host_after``), with their copies' failures to report.

    The bridge itself returns each range to the ring once its copy has
    completed or failed: nothing here has to run for that. The queue only
    remembers the events, so that ``reap()`` can raise a failed copy's error
    (once) and ``drain(timeout=None)`` can wait for all of them. As a context
    manager it drains on exit (and, when leaving on an exception, reaps
    without raising over it).
    """

    def __init__(self, bridge: Bridge) -> None:
        if bridge is None:
            raise TypeError("ReleaseQueue needs the bridge whose ring the ranges are in")
        self.bridge = bridge
        self._events: collections.deque[tuple[CopyEvent, bool]] = collections.deque()
        self._failures: list[BridgeError] = []

    def __len__(self) -> int:
        """Ranges whose copies have not ended yet (as far as the bridge has applied completions)."""
        return sum(1 for event, _ in self._events if self._status(event) == "pending")

    def __repr__(self) -> str:
        return f"ReleaseQueue({len(self)} pending)"

    def add(self, range: HostRange, event: CopyEvent, *, report: bool = True) -> None:
        """Hands ``range`` to the bridge, released once ``event`` completes or fails. ``report=False``: a failure
        is not raised by reap()."""
        report = _checked_flag(report, "report")
        if not isinstance(range, HostRange):
            raise TypeError(f"range must be a HostRange, not {type(range).__name__}")
        if not isinstance(event, CopyEvent):
            raise TypeError(f"event must be a CopyEvent, not {type(event).__name__}")
        self.bridge.release_host_after(range, event)
        self._events.append((event, report))

    def _status(self, event: CopyEvent) -> str:
        try:
            return self.bridge.copy_status(event)
        except BridgeError:  # Closed, OldGenerationHandle: over, its range no longer the ring's
            return "gone"

    def reap(self, *, raise_failures: bool = True) -> int:
        """Forgets every event whose copy ended (its range is back); returns how many. Raises the first new
        failure once."""
        raise_failures = _checked_flag(raise_failures, "raise_failures")
        settled = 0
        if self._events:
            try:
                self.bridge.poll()  # applies completions (and with them the bridge's releases)
            except BridgeError:
                pass  # closed or broken: the statuses below say what is over
            keep: collections.deque[tuple[CopyEvent, bool]] = collections.deque()
            for event, report in self._events:
                status = self._status(event)
                if status == "pending":
                    keep.append((event, report))
                    continue
                settled += 1
                if status == "failed" and report:
                    try:
                        self.bridge.wait(event)
                    except BridgeError as error:
                        self._failures.append(error)
            self._events = keep
        if raise_failures and self._failures:
            raise self._failures.pop(0)
        return settled

    def drain(self, timeout: float | None = None) -> bool:
        """Waits until every copy has ended (True) or ``timeout`` seconds pass (False); raises a failure once."""
        timeout = _checked_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        for event, _ in list(self._events):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                if self.bridge.wait(event, timeout=left) == "pending":
                    break
            except BridgeError:
                pass  # reaped below
        self.reap()
        return not self._events

    def __enter__(self) -> ReleaseQueue:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.drain()
        else:
            self.reap(raise_failures=False)


# --------------------------------------------------------------------------------------------- helpers


def _chunk_error(error: BridgeError, what: str, index: int, offset: int, n: int, total: int,
                 handle: DeviceHandle) -> BridgeError:
    # Worded as the planner words a chunk that failed at submit (ring_chunks.cpp), so the same failure reads
    # the same whether upload's own wait met it or tensor.wait() did; the tensor starts at device offset 0.
    new = type(error)(f"{what} chunk {index} (bytes {offset}..{offset + n} of {total}, device offset {offset} of "
                      f"handle {{domain {handle.domain}, generation {handle.generation}, id {handle.id:#x}}}): "
                      f"{error.message}")
    new.fatal = getattr(error, "fatal", False)
    return new


def _cleanup(bridge: Bridge, events: Iterable[CopyEvent]) -> None:
    """After a failure: waits (bounded) for this call's copies still in flight. Their ranges were handed to
    ``bridge.release_host_after``: the bridge releases each as its copy ends, within this wait or later."""
    deadline = time.monotonic() + _CLEANUP_WAIT_S
    for event in events:
        try:
            bridge.wait(event, timeout=max(0.0, deadline - time.monotonic()))
        except BridgeError:
            pass


def _free_or_release(bridge: Bridge, handle: DeviceHandle) -> None:
    try:
        bridge.free(handle)
    except AllocationStillInUse:
        bridge.release(handle)  # copies still in flight: freed when they end
    except (Closed, BridgeError):
        pass


def _release_owned(owner: _OwnedAllocation) -> None:
    """After a failure: lets go of an allocation the call made (freed at once, or once the copies still in
    flight into it end); nothing to do where the bridge closed or restarted meanwhile."""
    try:
        owner.release()
    except BridgeError:
        pass


# ---------------------------------------------------------------------------------------- DeviceTensor


class _OwnsNothing:
    """The owner of a borrowed DeviceTensor (``DeviceTensor._borrowing``): releasing it releases nothing."""

    @staticmethod
    def release() -> None:
        pass


class DeviceTensor(_NotCopyable):
    """A device allocation holding one array: its handle, shape and dtype, and the copies that filled it.

    Made by ``bridge.upload(array)``. ``ready()`` / ``wait()`` tell when the
    upload's copies have completed (once they have, the tensor forgets them);
    ``view()``, ``to_tinygrad()``, DLPack and
    ``numpy()`` read the data (each waits for the upload first). ``free()``
    ends it: the allocation is freed at once, or, when a view, tinygrad tensor
    or DLPack array still reads it, as soon as the last of them is gone. As a
    context manager it frees on exit, and a tensor dropped without ``free()``
    is freed when it is collected (its handle, kept apart from it, then no
    longer names an allocation).

    ``handle`` is a ``DeviceHandle`` or an ``_OwnedAllocation`` (what the
    staging layer's own calls get from C++: the allocation is owned from the
    moment the call returns, so an exception such as Ctrl-C before the tensor
    exists releases it instead of leaking it); the tensor keeps the owner.
    """

    def __init__(self, bridge: Bridge, handle: DeviceHandle | _OwnedAllocation, shape: tuple[int, ...], dtype: str,
                 events: list[tuple[CopyEvent, int, int]] | None = None, *, landing: Future | None = None) -> None:
        self._start(bridge, handle, tuple(shape), _dtype_name(dtype), list(events or []), landing)

    def _start(self, bridge: Bridge, handle: DeviceHandle | _OwnedAllocation, shape: tuple[int, ...], dtype: str,
               events: list[tuple[CopyEvent, int, int]], landing: Any) -> None:
        # The owner (when the allocation came as one): dropped with the tensor, it releases the allocation
        # even where free() never runs (the tensor dropped half-made); free() releases through it.
        self._owner = handle if isinstance(handle, _OwnedAllocation) else None
        self.bridge = bridge
        self._handle = handle if self._owner is None else handle.handle
        self.shape = shape
        self.dtype = dtype
        self._events = events  # (event, chunk offset, chunk length); emptied once all of them completed
        # A tensor another thread is still filling (restore(wait=False)): resolves to the copies it submitted,
        # or to the error that stopped it before this tensor's bytes were submitted.
        self._landing = landing
        self._freed = False
        self._region = None  # adopt(): the _AdoptedRegion the tensor lies in, let go once the tensor is freed

    @classmethod
    def _made(cls, bridge: Bridge, handle: DeviceHandle | _OwnedAllocation, shape: tuple[int, ...], dtype: str,
              landing: Any) -> DeviceTensor:
        """As the constructor, for a ``shape`` tuple and a devbridge ``dtype`` name already checked (a
        restore's thousands of tensors, from the checkpoint header): nothing converted or looked up."""
        tensor = cls.__new__(cls)
        tensor._start(bridge, handle, shape, dtype, [], landing)
        return tensor

    @classmethod
    def _borrowing(cls, tensor: DeviceTensor) -> DeviceTensor:
        """A tensor over ``tensor``'s allocation that owns nothing: freeing or dropping it leaves the allocation
        to ``tensor``. For a consumer that needs an object of its own per use (Ray keeps one per ref). It is
        made once ``tensor``'s upload completed: those copies stay ``tensor``'s to wait for."""
        tensor.wait()
        borrowed = cls._made(tensor.bridge, tensor.handle, tensor.shape, tensor.dtype, None)
        borrowed._owner = _OwnsNothing
        return borrowed

    @property
    def handle(self) -> DeviceHandle:
        """The allocation's handle. A tensor a restore is still filling (``restore(wait=False)``) hands it
        out once its bytes have landed (raising the restore's error if it stopped first): a download, view
        or checkpoint of the bare handle before then read the allocation before its bytes were there."""
        if self._landing is not None:
            self._landed(None)
        return self._handle

    @property
    def read_only(self) -> bool:
        """True for a tensor over adopted host memory (``bridge.adopt``): nothing may be written into it."""
        return self._region is not None

    @property
    def device(self) -> str:
        """Where the tensor lives: its bridge's device, ``"<backend>:<device_id>"``."""
        return self.bridge.device

    @property
    def itemsize(self) -> int:
        return dtype_info(self.dtype)["itemsize"]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def freed(self) -> bool:
        return self._freed

    def _check(self) -> None:
        if self._freed:
            raise Closed(f"the DeviceTensor over {self._handle!r} has been freed")

    @contextlib.contextmanager
    def _freed_meanwhile_is_closed(self):
        """A call on the tensor that another thread's ``free()`` overtook after ``_check``: the bridge no longer
        knows the handle, and the caller is told what a call after the free is told (``Closed``), not
        ``UnknownDeviceHandle``."""
        try:
            yield
        except UnknownDeviceHandle as error:
            if not self._freed:
                raise
            raise Closed(f"the DeviceTensor over {self._handle!r} was freed (by another thread) during the "
                         "call") from error

    def _check_current(self) -> None:
        """Raises what the bridge says of the tensor's handle once it names no allocation of the bridge's
        current generation: ``OldGenerationHandle`` after a restart (the handle and both generations, as any
        use of ``handle`` says), ``Closed`` naming the handle after close. Two attributes compared; the
        bridge is asked only when they differ."""
        bridge = self.bridge
        try:
            generation = bridge.generation
        except Closed:
            raise Closed(f"the DeviceTensor over {self._handle!r}: the bridge is closed") from None
        if self._handle.generation != generation:
            bridge.extent(self._handle)  # OldGenerationHandle: "handle {...} is from generation g, the bridge is at h"

    def _raise_failure(self, index: int, event: CopyEvent, offset: int, n: int) -> None:
        try:
            self.bridge.wait(event)
        except BridgeError as error:
            raise _chunk_error(error, "upload", index, offset, n, self.nbytes, self._handle) from error

    def _landed(self, timeout: float | None) -> bool:
        """Whether the thread filling the tensor has submitted all of its copies (waiting up to ``timeout``
        seconds); raises the error that stopped it first."""
        if self._landing is None:
            return True
        try:
            events = self._landing.result(timeout)
        except FutureTimeout:
            return False
        self._events.extend(events)
        self._landing = None
        return True

    def ready(self) -> bool:
        """True once every copy of the upload has completed (the tensor then forgets them); raises the failure
        of one that failed. After a restart or close, what any use of the tensor raises
        (``OldGenerationHandle`` or ``Closed``, naming its handle), whether or not its upload had finished."""
        self._check()
        self._check_current()
        if self._landing is not None and not (self._landing.done() and self._landed(0)):
            return False
        events = self._events
        pending = False
        for index, (event, offset, n) in enumerate(events):
            status = self.bridge.copy_status(event)
            if status == "failed":
                self._raise_failure(index, event, offset, n)
            if status == "pending":
                pending = True
        if pending:
            return False
        if events:
            self._events = []  # all completed: no later call asks the bridge about them again
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the upload's copies: True when all completed (the tensor then forgets them), False if
        ``timeout`` (seconds) passed first.

        A failed copy raises its error (``DeviceCopyFailed``) naming the chunk. After a restart or close it
        raises as ``ready()`` does (``OldGenerationHandle`` or ``Closed``, naming the tensor's handle)."""
        timeout = _checked_timeout(timeout)
        self._check()
        self._check_current()
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._landed(timeout):
            return False
        events = self._events
        done = True
        for index, (event, offset, n) in enumerate(events):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                status = self.bridge.wait(event, timeout=left)
            except BridgeError as error:
                raise _chunk_error(error, "upload", index, offset, n, self.nbytes, self._handle) from error
            done = done and status == "completed"
        if done and events:
            self._events = []  # all completed: later waits (numpy(), view(), DLPack) ask the bridge nothing
        return done

    def view(self, *, wait: bool = True):
        """A ``TensorView`` of the whole array (it waits for the upload unless ``wait=False``)."""
        self._check()
        with self._freed_meanwhile_is_closed():
            if wait:
                self.wait()
            return self.bridge.view(self._handle, self.dtype, self.shape, wait=wait)

    def to_tinygrad(self):
        """A zero-copy tinygrad Tensor over the allocation (see ``TensorView.to_tinygrad``)."""
        with self.view() as view:
            return view.to_tinygrad()

    def __dlpack__(self, **kwargs: Any):
        with self.view() as view:
            return view.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        with self.view() as view:
            return view.__dlpack_device__()

    def numpy(self, out: np.ndarray | None = None) -> np.ndarray:
        """Downloads the array into a fresh numpy array (or ``out``)."""
        self._check()
        with self._freed_meanwhile_is_closed():
            return download(self.bridge, self, out)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """numpy's protocol (``np.asarray(t)``, ``np.sum(t)``): a download, as ``numpy()``, so always a copy:
        ``copy=False`` is ``ValueError`` (``np.from_dlpack(t)`` reads it in place where device memory is host
        memory). Without it numpy made a 0-d object array holding the tensor."""
        if copy is not None and not copy:
            raise ValueError("Unable to avoid copy while creating an array as requested: a DeviceTensor's bytes "
                             "are the device's, and np.asarray downloads them; np.from_dlpack(tensor) reads them "
                             "in place where device memory is host memory")
        a = self.numpy()
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)

    def free(self) -> None:
        """Frees the allocation (deferred while views, tinygrad tensors or DLPack arrays still read it). Idempotent.
        A tensor a restore is still filling (``restore(wait=False)``) is let go by the restore's reader once its
        bytes have landed (or the reading ended): freed at once, the reader would find its allocation gone and
        fail the whole restore. Nothing here waits for the reader."""
        if self._freed:
            return
        landing = self._landing
        # Not landed, or the reading failed first: let go by the reader once it ends (at once if it has).
        if landing is not None and self._owner is not None and not landing.landed_quietly():
            landing.release_when_landed(self._owner)
            self._freed = True
            return
        if landing is not None:
            with contextlib.suppress(Exception):  # the reading's error is the restore's to raise, not free()'s
                self._landed(0)  # its copies, for the poll below
        self._release()

    def _release(self) -> None:
        """What ``free()`` does once no restore's reader writes the tensor: what a subclass that owns its
        allocation otherwise (a Prefetcher's batch) overrides."""
        if self._freed:
            return
        self._freed = True
        if self.bridge.closed:
            return
        for event, _, _ in self._events:  # a copy in flight pins it; the deferred free waits for it
            try:
                self.bridge.copy_status(event)
            except BridgeError:
                pass
        try:
            if self._owner is not None:
                self._owner.release()
            else:
                self.bridge.release(self._handle)
        except BridgeError:
            pass  # a restart retired it already, or the bridge closed
        # An adopted tensor's region goes with the last tensor in it: now, or (a view still reads the
        # tensor) once the bridge lets go of it.
        if self._region is not None:
            self._region.drop()
            self._region = None

    def __enter__(self) -> DeviceTensor:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.free()

    def __del__(self) -> None:
        # Dropped without free(): the allocation goes as the memory of any Python object does (deferred while a
        # view, DLPack array or tinygrad tensor from it still reads it). Never raises: it may run at any point.
        # Never waiting for a restart: the collector may run this on a thread the restart itself waits for (a
        # checkpoint's checksum thread starting up inside the restart's in-place read), and the restart frees
        # the allocation anyway.
        try:
            if not getattr(self, "_freed", True):
                _without_waiting_for_a_restart(self.free)
        except BaseException:  # noqa: BLE001 - a closed bridge, an interpreter shutting down
            pass

    def __repr__(self) -> str:
        landing = self._landing is not None and not self._landing.landed_quietly()
        state = "freed" if self._freed else ("pending" if landing or self._events and not self._all_done() else "ready")
        return f"DeviceTensor(shape={self.shape}, dtype={self.dtype!r}, handle={self._handle!r}, {state})"

    def _all_done(self) -> bool:
        try:
            return all(self.bridge.copy_status(e) != "pending" for e, _, _ in self._events)
        except BridgeError:
            return True


# ------------------------------------------------------------------------------------- upload/download


class _AdoptedRegion:
    """A buffer registered for adoption, shared by every tensor adopted from it: adopting the same buffer
    again (one object-store object imported twice) reuses the registration, which a second one would
    overlap."""

    _live: dict[tuple[int, int, int, int], _AdoptedRegion] = {}

    def __init__(self, key: tuple[int, int, int, int], region: Any) -> None:
        self.key, self.region, self.tensors = key, region, 0

    @classmethod
    def of(cls, bridge: Bridge, flat: np.ndarray) -> _AdoptedRegion:
        key = (bridge.domain, bridge.generation, flat.__array_interface__["data"][0], flat.nbytes)
        found = cls._live.get(key)
        if found is None or not found.region.registered:
            found = cls._live[key] = cls(key, bridge.register_host(flat, writable=False))
        return found

    def drop(self) -> None:
        self.tensors -= 1
        if self.tensors == 0:
            if self._live.get(self.key) is self:
                del self._live[self.key]
            self.region = None  # unregistered now, or once the bridge lets go (a view still reads)


def adopt(bridge: Bridge, array: Any, *, dtype: Any = None) -> DeviceTensor:
    """The array's own memory as a read-only ``DeviceTensor``, with no copy, where the bridge's device
    addresses host memory (the host backend): an immutable buffer (a Ray object-store array, a read-only
    mmap) becomes a tensor that views, tinygrad, DLPack and downloads read in place. A writable array
    raises ``ValueError``: mark it read-only first (``a.flags.writeable = False``) if nothing writes it.

    The array is registered read-only (``register_host(array, writable=False)``) and held until the tensor
    is freed and no view reads it any more. Writes into the tensor are refused (``InvalidRange``), its
    DLPack export carries the read-only flag. ``Unsupported`` on a backend whose device memory is not host
    memory (stage with ``upload`` there); ``ValueError`` for an empty array, one that is not C-contiguous,
    or ``dtype`` of another item size than the array's.
    """
    _checked_bridge(bridge)
    a = _intake(array, "adopt", dtype, copy=False)
    if a.flags.writeable:
        # Views, DLPack arrays and lazy tinygrad graphs read adopted memory in place, whenever they run: a
        # write through the caller's array would change them under their feet (as adopt_host refuses a
        # writable region, and the bridge refuses an upload under a live view).
        raise ValueError(f"adopt: the array (shape {a.shape}, {a.dtype}) is writable; only memory nothing "
                         "writes while the tensor lives can be adopted: mark it read-only "
                         "(a.flags.writeable = False) if nothing writes it, or upload a copy (bridge.upload(a))")
    name = _dtype_name(a.dtype)
    spec_for_array(a.shape, name)  # the shape's checks: an empty array raises ValueError
    # The largest alignment both the address and the length keep (a power of two, at most 256): the
    # adopted allocation's extent is exactly the array's bytes.
    address = a.__array_interface__["data"][0]
    alignment = min(256, (address | a.nbytes) & -(address | a.nbytes))
    spec = ObjectSpec(max_extent=a.nbytes, alignment=alignment, dtype=name)
    shared = _AdoptedRegion.of(bridge, a.reshape(-1).view(np.uint8))
    shared.tensors += 1
    tensor = None
    try:
        # Owned from the moment adopt_host returns: an exception before the tensor keeps it releases it.
        tensor = DeviceTensor(bridge, _adopt_owned(bridge, shared.region, spec), a.shape, name)
        tensor._region = shared
    except BaseException:
        if tensor is None or tensor._region is None:  # the tensor never took its share of the region
            shared.drop()
        raise
    return tensor



def upload(bridge: Bridge, array: Any, *, dtype: Any = None, alignment: int = 256, wait: bool = False) -> DeviceTensor:
    """Copies a C-contiguous array into a new device allocation; returns its ``DeviceTensor``.

    ``array``: numpy, any DLPack producer in host memory (a torch or jax CPU
    tensor, bfloat16 and float8 included) or a buffer (``bytes``...), read in
    place; a big-endian array is converted to little-endian (its values kept);
    one on a device is ``ValueError``. The bytes go through the ring in chunks (at most a quarter of the ring
    each), so an array larger than the ring works; each chunk's range goes
    back to the ring as soon as its copy completes. ``dtype`` relabels the
    bytes (same itemsize: e.g. ``uint16`` bits as ``"bfloat16"``); nothing is
    converted. ``wait=True`` returns once every copy has completed (else
    ``tensor.wait()``/``ready()`` tell). An empty array raises ``ValueError``,
    a non-contiguous one ``ValueError``. On any failure the ring ranges go
    back, the allocation is freed and the error names the chunk.
    """
    _checked_bridge(bridge)
    wait = _checked_flag(wait, "wait")
    a = _intake(array, "upload", dtype)
    name = _dtype_name(a.dtype)
    spec, extent = spec_for_array(a.shape, name, alignment)
    return _upload(bridge, a.shape, name, spec, extent, a.reshape(-1).view(np.uint8), wait)


def _upload(bridge: Bridge, shape: tuple[int, ...], name: str, spec: ObjectSpec, extent: int,
            data: Any, wait: bool) -> DeviceTensor:
    """A new allocation of ``extent`` bytes of ``spec`` holding ``data`` (a C-contiguous buffer of the bytes of
    ``shape`` elements of ``name``): a ``DeviceTensor``. The transfer planner chooses the route (a registered
    copy where registering is cheap, ring chunks elsewhere); without ``wait``, ring-chunk copies may still be
    in flight (``DeviceTensor.wait``/``ready``). On any failure the allocation is freed and the error names
    the chunk. The allocation comes back owned (``_OwnedAllocation``): an exception between the call and
    the tensor (Ctrl-C) releases it."""
    planner = TransferPlanner(bridge)
    if wait:
        return DeviceTensor(bridge, planner._upload_owned(data, spec, extent), shape, name)
    owner, pending = planner._submit_upload_owned(data, spec, extent)
    return DeviceTensor(bridge, owner, shape, name, pending)


def _fill_new(bridge: Bridge, shape: tuple[int, ...], name: str, spec: ObjectSpec, extent: int, wait: bool,
              stage: Callable[[DeviceHandle], list[tuple[CopyEvent, int, int]]]) -> DeviceTensor:
    """Allocates ``extent`` bytes of ``spec`` and fills them with ``stage(handle)`` (which returns the copies
    still in flight as ``(event, offset, length)``): a ``DeviceTensor`` of ``shape`` and dtype ``name``, for
    sources the planner does not read itself (a file, another bridge's tensor). On any failure the
    allocation is freed (deferred while copies still pin it); it is owned from the moment it is made
    (``_OwnedAllocation``), so an exception anywhere (Ctrl-C) leaves nothing allocated."""
    owner = _alloc_owned(bridge, spec, extent)
    events: list[tuple[CopyEvent, int, int]] = []
    try:
        events = stage(owner.handle)
        tensor = DeviceTensor(bridge, owner, shape, name, events)
        if wait:
            tensor.wait()
        return tensor
    except BaseException:
        _cleanup(bridge, [e for e, _, _ in events])  # a failed wait: its other copies may be in flight
        _release_owned(owner)
        raise


def _stage_into(bridge: Bridge, a: np.ndarray, handle: DeviceHandle, offset: int = 0) -> list[tuple[CopyEvent, int, int]]:
    """Copies the bytes of the C-contiguous array ``a`` into ``handle`` from ``offset`` by the planner's route,
    without waiting for ring-chunk copies: their ``(event, offset, length)`` (offsets from ``a``'s start), as
    ``DeviceTensor`` keeps them. Each chunk's range goes back to the ring once its copy is done."""
    return TransferPlanner(bridge).submit_upload(a.reshape(-1).view(np.uint8), into=handle, offset=offset)[1]


def download(bridge: Bridge, x: Any, out: np.ndarray | None = None, *, dtype: Any = None,
             shape: Any = None) -> np.ndarray:
    """Copies a ``DeviceTensor`` (or a ``DeviceHandle`` with ``dtype``/``shape``) into a numpy array.

    For a handle, ``dtype`` defaults to the allocation's (``uint8`` for an
    untyped one) and ``shape`` to the whole extent as a vector. A shape past
    a tensor's bytes is ``ValueError`` (the rounded allocation beyond them
    holds none of its data); past a handle's extent, ``InvalidRange``. bfloat16 and float8 come back
    as ml_dtypes' types when ml_dtypes is installed, else as their bits
    (``uint16``/``uint8``). ``out``, when given, must be a writable
    C-contiguous numpy array of that shape (or size) and dtype (or those bits).
    Chunked through the ring like ``upload``; on failure every ring range goes
    back and the error names the chunk.
    """
    _checked_bridge(bridge)
    if isinstance(x, DeviceTensor):
        x._check()
        x.wait()
        handle = x.handle
        name = x.dtype if dtype is None else _dtype_name(dtype)
        limit, what = x.nbytes, f"the tensor's {x.nbytes} bytes (shape {x.shape} {x.dtype})"
    elif isinstance(x, DeviceHandle):
        handle = x
        name = _handle_dtype(bridge, x) if dtype is None else _dtype_name(dtype)
        limit = bridge.extent(x)
        what = f"the {limit} bytes of {x!r}"
    else:
        raise TypeError(f"download takes a DeviceTensor or a DeviceHandle, not {type(x).__name__}")
    if shape is not None:
        dims = _checked_shape(shape)
    elif isinstance(x, DeviceTensor) and dtype is None:
        dims = x.shape
    else:
        dims = _whole(limit, name, what)
    np_dtype = _numpy_dtype(name)
    nbytes = math.prod(dims) * np_dtype.itemsize
    if nbytes > limit:
        # A tensor's size is the staging layer's; an allocation's extent is the bridge's (the contract's kind).
        error = ValueError if isinstance(x, DeviceTensor) else InvalidRange
        raise error(f"download of shape {dims} {name} ({nbytes} bytes) is larger than {what}")
    if out is None:
        out = np.empty(dims, dtype=np_dtype)
    else:
        if not isinstance(out, np.ndarray):
            raise TypeError(f"out must be a numpy.ndarray, not {type(out).__name__}")
        if isinstance(out, np.ma.MaskedArray):  # its mask would hide what lands under it
            raise TypeError(f"out is a numpy masked array (numpy.ma.MaskedArray, shape {out.shape}): a download "
                            "writes values, no mask; pass out.data (the array under the mask) or a plain array")
        bits = _bits_dtype(name)
        if out.dtype != np_dtype and (bits is None or out.dtype != bits):
            raise ValueError(f"out has dtype {out.dtype}, the data is {name} ({np_dtype})")
        if out.size != math.prod(dims):
            raise ValueError(f"out has {out.size} elements (shape {out.shape}), the data has shape {dims}")
        if not out.flags.c_contiguous:
            raise ValueError(f"out (shape {out.shape}, strides {out.strides}) is not C-contiguous")
        if not out.flags.writeable:
            raise ValueError("out is read-only")
    if nbytes == 0:
        return out
    TransferPlanner(bridge).download(handle, 0, out.reshape(-1).view(np.uint8))
    return out


def _handle_dtype(bridge: Bridge, handle: DeviceHandle) -> str:
    """The dtype a handle's bytes read as: its allocation's, ``uint8`` for an untyped one (``"bytes"``)."""
    name = bridge.spec(handle).dtype
    return "uint8" if name == "bytes" else name


def _whole(nbytes: int, name: str, what: str) -> tuple[int]:
    """The shape of ``nbytes`` as a vector of ``name``; ``ValueError`` when they are no whole number of it."""
    itemsize = dtype_info(name)["itemsize"]
    if nbytes % itemsize:
        raise ValueError(f"{what} are not a whole number of {name} ({itemsize} bytes); give a shape")
    return (nbytes // itemsize,)




__all__ = ["DeviceTensor", "ReleaseQueue", "download", "spec_for_array", "upload"]
