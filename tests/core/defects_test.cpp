// One test per "defect of the reference implementation" in CONTRACT.md,
// proving devbridge does not have it.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "support.hpp"

namespace devbridge::testing {
namespace {

using DefectTest = BridgeTest;

// 1. Copy events carry no generation and ids restart after a restart, so a
//    stale event reads as complete for a new copy.
TEST_F(DefectTest, Defect1_StaleEventNeverReadsAsCompleteForANewCopy) {
  const DeviceHandle h1 = bridge->alloc_device(bytes_spec(), 64);
  const HostRange range = filled_range(64, 71);
  const CopyEvent old_event = bridge->host_to_device(range, DeviceRange{h1, 0, 64}, CopyMode::Async);
  complete(old_event);
  ASSERT_EQ(bridge->copy_status(old_event).state, CopyState::Completed);
  bridge->restart(2);
  const DeviceHandle h2 = bridge->alloc_device(bytes_spec(), 64);
  const CopyEvent new_event = bridge->host_to_device(range, DeviceRange{h2, 0, 64}, CopyMode::Async);
  EXPECT_NE(new_event, old_event);
  EXPECT_EQ(new_event.generation, 2u);
  // The old event is refused, never "completed"; the new copy is pending.
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, bridge->copy_status(old_event));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, bridge->safe_to_release_host(old_event));
  EXPECT_EQ(bridge->copy_status(new_event).state, CopyState::Pending);
  // Even an event forged with the new copy's id but the old generation.
  const CopyEvent forged{new_event.domain, 1, new_event.id};
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, bridge->host_bytes_valid(forged));
  EXPECT_FALSE(bridge->safe_to_release_host(new_event));
  complete(new_event);
  EXPECT_TRUE(bridge->safe_to_release_host(new_event));
}

// 2. A late completion from the old worker completes the new generation's
//    copy; the allocation can then be freed under a running copy.
TEST_F(DefectTest, Defect2_LateCompletionFromTheOldWorkerNeverCompletesANewCopy) {
  const DeviceHandle old_handle = bridge->alloc_device(bytes_spec(), 64);
  const HostRange range = filled_range(64, 72);
  fake->inject(Call::CopyHostToDevice, Failure::LateCompletion);
  const CopyEvent old_event = bridge->host_to_device(range, DeviceRange{old_handle, 0, 64}, CopyMode::Async);
  bridge->restart(2);  // the late copy survives quiesce in the fake
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  // The new copy's submission releases the late completion in the fake: it
  // arrives while the new copy is in flight.
  const CopyEvent new_event = bridge->host_to_device(range, DeviceRange{h, 0, 64}, CopyMode::Async);
  // And the old worker's completion once more, forged with the new copy's id.
  fake->report_completion(CopyEvent{old_event.domain, old_event.generation, new_event.id});
  bridge->poll();
  EXPECT_EQ(bridge->stats().stale_completions, 2u);
  EXPECT_EQ(bridge->copy_status(new_event).state, CopyState::Pending);
  EXPECT_FALSE(bridge->safe_to_release_host(new_event));
  // The allocation cannot be freed under the running copy.
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->free_device(h));
  EXPECT_EQ(fake->live_allocations(), 1u);
  complete(new_event);
  bridge->free_device(h);
  EXPECT_EQ(fake->live_allocations(), 0u);
}

// 3. Host ranges are never validated (an overflowing offset reaches the backend).
TEST_F(DefectTest, Defect3_OverflowingHostRangeNeverReachesTheBackend) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 4096);
  const HostRange range = filled_range(4096, 73);
  fake->clear_calls();
  for (const HostRange bad : {HostRange{UINT64_MAX - 15, 64}, HostRange{UINT64_MAX, 1},
                              HostRange{range.offset + 64, UINT64_MAX - 63}, HostRange{bridge->ring_capacity(), 64}}) {
    EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange,
                           bridge->host_to_device(bad, DeviceRange{h, 0, bad.len}, CopyMode::Sync));
    EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange,
                           bridge->device_to_host(DeviceRange{h, 0, bad.len}, bad, CopyMode::Async));
  }
  EXPECT_CALLS(fake);
}

// 4. Extent 0, alignment 3 and misaligned device offsets are accepted.
TEST_F(DefectTest, Defect4_ZeroExtentAlignmentThreeAndMisalignedOffsetsAreRefused) {
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidExtent, bridge->alloc_device(bytes_spec(4096, 64), 0));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidAlignment, bridge->alloc_device(bytes_spec(4096, 3), 3));
  const DeviceHandle h = bridge->alloc_device(float_spec(4096, 64), 256);
  const HostRange range = filled_range(64, 74);
  fake->clear_calls();
  // A float32 allocation: a device offset or length off the element grid is refused.
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange,
                         bridge->host_to_device(range, DeviceRange{h, 2, 64}, CopyMode::Sync));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange,
                         bridge->host_to_device(HostRange{range.offset, 62}, DeviceRange{h, 0, 62}, CopyMode::Sync));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange,
                         bridge->device_to_host(DeviceRange{h, 1, 64}, range, CopyMode::Async));
  EXPECT_CALLS(fake);
}

// 5. A restart never frees the backend's allocations; old handles can then
//    never be freed (a leak per restart).
TEST_F(DefectTest, Defect5_RestartFreesEveryBackendAllocation) {
  for (Generation g = 2; g <= 6; ++g) {
    for (int i = 0; i < 3; ++i) bridge->alloc_device(bytes_spec(), 64);
    EXPECT_EQ(fake->live_allocations(), 3u);
    bridge->restart(g);
    EXPECT_EQ(fake->live_allocations(), 0u) << "after restart to " << g;
    EXPECT_EQ(bridge->stats().live_allocations, 0u);
    EXPECT_EQ(bridge->stats().allocated_bytes, 0u);
  }
  const auto kinds = call_kinds(fake->calls());
  EXPECT_EQ(std::count(kinds.begin(), kinds.end(), Call::Allocate),
            std::count(kinds.begin(), kinds.end(), Call::Free));
}

// 6. A restart to the same or an older generation is accepted and aliases handles.
TEST_F(DefectTest, Defect6_RestartToTheSameOrAnOlderGenerationIsRefused) {
  bridge->restart(4);
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  fake->clear_calls();
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, bridge->restart(4));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, bridge->restart(3));
  EXPECT_CALLS(fake);  // refused before quiescing anything
  EXPECT_EQ(bridge->generation(), 4u);
  EXPECT_EQ(bridge->extent(h), 64u);  // h is still valid: nothing aliased it
}

// 7. Completions for unknown copies are dropped silently; an early completion
//    is lost and pins its allocation forever.
TEST_F(DefectTest, Defect7_UnknownCompletionsAreCountedAndEarlyCompletionsAreNotLost) {
  fake->report_completion(CopyEvent{bridge->domain(), bridge->generation(), 12345});
  EXPECT_EQ(bridge->poll(), 1u);
  EXPECT_EQ(bridge->stats().stale_completions, 1u);

  // Completions that arrive as early as possible (inside the submission) while
  // another thread keeps draining: every one must land on its copy.
  fake->set_auto_complete(true);
  std::atomic<bool> stop{false};
  std::thread poller([&] {
    while (!stop.load()) {
      bridge->poll();
      std::this_thread::yield();
    }
  });
  const HostRange range = filled_range(64, 75);
  for (int i = 0; i < 200; ++i) {
    const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
    const CopyEvent e = bridge->host_to_device(range, DeviceRange{h, 0, 64}, CopyMode::Async);
    EXPECT_EQ(bridge->wait(e).state, CopyState::Completed);
    bridge->free_device(h);  // not pinned by a lost completion
  }
  stop = true;
  poller.join();
  EXPECT_EQ(bridge->stats().stale_completions, 1u);
  EXPECT_EQ(bridge->stats().copy_records, 0u);
  EXPECT_EQ(fake->live_allocations(), 0u);
}

// 8. Copy records are never removed: memory grows with every copy made.
TEST_F(DefectTest, Defect8_CopyRecordsAreRetired) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  const HostRange range = filled_range(64, 76);
  fake->set_auto_complete(true);
  std::uint64_t max_records = 0;
  for (int i = 0; i < 5000; ++i) {
    const CopyMode mode = i % 3 == 0 ? CopyMode::Sync : CopyMode::Async;
    bridge->host_to_device(range, DeviceRange{h, 0, 64}, mode);
    if (i % 16 == 0) bridge->poll();
    max_records = std::max(max_records, bridge->stats().copy_records);
  }
  bridge->poll();
  EXPECT_LE(max_records, 16u);
  EXPECT_EQ(bridge->stats().copy_records, 0u);
  EXPECT_EQ(bridge->stats().copies_submitted, 5000u);
  EXPECT_EQ(bridge->stats().copies_completed, 5000u);
}

// 9. A view can be handed out while a copy into the allocation is in flight,
//    with nothing to order the two.
TEST_F(DefectTest, Defect9_NoViewWhileACopyIntoTheAllocationIsInFlight) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 128);
  std::vector<std::byte> data;
  const HostRange range = filled_range(128, 77, &data);
  const CopyEvent e = bridge->host_to_device(range, DeviceRange{h, 0, 128}, CopyMode::Async);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse,
                         bridge->view(h, ViewSpec{DType::UInt8, {128}, std::nullopt, 0}));
  EXPECT_EQ(bridge->stats().live_views, 0u);
  // Asking to wait orders the view after the copy: it sees the copied bytes.
  std::thread completer([&] { fake->complete(e); });
  ViewLease lease = bridge->view(h, ViewSpec{DType::UInt8, {128}, std::nullopt, 0}, ViewWait::Wait);
  completer.join();
  EXPECT_EQ(bridge->copy_status(e).state, CopyState::Completed);
  const auto* bytes = reinterpret_cast<const std::byte*>(lease->data);
  EXPECT_TRUE(std::equal(bytes, bytes + 128, data.begin()));
}

}  // namespace
}  // namespace devbridge::testing
