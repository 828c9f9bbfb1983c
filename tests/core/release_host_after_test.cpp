// Bridge::release_host_after: the core's one release-after-completion
// mechanism. A ring range goes back once its copy's event settles (an
// upload's safe_to_release_host, a download's host_bytes_valid, or a
// failure), noticed whenever the bridge applies completions and before
// reserve looks for room; a waiting reserve is woken by it.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <thread>

#include "support.hpp"

namespace devbridge::testing {
namespace {

using namespace std::chrono_literals;

class ReleaseHostAfterTest : public BridgeTest {
 protected:
  static constexpr std::uint64_t kSmallRing = 4096;
  void SetUp() override {
    BridgeOptions options = default_options();
    options.ring_bytes = kSmallRing;
    rebuild(options);
    handle = bridge->alloc_device(bytes_spec(), kSmallRing);
  }
  std::uint64_t pending() { return bridge->stats().ring_releases_pending; }
  std::uint64_t reservations() { return bridge->stats().ring_reservations; }

  DeviceHandle handle;
};

TEST_F(ReleaseHostAfterTest, UploadRangeGoesBackWhenItsCopyCompletes) {
  std::vector<std::byte> data;
  const HostRange range = filled_range(1024, 1, &data);
  const CopyEvent event = bridge->host_to_device(range, DeviceRange{handle, 0, 1024}, CopyMode::Async);
  bridge->release_host_after(range, event);
  EXPECT_EQ(pending(), 1u);
  EXPECT_EQ(reservations(), 1u);
  bridge->poll();  // nothing completed yet: the range stays
  EXPECT_EQ(pending(), 1u);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, bridge->release_host_after(range, event));  // already waiting
  ASSERT_TRUE(fake->complete(event));
  EXPECT_EQ(bridge->wait(event).state, CopyState::Completed);
  EXPECT_EQ(pending(), 0u);
  EXPECT_EQ(reservations(), 0u);
  EXPECT_EQ(device_contents(handle, 0, 1024), data);
}

TEST_F(ReleaseHostAfterTest, DownloadRangeGoesBackOnceItsBytesAreValid) {
  const HostRange range = bridge->reserve(512);
  const CopyEvent event = bridge->device_to_host(DeviceRange{handle, 0, 512}, range, CopyMode::Async);
  bridge->release_host_after(range, event);
  EXPECT_FALSE(bridge->host_bytes_valid(event));
  EXPECT_EQ(reservations(), 1u);
  fake->complete(event);
  EXPECT_TRUE(bridge->host_bytes_valid(event));  // applies the completion, and with it the release
  EXPECT_EQ(reservations(), 0u);
  EXPECT_EQ(pending(), 0u);
}

TEST_F(ReleaseHostAfterTest, FailedCopyReleasesItsRangeAndKeepsItsFailureToObserve) {
  fake->inject(Call::CopyHostToDevice, Failure::CopyFailedAtCompletion);
  const HostRange range = filled_range(256, 2);
  const CopyEvent event = bridge->host_to_device(range, DeviceRange{handle, 0, 256}, CopyMode::Async);
  bridge->release_host_after(range, event);
  fake->complete_all();
  bridge->poll();
  EXPECT_EQ(reservations(), 0u);
  EXPECT_EQ(pending(), 0u);
  const CopyStatus status = bridge->wait(event);  // the failure is still the caller's to see
  EXPECT_EQ(status.state, CopyState::Failed);
  EXPECT_EQ(status.error, ErrorKind::DeviceCopyFailed);
}

TEST_F(ReleaseHostAfterTest, SettledEventReleasesAtOnce) {
  const HostRange synced = filled_range(128, 3);
  const CopyEvent sync_event = bridge->host_to_device(synced, DeviceRange{handle, 0, 128}, CopyMode::Sync);
  bridge->release_host_after(synced, sync_event);
  EXPECT_EQ(reservations(), 0u);

  const HostRange range = filled_range(128, 4);
  const CopyEvent event = bridge->host_to_device(range, DeviceRange{handle, 0, 128}, CopyMode::Async);
  fake->complete(event);  // completed in the backend, not yet applied by the bridge
  bridge->release_host_after(range, event);
  EXPECT_EQ(reservations(), 0u);
  EXPECT_EQ(pending(), 0u);
}

TEST_F(ReleaseHostAfterTest, RangeAnotherCopyPinsWaitsForThatCopyToo) {
  const HostRange range = filled_range(256, 5);
  const CopyEvent first = bridge->host_to_device(range, DeviceRange{handle, 0, 256}, CopyMode::Async);
  const CopyEvent second = bridge->host_to_device(range, DeviceRange{handle, 256, 256}, CopyMode::Async);
  bridge->release_host_after(range, first);
  fake->complete(first);
  bridge->poll();
  EXPECT_EQ(reservations(), 1u);  // `second` still reads it
  EXPECT_EQ(pending(), 1u);
  fake->complete(second);
  bridge->poll();
  EXPECT_EQ(reservations(), 0u);
  EXPECT_EQ(pending(), 0u);
}

TEST_F(ReleaseHostAfterTest, RefusesWrongEventsAndRangesChangingNothing) {
  const HostRange range = filled_range(256, 6);
  const CopyEvent event = bridge->host_to_device(range, DeviceRange{handle, 0, 256}, CopyMode::Async);

  CopyEvent foreign = event;
  foreign.domain += 1000;
  auto message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::ForeignDomain, bridge->release_host_after(range, foreign));
  EXPECT_NE(message.find("domain"), std::string::npos) << message;
  CopyEvent old = event;
  old.generation = 0;
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, bridge->release_host_after(range, old));
  CopyEvent unknown = event;
  unknown.id += 1 << 20;
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->release_host_after(range, unknown));

  message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange,
                                   bridge->release_host_after(HostRange{range.offset, 128}, event));
  EXPECT_NE(message.find("[offset " + std::to_string(range.offset) + ", len 128]"), std::string::npos) << message;
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, bridge->release_host_after(HostRange{3000, 64}, event));
  EXPECT_EQ(pending(), 0u);

  fake->complete(event);
  bridge->wait(event);
  EXPECT_EQ(reservations(), 1u);  // none of the refused calls took it
  bridge->release_host(range);
}

TEST_F(ReleaseHostAfterTest, RestartReleasesWaitingRangesOnceTheDeviceIsIdle) {
  const HostRange a = filled_range(256, 7);
  const HostRange b = bridge->reserve(256);
  const CopyEvent up = bridge->host_to_device(a, DeviceRange{handle, 0, 256}, CopyMode::Async);
  const CopyEvent down = bridge->device_to_host(DeviceRange{handle, 0, 256}, b, CopyMode::Async);
  bridge->release_host_after(a, up);
  bridge->release_host_after(b, down);
  EXPECT_EQ(pending(), 2u);
  bridge->restart(2);  // the fake's quiesce completes what is in flight
  EXPECT_EQ(pending(), 0u);
  EXPECT_EQ(reservations(), 0u);
  EXPECT_EQ(bridge->ring_free_bytes(), kSmallRing);
}

TEST_F(ReleaseHostAfterTest, FailedQuiesceKeepsWaitingRangesUntilARestartSucceeds) {
  const HostRange range = filled_range(256, 8);
  const CopyEvent event = bridge->host_to_device(range, DeviceRange{handle, 0, 256}, CopyMode::Async);
  bridge->release_host_after(range, event);
  fake->inject(Call::Quiesce, Failure::Fatal);
  EXPECT_ANY_THROW(bridge->restart(2));
  EXPECT_EQ(reservations(), 1u);  // the device may still read it
  EXPECT_EQ(pending(), 1u);
  bridge->restart(2);
  EXPECT_EQ(reservations(), 0u);
  EXPECT_EQ(pending(), 0u);
}

TEST_F(ReleaseHostAfterTest, CloseDropsWaitingRanges) {
  const HostRange range = filled_range(256, 9);
  const CopyEvent event = bridge->host_to_device(range, DeviceRange{handle, 0, 256}, CopyMode::Async);
  bridge->release_host_after(range, event);
  bridge->close();
  EXPECT_EQ(pending(), 0u);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Closed, bridge->release_host_after(range, event));
}

TEST_F(ReleaseHostAfterTest, ReserveFindsRoomFromSettledRangesWithoutAPoll) {
  const HostRange range = filled_range(kSmallRing, 10);
  const CopyEvent event = bridge->host_to_device(range, DeviceRange{handle, 0, kSmallRing}, CopyMode::Async);
  bridge->release_host_after(range, event);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Backpressure, bridge->reserve(64));
  fake->complete(event);  // not applied by anyone yet
  const HostRange next = bridge->reserve(64);
  EXPECT_EQ(next.len, 64u);
  EXPECT_EQ(pending(), 0u);
}

TEST_F(ReleaseHostAfterTest, WaitingReserveIsWokenByAPendingRelease) {
  const HostRange range = filled_range(kSmallRing, 11);
  const CopyEvent event = bridge->host_to_device(range, DeviceRange{handle, 0, kSmallRing}, CopyMode::Async);
  auto waiter = std::async(std::launch::async, [&] { return bridge->reserve(1024, 64, 10s); });
  EXPECT_EQ(waiter.wait_for(20ms), std::future_status::timeout);
  bridge->release_host_after(range, event);  // the waiting reserve now watches completions
  EXPECT_EQ(waiter.wait_for(20ms), std::future_status::timeout);
  fake->complete(event);
  ASSERT_EQ(waiter.wait_for(5s), std::future_status::ready);
  EXPECT_EQ(waiter.get().len, 1024u);
  EXPECT_EQ(pending(), 0u);
}

TEST_F(ReleaseHostAfterTest, RangeReleasedByHandIsForgottenNotReleasedTwice) {
  const HostRange range = bridge->reserve(256);
  const HostRange other = bridge->reserve(256);
  const CopyEvent event = bridge->device_to_host(DeviceRange{handle, 0, 256}, other, CopyMode::Async);
  bridge->release_host_after(range, event);  // the event is another range's copy: `range` waits for it all the same
  fake->complete(event);
  bridge->release_host(range);  // by hand meanwhile (the bridge has not applied the completion yet)
  const HostRange again = bridge->reserve(256);
  bridge->wait(event);
  EXPECT_EQ(pending(), 0u);
  EXPECT_EQ(reservations(), 2u);  // `other` and `again`: nothing was released twice
  EXPECT_NO_THROW(bridge->host_bytes(again));
  bridge->release_host(other);
  bridge->release_host(again);
}

TEST_F(ReleaseHostAfterTest, WaitForReleaseAfterReturnsOnceAWaitingRangeGoesBack) {
  EXPECT_FALSE(bridge->wait_for_release_after()) << "nothing waits: false at once, even with no timeout";
  const HostRange range = filled_range(kSmallRing, 12);
  const CopyEvent event = bridge->host_to_device(range, DeviceRange{handle, 0, kSmallRing}, CopyMode::Async);
  bridge->release_host_after(range, event);
  EXPECT_FALSE(bridge->wait_for_release_after(5ms)) << "the copy has not ended: the timeout passes";
  EXPECT_EQ(pending(), 1u);
  auto waiter = std::async(std::launch::async, [&] { return bridge->wait_for_release_after(); });
  EXPECT_EQ(waiter.wait_for(20ms), std::future_status::timeout);
  fake->complete(event);
  ASSERT_EQ(waiter.wait_for(5s), std::future_status::ready);
  EXPECT_TRUE(waiter.get());
  EXPECT_EQ(pending(), 0u);
  EXPECT_EQ(reservations(), 0u);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, bridge->wait_for_release_after(-1ns));
}

}  // namespace
}  // namespace devbridge::testing
