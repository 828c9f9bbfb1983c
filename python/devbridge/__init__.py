"""devbridge: a host ring <-> device memory bridge with zero-copy tensor views.

The bridge is a GPU worker's one boundary between a ring of host memory,
device allocations and the tensor views compute runs on (tinygrad, or any
DLPack consumer). See docs/PYTHON.md for a walk-through.

    import numpy as np, devbridge
    with devbridge.Bridge() as b:
        h = b.alloc(devbridge.ObjectSpec(1 << 20, 64, "float32"), 4096)
        r = b.ring.reserve(4096)
        b.ring.ndarray(r, "float32")[:] = np.random.rand(1024)
        b.wait(b.host_to_device(r, h))
        with b.view(h, "float32", (32, 32)) as v:
            t = v.to_tinygrad()          # zero-copy tinygrad.Tensor on "CPU"
            print((t * 2 + 1).sum().item())
"""

from __future__ import annotations

from . import _devbridge as _ext
from ._devbridge import (
    MAX_RANK,
    CopyEvent,
    CopyLayout,
    DeviceHandle,
    FakeControl,
    HostRange,
    HostRegion,
    HostRing,
    ObjectSpec,
    RegionRange,
    RingBuffer,
    TensorView,
    devices,
    dtype_info,
    dtypes,
    list_backends,
    pitched_layout,
)
from ._errors import (
    ERROR_CLASSES as _ERROR_CLASSES,
    AllocationFailed,
    AllocationStillInUse,
    Backpressure,
    BridgeError,
    Broken,
    Closed,
    DeviceCopyFailed,
    ForeignDomain,
    InvalidAlignment,
    InvalidExtent,
    InvalidRange,
    InvalidTensorView,
    InvalidViewDType,
    OldGenerationHandle,
    OutputCopyFailed,
    Unavailable,
    UnknownDeviceHandle,
    Unsupported,
    UnsupportedDType,
)
from ._tinygrad import synchronize as tinygrad_synchronize
from ._tinygrad import DeviceMismatchWarning
from ._bridge import Bridge
from ._staging import DeviceTensor, ReleaseQueue, adopt, download, spec_for_array, upload
from ._prefetch import Prefetcher
from ._portable import PortableTensor, export, export_to, import_tensor, transfer
from ._checkpoint import CheckpointError, PendingRestore, checkpoint, checkpoint_info, restore

__version__ = "0.1.0"


def info() -> str:
    """One line per backend of this build: whether it can run here and, when it cannot, why and what to
    install or set so that it can (what `devbridge info` prints first). ``print(devbridge.info())``."""
    rows = list_backends()
    width = max(len(row["name"]) for row in rows)
    return "\n".join(f"{row['name']:<{width}}  {row['summary']}" for row in rows)


if [cls.kind for cls in _ERROR_CLASSES] != list(_ext._error_kinds()):
    raise ImportError(
        "devbridge: the extension's error kinds differ from devbridge._errors "
        f"({list(_ext._error_kinds())}); rebuild the module"
    )
_ext._register_errors(list(_ERROR_CLASSES))

__all__ = [
    "MAX_RANK",
    "Bridge",
    "CopyEvent",
    "CopyLayout",
    "DeviceHandle",
    "FakeControl",
    "HostRange",
    "HostRegion",
    "HostRing",
    "ObjectSpec",
    "RegionRange",
    "RingBuffer",
    "TensorView",
    "devices",
    "dtype_info",
    "dtypes",
    "info",
    "list_backends",
    "pitched_layout",
    "tinygrad_synchronize",
    "DeviceTensor",
    "ReleaseQueue",
    "download",
    "spec_for_array",
    "upload",
    "adopt",
    "Prefetcher",
    "CheckpointError",
    "PortableTensor",
    "checkpoint",
    "checkpoint_info",
    "export",
    "export_to",
    "import_tensor",
    "PendingRestore",
    "restore",
    "transfer",
    "DeviceMismatchWarning",
    "BridgeError",
] + [cls.__name__ for cls in _ERROR_CLASSES]
