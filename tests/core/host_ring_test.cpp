// CONTRACT.md "Host ring": reserve alignment, never spanning the end, release
// in any order with the tail advancing over the released prefix, wrap-around,
// Backpressure when full, release refused while a copy uses the range.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <thread>

#ifdef DEVBRIDGE_HAVE_RAPIDCHECK
#include <rapidcheck.h>
#endif

#include "core/host_ring.hpp"
#include "support.hpp"

namespace devbridge::testing {
namespace {

class HostRingTest : public BridgeTest {
 protected:
  static constexpr std::uint64_t kSmallRing = 4096;
  void SetUp() override {
    BridgeOptions options = default_options();
    options.ring_bytes = kSmallRing;
    rebuild(options);
  }
};

TEST_F(HostRingTest, ReserveHonoursAlignment) {
  const HostRange odd = bridge->reserve(3, 1);
  EXPECT_EQ(odd.len, 3u);
  for (std::uint64_t alignment : {2u, 8u, 64u, 256u, 1024u}) {
    const HostRange r = bridge->reserve(5, alignment);
    EXPECT_EQ(r.offset % alignment, 0u) << alignment;
    EXPECT_EQ(r.len, 5u);
  }
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidAlignment, bridge->reserve(8, 3));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidAlignment, bridge->reserve(8, 0));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidAlignment, bridge->reserve(8, 8192));
  EXPECT_ANY_THROW(bridge->reserve(0));
  EXPECT_ANY_THROW(bridge->reserve(kSmallRing + 1));
}

TEST_F(HostRingTest, ReservationsNeverOverlapAndHostBytesAreThem) {
  const HostRange a = bridge->reserve(100, 1);
  const HostRange b = bridge->reserve(100, 1);
  EXPECT_TRUE(a.offset + a.len <= b.offset || b.offset + b.len <= a.offset);
  auto bytes = bridge->host_bytes(a);
  EXPECT_EQ(bytes.size(), 100u);
  EXPECT_EQ(bridge->host_bytes(b).data() - bytes.data(), static_cast<std::ptrdiff_t>(b.offset - a.offset));
  EXPECT_EQ(bridge->host_bytes(HostRange{a.offset + 10, 20}).size(), 20u);  // a sub-range
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, bridge->host_bytes(HostRange{a.offset + 90, 20}));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, bridge->host_bytes(HostRange{3000, 8}));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, bridge->host_bytes(HostRange{UINT64_MAX - 4, 8}));
}

TEST_F(HostRingTest, ReservationNeverSpansTheEnd) {
  const HostRange a = bridge->reserve(3000, 1);
  const HostRange b = bridge->reserve(500, 1);
  bridge->release_host(a);  // tail moves to b
  // 596 bytes left before the end: 2000 must start the next lap, at 0.
  const HostRange c = bridge->reserve(2000, 1);
  EXPECT_EQ(c.offset, 0u);
  EXPECT_LE(c.offset + c.len, kSmallRing);
  // b still owns [3000, 3500): the lap only has room up to it.
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Backpressure, bridge->reserve(1500, 1));
  bridge->release_host(b);
  bridge->release_host(c);
  EXPECT_EQ(bridge->ring_free_bytes(), kSmallRing);
}

// stats().ring_wraps: the CLI's stream reports it, and the planner makes
// the stream's reservations, so only the ring can count them.
TEST_F(HostRingTest, CountsWrapsButNotADrainedRingStartingOver) {
  EXPECT_EQ(bridge->stats().ring_wraps, 0u);
  const HostRange a = bridge->reserve(3000, 1);
  const HostRange b = bridge->reserve(500, 1);
  bridge->release_host(a);
  const HostRange c = bridge->reserve(2000, 1);  // does not fit after b: the next lap, a wrap
  EXPECT_EQ(c.offset, 0u);
  EXPECT_EQ(bridge->stats().ring_wraps, 1u);
  bridge->release_host(b);
  bridge->release_host(c);
  // Drained: the next reservation starts over at 0 without wrapping.
  const HostRange d = bridge->reserve(1000, 1);
  EXPECT_EQ(d.offset, 0u);
  EXPECT_EQ(bridge->stats().ring_wraps, 1u);
  // Up to the ring's end exactly, then on at 0 while d is still held: a wrap.
  const HostRange e = bridge->reserve(kSmallRing - 1000, 1);
  bridge->release_host(d);
  const HostRange f = bridge->reserve(500, 1);
  EXPECT_EQ(f.offset, 0u);
  EXPECT_EQ(bridge->stats().ring_wraps, 2u);
  bridge->release_host(e);
  bridge->release_host(f);
}

TEST_F(HostRingTest, TailAdvancesOnlyOverTheReleasedPrefix) {
  const HostRange a = bridge->reserve(1024, 1);
  const HostRange b = bridge->reserve(1024, 1);
  const HostRange c = bridge->reserve(1024, 1);
  EXPECT_EQ(bridge->stats().ring_reservations, 3u);
  EXPECT_EQ(bridge->ring_free_bytes(), 1024u);
  bridge->release_host(b);  // out of order: a still holds the tail
  EXPECT_EQ(bridge->ring_free_bytes(), 1024u);
  EXPECT_EQ(bridge->stats().ring_reservations, 2u);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, bridge->release_host(b));  // already released
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, bridge->host_bytes(b));
  bridge->release_host(a);  // the tail jumps over a and b
  EXPECT_EQ(bridge->ring_free_bytes(), 3072u);
  bridge->release_host(c);
  EXPECT_EQ(bridge->ring_free_bytes(), kSmallRing);
  EXPECT_EQ(bridge->stats().ring_reservations, 0u);
}

TEST_F(HostRingTest, ReleaseTakesExactlyTheReservedRange) {
  const HostRange a = bridge->reserve(256, 64);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, bridge->release_host(HostRange{a.offset, 128}));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, bridge->release_host(HostRange{a.offset + 64, 192}));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, bridge->release_host(HostRange{UINT64_MAX, 1}));
  bridge->release_host(a);
}

TEST_F(HostRingTest, WrapsAroundManyLapsWithoutLosingBytes) {
  std::vector<std::pair<HostRange, std::vector<std::byte>>> live;
  std::uint64_t seed = 0;
  for (int round = 0; round < 200; ++round) {
    const std::uint64_t len = 100 + (round * 37) % 900;
    HostRange r;
    for (;;) {
      try {
        r = bridge->reserve(len, 16);
        break;
      } catch (const Error& e) {
        ASSERT_EQ(e.kind(), ErrorKind::Backpressure);
        ASSERT_FALSE(live.empty()) << "an empty ring refused " << len << " bytes";
        // Release the oldest, checking nothing overwrote it.
        EXPECT_EQ(to_vector(bridge->host_bytes(live.front().first)), live.front().second);
        bridge->release_host(live.front().first);
        live.erase(live.begin());
      }
    }
    EXPECT_EQ(r.offset % 16, 0u);
    EXPECT_LE(r.offset + r.len, kSmallRing);
    auto data = random_bytes(len, ++seed);
    std::memcpy(bridge->host_bytes(r).data(), data.data(), len);
    live.emplace_back(r, std::move(data));
  }
  for (auto& [r, data] : live) {
    EXPECT_EQ(to_vector(bridge->host_bytes(r)), data);
    bridge->release_host(r);
  }
  EXPECT_EQ(bridge->ring_free_bytes(), kSmallRing);
}

TEST_F(HostRingTest, FullRingIsBackpressureAndFreesUpOnRelease) {
  const HostRange whole = bridge->reserve(kSmallRing, 1);
  EXPECT_EQ(bridge->ring_free_bytes(), 0u);
  const std::string message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::Backpressure, bridge->reserve(1, 1));
  EXPECT_FALSE(message.empty());
  bridge->release_host(whole);
  const HostRange again = bridge->reserve(kSmallRing, 1);
  EXPECT_EQ(again.offset, 0u);
  bridge->release_host(again);
}

// reserve with a timeout waits for room: a release wakes it (a missed wake
// would hang here, the wait has no end), the time running out is
// Backpressure with the ring's message, close() ends it with Closed.
TEST_F(HostRingTest, AWaitingReserveIsWokenByARelease) {
  const HostRange whole = bridge->reserve(kSmallRing, 1);
  std::atomic<bool> started{false};
  std::optional<HostRange> got;
  std::thread waiter([&] {
    started = true;
    got = bridge->reserve(kSmallRing / 2, 64, std::chrono::nanoseconds::max());
  });
  while (!started) std::this_thread::yield();
  bridge->release_host(whole);
  waiter.join();
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->len, kSmallRing / 2);
  bridge->release_host(*got);
}

TEST_F(HostRingTest, AWaitingReserveRunsOutOfTimeAsBackpressure) {
  const HostRange first = bridge->reserve(kSmallRing / 2, 1);
  const HostRange second = bridge->reserve(kSmallRing / 2, 1);
  bridge->release_host(second);  // the ring frees in order: no room until the oldest goes
  const std::string message = EXPECT_DEVBRIDGE_ERROR(
      ErrorKind::Backpressure, bridge->reserve(kSmallRing, 1, std::chrono::milliseconds(1)));
  EXPECT_NE(message.find("host ring full"), std::string::npos) << message;
  bridge->release_host(first);
  bridge->release_host(bridge->reserve(kSmallRing, 1, std::chrono::milliseconds(1)));
  // What can never fit is refused at once, not waited for.
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, bridge->reserve(kSmallRing + 1, 1, std::chrono::hours(1)));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, bridge->reserve(1, 1, std::chrono::nanoseconds(-1)));
}

TEST_F(HostRingTest, CloseEndsAWaitingReserveWithClosed) {
  (void)bridge->reserve(kSmallRing, 1);
  std::atomic<bool> started{false};
  std::optional<ErrorKind> refused;
  std::thread waiter([&] {
    started = true;
    try {
      (void)bridge->reserve(1, 1, std::chrono::nanoseconds::max());
    } catch (const Error& e) {
      refused = e.kind();
    }
  });
  while (!started) std::this_thread::yield();
  bridge->close();
  waiter.join();
  EXPECT_EQ(refused, ErrorKind::Closed);
}

// docs/BACKENDS.md: the fake's memory_bytes bounds its device allocations;
// the ring is host memory, as on a real device, and is not counted (a ring
// larger than the whole memory is refused all the same).
TEST_F(HostRingTest, TheFakesMemoryBytesBoundsDeviceAllocationsNotTheRing) {
  BridgeOptions options = default_options();
  options.ring_bytes = kSmallRing;
  options.caching_pool = CachingPool::Off;
  rebuild(options, 8192);
  EXPECT_EQ(fake->describe().free_memory, 8192u) << "the ring takes none of it";
  const DeviceHandle all = bridge->alloc_device(bytes_spec(), 8192);
  EXPECT_EQ(fake->describe().free_memory, 0u);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationFailed, bridge->alloc_device(bytes_spec(), 64));
  bridge->free_device(all);
  options.ring_bytes = 8192 + 4096;
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationFailed, Bridge(std::make_unique<FakeBackend>(8192), options));
}

TEST_F(HostRingTest, ReleaseRefusedWhileAnAsyncCopyUsesTheRange) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 512);
  const HostRange a = filled_range(512, 61);
  const HostRange b = filled_range(512, 62);
  const CopyEvent up = bridge->host_to_device(HostRange{a.offset + 128, 128}, DeviceRange{h, 0, 128}, CopyMode::Async);
  const CopyEvent down = bridge->device_to_host(DeviceRange{h, 0, 512}, b, CopyMode::Async);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->release_host(a));  // a sub-range is in use
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->release_host(b));
  complete(up);
  bridge->release_host(a);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->release_host(b));
  complete(down);
  bridge->release_host(b);
}

TEST_F(HostRingTest, FailedCopyUnpinsTheRangeButKeepsItReserved) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 512);
  std::vector<std::byte> data;
  const HostRange a = filled_range(512, 63, &data);
  const CopyEvent e = bridge->host_to_device(a, DeviceRange{h, 0, 512}, CopyMode::Async);
  complete(e, false);
  EXPECT_EQ(to_vector(bridge->host_bytes(a)), data);
  bridge->release_host(a);
}

#ifdef DEVBRIDGE_HAVE_RAPIDCHECK
// Property: under any sequence of reserves and out-of-order releases, live
// reservations lie inside the ring, are aligned, never overlap, keep their
// bytes, and once all are released the whole ring is free again.
TEST(HostRingProperty, ReservationsStayDisjointAndIntact) {
  const bool ok = rc::check("ring reservations stay disjoint and intact", [] {
    constexpr std::uint64_t kRing = 2048;
    BridgeOptions options = BridgeTest::default_options();
    options.ring_bytes = kRing;
    Bridge bridge(std::make_unique<FakeBackend>(), options);
    struct Live {
      HostRange range;
      std::vector<std::byte> data;
    };
    std::vector<Live> live;
    const auto ops = *rc::gen::container<std::vector<std::tuple<bool, std::uint32_t, std::uint32_t>>>(
        rc::gen::tuple(rc::gen::arbitrary<bool>(), rc::gen::inRange<std::uint32_t>(1, 900),
                       rc::gen::inRange<std::uint32_t>(0, 8)));
    std::uint64_t seed = 1;
    for (const auto& [do_reserve, size, shift] : ops) {
      if (do_reserve || live.empty()) {
        const std::uint64_t alignment = std::uint64_t{1} << shift;
        HostRange r;
        try {
          r = bridge.reserve(size, alignment);
        } catch (const Error& e) {
          RC_ASSERT(e.kind() == ErrorKind::Backpressure);
          RC_ASSERT(!live.empty());
          continue;
        }
        RC_ASSERT(r.len == size);
        RC_ASSERT(r.offset % alignment == 0);
        RC_ASSERT(r.offset + r.len <= kRing);
        for (const auto& other : live) {
          RC_ASSERT(r.offset + r.len <= other.range.offset || other.range.offset + other.range.len <= r.offset);
        }
        auto data = random_bytes(size, ++seed);
        std::memcpy(bridge.host_bytes(r).data(), data.data(), size);
        live.push_back({r, std::move(data)});
      } else {
        const std::size_t index = size % live.size();
        RC_ASSERT(to_vector(bridge.host_bytes(live[index].range)) == live[index].data);
        bridge.release_host(live[index].range);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(index));
      }
    }
    for (const auto& l : live) {
      RC_ASSERT(to_vector(bridge.host_bytes(l.range)) == l.data);
      bridge.release_host(l.range);
    }
    RC_ASSERT(bridge.ring_free_bytes() == kRing);
    RC_ASSERT(bridge.reserve(kRing, 1).offset == 0u);
  });
  EXPECT_TRUE(ok);
}
#endif

}  // namespace
}  // namespace devbridge::testing

// The ring's own bookkeeping, without a bridge: more reservations than its
// first table holds (it doubles, with the oldest keys past the first slots),
// every sub-range found in the reservation that holds it whatever its place
// (the newest, or a search among the older ones), released ones and the
// bytes past the head refused, pins kept across growth.
namespace devbridge::testing {
namespace {
using detail::HostRing;

TEST(HostRingKeys, FindsEveryRangeInItsReservationAcrossGrowthAndLaps) {
  constexpr std::uint64_t kCapacity = 64 * 64;
  std::vector<std::byte> memory(kCapacity);
  HostRing ring(HostBlock{memory.data(), kCapacity});
  std::deque<std::pair<HostRange, HostRing::Key>> live;
  for (int lap = 0; lap < 5; ++lap) {
    // Fill to 40 of the 64 places (the table grows past 8, 16, 32), keys
    // starting wherever the previous lap left them.
    while (live.size() < 40) {
      const HostRange range = ring.reserve(64, 64);
      live.emplace_back(range, ring.find(range));
    }
    for (std::size_t i = 0; i < live.size(); ++i) {
      const auto [range, key] = live[i];
      EXPECT_EQ(ring.find(HostRange{range.offset + 8, 16}), key) << "reservation " << i << " of lap " << lap;
      EXPECT_EQ(ring.find(HostRange{range.offset + 63, 1}), key);
      EXPECT_THROW(ring.find(HostRange{range.offset + 60, 8}), Error);  // into the next one
      ring.pin(key);
    }
    // Released from the middle: refused there, the others still found.
    auto pinned = live[live.size() / 2];
    ring.unpin(pinned.second);
    ring.release(pinned.first);
    EXPECT_THROW(ring.find(pinned.first), Error);
    EXPECT_EQ(ring.find(live.front().first), live.front().second);
    EXPECT_EQ(ring.find(live.back().first), live.back().second);
    live.erase(live.begin() + static_cast<std::ptrdiff_t>(live.size() / 2));
    // Past the head: nothing reserved there.
    const auto head = (live.back().first.offset + 64) % kCapacity;
    EXPECT_THROW(ring.find(HostRange{head, 64}), Error);
    // The oldest 30 go (their pins first: a pinned range is refused).
    EXPECT_THROW(ring.release(live.front().first), Error);
    for (int i = 0; i < 30; ++i) {
      ring.unpin(live.front().second);
      ring.release(live.front().first);
      live.pop_front();
    }
    for (const auto& [range, key] : live) EXPECT_EQ(ring.find(range), key);
    for (const auto& [range, key] : live) ring.unpin(key);
  }
  EXPECT_EQ(ring.reservations(), live.size());
}
}  // namespace
}  // namespace devbridge::testing
