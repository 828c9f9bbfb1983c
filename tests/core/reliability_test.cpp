// The promise at the edges: faults during restart and close, timeouts at the
// limits of their type, bounded failure records, events forged across
// generations, and close() waking every blocked caller. Each test names the
// defect of the reliability issue it pins down; each failed at 55e61ea.
#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include "devbridge/backends/host.hpp"
#include "devbridge/checked.hpp"
#include "devbridge/wait_check.hpp"
#include "support.hpp"

namespace devbridge::testing {
namespace {

using namespace std::chrono_literals;

class ReliabilityTest : public BridgeTest {
 protected:
  DeviceHandle alloc(std::uint64_t extent = 4096) { return bridge->alloc_device(bytes_spec(), extent); }
};

// ---- defect 5: a restart whose quiesce fails frees and unpins nothing ----

TEST_F(ReliabilityTest, FailedQuiesceDuringRestartKeepsOldMemoryAndRangesPinned) {
  auto h = alloc();
  std::vector<std::byte> device_data;
  HostRange up = filled_range(4096, 1, &device_data);
  bridge->host_to_device(up, {h, 0, 4096}, CopyMode::Sync);
  bridge->release_host(up);
  HostRange down = bridge->reserve(4096);
  const CopyEvent pending = bridge->device_to_host({h, 0, 4096}, down, CopyMode::Async);
  const auto live_before = fake->live_allocations();

  fake->inject(Call::Quiesce, Failure::Fatal);
  const auto message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::Unavailable, bridge->restart(2));
  EXPECT_NE(message.find("nothing was freed"), std::string::npos) << message;

  // Still the old generation, Broken, with everything in place.
  const auto stats = bridge->stats();
  EXPECT_EQ(stats.generation, 1u);
  EXPECT_TRUE(stats.broken);
  EXPECT_EQ(stats.live_allocations, 1u);
  EXPECT_EQ(stats.copies_in_flight, 1u);
  EXPECT_EQ(fake->live_allocations(), live_before);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->release_host(down));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Broken, bridge->reserve(64));

  // The retry quiesces for real, then frees everything.
  bridge->restart(2);
  EXPECT_EQ(bridge->generation(), 2u);
  EXPECT_FALSE(bridge->stats().broken);
  EXPECT_EQ(fake->live_allocations(), 0u);
  EXPECT_EQ(bridge->stats().ring_used, 4096u) << "the range stays reserved (the caller's), no longer pinned";
  bridge->release_host(down);
  // The old download can no longer complete into the ring.
  EXPECT_FALSE(fake->complete(pending));
}

TEST_F(ReliabilityTest, OldDownloadCannotOverwriteAReusedRangeAfterAFailedQuiesce) {
  auto h = alloc();
  HostRange down = bridge->reserve(4096);
  bridge->device_to_host({h, 0, 4096}, down, CopyMode::Async);
  fake->inject(Call::Quiesce, Failure::Fatal);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Unavailable, bridge->restart(2));
  // 55e61ea: the restart succeeded, `down` could be released and reserved
  // again, and the old download then wrote over the new owner's bytes.
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->release_host(down));
  EXPECT_EQ(fake->pending().size(), 1u);
}

TEST_F(ReliabilityTest, FailedQuiesceDuringCloseFreesNothingAndALaterCloseRetries) {
  auto h = alloc();
  HostRange down = bridge->reserve(4096);
  bridge->device_to_host({h, 0, 4096}, down, CopyMode::Async);
  fake->inject(Call::Quiesce, Failure::Fatal);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Unavailable, bridge->close());
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Closed, bridge->reserve(64));
  EXPECT_EQ(fake->live_allocations(), 1u);
  EXPECT_EQ(fake->live_host_blocks(), 1u);
  bridge->close();
  EXPECT_EQ(fake->live_allocations(), 0u);
  EXPECT_EQ(fake->live_host_blocks(), 0u);
  bridge->close();  // idempotent once done
}

// ---- defect 7: an event never issued in this generation is unknown ----

TEST_F(ReliabilityTest, EventIdFromAnOlderGenerationIsUnknownInTheNewOne) {
  auto h = alloc();
  HostRange up = filled_range(4096, 2);
  const CopyEvent async_event = bridge->host_to_device(up, {h, 0, 4096}, CopyMode::Async);
  complete(async_event);
  const CopyEvent sync_event = bridge->host_to_device(up, {h, 0, 4096}, CopyMode::Sync);
  bridge->restart(2);
  for (const CopyEvent& old : {async_event, sync_event}) {
    const CopyEvent forged{old.domain, 2, old.id};
    EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->safe_to_release_host(forged));
    EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->copy_status(forged));
    EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, bridge->copy_status(old));
  }
}

// ---- defect 6: failure records are bounded ----

TEST_F(ReliabilityTest, ObservedFailuresStopCountingAsRecords) {
  auto h = alloc();
  HostRange up = filled_range(4096, 3);
  const CopyEvent e = bridge->host_to_device(up, {h, 0, 4096}, CopyMode::Async);
  complete(e, /*ok=*/false);
  EXPECT_EQ(bridge->stats().copy_records, 1u);
  EXPECT_FALSE(bridge->safe_to_release_host(e));
  EXPECT_EQ(bridge->stats().copy_records, 1u) << "a boolean query does not observe the failure";
  const auto status = bridge->wait(e, 0ns);
  EXPECT_EQ(status.state, CopyState::Failed);
  EXPECT_EQ(status.error, ErrorKind::DeviceCopyFailed);
  EXPECT_EQ(bridge->stats().copy_records, 0u);
  // Read again, it is still the same failure.
  EXPECT_EQ(bridge->copy_status(e).error, ErrorKind::DeviceCopyFailed);
  EXPECT_FALSE(bridge->host_bytes_valid(e));
}

TEST_F(ReliabilityTest, UnobservedFailuresAreCappedOldestFirstAndNeverReadAsCompleted) {
  BridgeOptions options = default_options();
  options.failed_record_limit = 8;
  rebuild(options);
  auto h = alloc();
  HostRange down = bridge->reserve(4096);
  std::vector<CopyEvent> failed;
  for (int i = 0; i < 1000; ++i) {
    failed.push_back(bridge->device_to_host({h, 0, 4096}, down, CopyMode::Async));
    complete(failed.back(), /*ok=*/false);
  }
  const auto stats = bridge->stats();
  EXPECT_EQ(stats.failed_records, 8u);
  EXPECT_EQ(stats.copy_records, 8u);
  EXPECT_EQ(stats.failed_records_evicted, 992u);
  EXPECT_EQ(stats.copies_failed, 1000u);
  // The newest are remembered exactly; a forgotten one is unknown, never Completed.
  EXPECT_EQ(bridge->copy_status(failed.back()).error, ErrorKind::OutputCopyFailed);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->host_bytes_valid(failed.front()));
  // A later success in the same slot reads as Completed.
  const CopyEvent ok = bridge->device_to_host({h, 0, 4096}, down, CopyMode::Async);
  complete(ok);
  EXPECT_TRUE(bridge->host_bytes_valid(ok));
}

TEST_F(ReliabilityTest, TwentyThousandFailuresKeepMemoryFlat) {
  auto h = alloc();
  HostRange up = filled_range(4096, 4);
  for (int i = 0; i < 20000; ++i) {
    const CopyEvent e = bridge->host_to_device(up, {h, 0, 4096}, CopyMode::Async);
    complete(e, /*ok=*/false);
  }
  EXPECT_LE(bridge->stats().copy_records, BridgeOptions{}.failed_record_limit);
  EXPECT_LE(bridge->stats().failed_records, BridgeOptions{}.failed_record_limit);
}

// ---- defect 4: timeouts at the limits ----

TEST_F(ReliabilityTest, HugeTimeoutsWaitUntilDone) {
  auto h = alloc();
  HostRange up = filled_range(4096, 5);
  for (auto timeout : {std::chrono::nanoseconds::max(), std::chrono::nanoseconds::max() - 1ns,
                       std::chrono::nanoseconds(std::chrono::hours(24 * 365 * 100))}) {
    const CopyEvent e = bridge->host_to_device(up, {h, 0, 4096}, CopyMode::Async);
    auto waiter = std::async(std::launch::async, [&] { return bridge->wait(e, timeout); });
    EXPECT_EQ(waiter.wait_for(50ms), std::future_status::timeout) << "returned at once: the deadline overflowed";
    ASSERT_TRUE(fake->complete(e));
    EXPECT_EQ(waiter.get().state, CopyState::Completed);
  }
}

TEST_F(ReliabilityTest, HugeWaitForRoomWaitsForRoom) {
  BridgeOptions options = default_options();
  options.inflight_budget_bytes = 4096;
  rebuild(options);
  auto h = alloc(8192);
  HostRange a = filled_range(4096, 6), b = filled_range(4096, 7);
  const CopyEvent first = bridge->host_to_device(a, {h, 0, 4096}, CopyMode::Async);
  auto second = std::async(std::launch::async, [&] {
    return bridge->host_to_device(b, {h, 4096, 4096}, CopyMode::Async, Admission{std::chrono::nanoseconds::max()});
  });
  EXPECT_EQ(second.wait_for(50ms), std::future_status::timeout) << "Backpressure at once: the deadline overflowed";
  ASSERT_TRUE(fake->complete(first));
  const CopyEvent next = second.get();
  complete(next);
}

TEST_F(ReliabilityTest, NegativeTimeoutsAreRefused) {
  auto h = alloc();
  HostRange up = filled_range(4096, 8);
  const CopyEvent e = bridge->host_to_device(up, {h, 0, 4096}, CopyMode::Async);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, bridge->wait(e, -1ns));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, bridge->wait(e, std::chrono::nanoseconds::min()));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange,
                         bridge->host_to_device(up, {h, 0, 4096}, CopyMode::Async, Admission{-1ns}));
  EXPECT_EQ(bridge->stats().copies_in_flight, 1u);
}

// A finalizer (NoWaitForRestart on its thread) never waits for a restart:
// the collector may run it on a thread the restart itself waits for. Here a
// restart waits for an in-place read whose callback waits for another
// thread's call, as a checkpoint's read waited for its checksum thread to
// start while a finalizer on that thread waited for the restart: the whole
// process stopped. The call is refused (OldGenerationHandle) instead.
TEST(NoWaitForRestart, AFinalizersCallDuringARestartIsRefusedInsteadOfWaiting) {
  Bridge b(host::make_host_backend(), BridgeOptions{1, 1 << 20, 0});
  const DeviceHandle read = b.alloc_device(bytes_spec(), 4096);
  const DeviceHandle dropped = b.alloc_device(bytes_spec(), 4096);
  const DeviceRange range{read, 0, 4096};
  std::thread restarter;
  std::atomic<bool> refused{false};
  b.read_in_place(std::span(&range, 1), [&](auto) {
    restarter = std::thread([&] { b.restart(2); });
    // Each try on a thread of its own, as the collector's would be; before the restart begins, extent()
    // answers, and once it has, the call must be refused, not wait for the restart (which waits for this
    // callback: without the scope, the try would never end).
    auto finalizer = std::async(std::launch::async, [&] {
      const NoWaitForRestart finalizing;
      const auto deadline = std::chrono::steady_clock::now() + 20s;
      while (std::chrono::steady_clock::now() < deadline) {
        try {
          (void)b.extent(dropped);
        } catch (const Error& e) {
          refused = e.kind() == ErrorKind::OldGenerationHandle;
          if (refused) EXPECT_THROW(b.release(dropped), Error);  // a release too: the restart frees it
          return;
        }
        std::this_thread::sleep_for(1ms);
      }
    });
    EXPECT_EQ(finalizer.wait_for(30s), std::future_status::ready) << "the finalizer's call waited for the restart";
  });
  restarter.join();
  EXPECT_TRUE(refused);
  EXPECT_EQ(b.generation(), 2u);
  EXPECT_EQ(b.stats().live_allocations, 0u);  // the restart freed both
}

TEST(CheckedArithmetic, SecondsSaturateAndRefuseNegativeOrNaN) {
  using checked::seconds_to_nanoseconds;
  EXPECT_EQ(seconds_to_nanoseconds(std::numeric_limits<double>::infinity(), "t"), std::chrono::nanoseconds::max());
  EXPECT_EQ(seconds_to_nanoseconds(1e9, "t"), std::chrono::nanoseconds(1'000'000'000'000'000'000ll));
  EXPECT_EQ(seconds_to_nanoseconds(1e10, "t"), std::chrono::nanoseconds::max());
  EXPECT_EQ(seconds_to_nanoseconds(1e300, "t"), std::chrono::nanoseconds::max());
  EXPECT_EQ(seconds_to_nanoseconds(0.0, "t"), 0ns);
  EXPECT_EQ(seconds_to_nanoseconds(1.5e-9, "t"), 1ns);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, seconds_to_nanoseconds(-1e-9, "t"));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, seconds_to_nanoseconds(std::nan(""), "t"));
  const auto now = checked::Clock::now();
  EXPECT_EQ(checked::deadline_after(std::chrono::nanoseconds::max(), now), checked::Clock::time_point::max());
  EXPECT_EQ(checked::deadline_after(-5ns, now), now);
  EXPECT_EQ(checked::align_up(UINT64_MAX - 4094, 4096), std::nullopt);
  EXPECT_EQ(checked::align_up(4097, 4096), 8192u);
  EXPECT_EQ(checked::add(UINT64_MAX, 1), std::nullopt);
  EXPECT_EQ(checked::mul(1ull << 32, 1ull << 32), std::nullopt);
  EXPECT_TRUE(checked::range_within(10, 0, 10));
  EXPECT_FALSE(checked::range_within(10, 1, 10));
  EXPECT_FALSE(checked::range_within(1, UINT64_MAX, 10));
}

// ---- defect 3: close() wakes every blocked caller ----

TEST_F(ReliabilityTest, CloseWakesAWaiterWhileAHostLeaseAndAViewLive) {
  auto h = alloc();
  auto other = alloc();
  HostRange up = filled_range(4096, 9);
  HostLease exported = bridge->lease_host(up);
  ViewLease view = bridge->view(other, ViewSpec{DType::UInt8, {4096}, std::nullopt, 0});
  const CopyEvent e = bridge->host_to_device(up, {h, 0, 4096}, CopyMode::Async);
  std::atomic<bool> started{false};
  auto waiter = std::async(std::launch::async, [&] {
    started = true;
    return bridge->wait(e);
  });
  auto viewer = std::async(std::launch::async, [&] {
    return bridge->view(h, ViewSpec{DType::UInt8, {4096}, std::nullopt, 0}, ViewWait::Wait);
  });
  while (!started) std::this_thread::yield();
  std::this_thread::sleep_for(20ms);
  bridge->close();
  EXPECT_EQ(waiter.wait_for(2s), std::future_status::ready) << "close() did not wake the waiter";
  EXPECT_EQ(viewer.wait_for(2s), std::future_status::ready) << "close() did not wake the waiting view";
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Closed, waiter.get());
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Closed, viewer.get());
  // What consumers hold stays valid until they let go.
  std::memset(exported.bytes().data(), 0x5A, exported.bytes().size());
  EXPECT_EQ(fake->live_host_blocks(), 1u);
  EXPECT_EQ(fake->live_allocations(), 1u);  // the viewed one
  exported.reset();
  EXPECT_EQ(fake->live_host_blocks(), 0u);
  view.reset();
  EXPECT_EQ(fake->live_allocations(), 0u);
}

TEST_F(ReliabilityTest, HostLeaseIsValidatedAndOutlivesTheBridge) {
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, bridge->lease_host(HostRange{0, 64}));
  HostRange r = filled_range(128, 10);
  HostLease lease = bridge->lease_host(r);
  EXPECT_EQ(lease.bytes().size(), 128u);
  HostLease moved = std::move(lease);
  EXPECT_FALSE(lease);
  bridge.reset();  // closes: the ring stays for the lease
  moved.bytes()[0] = std::byte{1};
  moved.reset();
}

TEST_F(ReliabilityTest, CloseDuringABlockedWaitForRoomRefusesIt) {
  BridgeOptions options = default_options();
  options.inflight_budget_bytes = 4096;
  rebuild(options);
  auto h = alloc(8192);
  HostRange a = filled_range(4096, 11), b = filled_range(4096, 12);
  bridge->host_to_device(a, {h, 0, 4096}, CopyMode::Async);
  auto second = std::async(std::launch::async, [&] {
    return bridge->host_to_device(b, {h, 4096, 4096}, CopyMode::Async, Admission{std::chrono::hours(1)});
  });
  std::this_thread::sleep_for(20ms);
  bridge->close();
  ASSERT_EQ(second.wait_for(2s), std::future_status::ready);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Closed, second.get());
}

// ---- found by the fuzzer (tests/fuzz) ----

TEST_F(ReliabilityTest, AViewEndedBetweenAFailedCloseAndItsRetryIsNotLeaked) {
  auto h = alloc();
  ViewLease view = bridge->view(h, ViewSpec{DType::UInt8, {4096}, std::nullopt, 0});
  fake->inject(Call::Quiesce, Failure::Fatal);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Unavailable, bridge->close());
  view.reset();  // the allocation is still the bridge's, not an orphan
  bridge->close();
  EXPECT_EQ(fake->live_allocations(), 0u);
  EXPECT_EQ(bridge->stats().orphaned_allocations, 0u);
}

TEST_F(ReliabilityTest, AViewsRankMustFitTheObjectsShapeKind) {
  auto vector = bridge->alloc_device(ObjectSpec{4096, 64, DType::Float32, ShapeKind::Vector}, 4096);
  auto matrix = bridge->alloc_device(ObjectSpec{4096, 64, DType::Float32, ShapeKind::Matrix}, 4096);
  auto scalar = bridge->alloc_device(ObjectSpec{64, 64, DType::Float32, ShapeKind::Scalar}, 64);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidTensorView, bridge->view(vector, ViewSpec{DType::Float32, {32, 32}}));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidTensorView, bridge->view(matrix, ViewSpec{DType::Float32, {1024}}));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidTensorView, bridge->view(scalar, ViewSpec{DType::Float32, {1}}));
  EXPECT_TRUE(bridge->view(vector, ViewSpec{DType::Float32, {1024}}));
  EXPECT_TRUE(bridge->view(matrix, ViewSpec{DType::Float32, {32, 32}}));
  EXPECT_TRUE(bridge->view(scalar, ViewSpec{DType::Float32, {}}));
}

TEST_F(ReliabilityTest, StridesReachingInt64MaxAreRefusedWithoutOverflow) {
  auto h = bridge->alloc_device(float_spec(), 4096);
  for (std::int64_t stride : {INT64_MAX, INT64_MAX / 2, INT64_MIN + 1}) {
    EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidTensorView,
                           bridge->view(h, ViewSpec{DType::Float32, {2}, Dims{stride}, 0}));
  }
  EXPECT_EQ(bridge->stats().live_views, 0u);
}

TEST(FakeBackendLimits, ARingLargerThanTheFakesMemoryIsAllocationFailed) {
  for (std::uint64_t bytes : {std::uint64_t{(1ull << 20) + 1}, std::uint64_t{1ull << 63}, std::uint64_t{UINT64_MAX - 4095}, std::uint64_t{UINT64_MAX}}) {
    auto backend = std::make_unique<FakeBackend>(1ull << 20);
    BridgeOptions options;
    options.ring_bytes = bytes;
    EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationFailed, Bridge(std::move(backend), options));
  }
}

TEST_F(ReliabilityTest, AnAsyncCopyRefusedAtSubmitLeavesItsEventUnknown) {
  auto h = alloc();
  HostRange r = bridge->reserve(4096);
  fake->inject(Call::CopyDeviceToHost, Failure::CopyFailedAtSubmit);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OutputCopyFailed, bridge->device_to_host({h, 0, 4096}, r, CopyMode::Async));
  // The id the failed submission would have had was never handed out.
  const CopyEvent guessed{bridge->domain(), 1, 1ull << 32};
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->copy_status(guessed));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->safe_to_release_host(guessed));
  // The next copy takes that id, and completes as itself.
  const CopyEvent next = bridge->device_to_host({h, 0, 4096}, r, CopyMode::Async);
  EXPECT_EQ(next, guessed);
  EXPECT_FALSE(bridge->host_bytes_valid(next));
  complete(next);
  EXPECT_TRUE(bridge->host_bytes_valid(next));
}

TEST_F(ReliabilityTest, AFailedSyncCopyHandsOutNoEventThatCouldReadCompleted) {
  auto h = alloc();
  HostRange r = bridge->reserve(4096);
  fake->inject(Call::CopyDeviceToHost, Failure::CopyFailedAtSubmit);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OutputCopyFailed, bridge->device_to_host({h, 0, 4096}, r, CopyMode::Sync));
  const CopyEvent guessed{bridge->domain(), 1, (1ull << 63) | 1};
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->copy_status(guessed));
  const CopyEvent ok = bridge->device_to_host({h, 0, 4096}, r, CopyMode::Sync);
  EXPECT_EQ(ok, guessed);
  EXPECT_TRUE(bridge->host_bytes_valid(ok));
}

}  // namespace
}  // namespace devbridge::testing
