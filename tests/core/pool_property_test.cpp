// Property: under any sequence of allocations and frees of mixed sizes
// through the splitting pool (the fake addresses parts and refuses a use of
// a released one), live allocations never overlap and keep their bytes, the
// pool's books balance (allocated + cached == reserved), and once all are
// freed every segment is whole again and goes back to the backend.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#ifdef DEVBRIDGE_HAVE_RAPIDCHECK
#include <rapidcheck.h>
#endif

#include "support.hpp"

namespace devbridge::testing {
namespace {

#ifdef DEVBRIDGE_HAVE_RAPIDCHECK
TEST(SplitPoolProperty, LiveAllocationsStayDisjointAndIntactAndTheBooksBalance) {
  const bool ok = rc::check("the split pool keeps allocations disjoint and intact", [] {
    auto fake = std::make_shared<FakeBackend>(1ull << 30);
    Bridge bridge(std::make_unique<ForwardingBackend>(fake),
                  BridgeOptions{.ring_bytes = 1 << 16,
                                .caching_pool = CachingPool::On,
                                .pool_cap_bytes = *rc::gen::element<std::uint64_t>(0, 4 << 20, ~0ull)});
    struct Live {
      DeviceHandle handle;
      std::uint64_t address, extent;
      std::byte mark;
    };
    std::vector<Live> live;
    const auto view_address = [&](DeviceHandle h) {
      return bridge.view(h, ViewSpec{DType::UInt8, Dims{1}, std::nullopt, 0})->data;
    };
    const auto read_first = [&](DeviceHandle h, std::uint64_t len) {
      const auto r = bridge.reserve(len);
      bridge.device_to_host(DeviceRange{h, 0, len}, r, CopyMode::Sync);
      std::vector<std::byte> out(bridge.host_bytes(r).begin(), bridge.host_bytes(r).end());
      bridge.release_host(r);
      return out;
    };
    // Small (packed), mid-size, and large (own or split segments) extents.
    const auto extent_gen = rc::gen::oneOf(rc::gen::inRange<std::uint64_t>(1, 1 << 12),
                                           rc::gen::inRange<std::uint64_t>(1 << 12, 3 << 19),
                                           rc::gen::inRange<std::uint64_t>(1 << 20, 12 << 20));
    const auto steps = *rc::gen::inRange(1, 120);
    for (int step = 0; step < steps; ++step) {
      if (live.empty() || *rc::gen::inRange(0, 5) < 3) {
        const std::uint64_t extent = *extent_gen;
        const auto h = bridge.alloc_device(ObjectSpec{extent, 1, DType::UInt8, ShapeKind::Vector}, extent);
        const auto address = view_address(h);
        for (const auto& other : live)
          RC_ASSERT(address + extent <= other.address || other.address + other.extent <= address);
        const auto mark = static_cast<std::byte>(step + 1);
        const std::uint64_t len = std::min<std::uint64_t>(extent, 4096);
        const auto r = bridge.reserve(len);
        std::memset(bridge.host_bytes(r).data(), static_cast<int>(mark), len);
        bridge.host_to_device(r, DeviceRange{h, 0, len}, CopyMode::Sync);
        bridge.release_host(r);
        live.push_back({h, address, extent, mark});
      } else {
        const auto index = *rc::gen::inRange<std::size_t>(0, live.size());
        const auto& victim = live[index];
        const auto bytes = read_first(victim.handle, std::min<std::uint64_t>(victim.extent, 4096));
        RC_ASSERT(std::all_of(bytes.begin(), bytes.end(), [&](std::byte b) { return b == victim.mark; }));
        bridge.free_device(victim.handle);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(index));
      }
      const auto stats = bridge.memory_stats();
      RC_ASSERT(stats.allocated_bytes + stats.cached_bytes == stats.reserved_bytes);
      RC_ASSERT(stats.segments == fake->live_allocations());
      RC_ASSERT(fake->live_parts() == live.size());
      if (stats.pool_cap_bytes == 0) RC_ASSERT(stats.free_segments == 0u);  // a whole free segment goes back
    }
    for (const auto& l : live) bridge.free_device(l.handle);
    const auto stats = bridge.memory_stats();
    RC_ASSERT(stats.free_segments == stats.segments);
    RC_ASSERT(stats.cached_blocks == stats.segments);  // every segment coalesced whole
    bridge.empty_cache();
    RC_ASSERT(fake->live_allocations() == 0u);
    RC_ASSERT(fake->live_parts() == 0u);
    RC_ASSERT(bridge.memory_stats().reserved_bytes == 0u);
  });
  EXPECT_TRUE(ok);
}
#else
TEST(SplitPoolProperty, NeedsRapidcheck) { GTEST_SKIP() << "rapidcheck is not installed (scripts/setup.sh installs it)"; }
#endif

}  // namespace
}  // namespace devbridge::testing
