// The device bridge contract's scenarios on the fake backend, through the
// safe crate: exact ranges and release points, injected allocation and copy
// failures, invalid views, and old-generation handles after a restart.
use std::sync::Arc;
use std::time::Duration;

use devbridge::*;

const EXTENT: u64 = 256;

fn open_fake() -> DeviceBridge {
    let options = OpenOptions { ring_bytes: 1 << 16, ..OpenOptions::default() };
    DeviceBridge::open("fake", None, &options).expect("open the fake backend")
}

fn float_vector_spec() -> ObjectSpec {
    ObjectSpec { max_extent: 4096, alignment: 4, dtype: Some(Dtype::Float32), shape: ShapeKind::Vector }
}

fn whole(handle: DeviceHandle, len: u64) -> DeviceRange {
    DeviceRange { handle, offset: 0, len }
}

fn kind<T: std::fmt::Debug>(result: Result<T>) -> ErrorKind {
    let error = result.expect_err("the call should have failed");
    assert!(!error.message().is_empty(), "{:?} came without a message", error.kind());
    error.kind()
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + 3) as u8).collect()
}

#[test]
fn copies_move_exactly_the_requested_ranges() {
    let bridge = open_fake();
    let handle = bridge.alloc_device(&float_vector_spec(), EXTENT).unwrap();
    assert_eq!(bridge.extent(handle).unwrap(), EXTENT);

    let mut source = bridge.reserve_host(64, 0, Some(Duration::ZERO)).unwrap();
    source.bytes_mut().unwrap().copy_from_slice(&pattern(64));
    // Host bytes [16, 48) to device bytes [32, 64).
    let target = DeviceRange { handle, offset: 32, len: 32 };
    bridge.host_to_device(source.span(16, 32).unwrap(), target, CopyMode::Sync).unwrap();

    let mut back = bridge.reserve_host(32, 0, Some(Duration::ZERO)).unwrap();
    let event = bridge.device_to_host(target, back.whole(), CopyMode::Sync).unwrap();
    assert!(bridge.host_bytes_valid(event).unwrap(), "a sync download's bytes are valid on return");
    assert!(bridge.copy_event_complete(event).unwrap());
    assert_eq!(back.bytes().unwrap(), &pattern(64)[16..48]);

    // Neither side may be longer than the other, nor pass the allocation,
    // nor reach outside its reservation.
    let short = DeviceRange { handle, offset: 0, len: 16 };
    assert_eq!(kind(bridge.host_to_device(back.whole(), short, CopyMode::Sync)), ErrorKind::InvalidRange);
    let past_end = DeviceRange { handle, offset: EXTENT - 16, len: 32 };
    assert_eq!(kind(bridge.host_to_device(back.whole(), past_end, CopyMode::Sync)), ErrorKind::InvalidRange);
    assert_eq!(kind(source.span(48, 32).map(|s| s.range())), ErrorKind::InvalidRange);

    back.release().map_err(|(e, _)| e).unwrap();
    source.release().map_err(|(e, _)| e).unwrap();
    bridge.free_device(handle).unwrap();
    assert_eq!(bridge.test_live_allocations().unwrap(), 0);
}

#[test]
fn an_async_upload_holds_its_host_bytes_and_allocation_until_it_completes() {
    let bridge = open_fake();
    let handle = bridge.alloc_device(&float_vector_spec(), EXTENT).unwrap();
    let mut host = bridge.reserve_host(EXTENT, 0, Some(Duration::ZERO)).unwrap();
    host.bytes_mut().unwrap().copy_from_slice(&pattern(EXTENT as usize));

    let upload = bridge.host_to_device(host.whole(), whole(handle, EXTENT), CopyMode::Async).unwrap();
    assert!(!bridge.safe_to_release_host(upload).unwrap());
    assert!(!bridge.copy_event_complete(upload).unwrap());
    assert_eq!(bridge.copy_status(upload).unwrap(), CopyOutcome::Pending);
    assert_eq!(bridge.wait(upload, Some(Duration::ZERO)).unwrap(), CopyOutcome::Pending);
    // In flight: the bytes are out of reach, the range cannot go back, the
    // allocation cannot be freed.
    assert_eq!(kind(host.bytes_mut().map(|b| b.len())), ErrorKind::AllocationStillInUse);
    let (error, mut host) = host.release().expect_err("release under an in-flight upload");
    assert_eq!(error.kind(), ErrorKind::AllocationStillInUse);
    assert_eq!(kind(bridge.free_device(handle)), ErrorKind::AllocationStillInUse);

    assert_eq!(bridge.fake_complete_all(true).unwrap(), 1);
    assert!(bridge.safe_to_release_host(upload).unwrap());
    assert!(bridge.copy_event_complete(upload).unwrap());
    assert_eq!(bridge.wait(upload, None).unwrap(), CopyOutcome::Completed);
    assert_eq!(host.bytes().unwrap().len(), EXTENT as usize);
    host.release().map_err(|(e, _)| e).unwrap();
    bridge.free_device(handle).unwrap();
}

#[test]
fn an_async_download_makes_host_bytes_valid_only_when_it_completes() {
    let bridge = open_fake();
    let handle = bridge.alloc_device(&float_vector_spec(), EXTENT).unwrap();
    let mut host = bridge.reserve_host(EXTENT, 0, None).unwrap();
    host.bytes_mut().unwrap().copy_from_slice(&pattern(EXTENT as usize));
    bridge.host_to_device(host.whole(), whole(handle, EXTENT), CopyMode::Sync).unwrap();
    host.bytes_mut().unwrap().fill(0);

    let download = bridge.device_to_host(whole(handle, EXTENT), host.whole(), CopyMode::Async).unwrap();
    assert!(!bridge.host_bytes_valid(download).unwrap());
    assert_eq!(kind(host.bytes().map(|b| b.len())), ErrorKind::AllocationStillInUse);
    bridge.fake_complete_all(true).unwrap();
    assert!(bridge.host_bytes_valid(download).unwrap());
    assert_eq!(host.bytes().unwrap(), &pattern(EXTENT as usize)[..]);
}

#[test]
fn a_reservation_dropped_under_a_copy_goes_back_when_the_copy_ends() {
    let bridge = open_fake();
    let handle = bridge.alloc_device(&float_vector_spec(), EXTENT).unwrap();
    let mut host = bridge.reserve_host(EXTENT, 0, None).unwrap();
    bridge.host_to_device(host.whole(), whole(handle, EXTENT), CopyMode::Async).unwrap();
    drop(host);
    assert_eq!(bridge.stats().unwrap().ring_releases_pending, 1);
    bridge.fake_complete_all(true).unwrap();
    assert!(bridge.wait_for_release_after(Some(Duration::from_secs(5))).unwrap());
    let stats = bridge.stats().unwrap();
    assert_eq!((stats.ring_reservations, stats.ring_releases_pending), (0, 0));
}

#[test]
fn release_after_hands_the_range_back_once_the_event_allows() {
    let bridge = open_fake();
    let handle = bridge.alloc_device(&float_vector_spec(), EXTENT).unwrap();
    let mut host = bridge.reserve_host(EXTENT, 0, None).unwrap();
    let upload = bridge.host_to_device(host.whole(), whole(handle, EXTENT), CopyMode::Async).unwrap();
    host.release_after(upload).map_err(|(e, _)| e).unwrap();
    assert_eq!(bridge.stats().unwrap().ring_reservations, 1);
    bridge.fake_complete_all(true).unwrap();
    bridge.poll().unwrap();
    assert_eq!(bridge.stats().unwrap().ring_reservations, 0);
}

#[test]
fn an_injected_allocation_failure_is_allocation_failed_once() {
    let bridge = open_fake();
    // The bridge retries an allocation once after reclaiming what it can.
    bridge.fake_inject(FakeCall::Allocate, FakeFailure::Allocation, 1).unwrap();
    bridge.fake_inject(FakeCall::Allocate, FakeFailure::Allocation, 2).unwrap();
    assert_eq!(kind(bridge.alloc_device(&float_vector_spec(), EXTENT)), ErrorKind::AllocationFailed);
    let handle = bridge.alloc_device(&float_vector_spec(), EXTENT).unwrap();
    bridge.free_device(handle).unwrap();
    // A failure that cannot apply to the call is refused.
    assert_eq!(kind(bridge.fake_inject(FakeCall::Allocate, FakeFailure::InvalidView, 1)), ErrorKind::InvalidRange);
}

#[test]
fn allocation_rules_are_the_libraries() {
    let bridge = open_fake();
    assert_eq!(kind(bridge.alloc_device(&float_vector_spec(), 4097)), ErrorKind::InvalidExtent);
    let unaligned = ObjectSpec { alignment: 3, ..float_vector_spec() };
    assert_eq!(kind(bridge.alloc_device(&unaligned, 9)), ErrorKind::InvalidAlignment);
}

#[test]
fn injected_copy_failures_arrive_with_their_kind_and_lose_nothing() {
    let bridge = open_fake();
    let handle = bridge.alloc_device(&float_vector_spec(), EXTENT).unwrap();
    let mut host = bridge.reserve_host(EXTENT, 0, None).unwrap();

    bridge.fake_inject(FakeCall::CopyHostToDevice, FakeFailure::CopyAtSubmit, 1).unwrap();
    let upload = bridge.host_to_device(host.whole(), whole(handle, EXTENT), CopyMode::Sync);
    assert_eq!(kind(upload), ErrorKind::DeviceCopyFailed);
    bridge.fake_inject(FakeCall::CopyDeviceToHost, FakeFailure::CopyAtSubmit, 1).unwrap();
    let download = bridge.device_to_host(whole(handle, EXTENT), host.whole(), CopyMode::Sync);
    assert_eq!(kind(download), ErrorKind::OutputCopyFailed);
    bridge.host_to_device(host.whole(), whole(handle, EXTENT), CopyMode::Sync).unwrap();

    bridge.fake_inject(FakeCall::CopyHostToDevice, FakeFailure::CopyAtCompletion, 1).unwrap();
    let event = bridge.host_to_device(host.whole(), whole(handle, EXTENT), CopyMode::Async).unwrap();
    bridge.fake_complete_all(true).unwrap();
    assert!(!bridge.safe_to_release_host(event).unwrap());
    assert!(!bridge.copy_event_complete(event).unwrap());
    match bridge.wait(event, None).unwrap() {
        CopyOutcome::Failed(error) => {
            assert_eq!(error.kind(), ErrorKind::DeviceCopyFailed);
            assert!(!error.message().is_empty());
        }
        other => panic!("expected a failed copy, got {:?}", other),
    }
    // A failed copy is over: the bytes are the caller's again.
    assert!(host.bytes_mut().is_ok());
    host.release().map_err(|(e, _)| e).unwrap();
    bridge.free_device(handle).unwrap();
    assert!(bridge.stats().unwrap().copies_failed >= 1);
}

#[test]
fn views_describe_the_allocation_and_hold_it() {
    let bridge = open_fake();
    let handle = bridge.alloc_device(&float_vector_spec(), EXTENT).unwrap();
    let info = bridge.backend_info().unwrap();
    let view = bridge.wrap_for_tinygrad(handle, &ViewSpec::contiguous(Dtype::Float32, &[64])).unwrap();
    assert_eq!(view.shape(), &[64]);
    assert_eq!(view.strides(), &[1]);
    assert_eq!(view.dtype(), Some(Dtype::Float32));
    let dl_dtype = view.dl_dtype();
    assert_eq!((dl_dtype.code, dl_dtype.bits, dl_dtype.lanes), (2, 32, 1), "kDLFloat, 32 bits");
    assert_eq!(view.device().device_type, info.dlpack_device_type);
    assert_eq!(view.tinygrad_device(), info.tinygrad_device);
    assert!(!view.data_ptr().is_null());
    assert_eq!(view.handle(), handle);
    assert!(!view.read_only());
    assert_eq!(bridge.stats().unwrap().live_views, 1);

    assert_eq!(kind(bridge.free_device(handle)), ErrorKind::AllocationStillInUse);
    view.end().unwrap();
    bridge.free_device(handle).unwrap();
}

#[test]
fn invalid_views_are_refused() {
    let bridge = open_fake();
    let handle = bridge.alloc_device(&float_vector_spec(), EXTENT).unwrap();
    let wrong_dtype = ViewSpec::contiguous(Dtype::Int16, &[128]);
    assert_eq!(kind(bridge.wrap_for_tinygrad(handle, &wrong_dtype)), ErrorKind::InvalidViewDType);
    let too_large = ViewSpec::contiguous(Dtype::Float32, &[65]);
    assert_eq!(kind(bridge.wrap_for_tinygrad(handle, &too_large)), ErrorKind::InvalidTensorView);
    let odd_strides = ViewSpec { strides: Some(vec![1, 1]), ..ViewSpec::contiguous(Dtype::Float32, &[64]) };
    assert_eq!(kind(bridge.wrap_for_tinygrad(handle, &odd_strides)), ErrorKind::InvalidTensorView);

    bridge.fake_inject(FakeCall::ValidateView, FakeFailure::InvalidView, 1).unwrap();
    let fine = ViewSpec::contiguous(Dtype::Float32, &[64]);
    assert_eq!(kind(bridge.wrap_for_tinygrad(handle, &fine)), ErrorKind::InvalidTensorView);
    assert_eq!(bridge.stats().unwrap().live_views, 0);
    bridge.wrap_for_tinygrad(handle, &fine).unwrap();
}

#[test]
fn a_restart_refuses_every_handle_and_event_of_the_old_generation() {
    let bridge = open_fake();
    assert_eq!(bridge.generation().unwrap(), 1);
    let handle = bridge.alloc_device(&float_vector_spec(), EXTENT).unwrap();
    let mut host = bridge.reserve_host(EXTENT, 0, None).unwrap();
    let upload = bridge.host_to_device(host.whole(), whole(handle, EXTENT), CopyMode::Async).unwrap();
    let view = bridge.wrap_for_tinygrad(handle, &ViewSpec { wait_in_flight: false, ..ViewSpec::contiguous(Dtype::Float32, &[64]) });
    assert_eq!(kind(view), ErrorKind::AllocationStillInUse, "a copy into it is in flight");

    bridge.restart(2).unwrap();
    assert_eq!(bridge.generation().unwrap(), 2);
    assert_eq!(handle.generation(), 1);
    assert_eq!(kind(bridge.free_device(handle)), ErrorKind::OldGenerationHandle);
    assert_eq!(kind(bridge.extent(handle)), ErrorKind::OldGenerationHandle);
    assert_eq!(kind(bridge.wait(upload, None)), ErrorKind::OldGenerationHandle);
    assert_eq!(kind(bridge.wrap_for_tinygrad(handle, &ViewSpec::contiguous(Dtype::Float32, &[64]))), ErrorKind::OldGenerationHandle);
    // The restart quiesced the device, so the host bytes are the caller's.
    assert!(host.bytes_mut().is_ok());
    assert_eq!(kind(bridge.restart(2)), ErrorKind::OldGenerationHandle, "generations only move forward");
    assert_eq!(bridge.test_live_allocations().unwrap(), 0);
    assert_eq!(bridge.stats().unwrap().restarts, 1);
}

#[test]
fn a_fatal_fault_breaks_the_bridge_until_a_restart() {
    let bridge = open_fake();
    let handle = bridge.alloc_device(&float_vector_spec(), EXTENT).unwrap();
    let mut host = bridge.reserve_host(EXTENT, 0, None).unwrap();
    bridge.fake_inject(FakeCall::CopyHostToDevice, FakeFailure::Fatal, 1).unwrap();
    assert!(bridge.host_to_device(host.whole(), whole(handle, EXTENT), CopyMode::Sync).is_err());
    assert_eq!(bridge.stats().unwrap().broken, 1);
    assert_eq!(kind(bridge.alloc_device(&float_vector_spec(), EXTENT)), ErrorKind::Broken);
    bridge.restart(5).unwrap();
    bridge.alloc_device(&float_vector_spec(), EXTENT).unwrap();
}

#[test]
fn handles_and_ranges_of_another_bridge_are_refused() {
    let first = open_fake();
    let second = open_fake();
    assert_ne!(first.domain().unwrap(), second.domain().unwrap());
    let handle = first.alloc_device(&float_vector_spec(), EXTENT).unwrap();
    assert_eq!(kind(second.free_device(handle)), ErrorKind::ForeignDomain);
    let mut host = first.reserve_host(EXTENT, 0, None).unwrap();
    let theirs = second.alloc_device(&float_vector_spec(), EXTENT).unwrap();
    let copy = second.host_to_device(host.whole(), whole(theirs, EXTENT), CopyMode::Sync);
    assert_eq!(kind(copy), ErrorKind::ForeignDomain);
    drop(host);
    // A handle is plain numbers: it outlives its bridge harmlessly.
    drop(first);
    assert_eq!(kind(second.extent(handle)), ErrorKind::ForeignDomain);
}

#[test]
fn a_step_holds_its_allocations() {
    let bridge = open_fake();
    let handle = bridge.alloc_device(&float_vector_spec(), EXTENT).unwrap();
    bridge.begin_step(7, &[handle]).unwrap();
    assert_eq!(kind(bridge.free_device(handle)), ErrorKind::AllocationStillInUse);
    bridge.end_step(7).unwrap();
    bridge.free_device(handle).unwrap();
}

#[test]
fn a_closed_bridge_refuses_every_call() {
    let mut bridge = open_fake();
    bridge.close().unwrap();
    assert_eq!(kind(bridge.alloc_device(&float_vector_spec(), EXTENT)), ErrorKind::Closed);
}

#[test]
fn one_bridge_serves_many_threads() {
    let bridge = Arc::new(open_fake());
    bridge.fake_set_auto_complete(true).unwrap();
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let bridge = Arc::clone(&bridge);
            std::thread::spawn(move || {
                for _ in 0..50 {
                    let handle = bridge.alloc_device(&float_vector_spec(), 64).unwrap();
                    let mut host = bridge.reserve_host(64, 0, None).unwrap();
                    let event = bridge.host_to_device(host.whole(), whole(handle, 64), CopyMode::Async).unwrap();
                    assert_eq!(bridge.wait(event, None).unwrap(), CopyOutcome::Completed);
                    host.release().map_err(|(e, _)| e).unwrap();
                    bridge.free_device(handle).unwrap();
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
    assert_eq!(bridge.test_live_allocations().unwrap(), 0);
}

#[test]
fn errors_name_their_kind_as_the_library_does() {
    let kinds = [
        ErrorKind::AllocationFailed,
        ErrorKind::DeviceCopyFailed,
        ErrorKind::OutputCopyFailed,
        ErrorKind::InvalidExtent,
        ErrorKind::InvalidAlignment,
        ErrorKind::InvalidRange,
        ErrorKind::UnknownDeviceHandle,
        ErrorKind::OldGenerationHandle,
        ErrorKind::ForeignDomain,
        ErrorKind::InvalidViewDType,
        ErrorKind::InvalidTensorView,
        ErrorKind::UnsupportedDType,
        ErrorKind::AllocationStillInUse,
        ErrorKind::Backpressure,
        ErrorKind::Unavailable,
        ErrorKind::Unsupported,
        ErrorKind::Closed,
        ErrorKind::Broken,
    ];
    for (index, kind) in kinds.iter().enumerate() {
        assert_eq!(ErrorKind::from_status(index as i32 + 1), Some(*kind));
        assert_eq!(kind.name(), format!("{:?}", kind));
    }
    assert_eq!(ErrorKind::from_status(0), None);
    assert_eq!(ErrorKind::from_status(kinds.len() as i32 + 1), None);

    let error = DeviceBridge::open("no-such-backend", None, &OpenOptions::default()).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable);
    let shown = error.to_string();
    assert!(shown.starts_with("Unavailable: ") && shown.len() > "Unavailable: ".len(), "{}", shown);
    let _: &dyn std::error::Error = &error;
}

#[test]
fn a_full_ring_is_backpressure() {
    let options = OpenOptions { ring_bytes: 4096, ..OpenOptions::default() };
    let bridge = DeviceBridge::open("fake", None, &options).unwrap();
    let _all = bridge.reserve_host(4096, 0, Some(Duration::ZERO)).unwrap();
    assert_eq!(kind(bridge.reserve_host(64, 0, Some(Duration::ZERO))), ErrorKind::Backpressure);
    assert_eq!(kind(bridge.reserve_host(64, 0, Some(Duration::from_millis(10)))), ErrorKind::Backpressure);
}

#[test]
fn a_reservation_whose_failed_copy_the_bridge_forgot_is_readable_again() {
    // The bridge keeps a bounded log of failed copies (failed_record_limit): once a later failure evicts an
    // earlier one, its event is unknown. That copy is long over; the reservation's bytes were refused for good.
    let options = OpenOptions { ring_bytes: 1 << 16, failed_record_limit: 1, ..OpenOptions::default() };
    let bridge = DeviceBridge::open("fake", None, &options).unwrap();
    let handle = bridge.alloc_device(&float_vector_spec(), EXTENT).unwrap();
    let mut first = bridge.reserve_host(EXTENT, 0, Some(Duration::ZERO)).unwrap();
    let mut second = bridge.reserve_host(EXTENT, 0, Some(Duration::ZERO)).unwrap();
    bridge.fake_inject(FakeCall::CopyDeviceToHost, FakeFailure::CopyAtCompletion, 1).unwrap();
    bridge.fake_inject(FakeCall::CopyDeviceToHost, FakeFailure::CopyAtCompletion, 2).unwrap();
    let forgotten = bridge.device_to_host(whole(handle, EXTENT), first.whole(), CopyMode::Async).unwrap();
    bridge.device_to_host(whole(handle, EXTENT), second.whole(), CopyMode::Async).unwrap();
    bridge.fake_complete_all(true).unwrap();
    assert_eq!(kind(bridge.copy_status(forgotten)), ErrorKind::UnknownDeviceHandle);
    assert_eq!(first.bytes().expect("a forgotten failure is over").len(), EXTENT as usize);
    assert_eq!(second.bytes().unwrap().len(), EXTENT as usize);
}
