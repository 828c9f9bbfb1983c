// The copy timeline on its own: records, the in-flight budget, the bounded
// failure log and its watermark, sync numbering, a new generation.
#include "core/copy_timeline.hpp"

#include <gtest/gtest.h>

#include "support.hpp"

namespace devbridge::detail {
namespace {

constexpr std::uint64_t kDomain = 7;
constexpr Generation kGeneration = 1;

CopyEvent event(std::uint64_t id) { return CopyEvent{kDomain, kGeneration, id}; }

BridgeStats stats_of(const CopyTimeline& timeline) {
  BridgeStats s;
  timeline.fill(s);
  return s;
}

TEST(CopyTimeline, AsyncCopyIsPendingUntilCompleteAndCountsInFlight) {
  CopyTimeline timeline(kDomain, 100, 4);
  EXPECT_TRUE(timeline.has_room(100));
  const auto id = timeline.begin_async(CopyDirection::HostToDevice, 3, 42, 60);
  timeline.submitted();
  EXPECT_EQ(timeline.state(event(id)), CopyState::Pending);
  EXPECT_EQ(timeline.inflight_bytes(), 60u);
  EXPECT_TRUE(timeline.has_room(40));
  EXPECT_FALSE(timeline.has_room(41));
  auto* record = timeline.pending(id);
  ASSERT_NE(record, nullptr);
  EXPECT_EQ(record->allocation, 3u);
  EXPECT_EQ(record->host_key, 42u);
  timeline.complete(id);
  EXPECT_EQ(timeline.state(event(id)), CopyState::Completed);
  EXPECT_EQ(timeline.pending(id), nullptr);
  const auto s = stats_of(timeline);
  EXPECT_EQ(s.copies_submitted, 1u);
  EXPECT_EQ(s.copies_completed, 1u);
  EXPECT_EQ(s.copies_in_flight, 0u);
  EXPECT_EQ(s.inflight_bytes, 0u);
}

TEST(CopyTimeline, CancelledSubmissionLeavesItsIdUnknown) {
  CopyTimeline timeline(kDomain, 100, 4);
  const auto id = timeline.begin_async(CopyDirection::DeviceToHost, 0, 0, 10);
  timeline.cancel_async(id);
  EXPECT_EQ(timeline.inflight_bytes(), 0u);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, timeline.state(event(id)));
  // The next copy takes the id the failed submission would have had.
  EXPECT_EQ(timeline.begin_async(CopyDirection::DeviceToHost, 0, 0, 10), id);
}

TEST(CopyTimeline, FailureReadsBackAsFailedAndObservingItCountsOnce) {
  CopyTimeline timeline(kDomain, 100, 4);
  const auto id = timeline.begin_async(CopyDirection::HostToDevice, 0, 0, 8);
  timeline.record_failure(id, kGeneration, ErrorKind::DeviceCopyFailed, "injected");
  EXPECT_EQ(stats_of(timeline).copy_records, 1u);
  const auto status = timeline.observe(event(id));
  EXPECT_EQ(status.state, CopyState::Failed);
  EXPECT_EQ(status.error, ErrorKind::DeviceCopyFailed);
  EXPECT_EQ(status.message, "injected");
  EXPECT_EQ(timeline.observe(event(id)).state, CopyState::Failed);
  const auto s = stats_of(timeline);
  EXPECT_EQ(s.copy_records, 0u);
  EXPECT_EQ(s.failed_records, 1u);
  EXPECT_EQ(s.copies_failed, 1u);
}

// A failure forgotten from the bounded log never reads as Completed, and
// neither does an older completed event of the same slot.
TEST(CopyTimeline, ForgottenFailureIsUnknownNeverCompleted) {
  CopyTimeline timeline(kDomain, 100, 1);
  const auto completed = timeline.begin_async(CopyDirection::HostToDevice, 0, 0, 1);
  timeline.complete(completed);
  const auto failed = timeline.begin_async(CopyDirection::HostToDevice, 0, 0, 1);  // the same slot, next version
  timeline.record_failure(failed, kGeneration, ErrorKind::DeviceCopyFailed, "first");
  const auto other = timeline.begin_async(CopyDirection::HostToDevice, 0, 0, 1);
  timeline.record_failure(other, kGeneration, ErrorKind::DeviceCopyFailed, "second");  // evicts `failed`
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, timeline.state(event(failed)));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, timeline.state(event(completed)));
  EXPECT_EQ(timeline.state(event(other)), CopyState::Failed);
  EXPECT_EQ(stats_of(timeline).failed_records_evicted, 1u);
}

TEST(CopyTimeline, SyncEventsAreNumberedOnlyWhenIssued) {
  CopyTimeline timeline(kDomain, 100, 4);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, timeline.state(event(CopyTimeline::kSyncEventBit | 1)));
  const auto id = timeline.complete_sync();
  EXPECT_EQ(timeline.state(event(id)), CopyState::Completed);
  EXPECT_EQ(timeline.pending(id), nullptr);  // a completion naming it is stale
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, timeline.state(event(CopyTimeline::kSyncEventBit)));
}

TEST(CopyTimeline, RestartForgetsEveryIdAndTheBudgetInFlight) {
  CopyTimeline timeline(kDomain, 100, 4);
  const auto pending = timeline.begin_async(CopyDirection::HostToDevice, 0, 0, 30);
  const auto sync = timeline.complete_sync();
  timeline.restart();
  EXPECT_EQ(timeline.inflight_bytes(), 0u);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, timeline.state(event(pending)));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, timeline.state(event(sync)));
  EXPECT_EQ(stats_of(timeline).copies_submitted, 1u);  // counters span generations
}

TEST(CopyTimeline, ACompletionSettlesItsOwnCopyOnlyAndStaleOnesAreCounted) {
  CopyTimeline timeline(kDomain, 100, 4);
  const auto id = timeline.begin_async(CopyDirection::DeviceToHost, 1, 2, 10);
  timeline.submitted();
  auto completion = [&](std::uint64_t domain, Generation generation, std::uint64_t of) {
    Completion c;
    c.event = CopyEvent{domain, generation, of};
    return c;
  };
  EXPECT_EQ(timeline.settling(completion(kDomain + 1, kGeneration, id), kDomain, kGeneration), nullptr);
  EXPECT_EQ(timeline.settling(completion(kDomain, kGeneration + 1, id), kDomain, kGeneration), nullptr);
  EXPECT_EQ(timeline.settling(completion(kDomain, kGeneration, id + 1), kDomain, kGeneration), nullptr);
  EXPECT_EQ(timeline.settling(completion(kDomain, kGeneration, id | CopyTimeline::kSyncEventBit), kDomain,
                              kGeneration),
            nullptr);
  EXPECT_EQ(stats_of(timeline).stale_completions, 4u);
  EXPECT_EQ(timeline.state(event(id)), CopyState::Pending) << "a stale completion settles nothing";
  EXPECT_EQ(timeline.settling(completion(kDomain, kGeneration, id), kDomain, kGeneration), timeline.pending(id));
  EXPECT_EQ(stats_of(timeline).stale_completions, 4u);
}

}  // namespace
}  // namespace devbridge::detail
