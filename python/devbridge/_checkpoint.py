"""Checkpoint files: safetensors checkpoint/restore of a bridge's tensors.

Pure Python over the staging layer (``_staging``) and the portable tensors' device
reads (``_portable``: a tensor resolved to what it names, streamed out through the
ring). See docs/PORTABLE.md.

* ``checkpoint(bridge, path, {name: tensor})`` writes a safetensors file
  atomically, with the generation and a checksum of the data in its metadata;
  ``restore(bridge, path)`` -> ``{name: DeviceTensor}`` verifies it while it
  streams, and frees everything when the file is bad.
* ``checkpoint_info(path)``: the header, after the checks ``restore`` makes first.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import queue
import stat
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, BinaryIO, Callable, NamedTuple

import numpy as np

from ._devbridge import Bridge, DeviceHandle, ObjectSpec, TransferPlanner, _checkpoint_open, dtype_info, _safetensors_name
from ._errors import BridgeError
from ._portable import (
    CheckpointError,
    _Source,
    _context,
    _read_exactly,
    _resolve,
    _with_context,
    _stream,
    _write_all,
)
from ._staging import (
    _CLEANUP_WAIT_S,
    DeviceTensor,
    spec_for_array,
)

FORMAT = "devbridge-checkpoint"
FORMAT_VERSION = "1"
# Restore: a ring chunk this large or larger is read (and crc32-hashed) in parts, one per thread.
_PARALLEL_READ_BYTES = 4 << 20
_READ_THREADS = 2
# Restore: how far ahead of its reads the kernel is asked to read the file (posix_fadvise WILLNEED).
_READ_AHEAD_BYTES = 256 << 20
# Restore: how long a chunk waits for ring room another caller holds (another restore, a stream) before
# Backpressure: room that long held is a stall, not a queue.
_RING_ROOM_WAIT_S = 60.0
# Checksums a checkpoint may record: algorithm -> hex digits. checkpoint writes crc32 by default (see
# docs/PORTABLE.md, "Checksums"); restore and `devbridge checkpoint inspect` verify both.
_CHECKSUM_DIGITS = {"sha256": 64, "crc32": 8}
_DEFAULT_CHECKSUM = "crc32"


def _checked_path(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, not {type(path).__name__}")
    path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"path must name a str path, not {type(path).__name__}")
    if not path:
        raise ValueError("path is empty")
    return path


try:  # ISA-L's CRC-32: the same checksum as zlib's, 5x faster here, and able to join pieces hashed apart
    from isal.isal_zlib import crc32 as _crc32
    from isal.isal_zlib import crc32_combine as _crc32_combine
except ImportError:  # a dependency; where its wheel is missing, zlib hashes the data in one piece at a time
    from zlib import crc32 as _crc32
    _crc32_combine = None


class _Crc32:
    """CRC-32 (zlib's: the IEEE polynomial, as gzip and PNG) behind hashlib's interface, plus ``combine``."""

    name = "crc32"

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = _crc32(data, self._value)

    def combine(self, crc: int, length: int) -> None:
        """As ``update`` of ``length`` bytes whose own CRC-32 is ``crc`` (hashed elsewhere, in parallel)."""
        self._value = _crc32_combine(self._value, crc, length)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def _new_digest(algorithm: str) -> Any:
    return hashlib.sha256() if algorithm == "sha256" else _Crc32()


class _Hasher:
    """Feeds a digest, in order, on a thread of its own, so the checksum overlaps the device copies and the
    file I/O (hashlib and zlib release the GIL for large buffers, and so do os.write and readinto).
    ``submit(view)`` returns a Future; the caller keeps the bytes unchanged until it is done."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self.digest = _new_digest(algorithm)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="devbridge-checksum")

    def submit(self, view: memoryview) -> Future:
        return self._pool.submit(self.digest.update, view)

    def checksum(self) -> str:
        """``"<algorithm>:<hex>"`` of everything submitted (waits for it)."""
        self._pool.shutdown(wait=True)
        return f"{self.algorithm}:{self.digest.hexdigest()}"

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def checkpoint(bridge: Bridge, path: Any, tensors: Mapping[str, Any], *,
               metadata: Mapping[str, str] | None = None, checksum: str = _DEFAULT_CHECKSUM) -> dict[str, str]:
    """Writes ``{name: DeviceTensor | DeviceHandle}`` of ``bridge`` to ``path`` as a safetensors file.

    The file loads with the ``safetensors`` package (and numpy/torch loaders).
    Its ``__metadata__`` holds the format and its version, the bridge's
    generation, a checksum of the data section (``checksum``: ``"crc32"``,
    the default, or ``"sha256"``; restore verifies either), each tensor's
    devbridge dtype (``dtypes``, JSON) and ``metadata``'s own entries. The
    tensors stream from the ring to the file chunk by chunk (the checkpoint is
    never held in memory), hashed on a thread of their own while they are
    written, into a temporary file beside ``path`` that is fsynced, renamed
    over ``path`` and its directory fsynced: a crash leaves the old file or
    the new one, never a mix. Returns the metadata written.
    """
    path = _checked_path(path)
    if not isinstance(checksum, str):
        raise TypeError(f"checksum must be a str, not {type(checksum).__name__}")
    if checksum not in _CHECKSUM_DIGITS:
        raise ValueError(f"checksum {checksum!r} is not one of {', '.join(sorted(_CHECKSUM_DIGITS))}")
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of names to DeviceTensors or DeviceHandles, "
                        f"not {type(tensors).__name__}")
    sources: list[tuple[str, _Source]] = []
    for name, x in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"checkpoint {path!r}: tensor names must be str, not {type(name).__name__}")
        if not name or name == "__metadata__":
            raise ValueError(f"checkpoint {path!r}: {name!r} cannot name a tensor")
        _check_utf8(name, f"checkpoint {path!r}: tensor name {name!r}")
        with _context(f"checkpoint {path!r}: tensor {name!r}"):
            sources.append((name, _resolve(bridge, x)))
    # The package's own order: widest dtype first, so every tensor starts aligned to its itemsize.
    sources.sort(key=lambda entry: (-dtype_info(entry[1].dtype)["itemsize"], entry[0]))
    meta = _checkpoint_metadata(bridge, metadata, {name: s.dtype for name, s in sources},
                                f"{checksum}:" + "0" * _CHECKSUM_DIGITS[checksum])
    header: dict[str, Any] = {"__metadata__": meta}
    begin = 0
    for name, source in sources:
        header[name] = {"dtype": _safetensors_name(source.dtype), "shape": list(source.shape),
                        "data_offsets": [begin, begin + source.nbytes]}
        begin += source.nbytes

    directory = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with open(fd, "wb", buffering=0) as file:
            hasher = _Hasher(checksum)
            try:
                encoded = _encode_header(header)
                with contextlib.suppress(OSError):  # the file's blocks at once, not a write at a time; a hint
                    os.posix_fallocate(file.fileno(), 0, len(encoded) + begin)
                _write_all(file.write, encoded)  # the checksum is a placeholder of the final length

                writeback = _Writeback(file.fileno(), len(encoded))

                def write_and_hash(view: memoryview) -> None:
                    # Hashed (on the hasher's thread) while it is written here; both done before the return.
                    hashed = hasher.submit(view)
                    try:
                        _write_all(file.write, view)
                    finally:
                        hashed.result()
                    writeback.wrote(view.nbytes)

                batch = _SmallChunks(write_and_hash)

                def sink(offset: int, chunk: np.ndarray) -> None:
                    # The chunk is a ring range that goes back when this returns: a large one is written
                    # and hashed from the ring, a small one copied out to go with the next ones.
                    batch.add(memoryview(chunk).cast("B"))

                planners: dict[int, TransferPlanner] = {}  # by bridge domain: each asks its backend once
                for name, source in sources:
                    with _context(f"checkpoint {path!r}: tensor {name!r}"):
                        planner = planners.get(source.bridge.domain)
                        if planner is None:
                            planner = planners[source.bridge.domain] = TransferPlanner(source.bridge)
                        _stream(source, sink, planner)
                batch.flush()
                meta["checksum"] = hasher.checksum()
                file.seek(0)
                _write_all(file.write, _encode_header(header))
            finally:
                hasher.close()
            os.fchmod(file.fileno(), _mode_for(path))
            os.fsync(file.fileno())
        replaced = _keep_old_blocks(path, temporary)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_directory(directory)
    if replaced is not None:
        _free_later(replaced)
    return dict(meta)


def _keep_old_blocks(path: str, temporary: str) -> str | None:
    """A second name for the file ``path`` is about to replace, so the rename does not free its blocks
    inline (tens of milliseconds for a large checkpoint): they are freed after the call returns. None
    when there is no old file, or the file system has no hard links (the rename then frees them)."""
    kept = temporary[:-len(".tmp")] + ".old"
    try:
        os.link(path, kept)
    except OSError:
        return None
    return kept


def _free_later(kept: str) -> None:
    """Unlinks the replaced checkpoint's last name on a thread of its own (joined when the interpreter
    exits, so nothing is left behind but by a crash, and then only a ``.<name>.*.old`` beside it)."""
    global _UNLINKER
    if _UNLINKER is None:
        _UNLINKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="devbridge-unlink")
    _UNLINKER.submit(_unlink_quietly, kept)


def _unlink_quietly(name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name)


_UNLINKER: ThreadPoolExecutor | None = None


def _checkpoint_metadata(bridge: Bridge, extra: Mapping[str, str] | None, dtypes_by_name: dict[str, str],
                         checksum: str) -> dict[str, str]:
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "generation": str(bridge.generation),
            "checksum": checksum, "dtypes": json.dumps(dtypes_by_name, sort_keys=True)}
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise TypeError(f"metadata must be a mapping of str to str, not {type(extra).__name__}")
        for key, value in extra.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"metadata entries must be str to str, not {type(key).__name__} to "
                                f"{type(value).__name__}")
            if key in meta:
                raise ValueError(f"metadata key {key!r} is devbridge's own")
            _check_utf8(key, f"metadata key {key!r}")
            _check_utf8(value, f"metadata {key!r}'s value {value!r}")
            meta[key] = value
    return meta


def _check_utf8(text: str, what: str) -> None:
    """A str with a lone surrogate (``"\\ud800"``) has no UTF-8: json.dumps would still write it (as an
    escape), and every reader, safetensors' and restore's, would refuse the file. Refused before anything
    is written."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid UTF-8 (it holds a lone surrogate); a safetensors header is "
                         "UTF-8") from None


def _encode_header(header: dict[str, Any]) -> bytes:
    """8-byte little-endian length, then the JSON header padded with spaces so the data starts 8-aligned
    (as the safetensors package writes it)."""
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _mode_for(path: str) -> int:
    """The permissions the renamed file should have: the old file's, or 0o666 less the umask."""
    with contextlib.suppress(OSError):
        return stat.S_IMODE(os.stat(path).st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


class _SmallChunks:
    """A checkpoint's chunks on their way to ``write(view)`` (which writes and hashes one piece, in order):
    those under ``_SMALL_CHUNK_BYTES`` are copied into one buffer and go together, so thousands of small
    tensors cost a write and a hash per few MiB instead of a system call and a thread hand-off each."""

    def __init__(self, write: Callable[[memoryview], None]) -> None:
        self._write = write
        self._buffer = bytearray(_BATCH_BYTES)
        self._used = 0

    def add(self, view: memoryview) -> None:
        if view.nbytes >= _SMALL_CHUNK_BYTES:
            self.flush()
            self._write(view)
            return
        if self._used + view.nbytes > len(self._buffer):
            self.flush()
        self._buffer[self._used:self._used + view.nbytes] = view
        self._used += view.nbytes

    def flush(self) -> None:
        if self._used:
            used, self._used = self._used, 0
            self._write(memoryview(self._buffer)[:used])


# Checkpoint: chunks smaller than this are batched (_SmallChunks) into buffers of _BATCH_BYTES.
_SMALL_CHUNK_BYTES = 1 << 20
_BATCH_BYTES = 4 << 20


class _Writeback:
    """Starts the disk on what a checkpoint has written so far, every ``_WRITEBACK_BYTES``, without
    waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``): the final fsync then waits for the
    tail only, instead of the whole file after the last write. Elsewhere, or if the call is refused,
    nothing (the fsync does it all)."""

    def __init__(self, fd: int, start: int) -> None:
        self._fd, self._flushed, self._written = fd, 0, start

    def wrote(self, nbytes: int) -> None:
        self._written += nbytes
        if self._written - self._flushed < _WRITEBACK_BYTES or _sync_file_range is None:
            return
        if _sync_file_range(self._fd, self._flushed, self._written - self._flushed, _SYNC_FILE_RANGE_WRITE) == 0:
            self._flushed = self._written


_WRITEBACK_BYTES = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        import ctypes

        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_sync_file_range = _libc_sync_file_range()


def _fsync_directory(directory: str) -> None:
    """Makes the rename durable: the directory entry, not only the file, must reach the disk."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # a platform that cannot open directories (Windows) has no such fsync
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Entry(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class _Header(NamedTuple):
    metadata: dict[str, str]
    entries: list[_Entry]  # in file order


def _open_checkpoint(path: str) -> tuple[BinaryIO, _Header]:
    """Opens ``path`` and checks its header against the file before anything is allocated: the C++
    reader ``devbridge checkpoint inspect`` uses (include/devbridge/checkpoint_file.hpp), so both refuse
    the same files with the same reasons. Returns the file the header was read through (unbuffered,
    positioned at the data section) and the header; ``CheckpointError`` names the file when refused."""
    file, metadata, tensors, data_start = _checkpoint_open(os.fsencode(path), repr(path))
    file.seek(data_start)
    return file, _Header(metadata, [_Entry(*t) for t in tensors])


def checkpoint_info(path: Any) -> dict[str, Any]:
    """A checkpoint's header without restoring it: ``{"metadata": {...}, "tensors": {name: {"dtype",
    "shape", "nbytes"}}}`` (devbridge dtype names), after the same checks ``restore`` makes first."""
    path = _checked_path(path)
    file, header = _open_checkpoint(path)
    file.close()
    return {"metadata": dict(header.metadata),
            "tensors": {e.name: {"dtype": e.dtype, "shape": e.shape, "nbytes": e.end - e.begin}
                        for e in header.entries}}


# The dtypes each bridge's device holds, by bridge domain (process-unique, never reused). They are fixed
# when the bridge is made; backend_info() asks the backend afresh (the host reads /proc/meminfo), so restore
# reads them once per bridge. A Bridge takes no attribute and no weak reference: past the bound, the oldest
# entries are forgotten (and read again if asked).
_HELD_DTYPES: collections.OrderedDict[int, frozenset[str]] = collections.OrderedDict()
_HELD_DTYPES_BOUND = 64


def _held_dtypes(bridge: Bridge) -> frozenset[str]:
    domain = bridge.domain
    held = _HELD_DTYPES.get(domain)
    if held is None:
        held = _HELD_DTYPES[domain] = frozenset(bridge.backend_info()["dtypes"])
        while len(_HELD_DTYPES) > _HELD_DTYPES_BOUND:
            _HELD_DTYPES.popitem(last=False)
    return held


def restore(bridge: Bridge, path: Any, *, names: Any = None, prefix: str | None = None,
            rows: Mapping[str, slice] | None = None, alignment: int = 256,
            verify: bool = True, wait: bool = True) -> dict[str, DeviceTensor] | PendingRestore:
    """Restores a safetensors checkpoint into ``bridge``'s current generation: ``{name: DeviceTensor}``.

    Any safetensors file works (a devbridge checkpoint, or one the
    ``safetensors`` package wrote), on any backend and in any generation; so
    does a sharded checkpoint as the ecosystem writes it: ``path`` names its
    index (``model.safetensors.index.json``, whose ``weight_map`` says which
    file beside it holds each tensor), and the shards are read in parallel.
    The header is checked against the file before anything is allocated: a file
    that is not safetensors, is truncated, or holds a dtype devbridge lacks or
    an empty tensor raises ``CheckpointError`` naming the file, the tensor
    and why. Every tensor is allocated, then the data streams from the file
    through the ring: read with ``pread`` straight into the ring's chunks
    (large chunks in parallel parts), each chunk's device copy in flight while
    the next is read, so host memory beyond the tensors stays within the ring
    whatever the file's size. A devbridge checkpoint's checksum is computed
    as the bytes are read and, with ``verify`` (the default), compared at the
    end. When the checksum differs, the file ends early, or an allocation or
    copy fails (the error names the tensor), every tensor is freed before the
    error is raised.

    ``wait=False`` returns a ``PendingRestore`` at once: the same mapping,
    filled by a reader thread in file order; each tensor's ``ready()`` /
    ``wait()`` say when its own bytes are on the device (compute can start on
    the first layers while the rest is read), and ``PendingRestore.wait()``
    gives the verdict on the whole file (its checksum), freeing every tensor
    and raising the error if it failed.

    Partial loads read only the bytes asked for: ``names`` (an iterable of
    tensor names, each of which must be there, or a callable ``name -> bool``)
    and ``prefix`` (names that start with it) choose tensors, both applying
    when both are given; ``rows`` maps a name to a ``slice`` of its first
    dimension (step 1), restored as a tensor of just those rows (as
    safetensors' ``get_slice``). A checksum covers the whole data section, so
    a partial load of a file that records one needs ``verify=False``
    (``ValueError`` otherwise: nothing would be verified).
    """
    if not isinstance(bridge, Bridge):
        raise TypeError(f"bridge must be a devbridge.Bridge, not {type(bridge).__name__}")
    for flag, value in (("verify", verify), ("wait", wait)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be a bool, not {type(value).__name__}")
    path = _checked_path(path)
    selection = _Selection(names, prefix, rows)
    if path.endswith(".json"):
        pending = _restore_sharded(bridge, path, selection, alignment, verify)
    else:
        file, header = _open_checkpoint(path)
        with file:
            selection.require_all(header.entries, path)
            pending = _restore_file(bridge, path, file, header, selection, selection.partial, alignment, verify)
    return pending if not wait else pending.tensors()


class _Selection:
    """What a partial restore asks for: which tensors (``names``, ``prefix``) and which rows of each
    (``rows``), checked for type and shape before any file is opened."""

    def __init__(self, names: Any, prefix: str | None, rows: Mapping[str, slice] | None) -> None:
        self.exact: frozenset[str] | None = None
        self.predicate: Callable[[str], bool] | None = None
        if isinstance(names, (str, bytes)):
            raise TypeError("names must be an iterable of tensor names or a callable, not one string "
                            "(prefix= selects by the start of a name)")
        if callable(names):
            self.predicate = names
        elif names is not None:
            try:
                self.exact = frozenset(names)
            except TypeError:
                raise TypeError(f"names must be an iterable of str or a callable, "
                                f"not {type(names).__name__}") from None
            if not all(isinstance(n, str) for n in self.exact):
                raise TypeError("names must hold only str tensor names")
        if prefix is not None and not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, not {type(prefix).__name__}")
        self.prefix = prefix
        self.rows: dict[str, tuple[int | None, int | None]] = {}
        if rows is not None:
            if not isinstance(rows, Mapping):
                raise TypeError(f"rows must map tensor names to slices, not {type(rows).__name__}")
            for name, row_slice in rows.items():
                if not isinstance(name, str) or not isinstance(row_slice, slice):
                    raise TypeError(f"rows must map str names to slices, not {name!r}: {row_slice!r}")
                for bound in (row_slice.start, row_slice.stop):
                    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)):
                        raise TypeError(f"rows[{name!r}]: slice bounds must be int or None, not {bound!r}")
                if row_slice.step not in (None, 1):
                    raise ValueError(f"rows[{name!r}]: only contiguous row slices (step 1) can be read in place, "
                                     f"not step {row_slice.step!r}")
                self.rows[name] = (row_slice.start, row_slice.stop)

    def within(self, names: frozenset[str]) -> _Selection:
        """This selection narrowed to ``names`` (which it chose): one shard's part of a sharded restore."""
        narrowed = _Selection(names, None, None)
        narrowed.rows = {n: r for n, r in self.rows.items() if n in names}
        return narrowed

    @property
    def partial(self) -> bool:
        return self.exact is not None or self.predicate is not None or self.prefix is not None or bool(self.rows)

    def wants(self, name: str) -> bool:
        if self.exact is not None and name not in self.exact:
            return False
        if self.prefix is not None and not name.startswith(self.prefix):
            return False
        return self.predicate is None or bool(self.predicate(name))

    def require_all(self, available: Any, where: str) -> None:
        """Every name asked for by name (``names`` as a collection, ``rows``) is in ``available`` (entries
        or names) and chosen: ``CheckpointError`` naming the missing ones before anything is allocated."""
        have = {getattr(e, "name", e) for e in available}
        asked = set(self.exact or ()) | set(self.rows)
        missing = sorted(asked - have)
        if missing:
            raise CheckpointError(f"{where!r} holds no tensor named {', '.join(map(repr, missing[:5]))}"
                                  f"{' and more' if len(missing) > 5 else ''}; nothing was restored")
        unchosen = sorted(n for n in self.rows if not self.wants(n))
        if unchosen:
            raise ValueError(f"rows= names tensors that names=/prefix= leave out: {', '.join(map(repr, unchosen))}")

    def cut(self, entry: _Entry, where: str) -> _Entry:
        """``entry``, or just its rows when ``rows`` names it: the same bytes, narrowed to the rows asked for."""
        if entry.name not in self.rows:
            return entry
        if not entry.shape:
            raise ValueError(f"rows[{entry.name!r}]: {where!r} holds it as a scalar (shape ()), which has no rows")
        start, stop = self.rows[entry.name]
        first, last, _ = slice(start, stop).indices(entry.shape[0])
        if last <= first:
            raise ValueError(f"rows[{entry.name!r}] = {start}:{stop} selects no row of its {entry.shape[0]}")
        row_bytes = (entry.end - entry.begin) // entry.shape[0]
        return entry._replace(shape=(last - first, *entry.shape[1:]), begin=entry.begin + first * row_bytes,
                              end=entry.begin + last * row_bytes)


def _restore_file(bridge: Bridge, path: str, file: BinaryIO, header: _Header, selection: _Selection,
                  partial: bool, alignment: int, verify: bool) -> PendingRestore:
    """``restore`` of one file whose header is checked: the tensors ``selection`` chooses, in file order
    (``partial``: not every byte of the data section, so its checksum cannot be verified), allocated here
    and filled on a reader thread (``PendingRestore``). ``file`` stays the caller's: the reader reads a
    duplicate of its descriptor."""
    held = _held_dtypes(bridge)
    chosen = [selection.cut(e, path) for e in header.entries if selection.wants(e.name)]
    specs = []  # each tensor's (spec, extent), kept for the allocations
    by_shape: dict[tuple[tuple[int, ...], str], tuple[ObjectSpec, int]] = {}  # a model's layers share shapes
    for entry in chosen:  # spec_for_array's own checks (alignment, sizes) before any allocation
        key = (entry.shape, entry.dtype)
        if key not in by_shape:
            by_shape[key] = spec_for_array(entry.shape, entry.dtype, alignment)
        spec, extent = by_shape[key]
        specs.append((spec, extent))
        if entry.dtype not in held:  # before anything is allocated or read: the bridge's own refusal
            with _context(f"restore {path!r}: tensor {entry.name!r} is {entry.dtype} (nothing was restored)"):
                bridge.free(bridge.alloc(spec, extent))  # UnsupportedDType, checked before any allocation
    expected = header.metadata.get("checksum") if verify else None
    if expected and partial:
        raise ValueError(f"{path!r} records a checksum of its whole data section, which a partial restore "
                         f"(names=, prefix=, rows=) does not read: pass verify=False to restore part of it")
    # Every tensor is allocated, then the reader starts: started on the first tensor while the rest were
    # allocated, its thread and this one took turns at the GIL (each turn up to the interpreter's switch
    # interval), and 3000 small tensors were read at half the speed; allocated first, it finds them all
    # handed and reads adjacent ones together (_RestoreReader.run).
    stop = threading.Event()
    handed: queue.SimpleQueue[tuple[_Entry, DeviceHandle, Future] | None] = queue.SimpleQueue()
    tensors: dict[str, DeviceTensor] = {}
    try:
        for entry, (spec, extent) in zip(chosen, specs):
            try:
                handle = bridge.alloc(spec, extent)
            except BridgeError as error:
                raise _with_context(error, f"restore {path!r}: tensor {entry.name!r}") from error
            landed: Future = Future()
            tensors[entry.name] = DeviceTensor(bridge, handle, entry.shape, entry.dtype, landing=landed)
            handed.put((entry, handle, landed))
        handed.put(None)
        reading = _READERS.submit(_RestoreReader(bridge, path, file, expected, stop).run, handed)
    except BaseException:
        _free_all(tensors)  # nothing was read into them
        raise
    return PendingRestore(path, tensors, reading=reading, stop=stop)


class PendingRestore(Mapping[str, DeviceTensor]):
    """What ``restore(..., wait=False)`` returns: ``{name: DeviceTensor}`` at once, filled from the file by a
    reader thread in file order.

    Each tensor's ``ready()`` is True once its own bytes are on the device,
    so compute can start on the first tensors while the rest of the file is
    read; its ``wait()`` waits for them (and raises the restore's error if
    the reader failed before reaching it). ``wait()`` here waits for the whole
    file and the verdict of its checksum: the bytes are verified only once it
    returns True. When the restore fails (a checksum that differs, a file that
    ends early, a copy that fails), ``wait()`` frees every tensor and raises
    the error, naming the file and the tensor; ``abandon()`` stops the reader
    and frees every tensor.
    """

    def __init__(self, path: str, tensors: dict[str, DeviceTensor], *, reading: Future | None = None,
                 stop: threading.Event | None = None, parts: list[PendingRestore] | None = None) -> None:
        self._path = path
        self._tensors = tensors
        self._parts = parts or []  # a sharded restore: one per file
        self._reading = reading  # one file: its reader
        self._stop = stop
        self._failure: BaseException | None = None

    def __getitem__(self, name: str) -> DeviceTensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return f"PendingRestore({self._path!r}, {len(self._tensors)} tensors, {'read' if self.done() else 'reading'})"

    def done(self) -> bool:
        """True once every file has been read to its end and its checksum compared, or the reading failed."""
        return all(part.done() for part in self._parts) and (self._reading is None or self._reading.done())

    def ready(self) -> bool:
        """True once every tensor is on the device and verified (never blocks); raises as ``wait``."""
        return self.done() and self.wait(0)

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the whole restore: True once every tensor is on the device and the checksum matched,
        False if ``timeout`` seconds passed first. On a failure every tensor is freed and the error raised."""
        if self._failure is not None:
            raise self._failure
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        try:
            failures = []
            for part in self._parts:  # every file's reader stops before anything is freed
                try:
                    if not part.wait(left()):
                        return False
                except BaseException as error:  # noqa: BLE001 - raised below
                    failures.append(error)
            if failures:
                raise failures[0]
            if self._reading is None:
                return True  # its files' own waits saw their tensors
            try:
                self._reading.result(left())
            except FutureTimeout:
                return False
            for name, tensor in self._tensors.items():
                try:
                    if not (tensor.freed or tensor.wait(left())):
                        return False
                except BridgeError as error:  # a copy that failed: named by its tensor
                    raise _with_context(error, f"restore {self._path!r}: tensor {name!r}") from error
            return True
        except BaseException as error:
            self._failure = error
            self.abandon()
            raise

    def abandon(self) -> None:
        """Stops the reading before its next chunk, waits for it to stop, and frees every tensor (the bridge
        defers a free while a copy still fills the allocation). Idempotent."""
        for part in self._parts:
            part.abandon()
        if self._stop is not None:
            self._stop.set()
        if self._reading is not None:
            with contextlib.suppress(BaseException):
                self._reading.result(_CLEANUP_WAIT_S)
        _free_all(self._tensors)

    def tensors(self) -> dict[str, DeviceTensor]:
        """``{name: DeviceTensor}``, once ``wait()`` has seen the whole restore through (raising its error)."""
        self.wait()
        return dict(self._tensors)


def _free_all(tensors: Mapping[str, DeviceTensor]) -> None:
    for tensor in tensors.values():  # their copies first, so the frees happen now, not deferred
        if tensor.freed:
            continue
        with contextlib.suppress(Exception):  # the failure is being raised already
            tensor.wait(timeout=_CLEANUP_WAIT_S)
        tensor.free()


# Files read at once (the shards of a sharded checkpoint, restores that do not wait), each on a reader
# thread whose large chunks are read in _READ_THREADS parts.
_FILE_READERS = 4
_READERS: ThreadPoolExecutor
_PART_READERS: ThreadPoolExecutor


def _start_reader_pools() -> None:
    """The reader threads' pools, at import and again in a forked child: a child inherits a pool whose
    threads did not come with it, and a restore there would wait for them forever."""
    global _READERS, _PART_READERS
    _READERS = ThreadPoolExecutor(_FILE_READERS, thread_name_prefix="devbridge-restore")
    _PART_READERS = ThreadPoolExecutor(_FILE_READERS * (_READ_THREADS - 1), thread_name_prefix="devbridge-read")


_start_reader_pools()
os.register_at_fork(after_in_child=_start_reader_pools)


def _restore_sharded(bridge: Bridge, index_path: str, selection: _Selection, alignment: int,
                     verify: bool) -> PendingRestore:
    """``restore`` of a sharded checkpoint: every shard's header is checked against the index (each tensor the
    index maps to a shard is in it) before anything is allocated; then the shards are restored in parallel,
    each tensor from the shard the index names. A failure in any shard frees what every shard restored."""
    weight_map = _read_index(index_path)
    selection.require_all(weight_map, index_path)
    directory = os.path.dirname(os.path.abspath(index_path))
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if selection.wants(name):
            by_shard.setdefault(shard, []).append(name)
    opened: list[tuple[str, BinaryIO, _Header]] = []  # (shard, its file, its header)
    try:
        for shard in sorted(by_shard):
            try:
                file, header = _open_checkpoint(os.path.join(directory, shard))
            except FileNotFoundError:
                raise CheckpointError(f"{index_path!r} maps {by_shard[shard][0]!r} to {shard!r}, which is not there; "
                                      f"nothing was restored") from None
            opened.append((shard, file, header))
            held_here = {e.name for e in header.entries}
            absent = sorted(set(by_shard[shard]) - held_here)
            if absent:
                raise CheckpointError(f"{index_path!r} maps {absent[0]!r} to {shard!r}, which holds no such tensor; "
                                      f"nothing was restored")
        parts: list[PendingRestore] = []
        try:
            for shard, file, header in opened:  # each allocates its tensors, then reads on a reader thread
                wanted = frozenset(by_shard[shard])
                partial = selection.partial or len(wanted) != len(header.entries)
                parts.append(_restore_file(bridge, os.path.join(directory, shard), file, header,
                                           selection.within(wanted), partial, alignment, verify))
        except BaseException:
            for part in parts:
                part.abandon()
            raise
        return PendingRestore(index_path, {name: t for part in parts for name, t in part.items()}, parts=parts)
    finally:
        for _, file, _ in opened:
            file.close()


def _read_index(index_path: str) -> dict[str, str]:
    """A sharded checkpoint's ``weight_map`` (tensor name -> shard file beside the index), checked: a JSON
    object whose ``weight_map`` maps str names to plain relative file names (no absolute path, no ``..``)."""
    try:
        with open(index_path, "rb") as f:
            index = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{index_path!r} is not a readable JSON index of a sharded checkpoint: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path!r} has no weight_map (tensor name -> shard file): "
                              f"not the index of a sharded checkpoint")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise CheckpointError(f"{index_path!r} maps {name!r} to {shard!r}, not a file name")
        if os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/"):
            raise CheckpointError(f"{index_path!r} maps {name!r} to {shard!r}: shards must lie beside the index")
    return weight_map


class _RestoreReader:
    """Reads a checkpoint's data section into its tensors, in file order, on a reader thread: each tensor
    streams through the transfer planner's ring chunks, ``pread`` straight from the file into a chunk (no
    map of the file, no staging buffer: host memory beyond the tensors stays within the ring), the chunk's
    device copy in flight while the next is read. A chunk of ``_PARALLEL_READ_BYTES`` or more is read in
    parts on ``_READ_THREADS`` threads, each part hashed by the thread that read it (crc32 parts are
    combined; sha256 hashes the chunk in order once it is read). The checksum is compared at the end."""

    def __init__(self, bridge: Bridge, path: str, file: BinaryIO, expected: str | None,
                 stop: threading.Event) -> None:
        self._bridge = bridge
        self._stop = stop  # set by PendingRestore.abandon: the next chunk raises
        self._path = path
        self._start = file.tell()  # the data section's first byte
        self._expected = expected
        self._algorithm = expected.partition(":")[0] if expected else None
        self._digest = _new_digest(self._algorithm) if self._algorithm else None
        self._fd = os.dup(file.fileno())  # the caller closes its file once restore returns
        self._advised_to = 0  # file offsets: read ahead up to here

    def run(self, handed: queue.SimpleQueue) -> None:
        """Fills each tensor ``handed`` to it as ``(entry, handle, landing)`` until ``None`` (its landing gets
        the copies still in flight), then compares the checksum. Small tensors next to each other in the file
        that are already handed go together (``_fill_batch``). A failure is set on the landing of every
        tensor not filled yet, those still to be handed included, and raised (``PendingRestore.wait`` frees
        them)."""
        landings: list[Future] = []
        handing = True

        def take(block: bool) -> Any:
            nonlocal handing
            item = handed.get() if block else handed.get_nowait()
            if item is None:
                handing = False
            else:
                landings.append(item[2])
            return item

        try:
            planner = TransferPlanner(self._bridge, wait_for_room=_RING_ROOM_WAIT_S)
            item = take(True)
            while item is not None:
                batch = [item]
                nbytes = item[0].end - item[0].begin
                item = _NOT_TAKEN
                while nbytes < _BATCH_READ_BYTES and len(batch) < _BATCH_TENSORS:
                    try:
                        item = take(False)
                    except queue.Empty:
                        item = _NOT_TAKEN
                        break
                    if item is None or item[0].begin != batch[-1][0].end or \
                            nbytes + item[0].end - item[0].begin > _BATCH_READ_BYTES:
                        break
                    batch.append(item)
                    nbytes += item[0].end - item[0].begin
                    item = _NOT_TAKEN
                if len(batch) == 1:
                    self._fill_one(planner, *batch[0])
                else:
                    self._fill_batch(planner, batch)
                if item is _NOT_TAKEN:
                    item = take(True)
            if self._digest is not None and not self._stop.is_set():
                actual = f"{self._algorithm}:{self._digest.hexdigest()}"
                if actual != self._expected:
                    raise CheckpointError(f"{self._path!r} is corrupt: the data's checksum is {actual}, "
                                          f"the file records {self._expected}; nothing was restored")
        except BaseException as error:
            while handing:  # the allocating thread ends with None
                take(True)
            for landed in landings:
                if not landed.done():
                    landed.set_exception(error)
            raise
        finally:
            os.close(self._fd)

    def _fill_one(self, planner: TransferPlanner, entry: _Entry, handle: DeviceHandle, landed: Future) -> None:
        """One tensor by the planner's stream: straight into its memory where the device's memory is host
        memory (``write_in_place``), else through the ring in chunks."""
        try:
            events = planner.submit_stream(lambda at, chunk, begin=entry.begin: self._read(begin, at, chunk),
                                           entry.end - entry.begin, into=handle)
        except (BridgeError, CheckpointError) as error:  # both rebuilt with the name in front
            raise _with_context(error, f"restore {self._path!r}: tensor {entry.name!r}") from error
        landed.set_result(events)

    def _fill_batch(self, planner: TransferPlanner, batch: list[tuple[_Entry, DeviceHandle, Future]]) -> None:
        """Small tensors next to each other in the file as one stream (``submit_scatter``): where the device's
        memory is host memory, one ``preadv`` straight into all of them and one hash pass, instead of a
        planner call, a read and a hash each."""
        first = batch[0][0]
        try:
            results = planner.submit_scatter(lambda at, views: self._read_pieces(first.begin, at, views),
                                             [(handle, 0, entry.end - entry.begin) for entry, handle, _ in batch])
        except (BridgeError, CheckpointError) as error:
            names = f"tensor {first.name!r}" + (f" and the {len(batch) - 1} after it" if len(batch) > 1 else "")
            raise _with_context(error, f"restore {self._path!r}: {names}") from error
        for (_, _, landed), events in zip(batch, results):
            landed.set_result(events)

    def _read_pieces(self, tensor: int, offset: int, views: list[memoryview]) -> None:
        """Bytes from ``offset`` of the run of tensors starting at byte ``tensor`` of the data section into
        ``views``, in order (``preadv``, repeated while the kernel returns less), hashed in order. A run of
        ``_PARALLEL_READ_BYTES`` or more is read in ``_READ_THREADS`` parts, as ``_read`` reads a chunk."""
        if len(views) == 1:
            self._read(tensor, offset, views[0])
            return
        if self._stop.is_set():
            raise CheckpointError(f"the restore of {self._path!r} was abandoned")
        at = self._start + tensor + offset  # in the file
        total = sum(v.nbytes for v in views)
        self._read_ahead(at + total)
        crc_parts = self._algorithm == "crc32" and _crc32_combine is not None
        if total < _PARALLEL_READ_BYTES:
            parts = [(0, total, views)]
        else:
            parts = [(first, last, _cut(views, first, last)) for first, last in _split(total, _READ_THREADS)]
        reads = [_PART_READERS.submit(self._read_run, part, at + first, offset + first, crc_parts)
                 for first, last, part in parts[1:]]
        try:  # the first part on this thread
            results = [self._read_run(parts[0][2], at, offset, crc_parts)]
        finally:
            futures_wait(reads)  # every part has stopped writing before a failure gives the tensors back
        results += [read.result() for read in reads]
        if self._digest is None:
            return
        if crc_parts:
            for (first, last, _), crc in zip(parts, results):
                self._digest.combine(crc, last - first)
        else:
            for view in views:
                self._digest.update(view)

    def _read_run(self, views: list[memoryview], at: int, offset: int, crc: bool) -> int | None:
        """``views`` filled from byte ``at`` of the file on, in order, ``_HASH_STEP_BYTES`` at a time, each
        step hashed right after it is read (still in the CPU's cache); their CRC-32 when ``crc``."""
        total = sum(v.nbytes for v in views)
        value = 0
        for first in range(0, total, _HASH_STEP_BYTES):
            step = _cut(views, first, min(first + _HASH_STEP_BYTES, total)) if total > _HASH_STEP_BYTES else views
            left, done = step, first
            while left:
                n = os.preadv(self._fd, left[:_IOV_MAX], at + done)
                if not n:
                    raise CheckpointError(f"the file ends {total - done} bytes early "
                                          f"(at byte {offset + done} of the run of tensors read together)")
                done += n
                while left and n >= left[0].nbytes:
                    n -= left[0].nbytes
                    left = left[1:]
                if n:
                    left = [left[0][n:], *left[1:]]
            if crc:
                for view in step:
                    value = _crc32(view, value)
        return value if crc else None

    def _read(self, tensor: int, offset: int, chunk: memoryview) -> None:
        """Bytes ``[offset, offset + len(chunk))`` of the tensor starting at byte ``tensor`` of the data section
        into ``chunk``, hashed in order."""
        if self._stop.is_set():
            raise CheckpointError(f"the restore of {self._path!r} was abandoned")
        at = self._start + tensor + offset  # in the file
        self._read_ahead(at + chunk.nbytes)
        if chunk.nbytes < _PARALLEL_READ_BYTES:
            _pread_exactly(self._fd, chunk, at, offset)
            if self._digest is not None:
                self._digest.update(chunk)
            return
        parts = _split(chunk.nbytes, _READ_THREADS)
        crc_parts = self._algorithm == "crc32" and _crc32_combine is not None
        reads = [_PART_READERS.submit(self._read_part, chunk[first:last], at + first, offset + first, crc_parts)
                 for first, last in parts[1:]]
        try:  # the first part on this thread
            results = [self._read_part(chunk[:parts[0][1]], at, offset, crc_parts)]
        finally:
            futures_wait(reads)  # every part has stopped writing into the chunk before a failure gives it back
        results += [read.result() for read in reads]
        if self._digest is None:
            return
        if crc_parts:
            for (first, last), crc in zip(parts, results):
                self._digest.combine(crc, last - first)
        else:
            self._digest.update(chunk)

    def _read_ahead(self, end: int) -> None:
        """Asks the kernel to start reading the next ``_READ_AHEAD_BYTES`` from ``end`` on: the disk works
        while this chunk is hashed and copied (a cold file otherwise idles it between reads)."""
        if end + _READ_AHEAD_BYTES // 2 <= self._advised_to:
            return
        start = max(end, self._advised_to)
        self._advised_to = end + _READ_AHEAD_BYTES
        with contextlib.suppress(OSError):  # a hint
            os.posix_fadvise(self._fd, start, self._advised_to - start, os.POSIX_FADV_WILLNEED)

    def _read_part(self, view: memoryview, at: int, offset: int, crc: bool) -> int | None:
        _pread_exactly(self._fd, view, at, offset)
        return _crc32(view) if crc else None


_NOT_TAKEN = object()  # _RestoreReader.run: no tensor taken ahead of the batch just read
# Restore: tensors next to each other in the file go as one stream (submit_scatter: a preadv into them all
# where device memory is host memory, in parts on _READ_THREADS threads past _PARALLEL_READ_BYTES), up to
# _BATCH_READ_BYTES and _BATCH_TENSORS at a time; a preadv takes at most _IOV_MAX pieces.
_BATCH_READ_BYTES = 8 << 20
_BATCH_TENSORS = 1024
_IOV_MAX = 1024
# Restore: a run read in one piece is read and hashed this much at a time (the hash reads what the read
# just wrote while the CPU's cache still holds it).
_HASH_STEP_BYTES = 1 << 20


def _cut(views: list[memoryview], first: int, last: int) -> list[memoryview]:
    """Bytes ``[first, last)`` of the run ``views`` make, as views."""
    out, at = [], 0
    for view in views:
        end = at + view.nbytes
        if end > first and at < last:
            out.append(view[max(first, at) - at:min(last, end) - at])
        at = end
    return out


def _split(nbytes: int, parts: int) -> list[tuple[int, int]]:
    """``[0, nbytes)`` as ``parts`` ranges of nearly equal length, each a multiple of 4 KiB but the last."""
    step = ((nbytes + parts - 1) // parts + 4095) // 4096 * 4096
    return [(first, min(first + step, nbytes)) for first in range(0, nbytes, step)]


def _pread_exactly(fd: int, view: memoryview, at: int, offset: int) -> None:
    """Fills ``view`` from byte ``at`` of the file, which holds byte ``offset`` of the tensor: a file that ends
    first (it shrank since its header was checked) is ``_read_exactly``'s ``CheckpointError`` naming where."""
    position = at

    def readinto(part: memoryview) -> int:
        nonlocal position
        n = os.preadv(fd, [part], position)
        position += n
        return n

    _read_exactly(readinto, view, offset)


__all__ = ["CheckpointError", "PendingRestore", "checkpoint", "checkpoint_info", "restore"]
