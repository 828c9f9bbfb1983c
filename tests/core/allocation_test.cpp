// CONTRACT.md "Allocation": validation before the backend, backend refusal,
// generation ownership, strict free and deferred release.
#include <gtest/gtest.h>

#include <set>

#include "support.hpp"

namespace devbridge::testing {
namespace {

using AllocationTest = BridgeTest;

TEST_F(AllocationTest, ValidAllocationCallsBackendOnceWithExactArguments) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(4096, 128), 1024);
  EXPECT_EQ(bridge->extent(h), 1024u);
  EXPECT_EQ(bridge->spec(h).alignment, 128u);
  const auto calls = fake->calls();
  ASSERT_EQ(calls.size(), 1u) << describe_calls(calls);
  EXPECT_EQ(calls[0].call, Call::Allocate);
  EXPECT_EQ(calls[0].bytes, 1024u);
  EXPECT_EQ(calls[0].alignment, 128u);
  EXPECT_EQ(calls[0].address % 128, 0u);
  EXPECT_EQ(fake->live_allocations(), 1u);
  EXPECT_EQ(bridge->stats().live_allocations, 1u);
  EXPECT_EQ(bridge->stats().allocated_bytes, 1024u);
}

TEST_F(AllocationTest, ZeroAlignmentIsInvalidAlignment) {
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidAlignment, bridge->alloc_device(bytes_spec(4096, 0), 64));
  EXPECT_CALLS(fake);
}

TEST_F(AllocationTest, NonPowerOfTwoAlignmentIsInvalidAlignment) {
  const std::string message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidAlignment,
                                                     bridge->alloc_device(bytes_spec(4096, 3), 63));
  EXPECT_NE(message.find('3'), std::string::npos) << message;
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidAlignment, bridge->alloc_device(bytes_spec(4096, 96), 96));
  EXPECT_CALLS(fake);
}

TEST_F(AllocationTest, ZeroExtentIsInvalidExtent) {
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidExtent, bridge->alloc_device(bytes_spec(4096, 64), 0));
  EXPECT_CALLS(fake);
}

TEST_F(AllocationTest, ExtentOverMaxIsInvalidExtent) {
  const std::string message =
      EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidExtent, bridge->alloc_device(bytes_spec(4096, 64), 4160));
  EXPECT_NE(message.find("4160"), std::string::npos) << message;
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidExtent, bridge->alloc_device(bytes_spec(4096, 64), UINT64_MAX & ~63ull));
  EXPECT_CALLS(fake);
}

TEST_F(AllocationTest, ExtentNotMultipleOfAlignmentIsInvalidExtent) {
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidExtent, bridge->alloc_device(bytes_spec(4096, 64), 96));
  EXPECT_CALLS(fake);
}

TEST_F(AllocationTest, ExtentNotMultipleOfDTypeSizeIsInvalidExtent) {
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidExtent, bridge->alloc_device(float_spec(4096, 2), 6));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidExtent,
                         bridge->alloc_device(ObjectSpec{4096, 1, DType::Float64, ShapeKind::Vector}, 12));
  EXPECT_CALLS(fake);
  // The same sizes are fine where the dtype divides them.
  const DeviceHandle h = bridge->alloc_device(ObjectSpec{4096, 2, DType::Float16, ShapeKind::Vector}, 6);
  bridge->free_device(h);
}

TEST_F(AllocationTest, BackendRefusalIsAllocationFailedWithBytesAskedAndFree) {
  rebuild(default_options(), /*device_memory=*/100000);
  const std::string message =
      EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationFailed, bridge->alloc_device(bytes_spec(1 << 20, 64), 200000));
  EXPECT_NE(message.find("200000"), std::string::npos) << message;
  EXPECT_NE(message.find("100000"), std::string::npos) << message;
  // Out of memory is retried once, after the bridge has reclaimed what it can.
  EXPECT_CALLS(fake, Call::Allocate, Call::Allocate);
  EXPECT_EQ(bridge->memory_stats().oom_failures, 1u);
  EXPECT_EQ(bridge->stats().live_allocations, 0u);
  EXPECT_EQ(fake->live_allocations(), 0u);
}

TEST_F(AllocationTest, InjectedAllocationFailureLeavesNothingBehind) {
  // The second allocation fails, and so does its one retry.
  fake->inject(Call::Allocate, Failure::AllocationFailed, 2);
  fake->inject(Call::Allocate, Failure::AllocationFailed, 3);
  const DeviceHandle first = bridge->alloc_device(bytes_spec(), 64);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationFailed, bridge->alloc_device(bytes_spec(), 128));
  const DeviceHandle third = bridge->alloc_device(bytes_spec(), 192);
  EXPECT_EQ(bridge->stats().live_allocations, 2u);
  EXPECT_FALSE(bridge->stats().broken);
  bridge->free_device(first);
  bridge->free_device(third);
  const auto calls = fake->calls();
  ASSERT_EQ(call_kinds(calls), (std::vector<Call>{Call::Allocate, Call::Allocate, Call::Allocate, Call::Allocate,
                                                  Call::Free, Call::Free}))
      << describe_calls(calls);
  EXPECT_EQ(calls[1].bytes, 128u);
  EXPECT_EQ(calls[2].bytes, 128u);
  EXPECT_EQ(calls[4].address, calls[0].address);
  EXPECT_EQ(calls[5].address, calls[3].address);
}

TEST_F(AllocationTest, HandleBelongsToTheCurrentGenerationAndDomain) {
  std::set<std::uint64_t> ids;
  for (int i = 0; i < 50; ++i) {
    const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
    EXPECT_EQ(h.generation, bridge->generation());
    EXPECT_EQ(h.domain, bridge->domain());
    EXPECT_TRUE(ids.insert(h.id).second) << "id " << h.id << " reused";
    bridge->free_device(h);  // freed ids are not reused either
  }
}

TEST_F(AllocationTest, FreeTwiceIsUnknownDeviceHandle) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  bridge->free_device(h);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->free_device(h));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->extent(h));
  EXPECT_CALLS(fake, Call::Allocate, Call::Free);
}

TEST_F(AllocationTest, ForgedIdIsUnknownDeviceHandle) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  DeviceHandle forged = h;
  forged.id += 1000;
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->free_device(forged));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->release(forged));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->extent(forged));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->spec(forged));
  const DeviceHandle zero{};
  EXPECT_NE(zero, h);
  EXPECT_ANY_THROW(bridge->free_device(zero));
  EXPECT_EQ(fake->live_allocations(), 1u);
}

TEST_F(AllocationTest, StrictFreeRefusedWhileAsyncCopyInFlightAndNothingChanges) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 256);
  const HostRange range = filled_range(256, 1);
  const CopyEvent e = bridge->host_to_device(range, DeviceRange{h, 0, 256}, CopyMode::Async);
  fake->clear_calls();
  const BridgeStats before = bridge->stats();
  const std::string message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->free_device(h));
  EXPECT_FALSE(message.empty());
  EXPECT_CALLS(fake);
  const BridgeStats after = bridge->stats();
  EXPECT_EQ(after.live_allocations, before.live_allocations);
  EXPECT_EQ(after.copies_in_flight, 1u);
  EXPECT_EQ(bridge->extent(h), 256u);  // still usable
  complete(e);
  bridge->free_device(h);
  EXPECT_CALLS(fake, Call::Free);
  EXPECT_EQ(fake->live_allocations(), 0u);
  bridge->release_host(range);
}

TEST_F(AllocationTest, StrictFreeRefusedWhileStepRuns) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  const DeviceHandle handles[] = {h};
  bridge->begin_step(7, handles);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->free_device(h));
  EXPECT_EQ(fake->live_allocations(), 1u);
  bridge->end_step(7);
  bridge->free_device(h);
  EXPECT_EQ(fake->live_allocations(), 0u);
}

TEST_F(AllocationTest, StrictFreeRefusedWhileViewLives) {
  const DeviceHandle h = bridge->alloc_device(float_spec(), 64);
  ViewLease lease = bridge->view(h, ViewSpec{DType::Float32, {16}, std::nullopt, 0});
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->free_device(h));
  EXPECT_EQ(fake->live_allocations(), 1u);
  lease.reset();
  bridge->free_device(h);
  EXPECT_EQ(fake->live_allocations(), 0u);
}

TEST_F(AllocationTest, ReleaseWithNothingInUseFreesAtOnce) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  bridge->release(h);
  EXPECT_CALLS(fake, Call::Allocate, Call::Free);
  EXPECT_EQ(fake->live_allocations(), 0u);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->release(h));
}

TEST_F(AllocationTest, DeferredReleaseWaitsForTheLastCopyAndTheHandleIsDeadAtOnce) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 512);
  const HostRange a = filled_range(256, 2);
  const HostRange b = filled_range(256, 3);
  const CopyEvent e1 = bridge->host_to_device(a, DeviceRange{h, 0, 256}, CopyMode::Async);
  const CopyEvent e2 = bridge->host_to_device(b, DeviceRange{h, 256, 256}, CopyMode::Async);
  fake->clear_calls();
  bridge->release(h);
  EXPECT_CALLS(fake);  // not freed yet
  // Unusable from this moment.
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->extent(h));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle,
                         bridge->device_to_host(DeviceRange{h, 0, 64}, bridge->reserve(64), CopyMode::Sync));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle,
                         bridge->view(h, ViewSpec{DType::UInt8, {64}, std::nullopt, 0}, ViewWait::Wait));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->free_device(h));
  const DeviceHandle handles[] = {h};
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->begin_step(1, handles));
  complete(e1);
  EXPECT_EQ(fake->live_allocations(), 1u);
  complete(e2);
  EXPECT_EQ(fake->live_allocations(), 0u);
  EXPECT_CALLS(fake, Call::Free);
  EXPECT_EQ(bridge->copy_status(e2).state, CopyState::Completed);
}

TEST_F(AllocationTest, DeferredReleaseWaitsForTheStep) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  const DeviceHandle handles[] = {h};
  bridge->begin_step(3, handles);
  bridge->release(h);
  EXPECT_EQ(fake->live_allocations(), 1u);
  bridge->end_step(3);
  EXPECT_EQ(fake->live_allocations(), 0u);
}

TEST_F(AllocationTest, DeferredReleaseWaitsForTheView) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  ViewLease lease = bridge->view(h, ViewSpec{DType::UInt8, {64}, std::nullopt, 0});
  bridge->release(h);
  EXPECT_EQ(fake->live_allocations(), 1u);
  EXPECT_EQ(lease->handle, h);
  lease.reset();
  EXPECT_EQ(fake->live_allocations(), 0u);
}

TEST_F(AllocationTest, DeferredReleaseAfterFailedCopyStillFrees) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  const HostRange range = filled_range(64, 4);
  fake->inject(Call::CopyHostToDevice, Failure::CopyFailedAtCompletion);
  const CopyEvent e = bridge->host_to_device(range, DeviceRange{h, 0, 64}, CopyMode::Async);
  bridge->release(h);
  EXPECT_EQ(fake->live_allocations(), 1u);
  complete(e);
  EXPECT_EQ(bridge->copy_status(e).state, CopyState::Failed);
  EXPECT_EQ(fake->live_allocations(), 0u);
}

}  // namespace
}  // namespace devbridge::testing
