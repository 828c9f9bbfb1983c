use std::ffi::CStr;
use std::fmt;

use crate::sys;

/// What went wrong: exactly the C ABI's status kinds (DEVBRIDGE_ERROR_*).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    AllocationFailed,
    DeviceCopyFailed,
    OutputCopyFailed,
    InvalidExtent,
    InvalidAlignment,
    InvalidRange,
    UnknownDeviceHandle,
    OldGenerationHandle,
    ForeignDomain,
    InvalidViewDType,
    InvalidTensorView,
    UnsupportedDType,
    AllocationStillInUse,
    Backpressure,
    Unavailable,
    Unsupported,
    Closed,
    Broken,
}

impl ErrorKind {
    /// The kind of a failed status; None for DEVBRIDGE_OK and for a value
    /// this crate does not know (a newer library's).
    pub fn from_status(status: sys::devbridge_status) -> Option<ErrorKind> {
        use ErrorKind::*;
        Some(match status {
            sys::DEVBRIDGE_ERROR_ALLOCATION_FAILED => AllocationFailed,
            sys::DEVBRIDGE_ERROR_DEVICE_COPY_FAILED => DeviceCopyFailed,
            sys::DEVBRIDGE_ERROR_OUTPUT_COPY_FAILED => OutputCopyFailed,
            sys::DEVBRIDGE_ERROR_INVALID_EXTENT => InvalidExtent,
            sys::DEVBRIDGE_ERROR_INVALID_ALIGNMENT => InvalidAlignment,
            sys::DEVBRIDGE_ERROR_INVALID_RANGE => InvalidRange,
            sys::DEVBRIDGE_ERROR_UNKNOWN_DEVICE_HANDLE => UnknownDeviceHandle,
            sys::DEVBRIDGE_ERROR_OLD_GENERATION_HANDLE => OldGenerationHandle,
            sys::DEVBRIDGE_ERROR_FOREIGN_DOMAIN => ForeignDomain,
            sys::DEVBRIDGE_ERROR_INVALID_VIEW_DTYPE => InvalidViewDType,
            sys::DEVBRIDGE_ERROR_INVALID_TENSOR_VIEW => InvalidTensorView,
            sys::DEVBRIDGE_ERROR_UNSUPPORTED_DTYPE => UnsupportedDType,
            sys::DEVBRIDGE_ERROR_ALLOCATION_STILL_IN_USE => AllocationStillInUse,
            sys::DEVBRIDGE_ERROR_BACKPRESSURE => Backpressure,
            sys::DEVBRIDGE_ERROR_UNAVAILABLE => Unavailable,
            sys::DEVBRIDGE_ERROR_UNSUPPORTED => Unsupported,
            sys::DEVBRIDGE_ERROR_CLOSED => Closed,
            sys::DEVBRIDGE_ERROR_BROKEN => Broken,
            _ => return None,
        })
    }

    /// The contract's name ("InvalidRange"), as the library spells it.
    pub fn name(self) -> &'static str {
        // The enum's order is the status order, one up from OK.
        let status = self as sys::devbridge_status + 1;
        // SAFETY: the library returns static storage or NULL.
        let name = unsafe { sys::devbridge_status_name(status) };
        if name.is_null() {
            return "unknown";
        }
        unsafe { CStr::from_ptr(name) }.to_str().unwrap_or("unknown")
    }
}

/// A failed call: its kind and the message the library left for this
/// thread (devbridge_last_error_message), captured at once so it cannot be
/// overwritten by a later call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

impl Error {
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// An error this crate raises itself, before calling the library.
    #[cold]
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error { kind, message: message.into() }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.name(), self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// The one conversion of a status into a Result. Call it right after the
/// call that returned `status`, on the same thread: the message is
/// thread-local and the next failing call replaces it.
///
/// Inlined so that the success path is one compare in the caller: out of
/// line it cost a call and a frame on every operation (about 23
/// instructions, measured with callgrind by examples/overhead.rs).
#[inline(always)]
pub(crate) fn check(status: sys::devbridge_status) -> Result<()> {
    if status == sys::DEVBRIDGE_OK {
        Ok(())
    } else {
        Err(failure(status))
    }
}

#[cold]
#[inline(never)]
fn failure(status: sys::devbridge_status) -> Error {
    // SAFETY: never NULL; valid until the next failing call on this thread.
    let message = unsafe { CStr::from_ptr(sys::devbridge_last_error_message()) }.to_string_lossy().into_owned();
    match ErrorKind::from_status(status) {
        Some(kind) => Error { kind, message },
        // A newer library's kind: nothing this crate can promise about the
        // state behind it, so it reads as Broken (restart), named.
        None => Error { kind: ErrorKind::Broken, message: format!("unknown status {}: {}", status, message) },
    }
}
