// The drop queue's own rules, on the fake (the conformance suite runs the
// shared rows on every backend): what close and restart do with fences that
// have not passed, a backend that fails to test one, a backend without
// consumer queues, and that each fence is asked about sparingly and given
// back exactly once.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "forwarding_backend.hpp"
#include "support.hpp"

namespace devbridge::testing {
namespace {

using namespace std::chrono_literals;

constexpr std::uint64_t kBytes = 4096;
constexpr std::uintptr_t kQueue = 0x5eed;
const ObjectSpec kFloats{kBytes, 64, DType::Float32, ShapeKind::Vector};
const ViewSpec kVector{DType::Float32, Dims{1024}, std::nullopt, 0};

// Counts fence tests, and can make them fail, on top of a shared fake.
class CountingFences final : public ForwardingBackend {
 public:
  explicit CountingFences(std::shared_ptr<FakeBackend> fake) : ForwardingBackend(fake), fake_(std::move(fake)) {}
  bool fence_passed(Fence fence) override {
    ++tests;
    if (fail_tests) throw Error(ErrorKind::Unavailable, "fence test failed: device lost", /*fatal=*/true);
    return fake_->fence_passed(fence);
  }
  std::atomic<int> tests{0};
  std::atomic<bool> fail_tests{false};

 private:
  std::shared_ptr<FakeBackend> fake_;
};

class FenceTest : public ::testing::Test {
 protected:
  void make(BridgeOptions options = {}) {
    options.ring_bytes = 1 << 16;
    fake = std::make_shared<FakeBackend>();
    fake->set_auto_complete(true);
    auto counting = std::make_unique<CountingFences>(fake);
    fences = counting.get();
    bridge = std::make_unique<Bridge>(std::move(counting), options);
  }
  void launch(DeviceHandle x, DeviceHandle y) {
    bridge->launch_axpy(DeviceRange{x, 0, kBytes}, DeviceRange{y, 0, kBytes}, 1.0f, 0.0f);
  }

  std::shared_ptr<FakeBackend> fake;
  CountingFences* fences = nullptr;
  std::unique_ptr<Bridge> bridge;
};

TEST_F(FenceTest, CloseAbandonsMemoryWhoseFenceNeverPassesAndNeverFreesIt) {
  make(BridgeOptions{.close_fence_timeout = 20ms});
  const auto y = bridge->alloc_device(kFloats, kBytes);
  auto lease = bridge->view(y, kVector);
  fake->block_consumer_queue(kQueue);
  lease.end_after(ConsumerQueue{kQueue});
  bridge->close();
  EXPECT_EQ(bridge->stats().abandoned_fences, 1u);
  EXPECT_EQ(fake->live_allocations(), 1u) << "freed memory a consumer's queue may still read";
  EXPECT_EQ(fake->live_fences(), 0u) << "the abandoned fence was not given back";
  bridge.reset();
  EXPECT_EQ(fake->live_allocations(), 1u);
}

TEST_F(FenceTest, ALeaseEndedAfterAQueueOnAClosedBridgeIsSettledWhenTheBridgeGoes) {
  make();
  const auto y = bridge->alloc_device(kFloats, kBytes);
  auto lease = bridge->view(y, kVector);
  bridge->close();
  EXPECT_EQ(fake->live_allocations(), 1u) << "the lease keeps it past close";
  fake->block_consumer_queue(kQueue);
  lease.end_after(ConsumerQueue{kQueue});
  std::thread consumer([&] {
    std::this_thread::sleep_for(30ms);
    fake->unblock_consumer_queue(kQueue);
  });
  bridge.reset();  // the core goes with its last lease: it waits for the fence first
  consumer.join();
  EXPECT_EQ(fake->live_allocations(), 0u);
  EXPECT_EQ(fake->live_fences(), 0u);
}

TEST_F(FenceTest, AFenceTestThatFailsBreaksTheBridgeAndKeepsTheMemoryUntilARestart) {
  make();
  const auto x = bridge->alloc_device(kFloats, kBytes);
  const auto y = bridge->alloc_device(kFloats, kBytes);
  fake->hold_launches(true);
  launch(x, y);
  bridge->release(y);
  fences->fail_tests = true;
  (void)bridge->stats();
  EXPECT_TRUE(bridge->stats().broken);
  EXPECT_EQ(fake->live_allocations(), 2u) << "memory freed though its fence's state is unknown";
  fences->fail_tests = false;
  bridge->restart(2);  // the quiesce finishes the launch: its fence has passed
  EXPECT_FALSE(bridge->stats().broken);
  EXPECT_EQ(fake->live_allocations(), 0u);
  EXPECT_EQ(fake->live_fences(), 0u);
}

TEST_F(FenceTest, AQueueWithAPendingFenceIsNotAskedAboutItsLaterFences) {
  make();
  const auto x = bridge->alloc_device(kFloats, kBytes);
  const auto y = bridge->alloc_device(kFloats, kBytes);
  fake->hold_launches(true);
  for (int i = 0; i < 100; ++i) launch(x, y);
  EXPECT_EQ(bridge->stats().pending_fences, 100u);
  fences->tests = 0;
  for (int i = 0; i < 10; ++i) (void)bridge->stats();
  EXPECT_EQ(fences->tests.load(), 10) << "a queue runs in order: only its oldest pending fence needs a test";
  fake->hold_launches(false);
  EXPECT_EQ(bridge->stats().pending_fences, 0u);
  bridge->free_device(x);
  bridge->free_device(y);
  EXPECT_EQ(fake->live_fences(), 0u);
}

// A backend whose consumers have no queues (host memory) refuses the fence:
// the step and the lease then stay as they were.
TEST(FenceRefusal, EndingAStepOrAViewAfterAQueueTheBackendCannotFenceChangesNothing) {
  struct NoConsumerQueues final : ForwardingBackend {
    using ForwardingBackend::ForwardingBackend;
    Fence record_fence(const QueueRef& where) override {
      if (where.queue == Queue::Consumer) throw Error(ErrorKind::Unsupported, "no consumer queues here");
      return ForwardingBackend::record_fence(where);
    }
  };
  auto fake = std::make_shared<FakeBackend>();
  Bridge bridge(std::make_unique<NoConsumerQueues>(fake), BridgeOptions{.ring_bytes = 1 << 16});
  const auto z = bridge.alloc_device(kFloats, kBytes);
  const DeviceHandle zs[] = {z};
  bridge.begin_step(3, zs);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Unsupported, bridge.end_step(3, ConsumerQueue{kQueue}));
  EXPECT_EQ(bridge.stats().active_steps, 1u) << "the step ended though its fence was never recorded";
  auto lease = bridge.view(z, kVector);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Unsupported, lease.end_after(ConsumerQueue{kQueue}));
  EXPECT_TRUE(lease) << "the lease ended though no fence holds its memory";
  lease.reset();
  bridge.end_step(3);
  bridge.free_device(z);
  EXPECT_EQ(fake->live_allocations(), 0u);
}

TEST_F(FenceTest, AnUnblockedConsumerQueueEndsAViewAtOnce) {
  make();
  const auto y = bridge->alloc_device(kFloats, kBytes);
  auto lease = bridge->view(y, kVector);
  lease.end_after(ConsumerQueue{kQueue});  // not blocked: the fake's fence has passed already
  EXPECT_EQ(bridge->stats().pending_fences, 0u);
  bridge->free_device(y);
}

TEST_F(FenceTest, FreeDeviceNamesThePendingFences) {
  make();
  const auto x = bridge->alloc_device(kFloats, kBytes);
  fake->hold_launches(true);
  launch(x, x);
  const auto message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->free_device(x));
  EXPECT_NE(message.find("2 uses ending at a fence not yet passed"), std::string::npos) << message;
  fake->hold_launches(false);
  bridge->free_device(x);
}

TEST_F(FenceTest, RestartOrphansWhatAConsumersFenceHoldsAndFreesItWhenTheFencePasses) {
  make();
  const auto y = bridge->alloc_device(kFloats, kBytes);
  auto lease = bridge->view(y, kVector);
  fake->block_consumer_queue(kQueue);
  lease.end_after(ConsumerQueue{kQueue});
  bridge->restart(2);
  EXPECT_EQ(bridge->stats().orphaned_allocations, 1u);
  EXPECT_EQ(fake->live_allocations(), 1u);
  fake->unblock_consumer_queue(kQueue);
  EXPECT_EQ(bridge->stats().orphaned_allocations, 0u);
  EXPECT_EQ(fake->live_allocations(), 0u);
  EXPECT_EQ(fake->live_fences(), 0u);
}

}  // namespace
}  // namespace devbridge::testing
