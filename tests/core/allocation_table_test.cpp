// The allocation table on its own: lookup and validation of handles,
// starting and retiring slots with their accounting, orphans, and the
// allocations' share of BridgeStats and MemoryStats.
#include "core/allocation_table.hpp"

#include <gtest/gtest.h>

#include "core/device_pool.hpp"
#include "support.hpp"

namespace devbridge::detail {
namespace {

constexpr Generation kGeneration = 1;

const ObjectSpec kSpec{1 << 20, 64, DType::Float32, ShapeKind::Tensor};

DeviceHandle handle(std::uint64_t id) { return DeviceHandle{3, kGeneration, id}; }

struct AllocationTableTest : ::testing::Test {
  AllocationTable table;

  // An allocation of `bytes` of backend memory at `address`; its id.
  std::uint64_t add(std::uint64_t bytes, std::uint64_t address = 0x1000) {
    return table.start(table.acquire(), kSpec, 4, DType::Float32, bytes, DeviceAllocation{address, bytes, 0});
  }
  BridgeStats stats() const {
    BridgeStats s;
    table.fill(s);
    return s;
  }
  MemoryStats memory(const DevicePool* pool = nullptr) const {
    MemoryStats m;
    table.fill(m, pool);
    return m;
  }
};

TEST_F(AllocationTableTest, StartedAllocationIsFoundByItsHandleAndCounted) {
  const auto id = add(256);
  auto& slot = table.live(handle(id));
  EXPECT_EQ(slot.extent, 256u);
  EXPECT_EQ(slot.element_size, 4u);
  EXPECT_EQ(slot.view_dtype, DType::Float32);
  EXPECT_FALSE(slot.read_only());
  EXPECT_FALSE(slot.used());
  EXPECT_EQ(table.allocated_bytes(), 256u);
  EXPECT_EQ(table.live_count(), 1u);
  const auto m = memory();
  EXPECT_EQ(m.allocations, 1u);
  EXPECT_EQ(m.total_allocations, 1u);
  EXPECT_EQ(m.peak_allocated_bytes, 256u);
  EXPECT_EQ(m.backend_allocations, 1u) << "without the pool every allocation is the backend's";
}

TEST_F(AllocationTableTest, RetiredOrReleasedAllocationIsUnknownAndItsIdNeverComesBack) {
  const auto id = add(128);
  table.retire(id_slot(id));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, table.live(handle(id)));
  EXPECT_EQ(table.find(id), nullptr);
  EXPECT_EQ(table.allocated_bytes(), 0u);
  const auto again = add(128);
  EXPECT_EQ(id_slot(again), id_slot(id)) << "the slot is reused";
  EXPECT_NE(again, id) << "with a new version";
  table.live(handle(again)).released = true;
  const auto message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, table.live(handle(again)));
  EXPECT_NE(message.find("released"), std::string::npos) << message;
  EXPECT_NE(table.find(again), nullptr) << "a released allocation stays in the table until its last use ends";
}

TEST_F(AllocationTableTest, UnissuedSlotLeavesItsIdUnknown) {
  const auto index = table.acquire();
  table.unissue(index);
  const auto id = add(64);
  EXPECT_EQ(id_slot(id), index);
  EXPECT_EQ(id_version(id), 1u) << "the unissued version was given back";
}

TEST_F(AllocationTableTest, PeaksAndTotalsFollowStartsAndRetiresUntilReset) {
  const auto a = add(100);
  const auto b = add(300);
  table.retire(id_slot(a));
  auto m = memory();
  EXPECT_EQ(m.allocated_bytes, 300u);
  EXPECT_EQ(m.peak_allocated_bytes, 400u);
  EXPECT_EQ(m.total_allocated_bytes, 400u);
  EXPECT_EQ(m.reserved_bytes, 300u) << "without the pool, what is reserved is what is allocated";
  EXPECT_EQ(m.peak_reserved_bytes, 400u);
  table.reset_peaks(nullptr);
  m = memory();
  EXPECT_EQ(m.peak_allocated_bytes, 300u);
  table.retire(id_slot(b));
  EXPECT_EQ(memory().allocated_bytes, 0u);
  EXPECT_EQ(memory().total_allocations, 2u);
}

TEST_F(AllocationTableTest, AdoptedMemoryIsReadOnlyAndNeverCountedAsAllocated) {
  const auto index = table.acquire();
  const auto id = table.start_adopted(index, kSpec, 4, DType::Float32, 512, DeviceAllocation{0x2000, 512, 0}, 5);
  auto& slot = table.live(handle(id));
  EXPECT_TRUE(slot.read_only());
  EXPECT_EQ(slot.adopted_region, 6u) << "1 + the region's slot";
  EXPECT_EQ(table.allocated_bytes(), 0u);
  const auto s = stats();
  EXPECT_EQ(s.adopted_allocations, 1u);
  EXPECT_EQ(s.adopted_bytes, 512u);
  EXPECT_EQ(s.allocated_bytes, 0u);
  table.retire(index);
  EXPECT_EQ(table.allocated_bytes(), 0u) << "retiring adopted memory takes nothing off the allocated bytes";
}

TEST_F(AllocationTableTest, OrphanKeepsItsMemoryViewsAndFencesAfterItsSlotIsRetired) {
  const auto id = add(256, 0x4000);
  table.live(handle(id)).views = 2;
  table.orphan(id_slot(id), kGeneration, 1);
  EXPECT_EQ(table.find(id), nullptr);
  EXPECT_EQ(table.allocated_bytes(), 0u) << "an orphan's memory left the generation's accounting";
  auto* orphan = table.find_orphan({kGeneration, id});
  ASSERT_NE(orphan, nullptr);
  EXPECT_EQ(orphan->device.address, 0x4000u);
  EXPECT_EQ(orphan->views, 2u);
  EXPECT_EQ(orphan->fences, 1u);
  EXPECT_EQ(orphan->alignment, kSpec.alignment);
  EXPECT_TRUE(orphan->used());
  auto s = stats();
  EXPECT_EQ(s.orphaned_allocations, 1u);
  EXPECT_EQ(s.live_views, 2u);
  EXPECT_EQ(s.live_allocations, 0u);
  EXPECT_EQ(memory().reserved_bytes, 256u) << "without the pool the backend still holds an orphan's memory";
  orphan->views = 0;
  orphan->fences = 0;
  EXPECT_FALSE(orphan->used());
  table.erase_orphan({kGeneration, id});
  EXPECT_EQ(memory().reserved_bytes, 0u);
  EXPECT_EQ(table.find_orphan({kGeneration, id}), nullptr);
  EXPECT_EQ(table.orphan_count(), 0u);
  EXPECT_EQ(table.find_orphan({kGeneration + 1, id}), nullptr) << "orphans are keyed by the generation they left";
}

TEST_F(AllocationTableTest, LiveViewsCountAcrossSlotsAndOrphans) {
  const auto a = add(64);
  const auto b = add(64, 0x8000);
  table.live(handle(a)).views = 1;
  table.live(handle(b)).views = 3;
  table.orphan(id_slot(b), kGeneration, 0);
  const auto s = stats();
  EXPECT_EQ(s.live_views, 4u);
  EXPECT_EQ(s.live_allocations, 1u);
}

TEST_F(AllocationTableTest, PoolCountersReadThroughThePool) {
  DevicePool pool(1 << 30, 0);
  table.note_pool_request(1000);
  table.count_cache_lookup(false);
  table.count_segment(4096);
  table.note_pool_request(10);
  table.count_cache_lookup(true);
  table.count_backend_frees(2);
  table.count_oom_retry();
  table.count_oom_failure();
  const auto m = memory(&pool);
  EXPECT_TRUE(m.pool_enabled);
  EXPECT_EQ(m.pool_cap_bytes, 1u << 30);
  EXPECT_EQ(m.cache_hits, 1u);
  EXPECT_EQ(m.cache_misses, 1u);
  EXPECT_EQ(m.backend_allocations, 1u);
  EXPECT_EQ(m.total_reserved_bytes, 4096u);
  EXPECT_EQ(m.backend_frees, 2u);
  EXPECT_EQ(m.oom_retries, 1u);
  EXPECT_EQ(m.oom_failures, 1u);
  EXPECT_EQ(m.largest_request_bytes, 1000u) << "the largest, not the last";
  EXPECT_EQ(m.reserved_bytes, pool.reserved_bytes()) << "with the pool, what is reserved is the pool's";
}

TEST(AllocationRange, ValidatedAgainstExtentAndElementSize) {
  AllocationSlot slot;
  slot.start(kSpec, 4, DType::Float32, 64, DeviceAllocation{0x1000, 64, 0});
  const auto h = handle(1);
  validate_device_range(DeviceRange{h, 0, 64}, slot);
  validate_device_range(DeviceRange{h, 60, 4}, slot);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, validate_device_range(DeviceRange{h, 0, 0}, slot));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, validate_device_range(DeviceRange{h, 60, 8}, slot));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, validate_device_range(DeviceRange{h, 65, 1}, slot));
  const auto message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, validate_device_range(DeviceRange{h, 2, 4}, slot));
  EXPECT_NE(message.find("aligned"), std::string::npos) << message;
}

}  // namespace
}  // namespace devbridge::detail
