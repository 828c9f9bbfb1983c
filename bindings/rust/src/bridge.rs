use std::ffi::CString;
use std::ptr::{self, NonNull};
use std::time::Duration;

use crate::error::{check, Error, ErrorKind, Result};
use crate::sys;
use crate::types::*;
use crate::view::TensorView;

/// The bridge's counters (include/devbridge/bridge.hpp BridgeStats).
pub type BridgeStats = sys::devbridge_stats;
/// Device memory as the bridge sees it (bridge.hpp MemoryStats).
pub type MemoryStats = sys::devbridge_memory_stats;

/// One backend bound to one device, with its host ring: the worker's
/// boundary between ring bytes, device allocations and tinygrad views.
///
/// Every method takes `&self` and may run on many threads at once: the
/// header promises that every call on a bridge is safe from many threads
/// except devbridge_destroy (and the C++ bridge behind it is guarded by one
/// lock). `close` and `Drop` take the bridge exclusively because the ring's
/// bytes die with them and a [`HostReservation`] hands those bytes out.
pub struct DeviceBridge {
    raw: NonNull<sys::devbridge_bridge>,
}

// SAFETY: the C ABI makes every call but devbridge_destroy thread-safe; the
// one destroy is in Drop, which has the bridge to itself.
unsafe impl Send for DeviceBridge {}
unsafe impl Sync for DeviceBridge {}

/// A timeout as the C ABI spells it: None waits as long as it takes.
fn timeout_ns(timeout: Option<Duration>) -> i64 {
    timeout.map_or(sys::DEVBRIDGE_WAIT_FOREVER, |t| i64::try_from(t.as_nanos()).unwrap_or(i64::MAX))
}

pub(crate) fn c_text(text: &str, what: &str) -> Result<CString> {
    CString::new(text).map_err(|_| Error::new(ErrorKind::InvalidRange, format!("{} contains a NUL byte", what)))
}

fn flag(query: impl FnOnce(*mut i32) -> sys::devbridge_status) -> Result<bool> {
    let mut answer = 0;
    check(query(&mut answer))?;
    Ok(answer != 0)
}

impl DeviceBridge {
    /// Opens `backend` ("fake", "host", "cuda", "opencl", "auto") on
    /// `device` (a DeviceInfo::device_id; None: the backend's first).
    pub fn open(backend: &str, device: Option<&str>, options: &OpenOptions) -> Result<DeviceBridge> {
        let backend = c_text(backend, "backend")?;
        let device = device.map(|d| c_text(d, "device")).transpose()?;
        let texts = options
            .backend_options
            .iter()
            .map(|(k, v)| Ok((c_text(k, "backend option key")?, c_text(v, "backend option value")?)))
            .collect::<Result<Vec<_>>>()?;
        let pairs: Vec<sys::devbridge_backend_option> =
            texts.iter().map(|(k, v)| sys::devbridge_backend_option { key: k.as_ptr(), value: v.as_ptr() }).collect();

        let mut c: sys::devbridge_open_options = sys::sized();
        c.backend = backend.as_ptr();
        c.device = device.as_ref().map_or(ptr::null(), |d| d.as_ptr());
        c.backend_options = pairs.as_ptr();
        c.backend_option_count = pairs.len() as u64;
        c.generation = options.generation;
        c.ring_bytes = options.ring_bytes;
        c.inflight_budget_bytes = options.inflight_budget_bytes;
        c.failed_record_limit = options.failed_record_limit;
        c.pool_cap_bytes = options.pool_cap_bytes;
        c.writes_under_view_timeout_ns = options.writes_under_view_timeout_ns;
        c.close_fence_timeout_ns = options.close_fence_timeout_ns;
        c.writes_under_view = match options.writes_under_view {
            WritesUnderView::Refuse => sys::DEVBRIDGE_WRITES_UNDER_VIEW_REFUSE,
            WritesUnderView::Wait => sys::DEVBRIDGE_WRITES_UNDER_VIEW_WAIT,
            WritesUnderView::Allow => sys::DEVBRIDGE_WRITES_UNDER_VIEW_ALLOW,
        };
        c.caching_pool = match options.caching_pool {
            CachingPool::BackendDefault => sys::DEVBRIDGE_CACHING_POOL_BACKEND_DEFAULT,
            CachingPool::On => sys::DEVBRIDGE_CACHING_POOL_ON,
            CachingPool::Off => sys::DEVBRIDGE_CACHING_POOL_OFF,
        };
        let mut raw = ptr::null_mut();
        check(unsafe { sys::devbridge_open(&c, &mut raw) })?;
        let raw = NonNull::new(raw)
            .ok_or_else(|| Error::new(ErrorKind::Broken, "devbridge_open succeeded without a bridge"))?;
        Ok(DeviceBridge { raw })
    }

    /// The devices `backend` can bind here (none when it cannot run here).
    pub fn list_devices(backend: &str) -> Result<Vec<DeviceInfo>> {
        let name = c_text(backend, "backend")?;
        let mut count = 0u64;
        check(unsafe { sys::devbridge_device_count(name.as_ptr(), &mut count) })?;
        (0..count)
            .map(|index| {
                let mut info: sys::devbridge_device_info = sys::sized();
                check(unsafe { sys::devbridge_device_at(name.as_ptr(), index, &mut info) })?;
                Ok(DeviceInfo::from_c(&info))
            })
            .collect()
    }

    #[inline]
    pub(crate) fn raw(&self) -> *mut sys::devbridge_bridge {
        self.raw.as_ptr()
    }

    /// The C bridge, for a `sys` call this crate does not wrap; valid while
    /// this DeviceBridge lives (never pass it to devbridge_destroy).
    pub fn as_raw(&self) -> *mut sys::devbridge_bridge {
        self.raw()
    }

    /// The device this bridge is bound to.
    pub fn backend_info(&self) -> Result<DeviceInfo> {
        let mut info: sys::devbridge_device_info = sys::sized();
        check(unsafe { sys::devbridge_backend_info(self.raw(), &mut info) })?;
        Ok(DeviceInfo::from_c(&info))
    }

    pub fn generation(&self) -> Result<u64> {
        let mut generation = 0;
        check(unsafe { sys::devbridge_generation(self.raw(), &mut generation) })?;
        Ok(generation)
    }

    /// The number that tells this bridge's handles from any other's.
    pub fn domain(&self) -> Result<u64> {
        let mut domain = 0;
        check(unsafe { sys::devbridge_domain(self.raw(), &mut domain) })?;
        Ok(domain)
    }

    /// Frees every allocation of the old generation and moves to
    /// `generation` (greater than the current one): every older handle and
    /// event is refused from now on (OldGenerationHandle). Host reservations
    /// stay reserved. Clears Broken.
    pub fn restart(&self, generation: u64) -> Result<()> {
        check(unsafe { sys::devbridge_restart(self.raw(), generation) })
    }

    /// Fails every later call with Closed, quiesces the device and frees
    /// everything; live [`TensorView`]s keep their memory until they end.
    /// May be retried if it fails. Dropping the bridge closes it too.
    pub fn close(&mut self) -> Result<()> {
        check(unsafe { sys::devbridge_close(self.raw()) })
    }

    // ---- allocation ----

    #[inline]
    pub fn alloc_device(&self, spec: &ObjectSpec, extent: u64) -> Result<DeviceHandle> {
        let mut handle = sys::devbridge_handle { domain: 0, generation: 0, id: 0 };
        check(unsafe { sys::devbridge_alloc_device(self.raw(), &spec.to_c(), extent, &mut handle) })?;
        Ok(DeviceHandle(handle))
    }

    /// Frees now, or AllocationStillInUse (a copy, step, view or fence uses
    /// it) changing nothing.
    #[inline]
    pub fn free_device(&self, handle: DeviceHandle) -> Result<()> {
        check(unsafe { sys::devbridge_free_device(self.raw(), handle.0) })
    }

    /// Deferred free: the handle is dead at once, the memory goes back once
    /// nothing uses it.
    #[inline]
    pub fn release_device(&self, handle: DeviceHandle) -> Result<()> {
        check(unsafe { sys::devbridge_release_device(self.raw(), handle.0) })
    }

    pub fn extent(&self, handle: DeviceHandle) -> Result<u64> {
        let mut extent = 0;
        check(unsafe { sys::devbridge_extent(self.raw(), handle.0, &mut extent) })?;
        Ok(extent)
    }

    // ---- host ring ----

    /// `bytes` of the ring, aligned to `alignment` (a power of two up to
    /// 4096; 0: 64). Backpressure when there is no room after `timeout`
    /// (Some(ZERO): at once; None: until there is room).
    pub fn reserve_host(&self, bytes: u64, alignment: u64, timeout: Option<Duration>) -> Result<HostReservation<'_>> {
        let mut range = sys::devbridge_host_range { offset: 0, len: 0 };
        check(unsafe { sys::devbridge_reserve_host(self.raw(), bytes, alignment, timeout_ns(timeout), &mut range) })?;
        let range = HostRange { offset: range.offset, len: range.len };
        let mut data = ptr::null_mut();
        if let Err(error) = check(unsafe { sys::devbridge_host_bytes(self.raw(), range.to_c(), &mut data) }) {
            let _ = check(unsafe { sys::devbridge_release_host(self.raw(), range.to_c()) });
            return Err(error);
        }
        let data = NonNull::new(data)
            .ok_or_else(|| Error::new(ErrorKind::Broken, "devbridge_host_bytes gave no address"))?;
        Ok(HostReservation { bridge: self, range, data, in_flight: Vec::new() })
    }

    /// Waits until a range given to [`HostReservation::release_after`] goes
    /// back to the ring: true; false when none waits or the timeout passed.
    pub fn wait_for_release_after(&self, timeout: Option<Duration>) -> Result<bool> {
        flag(|out| unsafe { sys::devbridge_wait_for_release_after(self.raw(), timeout_ns(timeout), out) })
    }

    // ---- copies ----

    /// Copies exactly `host` to exactly `device`. Sync: the host bytes may
    /// be reused when it returns. Async: once the event completes
    /// ([`DeviceBridge::safe_to_release_host`]).
    #[inline]
    pub fn host_to_device(&self, host: HostSpan<'_, '_>, device: DeviceRange, mode: CopyMode) -> Result<CopyEvent> {
        let ring = self.ring_side(&host)?;
        let mut event = sys::devbridge_event { domain: 0, generation: 0, id: 0 };
        check(unsafe { sys::devbridge_host_to_device(self.raw(), ring, device.to_c(), mode.to_c(), &mut event) })?;
        Ok(host.submitted(CopyEvent(event), mode))
    }

    /// Copies exactly `device` to exactly `host`. Sync: the host bytes are
    /// valid when it returns. Async: once the event completes
    /// ([`DeviceBridge::host_bytes_valid`]).
    #[inline]
    pub fn device_to_host(&self, device: DeviceRange, host: HostSpan<'_, '_>, mode: CopyMode) -> Result<CopyEvent> {
        let ring = self.ring_side(&host)?;
        let mut event = sys::devbridge_event { domain: 0, generation: 0, id: 0 };
        check(unsafe { sys::devbridge_device_to_host(self.raw(), device.to_c(), ring, mode.to_c(), &mut event) })?;
        Ok(host.submitted(CopyEvent(event), mode))
    }

    // A copy's ring side must be one of this bridge's reservations. (The C
    // call is made in each direction's body, not through a shared closure:
    // capturing the device range made the compiler copy it through a
    // temporary it reloaded in other pieces, a store-forwarding stall of
    // about 7 ns per copy, examples/overhead.rs.)
    #[inline]
    fn ring_side(&self, host: &HostSpan<'_, '_>) -> Result<sys::devbridge_host_range> {
        if !ptr::eq(host.reservation.bridge, self) {
            return Err(Error::new(ErrorKind::ForeignDomain, "the host range was reserved on another bridge"));
        }
        Ok(host.range.to_c())
    }

    /// Blocks until the copy completes or fails, or `timeout` passes (then
    /// Pending); None waits as long as it takes.
    pub fn wait(&self, event: CopyEvent, timeout: Option<Duration>) -> Result<CopyOutcome> {
        self.outcome(|out| unsafe { sys::devbridge_wait(self.raw(), event.0, timeout_ns(timeout), out) })
    }

    /// Where the copy stands, without waiting.
    pub fn copy_status(&self, event: CopyEvent) -> Result<CopyOutcome> {
        self.outcome(|out| unsafe { sys::devbridge_copy_status(self.raw(), event.0, out) })
    }

    fn outcome(&self, query: impl FnOnce(*mut sys::devbridge_copy_outcome) -> sys::devbridge_status) -> Result<CopyOutcome> {
        let mut outcome: sys::devbridge_copy_outcome = sys::sized();
        check(query(&mut outcome))?;
        Ok(match outcome.state {
            sys::DEVBRIDGE_COPY_PENDING => CopyOutcome::Pending,
            sys::DEVBRIDGE_COPY_COMPLETED => CopyOutcome::Completed,
            // The library left the copy's own message for this thread.
            _ => CopyOutcome::Failed(check(outcome.error).err().unwrap_or_else(|| {
                Error::new(ErrorKind::Broken, "a failed copy reported no error kind")
            })),
        })
    }

    /// Applies every completion the backend has; how many it applied.
    #[inline]
    pub fn poll(&self) -> Result<u64> {
        let mut applied = 0;
        check(unsafe { sys::devbridge_poll(self.raw(), &mut applied) })?;
        Ok(applied)
    }

    /// True once an upload's host range may be released or reused.
    #[inline]
    pub fn safe_to_release_host(&self, event: CopyEvent) -> Result<bool> {
        flag(|out| unsafe { sys::devbridge_safe_to_release_host(self.raw(), event.0, out) })
    }

    /// True once a download's host bytes are valid.
    #[inline]
    pub fn host_bytes_valid(&self, event: CopyEvent) -> Result<bool> {
        flag(|out| unsafe { sys::devbridge_host_bytes_valid(self.raw(), event.0, out) })
    }

    /// True once the copy completed (either direction); false for a failed
    /// one (wait / copy_status say it failed).
    #[inline]
    pub fn copy_event_complete(&self, event: CopyEvent) -> Result<bool> {
        flag(|out| unsafe { sys::devbridge_copy_event_complete(self.raw(), event.0, out) })
    }

    // ---- compute ----

    /// Marks the handles as used by `step` until [`DeviceBridge::end_step`]:
    /// free_device refuses them, release_device defers.
    pub fn begin_step(&self, step: u64, handles: &[DeviceHandle]) -> Result<()> {
        let raw: Vec<sys::devbridge_handle> = handles.iter().map(|h| h.0).collect();
        check(unsafe { sys::devbridge_begin_step(self.raw(), step, raw.as_ptr(), raw.len() as u64) })
    }

    pub fn end_step(&self, step: u64) -> Result<()> {
        check(unsafe { sys::devbridge_end_step(self.raw(), step) })
    }

    /// y = a*x + b over float32 ranges of equal length, in order with copies.
    pub fn launch_axpy(&self, x: DeviceRange, y: DeviceRange, a: f32, b: f32) -> Result<()> {
        check(unsafe { sys::devbridge_launch_axpy(self.raw(), x.to_c(), y.to_c(), a, b) })
    }

    // ---- views ----

    /// A zero-copy tinygrad/DLPack view of the allocation; the allocation
    /// stays allocated until the view ends (drop or [`TensorView::end`]).
    pub fn wrap_for_tinygrad(&self, handle: DeviceHandle, spec: &ViewSpec) -> Result<TensorView> {
        let c_spec = spec.to_c()?;
        let mut view: sys::devbridge_view = sys::sized();
        check(unsafe { sys::devbridge_view_open(self.raw(), handle.0, &c_spec, &mut view) })?;
        Ok(TensorView::from_c(view))
    }

    // ---- statistics ----

    pub fn stats(&self) -> Result<BridgeStats> {
        let mut stats: BridgeStats = sys::sized();
        check(unsafe { sys::devbridge_get_stats(self.raw(), &mut stats) })?;
        Ok(stats)
    }

    pub fn memory_stats(&self) -> Result<MemoryStats> {
        let mut stats: MemoryStats = sys::sized();
        check(unsafe { sys::devbridge_get_memory_stats(self.raw(), &mut stats) })?;
        Ok(stats)
    }

    pub fn reset_peak_memory(&self) -> Result<()> {
        check(unsafe { sys::devbridge_reset_peak_memory(self.raw()) })
    }

    /// Gives every cached block back to the backend.
    pub fn empty_cache(&self) -> Result<()> {
        check(unsafe { sys::devbridge_empty_cache(self.raw()) })
    }

    // ---- test controls (test suites only; Unsupported on a backend without them) ----

    /// Fails the `nth` (from 1) next `call` of the fake backend, once.
    pub fn fake_inject(&self, call: FakeCall, failure: FakeFailure, nth: i32) -> Result<()> {
        check(unsafe { sys::devbridge_fake_inject(self.raw(), call as i32, failure as i32, nth) })
    }

    /// Whether the fake completes async copies as they are submitted (by
    /// default they stay pending until [`DeviceBridge::fake_complete_all`]).
    pub fn fake_set_auto_complete(&self, on: bool) -> Result<()> {
        check(unsafe { sys::devbridge_fake_set_auto_complete(self.raw(), on as i32) })
    }

    /// Completes every pending copy of the fake (successfully or failed);
    /// how many.
    pub fn fake_complete_all(&self, ok: bool) -> Result<u64> {
        let mut completed = 0;
        check(unsafe { sys::devbridge_fake_complete_all(self.raw(), ok as i32, &mut completed) })?;
        Ok(completed)
    }

    /// Device allocations the backend holds.
    pub fn test_live_allocations(&self) -> Result<u64> {
        let mut count = 0;
        check(unsafe { sys::devbridge_test_live_allocations(self.raw(), &mut count) })?;
        Ok(count)
    }

    /// Holds async copies pending (fake and host backends).
    pub fn test_hold_copies(&self, hold: bool) -> Result<()> {
        check(unsafe { sys::devbridge_test_hold_copies(self.raw(), hold as i32) })
    }
}

impl Drop for DeviceBridge {
    fn drop(&mut self) {
        // Closes (if not yet) and frees; live views keep their memory.
        unsafe { sys::devbridge_destroy(self.raw()) }
    }
}

impl std::fmt::Debug for DeviceBridge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBridge").field("domain", &self.domain().ok()).finish()
    }
}

/// A reservation of the bridge's host ring; its bytes are the caller's to
/// fill or read while no async copy through it is in flight.
///
/// Dropping it releases the range; if an async copy still uses it, the
/// range goes back once that copy is over (release_host_after).
pub struct HostReservation<'b> {
    bridge: &'b DeviceBridge,
    range: HostRange,
    // From devbridge_host_bytes: valid until the bridge closes, which needs
    // the bridge exclusively, so not while this borrow lives.
    data: NonNull<u8>,
    // Async copies issued through this reservation and not yet seen over.
    in_flight: Vec<CopyEvent>,
}

// SAFETY: the reservation is a range of a Sync bridge and a pointer to
// bytes only it hands out.
unsafe impl Send for HostReservation<'_> {}

impl<'b> HostReservation<'b> {
    /// The whole range, exactly as reserved.
    pub fn range(&self) -> HostRange {
        self.range
    }

    /// All of the reservation, as a copy's host side.
    #[inline]
    pub fn whole(&mut self) -> HostSpan<'_, 'b> {
        let range = self.range;
        HostSpan { reservation: self, range }
    }

    /// Bytes [offset, offset + len) of the reservation, as a copy's host side.
    #[inline]
    pub fn span(&mut self, offset: u64, len: u64) -> Result<HostSpan<'_, 'b>> {
        // Checked here, not only by the library: a range reaching into
        // another reservation would race with that one's slices.
        if offset.checked_add(len).map_or(true, |end| end > self.range.len) {
            return Err(Error::new(
                ErrorKind::InvalidRange,
                format!("[{}, +{}) is not within the reservation's {} bytes", offset, len, self.range.len),
            ));
        }
        let range = HostRange { offset: self.range.offset + offset, len };
        Ok(HostSpan { reservation: self, range })
    }

    /// The bytes, once every async copy through them is over (else
    /// AllocationStillInUse: wait for it first).
    pub fn bytes(&mut self) -> Result<&[u8]> {
        self.settle()?;
        // SAFETY: the ring keeps the range for us alone; no copy touches it.
        Ok(unsafe { std::slice::from_raw_parts(self.data.as_ptr(), self.range.len as usize) })
    }

    /// As [`HostReservation::bytes`], to fill.
    pub fn bytes_mut(&mut self) -> Result<&mut [u8]> {
        self.settle()?;
        // SAFETY: as in bytes; &mut self makes the slice the only one.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.data.as_ptr(), self.range.len as usize) })
    }

    // Forgets the copies that are over; AllocationStillInUse if any is not.
    fn settle(&mut self) -> Result<()> {
        let bridge = self.bridge;
        self.in_flight.retain(|&event| !copy_is_over(bridge, event));
        match self.in_flight.first() {
            None => Ok(()),
            Some(event) => Err(Error::new(
                ErrorKind::AllocationStillInUse,
                format!("an async copy through host range {:?} ({:?}) is still in flight", self.range, event),
            )),
        }
    }

    /// Ends the reservation now. Refused (AllocationStillInUse) while an
    /// async copy uses it; the reservation comes back with the error.
    pub fn release(self) -> std::result::Result<(), (Error, HostReservation<'b>)> {
        self.end(|bridge, range| unsafe { sys::devbridge_release_host(bridge, range) })
    }

    /// Ends the reservation once `event` allows (an upload's
    /// safe_to_release_host, a download's host_bytes_valid, or it failed).
    pub fn release_after(self, event: CopyEvent) -> std::result::Result<(), (Error, HostReservation<'b>)> {
        self.end(|bridge, range| unsafe { sys::devbridge_release_host_after(bridge, range, event.0) })
    }

    fn end(
        self,
        call: impl FnOnce(*mut sys::devbridge_bridge, sys::devbridge_host_range) -> sys::devbridge_status,
    ) -> std::result::Result<(), (Error, HostReservation<'b>)> {
        match check(call(self.bridge.raw(), self.range.to_c())) {
            Ok(()) => {
                // Already ended: skip Drop's release, free only the list.
                let mut ended = std::mem::ManuallyDrop::new(self);
                drop(std::mem::take(&mut ended.in_flight));
                Ok(())
            }
            Err(error) => Err((error, self)),
        }
    }
}

// A copy is over when it completed or failed, or when the bridge no longer
// knows it: a restart retired it (the restart quiesced the device), or its
// failure was forgotten (the bridge keeps a bounded log of failed copies and
// never forgets a copy in flight), as the core's own release path counts it.
// Anything else (Broken, ...) counts as still in flight: the device may
// still touch the bytes.
fn copy_is_over(bridge: &DeviceBridge, event: CopyEvent) -> bool {
    match bridge.copy_status(event) {
        Ok(outcome) => outcome != CopyOutcome::Pending,
        Err(error) => matches!(error.kind(), ErrorKind::OldGenerationHandle | ErrorKind::UnknownDeviceHandle),
    }
}

impl Drop for HostReservation<'_> {
    fn drop(&mut self) {
        let bridge = self.bridge.raw();
        let range = self.range.to_c();
        if check(unsafe { sys::devbridge_release_host(bridge, range) }).is_ok() {
            return;
        }
        // Still pinned by a copy: hand it back once the copies are over (one
        // event is enough: the ring waits for every copy that pins it).
        if let Some(event) = self.in_flight.last() {
            let _ = check(unsafe { sys::devbridge_release_host_after(bridge, range, event.0) });
        }
    }
}

impl std::fmt::Debug for HostReservation<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostReservation").field("range", &self.range).field("in_flight", &self.in_flight).finish()
    }
}

/// A copy's host side: a range within one reservation, borrowed from it
/// exclusively so no slice of it is alive while the copy is issued.
pub struct HostSpan<'r, 'b> {
    reservation: &'r mut HostReservation<'b>,
    range: HostRange,
}

impl HostSpan<'_, '_> {
    pub fn range(&self) -> HostRange {
        self.range
    }

    // An async copy is remembered by the reservation, so its bytes stay out
    // of reach until the copy is over.
    #[inline]
    fn submitted(self, event: CopyEvent, mode: CopyMode) -> CopyEvent {
        if mode == CopyMode::Async {
            self.reservation.in_flight.push(event);
        }
        event
    }
}

#[allow(dead_code)]
fn _assert_thread_safety() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<DeviceBridge>();
}
