"""The array intake: how every entry that takes an array reads it, and devbridge's dtypes in numpy.

* ``_intake(array, what, dtype=None, *, copy=True, any_layout=False)``: the one reading of an array
  (numpy, a DLPack producer in host memory, a buffer) as a C-contiguous little-endian numpy array over
  the caller's memory where that allows; upload, adopt, the Prefetcher, import_tensor,
  ``PortableTensor.from_array`` and a ``devbridge.ray`` put all take arrays through it.
* ``_dtype_name(dtype)``: devbridge's name of a dtype; ``_numpy_dtype(name)``: the numpy dtype arrays of
  it come back as; ``_bits_dtype(name)``: the unsigned integers holding one numpy lacks.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any

import numpy as np

from ._devbridge import dtype_info, dtypes



# ---------------------------------------------------------------------------------------------- dtypes


# A numpy dtype may carry devbridge's name of the data in its metadata: bits of a dtype numpy lacks
# (bfloat16, float8 from a DLPack producer) or bytes relabelled with ``dtype=``. Such an array says what it
# holds to every later step (``_dtype_name(array.dtype)``) without a parallel list of names.
_LABEL = "devbridge_dtype"


def _dtype_name(dtype: Any) -> str:
    """devbridge's name for a dtype given as a name, a numpy dtype or a tinygrad DType."""
    if isinstance(dtype, str):
        return _name_of_text(dtype)
    if isinstance(dtype, np.dtype) or (isinstance(dtype, type) and issubclass(dtype, np.generic)):
        dtype = np.dtype(dtype)
        if dtype.metadata:  # equal, and hashed alike, with or without it: never looked up by it
            return dtype.metadata[_LABEL] if _LABEL in dtype.metadata else dtype_info(dtype)["name"]
        name = _NAME_BY_NUMPY_DTYPE.get(dtype)
        if name is None:  # the module refuses a big-endian one, which .name would not say (nothing kept)
            name = _NAME_BY_NUMPY_DTYPE[dtype] = dtype_info(dtype)["name"]
        return name
    return dtype_info(dtype)["name"]  # a tinygrad DType or anything the module accepts


# Asking the module builds a dict each time: an upload asks several times per array, and a batch of
# hundreds of small arrays spent a third of its time here. Only names the module accepted are kept.
_NAME_BY_NUMPY_DTYPE: dict[np.dtype, str] = {}


@functools.lru_cache(maxsize=256)
def _name_of_text(text: str) -> str:
    return dtype_info(text)["name"]


@functools.lru_cache(maxsize=None)
def _ml_dtypes() -> Any:
    """The ml_dtypes module when it is installed (imported here if nobody has yet), else None."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes


def _bits_dtype(name: str) -> np.dtype | None:
    """The unsigned integers holding a dtype numpy itself lacks (bfloat16, float8); None for one it has."""
    try:
        if np.dtype(name).isbuiltin == 1:  # ml_dtypes registers its types as user dtypes (2)
            return None
    except TypeError:
        pass
    return np.dtype(f"uint{dtype_info(name)['itemsize'] * 8}")


def _numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype arrays of devbridge dtype ``name`` come back as.

    One numpy lacks (bfloat16, float8) is ml_dtypes' type when ml_dtypes is installed (importable: jax
    users have it), else its unsigned bits: what comes back depends on what is installed, never on which
    package happened to be imported first.
    """
    bits = _bits_dtype(name)
    if bits is None:
        return np.dtype(name)
    ml_dtypes = _ml_dtypes()
    own = getattr(ml_dtypes, name, None) if ml_dtypes is not None else None
    return bits if own is None else np.dtype(own)


@functools.lru_cache(maxsize=None)
def _labelled(name: str) -> np.dtype:
    """A numpy dtype whose ``_dtype_name`` is ``name``: numpy's own when it has it, else labelled bits."""
    bits = _bits_dtype(name)
    return np.dtype(name) if bits is None else np.dtype(bits, metadata={_LABEL: name})


# ---------------------------------------------------------------------------------------------- intake
#
# Every entry that takes an array (upload, adopt, the Prefetcher, import_tensor, PortableTensor.from_array,
# a devbridge.ray put) reads it through _intake: numpy, any DLPack producer in host memory (torch, jax,
# cupy's host arrays...; bfloat16 and float8 included) or any buffer-protocol object, without a copy. The
# one rule for byte order: devbridge's bytes are little-endian (PortableTensor, safetensors, every device
# it drives), so a big-endian array is converted to them (a copy, the values kept) by every entry that copies
# anyway; adopt, which promises no copy, refuses it.

_DLPACK_CPU = 1
_DLPACK_DEVICES = {1: "CPU", 2: "CUDA", 3: "CUDA host", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI", 10: "ROCm",
                   11: "ROCm host", 12: "ext dev", 13: "CUDA managed", 14: "oneAPI", 15: "WebGPU", 16: "Hexagon",
                   17: "MAIA"}
# The DLPack devices whose memory the CPU reads, as numpy's from_dlpack takes them: the CPU's, pinned host
# memory (CUDA host, ROCm host) and CUDA managed memory. A capsule on any other device is never read here.
_DLPACK_HOST_READABLE = frozenset({1, 3, 11, 13})
# DLPack's type codes (dlpack.h), to name a dtype devbridge does not hold.
_DLPACK_CODES = {0: "int", 1: "uint", 2: "float", 3: "opaque handle", 4: "bfloat", 5: "complex", 6: "bool",
                 7: "float8_e3m4", 8: "float8_e4m3", 9: "float8_e4m3b11fnuz", 10: "float8_e4m3fn",
                 11: "float8_e4m3fnuz", 12: "float8_e5m2", 13: "float8_e5m2fnuz", 14: "float8_e8m0fnu",
                 15: "float6_e2m3fn", 16: "float6_e3m2fn", 17: "float4_e2m1fn"}


def _dlpack_dtype_text(code: int, bits: int, lanes: int) -> str:
    """A DLPack dtype as numpy would spell it ("complex64", "float8_e4m3fnuz"), else its numbers."""
    base = _DLPACK_CODES.get(code)
    if base is None or code == 3:
        return f"DLPack code {code}, {bits} bits"
    name = base if code >= 7 else ("bool" if code == 6 else f"{base}{bits}")
    return name if lanes == 1 else f"{name} x{lanes} lanes"


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_DLPACK_FLAG_READ_ONLY = 1

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


@functools.lru_cache(maxsize=None)
def _dlpack_dtypes() -> dict[tuple[int, int], str]:
    """(DLPack type code, bits) -> devbridge dtype, from the module's own table."""
    return {(dtype_info(n)["dlpack_code"], dtype_info(n)["dlpack_bits"]): n for n in dtypes()}


class _DLPackMemory:
    """The memory of a DLPack capsule (versioned or not) as an array interface for numpy. It holds the capsule,
    whose destructor (the producer's) lets the producer's memory go once the array is gone."""

    __slots__ = ("__array_interface__", "_capsule")

    def __init__(self, capsule: Any, interface: dict[str, Any]) -> None:
        self._capsule = capsule
        self.__array_interface__ = interface


def _from_capsule(array: Any, what: str) -> np.ndarray:
    """A DLPack producer's CPU tensor whose dtype numpy lacks (bfloat16, float8), read without a copy from
    its capsule as numpy would: the bits, labelled with devbridge's dtype."""
    kind = type(array).__name__
    try:
        try:
            # DLPack >= 1.0 says whether the memory is read-only; a producer from before takes no max_version.
            capsule = array.__dlpack__(max_version=(1, 0))
        except TypeError:
            capsule = array.__dlpack__()
    except Exception as error:  # the producer's own refusal (a tensor requiring grad, an unsupported dtype...)
        raise TypeError(f"{what}: the {kind} refused its DLPack export: {type(error).__name__}: {error}") from error
    # As numpy reads a capsule: a DLPack >= 1.0 one says whether its memory is read-only (torch's writable
    # tensors are not, and adopt refuses them as it refuses a writable numpy array); an unversioned one cannot
    # say, and numpy marks what it gives read-only (jax, whose arrays nothing changes, gives only those).
    read_only = True
    try:
        managed = _DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, b"dltensor_versioned"))
        tensor, read_only = managed.dl_tensor, bool(managed.flags & _DLPACK_FLAG_READ_ONLY)
    except ValueError:
        try:
            tensor = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
        except ValueError as error:
            raise TypeError(f"{what}: the {kind}'s __dlpack__() gave no DLPack capsule ({error})") from error
    # The capsule's own word on where the memory is, whatever __dlpack_device__() said: memory on a device
    # (an OpenCL buffer, a CUDA pointer) read as host memory is garbage or a crash.
    device_type, device_id = tensor.device.device_type, tensor.device.device_id
    if device_type not in _DLPACK_HOST_READABLE:
        raise ValueError(f"{what}: the {kind}'s DLPack capsule is on device ({device_type}, {device_id}) "
                         f"({_DLPACK_DEVICES.get(device_type, 'not host memory')}), though its __dlpack_device__() "
                         "said the CPU: devbridge takes arrays in host memory and reads nothing else; copy it "
                         "to the CPU first")
    code, bits, lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    name = _dlpack_dtypes().get((code, bits)) if lanes == 1 else None
    if name is None:  # ValueError, as the same dtype in a numpy array is (dtype_info's words)
        raise ValueError(f"{what}: unknown dtype \"{_dlpack_dtype_text(code, bits, lanes)}\" (the {kind}'s DLPack "
                         f"dtype: code {code}, bits {bits}, lanes {lanes}); devbridge knows: {', '.join(dtypes())}")
    dtype = _labelled(name)
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    if math.prod(shape) == 0:
        return np.empty(shape, dtype)
    strides = None if not tensor.strides else tuple(tensor.strides[i] * dtype.itemsize for i in range(tensor.ndim))
    interface = {"version": 3, "shape": shape, "typestr": dtype.str, "strides": strides,
                 "data": (tensor.data + tensor.byte_offset, read_only)}
    return np.asarray(_DLPackMemory(capsule, interface)).view(dtype)


def _from_dlpack(array: Any, what: str) -> np.ndarray:
    kind = type(array).__name__
    try:
        device_type, device_id = (int(v) for v in array.__dlpack_device__())
    except Exception as error:
        raise TypeError(f"{what}: the {kind} has __dlpack__ but no usable __dlpack_device__ ({error})") from error
    if device_type != _DLPACK_CPU:
        where = _DLPACK_DEVICES.get(device_type, "not host memory")
        raise ValueError(f"{what}: the {kind} lives on DLPack device ({device_type}, {device_id}) ({where}), not "
                         "the CPU: devbridge takes arrays in host memory; copy it there first (torch: .cpu(), "
                         "jax: jax.device_put(x, jax.devices('cpu')[0]))")
    try:
        # numpy reads a capsule only on a device whose memory the CPU reads (_DLPACK_HOST_READABLE's).
        return np.from_dlpack(array)
    except (BufferError, RuntimeError, TypeError, ValueError):
        # A dtype numpy lacks, the producer's refusal (said by it), or a capsule on a device numpy refuses,
        # which _from_capsule refuses too: it checks the capsule's device before reading a byte.
        return _from_capsule(array, what)


class _NotAnArray(TypeError):
    """An object that is no array the intake reads (no ndarray, DLPack producer or buffer); an entry that
    takes anything ``numpy.asarray`` takes (``any_layout``) tries that instead. Any other refusal (a
    producer's failed export, a masked array) stands for every entry alike."""


def _refuse_masked(array: Any, what: str) -> None:
    """``TypeError`` for a numpy masked array: devbridge's bytes carry no mask, and its ``data`` holds
    whatever the masked elements hold (reshaped, it is not even the array numpy would give)."""
    if isinstance(array, np.ma.MaskedArray):
        raise TypeError(f"{what}: a numpy masked array (numpy.ma.MaskedArray, shape {array.shape}, "
                        f"{array.dtype}) cannot be taken: devbridge's tensors carry no mask; pass "
                        "a.filled(value) (the masked elements replaced by value) or a.data (the values under the "
                        "mask as they are)")


def _dtype_refusal(dtype: np.dtype, what: str) -> str | None:
    """Why ``dtype``, which devbridge does not hold, is none of its dtypes where the module's "unknown dtype
    \"void64\"" would not say it: a structured dtype (fields) or raw void bytes. None for any other."""
    if dtype.fields is not None:
        return (f"{what}: the array has a structured dtype ({dtype}): a record of fields, not one of devbridge's "
                "dtypes (devbridge.dtypes()); pass one field at a time (numpy.ascontiguousarray(a['name'])), or "
                "its bytes (a.view(numpy.uint8))")
    if dtype.type is np.void:  # ml_dtypes' types are kind "V" too, but their own types
        return (f"{what}: the array has a raw void dtype ({dtype}: {dtype.itemsize}-byte items numpy gives no "
                "type), not one of devbridge's dtypes (devbridge.dtypes()); pass its bytes (a.view(numpy.uint8)), "
                "or give dtype= (a devbridge dtype of its item size) to relabel them")
    return None


def _to_numpy(array: Any, what: str) -> np.ndarray:
    """``array`` as a numpy array over its own memory: numpy, a CPU DLPack producer, a buffer."""
    _refuse_masked(array, what)
    if isinstance(array, np.ndarray):
        return array
    if isinstance(array, np.generic):  # its buffer would be its bytes (datetime64: 8 uint8), not its dtype
        return np.asarray(array)
    if hasattr(type(array), "__dlpack__"):
        return _from_dlpack(array, what)
    kind = type(array).__name__
    try:
        view = memoryview(array)
    except TypeError as error:
        raise _NotAnArray(f"{what} takes an array (numpy, a DLPack producer in host memory such as a torch or jax "
                          f"CPU tensor, or a buffer such as bytes or array.array), not {kind}") from error
    except BufferError as error:
        raise TypeError(f"{what}: the {kind} refused its buffer: {error}") from error
    if not view.c_contiguous:
        raise ValueError(f"{what}: the {kind} buffer is not C-contiguous; copy it first")
    return np.asarray(view)


def _lazy_sign_bits(array: Any) -> list[str]:
    """torch's lazy bits set on ``array``: "negative" (``_neg_view()``, the ``.imag`` of a conjugate view),
    "conjugate" (``.conj()`` of a complex tensor). Their memory holds the values before the negation or
    conjugation, which DLPack (numpy's ``from_dlpack`` included) exports as they are: read as the tensor's
    values, a negative view lost its sign. Empty for any other array (checked by duck type: torch is never
    imported here)."""
    bits = []
    for method, bit in (("is_neg", "negative"), ("is_conj", "conjugate")):
        test = getattr(type(array), method, None)
        if callable(test):
            try:
                if test(array) is True:
                    bits.append(bit)
            except Exception:  # noqa: BLE001 - not torch's method: nothing set
                pass
    return bits


def _resolved_lazy_sign(array: Any, what: str, copy: bool) -> Any:
    """``array`` with torch's lazy negation and conjugation applied (``resolve_neg()``, ``resolve_conj()``:
    a copy holding the values) for an entry that copies anyway; ``ValueError`` for one that copies nothing
    (adopt). Any other array as it is."""
    bits = _lazy_sign_bits(array)
    if not bits:
        return array
    kind = type(array).__name__
    if not copy:
        raise ValueError(f"{what}: the {kind} has torch's {' and '.join(bits)} bit set: its memory holds the "
                         f"values before a lazy {'negation' if bits == ['negative'] else 'negation/conjugation'}, "
                         "not the values themselves, and this call copies nothing; pass tensor.resolve_neg()"
                         ".resolve_conj() (a copy of the values), or use a call that copies (bridge.upload)")
    try:
        if "conjugate" in bits:
            array = array.resolve_conj()
        if "negative" in bits or _lazy_sign_bits(array):
            array = array.resolve_neg()
    except Exception as error:  # the producer's own refusal (a tensor requiring grad...)
        raise TypeError(f"{what}: the {kind} has torch's {' and '.join(bits)} bit set, and resolving it "
                        f"(resolve_neg()/resolve_conj()) failed: {type(error).__name__}: {error}") from error
    return array


def _intake(array: Any, what: str, dtype: Any = None, *, copy: bool = True, any_layout: bool = False) -> np.ndarray:
    """The one reading of an array an entry is given: a C-contiguous numpy array of little-endian items
    whose ``_dtype_name(a.dtype)`` is the data's devbridge dtype (``dtype`` relabels bytes of the same item
    size), over the caller's memory where that allows.

    ``copy``: the entry copies the data anyway, so a big-endian array is converted (else ``ValueError``
    naming its dtype). ``any_layout``: anything ``numpy.asarray`` takes, a strided array copied into
    row-major order (else a non-contiguous array is ``ValueError``). ``what`` names the entry in errors."""
    array = _resolved_lazy_sign(array, what, copy)
    try:
        a = _to_numpy(array, what)
    except _NotAnArray as error:
        a = np.asarray(array) if any_layout else None  # a list, a scalar, an object with __array__...
        if a is None or (a.dtype == object and not isinstance(array, (int, float, complex, list, tuple))):
            # numpy read no numbers from it, only wrapped it (None) or its items (a tinygrad Tensor): no array.
            # (Objects out of a Python number or a list are the dtype's ValueError below, as a put words it.)
            raise TypeError(str(error)) from error.__cause__
    if not a.flags.c_contiguous:
        if not any_layout:
            hint = ("tensor.contiguous()" if callable(getattr(array, "contiguous", None))
                    else "numpy.ascontiguousarray(array)")
            raise ValueError(f"{what}: the array (shape {a.shape}, strides {a.strides}) is not C-contiguous, so "
                             f"it is not one run of bytes; pass {hint}")
        a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        if not copy:
            raise ValueError(f"{what}: the array is big-endian ({a.dtype.str}) and devbridge's bytes are "
                             "little-endian; this call copies nothing, so pass array.astype(array.dtype."
                             "newbyteorder('<')) or use a call that copies")
        a = a.astype(a.dtype.newbyteorder("<"))
    if dtype is not None:
        name = _dtype_name(dtype)
        if dtype_info(name)["itemsize"] != a.itemsize:
            raise ValueError(f"{what}: dtype {name} has items of {dtype_info(name)['itemsize']} bytes, the "
                             f"array's {a.dtype} {a.itemsize}: dtype relabels the bytes, it does not convert them "
                             "(use array.astype)")
        a = a.view(_labelled(name))
    else:
        try:
            _dtype_name(a.dtype)  # ValueError now for a dtype devbridge does not hold
        except ValueError as error:
            why = _dtype_refusal(a.dtype, what)
            if why is None:
                raise
            raise ValueError(why) from error
    return a
