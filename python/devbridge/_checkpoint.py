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
import errno
import hashlib
import io
import json
import math
import operator
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, BinaryIO, Callable, NamedTuple

import numpy as np

from ._devbridge import (Bridge, ObjectSpec, TransferPlanner, _alloc_owned, _checkpoint_open, _checkpoint_select,
                         _restore_start, _RestoreStream, _safetensors_name, dtype_info)
from ._errors import BridgeError
from ._portable import (
    _CONTEXTUAL,
    CheckpointError,
    _Source,
    _context,
    _gc_paused,
    _raise_in_context,
    _resolve,
    _with_context,
    _stream,
    _write_all,
)
from ._staging import (
    _CLEANUP_WAIT_S,
    DeviceTensor,
    _checked_timeout,
    _NotCopyable,
    spec_for_array,
)

FORMAT = "devbridge-checkpoint"
FORMAT_VERSION = "1"
# Restore: how long a chunk waits for ring room another caller holds (another restore, a stream) before
# Backpressure: room that long held is a stall, not a queue.
_RING_ROOM_WAIT_S = 60.0
# Checksums a checkpoint may record: algorithm -> hex digits. checkpoint writes crc32 by default (see
# docs/PORTABLE.md, "Checksums"); restore and `devbridge checkpoint inspect` verify both.
_CHECKSUM_DIGITS = {"sha256": 64, "crc32": 8}
_DEFAULT_CHECKSUM = "crc32"
# The most bytes a safetensors header may hold: the C++ reader's (kHeaderLimit, checkpoint_file.hpp) and the
# safetensors package's limit. checkpoint writes no header past it (no reader would take the file), and a
# sharded checkpoint's index is refused past it, as a header is.
_HEADER_LIMIT = 100_000_000


def _checked_path(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, not {type(path).__name__}")
    path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"path must name a str path, not {type(path).__name__}")
    if not path:
        raise ValueError("path is empty")
    if "\0" in path:  # as open() refuses it: the C library would open the name before the NUL
        raise ValueError(f"path {path!r}: embedded null byte")
    return path


try:  # ISA-L's CRC-32: the same checksum as zlib's, 5x faster here
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # a dependency; where its wheel is missing, zlib's
    from zlib import crc32 as _crc32


class _Crc32:
    """CRC-32 (zlib's: the IEEE polynomial, as gzip and PNG) behind hashlib's interface."""

    name = "crc32"

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = _crc32(data, self._value)

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
        # The pool's work item keeps its arguments until its thread drops it, which can be after result()
        # returned; a chunk lent to the checkpoint's sink would still be held then (BufferError). The view
        # rides in a box the task empties: nothing holds it once the update returns.
        box = [view]
        return self._pool.submit(lambda: self.digest.update(box.pop()))

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
    tensors stream to the file chunk by chunk, from the ring or straight from
    host-addressable device memory (the checkpoint is never held in memory),
    hashed on a thread of their own while they are
    written, into a temporary file beside ``path`` that is fsynced, renamed
    over ``path`` and its directory fsynced: a crash leaves the old file or
    the new one, never a mix. A ``path`` that is a symlink is written through:
    its target is replaced and the link stays. A header past the 100 MB every
    reader takes (``ValueError``) is refused before anything is written.
    Returns the metadata written.
    """
    return _write_checkpoint(bridge, path, tensors, metadata, checksum)


def _write_checkpoint(bridge: Bridge, path: Any, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None,
                      checksum: str) -> dict[str, str]:
    path = _checked_path(path)
    if not isinstance(checksum, str):
        raise TypeError(f"checksum must be a str, not {type(checksum).__name__}")
    if checksum not in _CHECKSUM_DIGITS:
        raise ValueError(f"checksum {checksum!r} is not one of {', '.join(sorted(_CHECKSUM_DIGITS))}")
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of names to DeviceTensors or DeviceHandles, "
                        f"not {type(tensors).__name__}")
    # The collector is paused only while the header's objects are made (tens of thousands of them for a
    # large model), not while the data streams and is fsynced: a pause that long lets another thread's
    # cyclic garbage pile up.
    with _gc_paused():
        sources, sizes, meta, encoded, placeholder = _plan_checkpoint(bridge, path, tensors, metadata, checksum)
    total = len(encoded) + sum(sizes)
    _write_planned(path, sources, sizes, meta, encoded, placeholder, total, checksum)
    return dict(meta)


def _plan_checkpoint(bridge: Bridge, path: str, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None,
                     checksum: str) -> tuple[list[tuple[str, _Source]], list[int], dict[str, str], bytes, str]:
    """What ``checkpoint`` writes, before anything is: each tensor's source and size in file order, the
    metadata, and the encoded header (its checksum a placeholder of the final length)."""
    sources: list[tuple[str, _Source]] = []
    for name, x in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"checkpoint {path!r}: tensor names must be str, not {type(name).__name__}")
        if name == "__metadata__":  # the header's own key; "" is a name (the safetensors package writes it)
            raise ValueError(f"checkpoint {path!r}: {name!r} cannot name a tensor (it is the header's metadata)")
        _check_utf8(name, f"checkpoint {path!r}: tensor name {name!r}")
        try:  # the context is formatted only for an error: a checkpoint may have tens of thousands of tensors
            sources.append((name, _resolve(bridge, x)))
        except _CONTEXTUAL as error:
            _raise_in_context(error, f"checkpoint {path!r}: tensor {name!r}")
    itemsizes = {name: dtype_info(name)["itemsize"] for name in {source.dtype for _, source in sources}}
    # The package's own order: widest dtype first, so every tensor starts aligned to its itemsize.
    sources.sort(key=lambda entry: (-itemsizes[entry[1].dtype], entry[0]))
    placeholder = f"{checksum}:" + "0" * _CHECKSUM_DIGITS[checksum]
    meta = _checkpoint_metadata(bridge, metadata, {name: s.dtype for name, s in sources}, placeholder)
    header: dict[str, Any] = {"__metadata__": meta}
    safetensors_names = {name: _safetensors_name(name) for name in itemsizes}
    sizes: list[int] = []
    begin = 0
    for name, source in sources:
        nbytes = math.prod(source.shape) * itemsizes[source.dtype]
        header[name] = {"dtype": safetensors_names[source.dtype], "shape": list(source.shape),
                        "data_offsets": [begin, begin + nbytes]}
        sizes.append(nbytes)
        begin += nbytes

    encoded = _encode_header(header)
    header_bytes = len(encoded) - 8  # what the 8-byte length says, padding included, as a reader checks it
    if header_bytes > _HEADER_LIMIT:  # the rename would replace a good file with one no reader takes
        raise ValueError(f"checkpoint {path!r}: its header (the tensors' names, dtypes and shapes, and the "
                         f"metadata) would be {header_bytes} bytes, past the {_HEADER_LIMIT} a safetensors "
                         f"reader takes (restore's, the safetensors package's); nothing was written")
    return sources, sizes, meta, encoded, placeholder


def _write_planned(path: str, sources: list[tuple[str, _Source]], sizes: list[int],
                   meta: dict[str, str], encoded: bytes, placeholder: str, total: int, checksum: str) -> None:
    """Writes what ``_plan_checkpoint`` planned: the data streamed into a temporary file beside ``path``,
    hashed, fsynced and renamed over it."""
    # A symlink is written through, as open() writes through it: the temporary file goes beside its target
    # and the rename replaces the target, so the link stays a link.
    target = os.path.realpath(path)
    directory = os.path.dirname(target)
    if os.path.isdir(target):
        raise IsADirectoryError(errno.EISDIR, f"checkpoint {path!r}: it is a directory; name a file (in it)")
    if path.endswith((os.sep, os.altsep or os.sep)):
        # realpath drops the trailing separator: "models/" would become a file "models". The caller named
        # a directory (which is not there): refused as the directory is, nothing written.
        raise IsADirectoryError(errno.EISDIR, f"checkpoint {path!r}: it ends in a separator, so it names a "
                                              f"directory (which is not there); name a file; nothing was written")
    if os.path.lexists(target) and not stat.S_ISREG(os.stat(target).st_mode):
        # The rename would replace the node itself (as root, /dev/null), as the C ABI's writer refuses to.
        raise OSError(errno.EINVAL, f"checkpoint {path!r}: it is not a regular file (a FIFO, a device, a socket), "
                                    f"and a checkpoint replaces the file it names whole; name a regular file; "
                                    f"nothing was written")
    outcome = "the old file is kept" if os.path.lexists(target) else "nothing was written"
    try:
        fd, temporary = tempfile.mkstemp(prefix=_temporary_prefix(target), suffix=".tmp", dir=directory)
    except OSError as error:  # the directory is missing, read-only, full of names...
        raise _os_error_in_context(error, f"checkpoint {path!r}: cannot make its temporary file in {directory!r}",
                                   "nothing was written") from error
    try:
        with open(fd, "wb", buffering=0) as file:
            hasher = _Hasher(checksum)
            try:
                _reserve_blocks(file.fileno(), total)
                _write_all(file, encoded)  # the checksum is a placeholder of the final length

                writeback = _Writeback(file.fileno(), len(encoded))

                def write_and_hash(view: memoryview) -> None:
                    # Hashed (on the hasher's thread) while it is written here; both done before the return.
                    hashed = hasher.submit(view)
                    try:
                        _write_all(file, view)
                    finally:
                        hashed.result()
                    writeback.wrote(view.nbytes)

                batch = _SmallChunks(write_and_hash)

                def sink(offset: int, chunk: Any) -> None:
                    # The chunk is a ring range that goes back when this returns, or the tensor's own
                    # memory: a large one is written and hashed from there, a small one copied out to go
                    # with the next ones.
                    batch.add(memoryview(chunk).cast("B"))

                planners: dict[int, TransferPlanner] = {}  # by bridge domain: each asks its backend once
                for (name, source), nbytes in zip(sources, sizes):
                    try:
                        planner = planners.get(source.bridge.domain)
                        if planner is None:
                            planner = planners[source.bridge.domain] = TransferPlanner(source.bridge)
                        if source.strides is None and nbytes:  # row-major: its chunks as they come
                            planner.download_stream(source.handle, source.byte_offset, nbytes, batch.add_at)
                        else:
                            _stream(source, sink, planner)
                    except _CONTEXTUAL as error:
                        _raise_in_context(error, f"checkpoint {path!r}: tensor {name!r}")
                batch.flush()
                meta["checksum"] = hasher.checksum()
                file.seek(0)
                _write_all(file, _with_checksum(encoded, placeholder, meta["checksum"]))
            finally:
                hasher.close()
            os.fchmod(file.fileno(), _mode_for(target))
            os.fsync(file.fileno())
        replaced = _keep_old_blocks(target, temporary)
        os.replace(temporary, target)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(error, OSError):  # the file system's refusal (full, over quota, read-only...), named
            raise _os_error_in_context(error, f"checkpoint {path!r} ({total} bytes, written beside it as "
                                              f"{os.path.basename(temporary)!r})", outcome) from error
        raise
    _fsync_directory(directory)
    if replaced is not None:
        _free_later(replaced)


def _reserve_blocks(fd: int, nbytes: int) -> None:
    """The file's blocks at once, not a write at a time. Only a hint, where the file system cannot
    preallocate; but a file system that has no room says so here, before a byte is written."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise


def _temporary_prefix(path: str) -> str:
    """What the names of the files a checkpoint of ``path`` writes beside it start with."""
    return f".{os.path.basename(path)}."


def _remove_interrupted_checkpoint_files(path: str) -> list[str]:
    """Removes the files ``checkpoint`` writes beside ``path`` while it writes it (its temporary
    ``.<name>.XXXXXXXX.tmp`` and the replaced file's second name ``.<name>.XXXXXXXX.old``), which a process
    killed in the middle of a checkpoint leaves behind; returns the paths removed. Only once the process that
    wrote them is gone (a Ray worker restarted): a path another live writer uses would lose its file in
    progress. A symlink's are beside its target, where checkpoint writes them."""
    if os.path.islink(path):
        path = os.path.realpath(path)
    directory = os.path.dirname(os.path.abspath(path))
    pattern = re.compile(re.escape(_temporary_prefix(path)) + r"[A-Za-z0-9_]+\.(?:tmp|old)")
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:  # the directory is gone or unreadable: restore (or the next checkpoint) says so
        return removed
    for name in sorted(names):
        if pattern.fullmatch(name):
            stale = os.path.join(directory, name)
            try:
                if not os.path.isfile(stale) or os.path.islink(stale):
                    continue
                os.unlink(stale)
                removed.append(stale)
            except OSError:
                pass  # removed meanwhile, or not ours to remove: left as it is
    return removed



def _os_error_in_context(error: OSError, context: str, outcome: str) -> OSError:
    """``error`` as the same kind of OSError (same errno, so the same subclass), its message in
    ``context``: "[Errno 28] <context>: No space left on device; <outcome>"."""
    if error.errno is None:
        return error
    return OSError(error.errno, f"{context}: {error.strerror or os.strerror(error.errno)}; {outcome}")


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


def _with_checksum(encoded: bytes, placeholder: str, checksum: str) -> bytes:
    """The encoded header with its checksum in place of the placeholder of the same length (encoding a
    header of tens of thousands of tensors again would cost tens of milliseconds). The metadata comes
    first and its entries before the checksum are devbridge's own (format, version, generation), so the
    first ``"checksum":"<placeholder>"`` is the metadata's."""
    entry = f'"checksum":"{placeholder}"'.encode()
    at = encoded.index(entry)
    patched = f'"checksum":"{checksum}"'.encode()
    if len(patched) != len(entry):
        raise AssertionError(f"checksum {checksum!r} is not as long as its placeholder {placeholder!r}")
    return encoded[:at] + patched + encoded[at + len(entry):]


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

    def add_at(self, offset: int, view: memoryview) -> None:
        """``add``, as a streamed download's sink (``offset`` is the stream's, in order)."""
        self.add(view)

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
    dtype: str  # devbridge's name; the file's own spelling for a dtype devbridge lacks
    shape: tuple[int, ...]
    begin: int
    end: int
    # Why restore cannot take it (an empty shape, a dtype devbridge lacks), naming the file and the tensor; the
    # header reader keeps such an entry so the file's other tensors stay restorable: refused only when chosen.
    unrestorable: str | None = None


class _Header(NamedTuple):
    metadata: dict[str, str]
    entries: list[_Entry]  # in file order

    @property
    def checksum(self) -> str | None:
        """The checksum a devbridge checkpoint records (``format`` is devbridge's, as the C++ reader decides,
        which checked it is well-formed), else None: a plain safetensors file's metadata is its writer's own,
        a ``checksum`` key in it too."""
        if self.metadata.get("format") != FORMAT:
            return None
        # The reader takes hex digits in either case; the digests this compares with are lowercase.
        return self.metadata["checksum"].lower()


def _open_checkpoint(path: str) -> tuple[BinaryIO, _Header]:
    """Opens ``path`` and checks its header against the file before anything is allocated: the C++
    reader ``devbridge checkpoint inspect`` uses (include/devbridge/checkpoint_file.hpp), so both refuse
    the same files with the same reasons. Returns the file the header was read through (unbuffered,
    positioned at the data section) and the header; ``CheckpointError`` names the file when refused."""
    fd, metadata, tensors, data_start = _checkpoint_open(os.fsencode(path), repr(path))
    try:
        file = io.FileIO(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise
    file.seek(data_start)
    return file, _Header(metadata, [_Entry(*t) for t in tensors])


def _info_of(entry: _Entry) -> dict[str, Any]:
    """``checkpoint_info``'s entry of a tensor: an unrestorable one says why."""
    info = {"dtype": entry.dtype, "shape": entry.shape, "nbytes": entry.end - entry.begin}
    if entry.unrestorable is not None:
        info["unrestorable"] = entry.unrestorable
    return info


def checkpoint_info(path: Any) -> dict[str, Any]:
    """A checkpoint's header without restoring it: ``{"metadata": {...}, "tensors": {name: {"dtype",
    "shape", "nbytes"}}}`` (devbridge dtype names), after the same checks ``restore`` makes first. A tensor
    ``restore`` cannot take (an empty one, a dtype devbridge lacks: its ``"dtype"`` is then the file's
    spelling) is listed with ``"unrestorable"``, why; the file's other tensors can still be restored.

    ``path`` is what ``restore`` takes: a safetensors file, or a sharded checkpoint's index (told apart as
    ``restore`` tells them). For an index, ``"tensors"`` is every tensor its ``weight_map`` names, each as
    the shard the index maps it to holds it (what ``restore(index)`` returns), ``"metadata"`` is empty (the
    index's own ``"metadata"``, such as ``total_size``, is no safetensors metadata, and ``restore`` reads
    none of it), and ``"shards"`` maps each shard file named in the index to its own ``__metadata__``."""
    path = _checked_path(path)
    if path.lower().endswith(".json") and not _starts_as_safetensors(path):  # restore's own dispatch
        return _sharded_info(path)
    file, header = _open_checkpoint(path)
    file.close()
    return {"metadata": dict(header.metadata),
            "tensors": {e.name: _info_of(e) for e in header.entries}}


def _open_shard(index_path: str, directory: str, shard: str, names: list[str], said: str) -> tuple[BinaryIO, _Header]:
    """One shard of a sharded checkpoint opened and its header checked against the index: each tensor of
    ``names`` (those the index maps to it) is in it; ``CheckpointError`` otherwise, ending with ``said``."""
    try:
        file, header = _open_checkpoint(os.path.join(directory, shard))
    except FileNotFoundError:
        raise CheckpointError(f"{index_path!r} maps {names[0]!r} to {shard!r}, which is not there{said}") from None
    except OSError as error:  # not a directory, no permission...: the same kind, in the index's words
        raise _os_error_in_context(error, f"{index_path!r} maps {names[0]!r} to {shard!r}, which cannot be opened",
                                   said.removeprefix("; ") or "nothing was read") from error
    except CheckpointError as error:  # a directory, not safetensors, corrupt: the reader's words, in the index's
        raise CheckpointError(f"{index_path!r} maps {names[0]!r} to {shard!r}, which is refused: {error}{said}") \
            from None
    absent = sorted(set(names) - {e.name for e in header.entries})
    if absent:
        file.close()
        raise CheckpointError(f"{index_path!r} maps {absent[0]!r} to {shard!r}, which holds no such tensor{said}")
    return file, header


def _shards_of(weight_map: dict[str, str], wants: Callable[[str], bool]) -> dict[str, list[str]]:
    """The tensors ``wants`` of each shard the index names, by shard: one shard however the index spells its
    file (``x`` and ``./x`` are one file, read once)."""
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if wants(name):
            by_shard.setdefault(os.path.normpath(shard), []).append(name)
    return by_shard


def _sharded_info(index_path: str) -> dict[str, Any]:
    """``checkpoint_info`` of a sharded checkpoint's index: the index read by ``restore``'s reader
    (``_read_index``), every shard's header opened and checked against it as ``_restore_sharded`` does
    before it allocates, with its words (less its "nothing was restored": nothing is)."""
    weight_map = _read_index(index_path)
    directory = os.path.dirname(os.path.abspath(index_path))
    by_shard = _shards_of(weight_map, lambda name: True)
    tensors: dict[str, dict[str, Any]] = {}
    shards: dict[str, dict[str, str]] = {}
    for shard in sorted(by_shard):
        file, header = _open_shard(index_path, directory, shard, by_shard[shard], "")
        file.close()
        wanted = frozenset(by_shard[shard])
        tensors.update({e.name: _info_of(e) for e in header.entries if e.name in wanted})
        shards[shard] = dict(header.metadata)
    return {"metadata": {}, "tensors": tensors, "shards": shards}


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
    file beside it holds each tensor), and the shards are read in parallel
    (a ``.json`` name, in any case, is an index unless the file starts as a
    safetensors file does; the index is JSON as strict as a header).
    The header is checked against the file before anything is allocated: a file
    that is not safetensors, is truncated, or holds a dtype devbridge lacks or
    an empty tensor raises ``CheckpointError`` naming the file, the tensor
    and why. Every tensor is allocated, then a thread of the C++ library's
    (``checkpoint::RestoreStream``, no GIL) reads the data section in file
    order, adjacent tensors together: where device memory is host memory one
    ``preadv`` lands many tensors in their own bytes; elsewhere the bytes go
    through the ring's chunks, each chunk's device copy in flight while the
    next is read, so host memory beyond the tensors stays within the ring
    whatever the file's size. Large reads go in two parts on two threads. A
    devbridge checkpoint's checksum is computed as the bytes are read and,
    with ``verify`` (the default), compared at the end. When the checksum differs, the file ends early, or an allocation or
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
    (``ValueError`` otherwise: nothing would be verified); a selection of
    every tensor and every row is the whole file, and verified.
    """
    if not isinstance(bridge, Bridge):
        raise TypeError(f"bridge must be a devbridge.Bridge, not {type(bridge).__name__}")
    for flag, value in (("verify", verify), ("wait", wait)):
        if not isinstance(value, (bool, np.bool_)):  # numpy's too, as transfer and upload take them
            raise TypeError(f"{flag} must be a bool, not {type(value).__module__}.{type(value).__qualname__}")
    verify, wait = bool(verify), bool(wait)
    path = _checked_path(path)
    selection = _Selection(names, prefix, rows)
    # The collector is paused while the header's entries and the tensors' objects are made (tens of
    # thousands at once), not while the file is read (wait): another thread's cyclic garbage would pile up.
    with _gc_paused():
        # An index as the ecosystem names it (*.index.json, in any case); a safetensors file named *.json is
        # still a safetensors file: its first bytes say which.
        if path.lower().endswith(".json") and not _starts_as_safetensors(path):
            pending = _restore_sharded(bridge, path, selection, alignment, verify)
        else:
            file, header = _open_checkpoint(path)
            with file:
                selection.require_all(header.entries, path)
                pending = _restore_file(bridge, path, file, header, selection, alignment, verify)
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
                bounds = []
                for bound in (row_slice.start, row_slice.stop):  # any integer (numpy's too) but a bool
                    if bound is not None and (isinstance(bound, (bool, np.bool_)) or not hasattr(type(bound),
                                                                                             "__index__")):
                        raise TypeError(f"rows[{name!r}]: slice bounds must be int or None, not {bound!r}")
                    bounds.append(None if bound is None else operator.index(bound))
                step = row_slice.step  # as the bounds: any integer but a bool
                if step is not None and (isinstance(step, (bool, np.bool_)) or not hasattr(type(step), "__index__")):
                    raise TypeError(f"rows[{name!r}]: a slice step must be int or None, not {step!r}")
                if step is not None and operator.index(step) != 1:
                    raise ValueError(f"rows[{name!r}]: only contiguous row slices (step 1) can be read in place, "
                                     f"not step {step!r}")
                self.rows[name] = (bounds[0], bounds[1])

    def within(self, names: frozenset[str]) -> _Selection:
        """This selection narrowed to ``names`` (which it chose): one shard's part of a sharded restore."""
        narrowed = _Selection(names, None, None)
        narrowed.rows = {n: r for n, r in self.rows.items() if n in names}
        return narrowed

    @property
    def partial(self) -> bool:
        """Whether it chooses at all (else every tensor, whole); what it chooses may still be everything."""
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
                  alignment: int, verify: bool) -> PendingRestore:
    """``restore`` of one file whose header is checked: the tensors ``selection`` chooses, in file order,
    allocated here and filled on a reader thread (``PendingRestore``). A selection that leaves out a tensor
    or a row is partial: not every byte of the data section is read, so its checksum cannot be verified.
    ``file`` stays the caller's: the reader reads a duplicate of its descriptor."""
    held = _held_dtypes(bridge)
    # The library's one selection (checkpoint::select_tensors, the C ABI's too): names=, prefix=, in file order;
    # an unrestorable tensor is refused only when chosen.
    chosen = _checkpoint_select(header.entries, None if selection.exact is None else list(selection.exact),
                                selection.predicate, selection.prefix, repr(path))
    if selection.partial:
        chosen = [selection.cut(e, path) for e in chosen]
    # Every tensor and every row (names= all of them, rows= a[:]) is the whole file, not a part.
    partial = chosen != header.entries
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
                _alloc_owned(bridge, spec, extent).release()  # UnsupportedDType, checked before any allocation
    expected = header.checksum if verify else None
    if expected and partial:
        raise ValueError(f"{path!r} records a checksum of its whole data section, which a partial restore "
                         f"(names=, prefix=, rows=) does not read: pass verify=False to restore part of it")
    # One C++ call allocates every tensor and starts the reading thread (checkpoint::RestoreStream): the bytes
    # land while the tensors' Python objects are made here, and no reader takes turns with this thread at the GIL.
    algorithm = expected.partition(":")[0] if expected else None
    digest = _new_digest(algorithm) if algorithm == "sha256" else None
    targets = [(entry.name, entry.begin, entry.end, spec, extent) for entry, (spec, extent) in zip(chosen, specs)]
    stream = _restore_start(bridge, file.fileno(), file.tell(), targets, expected if algorithm == "crc32" else None,
                            digest.update if digest is not None else None, _before_read, _RING_ROOM_WAIT_S,
                            repr(path), path)
    made = DeviceTensor._made  # the header's shapes and dtype names are checked: no conversion per tensor
    tensors = {entry.name: made(bridge, handle, entry.shape, entry.dtype, _Landing(stream, i))
               for i, (entry, handle) in enumerate(zip(chosen, stream.take_owners()))}
    return PendingRestore(path, tensors, stream=stream, digest=(digest, expected) if digest is not None else None)


class _Landing:
    """Whether tensor ``index`` of a restore's stream has landed (a ``Future``'s ``done``/``result`` for
    ``DeviceTensor``): its bytes written in place, or its copies submitted, which ``result`` returns."""

    __slots__ = ("_stream", "_index")

    def __init__(self, stream: _RestoreStream, index: int) -> None:
        self._stream = stream
        self._index = index

    def done(self) -> bool:
        return self._stream.done() or self._stream.landed(self._index, 0)

    def result(self, timeout: float | None = None) -> list:
        if not self._stream.landed(self._index, timeout):
            raise FutureTimeout()
        return self._stream.copies(self._index)


# Tests and the benchmark's slow storage: called as (file offset, nbytes) on the reading thread before each read.
_before_read: Callable[[int, int], None] | None = None


class PendingRestore(_NotCopyable, Mapping[str, DeviceTensor]):
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
    and frees every tensor, after which ``wait()``, ``ready()`` and
    ``tensors()`` raise ``CheckpointError`` (``... was abandoned``), however far
    the reader had come.
    """

    def __init__(self, path: str, tensors: dict[str, DeviceTensor], *, stream: _RestoreStream | None = None,
                 digest: tuple[Any, str] | None = None, parts: list[PendingRestore] | None = None) -> None:
        self._path = path
        self._tensors = tensors
        self._parts = parts or []  # a sharded restore: one per file
        self._stream = stream  # one file: its reading
        self._digest = digest  # a checksum the stream does not check: (the digest it feeds, the expected text)
        # The verdict once there is one that is not True: the reading's error, or abandon()'s. The first one
        # set stands; the lock keeps a waiter's failure and another thread's abandon() from both setting it.
        self._failure: BaseException | None = None
        self._verdict_lock = threading.Lock()
        self._reader_left_running = False  # an interrupt asked the reader to stop without waiting for it

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
        return all(part.done() for part in self._parts) and (self._stream is None or self._stream.done())

    def ready(self) -> bool:
        """True once every tensor is on the device and verified (never blocks); raises as ``wait``."""
        if self._failure is not None:  # abandoned while the reader was still reading: not done, yet no wait
            raise self._failure
        return self.done() and self.wait(0)

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the whole restore: True once every tensor is on the device and the checksum matched,
        False if ``timeout`` seconds passed first. On a failure every tensor is freed and the error raised."""
        timeout = _checked_timeout(timeout)
        if self._failure is not None:
            self._let_readers_end(timeout)
            raise self._failure
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        try:
            failures = []
            for part in self._parts:  # every file's reader stops before anything is freed
                try:
                    if not part.wait(left()):
                        return False
                except BaseException as error:  # noqa: BLE001 - raised below
                    if not isinstance(error, Exception):
                        raise  # an interrupt (Ctrl-C) waits for no other file: every part is abandoned below
                    failures.append(error)
            if failures:
                raise failures[0]
            if self._stream is not None and not self._wait_for_file(left):
                return False
            # (a sharded restore's files' own waits saw their tensors)
        except BaseException as error:
            with self._verdict_lock:
                first = self._failure
                if first is None:
                    # An interrupt (Ctrl-C) ends this wait; later ones say what became of the restore.
                    self._failure = error if isinstance(error, Exception) else CheckpointError(
                        f"restore {self._path!r} was abandoned when its wait was interrupted "
                        f"({type(error).__name__}): its tensors are freed")
            if first is not None:  # abandoned (or failed on another thread) meanwhile: that verdict stands
                raise first from None
            # A failure frees the tensors once their copies end (bounded, in all), so the bridge's counts are
            # back when it is raised; an interrupt (Ctrl-C) waits for none: a hung device's copies never end,
            # and the bridge frees each allocation itself once its last copy does.
            self._abandon(_cleanup_deadline(error))
            raise
        # abandon() sets the verdict before it frees a tensor: a tensor seen freed above (or a reader that
        # reached the end before abandon() stopped it) is not a restore that succeeded.
        if self._failure is not None:
            raise self._failure
        return True

    def _wait_for_file(self, left: Callable[[], float | None]) -> bool:
        """``wait`` of one file's reading: its end, the checksum's verdict, every tensor's copies."""
        if not self._stream.finished(left()):
            return False
        if self._digest is not None:
            digest, expected = self._digest
            actual = f"{expected.partition(':')[0]}:{digest.hexdigest()}"
            if actual != expected:
                raise CheckpointError(f"{self._path!r} is corrupt: the data's checksum is {actual}, "
                                      f"the file records {expected}; nothing was restored")
        for name, tensor in self._tensors.items():
            try:
                if not (tensor.freed or tensor.wait(left())):
                    return False
            except BridgeError as error:  # a copy that failed: named by its tensor
                raise _with_context(error, f"restore {self._path!r}: tensor {name!r}") from error
        return True

    def _let_readers_end(self, timeout: float | None) -> None:
        """After an interrupt that left a reader to end its read on its own: a later ``wait()`` waits for it (up
        to ``timeout``), so that when it raises the verdict, the tensors that read still wrote are freed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for part in [*self._parts, self]:
            if part._reader_left_running and part._stream is not None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                with contextlib.suppress(Exception):  # its error is not the verdict: the interrupt's abandon is
                    part._stream.finished(left)

    def abandon(self) -> None:
        """Stops the reading before its next chunk, waits for it to stop, and frees every tensor: at once
        where its copies have ended, else once they end (up to 30 s in all is waited for them first, not per
        tensor; the bridge frees an allocation a copy still fills when that copy ends, so a hung device's
        tensors leak nothing). From then on ``wait()``, ``ready()`` and ``tensors()`` raise
        ``CheckpointError``, on every thread, whether or not the reader had read the whole file: its tensors
        are freed. Idempotent."""
        self._abandon(time.monotonic() + _CLEANUP_WAIT_S)

    def _abandon(self, deadline: float) -> None:
        """``abandon()``, its copies waited for until ``deadline`` (``time.monotonic()``) at the most, every
        part's and every tensor's together: a deadline already past (an interrupted wait) waits for none."""
        with self._verdict_lock:
            if self._failure is None:
                self._failure = CheckpointError(f"restore {self._path!r} was abandoned: its tensors are freed")
        try:
            for part in self._parts:
                part._abandon(deadline)
            if self._stream is not None:
                # An interrupt (Ctrl-C: a deadline already past) waits for no read in progress, which slow storage
                # can make seconds long: the reader is only asked to stop, and ends on its own. The tensors freed
                # below are safe to let go meanwhile: the bridge defers the release of one a read still writes.
                wait = time.monotonic() < deadline
                self._reader_left_running = not wait
                self._stream.stop(wait=wait)
        finally:  # a part's own cleanup interrupted (Ctrl-C) still lets go of every tensor
            _free_all(self._tensors, deadline)

    def tensors(self) -> dict[str, DeviceTensor]:
        """``{name: DeviceTensor}``, once ``wait()`` has seen the whole restore through (raising its error)."""
        self.wait()
        return dict(self._tensors)


def _cleanup_deadline(error: BaseException) -> float:
    """Until when a failure's cleanup waits for copies (``time.monotonic()``): ``_CLEANUP_WAIT_S`` from now
    after a failure, none after an interrupt (Ctrl-C: a hung device's copies never end)."""
    return time.monotonic() + _CLEANUP_WAIT_S if isinstance(error, Exception) else 0.0


def _free_all(tensors: Mapping[str, DeviceTensor], deadline: float) -> None:
    """Frees every tensor not freed yet. Their copies are waited for first, until ``deadline``
    (``time.monotonic()``) in all, never per tensor, so the frees happen now rather than deferred; a tensor
    whose copies have not ended by then (a hung device), every one when the deadline has passed, and every one
    left when the wait is interrupted (Ctrl-C, which then propagates), is released without waiting: the bridge
    frees its allocation once its last copy ends (``Bridge.release``), so nothing leaks."""
    pending = [tensor for tensor in tensors.values() if not tensor.freed]
    try:
        for tensor in pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(Exception):  # the failure is being raised already
                tensor.wait(timeout=left)
    finally:
        for tensor in pending:
            with contextlib.suppress(Exception):
                tensor._release()  # not free(): that waits for a reader this abandons to land the tensor


def _restore_sharded(bridge: Bridge, index_path: str, selection: _Selection, alignment: int,
                     verify: bool) -> PendingRestore:
    """``restore`` of a sharded checkpoint: every shard's header is checked against the index (each tensor the
    index maps to a shard is in it) before anything is allocated; then the shards are restored in parallel,
    each tensor from the shard the index names. A failure in any shard frees what every shard restored."""
    weight_map = _read_index(index_path)
    selection.require_all(weight_map, index_path)
    directory = os.path.dirname(os.path.abspath(index_path))
    by_shard = _shards_of(weight_map, selection.wants)
    opened: list[tuple[str, BinaryIO, _Header]] = []  # (shard, its file, its header)
    try:
        for shard in sorted(by_shard):
            opened.append((shard, *_open_shard(index_path, directory, shard, by_shard[shard],
                                               "; nothing was restored")))
            header = opened[-1][2]
            if verify and header.checksum and not selection.partial and len(by_shard[shard]) < len(header.entries):
                # Not a partial restore the caller asked for: the index itself leaves tensors of the shard out.
                raise CheckpointError(
                    f"{index_path!r} maps {len(by_shard[shard])} of the {len(header.entries)} tensors of {shard!r}, "
                    f"whose checksum covers all of them, so restoring what the index maps cannot verify it: pass "
                    f"verify=False to restore them unverified; nothing was restored")
        parts: list[PendingRestore] = []
        try:
            for shard, file, header in opened:  # each allocates its tensors, then reads on a reader thread
                parts.append(_restore_file(bridge, os.path.join(directory, shard), file, header,
                                           selection.within(frozenset(by_shard[shard])), alignment, verify))
        except BaseException as error:
            # One deadline for every shard's copies; an interrupt (Ctrl-C) waits for none.
            deadline = _cleanup_deadline(error)
            for part in parts:
                part._abandon(deadline)
            raise
        return PendingRestore(index_path, {name: t for part in parts for name, t in part.items()}, parts=parts)
    finally:
        for _, file, _ in opened:
            file.close()


def _starts_as_safetensors(path: str) -> bool:
    """Whether the regular file at ``path`` starts as a safetensors file does, with the 8-byte little-endian
    length of its header, within ``_HEADER_LIMIT``: its last four bytes are zero. An index is JSON text, which
    starts with whitespace or ``{`` and holds no NUL, so no index does. For a file named ``*.json``, which may
    be either. False where it cannot tell (a path that cannot be opened, a FIFO, a file of under 8 bytes): the
    index's reader then says why."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO: no wait
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        prefix = os.pread(fd, 8, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return len(prefix) == 8 and int.from_bytes(prefix, "little") <= _HEADER_LIMIT


class _IndexRefused(ValueError):
    """What the index's strict JSON reading refuses, in words that follow the index's name."""


def _object_of_unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object of the index, refused if it gives a key twice (a tensor mapped to two shards, a second
    ``weight_map``): which one counts would be a parser's guess (Python's takes the last), so neither does,
    as in a header."""
    unique = dict(pairs)
    if len(unique) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _IndexRefused(f"it gives {key!r} twice in one JSON object (which one counts would be a "
                                    f"parser's guess, so neither does)")
            seen.add(key)
    return unique


def _no_constant(name: str) -> Any:
    raise _IndexRefused(f"it holds {name}, which is not JSON (RFC 8259)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: infinity by another name
        raise _IndexRefused(f"it holds the number {text}, past what a double holds")
    return value


def _first_lone_surrogate(value: Any) -> str | None:
    """The first str in the parsed JSON ``value`` (keys too) that has no UTF-8, else None; without recursion,
    whatever the nesting the parser took."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return item
        elif isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return None


def _read_index(index_path: str) -> dict[str, str]:
    """A sharded checkpoint's ``weight_map`` (tensor name -> shard file beside the index), checked: JSON as
    strict as a header's (UTF-8, no key given twice in an object, no NaN or Infinity, no lone surrogate), an
    object whose ``weight_map`` maps str names to plain relative file names (no absolute path, no ``..``, no
    NUL). The index is opened as a checkpoint is: a path that cannot be opened is ``OSError``; a FIFO, a
    device or a directory, or a file past ``_HEADER_LIMIT`` bytes, a ``CheckpointError`` at once."""
    fd = os.open(index_path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO: no wait
    try:
        if not stat.S_ISREG((st := os.fstat(fd)).st_mode):
            raise CheckpointError(f"{index_path!r} is not a regular file")
        os.set_blocking(fd, True)
        with open(fd, "rb", closefd=False) as f:  # its size, then what it holds (it may have grown since)
            if st.st_size > _HEADER_LIMIT or len(text := f.read(_HEADER_LIMIT + 1)) > _HEADER_LIMIT:
                raise CheckpointError(f"{index_path!r} is past the {_HEADER_LIMIT} bytes an index may hold "
                                      f"(as a safetensors header): not the index of a sharded checkpoint")
    finally:
        os.close(fd)
    neither = f"{index_path!r} is not the JSON index of a sharded checkpoint (nor a safetensors file)"
    try:  # strictly, as a header: json.loads(bytes) would take UTF-16 and UTF-32 too, guessing which
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{neither}: it is not UTF-8 (byte {e.start} is {text[e.start]:#04x})") from None
    try:
        index = json.loads(decoded, object_pairs_hook=_object_of_unique_keys, parse_constant=_no_constant,
                           parse_float=_finite_float)
    except _IndexRefused as e:
        raise CheckpointError(f"{index_path!r} is not read as the index of a sharded checkpoint: {e}") from None
    except ValueError as e:  # not JSON
        raise CheckpointError(f"{neither}: {e}") from None
    except RecursionError:
        raise CheckpointError(f"{index_path!r} is not a JSON index of a sharded checkpoint: its JSON nests "
                              f"too deeply to read") from None
    lone = _first_lone_surrogate(index)
    if lone is not None:  # a "\ud800" escape: a str with no UTF-8, refused anywhere in a header too
        raise CheckpointError(f"{index_path!r} is not read as the index of a sharded checkpoint: it holds the "
                              f"string {lone!r}, whose escape of a lone surrogate is not valid UTF-8")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path!r} has no weight_map (tensor name -> shard file): "
                              f"not the index of a sharded checkpoint")
    if not weight_map:
        raise CheckpointError(f"{index_path!r} has an empty weight_map (tensor name -> shard file): it maps no "
                              f"tensor to a shard, so there is nothing to restore")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise CheckpointError(f"{index_path!r} maps {name!r} to {shard!r}, not a file name")
        if "\0" in shard:  # the C library would open the name before the NUL
            raise CheckpointError(f"{index_path!r} maps {name!r} to {shard!r}, not a file name: embedded null byte")
        if os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/"):
            raise CheckpointError(f"{index_path!r} maps {name!r} to {shard!r}: shards must lie beside the index")
    return weight_map


__all__ = ["CheckpointError", "PendingRestore", "checkpoint", "checkpoint_info", "restore"]
