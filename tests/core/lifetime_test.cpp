// CONTRACT.md "Restart", "Objects" (domains, generations, handles), Broken
// after a fatal backend error, Closed after close().
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <thread>

#include "support.hpp"

namespace devbridge::testing {
namespace {

using LifetimeTest = BridgeTest;

TEST_F(LifetimeTest, ConstructionAllocatesTheRingFromTheBackend) {
  auto backend = std::make_unique<FakeBackend>();
  FakeBackend* raw = backend.get();
  Bridge b(std::move(backend), default_options());
  const auto calls = raw->calls();
  ASSERT_EQ(call_kinds(calls), (std::vector<Call>{Call::AllocateHost})) << describe_calls(calls);
  EXPECT_EQ(calls[0].bytes, kRingBytes);
  EXPECT_EQ(b.ring_capacity(), kRingBytes);
  EXPECT_EQ(b.ring_free_bytes(), kRingBytes);
  EXPECT_EQ(raw->live_host_blocks(), 1u);
  EXPECT_EQ(b.backend_info().name, "fake");
  EXPECT_EQ(&b.backend(), raw);
}

TEST_F(LifetimeTest, RingAllocationFailureIsAllocationFailed) {
  auto backend = std::make_unique<FakeBackend>();
  backend->inject(Call::AllocateHost, Failure::AllocationFailed);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationFailed, Bridge(std::move(backend), default_options()));
}

TEST_F(LifetimeTest, EveryBridgeHasItsOwnDomain) {
  Bridge other(std::make_unique<FakeBackend>(), default_options());
  EXPECT_NE(other.domain(), bridge->domain());
  EXPECT_EQ(bridge->stats().domain, bridge->domain());
}

TEST_F(LifetimeTest, HandleFromAnotherBridgeIsForeignDomain) {
  Bridge other(std::make_unique<FakeBackend>(), default_options());
  const DeviceHandle foreign = other.alloc_device(bytes_spec(), 64);
  const HostRange range = filled_range(64, 51);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::ForeignDomain, bridge->free_device(foreign));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::ForeignDomain, bridge->release(foreign));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::ForeignDomain, bridge->extent(foreign));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::ForeignDomain,
                         bridge->host_to_device(range, DeviceRange{foreign, 0, 64}, CopyMode::Sync));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::ForeignDomain,
                         bridge->view(foreign, ViewSpec{DType::UInt8, {64}, std::nullopt, 0}));
  // The other bridge's events are foreign too.
  const HostRange other_range = other.reserve(64);
  const CopyEvent other_event = other.host_to_device(other_range, DeviceRange{foreign, 0, 64}, CopyMode::Sync);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::ForeignDomain, bridge->copy_status(other_event));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::ForeignDomain, bridge->wait(other_event, std::chrono::nanoseconds(0)));
  EXPECT_CALLS(fake);
  other.free_device(foreign);  // still fine where it belongs
}

TEST_F(LifetimeTest, RestartQuiescesThenFreesEveryAllocationAndLeaksNothing) {
  std::vector<std::uint64_t> addresses;
  std::vector<DeviceHandle> handles;
  for (int i = 0; i < 4; ++i) {
    handles.push_back(bridge->alloc_device(bytes_spec(), 64 * (i + 1)));
    addresses.push_back(fake->calls().back().address);
  }
  const HostRange range = filled_range(64, 52);
  const CopyEvent in_flight = bridge->host_to_device(range, DeviceRange{handles[0], 0, 64}, CopyMode::Async);
  const DeviceHandle step_handles[] = {handles[1]};
  bridge->begin_step(9, step_handles);
  ViewLease lease = bridge->view(handles[2], ViewSpec{DType::UInt8, {64}, std::nullopt, 0});
  bridge->release(handles[3]);  // freed at once (unused)
  addresses.pop_back();
  fake->clear_calls();

  bridge->restart(2);

  const auto calls = fake->calls();
  ASSERT_FALSE(calls.empty());
  EXPECT_EQ(calls[0].call, Call::Quiesce) << describe_calls(calls);
  std::vector<std::uint64_t> freed;
  for (std::size_t i = 1; i < calls.size(); ++i) {
    EXPECT_EQ(calls[i].call, Call::Free) << describe_calls(calls);
    freed.push_back(calls[i].address);
  }
  // The viewed allocation's memory stays until its lease ends: a view may
  // still be read (numpy, tinygrad), though its handle is refused.
  const std::uint64_t viewed_address = addresses[2];
  addresses.erase(addresses.begin() + 2);
  std::sort(freed.begin(), freed.end());
  std::sort(addresses.begin(), addresses.end());
  EXPECT_EQ(freed, addresses);
  EXPECT_EQ(fake->live_allocations(), 1u);
  EXPECT_EQ(bridge->stats().orphaned_allocations, 1u);
  fake->clear_calls();
  lease.reset();
  ASSERT_EQ(fake->calls().size(), 1u);
  EXPECT_EQ(fake->calls()[0].call, Call::Free);
  EXPECT_EQ(fake->calls()[0].address, viewed_address);
  EXPECT_EQ(fake->live_allocations(), 0u);
  EXPECT_EQ(bridge->stats().orphaned_allocations, 0u);
  EXPECT_EQ(fake->live_host_blocks(), 1u);  // the ring survives a restart
  EXPECT_TRUE(fake->pending().empty());

  const BridgeStats stats = bridge->stats();
  EXPECT_EQ(stats.generation, 2u);
  EXPECT_EQ(stats.restarts, 1u);
  EXPECT_EQ(stats.live_allocations, 0u);
  EXPECT_EQ(stats.allocated_bytes, 0u);
  EXPECT_EQ(stats.copy_records, 0u);
  EXPECT_EQ(stats.copies_in_flight, 0u);
  EXPECT_EQ(stats.inflight_bytes, 0u);
  EXPECT_EQ(stats.active_steps, 0u);
  EXPECT_EQ(bridge->generation(), 2u);

  // Every old handle and event is refused.
  for (const auto& h : handles) {
    EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, bridge->free_device(h));
    EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, bridge->extent(h));
  }
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, bridge->copy_status(in_flight));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, bridge->safe_to_release_host(in_flight));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, bridge->wait(in_flight, std::chrono::nanoseconds(0)));
  lease.reset();  // harmless
  // The old copy's ring range is no longer pinned: the caller may release it.
  bridge->release_host(range);
  EXPECT_EQ(bridge->ring_free_bytes(), bridge->ring_capacity());
}

TEST_F(LifetimeTest, CancelledCopyMovesNoBytes) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  const HostRange out = bridge->reserve(64);
  const auto before = host_contents(out);
  bridge->device_to_host(DeviceRange{h, 0, 64}, out, CopyMode::Async);
  bridge->restart(2);
  EXPECT_EQ(host_contents(out), before);
  bridge->poll();
  EXPECT_EQ(bridge->stats().stale_completions, 0u);  // the fake drops cancelled copies
}

// Restart in the middle of in-flight work that other threads are blocked on:
// each waiter wakes with OldGenerationHandle instead of hanging.
TEST_F(LifetimeTest, RestartWakesEveryBlockedWaiter) {
  BridgeOptions options = default_options();
  options.inflight_budget_bytes = 256;
  rebuild(options);
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 512);
  const HostRange a = filled_range(256, 56);
  const HostRange b = filled_range(256, 57);
  const CopyEvent e = bridge->host_to_device(a, DeviceRange{h, 0, 256}, CopyMode::Async);  // fills the budget
  std::atomic<int> woke{0};
  auto expect_old_generation = [&](const std::function<void()>& blocked) {
    return std::thread([&, blocked] {
      EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, blocked());
      ++woke;
    });
  };
  std::vector<std::thread> waiters;
  waiters.push_back(expect_old_generation([&] { bridge->wait(e); }));
  waiters.push_back(expect_old_generation(
      [&] { bridge->view(h, ViewSpec{DType::UInt8, {512}, std::nullopt, 0}, ViewWait::Wait); }));
  waiters.push_back(expect_old_generation([&] {
    bridge->host_to_device(b, DeviceRange{h, 256, 256}, CopyMode::Async, Admission{std::chrono::hours(1)});
  }));
  // No timing assumption: whether a waiter blocks before or after the
  // restart, its handle or event is old by the time it looks again.
  bridge->restart(2);
  for (auto& t : waiters) t.join();
  EXPECT_EQ(woke.load(), 3);
  EXPECT_EQ(fake->live_allocations(), 0u);
  EXPECT_EQ(bridge->stats().copies_in_flight, 0u);
}

TEST_F(LifetimeTest, CloseWakesABlockedWaiterWithClosed) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  const HostRange a = filled_range(64, 58);
  const CopyEvent e = bridge->host_to_device(a, DeviceRange{h, 0, 64}, CopyMode::Async);
  std::thread waiter([&] {
    try {
      bridge->wait(e);
      ADD_FAILURE() << "wait returned on a closed bridge";
    } catch (const Error& error) {
      // Closed when it looks after close(); OldGeneration cannot happen here.
      EXPECT_EQ(error.kind(), ErrorKind::Closed) << error.what();
    }
  });
  bridge->close();
  waiter.join();
  EXPECT_EQ(fake->live_allocations(), 0u);
}

TEST_F(LifetimeTest, NewGenerationWorksAfterRestart) {
  bridge->alloc_device(bytes_spec(), 64);
  bridge->restart(5);
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  EXPECT_EQ(h.generation, 5u);
  std::vector<std::byte> data;
  const HostRange range = filled_range(64, 53, &data);
  const CopyEvent e = bridge->host_to_device(range, DeviceRange{h, 0, 64}, CopyMode::Async);
  EXPECT_EQ(e.generation, 5u);
  complete(e);
  EXPECT_EQ(device_contents(h, 0, 64), data);
}

TEST_F(LifetimeTest, RestartToTheSameOrAnOlderGenerationIsRefusedAndChangesNothing) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  fake->clear_calls();
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, bridge->restart(1));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, bridge->restart(0));
  EXPECT_CALLS(fake);
  EXPECT_EQ(bridge->generation(), 1u);
  EXPECT_EQ(bridge->extent(h), 64u);
  bridge->restart(3);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, bridge->restart(3));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, bridge->restart(2));
  EXPECT_EQ(bridge->generation(), 3u);
}

TEST_F(LifetimeTest, HandleFromAFutureGenerationIsUnknown) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  DeviceHandle future = h;
  future.generation = 99;
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->free_device(future));
}

// ---- Broken -------------------------------------------------------------------

TEST_F(LifetimeTest, FatalBackendErrorLeavesTheBridgeBrokenUntilRestart) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  const HostRange range = filled_range(64, 54);
  fake->inject(Call::Allocate, Failure::Fatal);
  try {
    bridge->alloc_device(bytes_spec(), 64);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_TRUE(e.fatal());
  }
  EXPECT_TRUE(bridge->stats().broken);
  fake->clear_calls();
  // Every call fails fast with Broken, touching nothing.
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Broken, bridge->alloc_device(bytes_spec(), 64));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Broken, bridge->free_device(h));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Broken, bridge->release(h));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Broken, bridge->extent(h));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Broken, bridge->reserve(64));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Broken,
                         bridge->host_to_device(range, DeviceRange{h, 0, 64}, CopyMode::Sync));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Broken,
                         bridge->device_to_host(DeviceRange{h, 0, 64}, range, CopyMode::Async));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Broken, bridge->view(h, ViewSpec{DType::UInt8, {64}, std::nullopt, 0}));
  const DeviceHandle handles[] = {h};
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Broken, bridge->begin_step(1, handles));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Broken, bridge->poll());
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Broken, bridge->launch_axpy(DeviceRange{h, 0, 64}, DeviceRange{h, 0, 64}, 1, 0));
  EXPECT_CALLS(fake);
  // restart recovers and frees the old generation.
  bridge->restart(2);
  EXPECT_FALSE(bridge->stats().broken);
  EXPECT_EQ(fake->live_allocations(), 0u);
  const DeviceHandle fresh = bridge->alloc_device(bytes_spec(), 64);
  bridge->free_device(fresh);
}

TEST_F(LifetimeTest, FatalLaunchOrViewBreaksTheBridge) {
  for (const Call call : {Call::Launch, Call::ValidateView}) {
    rebuild(default_options());
    const DeviceHandle x = bridge->alloc_device(float_spec(), 64);
    const DeviceHandle y = bridge->alloc_device(float_spec(), 64);
    fake->inject(call, Failure::Fatal);
    if (call == Call::Launch) {
      EXPECT_ANY_THROW(bridge->launch_axpy(DeviceRange{x, 0, 64}, DeviceRange{y, 0, 64}, 1, 0));
    } else {
      EXPECT_ANY_THROW(bridge->view(x, ViewSpec{DType::Float32, {16}, std::nullopt, 0}));
    }
    EXPECT_TRUE(bridge->stats().broken) << fake::call_name(call);
    EXPECT_EQ(bridge->stats().live_views, 0u);
    bridge->restart(2);
    EXPECT_EQ(fake->live_allocations(), 0u);
  }
}

// ---- Closed -------------------------------------------------------------------

TEST_F(LifetimeTest, CloseFreesEverythingAndEveryLaterCallIsClosed) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  const HostRange range = filled_range(64, 55);
  const CopyEvent e = bridge->host_to_device(range, DeviceRange{h, 0, 64}, CopyMode::Async);
  fake->clear_calls();
  bridge->close();
  EXPECT_CALLS(fake, Call::Quiesce, Call::Free, Call::FreeHost);
  EXPECT_EQ(fake->live_allocations(), 0u);
  EXPECT_EQ(fake->live_host_blocks(), 0u);
  EXPECT_TRUE(bridge->stats().closed);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Closed, bridge->alloc_device(bytes_spec(), 64));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Closed, bridge->free_device(h));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Closed, bridge->reserve(64));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Closed, bridge->release_host(range));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Closed, bridge->host_bytes(range));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Closed, bridge->copy_status(e));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Closed, bridge->poll());
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Closed, bridge->restart(2));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Closed, bridge->view(h, ViewSpec{DType::UInt8, {64}, std::nullopt, 0}));
  bridge->close();  // idempotent
  EXPECT_CALLS(fake, Call::Quiesce, Call::Free, Call::FreeHost);
}

TEST(LifetimeStandalone, DestructorClosesAndLeaksNothing) {
  auto shared = std::make_shared<FakeBackend>();
  {
    Bridge b(std::make_unique<ForwardingBackend>(shared), BridgeTest::default_options());
    const DeviceHandle h = b.alloc_device(bytes_spec(), 64);
    const HostRange range = b.reserve(64);
    b.host_to_device(range, DeviceRange{h, 0, 64}, CopyMode::Async);
    b.alloc_device(bytes_spec(), 128);
    EXPECT_EQ(shared->live_allocations(), 2u);
    EXPECT_EQ(shared->live_host_blocks(), 1u);
  }
  EXPECT_EQ(shared->live_allocations(), 0u);
  EXPECT_EQ(shared->live_host_blocks(), 0u);
  EXPECT_TRUE(shared->pending().empty());
}

}  // namespace
}  // namespace devbridge::testing
