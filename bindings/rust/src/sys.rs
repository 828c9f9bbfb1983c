//! The C ABI of include/devbridge/c/devbridge.h, written by hand.
//!
//! Nothing here is generated, so the layout test (`tests` below, fed by
//! build.rs's probe of the real header) is what keeps it honest: every
//! struct's size, every field's offset and size, every constant's value and
//! every declared `devbridge_*` function are compared with the C compiler's
//! view of the header.
#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int, c_void};

pub type devbridge_status = i32;
pub type devbridge_dtype = i32;
pub type devbridge_shape_kind = i32;
pub type devbridge_copy_direction = i32;
pub type devbridge_copy_mode = i32;
pub type devbridge_host_kind = i32;
pub type devbridge_copy_state = i32;
pub type devbridge_writes_under_view = i32;
pub type devbridge_caching_pool = i32;
pub type devbridge_view_wait = i32;
pub type devbridge_device_kind = i32;
pub type devbridge_fake_call = i32;
pub type devbridge_fake_failure = i32;

// Defines the constants and, for the layout test, the list of them.
macro_rules! c_consts {
    ($($name:ident : $ty:ty = $value:expr;)*) => {
        $(pub const $name: $ty = $value;)*

        #[cfg(test)]
        pub(crate) fn rust_constants() -> Vec<(&'static str, i64)> {
            vec![$((stringify!($name), $name as i64),)*]
        }
    };
}

c_consts! {
    DEVBRIDGE_ABI_VERSION_MAJOR: u32 = 1;
    DEVBRIDGE_ABI_VERSION_MINOR: u32 = 1;
    DEVBRIDGE_ABI_VERSION: u32 = (DEVBRIDGE_ABI_VERSION_MAJOR << 16) | DEVBRIDGE_ABI_VERSION_MINOR;

    DEVBRIDGE_OK: devbridge_status = 0;
    DEVBRIDGE_ERROR_ALLOCATION_FAILED: devbridge_status = 1;
    DEVBRIDGE_ERROR_DEVICE_COPY_FAILED: devbridge_status = 2;
    DEVBRIDGE_ERROR_OUTPUT_COPY_FAILED: devbridge_status = 3;
    DEVBRIDGE_ERROR_INVALID_EXTENT: devbridge_status = 4;
    DEVBRIDGE_ERROR_INVALID_ALIGNMENT: devbridge_status = 5;
    DEVBRIDGE_ERROR_INVALID_RANGE: devbridge_status = 6;
    DEVBRIDGE_ERROR_UNKNOWN_DEVICE_HANDLE: devbridge_status = 7;
    DEVBRIDGE_ERROR_OLD_GENERATION_HANDLE: devbridge_status = 8;
    DEVBRIDGE_ERROR_FOREIGN_DOMAIN: devbridge_status = 9;
    DEVBRIDGE_ERROR_INVALID_VIEW_DTYPE: devbridge_status = 10;
    DEVBRIDGE_ERROR_INVALID_TENSOR_VIEW: devbridge_status = 11;
    DEVBRIDGE_ERROR_UNSUPPORTED_DTYPE: devbridge_status = 12;
    DEVBRIDGE_ERROR_ALLOCATION_STILL_IN_USE: devbridge_status = 13;
    DEVBRIDGE_ERROR_BACKPRESSURE: devbridge_status = 14;
    DEVBRIDGE_ERROR_UNAVAILABLE: devbridge_status = 15;
    DEVBRIDGE_ERROR_UNSUPPORTED: devbridge_status = 16;
    DEVBRIDGE_ERROR_CLOSED: devbridge_status = 17;
    DEVBRIDGE_ERROR_BROKEN: devbridge_status = 18;

    DEVBRIDGE_DTYPE_BYTES: devbridge_dtype = -1;
    DEVBRIDGE_DTYPE_BOOL: devbridge_dtype = 0;
    DEVBRIDGE_DTYPE_INT8: devbridge_dtype = 1;
    DEVBRIDGE_DTYPE_INT16: devbridge_dtype = 2;
    DEVBRIDGE_DTYPE_INT32: devbridge_dtype = 3;
    DEVBRIDGE_DTYPE_INT64: devbridge_dtype = 4;
    DEVBRIDGE_DTYPE_UINT8: devbridge_dtype = 5;
    DEVBRIDGE_DTYPE_UINT16: devbridge_dtype = 6;
    DEVBRIDGE_DTYPE_UINT32: devbridge_dtype = 7;
    DEVBRIDGE_DTYPE_UINT64: devbridge_dtype = 8;
    DEVBRIDGE_DTYPE_FLOAT16: devbridge_dtype = 9;
    DEVBRIDGE_DTYPE_BFLOAT16: devbridge_dtype = 10;
    DEVBRIDGE_DTYPE_FLOAT32: devbridge_dtype = 11;
    DEVBRIDGE_DTYPE_FLOAT64: devbridge_dtype = 12;
    DEVBRIDGE_DTYPE_FP8E4M3: devbridge_dtype = 13;
    DEVBRIDGE_DTYPE_FP8E5M2: devbridge_dtype = 14;
    DEVBRIDGE_DTYPE_COUNT: devbridge_dtype = 15;

    DEVBRIDGE_SHAPE_SCALAR: devbridge_shape_kind = 0;
    DEVBRIDGE_SHAPE_VECTOR: devbridge_shape_kind = 1;
    DEVBRIDGE_SHAPE_MATRIX: devbridge_shape_kind = 2;
    DEVBRIDGE_SHAPE_TENSOR: devbridge_shape_kind = 3;

    DEVBRIDGE_HOST_TO_DEVICE: devbridge_copy_direction = 0;
    DEVBRIDGE_DEVICE_TO_HOST: devbridge_copy_direction = 1;

    DEVBRIDGE_COPY_SYNC: devbridge_copy_mode = 0;
    DEVBRIDGE_COPY_ASYNC: devbridge_copy_mode = 1;

    DEVBRIDGE_HOST_RING: devbridge_host_kind = 0;
    DEVBRIDGE_HOST_REGION: devbridge_host_kind = 1;

    DEVBRIDGE_COPY_PENDING: devbridge_copy_state = 0;
    DEVBRIDGE_COPY_COMPLETED: devbridge_copy_state = 1;
    DEVBRIDGE_COPY_FAILED: devbridge_copy_state = 2;

    DEVBRIDGE_WRITES_UNDER_VIEW_REFUSE: devbridge_writes_under_view = 0;
    DEVBRIDGE_WRITES_UNDER_VIEW_WAIT: devbridge_writes_under_view = 1;
    DEVBRIDGE_WRITES_UNDER_VIEW_ALLOW: devbridge_writes_under_view = 2;

    DEVBRIDGE_CACHING_POOL_BACKEND_DEFAULT: devbridge_caching_pool = 0;
    DEVBRIDGE_CACHING_POOL_ON: devbridge_caching_pool = 1;
    DEVBRIDGE_CACHING_POOL_OFF: devbridge_caching_pool = 2;

    DEVBRIDGE_VIEW_REFUSE_IN_FLIGHT: devbridge_view_wait = 0;
    DEVBRIDGE_VIEW_WAIT_IN_FLIGHT: devbridge_view_wait = 1;

    DEVBRIDGE_DEVICE_CPU: devbridge_device_kind = 0;
    DEVBRIDGE_DEVICE_CUDA: devbridge_device_kind = 1;
    DEVBRIDGE_DEVICE_OPENCL: devbridge_device_kind = 2;

    DEVBRIDGE_WAIT_FOREVER: i64 = i64::MAX;

    DEVBRIDGE_DLPACK_FLAG_READ_ONLY: u64 = 1;

    DEVBRIDGE_FAKE_CALL_ALLOCATE: devbridge_fake_call = 0;
    DEVBRIDGE_FAKE_CALL_FREE: devbridge_fake_call = 1;
    DEVBRIDGE_FAKE_CALL_ALLOCATE_HOST: devbridge_fake_call = 2;
    DEVBRIDGE_FAKE_CALL_FREE_HOST: devbridge_fake_call = 3;
    DEVBRIDGE_FAKE_CALL_COPY_HOST_TO_DEVICE: devbridge_fake_call = 4;
    DEVBRIDGE_FAKE_CALL_COPY_DEVICE_TO_HOST: devbridge_fake_call = 5;
    DEVBRIDGE_FAKE_CALL_LAUNCH: devbridge_fake_call = 6;
    DEVBRIDGE_FAKE_CALL_VALIDATE_VIEW: devbridge_fake_call = 7;
    DEVBRIDGE_FAKE_CALL_QUIESCE: devbridge_fake_call = 8;
    DEVBRIDGE_FAKE_CALL_REGISTER_HOST: devbridge_fake_call = 9;
    DEVBRIDGE_FAKE_CALL_UNREGISTER_HOST: devbridge_fake_call = 10;

    DEVBRIDGE_FAKE_FAIL_ALLOCATION: devbridge_fake_failure = 0;
    DEVBRIDGE_FAKE_FAIL_COPY_AT_SUBMIT: devbridge_fake_failure = 1;
    DEVBRIDGE_FAKE_FAIL_COPY_AT_COMPLETION: devbridge_fake_failure = 2;
    DEVBRIDGE_FAKE_FAIL_INVALID_VIEW: devbridge_fake_failure = 3;
    DEVBRIDGE_FAKE_FAIL_LOST_COMPLETION: devbridge_fake_failure = 4;
    DEVBRIDGE_FAKE_FAIL_DUPLICATED_COMPLETION: devbridge_fake_failure = 5;
    DEVBRIDGE_FAKE_FAIL_LATE_COMPLETION: devbridge_fake_failure = 6;
    DEVBRIDGE_FAKE_FAIL_FATAL: devbridge_fake_failure = 7;
}

/// Structs with `size` first: the ABI's way of growing them at the end.
/// [`sized`] is the one place that initialises them.
///
/// # Safety
///
/// An all-zero value of the type must be valid (integers, raw pointers,
/// `Option<fn>` and arrays of those: no references, no `NonNull`, no enums
/// without a zero variant): [`sized`] makes one. Unsafe to implement, so
/// safe code cannot make `sized` produce an invalid value (a null
/// reference); only this crate's `c_structs!` implements it:
///
/// ```compile_fail
/// #[derive(Clone, Copy)]
/// struct Holds(&'static u64);
/// impl devbridge::sys::SizeFirst for Holds { // error: an unsafe trait needs `unsafe impl`
///     fn set_size(&mut self, _: u64) {}
/// }
/// ```
pub unsafe trait SizeFirst: Copy {
    fn set_size(&mut self, size: u64);
}

/// A zeroed struct with `size` set: "0: default" everywhere else.
#[inline]
pub fn sized<T: SizeFirst>() -> T {
    // SAFETY: SizeFirst's contract: zero is a valid value of T.
    let mut value: T = unsafe { std::mem::MaybeUninit::zeroed().assume_init() };
    value.set_size(std::mem::size_of::<T>() as u64);
    value
}

// Defines #[repr(C)] structs and, for the layout test, the list of their
// fields with offsets and sizes (computed without offset_of!, which is newer
// than the oldest toolchain this crate builds with).
macro_rules! c_structs {
    ($( $(#[$size_first:ident])? pub struct $name:ident { $(pub $field:ident : $ty:ty,)* } )*) => {
        $(
            #[repr(C)]
            #[derive(Clone, Copy, Debug)]
            pub struct $name { $(pub $field: $ty,)* }
            $(c_structs!(@$size_first $name);)?
        )*

        #[cfg(test)]
        pub(crate) fn rust_layouts() -> Vec<(&'static str, usize, Vec<(&'static str, usize, usize)>)> {
            vec![$((
                stringify!($name),
                std::mem::size_of::<$name>(),
                vec![$((stringify!($field), field_offset!($name, $field), field_size!($name, $field)),)*],
            ),)*]
        }
    };
    (@size_first $name:ident) => {
        // SAFETY: the C ABI's structs hold integers, raw pointers, Option<fn> and arrays of those.
        unsafe impl SizeFirst for $name {
            fn set_size(&mut self, size: u64) { self.size = size; }
        }
    };
}

#[cfg(test)]
macro_rules! field_offset {
    ($ty:ty, $field:ident) => {{
        let value = std::mem::MaybeUninit::<$ty>::uninit();
        let base = value.as_ptr();
        // SAFETY: addr_of! takes the field's address without reading it.
        let field = unsafe { std::ptr::addr_of!((*base).$field) };
        field as usize - base as usize
    }};
}

#[cfg(test)]
macro_rules! field_size {
    ($ty:ty, $field:ident) => {{
        fn pointee_size<T>(_: *const T) -> usize {
            std::mem::size_of::<T>()
        }
        let value = std::mem::MaybeUninit::<$ty>::uninit();
        // SAFETY: as in field_offset!.
        pointee_size(unsafe { std::ptr::addr_of!((*value.as_ptr()).$field) })
    }};
}

pub type devbridge_region_released_fn = Option<unsafe extern "C" fn(user_data: *mut c_void)>;
pub type devbridge_dlpack_deleter = Option<unsafe extern "C" fn(this: *mut devbridge_dlpack_tensor)>;

/// Opaque: only ever behind a pointer.
#[repr(C)]
pub struct devbridge_bridge {
    _private: [u8; 0],
}

/// Opaque: only ever behind a pointer.
#[repr(C)]
pub struct devbridge_view_lease {
    _private: [u8; 0],
}

/// Opaque, library-owned: freed by devbridge_portable_free.
#[repr(C)]
pub struct devbridge_portable {
    _private: [u8; 0],
}

c_structs! {
    pub struct DLDevice {
        pub device_type: c_int,
        pub device_id: c_int,
    }
    pub struct DLDataType {
        pub code: u8,
        pub bits: u8,
        pub lanes: u16,
    }
    pub struct DLTensor {
        pub data: *mut c_void,
        pub device: DLDevice,
        pub ndim: c_int,
        pub dtype: DLDataType,
        pub shape: *mut i64,
        pub strides: *mut i64,
        pub byte_offset: u64,
    }
    pub struct devbridge_handle {
        pub domain: u64,
        pub generation: u64,
        pub id: u64,
    }
    pub struct devbridge_event {
        pub domain: u64,
        pub generation: u64,
        pub id: u64,
    }
    pub struct devbridge_region {
        pub domain: u64,
        pub generation: u64,
        pub id: u64,
    }
    pub struct devbridge_host_range {
        pub offset: u64,
        pub len: u64,
    }
    pub struct devbridge_region_range {
        pub region: devbridge_region,
        pub offset: u64,
        pub len: u64,
    }
    pub struct devbridge_device_range {
        pub handle: devbridge_handle,
        pub offset: u64,
        pub len: u64,
    }
    pub struct devbridge_backend_option {
        pub key: *const c_char,
        pub value: *const c_char,
    }
    #[size_first]
    pub struct devbridge_open_options {
        pub size: u64,
        pub backend: *const c_char,
        pub device: *const c_char,
        pub backend_options: *const devbridge_backend_option,
        pub backend_option_count: u64,
        pub generation: u64,
        pub ring_bytes: u64,
        pub inflight_budget_bytes: u64,
        pub failed_record_limit: u64,
        pub pool_cap_bytes: u64,
        pub writes_under_view_timeout_ns: i64,
        pub close_fence_timeout_ns: i64,
        pub writes_under_view: devbridge_writes_under_view,
        pub caching_pool: devbridge_caching_pool,
    }
    #[size_first]
    pub struct devbridge_device_info {
        pub size: u64,
        pub backend: [c_char; 32],
        pub vendor: [c_char; 64],
        pub device_id: [c_char; 64],
        pub device_name: [c_char; 256],
        pub pci_bus_id: [c_char; 32],
        pub tinygrad_device: [c_char; 32],
        pub device_kind: devbridge_device_kind,
        pub device_ordinal: i32,
        pub dlpack_device_type: i32,
        pub host_addressable: i32,
        pub total_memory: u64,
        pub free_memory: u64,
        pub held_dtypes: u64,
        pub compute_dtypes: u64,
    }
    #[size_first]
    pub struct devbridge_object_spec {
        pub size: u64,
        pub max_extent: u64,
        pub alignment: u64,
        pub dtype: devbridge_dtype,
        pub shape: devbridge_shape_kind,
    }
    #[size_first]
    pub struct devbridge_host_registration {
        pub size: u64,
        pub data: *mut c_void,
        pub len: u64,
        pub read_only: i32,
        pub reserved: i32,
        pub on_release: devbridge_region_released_fn,
        pub user_data: *mut c_void,
    }
    pub struct devbridge_layout {
        pub rows: u64,
        pub row_bytes: u64,
        pub host_pitch: u64,
        pub device_pitch: u64,
    }
    #[size_first]
    pub struct devbridge_copy_request {
        pub size: u64,
        pub direction: devbridge_copy_direction,
        pub mode: devbridge_copy_mode,
        pub host_kind: devbridge_host_kind,
        pub reserved: i32,
        pub ring: devbridge_host_range,
        pub region: devbridge_region_range,
        pub device: devbridge_device_range,
        pub layout: devbridge_layout,
        pub wait_for_room_ns: i64,
    }
    #[size_first]
    pub struct devbridge_copy_outcome {
        pub size: u64,
        pub state: devbridge_copy_state,
        pub error: devbridge_status,
    }
    #[size_first]
    pub struct devbridge_view_spec {
        pub size: u64,
        pub dtype: devbridge_dtype,
        pub ndim: i32,
        pub shape: *const i64,
        pub strides: *const i64,
        pub byte_offset: u64,
        pub wait: devbridge_view_wait,
        pub reserved: i32,
    }
    #[size_first]
    pub struct devbridge_view {
        pub size: u64,
        pub dl_tensor: DLTensor,
        pub handle: devbridge_handle,
        pub dtype: devbridge_dtype,
        pub read_only: i32,
        pub tinygrad_device: *const c_char,
        pub lease: *mut devbridge_view_lease,
    }
    pub struct devbridge_dlpack_version {
        pub major: u32,
        pub minor: u32,
    }
    pub struct devbridge_dlpack_tensor {
        pub version: devbridge_dlpack_version,
        pub manager_ctx: *mut c_void,
        pub deleter: devbridge_dlpack_deleter,
        pub flags: u64,
        pub dl_tensor: DLTensor,
    }
    #[size_first]
    pub struct devbridge_stats {
        pub size: u64,
        pub generation: u64,
        pub domain: u64,
        pub broken: u64,
        pub closed: u64,
        pub live_allocations: u64,
        pub allocated_bytes: u64,
        pub copies_submitted: u64,
        pub copies_completed: u64,
        pub copies_failed: u64,
        pub copies_in_flight: u64,
        pub inflight_bytes: u64,
        pub inflight_budget_bytes: u64,
        pub copy_records: u64,
        pub failed_records: u64,
        pub failed_records_evicted: u64,
        pub stale_completions: u64,
        pub live_views: u64,
        pub orphaned_allocations: u64,
        pub pending_fences: u64,
        pub abandoned_fences: u64,
        pub active_steps: u64,
        pub restarts: u64,
        pub host_regions: u64,
        pub host_region_bytes: u64,
        pub adopted_allocations: u64,
        pub adopted_bytes: u64,
        pub ring_capacity: u64,
        pub ring_used: u64,
        pub ring_reservations: u64,
        pub ring_releases_pending: u64,
        pub ring_wraps: u64,
    }
    #[size_first]
    pub struct devbridge_memory_stats {
        pub size: u64,
        pub pool_enabled: u64,
        pub pool_cap_bytes: u64,
        pub allocated_bytes: u64,
        pub peak_allocated_bytes: u64,
        pub total_allocated_bytes: u64,
        pub reserved_bytes: u64,
        pub peak_reserved_bytes: u64,
        pub total_reserved_bytes: u64,
        pub allocations: u64,
        pub total_allocations: u64,
        pub backend_allocations: u64,
        pub backend_frees: u64,
        pub segments: u64,
        pub free_segments: u64,
        pub pool_splits: u64,
        pub cached_bytes: u64,
        pub cached_blocks: u64,
        pub free_segment_bytes: u64,
        pub cache_hits: u64,
        pub cache_misses: u64,
        pub oom_retries: u64,
        pub oom_failures: u64,
        pub largest_request_bytes: u64,
        pub fragmentation_bytes: u64,
    }
    #[size_first]
    pub struct devbridge_portable_view {
        pub size: u64,
        pub dtype: devbridge_dtype,
        pub rank: u32,
        pub dims: *const i64,
        pub data: *const c_void,
        pub len: u64,
    }
    pub struct devbridge_checkpoint_entry {
        pub name: *const c_char,
        pub handle: devbridge_handle,
        pub dtype: devbridge_dtype,
        pub rank: u32,
        pub dims: *const i64,
    }
    pub struct devbridge_restored_tensor {
        pub name: *const c_char,
        pub handle: devbridge_handle,
        pub dtype: devbridge_dtype,
        pub rank: u32,
        pub dims: *const i64,
    }
    pub struct devbridge_restored {
        pub count: u64,
        pub tensors: *const devbridge_restored_tensor,
        pub generation: u64,
    }
    #[size_first]
    pub struct devbridge_restore_options {
        pub size: u64,
        pub names: *const *const c_char,
        pub name_count: u64,
        pub prefix: *const c_char,
        pub skip_checksum: i32,
        pub reserved: i32,
    }
}

extern "C" {
    pub fn devbridge_abi_version() -> u32;
    pub fn devbridge_last_error_message() -> *const c_char;
    pub fn devbridge_status_name(status: devbridge_status) -> *const c_char;

    pub fn devbridge_dtype_name(dtype: devbridge_dtype) -> *const c_char;
    pub fn devbridge_dtype_size(dtype: devbridge_dtype) -> u32;

    pub fn devbridge_open(options: *const devbridge_open_options, out_bridge: *mut *mut devbridge_bridge)
        -> devbridge_status;
    pub fn devbridge_close(bridge: *mut devbridge_bridge) -> devbridge_status;
    pub fn devbridge_destroy(bridge: *mut devbridge_bridge);
    pub fn devbridge_restart(bridge: *mut devbridge_bridge, generation: u64) -> devbridge_status;
    pub fn devbridge_generation(bridge: *mut devbridge_bridge, out_generation: *mut u64) -> devbridge_status;
    pub fn devbridge_domain(bridge: *mut devbridge_bridge, out_domain: *mut u64) -> devbridge_status;

    pub fn devbridge_backend_info(bridge: *mut devbridge_bridge, out_info: *mut devbridge_device_info)
        -> devbridge_status;
    pub fn devbridge_device_count(backend: *const c_char, out_count: *mut u64) -> devbridge_status;
    pub fn devbridge_device_at(backend: *const c_char, index: u64, out_info: *mut devbridge_device_info)
        -> devbridge_status;

    pub fn devbridge_alloc_device(
        bridge: *mut devbridge_bridge,
        spec: *const devbridge_object_spec,
        extent: u64,
        out_handle: *mut devbridge_handle,
    ) -> devbridge_status;
    pub fn devbridge_free_device(bridge: *mut devbridge_bridge, handle: devbridge_handle) -> devbridge_status;
    pub fn devbridge_release_device(bridge: *mut devbridge_bridge, handle: devbridge_handle) -> devbridge_status;
    pub fn devbridge_extent(bridge: *mut devbridge_bridge, handle: devbridge_handle, out_extent: *mut u64)
        -> devbridge_status;

    pub fn devbridge_reserve_host(
        bridge: *mut devbridge_bridge,
        bytes: u64,
        alignment: u64,
        timeout_ns: i64,
        out_range: *mut devbridge_host_range,
    ) -> devbridge_status;
    pub fn devbridge_release_host(bridge: *mut devbridge_bridge, range: devbridge_host_range) -> devbridge_status;
    pub fn devbridge_release_host_after(
        bridge: *mut devbridge_bridge,
        range: devbridge_host_range,
        event: devbridge_event,
    ) -> devbridge_status;
    pub fn devbridge_wait_for_release_after(
        bridge: *mut devbridge_bridge,
        timeout_ns: i64,
        out_released: *mut i32,
    ) -> devbridge_status;
    pub fn devbridge_host_bytes(
        bridge: *mut devbridge_bridge,
        range: devbridge_host_range,
        out_data: *mut *mut u8,
    ) -> devbridge_status;

    pub fn devbridge_register_host(
        bridge: *mut devbridge_bridge,
        registration: *const devbridge_host_registration,
        out_region: *mut devbridge_region,
    ) -> devbridge_status;
    pub fn devbridge_unregister_host(bridge: *mut devbridge_bridge, region: devbridge_region) -> devbridge_status;
    pub fn devbridge_region_retained(
        bridge: *mut devbridge_bridge,
        region: devbridge_region,
        out_retained: *mut i32,
    ) -> devbridge_status;
    pub fn devbridge_adopt_host(
        bridge: *mut devbridge_bridge,
        range: devbridge_region_range,
        spec: *const devbridge_object_spec,
        out_handle: *mut devbridge_handle,
    ) -> devbridge_status;

    pub fn devbridge_copy(
        bridge: *mut devbridge_bridge,
        request: *const devbridge_copy_request,
        out_event: *mut devbridge_event,
    ) -> devbridge_status;
    pub fn devbridge_host_to_device(
        bridge: *mut devbridge_bridge,
        host: devbridge_host_range,
        device: devbridge_device_range,
        mode: devbridge_copy_mode,
        out_event: *mut devbridge_event,
    ) -> devbridge_status;
    pub fn devbridge_device_to_host(
        bridge: *mut devbridge_bridge,
        device: devbridge_device_range,
        host: devbridge_host_range,
        mode: devbridge_copy_mode,
        out_event: *mut devbridge_event,
    ) -> devbridge_status;

    pub fn devbridge_wait(
        bridge: *mut devbridge_bridge,
        event: devbridge_event,
        timeout_ns: i64,
        out_outcome: *mut devbridge_copy_outcome,
    ) -> devbridge_status;
    pub fn devbridge_copy_status(
        bridge: *mut devbridge_bridge,
        event: devbridge_event,
        out_outcome: *mut devbridge_copy_outcome,
    ) -> devbridge_status;
    pub fn devbridge_poll(bridge: *mut devbridge_bridge, out_applied: *mut u64) -> devbridge_status;
    pub fn devbridge_safe_to_release_host(
        bridge: *mut devbridge_bridge,
        event: devbridge_event,
        out_safe: *mut i32,
    ) -> devbridge_status;
    pub fn devbridge_host_bytes_valid(
        bridge: *mut devbridge_bridge,
        event: devbridge_event,
        out_valid: *mut i32,
    ) -> devbridge_status;
    pub fn devbridge_copy_event_complete(
        bridge: *mut devbridge_bridge,
        event: devbridge_event,
        out_complete: *mut i32,
    ) -> devbridge_status;

    pub fn devbridge_begin_step(
        bridge: *mut devbridge_bridge,
        step: u64,
        handles: *const devbridge_handle,
        handle_count: u64,
    ) -> devbridge_status;
    pub fn devbridge_end_step(bridge: *mut devbridge_bridge, step: u64) -> devbridge_status;
    pub fn devbridge_end_step_after(bridge: *mut devbridge_bridge, step: u64, consumer_queue: usize)
        -> devbridge_status;
    pub fn devbridge_launch_axpy(
        bridge: *mut devbridge_bridge,
        x: devbridge_device_range,
        y: devbridge_device_range,
        a: f32,
        b: f32,
    ) -> devbridge_status;

    pub fn devbridge_view_open(
        bridge: *mut devbridge_bridge,
        handle: devbridge_handle,
        spec: *const devbridge_view_spec,
        out_view: *mut devbridge_view,
    ) -> devbridge_status;
    pub fn devbridge_view_end(view: *mut devbridge_view) -> devbridge_status;
    pub fn devbridge_view_end_after(view: *mut devbridge_view, consumer_queue: usize) -> devbridge_status;
    pub fn devbridge_export_dlpack(
        bridge: *mut devbridge_bridge,
        handle: devbridge_handle,
        spec: *const devbridge_view_spec,
        out_tensor: *mut *mut devbridge_dlpack_tensor,
    ) -> devbridge_status;

    pub fn devbridge_get_stats(bridge: *mut devbridge_bridge, out_stats: *mut devbridge_stats) -> devbridge_status;
    pub fn devbridge_get_memory_stats(bridge: *mut devbridge_bridge, out_stats: *mut devbridge_memory_stats)
        -> devbridge_status;
    pub fn devbridge_reset_peak_memory(bridge: *mut devbridge_bridge) -> devbridge_status;
    pub fn devbridge_empty_cache(bridge: *mut devbridge_bridge) -> devbridge_status;

    pub fn devbridge_fake_inject(
        bridge: *mut devbridge_bridge,
        call: devbridge_fake_call,
        failure: devbridge_fake_failure,
        nth: i32,
    ) -> devbridge_status;
    pub fn devbridge_fake_set_auto_complete(bridge: *mut devbridge_bridge, on: i32) -> devbridge_status;
    pub fn devbridge_fake_complete_all(bridge: *mut devbridge_bridge, ok: i32, out_completed: *mut u64)
        -> devbridge_status;
    pub fn devbridge_test_live_allocations(bridge: *mut devbridge_bridge, out_count: *mut u64) -> devbridge_status;
    pub fn devbridge_test_hold_copies(bridge: *mut devbridge_bridge, hold: i32) -> devbridge_status;

    pub fn devbridge_export_tensor(
        bridge: *mut devbridge_bridge,
        handle: devbridge_handle,
        dtype: devbridge_dtype,
        dims: *const i64,
        rank: u32,
        offset: u64,
        out_tensor: *mut *mut devbridge_portable,
    ) -> devbridge_status;
    pub fn devbridge_portable_describe(
        tensor: *const devbridge_portable,
        out_view: *mut devbridge_portable_view,
    ) -> devbridge_status;
    pub fn devbridge_portable_free(tensor: *mut devbridge_portable);
    pub fn devbridge_import_tensor(
        bridge: *mut devbridge_bridge,
        tensor: *const devbridge_portable_view,
        spec: *const devbridge_object_spec,
        out_handle: *mut devbridge_handle,
    ) -> devbridge_status;

    pub fn devbridge_checkpoint(
        bridge: *mut devbridge_bridge,
        path: *const c_char,
        entries: *const devbridge_checkpoint_entry,
        count: u64,
        generation: u64,
    ) -> devbridge_status;
    pub fn devbridge_restore(
        bridge: *mut devbridge_bridge,
        path: *const c_char,
        out_restored: *mut *mut devbridge_restored,
    ) -> devbridge_status;
    pub fn devbridge_restore_selected(
        bridge: *mut devbridge_bridge,
        path: *const c_char,
        options: *const devbridge_restore_options,
        out_restored: *mut *mut devbridge_restored,
    ) -> devbridge_status;
    pub fn devbridge_restored_free(restored: *mut devbridge_restored);
}

#[cfg(test)]
mod tests;
