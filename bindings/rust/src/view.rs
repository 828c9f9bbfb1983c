use std::ffi::CStr;
use std::os::raw::c_void;

use crate::error::{check, Result};
use crate::sys;
use crate::types::{DeviceHandle, Dtype};

/// A zero-copy view of a device allocation as a DLTensor, holding the
/// lease that keeps the allocation allocated; the lease ends when the view
/// is dropped (or [`TensorView::end`]). It may outlive its bridge: the C ABI
/// keeps a live view's memory past close and destroy.
pub struct TensorView {
    raw: sys::devbridge_view,
}

// SAFETY: the lease may be ended from any thread (the C ABI's DLPack
// deleter is called from any thread; a view's end is the same operation).
unsafe impl Send for TensorView {}

impl TensorView {
    pub(crate) fn from_c(raw: sys::devbridge_view) -> TensorView {
        TensorView { raw }
    }

    /// The DLTensor as the library filled it; its pointers live as long as
    /// the view.
    pub fn dl_tensor(&self) -> &sys::DLTensor {
        &self.raw.dl_tensor
    }

    /// The first element (CPU, CUDA), or the cl_mem on OpenCL, where
    /// [`TensorView::byte_offset`] is the offset.
    pub fn data_ptr(&self) -> *mut c_void {
        self.raw.dl_tensor.data
    }

    pub fn byte_offset(&self) -> u64 {
        self.raw.dl_tensor.byte_offset
    }

    pub fn shape(&self) -> &[i64] {
        self.dims(self.raw.dl_tensor.shape)
    }

    /// In elements.
    pub fn strides(&self) -> &[i64] {
        self.dims(self.raw.dl_tensor.strides)
    }

    fn dims(&self, pointer: *const i64) -> &[i64] {
        let rank = self.raw.dl_tensor.ndim.max(0) as usize;
        if rank == 0 || pointer.is_null() {
            return &[];
        }
        // SAFETY: the lease owns `rank` dimensions there until the view ends.
        unsafe { std::slice::from_raw_parts(pointer, rank) }
    }

    pub fn dtype(&self) -> Option<Dtype> {
        Dtype::from_c(self.raw.dtype)
    }

    /// DLPack's spelling of the dtype (code, bits, lanes).
    pub fn dl_dtype(&self) -> sys::DLDataType {
        self.raw.dl_tensor.dtype
    }

    /// DLPack's device (device_type, device_id).
    pub fn device(&self) -> sys::DLDevice {
        self.raw.dl_tensor.device
    }

    /// "CPU", "CUDA:0", "CL", ...
    pub fn tinygrad_device(&self) -> &str {
        if self.raw.tinygrad_device.is_null() {
            return "";
        }
        // SAFETY: NUL-terminated, owned by the lease.
        unsafe { CStr::from_ptr(self.raw.tinygrad_device) }.to_str().unwrap_or("")
    }

    /// Adopted read-only memory: do not write through the view.
    pub fn read_only(&self) -> bool {
        self.raw.read_only != 0
    }

    pub fn handle(&self) -> DeviceHandle {
        DeviceHandle(self.raw.handle)
    }

    /// Ends the lease now (the allocation may then be freed).
    pub fn end(mut self) -> Result<()> {
        check(unsafe { sys::devbridge_view_end(&mut self.raw) })
    }
}

impl Drop for TensorView {
    fn drop(&mut self) {
        // Already ended (by end()) is OK and does nothing.
        let _ = unsafe { sys::devbridge_view_end(&mut self.raw) };
    }
}

impl std::fmt::Debug for TensorView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorView")
            .field("handle", &self.handle())
            .field("dtype", &self.dtype())
            .field("shape", &self.shape())
            .field("strides", &self.strides())
            .field("device", &self.tinygrad_device())
            .finish()
    }
}
