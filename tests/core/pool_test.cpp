// The caching pool and the out-of-memory retry, on the fake (which records
// every backend call, so a cache hit is a missing Allocate).
#include <gtest/gtest.h>

#include <memory>

#include "devbridge/backends/host.hpp"
#include "support.hpp"

namespace devbridge::testing {
namespace {

const ObjectSpec kBytes4K{1 << 20, 64, DType::UInt8, ShapeKind::Vector};
const ObjectSpec kFloats{1 << 20, 64, DType::Float32, ShapeKind::Vector};

std::size_t count(const std::vector<RecordedCall>& calls, Call kind) {
  std::size_t n = 0;
  for (const auto& call : calls) n += call.call == kind;
  return n;
}

struct PoolTest : ::testing::Test {
  static constexpr std::uint64_t kRing = 4096;
  void make(CachingPool pool = CachingPool::On, std::uint64_t memory = 1ull << 30, std::uint64_t cap = UINT64_MAX) {
    fake = std::make_shared<FakeBackend>(memory);  // the ring is not counted, but must fit in it
    fake->set_parts(parts);
    bridge = std::make_unique<Bridge>(std::make_unique<ForwardingBackend>(fake),
                                      BridgeOptions{.ring_bytes = kRing, .caching_pool = pool, .pool_cap_bytes = cap});
    fake->clear_calls();
  }
  std::shared_ptr<FakeBackend> fake;
  std::unique_ptr<Bridge> bridge;
  // Whole blocks (a device without parts, as OpenCL) unless a test splits.
  bool parts = false;
};

TEST_F(PoolTest, SizeClassesAreQuarterOctaves) {
  make();
  // 5000 bytes round up to 5120 (4096 + 1024), not to 4096: a new block.
  bridge->free_device(bridge->alloc_device(kBytes4K, 4096));
  const auto a = bridge->alloc_device(kBytes4K, 4992);
  EXPECT_EQ(count(fake->calls(), Call::Allocate), 2u);
  EXPECT_EQ(fake->calls().back().bytes, 5120u);
  bridge->free_device(a);
  const auto b = bridge->alloc_device(kBytes4K, 5120);  // the same class: a hit
  EXPECT_EQ(count(fake->calls(), Call::Allocate), 2u);
  const auto c = bridge->alloc_device(kBytes4K, 64);  // the smallest class is 512 bytes
  EXPECT_EQ(fake->calls().back().bytes, 512u);
  bridge->free_device(b);
  bridge->free_device(c);
}

TEST_F(PoolTest, AFreedBlockServesTheNextRequestOfItsSizeClassWithoutTheBackend) {
  make();
  const auto a = bridge->alloc_device(kBytes4K, 4096);
  bridge->free_device(a);
  const auto b = bridge->alloc_device(kBytes4K, 3712);  // above 3.5 KiB: the same 4 KiB class
  const auto calls = fake->calls();
  EXPECT_EQ(count(calls, Call::Allocate), 1u) << describe_calls(calls);
  EXPECT_EQ(count(calls, Call::Free), 0u);
  auto stats = bridge->memory_stats();
  EXPECT_TRUE(stats.pool_enabled);
  EXPECT_EQ(stats.cache_hits, 1u);
  EXPECT_EQ(stats.cache_misses, 1u);
  EXPECT_EQ(stats.backend_allocations, 1u);
  EXPECT_EQ(stats.total_allocations, 2u);
  EXPECT_EQ(stats.allocated_bytes, 4096u);
  bridge->free_device(b);
  stats = bridge->memory_stats();
  EXPECT_EQ(stats.cached_blocks, 1u);
  EXPECT_EQ(stats.reserved_bytes, 4096u);
  bridge->empty_cache();
  EXPECT_EQ(bridge->memory_stats().cached_bytes, 0u);
  EXPECT_EQ(fake->live_allocations(), 0u);
}

TEST_F(PoolTest, ABlockIsNotReusedWhileAFenceOnItIsPending) {
  make();
  const auto x = bridge->alloc_device(kFloats, 4096);
  const auto y = bridge->alloc_device(kFloats, 4096);
  fake->hold_launches(true);
  bridge->launch_axpy(DeviceRange{x, 0, 4096}, DeviceRange{y, 0, 4096}, 1.0f, 0.0f);
  bridge->release(y);
  const auto z = bridge->alloc_device(kFloats, 4096);  // y's kernel may still write: a new block
  EXPECT_EQ(count(fake->calls(), Call::Allocate), 3u);
  EXPECT_EQ(bridge->memory_stats().cached_blocks, 0u);
  fake->hold_launches(false);
  EXPECT_EQ(bridge->memory_stats().cached_blocks, 0u) << "memory_stats reaps nothing; stats() does";
  (void)bridge->stats();
  EXPECT_EQ(bridge->memory_stats().cached_blocks, 1u);
  const auto w = bridge->alloc_device(kFloats, 4096);  // now y's block
  EXPECT_EQ(count(fake->calls(), Call::Allocate), 3u);
  for (const auto h : {x, z, w}) bridge->free_device(h);
}

TEST_F(PoolTest, TheCapSendsWhatDoesNotFitBackToTheBackend) {
  make(CachingPool::On, 1ull << 30, 4096);
  const auto a = bridge->alloc_device(kBytes4K, 4096);
  const auto b = bridge->alloc_device(kBytes4K, 4096);
  bridge->free_device(a);
  bridge->free_device(b);
  const auto stats = bridge->memory_stats();
  EXPECT_EQ(stats.cached_bytes, 4096u);
  EXPECT_EQ(stats.backend_frees, 1u);
  EXPECT_EQ(fake->live_allocations(), 1u);
}

// A workload that changes sizes (one model's tensors freed, another's
// loaded): the cap fills with blocks of the old size. What goes back past it
// is an old-size block at least as large as the new one just freed (and, when
// a new block must be made, old blocks past the room it needs under the cap),
// so the new size is served from the cache from its second round on instead
// of allocating every time.
TEST_F(PoolTest, PastTheCapBlocksOfASizeNoLongerAskedForGoBackFirst) {
  make(CachingPool::On, 1ull << 30, 64 << 10);
  const auto old_a = bridge->alloc_device(kBytes4K, 32 << 10);
  const auto old_b = bridge->alloc_device(kBytes4K, 32 << 10);
  bridge->free_device(old_a);
  bridge->free_device(old_b);  // 64 KiB of 32 KiB blocks: the cap is full
  for (int round = 0; round < 3; ++round) {
    fake->clear_calls();
    std::vector<DeviceHandle> new_size;
    for (int i = 0; i < 4; ++i) new_size.push_back(bridge->alloc_device(kBytes4K, 16 << 10));
    for (const auto h : new_size) bridge->free_device(h);
    const auto allocated = count(fake->calls(), Call::Allocate);
    if (round == 0) EXPECT_EQ(allocated, 4u);
    else EXPECT_EQ(allocated, 0u) << "round " << round << ": " << describe_calls(fake->calls());
    EXPECT_LE(bridge->memory_stats().free_segment_bytes, 64u << 10);
  }
  EXPECT_EQ(fake->live_allocations(), 4u) << "the four 16 KiB blocks, cached";
}

TEST_F(PoolTest, RestartAndCloseGiveTheCacheBack) {
  make();
  bridge->free_device(bridge->alloc_device(kBytes4K, 4096));
  EXPECT_EQ(fake->live_allocations(), 1u);
  bridge->restart(2);
  EXPECT_EQ(fake->live_allocations(), 0u);
  bridge->free_device(bridge->alloc_device(kBytes4K, 4096));
  bridge->close();
  EXPECT_EQ(fake->live_allocations(), 0u);
}

TEST_F(PoolTest, PeaksAndTotalsFollowTheAllocationsAndResetToTheCurrentFigures) {
  make();
  const auto a = bridge->alloc_device(kBytes4K, 8192);
  const auto b = bridge->alloc_device(kBytes4K, 4096);
  bridge->free_device(a);
  auto stats = bridge->memory_stats();
  EXPECT_EQ(stats.peak_allocated_bytes, 8192u + 4096u);
  EXPECT_EQ(stats.allocated_bytes, 4096u);
  EXPECT_EQ(stats.total_allocated_bytes, 8192u + 4096u);
  EXPECT_EQ(stats.reserved_bytes, 8192u + 4096u);  // a's block is cached
  EXPECT_EQ(stats.largest_request_bytes, 8192u);
  EXPECT_EQ(stats.fragmentation_bytes, 0u);
  bridge->reset_peak_memory();
  stats = bridge->memory_stats();
  EXPECT_EQ(stats.peak_allocated_bytes, 4096u);
  EXPECT_EQ(stats.peak_reserved_bytes, 8192u + 4096u);
  bridge->free_device(b);  // a 4 KiB block cannot serve the largest request (8 KiB)
  EXPECT_EQ(bridge->memory_stats().fragmentation_bytes, 4096u);
}

// The scenario: the backend is out of memory, but a released
// allocation's last copy has completed (not yet drained): the retry drains
// it, frees the memory and succeeds.
TEST_F(PoolTest, OutOfMemoryDrainsCompletionsAndRetriesOnce) {
  for (const auto pool : {CachingPool::Off, CachingPool::On}) {
    make(pool, 8192);
    const auto x = bridge->alloc_device(kBytes4K, 8192);
    const auto range = bridge->reserve(4096);
    const auto copy = bridge->host_to_device(range, DeviceRange{x, 0, 4096}, CopyMode::Async);
    bridge->release(x);  // deferred: the copy is in flight
    ASSERT_TRUE(fake->complete(copy));  // done on the device; the bridge has not seen it
    const auto y = bridge->alloc_device(kBytes4K, 8192);
    const auto stats = bridge->memory_stats();
    EXPECT_EQ(stats.oom_retries, 1u);
    EXPECT_EQ(stats.oom_failures, 0u);
    EXPECT_EQ(fake->live_allocations(), 1u);
    bridge->free_device(y);
    bridge->release_host(range);
  }
}

TEST_F(PoolTest, OutOfMemoryReleasesTheCacheBeforeItGivesUp) {
  make(CachingPool::On, 16384);
  bridge->free_device(bridge->alloc_device(kBytes4K, 8192));  // cached
  const auto big = bridge->alloc_device(kBytes4K, 12288);     // needs the cached 8 KiB back
  EXPECT_EQ(bridge->memory_stats().oom_retries, 1u);
  EXPECT_EQ(bridge->memory_stats().cached_bytes, 0u);
  bridge->free_device(big);
}

TEST_F(PoolTest, ATrueOutOfMemoryNamesWhatTheBridgeHeld) {
  make(CachingPool::On, 8192);
  const auto x = bridge->alloc_device(kBytes4K, 8192);
  const auto message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationFailed, bridge->alloc_device(kBytes4K, 4096));
  EXPECT_NE(message.find("retried once"), std::string::npos) << message;
  EXPECT_NE(message.find("8192 bytes in live allocations"), std::string::npos) << message;
  EXPECT_NE(message.find("request of 4096 bytes"), std::string::npos) << message;
  const auto stats = bridge->memory_stats();
  EXPECT_EQ(stats.oom_retries, 1u);
  EXPECT_EQ(stats.oom_failures, 1u);
  EXPECT_FALSE(bridge->stats().broken);
  bridge->free_device(x);
}

TEST_F(PoolTest, ThePoolIsOffByDefaultForABackendThatDoesNotAskForIt) {
  make(CachingPool::BackendDefault);
  bridge->free_device(bridge->alloc_device(kBytes4K, 4096));
  EXPECT_FALSE(bridge->memory_stats().pool_enabled);
  EXPECT_EQ(fake->live_allocations(), 0u);
}


// ---- segments split into parts (a device that addresses parts: host, CUDA) ----

struct SplitPoolTest : PoolTest {
  SplitPoolTest() { parts = true; }
  // The device address a handle's view starts at.
  std::uint64_t address_of(DeviceHandle h) {
    const auto dtype = bridge->spec(h).dtype.value_or(DType::UInt8);
    return bridge->view(h, ViewSpec{dtype, Dims{1}, std::nullopt, 0})->data;
  }
};

TEST_F(SplitPoolTest, SmallTensorsArePackedIntoOneSegmentAndCoalesceWhenFreed) {
  make();
  const auto a = bridge->alloc_device(kBytes4K, 4096);
  const auto b = bridge->alloc_device(kBytes4K, 4096);
  const auto c = bridge->alloc_device(kBytes4K, 128);  // the smallest class, 512 bytes
  EXPECT_EQ(count(fake->calls(), Call::Allocate), 1u) << describe_calls(fake->calls());
  EXPECT_EQ(fake->calls().front().bytes, 2u << 20) << "small classes share a 2 MiB segment";
  EXPECT_EQ(fake->live_parts(), 3u);
  EXPECT_EQ(address_of(b), address_of(a) + 4096);
  EXPECT_EQ(address_of(c), address_of(b) + 4096);
  auto stats = bridge->memory_stats();
  EXPECT_EQ(stats.segments, 1u);
  EXPECT_EQ(stats.reserved_bytes, 2u << 20);
  EXPECT_EQ(stats.allocated_bytes, 4096u + 4096u + 512u);
  EXPECT_EQ(stats.cached_bytes, (2u << 20) - stats.allocated_bytes);
  bridge->free_device(b);  // a hole between a and c
  EXPECT_EQ(bridge->memory_stats().cached_blocks, 2u);
  bridge->free_device(a);  // merges with b's span
  bridge->free_device(c);  // merges both neighbours: the segment is whole again
  stats = bridge->memory_stats();
  EXPECT_EQ(stats.cached_blocks, 1u);
  EXPECT_EQ(stats.free_segments, 1u);
  EXPECT_EQ(fake->live_parts(), 0u);
  EXPECT_EQ(count(fake->calls(), Call::Free), 0u);
  bridge->empty_cache();
  EXPECT_EQ(fake->live_allocations(), 0u);
  EXPECT_EQ(bridge->memory_stats().reserved_bytes, 0u);
}

TEST_F(SplitPoolTest, AFreedLargeSegmentIsSplitForSmallerLargeTensors) {
  make();
  const ObjectSpec large{64 << 20, 64, DType::UInt8, ShapeKind::Vector};
  bridge->free_device(bridge->alloc_device(large, 32 << 20));
  const auto a = bridge->alloc_device(large, 8 << 20);
  const auto b = bridge->alloc_device(large, 16 << 20);
  EXPECT_EQ(count(fake->calls(), Call::Allocate), 1u) << "both from the freed 32 MiB";
  EXPECT_EQ(bridge->memory_stats().cache_hits, 2u);
  // Less than 1 MiB would be left: the span is handed out whole, not split.
  const auto c = bridge->alloc_device(large, (8 << 20) - (512 << 10));
  EXPECT_EQ(bridge->memory_stats().cached_bytes, 0u);
  for (const auto h : {a, b, c}) bridge->free_device(h);
  EXPECT_EQ(bridge->memory_stats().free_segments, 1u);
  // A small tensor never takes a large segment's span.
  bridge->free_device(bridge->alloc_device(kBytes4K, 4096));
  EXPECT_EQ(count(fake->calls(), Call::Allocate), 2u);
}

TEST_F(SplitPoolTest, APartIsNotReusedWhileAFenceOnItIsPending) {
  make();
  const auto x = bridge->alloc_device(kFloats, 4096);
  const auto y = bridge->alloc_device(kFloats, 4096);
  const auto y_address = address_of(y);
  fake->hold_launches(true);
  bridge->launch_axpy(DeviceRange{x, 0, 4096}, DeviceRange{y, 0, 4096}, 1.0f, 0.0f);
  bridge->release(y);
  const auto z = bridge->alloc_device(kFloats, 4096);
  EXPECT_NE(address_of(z), y_address) << "handed out a part the held kernel still writes";
  fake->hold_launches(false);
  (void)bridge->stats();  // reaps the fence: y's part goes back
  bridge->free_device(z);  // z (after y) merges with the free tail; y's span is the first free one
  const auto w = bridge->alloc_device(kFloats, 4096);
  EXPECT_EQ(address_of(w), y_address);
  for (const auto h : {x, w}) bridge->free_device(h);
  EXPECT_EQ(fake->live_parts(), 0u);
}

TEST_F(SplitPoolTest, APartAViewOutlivesRestartAndCloseKeepsOnlyItsSegment) {
  make();
  const auto kept = bridge->alloc_device(kBytes4K, 4096);
  bridge->free_device(bridge->alloc_device(kBytes4K, 1 << 20));  // the same segment, freed again
  auto view = bridge->view(kept, ViewSpec{DType::UInt8, Dims{4096}, std::nullopt, 0});
  bridge->restart(2);
  EXPECT_EQ(fake->live_allocations(), 1u) << "the segment under the live view stays";
  EXPECT_EQ(fake->live_parts(), 1u);
  bridge->free_device(bridge->alloc_device(kBytes4K, 4096));  // the new generation may use the rest of it
  bridge->close();
  EXPECT_EQ(fake->live_allocations(), 1u);
  view.reset();  // the last use: the part, then the whole segment, go back
  EXPECT_EQ(fake->live_parts(), 0u);
  EXPECT_EQ(fake->live_allocations(), 0u);
}

TEST_F(SplitPoolTest, OutOfMemoryReleasesWhollyFreeSegmentsOnly) {
  make(CachingPool::On, 6u << 20);
  const auto small = bridge->alloc_device(kBytes4K, 4096);  // a 2 MiB segment, in use
  const ObjectSpec large{64 << 20, 64, DType::UInt8, ShapeKind::Vector};
  bridge->free_device(bridge->alloc_device(large, 2 << 20));  // a free 2 MiB segment
  const auto big = bridge->alloc_device(large, 4 << 20);     // needs the free one back
  EXPECT_EQ(bridge->memory_stats().oom_retries, 1u);
  EXPECT_EQ(bridge->memory_stats().segments, 2u);
  const auto message =
      EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationFailed, bridge->alloc_device(large, 4 << 20));
  EXPECT_NE(message.find("retried once"), std::string::npos) << message;
  bridge->free_device(big);
  bridge->free_device(small);
}

TEST_F(SplitPoolTest, FragmentationCountsFreeSpansTooSmallForTheLargestRequest) {
  make();
  const ObjectSpec large{64 << 20, 64, DType::UInt8, ShapeKind::Vector};
  bridge->free_device(bridge->alloc_device(large, 16 << 20));
  DeviceHandle quarters[4];
  for (auto& q : quarters) q = bridge->alloc_device(large, 4 << 20);
  bridge->free_device(quarters[0]);
  bridge->free_device(quarters[2]);  // two 4 MiB holes, not adjacent
  auto stats = bridge->memory_stats();
  EXPECT_EQ(stats.largest_request_bytes, 16u << 20);
  EXPECT_EQ(stats.cached_bytes, 8u << 20);
  EXPECT_EQ(stats.fragmentation_bytes, 8u << 20) << "neither hole holds the largest request";
  bridge->free_device(quarters[1]);  // the holes coalesce into 12 MiB, still too small
  EXPECT_EQ(bridge->memory_stats().fragmentation_bytes, 12u << 20);
  bridge->free_device(quarters[3]);
  EXPECT_EQ(bridge->memory_stats().fragmentation_bytes, 0u);
}

// ---- the host backend: its freed memory is pool memory, every byte counted ----

// What memory_stats says the bridge holds is what the host backend holds: no
// cache of the backend's own beside the pool (it once kept 512 MiB of warm
// blocks that no stat showed, empty_cache() kept and close() left behind).
struct HostPoolTest : ::testing::Test {
  void make(BridgeOptions options = {.ring_bytes = 1 << 20}) {
    bridge = std::make_unique<Bridge>(host::make_host_backend(), options);
  }
  std::uint64_t held() { return *bridge->backend().test_controls()->live_bytes(); }
  void expect_every_byte_counted(const char* when) {
    const auto stats = bridge->memory_stats();
    EXPECT_EQ(stats.reserved_bytes, held()) << when;
    EXPECT_EQ(stats.reserved_bytes, stats.allocated_bytes + stats.cached_bytes) << when;
  }
  std::unique_ptr<Bridge> bridge;
};

TEST_F(HostPoolTest, ThePoolIsOnByDefaultWithTheBackendsCap) {
  make();
  const auto stats = bridge->memory_stats();
  EXPECT_TRUE(stats.pool_enabled);
  EXPECT_TRUE(stats.pool_splits);
  EXPECT_EQ(stats.pool_cap_bytes, 512u << 20);
  EXPECT_EQ(bridge->backend().describe().pool_cap_bytes, 512u << 20);
  make({.ring_bytes = 1 << 20, .pool_cap_bytes = 1234});
  EXPECT_EQ(bridge->memory_stats().pool_cap_bytes, 1234u) << "the caller's cap wins";
}

TEST_F(HostPoolTest, MemoryStatsAccountForEveryByteTheBackendHolds) {
  make();
  const ObjectSpec big{64 << 20, 64, DType::UInt8, ShapeKind::Vector};
  expect_every_byte_counted("a fresh bridge");
  const auto large = bridge->alloc_device(big, 24 << 20);
  const auto small = bridge->alloc_device(kBytes4K, 4096);
  const auto other = bridge->alloc_device(big, 5 << 20);
  expect_every_byte_counted("three live allocations");
  EXPECT_GE(held(), (29u << 20) + 4096);
  bridge->free_device(large);
  expect_every_byte_counted("one freed into the pool");
  EXPECT_EQ(bridge->memory_stats().free_segment_bytes, 24u << 20);
  // A freed large block is warm for the next one of its size: no new memory.
  const auto before = held();
  const auto again = bridge->alloc_device(big, 24 << 20);
  EXPECT_EQ(held(), before);
  EXPECT_EQ(bridge->memory_stats().cache_hits, 1u);
  bridge->free_device(again);
  bridge->free_device(other);
  expect_every_byte_counted("two freed");
  bridge->empty_cache();
  expect_every_byte_counted("after empty_cache");
  EXPECT_EQ(bridge->memory_stats().free_segment_bytes, 0u);
  EXPECT_EQ(held(), bridge->memory_stats().reserved_bytes);
  EXPECT_LT(held(), 4u << 20) << "only the small tensor's segment is left";
  bridge->free_device(small);
  bridge->empty_cache();
  EXPECT_EQ(held(), 0u);
  expect_every_byte_counted("empty");
}

TEST_F(HostPoolTest, TheCapBoundsTheWhollyFreeSegmentsKept) {
  make({.ring_bytes = 1 << 20, .pool_cap_bytes = 8u << 20});
  const ObjectSpec big{64 << 20, 64, DType::UInt8, ShapeKind::Vector};
  const auto a = bridge->alloc_device(big, 6 << 20);
  const auto b = bridge->alloc_device(big, 5 << 20);
  bridge->free_device(a);  // 6 MiB idle: within the cap
  bridge->free_device(b);  // 11 MiB would not be: this segment goes back
  EXPECT_EQ(bridge->memory_stats().free_segment_bytes, 6u << 20);
  EXPECT_EQ(held(), 6u << 20);
  expect_every_byte_counted("capped");
}

TEST_F(HostPoolTest, RestartShowsWhatAViewHoldsAndCloseKeepsNothingOnceItEnds) {
  make();
  const ObjectSpec big{64 << 20, 64, DType::UInt8, ShapeKind::Vector};
  const auto h = bridge->alloc_device(big, 16 << 20);
  auto lease = bridge->view(h, ViewSpec{DType::UInt8, Dims{16 << 20}, std::nullopt, 0});
  bridge->restart(2);
  auto stats = bridge->memory_stats();
  EXPECT_EQ(stats.reserved_bytes, 16u << 20) << "the orphan a view holds is the pool's, and shown";
  EXPECT_EQ(held(), 16u << 20);
  lease.reset();
  expect_every_byte_counted("the orphan went to the pool");
  EXPECT_EQ(bridge->memory_stats().cached_bytes, 16u << 20);
  bridge->empty_cache();
  EXPECT_EQ(held(), 0u);

  const auto h2 = bridge->alloc_device(big, 16 << 20);
  auto lease2 = bridge->view(h2, ViewSpec{DType::UInt8, Dims{16 << 20}, std::nullopt, 0});
  bridge->close();
  EXPECT_EQ(held(), 16u << 20);
  lease2.reset();  // the last orphan after close: straight back to the system
  EXPECT_EQ(held(), 0u);
}

// The same with segments: a cap full of small tensors' 2 MiB segments, then
// large tensors in rounds. The small segments give way (when a large segment
// is made, and past the cap when one is freed), so the large tensors are
// served from the cache from the second round on.
TEST_F(SplitPoolTest, PastTheCapSegmentsOfAKindNoLongerAskedForGoBackFirst) {
  make(CachingPool::On, 1ull << 30, 8 << 20);
  const ObjectSpec large{64 << 20, 64, DType::UInt8, ShapeKind::Vector};
  std::vector<DeviceHandle> small;
  for (int i = 0; i < 4 * 16; ++i) small.push_back(bridge->alloc_device(kBytes4K, 128 << 10));  // 4 segments
  for (const auto h : small) bridge->free_device(h);
  EXPECT_EQ(bridge->memory_stats().free_segment_bytes, 8u << 20) << "the cap is full of small segments";
  for (int round = 0; round < 3; ++round) {
    fake->clear_calls();
    std::vector<DeviceHandle> big;
    for (int i = 0; i < 3; ++i) big.push_back(bridge->alloc_device(large, 2 << 20));
    for (const auto h : big) bridge->free_device(h);
    const auto allocated = count(fake->calls(), Call::Allocate);
    if (round == 0) EXPECT_EQ(allocated, 3u);
    else EXPECT_EQ(allocated, 0u) << "round " << round << ": " << describe_calls(fake->calls());
    EXPECT_LE(bridge->memory_stats().free_segment_bytes, 8u << 20);
  }
}

// cap 1 MiB: a 3 MiB tensor and a 4 KiB one, the 3 MiB freed. The 4 KiB
// tensor's 2 MiB segment is free but for it: reused, never given back, and
// not what the cap bounds; the stats say which free bytes empty_cache() can
// return.
TEST_F(SplitPoolTest, FreeSpaceBesideALiveTensorIsCachedButNotIdle) {
  make(CachingPool::On, 1ull << 30, 1 << 20);
  const ObjectSpec large{64 << 20, 64, DType::UInt8, ShapeKind::Vector};
  const auto big = bridge->alloc_device(large, 3 << 20);
  const auto small = bridge->alloc_device(kBytes4K, 4096);
  bridge->free_device(big);
  auto stats = bridge->memory_stats();
  EXPECT_EQ(stats.free_segment_bytes, 0u) << "3 MiB is past the 1 MiB cap: given back";
  EXPECT_EQ(stats.cached_bytes, (2u << 20) - 4096);
  bridge->empty_cache();
  stats = bridge->memory_stats();
  EXPECT_EQ(stats.cached_bytes, (2u << 20) - 4096) << "inside the live tensor's segment";
  EXPECT_EQ(stats.free_segment_bytes, 0u);
  EXPECT_EQ(stats.reserved_bytes, 2u << 20);
  bridge->free_device(small);
  stats = bridge->memory_stats();
  EXPECT_EQ(stats.free_segment_bytes, 0u) << "2 MiB wholly free is past the cap too";
  EXPECT_EQ(stats.reserved_bytes, 0u);
  EXPECT_EQ(fake->live_allocations(), 0u);
}

}  // namespace
}  // namespace devbridge::testing
