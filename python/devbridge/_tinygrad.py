"""The tinygrad hand-off: TensorView.to_tinygrad() and its helpers.

What the hand-off guarantees
----------------------------
``Tensor.from_blob`` gives tinygrad a raw address; tinygrad never frees it and
reads it lazily, whenever a computation over the tensor is realized. So
``to_tinygrad()``:

* first waits until every copy into the allocation submitted so far has
  completed (the bridge's ``ViewWait::Wait``), so the tensor never reads bytes
  an upload is still writing;
* takes a lease of its own on the allocation and attaches it to the tinygrad
  ``Buffer`` that holds the address. The allocation cannot be freed while
  tinygrad can still read it: ``bridge.free(h)`` raises
  ``AllocationStillInUse`` and ``bridge.release(h)`` defers the free until
  the tensor (and every lazy tensor computed from it) is gone. Closing the
  ``TensorView`` it came from does not end the tensor's lease.

What it does not order
----------------------
* Copies submitted *after* the hand-off: an upload into the allocation
  while tinygrad computes races with it, as with any shared buffer.
* Writes tinygrad makes: tinygrad runs kernels asynchronously. After
  ``t.assign(...).realize()``, call ``devbridge.tinygrad_synchronize(t)``
  before ``bridge.device_to_host`` reads the allocation.
* ``bridge.restart()`` and ``bridge.close()``: a restart retires the old
  generation's handles whatever leases exist (that is its point: the worker
  is gone), but memory under a live tensor is freed only when the tensor's
  lease ends, so the tensor never reads freed memory.

Read-only memory (adopted host memory, ``view.read_only``): tinygrad has no
read-only tensors, so the tensor handed over is an exact identity over the
memory (``_unwritable``): reads stay zero-copy, and tinygrad's writes
(``assign``, ``+=``, an optimizer's step) land in a buffer of its own.

Addresses: tinygrad's kernels load and store 16 bytes at a time with aligned vector
instructions, so an address that is not a multiple of 16 bytes (a view at such a byte offset,
adopted memory that starts at one; 32 under tinygrad's LLVM renderer) is refused with
``Unsupported`` before tinygrad sees it (``_check_alignment``): handed over, it crashed the process.

bfloat16 on tinygrad's CPU device: its default (C) renderer declares bfloat16 buffers
``__bf16``, which an older clang (Debian 12's clang 14, which scripts/setup.sh installs) refuses
on x86-64 ("__bf16 is not supported on this target"), so every kernel over such a tensor, its
``numpy()`` included, fails in clang. ``_bfloat16_refusal`` compiles a probe once per process
with tinygrad's own clang command line (``CC``, target, ``-march``), and where that fails the
hand-off is refused with ``UnsupportedDType``, naming the ways round it.

Devices: a host-backend view becomes a tinygrad ``CPU`` tensor. A CUDA view
becomes a ``CUDA`` tensor; tinygrad computes in a CUDA context of its own
(``cuCtxCreate``), and device pointers are only valid in the context that
allocated them, so the bridge must use tinygrad's context:
``Bridge(backend="cuda", cuda_context="tinygrad")``.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import subprocess
import warnings
from typing import TYPE_CHECKING, Any

from ._errors import Unavailable, Unsupported, UnsupportedDType

if TYPE_CHECKING:  # pragma: no cover
    from tinygrad import Tensor

    from ._devbridge import TensorView

# tinygrad devices whose allocator honours Tensor.from_blob's external pointer.
# (Others, e.g. tinygrad's CL device, would silently allocate fresh memory.)
_ZERO_COPY_DEVICES = ("CPU", "CUDA")


_tinygrad_module: Any = None


def _import_tinygrad() -> Any:
    """The tinygrad module, imported on first use (devbridge does not need tinygrad otherwise).

    ``Unavailable`` when tinygrad is not installed: only a ``ModuleNotFoundError`` for ``tinygrad`` itself
    means that. A tinygrad that is installed but fails to import (a missing dependency or shared library, a
    version clash, an earlier import interrupted half way) raises ``Unavailable`` saying so, with the real
    error in the message and as its ``__cause__``; anything but an ``ImportError`` (``KeyboardInterrupt``,
    an error raised by tinygrad's own code) propagates unchanged."""
    global _tinygrad_module
    if _tinygrad_module is None:
        try:
            import tinygrad
        except ModuleNotFoundError as error:
            if error.name != "tinygrad":  # one of tinygrad's own imports: installed, but broken
                raise _import_failed(error) from error
            raise Unavailable("to_tinygrad: tinygrad is not installed (pip install tinygrad)") from error
        except ImportError as error:
            raise _import_failed(error) from error
        _tinygrad_module = tinygrad
    return _tinygrad_module


def _import_failed(error: ImportError) -> Unavailable:
    return Unavailable(f"to_tinygrad: tinygrad is installed but failed to import: {type(error).__name__}: {error} "
                       f"(the chained traceback shows where)")


@functools.lru_cache(maxsize=None)  # a few device strings per process; a failure is not cached
def _tinygrad_device(view_device: str) -> str:
    """tinygrad's name for the device of a view ("CPU", "CUDA", "CUDA:1")."""
    family, _, ordinal = view_device.partition(":")
    family = family.upper()
    if family not in _ZERO_COPY_DEVICES:
        raise Unsupported(_no_zero_copy_message(view_device))
    if family == "CPU":
        return "CPU"
    return family if ordinal in ("", "0") else f"{family}:{ordinal}"


def _no_zero_copy_message(view_device: str, handle: Any = None, dtype: str = "", shape: Any = None) -> str:
    # Copy it out is the only advice that works: DLPack of such a view names a device buffer (an OpenCL
    # cl_mem), which no CPU consumer reads, and torch 2.15 aborts the process on one (docs/PYTHON.md).
    what = "a" if handle is None else f"{handle!r} (a"
    download = ("bridge.download(tensor)" if handle is None
                else f"bridge.download(handle, dtype={dtype!r}, shape={tuple(shape)!r})")
    return (f"to_tinygrad: {what} {view_device} view{')' if handle is not None else ''} cannot be handed to "
            f"tinygrad without a copy (tinygrad takes external memory only on {', '.join(_ZERO_COPY_DEVICES)}). "
            f"Copy it out instead: tinygrad.Tensor({download}) (a DeviceTensor's .numpy() too), or "
            "bridge.device_to_host into the ring; a Prefetcher on this device takes to=\"device\" "
            "(DeviceTensors)")


def cuda_context(which: str, ordinal: int = 0) -> int:
    """The CUcontext (as an int) of tinygrad's CUDA device ``ordinal``.

    ``Bridge(backend="cuda", cuda_context="tinygrad")`` uses it so that the
    bridge allocates in the context tinygrad computes in.
    """
    if which != "tinygrad":
        raise ValueError(f'cuda_context must be None, an int (a CUcontext) or "tinygrad", not {which!r}')
    _import_tinygrad()
    from tinygrad import Device

    name = "CUDA" if ordinal == 0 else f"CUDA:{ordinal}"
    try:
        device = Device[name]
        context = ctypes.cast(device.context, ctypes.c_void_p).value
    except Exception as error:  # tinygrad raises whatever its driver binding raised
        raise Unavailable(f"tinygrad's {name} device is not usable here: {error}") from error
    if not context:
        raise Unavailable(f"tinygrad's CUDA:{ordinal} device has no context")
    return int(context)


# ---- building the tensor ----
#
# Tensor.from_blob(ptr, shape) is Tensor.empty(*shape) plus an external
# allocation. Tensor.empty builds its graph through tinygrad's general paths
# (a fresh buffer node, a reshape, a no-op shrink_to), which derive every
# node's dtype by a long match and simplify every shape argument with a graph
# rewrite: about 0.6 ms of Python for one tensor, most of the hand-off.
# _wrap_external builds the same graph directly: the Buffer over the
# address, its BUFFER node exactly as UOp.from_buffer makes it, and one
# RESHAPE node, each with its dtype given and its shape argument cached,
# and the Tensor made the way tinygrad makes the result of every operation
# (Tensor._apply_uop: no constructor, which would re-derive device and dtype).
# tinygrad interns UOps, so the nodes are not merely alike but the very
# objects tinygrad's own calls return, and the Tensor has exactly the fields
# its constructor sets: _fast_path_ok() checks both once per process, and
# where they do not hold (another tinygrad version) every hand-off goes
# through Tensor.from_blob instead.


class _Names:
    """The tinygrad names the hand-off uses, looked up once: it runs right
    after large copies, with cold caches, where each import statement and
    module attribute lookup costs microseconds."""

    def __init__(self) -> None:
        import weakref

        import tinygrad
        from tinygrad.device import Buffer, Device
        from tinygrad.tensor import Tensor, all_tensors
        from tinygrad.uop.ops import GroupOp, Ops, ParamArg, UOp, buffers, shape_to_shape_arg

        self.dtypes, self.Tensor, self.all_tensors, self.Buffer = tinygrad.dtypes, Tensor, all_tensors, Buffer
        self.Device = Device
        self.Ops, self.ParamArg, self.UOp, self.buffers = Ops, ParamArg, UOp, buffers
        self.shape_to_shape_arg, self.weakref = shape_to_shape_arg, weakref.ref
        # What Tensor.assign looks through to find the buffer it stores into.
        self.write_through_ops = frozenset(GroupOp.Movement | {Ops.BITCAST, Ops.DETACH})
        self.float8_dtypes = frozenset(getattr(tinygrad.dtypes, name) for name in ("fp8e4m3", "fp8e5m2")
                                       if hasattr(tinygrad.dtypes, name))


@functools.cache
def _tinygrad_names() -> _Names:
    _import_tinygrad()  # the clear error when tinygrad is missing
    return _Names()


@functools.lru_cache(maxsize=256)  # held, so the shape's UOp stays interned
def _shape_arg(shape: tuple[int, ...]) -> Any:
    return _tinygrad_names().shape_to_shape_arg(shape)


def _buffer_node(tg: _Names, buffer: Any) -> Any:
    """The BUFFER node of an allocated tinygrad Buffer, as UOp.from_buffer(buffer) makes it."""
    node = tg.UOp(tg.Ops.BUFFER, buffer.dtype, src=(_shape_arg((buffer.size,)),),
                  arg=tg.ParamArg(-id(buffer), buffer.dtype, device=buffer.device))
    if node not in tg.buffers:
        tg.buffers[node] = buffer.ref(1)
    return node


def _reshape_node(tg: _Names, node: Any, shape: tuple[int, ...]) -> Any:
    """node.reshape(shape), for a shape that differs from node's."""
    return tg.UOp(tg.Ops.RESHAPE, node.dtype, src=(node, _shape_arg(shape)))


def _tensor_of(tg: _Names, node: Any) -> "Tensor":
    """tinygrad.Tensor(node) for a node already on its device with its dtype."""
    tensor = tg.Tensor.__new__(tg.Tensor)
    tensor.uop, tensor.grad, tensor.is_param = node, None, True
    tg.all_tensors[tg.weakref(tensor)] = None
    return tensor


def _same_tensor(a: Any, b: Any) -> bool:
    slots = getattr(type(a), "__slots__", ())
    return (type(a) is type(b) and set(slots) == {"uop", "grad", "is_param"} and not getattr(a, "__dict__", {})
            and all(getattr(a, name) is getattr(b, name) for name in slots))


@functools.cache
def _fast_path_ok() -> bool:
    try:
        tg = _tinygrad_names()
        probe = tg.Buffer("CPU", 6, tg.dtypes.float32)  # never allocated
        node = _buffer_node(tg, probe)
        shaped = _reshape_node(tg, node, (2, 3))
        return (tg.UOp.from_buffer(probe) is node and shaped is node.reshape((2, 3))
                and _same_tensor(_tensor_of(tg, shaped), tg.Tensor(shaped)))
    except Exception:  # noqa: BLE001 - any difference in tinygrad's internals means: use from_blob
        return False


def _wrap_external(ptr: int, shape: tuple[int, ...], dtype: Any, device: str) -> tuple["Tensor", Any]:
    """A tinygrad Tensor over external memory (what Tensor.from_blob returns, built
    faster) and the tinygrad Buffer that holds the address."""
    tg = _tinygrad_names()
    if len(shape) == 0 or not _fast_path_ok():
        tensor = tg.Tensor.from_blob(ptr, shape, dtype=dtype, device=device)
        return tensor, tensor.uop.buffer
    buffer = tg.Buffer(device, math.prod(shape), dtype).allocate(external_ptr=ptr)
    node = _buffer_node(tg, buffer)
    if len(shape) > 1:
        node = _reshape_node(tg, node, shape)
    return _tensor_of(tg, node), buffer


def _unwritable(tg: _Names, tensor: "Tensor", view: "TensorView") -> "Tensor":
    """``tensor`` (over read-only memory) as a tensor no tinygrad write reaches that memory through.

    tinygrad has no read-only tensors: ``assign`` (and ``+=``, an optimizer's step) stores into the buffer
    found under the tensor's movement ops, which here is the caller's adopted memory (an ``ACCESS_READ``
    mmap faults, an object-store buffer would change under its other readers). ``tensor * 1`` is an
    exact identity tinygrad fuses into every kernel that reads it (still zero-copy), but it is a
    computation, not a buffer: an assign into it, or into any view of it, realizes a buffer of
    tinygrad's own first (copy on write). Where this tinygrad would still reach the buffer (it folded
    the identity away) or changed the dtype, the hand-off is refused rather than made writable. So is
    float8: tinygrad stores it through float32 in every kernel (subnormals flushed, infinities saturated),
    so the identity, and a read of it, would change the bits."""
    if tensor.dtype in tg.float8_dtypes:
        raise Unsupported(
            f"to_tinygrad: {view.handle!r} is read-only memory (adopted host memory) of {view.dtype}, which "
            "tinygrad can only hand on through a kernel, and its kernels store float8 through float32 (subnormals "
            "become 0, infinities the largest finite value); upload a copy (bridge.upload(array)) for a tensor "
            "tinygrad reads bit-exact, or read it with bridge.download(...)")
    wrapped = tensor * (True if tensor.dtype == tg.dtypes.bool else 1)
    node = wrapped.uop
    while node.op in tg.write_through_ops:
        node = node.src[0]
    if wrapped.dtype != tensor.dtype or node.has_buffer_identity(after_ok=True):
        raise Unsupported(
            f"to_tinygrad: {view.handle!r} is read-only memory (adopted host memory), and this tinygrad would "
            "write through the tensor into it; read it with bridge.download(...) (or tensor.numpy()), or upload "
            "a copy (bridge.upload(array)) for a tensor tinygrad may write")
    return wrapped


# ---- the address tinygrad may be given ----
#
# tinygrad compiles its kernels for the memory its own allocators return (CPU: mmap'd pages, CUDA:
# cuMemAlloc's 256 bytes), and loads and stores through a buffer up to 4 adjacent items at a time (8
# halves with ALLOW_HALF8) as one vector whose C type is aligned to its size, at most 16 bytes
# (renderer/cstyle.py's render_vector_prefix: float4 is aligned(16)); clang then emits aligned vector
# instructions (movaps), which fault on an address that is not a multiple of 16 (CUDA: a misaligned
# address error). Measured with tinygrad 0.14 on x86-64, each case in a subprocess (a view of an
# allocation at each element-aligned byte offset up to 64; elementwise, reduce, matmul, cast, assign):
# with DEV=CPU (clang, the default) float32 and int32 at offsets 4, 8, 12, 24 and 36 die with SIGSEGV
# in elementwise kernels and assign (int32 in matmul too), while 16, 32, 48 and 64 compute right;
# float16, int8, uint8, int16, float64 and int64 survived every offset, only because this tinygrad groups
# no loads of the 1- and 8-byte ones and groups halves into 8-byte vectors x86 loads unaligned without a
# fault (half4 is declared aligned(8), so an address off 8 is still undefined; half8 under ALLOW_HALF8 is
# aligned(16)). bfloat16 kernels do not compile with this clang at all (refused: _bfloat16_refusal).
# DEV=CPU:X86 (tinygrad's own x86 code, unaligned loads) survived every offset of every dtype. So the
# rule follows the vector width, not the dtype: an address tinygrad is given must be a multiple of 16
# bytes, whatever the dtype, which also holds when a later tinygrad groups more dtypes.
# tinygrad's LLVM renderer (DEV=CPU:LLVM) goes further: it declares every buffer argument "align 32"
# ("CPUAllocator promises 0x20 alignment"), so LLVM may assume, and emit instructions that need, 32
# (not measured: this machine's LLVM rejects tinygrad's IR before any kernel runs).
_TINYGRAD_ALIGNMENT = 16
_TINYGRAD_LLVM_ALIGNMENT = 32


def _alignment_needed(tg: _Names, ptr: int, device: str) -> int:
    """The alignment tinygrad's kernels on ``device`` assume of a buffer's address, checked for ``ptr``:
    16 bytes (its widest vector), 32 where the CPU device compiles through LLVM. The renderer is looked
    up only for an address that is a multiple of 16 but not of 32 (the hand-off of an aligned address
    costs nothing)."""
    if ptr % _TINYGRAD_LLVM_ALIGNMENT == 0 or ptr % _TINYGRAD_ALIGNMENT != 0 or not device.startswith("CPU"):
        return _TINYGRAD_ALIGNMENT
    try:
        renderer = type(tg.Device[device].renderer)
    except Exception:  # noqa: BLE001 - no renderer to ask: the C renderer's rule
        return _TINYGRAD_ALIGNMENT
    if any(cls.__name__ == "LLVMRenderer" for cls in renderer.__mro__):
        return _TINYGRAD_LLVM_ALIGNMENT
    return _TINYGRAD_ALIGNMENT


def _check_alignment(tg: _Names, view: "TensorView", ptr: int, device: str) -> None:
    """``Unsupported`` for an address tinygrad's kernels cannot load through (see above): before, tinygrad
    was handed it and the process died (SIGSEGV) at the first kernel that read it."""
    needed = _alignment_needed(tg, ptr, device)
    if ptr % needed == 0:
        return
    offset = view.byte_offset
    if offset % needed:
        where = (f"{view.handle!r} viewed at byte offset {offset} lies at address {ptr:#x}, which is not a "
                 f"multiple of {needed} bytes")
        instead = (f"take the view at a byte offset that is a multiple of {needed} (of an allocation aligned "
                   f"to at least {needed}: upload, restore and alloc align to 256 by default)")
    else:
        origin = ("adopted memory (adopt() takes the array's own address: a slice, or an np.memmap at a file "
                  "offset such as a safetensors tensor's, may start anywhere)" if view.read_only
                  else "its allocation")
        where = (f"{view.handle!r} starts at address {ptr:#x}, which is not a multiple of {needed} bytes: "
                 f"{origin}")
        instead = (f"adopt an array whose address is a multiple of {needed}" if view.read_only
                   else f"allocate it with an alignment of at least {needed}")
    raise Unsupported(
        f"to_tinygrad: {where}. tinygrad's kernels on {device} load and store up to {needed} bytes at a time "
        f"with aligned vector instructions, which fault on such an address, so it cannot be handed over "
        f"without a copy. Instead {instead}; or copy it: bridge.upload(array) (a copy aligned to 256), or "
        f"tinygrad.Tensor(bridge.download(handle, dtype={view.dtype!r}, shape={tuple(view.shape)!r}))")


# ---- bfloat16 on tinygrad's CPU device ----


@functools.lru_cache(maxsize=None)  # one probe per compiler command line, per process
def _bfloat16_compile_error(cc: str, arch: str, args: tuple[str, ...]) -> str | None:
    """clang's error compiling a bfloat16 (``__bf16``) copy for tinygrad's CPU target, with the command line
    tinygrad's ``ClangCompiler`` uses; None when it compiles, or when the compiler cannot be run at all
    (tinygrad's own kernels then fail, and say why, whatever the dtype)."""
    source = "void devbridge_bf16_probe(__bf16 *restrict out, __bf16 *restrict in) { out[0] = in[0]; }\n"
    command = [cc, "-c", "-x", "c", "-O2", "-fPIC", "-ffreestanding", "-fno-math-errno", "-nostdlib",
               f"--target={arch}-none-unknown-elf", *args, "-", "-o", os.devnull]
    try:
        done = subprocess.run(command, input=source.encode(), capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode == 0:
        return None
    lines = done.stderr.decode(errors="replace").splitlines()
    return next((line.split("error:", 1)[1].strip() for line in lines if "error:" in line),
                f"{cc} exited with status {done.returncode}")


def _bfloat16_refusal(tg: _Names, device: str) -> str | None:
    """Why tinygrad's ``device`` cannot compile a kernel over a bfloat16 buffer, or None where it can (or
    where it cannot be told: another renderer or compiler than tinygrad 0.14's C one for CPU)."""
    if not device.startswith("CPU"):
        return None
    try:
        tinygrad_device = tg.Device[device]
        renderer, compiler = type(tinygrad_device.renderer), tinygrad_device.compiler
    except Exception:  # noqa: BLE001 - nothing to ask: let tinygrad say what it says
        return None
    if not any(cls.__name__ == "ClangRenderer" for cls in renderer.__mro__):
        return None  # DEV=CPU:X86 (tinygrad's own x86 code) computes in bfloat16; LLVM: not measured
    arch, args = getattr(compiler, "arch", None), getattr(compiler, "args", None)
    if not isinstance(arch, str) or not isinstance(args, (list, tuple)) or not all(isinstance(a, str) for a in args):
        return None
    return _bfloat16_compile_error(os.environ.get("CC", "clang"), arch, tuple(args))


def _bfloat16_message(handle: Any, device: str, reason: str) -> str:
    cc = os.environ.get("CC", "clang")
    return (f"to_tinygrad: {handle!r} is bfloat16, and tinygrad's {device} device compiles its kernels with {cc}, "
            f"which cannot compile bfloat16 (__bf16) for this machine ({reason}): every tinygrad kernel reading the "
            f"tensor would fail in the compiler, its .numpy() included (a conversion to float32). Instead run "
            f"tinygrad's own x86 code generator (start Python with DEV=CPU:X86), or point CC at a newer clang "
            f"that compiles __bf16; or upload the bits as uint16 "
            f"(bridge.upload(array.view(numpy.uint16))) and widen them in tinygrad: "
            f"(t.cast(dtypes.uint32) * 65536).bitcast(dtypes.float32) is the exact float32; or download it "
            f"(bridge.download gives ml_dtypes' bfloat16) and convert it on the host")


def to_tinygrad(view: "TensorView") -> "Tensor":
    """A ``tinygrad.Tensor`` over the view's memory, zero-copy (see the module doc)."""
    tensor = hand_off(view)[0]
    warn_if_not_default(tensor.device, stacklevel=2)  # the frame that called view.to_tinygrad()
    return tensor


def hand_off(view: "TensorView") -> tuple["Tensor", Any]:
    """``to_tinygrad(view)`` and the tinygrad ``Buffer`` holding the address (and the lease).

    The lease ends when that Buffer is gone, which is when no tensor, lazy or
    realized, can read the allocation any more (tinygrad synchronizes its
    device before it lets go of a Buffer): a weak reference to it tells when
    the allocation is the bridge's alone again (the Prefetcher reuses it then)."""
    tg = _tinygrad_names()
    # Checked, and its own lease taken once every copy into the allocation has completed.
    lease, ptr, shape, dtype_name, view_device = view._export_for_tinygrad()
    try:
        tinygrad_dtype = getattr(tg.dtypes, dtype_name, None)
        if tinygrad_dtype is None:
            raise Unsupported(f"to_tinygrad: this tinygrad has no dtype {lease.dtype!r} (tinygrad.dtypes.{dtype_name})")
        try:
            device = _tinygrad_device(view_device)
        except Unsupported:  # no zero-copy hand-off: the advice names this view's download
            raise Unsupported(_no_zero_copy_message(view_device, lease.handle, lease.dtype, lease.shape)) from None
        _check_alignment(tg, lease, ptr, device)  # before tinygrad ever sees the address
        if dtype_name == "bfloat16":
            reason = _bfloat16_refusal(tg, device)
            if reason is not None:
                raise UnsupportedDType(_bfloat16_message(lease.handle, device, reason))
        if device.startswith("CUDA"):
            ordinal = int(device.partition(":")[2] or 0)
            if lease._native_context != cuda_context("tinygrad", ordinal):
                raise Unsupported(
                    "to_tinygrad: the bridge allocates in a different CUDA context from tinygrad's, so its pointers "
                    'are not valid where tinygrad computes; create the bridge with Bridge(backend="cuda", '
                    'cuda_context="tinygrad")'
                )
            # tinygrad launches on its context's legacy default stream, which
            # does not wait for the bridge's non-blocking streams: order it
            # after the bridge's work (compute steps included) on the device,
            # and hold the memory, once the lease ends, until that stream has
            # passed the kernels tinygrad enqueued over it.
            lease._order_consumer_stream(1)
            lease._end_after_stream(1)
        tensor, buffer = _wrap_external(ptr, shape, tinygrad_dtype, device)
        if lease.read_only:
            tensor = _unwritable(tg, tensor, lease)
        # The Buffer holds the address for as long as any tensor (lazy or not)
        # can read it: the lease lives exactly as long.
        buffer._devbridge_lease = lease
    except BaseException:
        lease.close()
        raise
    return tensor, buffer


class DeviceMismatchWarning(UserWarning):
    """tinygrad's default device is not the device of a tensor from to_tinygrad()."""


_warned_device_pairs: set[tuple[str, str]] = set()


def warn_if_not_default(device: str, stacklevel: int = 2) -> None:
    """Warns once per (view device, default device) pair when tinygrad's default device differs.

    Tensors made without ``device=`` (``Tensor(numpy)``, ``Tensor.randn``, ``nn.Linear``'s weights) land on
    the default device, and tinygrad refuses to mix devices in one operation: on a machine with an OpenCL
    driver (PoCL included) tinygrad picks ``CL`` while a host view is a ``CPU`` tensor. ``stacklevel``: as
    ``warnings.warn``'s, counted from the caller of this function."""
    try:
        default = _tinygrad_names().Device.canonicalize(None)
    except Exception:  # noqa: BLE001 - no usable default device: nothing to mix with
        return
    if default == device or (device, default) in _warned_device_pairs:
        return
    _warned_device_pairs.add((device, default))
    family = device.partition(":")[0]
    warnings.warn(
        f"to_tinygrad: this tensor is on tinygrad's {device} device, but tinygrad's default device is {default}; "
        f"tensors created without device= land on {default}, and an operation mixing them with this one fails. "
        f"Make {device} the default (start Python with DEV={family} in the environment; tinygrad before 0.12: "
        f"{family}=1), or create the other tensors with device=\"{device}\" (or device=tensor.device).",
        DeviceMismatchWarning,
        stacklevel=stacklevel + 1,
    )


def synchronize(tensor: "Tensor") -> None:
    """Waits until tinygrad's device has finished every kernel it was given.

    tinygrad runs kernels asynchronously; call this after writing through a
    tensor from ``to_tinygrad()`` and before the bridge copies the allocation
    out (``device_to_host``).
    """
    _import_tinygrad()
    from tinygrad import Device

    devices = tensor.device if isinstance(tensor.device, tuple) else (tensor.device,)
    for device in devices:
        Device[device].synchronize()
