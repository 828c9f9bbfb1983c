// The caching pool on every backend (switched on here even where the backend
// does not ask for it): a freed block serves the next request of its size
// class, a block whose fence is pending is never handed out, and restart and
// close leave the backend holding nothing.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "backend_drivers.hpp"
#include "devbridge/bridge.hpp"

namespace devbridge::conformance {
namespace {

constexpr std::uint64_t kBytes = 64 << 10;
const ObjectSpec kFloats{kBytes, 64, DType::Float32, ShapeKind::Vector};
const ViewSpec kFirstFloats{DType::Float32, Dims{16}, std::nullopt, 0};

class PoolConformance : public DriverTest {
 protected:
  Bridge& pooled() {
    return make_bridge(BridgeOptions{.ring_bytes = 1 << 20, .caching_pool = CachingPool::On});
  }
  // The device address behind a handle (a view's data; an OpenCL buffer's handle).
  std::uint64_t address_of(DeviceHandle h) { return bridge().view(h, kFirstFloats)->data; }
  std::uint64_t backend_count() { return driver().live_allocations(bridge().backend()); }
};

TEST_P(PoolConformance, AFreedBlockServesTheNextRequestOfItsClass) {
  auto& b = pooled();
  const auto a = b.alloc_device(kFloats, kBytes);
  const auto address = address_of(a);
  b.free_device(a);
  EXPECT_EQ(backend_count(), 1u) << "the pool keeps the block";
  const auto again = b.alloc_device(kFloats, kBytes - 64);  // the same size class
  EXPECT_EQ(address_of(again), address);
  EXPECT_EQ(b.memory_stats().cache_hits, 1u);
  EXPECT_EQ(b.memory_stats().backend_allocations, 1u);
  b.free_device(again);
  b.empty_cache();
  EXPECT_EQ(backend_count(), 0u);
}

TEST_P(PoolConformance, NoBlockIsHandedOutWhileAFenceOnItIsPending) {
  if (!can_hold()) GTEST_SKIP() << driver().name << " cannot hold work";
  auto& b = pooled();
  const auto x = b.alloc_device(kFloats, kBytes);
  const auto y = b.alloc_device(kFloats, kBytes);
  const auto y_address = address_of(y);
  hold(true);
  b.launch_axpy(DeviceRange{x, 0, kBytes}, DeviceRange{y, 0, kBytes}, 2.0f, 1.0f);
  b.release(y);
  const auto z = b.alloc_device(kFloats, kBytes);
  EXPECT_NE(address_of(z), y_address) << "handed out a block the held kernel still writes";
  hold(false);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (b.memory_stats().cached_blocks == 0 && std::chrono::steady_clock::now() < deadline) {
    (void)b.stats();  // any call reaps the passed fence; y's block goes to the pool
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(b.memory_stats().cached_blocks, 1u);
  const auto w = b.alloc_device(kFloats, kBytes);
  EXPECT_EQ(address_of(w), y_address);
  for (const auto h : {x, z, w}) b.free_device(h);
}

TEST_P(PoolConformance, RestartAndCloseLeaveTheBackendHoldingNothing) {
  auto& b = pooled();
  const auto cached = b.alloc_device(kFloats, kBytes);
  const auto kept = b.alloc_device(kFloats, kBytes);
  b.free_device(cached);
  EXPECT_EQ(backend_count(), 2u);
  b.restart(2);
  EXPECT_EQ(backend_count(), 0u);
  (void)kept;
  b.free_device(b.alloc_device(kFloats, kBytes));
  b.close();
  EXPECT_EQ(backend_count(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Backends, PoolConformance, ::testing::ValuesIn(backend_drivers()),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace devbridge::conformance
