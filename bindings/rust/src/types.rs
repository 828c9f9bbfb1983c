use std::ffi::CStr;
use std::os::raw::c_char;

use crate::error::{Error, ErrorKind, Result};
use crate::sys;

/// Element types (DEVBRIDGE_DTYPE_*), in the ABI's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    Bool,
    Int8,
    Int16,
    Int32,
    Int64,
    UInt8,
    UInt16,
    UInt32,
    UInt64,
    Float16,
    BFloat16,
    Float32,
    Float64,
    Fp8E4M3,
    Fp8E5M2,
}

impl Dtype {
    pub const ALL: [Dtype; sys::DEVBRIDGE_DTYPE_COUNT as usize] = [
        Dtype::Bool,
        Dtype::Int8,
        Dtype::Int16,
        Dtype::Int32,
        Dtype::Int64,
        Dtype::UInt8,
        Dtype::UInt16,
        Dtype::UInt32,
        Dtype::UInt64,
        Dtype::Float16,
        Dtype::BFloat16,
        Dtype::Float32,
        Dtype::Float64,
        Dtype::Fp8E4M3,
        Dtype::Fp8E5M2,
    ];

    #[inline]
    pub fn to_c(self) -> sys::devbridge_dtype {
        self as sys::devbridge_dtype
    }

    pub fn from_c(value: sys::devbridge_dtype) -> Option<Dtype> {
        usize::try_from(value).ok().and_then(|index| Dtype::ALL.get(index).copied())
    }

    /// The numpy/tinygrad name ("float32"), the library's.
    pub fn name(self) -> &'static str {
        // SAFETY: static storage; never NULL for a valid dtype.
        unsafe { static_text(sys::devbridge_dtype_name(self.to_c())) }
    }

    pub fn size_bytes(self) -> u32 {
        unsafe { sys::devbridge_dtype_size(self.to_c()) }
    }

    /// The dtypes whose bit is set in a devbridge_device_info mask.
    pub(crate) fn from_mask(mask: u64) -> Vec<Dtype> {
        Dtype::ALL.iter().copied().filter(|d| mask & (1u64 << d.to_c()) != 0).collect()
    }
}

/// # Safety
/// `text` is NULL or NUL-terminated static storage.
pub(crate) unsafe fn static_text(text: *const c_char) -> &'static str {
    if text.is_null() {
        return "";
    }
    CStr::from_ptr(text).to_str().unwrap_or("")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ShapeKind {
    Scalar,
    Vector,
    Matrix,
    Tensor,
}

impl ShapeKind {
    /// The kind for a tensor of `rank` dimensions.
    pub fn of_rank(rank: usize) -> ShapeKind {
        match rank {
            0 => ShapeKind::Scalar,
            1 => ShapeKind::Vector,
            2 => ShapeKind::Matrix,
            _ => ShapeKind::Tensor,
        }
    }

    #[inline]
    fn to_c(self) -> sys::devbridge_shape_kind {
        match self {
            ShapeKind::Scalar => sys::DEVBRIDGE_SHAPE_SCALAR,
            ShapeKind::Vector => sys::DEVBRIDGE_SHAPE_VECTOR,
            ShapeKind::Matrix => sys::DEVBRIDGE_SHAPE_MATRIX,
            ShapeKind::Tensor => sys::DEVBRIDGE_SHAPE_TENSOR,
        }
    }
}

/// What an allocation is for; the bridge checks extents and views against it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ObjectSpec {
    pub max_extent: u64,
    pub alignment: u64,
    /// None: untyped bytes.
    pub dtype: Option<Dtype>,
    pub shape: ShapeKind,
}

impl ObjectSpec {
    #[inline]
    pub(crate) fn to_c(&self) -> sys::devbridge_object_spec {
        let mut spec: sys::devbridge_object_spec = sys::sized();
        spec.max_extent = self.max_extent;
        spec.alignment = self.alignment;
        spec.dtype = self.dtype.map_or(sys::DEVBRIDGE_DTYPE_BYTES, Dtype::to_c);
        spec.shape = self.shape.to_c();
        spec
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyMode {
    /// The call returns once the bytes have moved.
    Sync,
    /// The call returns an event; the bytes have moved once it completes.
    Async,
}

impl CopyMode {
    #[inline]
    pub(crate) fn to_c(self) -> sys::devbridge_copy_mode {
        match self {
            CopyMode::Sync => sys::DEVBRIDGE_COPY_SYNC,
            CopyMode::Async => sys::DEVBRIDGE_COPY_ASYNC,
        }
    }
}

/// A device allocation's identity: plain numbers (domain, generation, id),
/// no pointer, so it can outlive its bridge harmlessly; the library refuses
/// it on another bridge (ForeignDomain) or after a restart
/// (OldGenerationHandle).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct DeviceHandle(pub(crate) sys::devbridge_handle);

impl DeviceHandle {
    #[inline]
    pub fn domain(&self) -> u64 {
        self.0.domain
    }
    #[inline]
    pub fn generation(&self) -> u64 {
        self.0.generation
    }
    #[inline]
    pub fn id(&self) -> u64 {
        self.0.id
    }
}

/// A copy's identity; plain numbers like DeviceHandle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CopyEvent(pub(crate) sys::devbridge_event);

impl CopyEvent {
    #[inline]
    pub fn generation(&self) -> u64 {
        self.0.generation
    }
}

// The identity triples carry no Eq in sys (they are the C structs); the
// wrappers compare their numbers.
macro_rules! identity_eq {
    ($($c:ty),*) => {$(
        impl PartialEq for $c {
            fn eq(&self, other: &Self) -> bool {
                (self.domain, self.generation, self.id) == (other.domain, other.generation, other.id)
            }
        }
        impl Eq for $c {}
        impl std::hash::Hash for $c {
            fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
                (self.domain, self.generation, self.id).hash(state)
            }
        }
    )*};
}
identity_eq!(sys::devbridge_handle, sys::devbridge_event);

/// Bytes [offset, offset + len) of the bridge's host ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HostRange {
    pub offset: u64,
    pub len: u64,
}

impl HostRange {
    #[inline]
    pub(crate) fn to_c(self) -> sys::devbridge_host_range {
        sys::devbridge_host_range { offset: self.offset, len: self.len }
    }
}

/// Bytes [offset, offset + len) of a device allocation.
///
/// Laid out as the C struct (repr(C), the handle transparent), so a copy's
/// argument is built with the same moves the C caller's is: field by field,
/// the compiler split it differently from how it reloaded it, and the
/// stalled store forwarding cost a sync upload about 7 ns
/// (examples/overhead.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(C)]
pub struct DeviceRange {
    pub handle: DeviceHandle,
    pub offset: u64,
    pub len: u64,
}

impl DeviceRange {
    #[inline]
    pub(crate) fn to_c(self) -> sys::devbridge_device_range {
        const _: () = assert!(
            std::mem::size_of::<DeviceRange>() == std::mem::size_of::<sys::devbridge_device_range>()
                && std::mem::align_of::<DeviceRange>() == std::mem::align_of::<sys::devbridge_device_range>()
        );
        // SAFETY: the same fields in the same order, repr(C) both (the
        // handle is repr(transparent) over the C triple), sizes checked above.
        unsafe { std::mem::transmute::<DeviceRange, sys::devbridge_device_range>(self) }
    }
}

/// Where a copy stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CopyOutcome {
    Pending,
    Completed,
    /// The copy's own kind and message.
    Failed(Error),
}

/// How a view is cut from an allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ViewSpec {
    pub dtype: Dtype,
    pub shape: Vec<i64>,
    /// In elements; None: row-major contiguous.
    pub strides: Option<Vec<i64>>,
    pub byte_offset: u64,
    /// Wait for copies into the allocation still in flight, rather than
    /// being refused (AllocationStillInUse).
    pub wait_in_flight: bool,
}

impl ViewSpec {
    /// A contiguous row-major view of `shape` at offset 0.
    pub fn contiguous(dtype: Dtype, shape: &[i64]) -> ViewSpec {
        ViewSpec { dtype, shape: shape.to_vec(), strides: None, byte_offset: 0, wait_in_flight: false }
    }

    /// The C struct; it points into `self`, so it lives no longer.
    #[inline]
    pub(crate) fn to_c(&self) -> Result<sys::devbridge_view_spec> {
        if let Some(strides) = &self.strides {
            if strides.len() != self.shape.len() {
                return Err(Error::new(
                    ErrorKind::InvalidTensorView,
                    format!("{} strides for {} dimensions", strides.len(), self.shape.len()),
                ));
            }
        }
        let mut spec: sys::devbridge_view_spec = sys::sized();
        spec.dtype = self.dtype.to_c();
        // Out of i32's range: passed as -1, which the library refuses with
        // its own message.
        spec.ndim = i32::try_from(self.shape.len()).unwrap_or(-1);
        spec.shape = self.shape.as_ptr();
        spec.strides = self.strides.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
        spec.byte_offset = self.byte_offset;
        spec.wait = if self.wait_in_flight { sys::DEVBRIDGE_VIEW_WAIT_IN_FLIGHT } else { sys::DEVBRIDGE_VIEW_REFUSE_IN_FLIGHT };
        Ok(spec)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    Cpu,
    Cuda,
    OpenCl,
    /// A kind a newer library reports.
    Other(i32),
}

/// One device a backend can bind (devbridge_device_info).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub backend: String,
    pub vendor: String,
    /// What `DeviceBridge::open` takes as `device`.
    pub device_id: String,
    pub device_name: String,
    /// None where the driver reports none (the host and fake backends).
    pub pci_bus_id: Option<String>,
    pub tinygrad_device: String,
    pub device_kind: DeviceKind,
    pub device_ordinal: i32,
    pub dlpack_device_type: i32,
    pub host_addressable: bool,
    pub total_memory: u64,
    pub free_memory: u64,
    pub held_dtypes: Vec<Dtype>,
    pub compute_dtypes: Vec<Dtype>,
}

fn fixed_text(text: &[c_char]) -> String {
    let bytes: Vec<u8> = text.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

impl DeviceInfo {
    pub(crate) fn from_c(info: &sys::devbridge_device_info) -> DeviceInfo {
        let pci_bus_id = fixed_text(&info.pci_bus_id);
        DeviceInfo {
            backend: fixed_text(&info.backend),
            vendor: fixed_text(&info.vendor),
            device_id: fixed_text(&info.device_id),
            device_name: fixed_text(&info.device_name),
            pci_bus_id: if pci_bus_id.is_empty() { None } else { Some(pci_bus_id) },
            tinygrad_device: fixed_text(&info.tinygrad_device),
            device_kind: match info.device_kind {
                sys::DEVBRIDGE_DEVICE_CPU => DeviceKind::Cpu,
                sys::DEVBRIDGE_DEVICE_CUDA => DeviceKind::Cuda,
                sys::DEVBRIDGE_DEVICE_OPENCL => DeviceKind::OpenCl,
                other => DeviceKind::Other(other),
            },
            device_ordinal: info.device_ordinal,
            dlpack_device_type: info.dlpack_device_type,
            host_addressable: info.host_addressable != 0,
            total_memory: info.total_memory,
            free_memory: info.free_memory,
            held_dtypes: Dtype::from_mask(info.held_dtypes),
            compute_dtypes: Dtype::from_mask(info.compute_dtypes),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WritesUnderView {
    /// AllocationStillInUse (the default).
    Refuse,
    /// Wait for the views to end.
    Wait,
    /// Copy anyway.
    Allow,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CachingPool {
    BackendDefault,
    On,
    Off,
}

/// How to open a bridge; `Default` is the library's defaults throughout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenOptions {
    /// Backend options as text (docs/BACKENDS.md lists each backend's).
    pub backend_options: Vec<(String, String)>,
    /// 0: 1.
    pub generation: u64,
    /// 0: 64 MiB.
    pub ring_bytes: u64,
    /// 0: the ring's size.
    pub inflight_budget_bytes: u64,
    /// 0: 1024.
    pub failed_record_limit: u64,
    /// 0: the backend's default.
    pub pool_cap_bytes: u64,
    /// For WritesUnderView::Wait; 0: forever.
    pub writes_under_view_timeout_ns: i64,
    /// 0: 10 s.
    pub close_fence_timeout_ns: i64,
    pub writes_under_view: WritesUnderView,
    pub caching_pool: CachingPool,
}

impl Default for OpenOptions {
    fn default() -> OpenOptions {
        OpenOptions {
            backend_options: Vec::new(),
            generation: 0,
            ring_bytes: 0,
            inflight_budget_bytes: 0,
            failed_record_limit: 0,
            pool_cap_bytes: 0,
            writes_under_view_timeout_ns: 0,
            close_fence_timeout_ns: 0,
            writes_under_view: WritesUnderView::Refuse,
            caching_pool: CachingPool::BackendDefault,
        }
    }
}

/// The fake backend's calls a failure can be injected into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FakeCall {
    Allocate = sys::DEVBRIDGE_FAKE_CALL_ALLOCATE as isize,
    Free = sys::DEVBRIDGE_FAKE_CALL_FREE as isize,
    AllocateHost = sys::DEVBRIDGE_FAKE_CALL_ALLOCATE_HOST as isize,
    FreeHost = sys::DEVBRIDGE_FAKE_CALL_FREE_HOST as isize,
    CopyHostToDevice = sys::DEVBRIDGE_FAKE_CALL_COPY_HOST_TO_DEVICE as isize,
    CopyDeviceToHost = sys::DEVBRIDGE_FAKE_CALL_COPY_DEVICE_TO_HOST as isize,
    Launch = sys::DEVBRIDGE_FAKE_CALL_LAUNCH as isize,
    ValidateView = sys::DEVBRIDGE_FAKE_CALL_VALIDATE_VIEW as isize,
    Quiesce = sys::DEVBRIDGE_FAKE_CALL_QUIESCE as isize,
    RegisterHost = sys::DEVBRIDGE_FAKE_CALL_REGISTER_HOST as isize,
    UnregisterHost = sys::DEVBRIDGE_FAKE_CALL_UNREGISTER_HOST as isize,
}

/// The failures the fake backend can inject.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FakeFailure {
    Allocation = sys::DEVBRIDGE_FAKE_FAIL_ALLOCATION as isize,
    CopyAtSubmit = sys::DEVBRIDGE_FAKE_FAIL_COPY_AT_SUBMIT as isize,
    CopyAtCompletion = sys::DEVBRIDGE_FAKE_FAIL_COPY_AT_COMPLETION as isize,
    InvalidView = sys::DEVBRIDGE_FAKE_FAIL_INVALID_VIEW as isize,
    LostCompletion = sys::DEVBRIDGE_FAKE_FAIL_LOST_COMPLETION as isize,
    DuplicatedCompletion = sys::DEVBRIDGE_FAKE_FAIL_DUPLICATED_COMPLETION as isize,
    LateCompletion = sys::DEVBRIDGE_FAKE_FAIL_LATE_COMPLETION as isize,
    Fatal = sys::DEVBRIDGE_FAKE_FAIL_FATAL as isize,
}
