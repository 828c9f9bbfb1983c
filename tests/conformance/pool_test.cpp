// The caching pool on every backend (switched on here even where the backend
// does not ask for it): a freed block serves the next request of its size
// class, a block whose fence is pending is never handed out, restart and
// close leave the backend holding nothing, and where the backend addresses
// parts (host, CUDA, the fake) small blocks share a segment and large ones
// split and coalesce. Blocks of 4 MiB are large: each is a segment of its own.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <vector>
#include <thread>

#include "backend_drivers.hpp"
#include "devbridge/bridge.hpp"

namespace devbridge::conformance {
namespace {

constexpr std::uint64_t kBytes = 4 << 20;
const ObjectSpec kFloats{kBytes, 64, DType::Float32, ShapeKind::Vector};
const ViewSpec kFirstFloats{DType::Float32, Dims{16}, std::nullopt, 0};

class PoolConformance : public DriverTest {
 protected:
  Bridge& pooled() {
    return make_bridge(BridgeOptions{.ring_bytes = 1 << 20, .caching_pool = CachingPool::On});
  }
  // The device address behind a handle (a view's data; an OpenCL buffer's handle).
  std::uint64_t address_of(DeviceHandle h) { return bridge().view(h, kFirstFloats)->data; }
  std::uint64_t backend_count() { return bridge().backend().test_controls()->live_allocations(); }
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

TEST_P(PoolConformance, SmallBlocksShareASegmentAndLargeOnesSplitAndCoalesce) {
  auto& b = pooled();
  if (!b.memory_stats().pool_splits) GTEST_SKIP() << driver().name << " cannot address parts of an allocation";
  const ObjectSpec small{64 << 10, 64, DType::Float32, ShapeKind::Vector};
  // Small: eight 64 KiB tensors in one 2 MiB segment, each its own bytes.
  std::vector<DeviceHandle> smalls;
  for (int i = 0; i < 8; ++i) smalls.push_back(b.alloc_device(small, 64 << 10));
  EXPECT_EQ(b.memory_stats().segments, 1u);
  EXPECT_EQ(backend_count(), 1u);
  std::vector<float> values(16);
  for (std::size_t i = 0; i < smalls.size(); ++i) {
    std::fill(values.begin(), values.end(), static_cast<float>(i));
    const auto r = b.reserve(64);
    std::memcpy(b.host_bytes(r).data(), values.data(), 64);
    b.host_to_device(r, DeviceRange{smalls[i], 0, 64}, CopyMode::Sync);
    b.release_host(r);
  }
  for (std::size_t i = 0; i < smalls.size(); ++i) {
    const auto r = b.reserve(64);
    b.device_to_host(DeviceRange{smalls[i], 0, 64}, r, CopyMode::Sync);
    std::memcpy(values.data(), b.host_bytes(r).data(), 64);
    b.release_host(r);
    EXPECT_EQ(values[15], static_cast<float>(i)) << "tensor " << i << " shares bytes with another";
  }
  for (const auto h : smalls) b.free_device(h);
  EXPECT_EQ(b.memory_stats().free_segments, 1u) << "the freed spans coalesce into the whole segment";
  EXPECT_EQ(b.memory_stats().cached_blocks, 1u);
  // Large: a freed 16 MiB segment serves a 4 MiB and an 8 MiB tensor.
  const ObjectSpec large{16 << 20, 64, DType::Float32, ShapeKind::Vector};
  b.free_device(b.alloc_device(large, 16 << 20));
  const auto segments = b.memory_stats().segments;
  const auto four = b.alloc_device(large, 4 << 20);
  const auto eight = b.alloc_device(large, 8 << 20);
  EXPECT_EQ(b.memory_stats().segments, segments) << "both from the freed 16 MiB segment";
  b.free_device(four);
  b.free_device(eight);
  // Coalesced again: the whole 16 MiB serves a 16 MiB tensor without the backend.
  const auto backend_allocations = b.memory_stats().backend_allocations;
  const auto whole = b.alloc_device(large, 16 << 20);
  EXPECT_EQ(b.memory_stats().backend_allocations, backend_allocations);
  b.free_device(whole);
  b.empty_cache();
  EXPECT_EQ(backend_count(), 0u);
  EXPECT_EQ(b.memory_stats().reserved_bytes, 0u);
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
