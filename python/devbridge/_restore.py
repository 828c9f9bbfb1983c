"""Restoring a checkpoint: ``restore(bridge, path)`` -> ``{name: DeviceTensor}``, or a ``PendingRestore``.

Owns the selection of a partial restore (``_Selection``: ``names``, ``prefix``,
``rows``), the restore of one checked file (``_restore_file``: every tensor
allocated, then filled by the C++ ``checkpoint::RestoreStream`` on a reader
thread, its checksum verified as it reads; ``_Landing`` says when a tensor's
bytes are in) and of a sharded checkpoint's shards in parallel
(``_restore_sharded``), ``PendingRestore`` (the verdict, ``wait``/``abandon``),
the cleanup that frees every tensor when a restore fails (``_free_all``, bounded
by ``_cleanup_deadline``), the dtypes each bridge holds (``_held_dtypes``), and
``_before_read``, the hook tests and the benchmark set here (this module reads
it at call time). Headers and indexes are read by ``_checkpoint_file``. See
docs/PORTABLE.md.
"""

from __future__ import annotations

import collections
import contextlib
import operator
import os
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, BinaryIO, Callable

import numpy as np

from ._checkpoint_file import (
    _checked_path,
    _Entry,
    _Header,
    _new_digest,
    _open_checkpoint,
    _open_shard,
    _read_index,
    _shards_of,
    _starts_as_safetensors,
)
from ._devbridge import Bridge, ObjectSpec, _alloc_owned, _checkpoint_select, _restore_start, _RestoreStream
from ._errors import BridgeError
from ._portable import CheckpointError, _context, _gc_paused, _with_context
from ._staging import (
    _CLEANUP_WAIT_S,
    DeviceTensor,
    _checked_timeout,
    _NotCopyable,
    spec_for_array,
)


# Restore: how long a chunk waits for ring room another caller holds (another restore, a stream) before
# Backpressure: room that long held is a stall, not a queue.
_RING_ROOM_WAIT_S = 60.0


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

    def choose(self, entries: list[Any], where: str) -> list[Any]:
        """The ``entries`` (a header's ``_Entry`` tuples, or a sharded index's names) this selection takes, in
        order, by the library's one rule (``_checkpoint_select``, the C ABI's too): ``CheckpointError`` naming
        the names asked for (``names`` as a collection, ``rows``) that ``where`` (quoted) lacks, or an
        unrestorable tensor chosen, before anything is allocated."""
        chosen = _checkpoint_select(entries, None if self.exact is None else list(self.exact), self.predicate,
                                    self.prefix, list(self.rows), where)
        if self.rows:
            taken = {getattr(e, "name", e) for e in chosen}
            unchosen = sorted(n for n in self.rows if n not in taken)
            if unchosen:
                raise ValueError(f"rows= names tensors that names=/prefix= leave out: "
                                 f"{', '.join(map(repr, unchosen))}")
        return chosen

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
    chosen = selection.choose(header.entries, repr(path))  # an unrestorable tensor is refused only when chosen
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

    def landed_quietly(self) -> bool:
        """``done()`` without its error: False where the reading failed or is stopping before the tensor landed
        (it raises then, until the reader has ended), for what must not raise the restore's error (``free()``,
        ``repr``)."""
        try:
            return self.done()
        except Exception:  # noqa: BLE001 - the restore's error is the restore's to raise
            return False

    def result(self, timeout: float | None = None) -> list:
        if not self._stream.landed(self._index, timeout):
            raise FutureTimeout()
        return self._stream.copies(self._index)

    def release_when_landed(self, owner: Any) -> None:
        """The tensor's allocation (``owner``, its ``_OwnedAllocation``, which owns it no longer) let go by the
        reader once its bytes have landed, or once the reading ends: at once where either is so."""
        self._stream.release_when_landed(self._index, owner)


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
                tensor.free()  # one the reader has not reached: let go by it once it ends, waiting for nothing


def _restore_sharded(bridge: Bridge, index_path: str, selection: _Selection, alignment: int,
                     verify: bool) -> PendingRestore:
    """``restore`` of a sharded checkpoint: every shard's header is checked against the index (each tensor the
    index maps to a shard is in it) before anything is allocated; then the shards are restored in parallel,
    each tensor from the shard the index names. A failure in any shard frees what every shard restored."""
    weight_map = _read_index(index_path)
    chosen = frozenset(selection.choose(list(weight_map), repr(index_path)))
    directory = os.path.dirname(os.path.abspath(index_path))
    by_shard = _shards_of(weight_map, chosen.__contains__, directory)
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
