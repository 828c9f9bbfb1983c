"""Portable tensors: export/import and transfer between bridges.

Everything here is pure Python over the staging layer (``_staging``): every byte
moves through the bridges' rings in chunks, so tensors larger than a ring work
and memory stays bounded. See docs/PORTABLE.md. Checkpoint files (safetensors
``checkpoint``/``restore``) are ``_checkpoint``'s, over what a device read is
here (``_resolve``, ``_stream``).

* ``PortableTensor(shape, dtype, data)``: ``{shape, dtype, bytes}``, the bytes
  row-major and little-endian; numpy reads it without a copy.
* ``export(bridge, x, ...)`` / ``bridge.export(...)`` -> ``PortableTensor``;
  ``export_to(bridge, x, file, ...)`` streams the bytes to a file instead.
* ``import_tensor(bridge, source, spec=None, ...)`` / ``bridge.import_tensor``
  -> ``DeviceTensor`` (``import`` is a Python keyword).
* ``transfer(src_bridge, x, dst_bridge)`` -> ``DeviceTensor`` on ``dst_bridge``:
  downloads chunk k+1 while chunk k uploads.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import io
import math
import operator
import sys
from typing import Any, BinaryIO, Callable, Iterator, NamedTuple, NoReturn

import numpy as np

from ._devbridge import Bridge, DeviceHandle, ObjectSpec, TransferPlanner, dtype_info
from ._errors import BridgeError, ForeignDomain
from ._intake import _bits_dtype, _dtype_name, _intake, _numpy_dtype, _refuse_masked
from ._staging import (
    DeviceTensor,
    _checked_flag,
    _checked_shape,
    _fill_new,
    _handle_dtype,
    spec_for_array,
    _stage_into,
    _upload,
)

_U64_MAX = (1 << 64) - 1


# Here, not in _checkpoint: import_tensor from a file raises it too (a file that ends early), and the
# extension's checkpoint reader raises it from devbridge._portable (python/src/checkpoint_file.cpp).
class CheckpointError(ValueError):
    """A checkpoint file that cannot be restored: not safetensors, truncated, corrupt, a checksum that
    does not match, or a tensor devbridge cannot hold. The message names the file, the tensor and why."""


# -------------------------------------------------------------------------------------- PortableTensor


class PortableTensor:
    """``{shape, dtype, bytes}``: one tensor's bytes, row-major and little-endian, outside any bridge.

    ``data`` is any C-contiguous buffer of exactly ``prod(shape) * itemsize``
    bytes; it is kept, not copied, except a typed buffer in big-endian byte
    order (a ``">f4"`` array), whose items are converted to little-endian (a
    copy; ``ValueError`` when they are not the dtype's size). numpy reads a PortableTensor without a copy
    (``numpy.asarray(t)``, ``t.numpy()``; dtypes numpy lacks, ``bfloat16`` and
    ``float8_*``, read as ml_dtypes' types when ml_dtypes is installed, else as
    the unsigned integers of their bits), and so does ``memoryview(t)`` on
    Python 3.12+ (``t.data`` on any version; always the bits).
    """

    __slots__ = ("_shape", "_dtype", "_bytes", "__weakref__")

    def __init__(self, shape: Any, dtype: Any, data: Any) -> None:
        dims = _checked_shape(shape)
        name = _checked_dtype(dtype)
        _refuse_masked(data, "PortableTensor data")
        try:
            view = memoryview(data)
        except TypeError as error:
            raise TypeError(f"PortableTensor data must be a buffer (bytes, numpy array...), not "
                            f"{type(data).__name__}") from error
        if not view.c_contiguous:
            raise ValueError(f"PortableTensor data (shape {view.shape}, strides {view.strides}) is not C-contiguous")
        data, view = _little_endian(data, view, name)
        nbytes = math.prod(dims) * dtype_info(name)["itemsize"]
        if view.nbytes != nbytes:
            raise ValueError(f"a PortableTensor of shape {dims} and dtype {name} holds {nbytes} bytes; "
                             f"the buffer has {view.nbytes}")
        self._shape = dims
        self._dtype = name
        self._bytes = np.frombuffer(data, np.uint8) if nbytes else np.empty(0, np.uint8)

    @classmethod
    def from_array(cls, array: Any, dtype: Any = None) -> PortableTensor:
        """A PortableTensor of a numpy array (or anything ``numpy.asarray`` takes).

        Also any CPU DLPack producer (torch, jax; bfloat16 and float8 too). A
        C-contiguous little-endian array is kept as it is; any other is copied
        into row-major little-endian order first. ``dtype`` relabels the bytes
        (same itemsize, e.g. ``uint16`` bits as ``"bfloat16"``)."""
        if dtype is not None:
            _checked_dtype(dtype)
        a = _intake(array, "PortableTensor.from_array", dtype, any_layout=True)
        return cls(a.shape, _dtype_name(a.dtype), a.reshape(-1).view(np.uint8))

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> str:
        """devbridge's dtype name (``devbridge.dtypes()``)."""
        return self._dtype

    @property
    def itemsize(self) -> int:
        return dtype_info(self._dtype)["itemsize"]

    @property
    def size(self) -> int:
        return math.prod(self._shape)

    @property
    def nbytes(self) -> int:
        return self._bytes.size

    def numpy(self) -> np.ndarray:
        """A numpy array over the bytes (no copy; writable when the buffer is). bfloat16 and float8 are
        ml_dtypes' types when ml_dtypes is installed, else their bits (as ``download``)."""
        return self._bytes.view(_numpy_dtype(self._dtype)).reshape(self._shape)

    @property
    def data(self) -> memoryview:
        """The bytes as a shaped, typed memoryview (no copy); bfloat16 and float8 as their bits, which is
        all a memoryview's format can say."""
        return memoryview(self._bytes.view(_bits_dtype(self._dtype) or _numpy_dtype(self._dtype))
                          .reshape(self._shape))

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """numpy's protocol (numpy 2): ``copy=None`` a copy only where ``dtype`` needs one, ``copy=True``
        always a new array, ``copy=False`` never a copy: ``ValueError`` when ``dtype`` needs one. Without a
        copy the array is over the buffer (its base, kept alive by it). (From Python 3.12 numpy reads
        ``__buffer__`` first where no dtype is asked for.)"""
        a = self.numpy()
        if dtype is not None and np.dtype(dtype) != a.dtype:
            if copy is not None and not copy:
                raise ValueError(f"Unable to avoid copy while creating an array as requested: the "
                                 f"PortableTensor holds {a.dtype}, and {np.dtype(dtype)} is a conversion (a copy); "
                                 f"pass copy=None to allow it, or ask for {a.dtype}")
            return a.astype(dtype)  # a new array: the copy copy=True asks for
        return a.copy() if copy else a

    def __buffer__(self, flags: int) -> memoryview:  # PEP 688 (Python 3.12+)
        return self.data

    def tobytes(self) -> bytes:
        return self._bytes.tobytes()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PortableTensor):
            return NotImplemented
        return (self._shape == other._shape and self._dtype == other._dtype
                and np.array_equal(self._bytes, other._bytes))

    __hash__ = None  # mutable when its buffer is

    def __repr__(self) -> str:
        return f"PortableTensor(shape={self._shape}, dtype={self._dtype!r}, nbytes={self.nbytes})"


def _little_endian(data: Any, view: memoryview, name: str) -> tuple[Any, memoryview]:
    """``data`` (and its ``view``) as little-endian bytes of ``name``: a typed buffer of items in the other
    byte order (a ``">f4"`` numpy array, a memoryview of format ``">f"``) converted, values kept, when its
    items are ``name``'s size (as ``dtype=`` relabels only items of its own size); ``ValueError`` naming the
    byte order otherwise. Bytes, and any buffer in the native order or with 1-byte items, as they are."""
    if view.itemsize == 1 or view.format[:1] not in ("<", ">", "!", "="):
        return data, view  # native ("@"/no prefix), bytes, or items whose order nothing swaps
    try:
        a = data if isinstance(data, np.ndarray) else np.asarray(view)
    except (TypeError, ValueError, NotImplementedError):  # a format numpy cannot read: its bytes as they are
        return data, view
    if a.dtype.isnative or a.dtype.byteorder == "|":
        return data, view
    itemsize = dtype_info(name)["itemsize"]
    if a.itemsize != itemsize:
        raise ValueError(f"PortableTensor data is in non-native byte order ({a.dtype.str}: big-endian) and a "
                         f"PortableTensor's bytes are little-endian; its {a.itemsize}-byte items are not {name}'s "
                         f"{itemsize}-byte ones, so they cannot be converted: pass the array converted "
                         "(array.astype(array.dtype.newbyteorder('<')))")
    # A new array (the values in the native order, which is little-endian wherever devbridge runs).
    a = a.astype(a.dtype.newbyteorder("="), order="C")
    return a, memoryview(a)


def _checked_dtype(dtype: Any) -> str:
    """devbridge's name of ``dtype``: ``TypeError`` for a value that is no dtype, ``ValueError`` for an
    unknown one (never the binding's generic error)."""
    if dtype is None or isinstance(dtype, (bool, int, float, bytes)):
        raise TypeError(f"dtype must be a name such as \"float32\", a numpy dtype or a tinygrad DType, "
                        f"not {type(dtype).__name__}")
    return _dtype_name(dtype)


# ------------------------------------------------------------------------------ what a device read is


class _Source(NamedTuple):
    """The logical tensor a caller asked for: ``shape`` elements of ``dtype`` in ``handle`` at
    ``byte_offset``, row-major when ``strides`` is None, else strided (in elements)."""

    bridge: Bridge
    handle: DeviceHandle
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None
    byte_offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_info(self.dtype)["itemsize"]


def _resolve(bridge: Bridge, x: Any, dtype: Any = None, shape: Any = None, strides: Any = None,
             offset: Any = 0) -> _Source:
    """What ``x`` (a ``DeviceTensor`` or ``DeviceHandle``) with the optional view spec names, validated as
    ``bridge.view`` validates a view (extent, dtype, strides, offset) and after the copies into it."""
    if not isinstance(bridge, Bridge):
        raise TypeError(f"bridge must be a devbridge.Bridge, not {type(bridge).__name__}")
    if isinstance(x, DeviceTensor):
        if x.bridge is not bridge:
            # As the bridge refuses another bridge's handle (download, view): the contract's ForeignDomain.
            raise ForeignDomain(f"{x!r} belongs to another bridge (domain {x.bridge.domain}, not {bridge.domain})")
        x.wait()  # raises Closed once freed, and the upload's failure if it failed
        if dtype is None and shape is None and strides is None and isinstance(offset, int) and offset == 0:
            # The whole tensor as it was made: row-major, in its allocation, nothing to validate as a view
            # (a checkpoint of thousands of tensors). The copy reading it is ordered after writes into it.
            return _Source(bridge, x.handle, x.dtype, x.shape, None, 0)
        handle, name, dims = x.handle, x.dtype, x.shape
    elif isinstance(x, DeviceHandle):
        handle = x
        name = _handle_dtype(bridge, x)
        dims = None
    else:
        raise TypeError(f"expected a DeviceTensor or a DeviceHandle, not {type(x).__name__}")
    if dtype is not None:
        name = _checked_dtype(dtype)
    itemsize = dtype_info(name)["itemsize"]
    if shape is not None:
        dims = _checked_shape(shape)
    elif dims is None or math.prod(dims) * itemsize != x.nbytes:
        # A handle (or a tensor relabelled to another itemsize): the whole extent as a vector.
        extent = bridge.extent(handle) if dims is None else x.nbytes
        if extent % itemsize:
            raise ValueError(f"{handle!r}: {extent} bytes are not a whole number of {name} ({itemsize} bytes); "
                             "give a shape")
        dims = (extent // itemsize,)
    if strides is not None:
        if isinstance(strides, (str, bytes)):
            raise TypeError(f"strides must be a sequence of ints, not {type(strides).__name__}")
        strides = tuple(operator.index(s) for s in strides)
    offset = operator.index(offset)
    if math.prod(dims) == 0:
        if offset < 0 or offset > _U64_MAX:
            raise OverflowError(f"offset {offset} is outside 0..2**64-1")
        return _Source(bridge, handle, name, dims, None, offset)
    with bridge.view(handle, name, dims, strides, offset, wait=True) as view:
        actual = tuple(view.strides)
        byte_offset = view.byte_offset
    if isinstance(x, DeviceTensor):
        # The view reads within the allocation; a tensor's bytes end before its rounded extent does.
        reach = sum((d - 1) * s for d, s in zip(dims, actual) if s > 0)
        end = byte_offset + (reach + 1) * itemsize
        if end > x.nbytes:
            raise ValueError(f"a view of shape {dims} {name} at byte {byte_offset} reads up to byte {end}, past "
                             f"the tensor's {x.nbytes} bytes (shape {x.shape} {x.dtype})")
    row_major = _row_major_strides(dims)
    contiguous = all(a == r for a, r, d in zip(actual, row_major, dims) if d > 1)
    return _Source(bridge, handle, name, dims, None if contiguous else actual, byte_offset)


def _row_major_strides(dims: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(dims):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


def _stream(source: _Source, sink: Callable[[int, np.ndarray], Any], planner: TransferPlanner | None = None) -> None:
    """Hands ``source``'s logical bytes (row-major) to ``sink(offset, chunk)`` in order, by the transfer planner
    (``planner``, one of ``source.bridge``'s, when the caller streams many sources).

    A row-major source streams chunk by chunk straight from the ring, or on host from the tensor's own
    memory (``chunk`` is a read-only uint8 array over memory lent for the call only: keeping it, or a view
    of it, past the call fails the transfer with ``BufferError``). A strided one is read as the span of bytes its elements
    cover (by the planner's route), gathered into row-major order, and handed over in one piece."""
    if source.nbytes == 0:
        return
    planner = planner or TransferPlanner(source.bridge)
    if source.strides is None:
        planner.download_stream(source.handle, source.byte_offset, source.nbytes,
                                lambda at, chunk: sink(at, np.frombuffer(chunk, np.uint8)))
        return
    itemsize = dtype_info(source.dtype)["itemsize"]
    reach = [(d - 1) * s for d, s in zip(source.shape, source.strides)]
    low = sum(r for r in reach if r < 0)  # elements before byte_offset a negative stride reaches
    span = np.empty((sum(r for r in reach if r > 0) - low + 1) * itemsize, np.uint8)
    planner.download(source.handle, source.byte_offset + low * itemsize, span)
    # Gathered as unsigned items of the same size: ml_dtypes' float8 has a typestr ("<f1") as_strided refuses.
    elements = span.view(np.dtype(f"uint{itemsize * 8}"))[-low:]
    logical = np.lib.stride_tricks.as_strided(elements, source.shape, [s * itemsize for s in source.strides],
                                              writeable=False)
    sink(0, np.ascontiguousarray(logical).reshape(-1).view(np.uint8))


def _with_context(error: BaseException, context: str) -> BaseException:
    """``error`` with ``context`` (the tensor, the file) in front of its message, same type; the
    error itself when its type cannot be rebuilt from a message."""
    if isinstance(error, BridgeError):
        new = type(error)(f"{context}: {error.message}")
        new.fatal = getattr(error, "fatal", False)
        return new
    if type(error) in (ValueError, TypeError, OverflowError, CheckpointError):
        return type(error)(f"{context}: {error}")
    return error


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic collector paused for a call that makes tens of thousands of objects at once (a
    checkpoint's header, a restore's tensors): each collection it would trigger walks every object the
    process holds, 30-45 ms of a 20,000-tensor checkpoint or restore here. Resumed at the end, only if it
    was this call that paused it."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


# The errors a context (the tensor, the file) is put in front of.
_CONTEXTUAL = (BridgeError, ValueError, TypeError, OverflowError)


def _raise_in_context(error: BaseException, context: str) -> NoReturn:
    """Raises ``error`` with ``context`` in front of its message (``_with_context``), chained from it."""
    new = _with_context(error, context)
    if new is error:
        raise error
    raise new from error


@contextlib.contextmanager
def _context(context: str) -> Iterator[None]:
    try:
        yield
    except _CONTEXTUAL as error:
        _raise_in_context(error, context)


# ---------------------------------------------------------------------------------------- export/import


def export(bridge: Bridge, x: Any, dtype: Any = None, shape: Any = None, strides: Any = None, offset: int = 0,
           *, out: Any = None) -> PortableTensor:
    """Copies a device tensor out of ``bridge`` into a ``PortableTensor`` (row-major, little-endian).

    ``x`` is a ``DeviceTensor`` (its dtype and shape by default) or a
    ``DeviceHandle`` (the allocation's dtype, the whole extent as a vector).
    ``dtype``, ``shape``, ``strides`` (in elements) and ``offset`` (in bytes)
    choose a view as ``bridge.view`` does; a strided view exports its logical
    row-major contents. The bytes are staged through the ring in chunks, so an
    export larger than the ring works. ``out``: a writable C-contiguous buffer
    of exactly the tensor's byte size to write into (the result shares it),
    a numpy array of the data's dtype (or its bits) or of bytes (uint8);
    else a new one is allocated.
    """
    source = _resolve(bridge, x, dtype, shape, strides, offset)
    if out is None:
        target = np.empty(source.nbytes, np.uint8)
    else:
        try:
            target = np.frombuffer(out, np.uint8) if memoryview(out).nbytes else np.empty(0, np.uint8)
        except TypeError as error:
            raise TypeError(f"out must be a writable buffer, not {type(out).__name__}") from error
        except (ValueError, BufferError) as error:
            raise ValueError(f"out is not a C-contiguous buffer: {error}") from error
        if isinstance(out, np.ndarray) and out.dtype != np.uint8:
            data_dtype, bits = _numpy_dtype(source.dtype), _bits_dtype(source.dtype)
            if out.dtype != data_dtype and (bits is None or out.dtype != bits):
                raise ValueError(f"out has dtype {out.dtype}, the data is {source.dtype} ({data_dtype}): give an "
                                 "array of that dtype or a buffer of bytes (uint8)")
        if target.size != source.nbytes:
            raise ValueError(f"out has {target.size} bytes; the export of shape {source.shape} {source.dtype} "
                             f"is {source.nbytes}")
        if target.size and not target.flags.writeable:
            raise ValueError("out is read-only")
    _stream(source, lambda at, chunk: np.copyto(target[at:at + chunk.size], chunk))
    return PortableTensor(source.shape, source.dtype, target if out is None else out)


def export_to(bridge: Bridge, x: Any, file: BinaryIO, dtype: Any = None, shape: Any = None, strides: Any = None,
              offset: int = 0) -> int:
    """``export`` streamed into ``file`` (anything with a binary ``write``): the row-major little-endian
    bytes go from the ring (on host, from the tensor's own memory) to ``file`` chunk by chunk, never held
    whole (a strided view excepted: the span it covers is read into memory first). ``write`` must copy
    what it keeps: a file that holds on to the buffer it is handed makes this fail with ``BufferError``
    rather than keep bytes the bridge reuses. Returns the number of bytes written."""
    write = getattr(file, "write", None)
    if not callable(write):
        raise TypeError(f"file must have a binary write(), not {type(file).__name__}")
    _refuse_text_mode(file, "export_to writes bytes", "wb")
    source = _resolve(bridge, x, dtype, shape, strides, offset)
    _stream(source, lambda at, chunk: _write_all(file, chunk, at))
    return source.nbytes


def _refuse_text_mode(file: Any, what: str, mode: str) -> None:
    if isinstance(file, io.TextIOBase):
        raise TypeError(f"{what}: open the file in binary mode ({mode!r}), not text "
                        f"({getattr(file, 'name', type(file).__name__)!r})")


def _write_all(file: Any, chunk: Any, offset: int = 0) -> None:
    """Writes all of ``chunk`` (byte ``offset`` of the stream) with ``file.write``, which may take part of
    it. ``None`` from a raw file (``io.RawIOBase``) says it took nothing, a non-blocking file that would
    block: ``BlockingIOError``; from any other file-like, that it took everything (many return nothing).
    A count that is no integer is a ``TypeError``; one that is not between 0 and what it was handed, or 0
    ``_ZERO_WRITES`` times in a row, an ``OSError``. Each names the file and the byte."""
    with _released_after(memoryview(chunk).cast("B")) as view:
        _write_view(file, view, offset)


@contextlib.contextmanager
def _released_after(view: memoryview) -> Iterator[memoryview]:
    """``view`` (of a chunk lent for one call) released once the ``with`` ends: a file that kept what it was
    handed then reads a released memoryview, not memory the bridge frees or reuses. One that kept a buffer
    taken from it cannot be stopped here: the lender fails the call (``BufferError``)."""
    try:
        yield view
    finally:
        with contextlib.suppress(BufferError):
            view.release()


def _handed(call: Callable[[memoryview], Any], view: memoryview, what: str, file: Any, at: int) -> Any:
    """``call(view)``, refused with ``BufferError`` (the view released first, by the caller's ``with``) when
    the file kept a reference to the view past the call: the bytes are lent for the call only, and what it
    kept would read (or write) memory the bridge reuses next, or raise later for being released."""
    before = sys.getrefcount(view)
    result = call(view)
    if sys.getrefcount(view) > before:
        raise BufferError(f"{what} {_file_name(file)} kept a buffer over a chunk it was lent ({view.nbytes} bytes "
                          f"from byte {at} of the stream) past its call: it is lent for the call only, over memory "
                          f"the bridge reuses next. Copy what you keep (bytes(data))")
    return result


def _write_view(file: Any, view: memoryview, offset: int) -> None:
    total = view.nbytes
    written = _handed(file.write, view, "write() to", file, offset)
    if type(written) is int and written == total:  # a blocking or buffered file takes it all at once
        return
    done, zeros = 0, 0
    while True:
        left = total - done
        if written is None and not isinstance(file, io.RawIOBase):  # a file-like that took all of it
            return
        written = _count(written, "write() to", file, offset + done, left)
        zeros = zeros + 1 if written == 0 else 0
        if zeros == _ZERO_WRITES:
            raise OSError(f"write() to {_file_name(file)} took nothing at byte {offset + done}, {zeros} times "
                          f"running; {left} bytes of the chunk unwritten")
        done += written
        if done == total:
            return
        with _released_after(view[done:]) as rest:
            written = _handed(file.write, rest, "write() to", file, offset + done)


# A write that takes no byte this many times in a row is given up on, not retried for ever.
_ZERO_WRITES = 3


def _count(n: Any, call: str, file: Any, at: int, handed: int) -> int:
    """``n``, what ``call`` (``"write() to"``) ``file`` returned when handed ``handed`` bytes at byte ``at``, as a
    byte count between 0 and ``handed``: ``None`` (a non-blocking raw file that would block) is
    ``BlockingIOError``; a bool (it says whether, not how much) or a non-integer ``TypeError``; a count out of
    range ``OSError``."""
    if n is None:
        raise BlockingIOError(errno.EAGAIN, f"{call} {_file_name(file)} moved nothing at byte {at}: the file is "
                              f"non-blocking and would block; {handed} bytes left")
    if isinstance(n, (bool, np.bool_)) or not hasattr(type(n), "__index__"):
        raise TypeError(f"{call} {_file_name(file)} returned {n!r} at byte {at}, not the number of bytes")
    n = operator.index(n)
    if not 0 <= n <= handed:
        raise OSError(f"{call} {_file_name(file)} returned {n} at byte {at}, handed {handed} bytes: a count it "
                      f"cannot have moved")
    return n


def _file_name(file: Any) -> str:
    """How an error names ``file``: its path when it has one, else the file-like itself."""
    name = getattr(file, "name", None)
    return repr(name) if isinstance(name, str) else repr(file)


def import_tensor(bridge: Bridge, source: Any, spec: ObjectSpec | None = None, *, dtype: Any = None,
                  shape: Any = None, alignment: int = 256, wait: bool = True) -> DeviceTensor:
    """Allocates in ``bridge``'s current generation and copies a portable tensor into it.

    ``source`` is a ``PortableTensor``; a C-contiguous numpy array (its dtype
    and shape unless given); any other buffer (``bytes``, ``bytearray``,
    ``mmap``...) with ``dtype`` and ``shape``; or a binary file (anything with
    ``readinto``) with ``dtype`` and ``shape``, read chunk by chunk. ``spec``
    (an ``ObjectSpec``) is the allocation's: its dtype must be the tensor's
    (or ``"bytes"``) and its ``max_extent`` must hold the tensor rounded up to
    its alignment; without one, ``spec_for_array(shape, dtype, alignment)``.
    Named ``import_tensor`` because ``import`` is a Python keyword. Returns a
    ``DeviceTensor`` (waited for unless ``wait=False``); on failure nothing
    stays allocated.
    """
    if not isinstance(bridge, Bridge):
        raise TypeError(f"bridge must be a devbridge.Bridge, not {type(bridge).__name__}")
    wait = _checked_flag(wait, "wait")
    _refuse_text_mode(source, "import_tensor reads bytes", "rb")
    readinto = (None if isinstance(source, (PortableTensor, np.ndarray, np.generic))
                else getattr(source, "readinto", None))
    if callable(readinto):
        if dtype is None or shape is None:
            raise TypeError("import_tensor from a file needs dtype= and shape=")
        dims, name = _checked_shape(shape), _checked_dtype(dtype)
        nbytes = math.prod(dims) * dtype_info(name)["itemsize"]
        allocation = _allocation(dims, name, spec, alignment, "import_tensor")
        with _context(f"import_tensor from {source!r}"):
            return _fill_new(bridge, dims, name, *allocation, wait,
                             lambda handle: TransferPlanner(bridge).submit_stream(
                                 lambda at, chunk: _read_exactly(source, chunk, at), nbytes, into=handle))
    tensor = _as_portable(source, dtype, shape)
    allocation = _allocation(tensor.shape, tensor.dtype, spec, alignment, "import_tensor")
    return _upload(bridge, tensor.shape, tensor.dtype, *allocation, tensor._bytes, wait)


def _as_portable(source: Any, dtype: Any, shape: Any) -> PortableTensor:
    if isinstance(source, PortableTensor):
        for given, own, what in ((dtype, source.dtype, "dtype"), (shape, source.shape, "shape")):
            if given is not None and (_checked_dtype(given) if what == "dtype" else _checked_shape(given)) != own:
                raise ValueError(f"import_tensor: {what}={given!r} differs from the PortableTensor's {own!r}")
        return source
    if isinstance(source, (np.ndarray, np.generic)) or hasattr(type(source), "__dlpack__"):
        a = _intake(source, "import_tensor")  # a numpy scalar as upload reads it: a 0-d array of its dtype
        dtype = a.dtype if dtype is None else dtype
        shape = a.shape if shape is None else shape
        source = a.reshape(-1).view(np.uint8)
    else:
        # What is neither a file nor an array must be a buffer: said first, so that a list is not told to add
        # dtype= and shape= only to be refused for not being a buffer then.
        try:
            memoryview(source).release()
        except TypeError:
            raise TypeError(f"import_tensor takes an array (numpy, DLPack, a PortableTensor), a binary file, or a "
                            f"buffer (bytes, bytearray, memoryview...) with dtype= and shape=, not "
                            f"{type(source).__name__} (numpy.asarray() it first)") from None
        if dtype is None or shape is None:
            raise TypeError(f"import_tensor of a {type(source).__name__} needs dtype= and shape= "
                            "(a PortableTensor or numpy array carries its own)")
    return PortableTensor(shape, dtype, source)


def _allocation(dims: tuple[int, ...], name: str, spec: ObjectSpec | None, alignment: int,
                what: str) -> tuple[ObjectSpec, int]:
    """The spec and extent to allocate for ``dims`` of ``name``: ``spec_for_array``, or the caller's spec
    when it holds them."""
    if spec is None:
        return spec_for_array(dims, name, alignment)
    if not isinstance(spec, ObjectSpec):
        raise TypeError(f"spec must be a devbridge.ObjectSpec, not {type(spec).__name__}")
    if spec.dtype not in (name, "bytes"):
        raise ValueError(f"{what}: the spec's dtype is {spec.dtype}, the tensor's {name}")
    nbytes = math.prod(dims) * dtype_info(name)["itemsize"]
    if nbytes == 0:
        raise ValueError(f"{what}: shape {dims} is empty: a device allocation cannot be empty")
    extent = -(-nbytes // spec.alignment) * spec.alignment
    if extent > spec.max_extent:
        raise ValueError(f"{what}: shape {dims} {name} ({nbytes} bytes, {extent} at alignment {spec.alignment}) "
                         f"does not fit the spec's max_extent of {spec.max_extent} bytes")
    return spec, extent


def _read_exactly(file: Any, view: memoryview, offset: int) -> None:
    """Fills ``view`` with ``file.readinto``; a file that ends first is a ``CheckpointError`` naming where, as
    byte ``offset`` of the tensor the view starts at. ``None`` (a non-blocking file with nothing to read) is a
    ``BlockingIOError``; a count that is no integer a ``TypeError``, one that is not between 0 and what it
    was handed an ``OSError``."""
    done = 0
    while done < view.nbytes:
        left = view.nbytes - done
        with _released_after(view[done:]) if done else contextlib.nullcontext(view) as part:
            n = _count(_handed(file.readinto, part, "readinto() from", file, offset + done), "readinto() from", file,
                       offset + done, left)
        if not n:
            raise CheckpointError(f"the file ends {left} bytes early (at byte {offset + done} of the tensor)")
        done += n


# -------------------------------------------------------------------------------------------- transfer


def transfer(src_bridge: Bridge, x: Any, dst_bridge: Bridge, *, dtype: Any = None, shape: Any = None,
             strides: Any = None, offset: int = 0, alignment: int = 256, wait: bool = True) -> DeviceTensor:
    """Copies a device tensor of ``src_bridge`` into a new allocation of ``dst_bridge`` (any two backends).

    ``x`` and the view arguments are as for ``export``. Where the two backends
    have a direct path (``Bridge.copy_to_peer``: CUDA within one context or
    between peer devices) a row-major tensor goes device to device in one
    copy. Otherwise the bytes are staged
    through both rings, chunk by chunk and overlapped: chunk k+1 downloads
    from the source while chunk k uploads to the destination, with a few
    chunks in flight per side, so memory stays bounded by the rings. Returns
    the destination's ``DeviceTensor`` (waited for unless ``wait=False``); on
    failure nothing stays allocated on the destination and the error names
    the chunk.
    """
    if not isinstance(dst_bridge, Bridge):
        raise TypeError(f"dst_bridge must be a devbridge.Bridge, not {type(dst_bridge).__name__}")
    wait = _checked_flag(wait, "wait")
    source = _resolve(src_bridge, x, dtype, shape, strides, offset)
    spec, extent = spec_for_array(source.shape, source.dtype, alignment)
    with _context(f"transfer of {source.handle!r} (bridge {src_bridge.domain} -> {dst_bridge.domain})"):
        return _fill_new(dst_bridge, source.shape, source.dtype, spec, extent, wait,
                         lambda handle: _device_to_device(source, dst_bridge, handle))


def _device_to_device(source: _Source, dst: Bridge, handle: DeviceHandle) -> list:
    """Copies ``source`` into ``handle`` of ``dst`` from offset 0. A row-major source goes by the transfer
    planner (a peer copy where the backends have a direct path, else chunk by chunk through both rings);
    a strided one is gathered into row-major order through the source's ring and uploaded by the
    destination's planner. Returns the destination's copies still in flight, as ``DeviceTensor`` keeps them."""
    if not source.nbytes:
        return []
    if source.strides is None:
        TransferPlanner(source.bridge).copy(source.handle, source.byte_offset, source.nbytes, handle, 0,
                                            destination_bridge=dst)
        return []
    events: list = []
    _stream(source, lambda at, chunk: events.extend(
        (event, at + offset, n) for event, offset, n in _stage_into(dst, chunk, handle, at)))
    return events


__all__ = ["CheckpointError", "PortableTensor", "export", "export_to", "import_tensor", "transfer"]
