#include "core/allocation_table.hpp"

#include "core/device_pool.hpp"

namespace devbridge::detail {

void AllocationTable::fail_unknown(const DeviceHandle& h) {
  fail(ErrorKind::UnknownDeviceHandle, "{} is unknown, already freed or released", describe(h));
}

std::uint64_t AllocationTable::start_adopted(std::uint32_t index, const ObjectSpec& spec, std::uint32_t elem,
                                             DType view_dtype, std::uint64_t extent, const DeviceAllocation& device,
                                             std::uint32_t region) {
  auto& slot = slots_[index];
  slot.start(spec, static_cast<std::uint8_t>(elem), view_dtype, extent, device);
  slot.adopted_region = region + 1;
  return make_id(index, slot.version);
}

void AllocationTable::orphan(std::uint32_t index, Generation generation, std::uint32_t fences) {
  const auto& slot = slots_[index];
  orphans_.emplace(OrphanKey{generation, make_id(index, slot.version)},
                   Orphan{slot.device, slot.views, fences, false, slot.spec.alignment, slot.adopted_region});
  retire(index);
}

Orphan* AllocationTable::find_orphan(const OrphanKey& key) noexcept {
  const auto it = orphans_.find(key);
  return it == orphans_.end() ? nullptr : &it->second;
}

std::uint64_t AllocationTable::reserved_bytes(const DevicePool* pool) const noexcept {
  if (pool) return pool->reserved_bytes();  // its segments hold orphans' blocks too
  // Without the pool the backend holds each live allocation, and each
  // orphan of an earlier generation a view or fence still holds.
  return allocated_bytes_ + orphaned_bytes();
}

std::uint64_t AllocationTable::orphaned_bytes() const noexcept {
  std::uint64_t bytes = 0;
  for (const auto& [key, orphan] : orphans_)
    if (!orphan.adopted_region) bytes += orphan.device.bytes;
  return bytes;
}

void AllocationTable::note_reserved(const DevicePool& pool) noexcept {
  peak_reserved_bytes_ = std::max(peak_reserved_bytes_, pool.reserved_bytes());
}

void AllocationTable::reset_peaks(const DevicePool* pool) noexcept {
  peak_allocated_bytes_ = allocated_bytes_;
  peak_reserved_bytes_ = reserved_bytes(pool);
}

void AllocationTable::fill(BridgeStats& s) const {
  s.live_allocations = slots_.live();
  s.allocated_bytes = allocated_bytes_;
  slots_.for_each_in_use([&](std::uint32_t, const AllocationSlot& a) {
    s.live_views += a.views;
    if (a.adopted_region) {
      ++s.adopted_allocations;
      s.adopted_bytes += a.device.bytes;
    }
  });
  s.orphaned_allocations = orphans_.size();
  for (const auto& [key, orphan] : orphans_) s.live_views += orphan.views;
}

void AllocationTable::fill(MemoryStats& m, const DevicePool* pool) const {
  m.pool_enabled = pool != nullptr;
  m.pool_cap_bytes = pool ? pool->cap_bytes() : 0;
  m.allocated_bytes = allocated_bytes_;
  m.peak_allocated_bytes = peak_allocated_bytes_;
  m.total_allocated_bytes = total_allocated_bytes_;
  m.reserved_bytes = reserved_bytes(pool);
  m.peak_reserved_bytes = pool ? std::max(peak_reserved_bytes_, m.reserved_bytes) : peak_allocated_bytes_;
  m.total_reserved_bytes = pool ? total_reserved_bytes_ : total_allocated_bytes_;
  m.allocations = slots_.live();
  m.total_allocations = total_allocations_;
  // Without the pool every allocation is the backend's.
  m.backend_allocations = pool ? backend_allocations_ : total_allocations_;
  m.backend_frees = backend_frees_;
  m.cached_bytes = pool ? pool->cached_bytes() : 0;
  m.cached_blocks = pool ? pool->cached_blocks() : 0;
  m.free_segment_bytes = pool ? pool->free_segment_bytes() : 0;
  m.segments = pool ? pool->segments() : 0;
  m.free_segments = pool ? pool->free_segments() : 0;
  m.pool_splits = pool && pool->splits();
  m.cache_hits = cache_hits_;
  m.cache_misses = cache_misses_;
  m.oom_retries = oom_retries_;
  m.oom_failures = oom_failures_;
  m.largest_request_bytes = largest_request_;
  m.fragmentation_bytes = pool ? pool->bytes_below(DevicePool::size_class(largest_request_)) : 0;
}

}  // namespace devbridge::detail
