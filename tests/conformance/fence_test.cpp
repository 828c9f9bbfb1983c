// Lifetimes ordered on the device, on every backend: a use that ends on a
// queue (a launch, a step ended after a consumer's queue, a view a consumer
// reads on its own queue) keeps its memory until the fence recorded there
// passes, and nobody has to poll for it to be freed afterwards.
//
// "Held" work is each backend's test control (Backend::hold_copies: the
// fake's held launches, the host engine's held compute lane, a gated CUDA
// stream, an OpenCL user event); a consumer's queue is a blockable queue of
// the test's own (TestConsumerQueue).
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend_drivers.hpp"
#include "devbridge/bridge.hpp"
#include "trace_checks.hpp"

namespace devbridge::conformance {
namespace {

using namespace std::chrono_literals;

constexpr std::uint64_t kBytes = 4096;
const ObjectSpec kFloats{kBytes, 64, DType::Float32, ShapeKind::Vector};

class FenceConformance : public DriverTest {
 protected:
  // Calls `probe` (any bridge call but poll) until `done` holds: a fence that
  // passed is noticed by whatever call comes next. Bounded so a lost fence
  // fails the test instead of hanging it; the bound is not a measurement.
  bool eventually(const std::function<bool()>& done) {
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(1ms);
    }
    return true;
  }

  bool backend_holds(std::uint64_t allocations) {
    return eventually([&] {
      (void)bridge().stats();  // any call reclaims what passed
      return backend_live_allocations() == allocations;
    });
  }

  std::unique_ptr<TestConsumerQueue> consumer_queue() {
    if (!driver().consumer_queue) return nullptr;
    return driver().consumer_queue(bridge().backend());
  }

};

// GTEST_SKIP returns from the function it is in: a macro, so it ends the test.
#define SKIP_WITHOUT_CONSUMER_QUEUES()                                                                        \
  if (!driver().consumer_queue)                                                                               \
  GTEST_SKIP() << driver().name << " has no consumer queues (a CPU consumer is done when its call returns)"

// The use-after-free the old design allowed: a launch counted as done once
// enqueued, so freeing y right after it handed memory the kernel was still
// writing back to the backend.
TEST_P(FenceConformance, FreeRightAfterAHeldLaunchIsDeferredUntilTheKernelFinished) {
  if (!can_hold()) GTEST_SKIP() << driver().name << " cannot hold work";
  auto& b = make_bridge(1 << 20);
  const auto x = b.alloc_device(kFloats, kBytes);
  const auto y = b.alloc_device(kFloats, kBytes);
  hold(true);
  b.launch_axpy(DeviceRange{x, 0, kBytes}, DeviceRange{y, 0, kBytes}, 2.0f, 1.0f);

  try {
    b.free_device(y);
    FAIL() << "free_device succeeded while the launch writing y was held";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::AllocationStillInUse);
    EXPECT_NE(std::string(e.what()).find("fence"), std::string::npos) << e.what();
  }
  b.release(y);
  b.release(x);
  EXPECT_GE(b.stats().pending_fences, 1u);
  // Neither to the backend nor to the pool (which may pack both into one segment).
  EXPECT_EQ(b.memory_stats().allocations, 2u) << "memory went back while the kernel may still run";
  EXPECT_EQ(b.memory_stats().allocated_bytes, 2 * kBytes);
  EXPECT_GE(backend_live_allocations(), 1u) << "memory went back while the kernel may still run";

  hold(false);
  EXPECT_TRUE(backend_holds(0)) << "released memory was not reclaimed once the launch finished";
  EXPECT_EQ(b.stats().pending_fences, 0u);
}

TEST_P(FenceConformance, ALaunchThatFinishedOnItsOwnFreesItsReleasedMemoryWithoutAPoll) {
  auto& b = make_bridge(1 << 20);
  const auto x = b.alloc_device(kFloats, kBytes);
  const auto y = b.alloc_device(kFloats, kBytes);
  b.launch_axpy(DeviceRange{x, 0, kBytes}, DeviceRange{y, 0, kBytes}, 1.0f, 0.0f);
  b.release(x);
  b.release(y);
  EXPECT_TRUE(backend_holds(0));
}

TEST_P(FenceConformance, AViewEndedAfterAConsumersQueueHoldsItsMemoryUntilTheQueuePassesIt) {
  SKIP_WITHOUT_CONSUMER_QUEUES();
  auto& b = make_bridge(1 << 20);
  const auto y = b.alloc_device(kFloats, kBytes);
  auto queue = consumer_queue();
  auto lease = b.view(y, ViewSpec{DType::Float32, Dims{1024}, std::nullopt, 0});
  queue->block();
  lease.end_after(ConsumerQueue{queue->handle()});
  EXPECT_FALSE(lease) << "end_after ends the lease itself";
  b.release(y);
  EXPECT_EQ(b.stats().pending_fences, 1u);
  EXPECT_EQ(backend_live_allocations(), 1u) << "freed while the consumer's queue may still read it";

  queue->unblock();
  EXPECT_TRUE(backend_holds(0));
}

TEST_P(FenceConformance, AStepEndedAfterAConsumersQueueKeepsFreeDeviceStrictUntilItsFencePasses) {
  SKIP_WITHOUT_CONSUMER_QUEUES();
  auto& b = make_bridge(1 << 20);
  const auto y = b.alloc_device(kFloats, kBytes);
  auto queue = consumer_queue();
  const DeviceHandle handles[] = {y};
  b.begin_step(7, handles);
  queue->block();
  b.end_step(7, ConsumerQueue{queue->handle()});
  EXPECT_EQ(b.stats().active_steps, 0u);
  try {
    b.free_device(y);
    FAIL() << "free_device succeeded while a consumer's queue may still run the step";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::AllocationStillInUse) << e.what();
  }
  queue->unblock();
  EXPECT_TRUE(eventually([&] {
    try {
      b.free_device(y);
      return true;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::AllocationStillInUse) << e.what();
      return false;
    }
  }));
  EXPECT_EQ(backend_live_allocations(), 0u);
}

TEST_P(FenceConformance, RestartWithPendingFencesLeaksNothing) {
  if (!can_hold()) GTEST_SKIP() << driver().name << " cannot hold work";
  auto& b = make_bridge(1 << 20);
  const auto x = b.alloc_device(kFloats, kBytes);
  const auto y = b.alloc_device(kFloats, kBytes);
  const auto z = b.alloc_device(kFloats, kBytes);
  hold(true);
  b.launch_axpy(DeviceRange{x, 0, kBytes}, DeviceRange{y, 0, kBytes}, 1.0f, 0.0f);
  auto queue = consumer_queue();
  if (queue) {
    auto lease = b.view(z, ViewSpec{DType::Float32, Dims{1024}, std::nullopt, 0});
    queue->block();
    lease.end_after(ConsumerQueue{queue->handle()});
  }
  held_ = false;  // the restart's quiesce ends held work

  b.restart(2);
  // The launch's queue is the backend's own: the quiesce finished it, so x
  // and y are gone. z waits for the consumer, whose queue is not ours.
  EXPECT_EQ(backend_live_allocations(), queue ? 1u : 0u);
  EXPECT_EQ(b.stats().orphaned_allocations, queue ? 1u : 0u);
  if (queue) queue->unblock();
  EXPECT_TRUE(backend_holds(0));
  EXPECT_EQ(b.stats().orphaned_allocations, 0u);
  EXPECT_EQ(b.stats().pending_fences, 0u);
}

TEST_P(FenceConformance, CloseWaitsForAConsumersFenceThenFreesEverything) {
  SKIP_WITHOUT_CONSUMER_QUEUES();
  auto& b = make_bridge(1 << 20);
  const auto y = b.alloc_device(kFloats, kBytes);
  auto queue = consumer_queue();
  auto lease = b.view(y, ViewSpec{DType::Float32, Dims{1024}, std::nullopt, 0});
  queue->block();
  lease.end_after(ConsumerQueue{queue->handle()});
  std::thread consumer([&] {
    std::this_thread::sleep_for(50ms);
    queue->unblock();
  });
  b.close();
  consumer.join();
  EXPECT_EQ(backend_live_allocations(), 0u);
  EXPECT_EQ(b.memory_stats().reserved_bytes, 0u) << "what the fence held went to the pool and stayed there";
  EXPECT_EQ(b.stats().abandoned_fences, 0u);
}

// The flight recorder shows a fence as a slice on its queue's track, from
// when the use was queued to when the bridge saw the fence pass: a held
// launch's on the compute track, a consumer's on a track of that queue.
TEST_P(FenceConformance, TheRecorderShowsEachFenceAsASliceOnItsQueuesTrack) {
  if (!can_hold() && !driver().consumer_queue) GTEST_SKIP() << driver().name << " has no fence that stays pending";
  auto& b = make_bridge(1 << 20);
  b.record(RecordOptions{.max_events = 1000});
  const auto x = b.alloc_device(kFloats, kBytes);
  const auto y = b.alloc_device(kFloats, kBytes);
  if (can_hold()) hold(true);
  b.launch_axpy(DeviceRange{x, 0, kBytes}, DeviceRange{y, 0, kBytes}, 2.0f, 1.0f);
  b.release(x);
  b.release(y);
  auto queue = consumer_queue();
  if (queue) {
    const auto z = b.alloc_device(kFloats, kBytes);
    auto lease = b.view(z, ViewSpec{DType::Float32, Dims{1024}, std::nullopt, 0});
    queue->block();
    lease.end_after(ConsumerQueue{queue->handle()});
    b.release(z);
    queue->unblock();
  }
  if (can_hold()) hold(false);
  ASSERT_TRUE(backend_holds(0));

  const auto trace = nlohmann::json::parse(b.trace_json());
  testing::expect_valid_trace(trace);
  std::map<std::uint64_t, std::string> track_names;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "M" && e["name"] == "thread_name") track_names[e["tid"]] = e["args"]["name"];
  std::map<std::string, std::vector<std::string>> fences;  // "B <queue>" / "E <status>", by track name
  for (const auto& e : trace["traceEvents"]) {
    if (e["name"] != "fence") continue;
    ASSERT_TRUE(e["ph"] == "B" || e["ph"] == "E") << e.dump() << ": a fence is a slice";
    EXPECT_EQ(e["cat"], "fence");
    // A lane of the track counts as the track ("compute #2": the launch's own slice is open beside it).
    const auto& lane = track_names[e["tid"]];
    const auto track = lane.substr(0, lane.find(" #"));
    fences[track].push_back(e["ph"] == "B" ? "B " + e["args"]["queue"].get<std::string>()
                                           : "E " + e["args"]["status"].get<std::string>());
    // What the fence holds: x and y for the launch, z for the consumer.
    if (e["ph"] == "B") EXPECT_EQ(e["args"]["bytes"], track == "compute" ? 2 * kBytes : kBytes) << e.dump();
  }
  std::map<std::string, std::vector<std::string>> expected;
  if (can_hold()) expected["compute"] = {"B compute", "E passed"};
  if (queue) expected["consumer " + std::to_string(queue->handle())] = {"B consumer", "E passed"};
  EXPECT_EQ(fences, expected) << trace.dump(1);
}

INSTANTIATE_TEST_SUITE_P(Backends, FenceConformance, ::testing::ValuesIn(backend_drivers()),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace devbridge::conformance
