"""devbridge's exceptions: one class per kind of the contract's error vocabulary.

Every error the C++ bridge raises (``devbridge::Error``) surfaces as the
subclass named after its kind, so callers can catch exactly what they expect::

    try:
        bridge.free(handle)
    except devbridge.AllocationStillInUse:
        ...

``str(error)`` is ``"<Kind>: <message>"``; ``error.kind`` is the kind's name,
``error.message`` the message alone (it names the handle, range or size at
fault) and ``error.fatal`` is True when a backend failure left the bridge
Broken (every later call fails until ``restart``).
"""

from __future__ import annotations


class BridgeError(Exception):
    """Base class of every devbridge error; ``.kind`` names the kind."""

    kind: str = "BridgeError"
    message: str
    fatal: bool

    def __init__(self, *args: object) -> None:
        text = str(args[0]) if args else ""
        prefix = f"{self.kind}: "
        if args and not text.startswith(prefix):
            args = (prefix + text,) + tuple(args[1:])
        super().__init__(*args)
        self.message = text[len(prefix):] if text.startswith(prefix) else text
        self.fatal = False


_defined: list[type[BridgeError]] = []


def _kind(name: str, doc: str) -> type[BridgeError]:
    cls = type(name, (BridgeError,), {"kind": name, "__doc__": doc, "__module__": "devbridge"})
    _defined.append(cls)
    return cls


# In devbridge::ErrorKind order (checked against the extension at import).
AllocationFailed = _kind("AllocationFailed", "The backend refused an allocation (bytes asked and free where known).")
DeviceCopyFailed = _kind("DeviceCopyFailed", "A host-to-device copy failed; the host range stays the caller's.")
OutputCopyFailed = _kind("OutputCopyFailed", "A device-to-host copy failed; the host range stays the caller's.")
InvalidExtent = _kind("InvalidExtent", "Extent zero, above max_extent, or not a multiple of alignment / dtype size.")
InvalidAlignment = _kind("InvalidAlignment", "Alignment zero or not a power of two.")
InvalidRange = _kind("InvalidRange", "A host or device range outside its ring / allocation, or of unequal lengths.")
UnknownDeviceHandle = _kind("UnknownDeviceHandle", "A handle this bridge never issued, or already freed.")
OldGenerationHandle = _kind("OldGenerationHandle", "A handle or event from before the bridge's last restart.")
ForeignDomain = _kind("ForeignDomain", "A handle or event from another bridge.")
InvalidViewDType = _kind("InvalidViewDType", "A view's dtype differs from the allocation's object spec.")
InvalidTensorView = _kind("InvalidTensorView", "A view's shape, strides and offset do not fit the allocation.")
UnsupportedDType = _kind("UnsupportedDType", "A dtype the bridge's device does not hold (see backend_info()['dtypes']).")
AllocationStillInUse = _kind("AllocationStillInUse", "Copies, compute steps or views still use the allocation or range.")
Backpressure = _kind("Backpressure", "No room: the host ring or the in-flight copy budget is full.")
Unavailable = _kind("Unavailable", "The backend (or a library it needs) is not available here.")
Unsupported = _kind("Unsupported", "The backend or consumer cannot do what was asked.")
Closed = _kind("Closed", "The bridge (or the view) is closed.")
Broken = _kind("Broken", "A fatal backend failure; every call fails until restart().")

# In the contract's order (checked against the C++ list at import).
ERROR_CLASSES: tuple[type[BridgeError], ...] = tuple(_defined)

__all__ = ["BridgeError"] + [cls.__name__ for cls in ERROR_CLASSES]
