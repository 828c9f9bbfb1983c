"""Writing a checkpoint: ``checkpoint(bridge, path, {name: tensor})`` -> a safetensors file, atomically.

Owns the plan of a checkpoint (each tensor resolved, its size and place in file
order, the metadata with the generation, dtypes and a checksum placeholder, the
header encoded and checked against ``_HEADER_LIMIT``) and its writing: the
tensors streamed from the ring or device memory into a temporary file beside
``path`` (small chunks batched, ``_SmallChunks``), hashed on a thread of their
own (``_Hasher``), the disk started on them as they go (``_Writeback``,
``sync_file_range``), the checksum patched into the header, the file fsynced,
renamed over ``path`` and its directory fsynced, the replaced file's blocks freed
later (``_free_later``); and the removal of what an interrupted checkpoint left
beside ``path`` (``_remove_interrupted_checkpoint_files``). The format's
constants and helpers are ``_checkpoint_file``'s. See docs/PORTABLE.md.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from ._checkpoint_file import (
    _CHECKSUM_DIGITS,
    _HEADER_LIMIT,
    FORMAT,
    FORMAT_VERSION,
    _checked_path,
    _new_digest,
    _os_error_in_context,
)
from ._devbridge import Bridge, TransferPlanner, _safetensors_name, dtype_info
from ._portable import (
    _CONTEXTUAL,
    _gc_paused,
    _raise_in_context,
    _resolve,
    _Source,
    _stream,
    _write_all,
)


_DEFAULT_CHECKSUM = "crc32"


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
