// CONTRACT.md "Copies": exact bytes, range validation, sync/async safe-release
// and valid points, status/wait/poll, failures that lose nothing, stale
// completions, record retirement, backpressure.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "support.hpp"

namespace devbridge::testing {
namespace {

using CopyTest = BridgeTest;

// ---- exact bytes, sync ------------------------------------------------------

TEST_F(CopyTest, SyncHostToDeviceCopiesExactBytesAndIsSafeToReleaseOnReturn) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 1024);
  const std::vector<std::byte> device_before = device_contents(h, 0, 1024);
  std::vector<std::byte> data;
  const HostRange range = filled_range(300, 11, &data);
  fake->clear_calls();
  const CopyEvent e = bridge->host_to_device(range, DeviceRange{h, 128, 300}, CopyMode::Sync);
  // On return: safe to release, and the copy is complete.
  EXPECT_TRUE(bridge->safe_to_release_host(e));
  EXPECT_EQ(bridge->copy_status(e).state, CopyState::Completed);
  const auto calls = fake->calls();
  ASSERT_EQ(calls.size(), 1u) << describe_calls(calls);
  EXPECT_EQ(calls[0].call, Call::CopyHostToDevice);
  EXPECT_EQ(calls[0].mode, CopyMode::Sync);
  EXPECT_EQ(calls[0].host_offset, range.offset);
  EXPECT_EQ(calls[0].device_offset, 128u);
  EXPECT_EQ(calls[0].bytes, 300u);
  bridge->release_host(range);
  // Exactly [128, 428) changed.
  const auto after = device_contents(h, 0, 1024);
  EXPECT_TRUE(std::equal(after.begin(), after.begin() + 128, device_before.begin()));
  EXPECT_TRUE(std::equal(after.begin() + 128, after.begin() + 428, data.begin()));
  EXPECT_TRUE(std::equal(after.begin() + 428, after.end(), device_before.begin() + 428));
  EXPECT_EQ(bridge->stats().copy_records, 0u);
}

TEST_F(CopyTest, SyncDeviceToHostMakesExactBytesValidOnReturn) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 1024);
  std::vector<std::byte> data;
  const HostRange in = filled_range(1024, 12, &data);
  bridge->host_to_device(in, DeviceRange{h, 0, 1024}, CopyMode::Sync);
  bridge->release_host(in);
  const HostRange out = bridge->reserve(512);
  const auto out_before = host_contents(out);
  fake->clear_calls();
  const CopyEvent e = bridge->device_to_host(DeviceRange{h, 256, 200}, HostRange{out.offset + 100, 200}, CopyMode::Sync);
  EXPECT_TRUE(bridge->host_bytes_valid(e));
  const auto calls = fake->calls();
  ASSERT_EQ(calls.size(), 1u) << describe_calls(calls);
  EXPECT_EQ(calls[0].call, Call::CopyDeviceToHost);
  EXPECT_EQ(calls[0].host_offset, out.offset + 100);
  EXPECT_EQ(calls[0].device_offset, 256u);
  EXPECT_EQ(calls[0].bytes, 200u);
  const auto got = host_contents(out);
  EXPECT_TRUE(std::equal(got.begin(), got.begin() + 100, out_before.begin()));
  EXPECT_TRUE(std::equal(got.begin() + 100, got.begin() + 300, data.begin() + 256));
  EXPECT_TRUE(std::equal(got.begin() + 300, got.end(), out_before.begin() + 300));
}

// ---- async ------------------------------------------------------------------

TEST_F(CopyTest, AsyncHostToDeviceIsSafeToReleaseOnlyAfterCompletion) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 512);
  std::vector<std::byte> data;
  const HostRange range = filled_range(512, 13, &data);
  fake->clear_calls();
  const CopyEvent e = bridge->host_to_device(range, DeviceRange{h, 0, 512}, CopyMode::Async);
  EXPECT_EQ(e.domain, bridge->domain());
  EXPECT_EQ(e.generation, bridge->generation());
  const auto calls = fake->calls();
  ASSERT_EQ(calls.size(), 1u) << describe_calls(calls);
  EXPECT_EQ(calls[0].mode, CopyMode::Async);
  EXPECT_EQ(calls[0].event, e);
  EXPECT_EQ(bridge->copy_status(e).state, CopyState::Pending);
  EXPECT_FALSE(bridge->safe_to_release_host(e));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->release_host(range));
  EXPECT_EQ(bridge->stats().copies_in_flight, 1u);
  EXPECT_EQ(bridge->stats().inflight_bytes, 512u);
  EXPECT_EQ(bridge->poll(), 0u);
  EXPECT_FALSE(bridge->safe_to_release_host(e));
  ASSERT_TRUE(fake->complete(e));
  EXPECT_EQ(bridge->poll(), 1u);
  EXPECT_TRUE(bridge->safe_to_release_host(e));
  EXPECT_EQ(bridge->copy_status(e).state, CopyState::Completed);
  EXPECT_EQ(bridge->stats().inflight_bytes, 0u);
  bridge->release_host(range);
  EXPECT_EQ(device_contents(h, 0, 512), data);
}

// A copy that ended in the backend holds nothing, whether or not the caller
// asked the bridge about it since: release_host and free_device apply the
// completions waiting in the backend before refusing (a thread releasing
// what another's completion freed was refused, and a reserve waiting for
// that room waited for good).
TEST_F(CopyTest, ReleaseAndFreeAfterACompletionNobodyPolledSucceed) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 512);
  const HostRange range = filled_range(512, 15);
  const CopyEvent e = bridge->host_to_device(range, DeviceRange{h, 0, 512}, CopyMode::Async);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->release_host(range));  // still in flight
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->free_device(h));
  ASSERT_TRUE(fake->complete(e));  // ended in the backend; nothing polled since
  bridge->release_host(range);
  bridge->free_device(h);
  EXPECT_EQ(bridge->stats().copies_in_flight, 0u);
  EXPECT_EQ(bridge->stats().live_allocations, 0u);
  EXPECT_EQ(bridge->stats().ring_reservations, 0u);
}

// The same for unregister_host: a copy from registered memory that ended
// unpolled does not keep the region registered.
TEST_F(CopyTest, UnregisterAfterACompletionNobodyPolledSucceeds) {
  std::vector<std::byte> memory(4096, std::byte{7});
  const HostRegion region = bridge->register_host(memory);
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 4096);
  const CopyEvent e =
      bridge->host_to_device(RegionRange{region, 0, 4096}, DeviceRange{h, 0, 4096}, CopyMode::Async);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->unregister_host(region));  // still in flight
  ASSERT_TRUE(fake->complete(e));  // ended in the backend; nothing polled since
  bridge->unregister_host(region);
  EXPECT_EQ(bridge->stats().host_regions, 0u);
  EXPECT_EQ(bridge->stats().copies_in_flight, 0u);
  bridge->free_device(h);
}

// And for axpy: an upload into y that ended unpolled does not refuse the
// launch (it did, though free_device in the same state succeeded).
TEST_F(CopyTest, AxpyAfterAnUploadNobodyPolledRuns) {
  const ObjectSpec spec{4096, 256, DType::Float32};
  const DeviceHandle x = bridge->alloc_device(spec, 512), y = bridge->alloc_device(spec, 512);
  const HostRange range = filled_range(512, 9);
  const CopyEvent e = bridge->host_to_device(range, DeviceRange{y, 0, 512}, CopyMode::Async);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse,
                         bridge->launch_axpy(DeviceRange{x, 0, 512}, DeviceRange{y, 0, 512}, 2.0f, 1.0f));
  ASSERT_TRUE(fake->complete(e));  // ended in the backend; nothing polled since
  bridge->launch_axpy(DeviceRange{x, 0, 512}, DeviceRange{y, 0, 512}, 2.0f, 1.0f);
  EXPECT_EQ(bridge->stats().copies_in_flight, 0u);
  bridge->release_host(range);
}

TEST_F(CopyTest, ADownloadStillInFlightKeepsRefusingAfterOthersComplete) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 512);
  const HostRange first = bridge->reserve(256), second = bridge->reserve(256);
  const CopyEvent done = bridge->device_to_host(DeviceRange{h, 0, 256}, first, CopyMode::Async);
  const CopyEvent pending = bridge->device_to_host(DeviceRange{h, 256, 256}, second, CopyMode::Async);
  ASSERT_TRUE(fake->complete(done));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->release_host(second));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->free_device(h));
  bridge->release_host(first);  // its completion was applied by the refused calls above
  ASSERT_TRUE(fake->complete(pending));
  bridge->release_host(second);
  bridge->free_device(h);
  EXPECT_EQ(bridge->stats().live_allocations, 0u);
}

TEST_F(CopyTest, AsyncDeviceToHostBytesBecomeValidAtCompletion) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 256);
  std::vector<std::byte> data;
  const HostRange in = filled_range(256, 14, &data);
  bridge->host_to_device(in, DeviceRange{h, 0, 256}, CopyMode::Sync);
  const HostRange out = bridge->reserve(256);
  const auto before = host_contents(out);
  const CopyEvent e = bridge->device_to_host(DeviceRange{h, 0, 256}, out, CopyMode::Async);
  EXPECT_FALSE(bridge->host_bytes_valid(e));
  EXPECT_EQ(host_contents(out), before);  // not written yet
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->release_host(out));
  complete(e);
  EXPECT_TRUE(bridge->host_bytes_valid(e));
  EXPECT_EQ(host_contents(out), data);
  bridge->release_host(out);
}

TEST_F(CopyTest, WaitReturnsPendingOnTimeoutAndCompletedWhenAnotherThreadCompletes) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  const HostRange range = filled_range(64, 15);
  const CopyEvent e = bridge->host_to_device(range, DeviceRange{h, 0, 64}, CopyMode::Async);
  EXPECT_EQ(bridge->wait(e, std::chrono::nanoseconds(0)).state, CopyState::Pending);
  EXPECT_EQ(bridge->wait(e, std::chrono::microseconds(100)).state, CopyState::Pending);
  std::thread completer([&] { fake->complete(e); });
  const CopyStatus status = bridge->wait(e);  // no timeout: until it completes
  completer.join();
  EXPECT_EQ(status.state, CopyState::Completed);
  EXPECT_TRUE(bridge->safe_to_release_host(e));
}

TEST_F(CopyTest, AutoCompletedAsyncCopyCompletesWithoutTheTest) {
  fake->set_auto_complete(true);
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  std::vector<std::byte> data;
  const HostRange range = filled_range(64, 16, &data);
  const CopyEvent e = bridge->host_to_device(range, DeviceRange{h, 0, 64}, CopyMode::Async);
  EXPECT_EQ(bridge->wait(e).state, CopyState::Completed);
  EXPECT_EQ(device_contents(h, 0, 64), data);
}

// ---- range validation --------------------------------------------------------

TEST_F(CopyTest, DeviceRangeOutsideExtentIsInvalidRange) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 256);
  const HostRange range = filled_range(128, 17);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange,
                         bridge->host_to_device(range, DeviceRange{h, 192, 128}, CopyMode::Sync));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange,
                         bridge->device_to_host(DeviceRange{h, 256, 128}, range, CopyMode::Async));
  EXPECT_CALLS(fake, Call::Allocate);
}

TEST_F(CopyTest, OverflowingOffsetsAreInvalidRangeNotWrapped) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 256);
  const HostRange range = filled_range(128, 18);
  fake->clear_calls();
  // offset + len wraps to a small number; it must not pass as in range.
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange,
                         bridge->host_to_device(range, DeviceRange{h, UINT64_MAX - 63, 128}, CopyMode::Sync));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange,
                         bridge->host_to_device(range, DeviceRange{h, UINT64_MAX, 128}, CopyMode::Async));
  EXPECT_DEVBRIDGE_ERROR(
      ErrorKind::InvalidRange,
      bridge->host_to_device(HostRange{UINT64_MAX - 63, 128}, DeviceRange{h, 0, 128}, CopyMode::Sync));
  EXPECT_DEVBRIDGE_ERROR(
      ErrorKind::InvalidRange,
      bridge->device_to_host(DeviceRange{h, 0, 128}, HostRange{UINT64_MAX, 128}, CopyMode::Async));
  EXPECT_DEVBRIDGE_ERROR(
      ErrorKind::InvalidRange,
      bridge->device_to_host(DeviceRange{h, 0, UINT64_MAX}, HostRange{range.offset, UINT64_MAX}, CopyMode::Sync));
  EXPECT_CALLS(fake);
  EXPECT_EQ(bridge->stats().copies_submitted, 0u);
}

TEST_F(CopyTest, HostRangeMustBeInsideTheRingAndReserved) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 256);
  const HostRange range = filled_range(128, 19);
  fake->clear_calls();
  // Past the ring.
  EXPECT_DEVBRIDGE_ERROR(
      ErrorKind::InvalidRange,
      bridge->host_to_device(HostRange{bridge->ring_capacity() - 64, 128}, DeviceRange{h, 0, 128}, CopyMode::Sync));
  // Inside the ring but not reserved.
  EXPECT_DEVBRIDGE_ERROR(
      ErrorKind::InvalidRange,
      bridge->host_to_device(HostRange{range.offset + 4096, 128}, DeviceRange{h, 0, 128}, CopyMode::Sync));
  // Starting inside the reservation but running past it.
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange,
                         bridge->host_to_device(HostRange{range.offset + 64, 128}, DeviceRange{h, 0, 128},
                                                CopyMode::Sync));
  // Once released, no longer reserved.
  bridge->release_host(range);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange,
                         bridge->device_to_host(DeviceRange{h, 0, 128}, range, CopyMode::Sync));
  EXPECT_CALLS(fake);
}

TEST_F(CopyTest, SubRangeOfAReservationIsAccepted) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 256);
  std::vector<std::byte> data;
  const HostRange range = filled_range(256, 20, &data);
  bridge->host_to_device(HostRange{range.offset + 64, 64}, DeviceRange{h, 0, 64}, CopyMode::Sync);
  const auto got = device_contents(h, 0, 64);
  EXPECT_TRUE(std::equal(got.begin(), got.end(), data.begin() + 64));
}

TEST_F(CopyTest, UnequalLengthsAreInvalidRange) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 256);
  const HostRange range = filled_range(128, 21);
  fake->clear_calls();
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange,
                         bridge->host_to_device(range, DeviceRange{h, 0, 64}, CopyMode::Sync));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange,
                         bridge->device_to_host(DeviceRange{h, 0, 128}, HostRange{range.offset, 64}, CopyMode::Async));
  EXPECT_CALLS(fake);
}

// ---- failures lose nothing -----------------------------------------------------

TEST_F(CopyTest, HostToDeviceFailingAtSubmitIsDeviceCopyFailedAndTheDataCanBeRetried) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 256);
  std::vector<std::byte> data;
  const HostRange range = filled_range(256, 22, &data);
  fake->clear_calls();
  fake->inject(Call::CopyHostToDevice, Failure::CopyFailedAtSubmit);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::DeviceCopyFailed,
                         bridge->host_to_device(range, DeviceRange{h, 0, 256}, CopyMode::Sync));
  EXPECT_FALSE(bridge->stats().broken);
  EXPECT_EQ(host_contents(range), data);  // still owned, still intact
  const CopyEvent retry = bridge->host_to_device(range, DeviceRange{h, 0, 256}, CopyMode::Sync);
  EXPECT_TRUE(bridge->safe_to_release_host(retry));
  EXPECT_CALLS(fake, Call::CopyHostToDevice, Call::CopyHostToDevice);
  bridge->release_host(range);
  EXPECT_EQ(device_contents(h, 0, 256), data);
}

TEST_F(CopyTest, AsyncHostToDeviceFailingAtSubmitLeavesNoRecordAndNoPin) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 256);
  const HostRange range = filled_range(256, 23);
  fake->inject(Call::CopyHostToDevice, Failure::CopyFailedAtSubmit);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::DeviceCopyFailed,
                         bridge->host_to_device(range, DeviceRange{h, 0, 256}, CopyMode::Async));
  const BridgeStats stats = bridge->stats();
  EXPECT_EQ(stats.copies_in_flight, 0u);
  EXPECT_EQ(stats.inflight_bytes, 0u);
  bridge->free_device(h);  // not pinned by the failed copy
  bridge->release_host(range);
}

TEST_F(CopyTest, DeviceToHostFailingAtSubmitIsOutputCopyFailed) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 256);
  const HostRange out = bridge->reserve(256);
  const auto before = host_contents(out);
  fake->inject(Call::CopyDeviceToHost, Failure::CopyFailedAtSubmit);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OutputCopyFailed,
                         bridge->device_to_host(DeviceRange{h, 0, 256}, out, CopyMode::Sync));
  EXPECT_EQ(host_contents(out), before);
  bridge->device_to_host(DeviceRange{h, 0, 256}, out, CopyMode::Sync);
  bridge->release_host(out);
}

TEST_F(CopyTest, HostToDeviceFailingAtCompletionIsDeviceCopyFailedAndTheDataCanBeRetried) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 256);
  const auto device_before = device_contents(h, 0, 256);
  std::vector<std::byte> data;
  const HostRange range = filled_range(256, 24, &data);
  fake->clear_calls();
  fake->inject(Call::CopyHostToDevice, Failure::CopyFailedAtCompletion);
  const CopyEvent e = bridge->host_to_device(range, DeviceRange{h, 0, 256}, CopyMode::Async);
  complete(e);
  const CopyStatus status = bridge->copy_status(e);
  EXPECT_EQ(status.state, CopyState::Failed);
  ASSERT_TRUE(status.error.has_value());
  EXPECT_EQ(*status.error, ErrorKind::DeviceCopyFailed);
  EXPECT_FALSE(status.message.empty());
  EXPECT_EQ(bridge->stats().copies_failed, 1u);
  EXPECT_EQ(bridge->stats().copies_in_flight, 0u);
  EXPECT_EQ(device_contents(h, 0, 256), device_before);
  EXPECT_EQ(host_contents(range), data);  // the range is still the caller's
  const CopyEvent retry = bridge->host_to_device(range, DeviceRange{h, 0, 256}, CopyMode::Async);
  complete(retry);
  EXPECT_EQ(bridge->copy_status(retry).state, CopyState::Completed);
  EXPECT_EQ(device_contents(h, 0, 256), data);
  bridge->release_host(range);
  const auto kinds = call_kinds(fake->calls());
  EXPECT_EQ(std::count(kinds.begin(), kinds.end(), Call::CopyHostToDevice), 2);
}

TEST_F(CopyTest, DeviceToHostFailingAtCompletionIsOutputCopyFailedAndBytesAreNotValid) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 256);
  std::vector<std::byte> data;
  const HostRange in = filled_range(256, 25, &data);
  bridge->host_to_device(in, DeviceRange{h, 0, 256}, CopyMode::Sync);
  const HostRange out = bridge->reserve(256);
  const auto before = host_contents(out);
  const CopyEvent e = bridge->device_to_host(DeviceRange{h, 0, 256}, out, CopyMode::Async);
  complete(e, /*ok=*/false);
  const CopyStatus status = bridge->copy_status(e);
  EXPECT_EQ(status.state, CopyState::Failed);
  ASSERT_TRUE(status.error.has_value());
  EXPECT_EQ(*status.error, ErrorKind::OutputCopyFailed);
  EXPECT_FALSE(bridge->host_bytes_valid(e));
  EXPECT_EQ(host_contents(out), before);
  // Retry into the same, still reserved, range.
  const CopyEvent retry = bridge->device_to_host(DeviceRange{h, 0, 256}, out, CopyMode::Sync);
  EXPECT_TRUE(bridge->host_bytes_valid(retry));
  EXPECT_EQ(host_contents(out), data);
  bridge->release_host(out);
}

TEST_F(CopyTest, FatalCopyFailureLeavesTheBridgeBroken) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  const HostRange range = filled_range(64, 26);
  fake->inject(Call::CopyHostToDevice, Failure::Fatal);
  EXPECT_ANY_THROW(bridge->host_to_device(range, DeviceRange{h, 0, 64}, CopyMode::Sync));
  EXPECT_TRUE(bridge->stats().broken);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Broken,
                         bridge->host_to_device(range, DeviceRange{h, 0, 64}, CopyMode::Sync));
}

// ---- stale and unknown completions ---------------------------------------------

TEST_F(CopyTest, UnknownCompletionIsCountedAndNeverApplied) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  const HostRange range = filled_range(64, 27);
  const CopyEvent e = bridge->host_to_device(range, DeviceRange{h, 0, 64}, CopyMode::Async);
  fake->report_completion(CopyEvent{e.domain, e.generation, e.id + 1000});  // unknown id
  fake->report_completion(CopyEvent{e.domain + 1, e.generation, e.id});     // another bridge's
  fake->report_completion(CopyEvent{e.domain, e.generation + 1, e.id});     // a future generation
  ::testing::internal::CaptureStderr();
  bridge->poll();
  const std::string logged = ::testing::internal::GetCapturedStderr();
  // Each line says why: the bridge's own domain and generation alone read as a mismatch that was not there.
  EXPECT_NE(logged.find("no copy in flight has it"), std::string::npos) << logged;
  EXPECT_NE(logged.find("another bridge's (this is domain " + std::to_string(e.domain) + ")"), std::string::npos)
      << logged;
  EXPECT_NE(logged.find("of generation " + std::to_string(e.generation + 1) + ", not this one"), std::string::npos)
      << logged;
  EXPECT_EQ(bridge->stats().stale_completions, 3u);
  EXPECT_EQ(bridge->copy_status(e).state, CopyState::Pending);
  EXPECT_FALSE(bridge->safe_to_release_host(e));
  complete(e);
  EXPECT_EQ(bridge->copy_status(e).state, CopyState::Completed);
  EXPECT_EQ(bridge->stats().stale_completions, 3u);
}

TEST_F(CopyTest, DuplicatedCompletionIsCountedOnce) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  const HostRange range = filled_range(64, 28);
  fake->inject(Call::CopyHostToDevice, Failure::DuplicatedCompletion);
  const CopyEvent e = bridge->host_to_device(range, DeviceRange{h, 0, 64}, CopyMode::Async);
  complete(e);
  bridge->poll();
  EXPECT_EQ(bridge->copy_status(e).state, CopyState::Completed);
  EXPECT_EQ(bridge->stats().copies_completed, 1u);
  EXPECT_EQ(bridge->stats().stale_completions, 1u);
  EXPECT_EQ(bridge->stats().copy_records, 0u);
}

TEST_F(CopyTest, CompletionOfAnAlreadyFailedCopyIsStale) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  const HostRange range = filled_range(64, 29);
  const CopyEvent e = bridge->host_to_device(range, DeviceRange{h, 0, 64}, CopyMode::Async);
  complete(e, false);
  fake->report_completion(e, true);
  bridge->poll();
  EXPECT_EQ(bridge->copy_status(e).state, CopyState::Failed);
  EXPECT_EQ(bridge->stats().stale_completions, 1u);
}

// ---- retirement -----------------------------------------------------------------

TEST_F(CopyTest, CompletedRecordsAreRetired) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  const HostRange range = filled_range(64, 30);
  for (int i = 0; i < 200; ++i) {
    const CopyEvent e = bridge->host_to_device(range, DeviceRange{h, 0, 64}, CopyMode::Async);
    EXPECT_EQ(bridge->stats().copy_records, 1u);
    complete(e);
    EXPECT_EQ(bridge->copy_status(e).state, CopyState::Completed);  // still answerable after retirement
  }
  EXPECT_EQ(bridge->stats().copy_records, 0u);
  EXPECT_EQ(bridge->stats().copies_completed, 200u);
  bridge->release_host(range);
}

TEST_F(CopyTest, InFlightCopyIsNeverRetired) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  const HostRange range = filled_range(64, 31);
  fake->inject(Call::CopyHostToDevice, Failure::LostCompletion);
  const CopyEvent lost = bridge->host_to_device(range, DeviceRange{h, 0, 64}, CopyMode::Async);
  fake->complete_all();
  bridge->poll();
  // The completion never came: the copy stays pending, the range stays pinned.
  EXPECT_EQ(bridge->copy_status(lost).state, CopyState::Pending);
  EXPECT_EQ(bridge->stats().copy_records, 1u);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->release_host(range));
}

// ---- backpressure -----------------------------------------------------------------

class BackpressureTest : public BridgeTest {
 protected:
  void SetUp() override {
    BridgeOptions options = default_options();
    options.inflight_budget_bytes = 1024;
    rebuild(options);
  }
};

TEST_F(BackpressureTest, AsyncBeyondBudgetIsBackpressureAndReachesNoBackend) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 2048);
  const HostRange a = filled_range(1024, 32);
  const HostRange b = filled_range(64, 33);
  const CopyEvent e = bridge->host_to_device(a, DeviceRange{h, 0, 1024}, CopyMode::Async);
  EXPECT_EQ(bridge->stats().inflight_budget_bytes, 1024u);
  fake->clear_calls();
  const std::string message = EXPECT_DEVBRIDGE_ERROR(
      ErrorKind::Backpressure, bridge->host_to_device(b, DeviceRange{h, 1024, 64}, CopyMode::Async));
  EXPECT_FALSE(message.empty());
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Backpressure,
                         bridge->device_to_host(DeviceRange{h, 1024, 64}, b, CopyMode::Async));
  EXPECT_CALLS(fake);
  // A sync copy is not in flight after it returns; it is not refused.
  bridge->host_to_device(b, DeviceRange{h, 1024, 64}, CopyMode::Sync);
  complete(e);
  const CopyEvent admitted = bridge->host_to_device(b, DeviceRange{h, 1024, 64}, CopyMode::Async);
  complete(admitted);
}

TEST_F(BackpressureTest, BoundedWaitForRoomSucceedsWhenAnotherThreadCompletes) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 2048);
  const HostRange a = filled_range(1024, 34);
  std::vector<std::byte> data;
  const HostRange b = filled_range(512, 35, &data);
  const CopyEvent first = bridge->host_to_device(a, DeviceRange{h, 0, 1024}, CopyMode::Async);
  std::atomic<bool> started{false};
  std::thread completer([&] {
    while (!started.load()) std::this_thread::yield();
    fake->complete(first);
  });
  started = true;
  // Generous bound: the test never depends on timing, only on the completer.
  const CopyEvent second = bridge->host_to_device(b, DeviceRange{h, 1024, 512}, CopyMode::Async,
                                                  Admission{std::chrono::seconds(60)});
  completer.join();
  EXPECT_EQ(bridge->copy_status(first).state, CopyState::Completed);
  complete(second);
  EXPECT_EQ(device_contents(h, 1024, 512), data);
}

TEST_F(BackpressureTest, BoundedWaitTimesOutAsBackpressure) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 2048);
  const HostRange a = filled_range(1024, 36);
  const HostRange b = filled_range(64, 37);
  bridge->host_to_device(a, DeviceRange{h, 0, 1024}, CopyMode::Async);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Backpressure,
                         bridge->host_to_device(b, DeviceRange{h, 1024, 64}, CopyMode::Async,
                                                Admission{std::chrono::milliseconds(1)}));
}

TEST_F(BackpressureTest, CopyLargerThanTheWholeBudgetIsRefused) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 4096);
  const HostRange a = filled_range(2048, 38);
  EXPECT_ANY_THROW(bridge->host_to_device(a, DeviceRange{h, 0, 2048}, CopyMode::Async));
  EXPECT_CALLS(fake, Call::Allocate);
}

}  // namespace
}  // namespace devbridge::testing
