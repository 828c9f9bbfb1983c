"""``devbridge.Bridge``: the extension's ``Bridge`` with the pure-Python layers' calls as its methods.

The bound class (python/src/bridge.cpp) has the contract's calls (alloc, copies, views, restart...).
The one-call staging (``upload``, ``download``, ``adopt``), portable tensors (``export``, ``export_to``,
``import_tensor``, ``transfer``) and checkpoint files (``checkpoint``, ``restore``) are module functions
taking the bridge first; each method here is the same call spelled ``bridge.name(...)``, defined in
this one class instead of being attached to the extension's class when a module is imported.
"""

from __future__ import annotations

import operator
from typing import Any, BinaryIO, Callable, Mapping

import numpy as np

from . import _checkpoint, _checkpoint_write, _devbridge, _portable, _staging
from ._devbridge import ObjectSpec
from ._portable import PortableTensor
from ._staging import DeviceTensor


def _documented_as(function: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The method's docstring is its module function's: one text for both spellings of the call."""

    def document(method: Callable[..., Any]) -> Callable[..., Any]:
        method.__doc__ = function.__doc__
        return method

    return document


class Bridge(_devbridge.Bridge):
    __doc__ = _devbridge.Bridge.__doc__  # the constructor's arguments are the extension's

    # As the extension's class: no instance attributes, no weak references (state lives in C++).
    __slots__ = ()

    # ------------------------------------------------------------------------------ staging (_staging)

    @_documented_as(_staging.upload)
    def upload(self, array: Any, *, dtype: Any = None, alignment: int = 256, wait: bool = False) -> DeviceTensor:
        return _staging.upload(self, array, dtype=dtype, alignment=alignment, wait=wait)

    @_documented_as(_staging.download)
    def download(self, x: Any, out: np.ndarray | None = None, *, dtype: Any = None,
                 shape: Any = None) -> np.ndarray:
        return _staging.download(self, x, out, dtype=dtype, shape=shape)

    @_documented_as(_staging.adopt)
    def adopt(self, array: Any, *, dtype: Any = None) -> DeviceTensor:
        return _staging.adopt(self, array, dtype=dtype)

    # ------------------------------------------------------------------- portable tensors (_portable)

    @_documented_as(_portable.export)
    def export(self, x: Any, dtype: Any = None, shape: Any = None, strides: Any = None, offset: int = 0,
               *, out: Any = None) -> PortableTensor:
        return _portable.export(self, x, dtype, shape, strides, offset, out=out)

    @_documented_as(_portable.export_to)
    def export_to(self, x: Any, file: BinaryIO, dtype: Any = None, shape: Any = None, strides: Any = None,
                  offset: int = 0) -> int:
        return _portable.export_to(self, x, file, dtype, shape, strides, offset)

    @_documented_as(_portable.import_tensor)
    def import_tensor(self, source: Any, spec: ObjectSpec | None = None, *, dtype: Any = None,
                      shape: Any = None, alignment: int = 256, wait: bool = True) -> DeviceTensor:
        return _portable.import_tensor(self, source, spec, dtype=dtype, shape=shape, alignment=alignment,
                                       wait=wait)

    @_documented_as(_portable.transfer)
    def transfer(self, x: Any, dst_bridge: _devbridge.Bridge, **kwargs: Any) -> DeviceTensor:
        return _portable.transfer(self, x, dst_bridge, **kwargs)

    # -------------------------------------------------------------------------- checkpoints (_checkpoint)

    @_documented_as(_checkpoint.checkpoint)
    def checkpoint(self, path: Any, tensors: Mapping[str, Any], *, metadata: Mapping[str, str] | None = None,
                   checksum: str = _checkpoint_write._DEFAULT_CHECKSUM) -> dict[str, str]:
        return _checkpoint.checkpoint(self, path, tensors, metadata=metadata, checksum=checksum)

    @_documented_as(_checkpoint.restore)
    def restore(self, path: Any, *, names: Any = None, prefix: str | None = None, rows: Any = None,
                alignment: int = 256, verify: bool = True,
                wait: bool = True) -> dict[str, DeviceTensor] | _checkpoint.PendingRestore:
        return _checkpoint.restore(self, path, names=names, prefix=prefix, rows=rows, alignment=alignment,
                                   verify=verify, wait=wait)

    # ---------------------------------------------------------------------------------------- compute

    def axpy(self, x: Any, y: Any, a: float = 1.0, b: float = 0.0, *, x_offset: int = 0, y_offset: int = 0,
             nbytes: int | None = None) -> None:
        """The built-in role y = a*x + b over float32. x and y: DeviceTensors or DeviceHandles; nbytes
        defaults to the rest of x from x_offset: of a DeviceTensor its elements (its allocation's rounding
        past them is no data of it, and y's elements there are not overwritten), of a handle its whole extent."""
        if nbytes is None and isinstance(x, DeviceTensor) and not isinstance(x_offset, bool):
            try:
                start = operator.index(x_offset)
            except TypeError:
                start = None  # the extension refuses it, naming x_offset
            if start is not None and 0 <= start <= x.nbytes:
                nbytes = x.nbytes - start
        super().axpy(x.handle if isinstance(x, DeviceTensor) else x, y.handle if isinstance(y, DeviceTensor) else y,
                     a, b, x_offset=x_offset, y_offset=y_offset, nbytes=nbytes)


__all__ = ["Bridge"]
