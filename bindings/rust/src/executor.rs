//! The executor-style surface a supervisor drives (the everycycle
//! `Executor` trait's shape), over one bridge.
use crate::bridge::DeviceBridge;
use crate::error::{check, Error, ErrorKind, Result};
use crate::sys;
use crate::types::{DeviceHandle, DeviceKind, Dtype, ObjectSpec, ShapeKind};

/// Whose kernels and memory the bridge drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Vendor {
    Cuda,
    OpenCl,
    /// Host memory (the host and fake backends).
    Cpu,
    /// A device kind a newer library reports.
    Other(i32),
}

/// One device the executor is bound to; the PCI bus id is its stable
/// identity where the driver reports one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BoundDevice {
    pub bus_address: Option<String>,
    pub display_name: String,
}

/// A tensor outside any bridge: row-major, little-endian bytes of `dtype`
/// in `shape`, for handing an activation to another vendor's executor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortableActivation {
    pub shape: Vec<u64>,
    pub dtype: Dtype,
    pub bytes: Vec<u8>,
}

/// The C ABI's dims (int64): one past i64 is what a negative dim is to the
/// C layer, InvalidRange (C_API.md), as a shape whose bytes overflow is.
pub(crate) fn c_dims(shape: &[u64]) -> Result<Vec<i64>> {
    shape
        .iter()
        .map(|&dim| {
            i64::try_from(dim).map_err(|_| {
                Error::new(ErrorKind::InvalidRange, format!("dimension {} of {:?} is past i64", dim, shape))
            })
        })
        .collect()
}

pub(crate) fn c_rank(dims: &[i64]) -> Result<u32> {
    u32::try_from(dims.len()).map_err(|_| Error::new(ErrorKind::InvalidTensorView, "rank past u32"))
}

/// An activation is a device allocation of this bridge; its handle means
/// nothing to another (ForeignDomain).
pub type ActivationHandle = DeviceHandle;

impl DeviceBridge {
    pub fn vendor(&self) -> Result<Vendor> {
        Ok(match self.backend_info()?.device_kind {
            DeviceKind::Cuda => Vendor::Cuda,
            DeviceKind::OpenCl => Vendor::OpenCl,
            DeviceKind::Cpu => Vendor::Cpu,
            DeviceKind::Other(kind) => Vendor::Other(kind),
        })
    }

    /// The devices this bridge owns: one.
    pub fn devices(&self) -> Result<Vec<BoundDevice>> {
        let info = self.backend_info()?;
        Ok(vec![BoundDevice { bus_address: info.pci_bus_id, display_name: info.device_name }])
    }

    /// The dtypes kernels on the device compute in.
    pub fn supported_dtypes(&self) -> Result<Vec<Dtype>> {
        Ok(self.backend_info()?.compute_dtypes)
    }

    /// A row-major activation of `shape` and `dtype`. The library decides
    /// what the device holds (UnsupportedDType otherwise) and whether it
    /// fits (AllocationFailed).
    pub fn alloc_activation(&self, shape: &[u64], dtype: Dtype) -> Result<ActivationHandle> {
        let element_size = u64::from(dtype.size_bytes());
        let bytes = shape
            .iter()
            .try_fold(element_size, |total, &dim| total.checked_mul(dim))
            .ok_or_else(|| Error::new(ErrorKind::InvalidExtent, format!("{:?} of {} overflows", shape, dtype.name())))?;
        let spec = ObjectSpec {
            max_extent: bytes,
            alignment: element_size,
            dtype: Some(dtype),
            shape: ShapeKind::of_rank(shape.len()),
        };
        self.alloc_device(&spec, bytes)
    }

    /// Releases an activation once nothing uses it. Idempotent: a handle
    /// already released (or retired by a restart) is not an error; one of
    /// another bridge is (ForeignDomain).
    pub fn release_activation(&self, handle: ActivationHandle) -> Result<()> {
        match self.release_device(handle) {
            Err(error)
                if matches!(error.kind(), ErrorKind::UnknownDeviceHandle | ErrorKind::OldGenerationHandle) =>
            {
                Ok(())
            }
            other => other,
        }
    }

    /// The activation's bytes as a portable tensor (staged through the ring
    /// in chunks). Unlike the everycycle trait, the caller names the dtype
    /// and shape: the C ABI does not keep them per handle.
    pub fn export_activation(&self, handle: ActivationHandle, dtype: Dtype, shape: &[u64]) -> Result<PortableActivation> {
        let dims = c_dims(shape)?;
        let mut tensor = std::ptr::null_mut();
        check(unsafe {
            sys::devbridge_export_tensor(self.raw(), handle.0, dtype.to_c(), dims.as_ptr(), c_rank(&dims)?, 0, &mut tensor)
        })?;
        // Owned from here: freed on every path below.
        struct Owned(*mut sys::devbridge_portable);
        impl Drop for Owned {
            fn drop(&mut self) {
                unsafe { sys::devbridge_portable_free(self.0) }
            }
        }
        let owned = Owned(tensor);
        let mut view: sys::devbridge_portable_view = sys::sized();
        check(unsafe { sys::devbridge_portable_describe(owned.0, &mut view) })?;
        let bytes = if view.len == 0 {
            Vec::new()
        } else {
            // SAFETY: `len` bytes live at `data` until devbridge_portable_free.
            unsafe { std::slice::from_raw_parts(view.data as *const u8, view.len as usize) }.to_vec()
        };
        Ok(PortableActivation { shape: shape.to_vec(), dtype, bytes })
    }

    /// A new activation of this bridge holding `portable`'s bytes.
    pub fn import_activation(&self, portable: &PortableActivation) -> Result<ActivationHandle> {
        let dims = c_dims(&portable.shape)?;
        let mut view: sys::devbridge_portable_view = sys::sized();
        view.dtype = portable.dtype.to_c();
        view.rank = c_rank(&dims)?;
        view.dims = if dims.is_empty() { std::ptr::null() } else { dims.as_ptr() };
        view.data = if portable.bytes.is_empty() { std::ptr::null() } else { portable.bytes.as_ptr().cast() };
        view.len = portable.bytes.len() as u64;
        let mut handle = sys::devbridge_handle { domain: 0, generation: 0, id: 0 };
        check(unsafe { sys::devbridge_import_tensor(self.raw(), &view, std::ptr::null(), &mut handle) })?;
        Ok(DeviceHandle(handle))
    }
}
