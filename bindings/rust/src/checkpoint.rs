//! Checkpoints in the format Python's `devbridge.checkpoint` writes and
//! `devbridge.restore` reads (docs/PORTABLE.md): a safetensors file whose
//! metadata carries the dtypes, the generation and a CRC-32 of the data.
use std::ffi::CStr;
use std::path::Path;

use crate::bridge::{c_text, DeviceBridge};
use crate::error::{check, Error, ErrorKind, Result};
use crate::executor::{c_dims, c_rank};
use crate::sys;
use crate::types::{DeviceHandle, Dtype};

/// One tensor to write: its bytes are the first ones of `handle`'s
/// allocation, row-major `shape` of `dtype`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointEntry {
    pub name: String,
    pub handle: DeviceHandle,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
}

/// A tensor read back: a new allocation of the bridge, the caller's to free.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestoredTensor {
    pub name: String,
    pub handle: DeviceHandle,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
}

/// What a restore made, in the file's order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Restored {
    pub tensors: Vec<RestoredTensor>,
    /// The generation the file records; 0 for a safetensors file devbridge
    /// did not write.
    pub generation: u64,
}

/// Which tensors [`DeviceBridge::restore_selected`] restores; the default
/// is every one, checksum checked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreSelection {
    /// Only these (each must be in the file); empty: no name filter.
    pub names: Vec<String>,
    /// Only names that start with it; both filters apply when both are set.
    pub prefix: Option<String>,
    /// Restore without checking a devbridge file's checksum (a subset must).
    pub skip_checksum: bool,
}

fn c_path(path: &Path) -> Result<std::ffi::CString> {
    let text = path
        .to_str()
        .ok_or_else(|| Error::new(ErrorKind::InvalidRange, format!("{} is not UTF-8", path.display())))?;
    c_text(text, "path")
}

impl DeviceBridge {
    /// Writes `entries` to `path` atomically (a temporary file beside it,
    /// fsynced and renamed over it). `generation` None records the bridge's.
    pub fn checkpoint(&self, path: &Path, entries: &[CheckpointEntry], generation: Option<u64>) -> Result<()> {
        let path = c_path(path)?;
        // The C entries point into these; both live until the call returns.
        let names = entries.iter().map(|e| c_text(&e.name, "tensor name")).collect::<Result<Vec<_>>>()?;
        let dims = entries.iter().map(|e| c_dims(&e.shape)).collect::<Result<Vec<_>>>()?;
        let c_entries = entries
            .iter()
            .zip(names.iter().zip(&dims))
            .map(|(entry, (name, dims))| {
                Ok(sys::devbridge_checkpoint_entry {
                    name: name.as_ptr(),
                    handle: entry.handle.0,
                    dtype: entry.dtype.to_c(),
                    rank: c_rank(dims)?,
                    dims: if dims.is_empty() { std::ptr::null() } else { dims.as_ptr() },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        check(unsafe {
            sys::devbridge_checkpoint(
                self.raw(),
                path.as_ptr(),
                if c_entries.is_empty() { std::ptr::null() } else { c_entries.as_ptr() },
                c_entries.len() as u64,
                generation.unwrap_or(0),
            )
        })
    }

    /// Every tensor of the safetensors file at `path` (devbridge's, its
    /// checksum verified, or any other) in new allocations of this bridge's
    /// current generation. On failure nothing stays allocated.
    pub fn restore(&self, path: &Path) -> Result<Restored> {
        self.restore_selected(path, &RestoreSelection::default())
    }

    /// The tensors `selection` chooses, reading only their bytes (Python's
    /// `restore(names=, prefix=, verify=)`). A name the file lacks is
    /// `InvalidRange`; so is a subset of a devbridge file that records a
    /// checksum unless `skip_checksum` (the checksum covers every byte).
    pub fn restore_selected(&self, path: &Path, selection: &RestoreSelection) -> Result<Restored> {
        let path = c_path(path)?;
        let names = selection.names.iter().map(|n| c_text(n, "tensor name")).collect::<Result<Vec<_>>>()?;
        let name_pointers: Vec<*const std::os::raw::c_char> = names.iter().map(|n| n.as_ptr()).collect();
        let prefix = selection.prefix.as_deref().map(|p| c_text(p, "prefix")).transpose()?;
        let mut options: sys::devbridge_restore_options = sys::sized();
        options.names = if name_pointers.is_empty() { std::ptr::null() } else { name_pointers.as_ptr() };
        options.name_count = name_pointers.len() as u64;
        options.prefix = prefix.as_ref().map_or(std::ptr::null(), |p| p.as_ptr());
        options.skip_checksum = selection.skip_checksum as i32;
        let mut restored = std::ptr::null_mut();
        check(unsafe { sys::devbridge_restore_selected(self.raw(), path.as_ptr(), &options, &mut restored) })?;
        // Owned from here: the description is freed on every path below;
        // the allocations are the caller's once this returns.
        struct Description(*mut sys::devbridge_restored);
        impl Drop for Description {
            fn drop(&mut self) {
                unsafe { sys::devbridge_restored_free(self.0) }
            }
        }
        let description = Description(restored);
        // SAFETY: a successful restore gives a description valid until freed.
        let c = unsafe { &*description.0 };
        let c_tensors: &[sys::devbridge_restored_tensor] = if c.count == 0 {
            &[]
        } else {
            unsafe { std::slice::from_raw_parts(c.tensors, c.count as usize) }
        };
        // The allocations are the caller's only once every tensor converts:
        // a dtype this crate does not know (a newer library's) frees them all.
        if let Some(unknown) = c_tensors.iter().find(|t| Dtype::from_c(t.dtype).is_none()) {
            for tensor in c_tensors {
                let _ = self.free_device(DeviceHandle(tensor.handle));
            }
            return Err(Error::new(
                ErrorKind::UnsupportedDType,
                format!("the library restored dtype {}, which this crate does not know", unknown.dtype),
            ));
        }
        let tensors = c_tensors
            .iter()
            .map(|t| RestoredTensor {
                // SAFETY: NUL-terminated names and `rank` dims, valid until
                // the description is freed.
                name: unsafe { CStr::from_ptr(t.name) }.to_string_lossy().into_owned(),
                handle: DeviceHandle(t.handle),
                dtype: Dtype::from_c(t.dtype).expect("checked above"),
                shape: if t.rank == 0 {
                    Vec::new()
                } else {
                    unsafe { std::slice::from_raw_parts(t.dims, t.rank as usize) }.iter().map(|&d| d as u64).collect()
                },
            })
            .collect();
        Ok(Restored { tensors, generation: c.generation })
    }
}
