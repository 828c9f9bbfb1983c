"""devbridge as a Ray Direct Transport (RDT): device tensors pass between actors by ObjectRef, out of the object store.

    import ray
    import devbridge.ray_transport as rt           # registers the "devbridge" transport: import it before
                                                   # creating the actors, in the process that creates them
    from devbridge.ray import init_local
    init_local()                                   # ray.init() on 127.0.0.1 (or join a cluster: ray.init(address=...))
    a, b = rt.start_worker("host"), rt.start_worker("opencl")
    a.put.remote("x", np.ones((1024, 1024), np.float32))
    b.accept.remote("x", a.share.remote("x"))       # A's device -> shared memory -> B's device; no object store

Any actor method decorated ``@ray.method(tensor_transport="devbridge")`` may return ``DeviceTensor``s (alone,
in a list, inside any picklable structure); everything else in the return value goes through Ray as usual.

Receiving is narrower: the ref may go to the driver's ``ray.get``, or as an argument to a task of an actor
created with ``enable_tensor_transport=True`` (``RDTDeviceWorker``, a class with an RDT method, or
``@ray.remote(enable_tensor_transport=True)``). Ray runs the receive on the actor's ``_ray_system``
concurrency group; an actor created without it (a plain ``@ray.remote`` class, ``devbridge.ray.DeviceWorker``)
has none, and the receive can queue behind the very task waiting for it: that actor hangs for good. This
transport cannot refuse the submission (Ray may ask it from a native callback, where raising crashes the
process), so it logs an error naming the actor where the task is submitted. Hand off to such actors with
``export``/``import_``. A remote function (not an actor) given the ref fails with Ray's ``RaySystemError``.

How the bytes move (one node):

* The method returns: Ray hands the DeviceTensors to ``extract_tensor_transport_metadata`` on the sender,
  which writes them once into a shared-memory segment, an anonymous ``memfd`` the sender holds open: at a
  view's address on the host backend (one copy, split across threads), through the ring elsewhere. The
  ObjectRef carries only where the segment is (sender pid and fd, inode), a token, offsets, shapes, dtypes.
* A receiver (an actor with tensor transport given it as an argument, the driver in ``ray.get``) opens the
  segment through ``/proc/<sender pid>/fd/<fd>``, maps it read-only and gets a ``SegmentTensor`` (a
  ``PortableTensor``) over the mapping: no copy. ``RDTDeviceWorker.accept`` puts it on that worker's
  device: adopted in place wherever the bridge adopts host memory (``Bridge.adopt``: no copy, a read-only
  tensor; the host backend, and OpenCL over host memory such as PoCL), copied once where it cannot (CUDA)
  or with ``adopt=False``. A receiver holds a shared ``flock`` on the segment for as long as anything maps
  it, through one file descriptor per segment (the mapping's): ``RLIMIT_NOFILE`` bounds how many received
  segments a process keeps. A sender holds two per segment it keeps (live, draining or pooled).
* When Ray's reference counting frees the ref, ``garbage_collect`` on the sender recycles the segment:
  once no receiver holds it any more it goes to the sender's pool (up to ``pool_bytes()``, 1 GiB by
  default, ``DEVBRIDGE_RDT_POOL_BYTES``, and ``pool_segments()``, 64, ``DEVBRIDGE_RDT_POOL_SEGMENTS``), where the next tensors of a similar size are written into pages
  already allocated and mapped; beyond that it is closed. A fresh segment costs several times the copy
  itself (the kernel allocates, zeroes and maps every page), which is what the pool saves.

Segments have no name anywhere: nothing is left behind when a process dies, however it dies (the kernel
frees a segment once the last process holding or mapping it is gone), and ``/dev/shm``'s size does not
limit them. The price: a receiver must be allowed to open another process's fd through ``/proc`` (same
user, the default for Ray workers; a ``/proc`` mounted ``hidepid=`` or a security profile forbidding
ptrace reads refuses it, with a ``DevbridgeTransportError`` saying so).

The receiver gets a ``SegmentTensor``, not a ``DeviceTensor``: Ray runs the receive on the actor's
``_ray_system`` thread, concurrently with the actor's own methods, and devbridge's staging layer is used
from one thread per bridge; so the device side is left to the method that takes the tensor, on its thread.

The segment is a snapshot taken when the method returned: unlike Ray's built-in transports, later
writes to the sender's tensor are not seen by receivers.

Limits: one node (a receiver on another node gets ``DevbridgeTransportError``: use ``export``/``import_``
there); Linux; no ``set_target_for_ref``; ``ray.get(ref, _use_object_store=True)`` fails (a DeviceTensor
cannot be pickled); a ref whose sender died cannot be read (``DevbridgeTransportError``), as with Ray's
own transports. Running out of file descriptors (``EMFILE``), on either side, is a ``DevbridgeTransportError``
saying so: never taken for a dead sender or freed tensors.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import math
import mmap
import os
import stat as _stat_module
import threading
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, List, Optional

import numpy as np

try:
    import ray
    from ray.experimental import (CommunicatorMetadata, TensorTransportManager, TensorTransportMetadata,
                                  register_tensor_transport)
except ImportError as _error:  # pragma: no cover - exercised only without Ray, or with a Ray before RDT
    raise ImportError("devbridge.ray_transport needs Ray with Ray Direct Transport custom transports "
                      "(ray.experimental.register_tensor_transport): pip install 'devbridge[ray]'") from _error

import devbridge
from ._portable import PortableTensor
from ._intake import _numpy_dtype
from ._staging import DeviceTensor, download
from .ray import DEFAULT_MAX_RESTARTS, TensorRef, _DeviceWorker
from .ray import start_worker as _start_worker

__all__ = ["TRANSPORT", "DevbridgeTransport", "DevbridgeTransportMetadata", "DevbridgeTransportError",
           "RDTDeviceWorker", "SegmentTensor", "start_worker", "segments", "pool_bytes", "set_pool_bytes",
           "pool_segments", "set_pool_segments", "transport_stats"]

TRANSPORT = "DEVBRIDGE"
_NAME = "devbridge-rdt"
# Page-aligned tensors: a receiver's view of each starts on its own page, as a fresh allocation would (and
# adopting two of them registers two regions that cannot overlap).
_ALIGN = 4096
# The first page holds the token of the tensors now in the segment: a receiver holding a ref the sender
# already freed (its segment recycled for other tensors) reads another token and refuses.
_HEADER = _ALIGN
_TOKEN = 16
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_AMBIGUOUS = object()  # the snapshot of a DeviceTensor two live refs hold at once
_DEFAULT_POOL_BYTES = 1 << 30
_DEFAULT_POOL_SEGMENTS = 64


_log = logging.getLogger(__name__)
_NO_TRANSPORT_MESSAGE = (
    "devbridge RDT: a devbridge ObjectRef is passed to a task of %s, an actor created without "
    "enable_tensor_transport=True: Ray queues the receive on that actor's _ray_system concurrency group, which "
    "it lacks, so the receive can wait behind the very task that waits for it and the actor hangs for good. "
    "Pass devbridge refs only to actors created with @ray.remote(enable_tensor_transport=True) "
    "(devbridge.ray_transport.RDTDeviceWorker / rt.start_worker), or to the driver's ray.get; hand off to other "
    "actors with export/import_")


class DevbridgeTransportError(RuntimeError):
    """A devbridge RDT hand-off that cannot complete: the tensors were freed, their sender died, the
    receiver is on another node or may not open the sender's segment, or a process ran out of file
    descriptors (or hit another ``OSError``, named as it is: never taken for the sender's death)."""


# ------------------------------------------------------------------------------------ process identity

# What opening or reading /proc/<pid>/... fails with when there is no such process (any more). Anything else
# (EMFILE: this process is out of file descriptors; ENFILE, ENOMEM, ...) says nothing about the process.
_NO_PROCESS = (errno.ENOENT, errno.ESRCH)


def _start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot) of the live process ``pid``; None when gone (no such process) or a
    zombie. Any other failure to read ``/proc/<pid>/stat`` (this process out of file descriptors: ``EMFILE``)
    is raised as the ``OSError`` it is: it does not mean the process died."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError as error:
        if error.errno in _NO_PROCESS:
            return None
        raise
    fields = data[data.rindex(b")") + 2:].split()  # the command name may hold spaces and parentheses
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _alive(pid: int, start: int) -> bool:
    # A pid is reused: the start time tells the sender from a later process of the same pid.
    return _start_time(pid) == start


_own_start: tuple[int, int] | None = None  # (pid, start time) of this process: read once (a fork has its own)


def _my_start_time() -> int:
    global _own_start
    pid = os.getpid()
    if _own_start is None or _own_start[0] != pid:
        start = _start_time(pid)
        if start is None:  # pragma: no cover - this process is alive
            raise DevbridgeTransportError(f"cannot read this process's own start time (/proc/{pid}/stat)")
        _own_start = (pid, start)
    return _own_start[1]


def _os_failure(obj_id: str, meta: "DevbridgeTransportMetadata", error: OSError, doing: str) -> DevbridgeTransportError:
    """A receive that failed on an ``OSError`` that says nothing about the sender or the tensors (out of file
    descriptors, out of memory...): a ``DevbridgeTransportError`` naming the error as it is."""
    code = errno.errorcode.get(error.errno, str(error.errno)) if error.errno is not None else "no errno"
    message = (f"ObjectRef({obj_id}): could not {doing}: {error.strerror or error} ({code}); the sender "
               f"(pid {meta.pid}) is not known to have died, nor its tensors to be freed")
    if error.errno in (errno.EMFILE, errno.ENFILE):
        whose = "This process has" if error.errno == errno.EMFILE else "The system has"
        message += (f". {whose} run out of file descriptors: each segment this process received holds one open "
                    "file descriptor for as long as anything maps it (a SegmentTensor, an array over one, a tensor "
                    "accept adopted from one), so RLIMIT_NOFILE bounds how many received tensors a process holds. "
                    "Release received tensors no longer needed (delete or replace them; accept into a worker "
                    "started with adopt=False copies instead of holding the segment), or raise the limit "
                    "(ulimit -n; resource.setrlimit(resource.RLIMIT_NOFILE, ...) in the receiving process)")
    return DevbridgeTransportError(message)


def segments(pid: int | None = None) -> list[int]:
    """The inodes of the transport's segments open in process ``pid`` (this one by default): those it wrote
    (for live refs, or pooled for reuse: ``transport_stats()`` tells which) and those it maps as a receiver."""
    base = f"/proc/{os.getpid() if pid is None else pid}/fd"
    found = set()
    try:
        fds = os.listdir(base)
    except OSError:
        return []
    for fd in fds:
        try:
            if os.readlink(f"{base}/{fd}").startswith(f"/memfd:{_NAME}"):
                found.add(os.stat(f"{base}/{fd}").st_ino)  # mmap holds a dup of each fd: count files
        except OSError:
            pass  # closed meanwhile
    return sorted(found)


def _node_id() -> str | None:
    # get_runtime_context() would start a local cluster in a process that has none.
    if not ray.is_initialized():
        return None
    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside a worker of this Ray version
        return None


def _try_lock(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


# ------------------------------------------------------------------------------------------- transport

class SegmentTensor(PortableTensor):
    """A PortableTensor received by the transport: read-only, over a mapping of the sender's segment.

    Its bytes never change while it lives (the sender wrote them before the ref existed, and recycles the
    segment only once no receiver holds it), so a bridge may adopt them as device memory (``Bridge.adopt``)
    rather than copy them."""

    __slots__ = ()

    def __reduce__(self):
        # Elsewhere the bytes are a private copy, no longer the segment: a plain PortableTensor.
        return (PortableTensor, (self.shape, self.dtype, self._bytes))


@dataclass
class DevbridgeTransportMetadata(TensorTransportMetadata):
    """What an ObjectRef carries: ``tensor_meta`` is ``[(shape, devbridge dtype name)]`` (a name, not a numpy
    dtype: ``bfloat16`` and ``float8_*`` have none); the bytes are in the segment open as ``fd`` in process
    ``pid`` (started at ``start``), inode ``inode``, ``nbytes`` bytes whose first page holds ``token``, at
    ``offsets``."""

    pid: int = 0
    start: int = 0
    fd: int = -1
    inode: int = 0
    nbytes: int = 0
    token: bytes = b""
    offsets: List[int] = field(default_factory=list)
    node_id: Optional[str] = None


class _Segment:
    """A segment the sender wrote: its memfd, kept open and mapped so that it can be written again."""

    __slots__ = ("fd", "mm", "size", "inode")

    def __init__(self, fd: int, mm: mmap.mmap, size: int) -> None:
        self.fd, self.mm, self.size, self.inode = fd, mm, size, os.fstat(fd).st_ino

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # a view of it is still alive somewhere in this process: let it go with that
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass


def _layout(tensors: list[DeviceTensor]) -> tuple[list[int], int]:
    offsets, end = [], _HEADER
    for t in tensors:
        offsets.append(end)
        end = -(-(end + t.nbytes) // _ALIGN) * _ALIGN
    return offsets, end


def _write(tensor: DeviceTensor, out: np.ndarray) -> None:
    """The tensor's bytes into ``out`` (a C-contiguous array of its shape and numpy dtype over the segment), by
    the transfer planner's route: one copy into the segment registered for the call where registering is
    cheap (host memory), else through the ring."""
    download(tensor.bridge, tensor, out)


_pool_bytes: int | None = None
_pool_segments: int | None = None


def _setting(override: int | None, variable: str, default: int) -> int:
    if override is not None:
        return override
    try:
        return max(0, int(os.environ.get(variable, default)))
    except ValueError:
        return default


def pool_bytes() -> int:
    """The most bytes of freed segments a sender keeps for reuse (``DEVBRIDGE_RDT_POOL_BYTES``, 1 GiB)."""
    return _setting(_pool_bytes, "DEVBRIDGE_RDT_POOL_BYTES", _DEFAULT_POOL_BYTES)


def pool_segments() -> int:
    """The most freed segments a sender keeps for reuse (``DEVBRIDGE_RDT_POOL_SEGMENTS``, 64): each holds two file
    descriptors, so thousands of small ones would exhaust ``RLIMIT_NOFILE`` well within ``pool_bytes()``."""
    return _setting(_pool_segments, "DEVBRIDGE_RDT_POOL_SEGMENTS", _DEFAULT_POOL_SEGMENTS)


def set_pool_bytes(nbytes: int | None) -> None:
    """Sets this process's pool limit (``None``: back to the environment's or the default; ``0``: a freed
    segment is closed at once). A smaller limit closes what no longer fits now."""
    global _pool_bytes
    _pool_bytes = None if nbytes is None else max(0, int(nbytes))
    _trim_pool()


def set_pool_segments(count: int | None) -> None:
    """Sets how many freed segments this process keeps for reuse (``None``: back to the environment's or the
    default; ``0``: none). A smaller limit closes what no longer fits now."""
    global _pool_segments
    _pool_segments = None if count is None else max(0, int(count))
    _trim_pool()


def _trim_pool() -> None:
    manager = _manager_if_made()
    if manager is not None:
        manager._trim()


def transport_stats() -> dict[str, int]:
    """This process's side of the transport: segments holding the tensors of live refs (``live``), freed
    ones a receiver still maps (``draining``), pooled for reuse (``pooled``), their bytes, and how many
    segments were created and reused."""
    manager = _manager_if_made()
    return manager.stats() if manager is not None else DevbridgeTransport._stats_of({}, [], [], 0, 0)


def _manager_if_made() -> DevbridgeTransport | None:
    from ray.experimental.rdt import util

    # Ray's per-process singleton, made on first use; there is no public accessor for it.
    manager = getattr(util, "transport_managers", {}).get(TRANSPORT)
    return manager if isinstance(manager, DevbridgeTransport) else None


class DevbridgeTransport(TensorTransportManager):
    """The ``TensorTransportManager`` Ray instantiates once per process; see the module doc."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, _Segment] = {}  # by fd: written, their ref not freed yet
        self._by_object: dict[str, DevbridgeTransportMetadata] = {}
        # Where the snapshot of each tensor a live ref holds lies, (obj_id, meta, index), or _AMBIGUOUS (see
        # extract_tensor_transport_metadata): the transport's own record, the tensor itself is the staging layer's.
        self._snapshots: weakref.WeakKeyDictionary[DeviceTensor, Any] = weakref.WeakKeyDictionary()
        self._draining: list[_Segment] = []   # freed, a receiver still holds them
        self._pooled: list[_Segment] = []     # freed, held by nobody but us (locked exclusively): reusable
        self._created = self._reused = 0
        atexit.register(self.close)

    def tensor_transport_backend(self) -> str:
        return TRANSPORT

    @staticmethod
    def is_one_sided() -> bool:
        # The bytes are in the segment before the ref exists: the receiver reads them without the sender.
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        # A receive is a local mmap that never waits on the sender: nothing can hang. Saying False would
        # make Ray kill the sender (and the receiver) whenever a receive task fails, e.g. on a dead receiver.
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        # Asking the actor would block the caller; an actor without devbridge fails at extract instead.
        return True

    def get_communicator_metadata(self, src_actor: Any, dst_actor: Any,
                                  backend: Optional[str] = None) -> CommunicatorMetadata:
        # Called where a task taking the ref is submitted to ``dst_actor``, just before Ray queues the receive
        # on that actor's _ray_system concurrency group. An actor created without enable_tensor_transport=True
        # has none: the receive lands behind the task waiting for it, and the actor hangs for good. Raising here
        # is not safe (Ray may call this from a native callback, where an exception crashes the process), so
        # say it, where the call was made, before the hang.
        if dst_actor is not None and not getattr(dst_actor, "_ray_enable_tensor_transport", True):  # None: not set
            _log.error(_NO_TRANSPORT_MESSAGE, dst_actor)
        return CommunicatorMetadata()

    # ------------------------------------------------------------------------------------------ sender

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: List[Any]) -> DevbridgeTransportMetadata:
        with self._lock:
            again = self._by_object.get(obj_id)
        if again is not None:
            # A retried task whose first reply was lost: Ray keeps the first primary copy and asks again (its list
            # holds the snapshot by now, see below).
            return again
        tensors = list(rdt_object)
        if not tensors:
            return DevbridgeTransportMetadata(tensor_meta=[], tensor_device=None)
        for t in tensors:
            if not isinstance(t, DeviceTensor):
                raise TypeError(f"the devbridge transport moves devbridge.DeviceTensor, not {type(t).__name__}")
            t._check()
        backends = {t.bridge.backend for t in tensors}
        if len(backends) != 1:
            raise ValueError(f"one ref's DeviceTensors must share a backend (Ray's rule), not {sorted(backends)}")
        offsets, need = _layout(tensors)
        start = _my_start_time()
        segment = self._take(need)
        token = uuid.uuid4().bytes
        try:
            for t, offset in zip(tensors, offsets):
                out = np.ndarray(t.shape, _numpy_dtype(t.dtype), buffer=segment.mm, offset=offset)
                _write(t, out)
                del out
            segment.mm[:_TOKEN] = token  # last: the bytes are whole before anything names them
            fcntl.flock(segment.fd, fcntl.LOCK_UN)
            meta = DevbridgeTransportMetadata(
                tensor_meta=[(t.shape, t.dtype) for t in tensors], tensor_device=backends.pop(), pid=os.getpid(),
                start=start, fd=segment.fd, inode=segment.inode, nbytes=segment.size,
                token=token, offsets=offsets, node_id=_node_id())
        except BaseException:
            segment.close()
            raise
        with self._lock:
            self._live[segment.fd] = segment
            self._by_object[obj_id] = meta
            for index, t in enumerate(tensors):
                # Ray hands the ref's DeviceTensors themselves to the sending actor when it passes the ref to
                # itself (no transfer): live tensors, which later writes change and a delete frees. Where the
                # snapshot is, for that actor to read instead (_snapshot_of); a tensor in two live refs at once
                # has no one snapshot.
                self._snapshots[t] = (obj_id, meta, index) if t not in self._snapshots else _AMBIGUOUS
        _written(tensors)  # a sending worker counts its exports now that they are out (not a retry's again)
        return meta

    def _take(self, need: int) -> _Segment:
        """A segment of at least ``need`` bytes, locked exclusively: the smallest pooled one of at most twice
        that, else a new one."""
        with self._lock:
            self._settle()
            fits = [s for s in self._pooled if need <= s.size <= 2 * need]
            if fits:
                best = min(fits, key=lambda s: s.size)
                self._pooled.remove(best)
                self._reused += 1
                return best
        try:
            segment = self._new_segment(need)
        except OSError as error:
            if error.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            # Pooled segments are idle: their file descriptors are the ones this process can give back at once.
            closed = self.close_pooled()
            try:
                if not closed:
                    raise
                segment = self._new_segment(need)
            except OSError as again:
                if again.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                with self._lock:
                    live, draining = len(self._live), len(self._draining)
                raise DevbridgeTransportError(
                    f"cannot make a segment for {need} bytes: {again.strerror} "
                    f"({errno.errorcode.get(again.errno, again.errno)}) in the sending process (pid {os.getpid()}), "
                    f"even after closing its {closed} pooled segments. A sender holds two file descriptors per "
                    f"segment it keeps ({live} for live refs, {draining} freed ones a receiver still maps), so a "
                    "receiver that keeps what it received keeps the sender's segments too. Free refs and received "
                    "tensors no longer needed, or raise RLIMIT_NOFILE (ulimit -n)") from again
        with self._lock:
            self._created += 1  # counted once made: a failed attempt (no fd or memory left) made nothing
        return segment

    @staticmethod
    def _new_segment(need: int) -> _Segment:
        fd = os.memfd_create(_NAME, os.MFD_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # Allocate the pages now: no memory left is an OSError here, not a SIGBUS in the middle of the copy.
            os.posix_fallocate(fd, 0, need)
            mm = mmap.mmap(fd, need, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            return _Segment(fd, mm, need)
        except BaseException:
            os.close(fd)
            raise

    def garbage_collect(self, obj_id: str, tensor_transport_meta: DevbridgeTransportMetadata,
                        tensors: List[Any]) -> None:
        with self._lock:
            for t in tensors:
                self._snapshots.pop(t, None)  # the ref is gone, and its snapshot with it
            self._by_object.pop(obj_id, None)
            segment = self._live.pop(tensor_transport_meta.fd, None)
            if segment is not None:
                self._draining.append(segment)
                self._settle()

    def _settle(self) -> None:
        """Moves the freed segments no receiver holds any more into the pool (locked by us: a stale receiver
        can no longer take it), their token wiped."""
        still = []
        for segment in self._draining:
            if _try_lock(segment.fd, fcntl.LOCK_EX):
                segment.mm[:_TOKEN] = bytes(_TOKEN)
                self._pooled.append(segment)
            else:
                still.append(segment)
        self._draining = still
        self._trim_locked()  # more pooled now: within the limits again

    def _trim(self) -> None:
        with self._lock:
            self._trim_locked()

    def _trim_locked(self) -> None:
        # Oldest first; a draining segment closed now lives on in its receivers' mappings only.
        limit, count = pool_bytes(), pool_segments()
        while self._pooled or self._draining:
            if (len(self._pooled) + len(self._draining) <= count
                    and sum(s.size for s in self._pooled) + sum(s.size for s in self._draining) <= limit):
                break
            (self._pooled if self._pooled else self._draining).pop(0).close()

    def close_pooled(self) -> int:
        """Closes the pooled segments (idle: no ref, no receiver), giving back their file descriptors; how many."""
        with self._lock:
            self._settle()
            pooled, self._pooled = self._pooled, []
        for segment in pooled:
            segment.close()
        return len(pooled)

    @staticmethod
    def _stats_of(live: dict, draining: list, pooled: list, created: int, reused: int) -> dict[str, int]:
        return {"live": len(live), "draining": len(draining), "pooled": len(pooled),
                "live_bytes": sum(s.size for s in live.values()),
                "pooled_bytes": sum(s.size for s in pooled) + sum(s.size for s in draining),
                "created": created, "reused": reused}

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._settle()
            return self._stats_of(self._live, self._draining, self._pooled, self._created, self._reused)

    def close(self) -> None:
        """Closes every segment this process wrote (at exit; a live ref's tensors can no longer be read)."""
        with self._lock:
            held = [*self._live.values(), *self._draining, *self._pooled]
            self._live, self._draining, self._pooled, self._by_object = {}, [], [], {}
            self._snapshots.clear()
        for segment in held:
            segment.close()

    def send_multiple_tensors(self, tensors: List[Any], tensor_transport_metadata: TensorTransportMetadata,
                              communicator_metadata: CommunicatorMetadata) -> None:
        raise NotImplementedError("the devbridge transport is one-sided: Ray never calls send_multiple_tensors")

    def abort_transport(self, obj_id: str, communicator_metadata: CommunicatorMetadata) -> None:
        pass  # a receive holds nothing between calls: a failed one left nothing behind

    # ---------------------------------------------------------------------------------------- receiver

    def recv_multiple_tensors(self, obj_id: str, tensor_transport_metadata: DevbridgeTransportMetadata,
                              communicator_metadata: CommunicatorMetadata,
                              target_buffers: Optional[List[Any]] = None) -> List[PortableTensor]:
        meta = tensor_transport_metadata
        if target_buffers:
            raise ValueError("the devbridge transport does not receive into target buffers (set_target_for_ref)")
        if not meta.tensor_meta:
            return []
        here = _node_id()
        if meta.node_id is not None and here is not None and here != meta.node_id:
            raise DevbridgeTransportError(
                f"ObjectRef({obj_id}): its tensors are in shared memory on node {meta.node_id}, this process is on "
                f"node {here}; the devbridge transport is one node only (hand off with export/import_ instead)")
        fd = None
        doing = "open the sender's segment"
        try:
            fd = self._open(obj_id, meta)
            # Shared while mapped: the sender recycles the segment only once it can lock it exclusively.
            doing = "lock and read the sender's segment"
            if not _try_lock(fd, fcntl.LOCK_SH) or os.pread(fd, _TOKEN, 0) != meta.token:
                raise DevbridgeTransportError(self._freed(obj_id, meta))
            size = os.fstat(fd).st_size
            if size != meta.nbytes:
                raise DevbridgeTransportError(
                    f"ObjectRef({obj_id}): the segment holds {size} bytes, the ref says {meta.nbytes}")
            # Not populated: a bridge that adopts the bytes touches them only when compute reads them, and
            # populating here made a 256 MiB host-to-host hand-off take twice as long.
            doing = "map the sender's segment"
            mm = mmap.mmap(fd, meta.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError as error:  # not the sender's death nor a freed ref (those are DevbridgeTransportErrors)
            raise _os_failure(obj_id, meta, error, doing) from error
        finally:
            # The mapping holds a duplicate of the fd (CPython's mmap dups it), which shares this open file
            # description and so the shared lock: the lock goes with the mapping, once the last tensor, array or
            # adopted DeviceTensor over it is gone, whenever that is. One fd per received segment, not two.
            if fd is not None:
                os.close(fd)
        out: list[PortableTensor] = []
        for (shape, dtype), offset in zip(meta.tensor_meta, meta.offsets):
            n = math.prod(shape) * devbridge.dtype_info(dtype)["itemsize"]
            out.append(SegmentTensor(shape, dtype, np.frombuffer(mm, np.uint8, n, offset)))
        return out

    def _open(self, obj_id: str, meta: DevbridgeTransportMetadata) -> int:
        """The sender's segment, opened read-only here (a new open file description: a lock of our own)."""
        if not _alive(meta.pid, meta.start):
            raise DevbridgeTransportError(
                f"ObjectRef({obj_id}): the sender process (pid {meta.pid}) that held its tensors has died; they "
                "lived on its device and are lost")
        path = f"/proc/{meta.pid}/fd/{meta.fd}"
        try:
            # Non-blocking: a stale ref's fd number may name a pipe or a FIFO by now.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except PermissionError as error:
            raise DevbridgeTransportError(
                f"ObjectRef({obj_id}): may not open {path}, the sender's segment ({error.strerror}): the transport "
                "needs both processes under one user and /proc readable between them (no hidepid=, no security "
                "profile denying ptrace reads)") from None
        except OSError as error:
            # No such fd (closed: the segment was freed) or process, or by now a socket (ENXIO). Anything else
            # (EMFILE...) is this process's own trouble: raised as it is (the caller names it).
            if error.errno not in (*_NO_PROCESS, errno.ENXIO):
                raise
            if not _alive(meta.pid, meta.start):
                raise DevbridgeTransportError(
                    f"ObjectRef({obj_id}): the sender process (pid {meta.pid}) died while its tensors were read; "
                    "they are lost") from None
            raise DevbridgeTransportError(self._freed(obj_id, meta)) from None
        try:
            info = os.fstat(fd)
            if (not _stat_module.S_ISREG(info.st_mode) or info.st_ino != meta.inode
                    or not _alive(meta.pid, meta.start)):
                raise DevbridgeTransportError(self._freed(obj_id, meta))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _snapshot_of(self, tensor: DeviceTensor) -> SegmentTensor | None:
        """The snapshot of ``tensor`` a live ref of this process holds (the segment written when it was shared), as
        any receiver maps it; None when no one live ref holds the tensor."""
        with self._lock:
            record = self._snapshots.get(tensor)
        if record is None or record is _AMBIGUOUS:
            return None
        obj_id, meta, index = record
        return self.recv_multiple_tensors(obj_id, meta, CommunicatorMetadata())[index]

    @staticmethod
    def _freed(obj_id: str, meta: DevbridgeTransportMetadata) -> str:
        return (f"ObjectRef({obj_id}): the sender (pid {meta.pid}) has freed its tensors (the ref went out of "
                "scope there); its segment no longer holds them")


# The RDT workers of this process (one, in an actor): told of the tensors each extraction wrote, so that a
# worker counts what it shares once the bytes are out, not when share() returns (extraction may still fail).
_senders: "weakref.WeakSet[_RDTDeviceWorker]" = weakref.WeakSet()


def _written(tensors: list[DeviceTensor]) -> None:
    for worker in list(_senders):
        worker._shared(tensors)


def _register() -> None:
    try:
        # Ray's devices are the tensors' tensor_device: the backend of their bridge.
        register_tensor_transport(TRANSPORT, ["host", "opencl", "cuda", "fake"], DevbridgeTransport, DeviceTensor)
    except ValueError:
        # Already registered: workers import this module too (the classes below are pickled by reference), and
        # Ray registers the driver's transports there itself, skipping a name this import registered first.
        pass


_register()


# -------------------------------------------------------------------------------------------- the worker

class _RDTDeviceWorker(_DeviceWorker):
    """A ``DeviceWorker`` that hands tensors to other workers by RDT: ``share`` and ``accept``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _senders.add(self)

    @ray.method(tensor_transport=TRANSPORT)
    def share(self, key: Any) -> DeviceTensor | list[DeviceTensor]:
        """The tensor(s) named by ``key`` (a name or TensorRef, or a list of them), for another actor:
        ``b.accept.remote(name, a.share.remote(key))``. The bytes are copied once, as the method returns, into
        shared memory; counted (``exports``, ``bytes_out``) once they are there: a share whose copy fails (no
        file descriptor or memory left for the segment) counts nothing."""
        self._check_open("share")
        keys = key if isinstance(key, list) else [key]
        tensors = [DeviceTensor._borrowing(self._lookup(k)[1]) for k in keys]
        return tensors if isinstance(key, list) else tensors[0]

    def close(self) -> None:
        """``DeviceWorker.close``, and the segments pooled for reuse are closed (their file descriptors given back):
        a closed worker shares nothing more. Segments of refs still alive stay readable until Ray frees them."""
        super().close()
        manager = _manager_if_made()
        if manager is not None:
            manager.close_pooled()

    def _shared(self, tensors: list[DeviceTensor]) -> None:
        """The transport wrote ``tensors`` into a segment: counts this worker's among them."""
        mine = [t for t in tensors if t.bridge is self.bridge]
        self._counts["exports"] += len(mine)
        self._counts["bytes_out"] += sum(t.nbytes for t in mine)

    def accept(self, name: str | list[str], value: Any) -> TensorRef | list[TensorRef]:
        """Stores what ``share`` handed over (a SegmentTensor, or a list) as ``name`` (or the list of names):
        adopted with no copy wherever the bridge adopts host memory (host; OpenCL over host memory, PoCL
        included; read-only: a later ``put`` of the name replaces it), holding the received segment (one file
        descriptor) until the name is replaced or deleted; one copy onto the device elsewhere (CUDA) or with
        ``adopt=False``. Also takes what ``put`` takes, and refuses what ``put`` refuses (a
        ``TensorRef``: ``devbridge.ForeignDomain``). A list of names takes a list of tensors of the same
        length (``share`` of a list of keys), one name one tensor (``TypeError`` otherwise)."""
        self._check_open("accept")
        if isinstance(name, (list, tuple)):
            for n in name:
                self._check_name(n, "accept")
            if not isinstance(value, (list, tuple)):
                raise TypeError(f"worker {self.domain}: accept: {len(name)} names {list(name)} for one "
                                f"{type(value).__name__}: share(key) of one key hands over one tensor, "
                                "share([key, ...]) a list")
            if len(set(name)) != len(name):
                raise ValueError(f"worker {self.domain}: accept: names {list(name)} name a tensor twice (the second "
                                 "would replace the first)")
            values = list(value)
            if len(values) != len(name):
                raise ValueError(f"worker {self.domain}: accept: {len(name)} names {list(name)} for {len(values)} "
                                 "tensors")
            return [self.accept(n, v) for n, v in zip(name, values)]
        self._check_name(name, "accept")
        if isinstance(value, (list, tuple)) and any(isinstance(v, (PortableTensor, DeviceTensor, TensorRef))
                                                    for v in value):
            raise TypeError(f"worker {self.domain}: accept: one name {name!r} for a {type(value).__name__} of "
                            f"{len(value)} tensors: pass a list of as many names")
        if isinstance(value, DeviceTensor):
            # A ref shared by this very actor: Ray hands back the tensor share() returned (no transfer). What every
            # other receiver reads is the snapshot written when share returned; the tensor itself may have been
            # written or freed since. A DeviceTensor from no live ref (share called directly, not through Ray):
            # a copy, so that replacing one name does not free the other.
            manager = _manager_if_made()
            snapshot = manager._snapshot_of(value) if manager is not None else None
            if snapshot is not None:
                value = snapshot
            else:
                value = self._portable(value) if value.bridge is self.bridge else value.bridge.export(value)
        tensor = None
        if isinstance(value, SegmentTensor) and self._adopt and value.shape:
            try:
                tensor = self.bridge.adopt(value.numpy(), dtype=value.dtype)
            except devbridge.Unsupported:
                self._adopt = False  # device memory that is not host memory after all: copy
        if tensor is None:
            tensor = self._ingest(value, reuse=name, adopt=True, what="accept")
        ref = self._store(name, tensor)
        self._counts["imports"] += 1  # counted once stored
        self._counts["bytes_in"] += tensor.nbytes
        return ref


RDTDeviceWorker = ray.remote(max_restarts=DEFAULT_MAX_RESTARTS, max_task_retries=0,
                             enable_tensor_transport=True)(_RDTDeviceWorker)


def start_worker(backend: str = "host", device: str | None = None, **kwargs: Any) -> Any:
    """``devbridge.ray.start_worker`` for an ``RDTDeviceWorker`` (same placement rules and arguments)."""
    return _start_worker(backend, device, actor_class=RDTDeviceWorker, **kwargs)
