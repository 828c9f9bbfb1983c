//! Safe Rust bindings to devbridge's C ABI (include/devbridge/c/devbridge.h,
//! libdevbridge_c): a bridge that moves tensors between a ring of host
//! memory and device memory, with zero-copy tinygrad/DLPack views.
//!
//! README.md says how to build and link, who owns what, and how the
//! contract's names map onto this crate's.
pub mod sys;

mod bridge;
mod checkpoint;
mod error;
mod executor;
mod types;
mod view;

pub use bridge::{BridgeStats, DeviceBridge, HostReservation, HostSpan, MemoryStats};
pub use checkpoint::{CheckpointEntry, RestoreSelection, Restored, RestoredTensor};
pub use error::{Error, ErrorKind, Result};
pub use executor::{ActivationHandle, BoundDevice, PortableActivation, Vendor};
pub use types::{
    CachingPool, CopyEvent, CopyMode, CopyOutcome, DeviceHandle, DeviceInfo, DeviceKind, DeviceRange, Dtype,
    FakeCall, FakeFailure, HostRange, ObjectSpec, OpenOptions, ShapeKind, ViewSpec, WritesUnderView,
};
pub use view::TensorView;
