// The allocation table: which allocations exist and what they cost. Each
// live allocation has a versioned slot (its spec, its memory, and the uses
// that keep it: copies, compute steps and fences, views); an allocation a
// restart or close took from its generation while views or fences still
// used it lives on as an orphan until they end. Beside them, the memory
// statistics (MemoryStats), kept here as an allocator's statistics adaptor
// keeps its counters: every slot that starts or retires is counted by the
// one call that does it.
//
// Not thread-safe: the bridge calls it under its lock. It never calls the
// backend or the pool: retiring a slot leaves its memory to the caller.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <utility>

#include "core/describe.hpp"
#include "core/fail.hpp"
#include "core/slot_table.hpp"
#include "devbridge/backend.hpp"
#include "devbridge/bridge.hpp"

namespace devbridge::detail {

class DevicePool;

struct AllocationSlot {
  std::uint32_t version = 0;
  bool in_use = false;
  bool released = false;  // deferred free: unusable, freed when the last use ends
  // In what was padding: spec_element_size(spec),
  // read by every copy, and the dtype a view must have (any when untyped:
  // one compare on the view path for the usual, typed case).
  std::uint8_t element_size = 1;
  DType view_dtype = DType::UInt8;
  ObjectSpec spec;
  std::uint64_t extent = 0;
  DeviceAllocation device;
  std::uint32_t copies = 0;   // in-flight copies of either direction, sync ones too
  std::uint32_t uploads = 0;  // of those, copies into the allocation
  // Active compute steps, launches in progress, and uses that end at a fence
  // not yet passed (the drop queue; counted here, not in a field of their
  // own, to keep the slot small; messages count them in the queue).
  std::uint32_t steps = 0;
  std::uint32_t views = 0;    // live view leases
  // Adopted host memory (Bridge::adopt_host): 1 + the slot of the region it
  // lies in, 0 for the backend's own memory. Adopted memory is read-only
  // and goes back to the region, never to the backend's free or the pool.
  std::uint32_t adopted_region = 0;
  bool read_only() const noexcept { return adopted_region != 0; }
  bool used() const noexcept { return copies || steps || views; }
  // Every field but the version, for a new use of the slot.
  // (The caller derives element size and view dtype from the spec while it
  // validates, before any store here could alias the spec.)
  [[gnu::always_inline]] void start(const ObjectSpec& new_spec, std::uint8_t new_element_size, DType new_view_dtype,
                                    std::uint64_t new_extent, const DeviceAllocation& memory) {
    in_use = true;
    released = false;
    spec = new_spec;
    element_size = new_element_size;
    view_dtype = new_view_dtype;
    extent = new_extent;
    device = memory;
    copies = uploads = steps = views = 0;
    adopted_region = 0;
  }
};

// An allocation a restart or close took from its generation while views
// still leased it or fences still held it; freed when the last one ends.
struct Orphan {
  DeviceAllocation device;
  std::uint32_t views = 0;
  std::uint32_t fences = 0;
  bool abandoned = false;  // its fence never passed by close: never freed
  std::uint64_t alignment = 0;  // its spec's, for the pool
  std::uint32_t adopted_region = 0;  // as AllocationSlot's
  bool used() const noexcept { return views != 0 || fences != 0; }
};

// Inlined: every copy runs it, from several instantiations of the bridge's copy().
[[gnu::always_inline]] inline void validate_device_range(const DeviceRange& range, const AllocationSlot& slot) {
  const auto elem = slot.element_size;
  if (range.len == 0 || range.offset > slot.extent || range.len > slot.extent - range.offset)
    fail(ErrorKind::InvalidRange, "device range [offset {}, len {}] of {} is outside its extent of {} bytes (or empty)",
         range.offset, range.len, describe(range.handle), slot.extent);
  if ((range.offset | range.len) & (elem - 1))
    fail(ErrorKind::InvalidRange, "device range [offset {}, len {}] of {} is not aligned to its {} elements ({} bytes)",
         range.offset, range.len, describe(range.handle), spec_dtype_name(slot.spec), elem);
}

// Bytes a copy moves; for a pitched one, after checking that its rows fit
// both ranges and the allocation's element alignment.
template <bool kPitched, class Host>
std::uint64_t checked_copy_bytes(const Host& host, const DeviceRange& device, const AllocationSlot& slot,
                                 const CopyLayout& layout) {
  if constexpr (!kPitched) {
    if (host.len != device.len)
      fail(ErrorKind::InvalidRange, "{} and device range of {} bytes differ in length", describe(host), device.len);
    return host.len;
  } else {
    if (!layout.pitched() || layout.row_bytes == 0)
      fail(ErrorKind::InvalidRange, "a pitched copy of {} rows of {} bytes moves nothing", layout.rows,
           layout.row_bytes);
    const auto host_span = layout_host_span(layout);
    const auto device_span = layout_device_span(layout);
    if (host_span > host.len)
      fail(ErrorKind::InvalidRange, "{} rows of {} bytes at a host pitch of {} reach {} bytes, past {}", layout.rows,
           layout.row_bytes, layout.host_pitch, host_span, describe(host));
    if (device_span > device.len)
      fail(ErrorKind::InvalidRange,
           "{} rows of {} bytes at a device pitch of {} reach {} bytes, past the device range [offset {}, len {}] "
           "of {}",
           layout.rows, layout.row_bytes, layout.device_pitch, device_span, device.offset, device.len,
           describe(device.handle));
    if ((layout.row_bytes | layout.device_pitch) & (slot.element_size - 1))
      fail(ErrorKind::InvalidRange, "rows of {} bytes at a device pitch of {} split the {} elements ({} bytes) of {}",
           layout.row_bytes, layout.device_pitch, spec_dtype_name(slot.spec), slot.element_size,
           describe(device.handle));
    return layout_bytes_moved(layout);
  }
}

class AllocationTable {
 public:
  using OrphanKey = std::pair<Generation, std::uint64_t>;  // the generation it left, and its id there

  // ---- lookup ----
  // The allocation `h` names, unless it is unknown or released (then
  // UnknownDeviceHandle). The handle's domain and generation are the
  // caller's to check.
  [[gnu::always_inline]] AllocationSlot& live(const DeviceHandle& h) {
    auto* slot = slots_.find(h.id);
    if (__builtin_expect(!slot || slot->released, 0)) fail_unknown(h);
    return *slot;
  }
  [[noreturn, gnu::cold, gnu::noinline]] static void fail_unknown(const DeviceHandle& h);
  // The slot `id` names, released ones too; nullptr when it is not in use.
  AllocationSlot* find(std::uint64_t id) noexcept { return slots_.find(id); }
  const AllocationSlot* find(std::uint64_t id) const noexcept { return slots_.find(id); }
  AllocationSlot& operator[](std::uint32_t index) noexcept { return slots_[index]; }
  const AllocationSlot& operator[](std::uint32_t index) const noexcept { return slots_[index]; }
  std::size_t live_count() const noexcept { return slots_.live(); }
  template <class F>
  void for_each_in_use(F&& f) {
    slots_.for_each_in_use(std::forward<F>(f));
  }

  // ---- starting and retiring ----
  // A free slot for an allocation about to be made (its version bumped);
  // then start() or start_adopted(), or unissue() if making it failed.
  [[gnu::always_inline]] std::uint32_t acquire() { return slots_.acquire(); }
  void unissue(std::uint32_t index) { slots_.unissue(index); }

  // The backend's (or the pool's) memory in a slot just acquired, counted
  // as allocated. Returns the allocation's id.
  [[gnu::always_inline]] std::uint64_t start(std::uint32_t index, const ObjectSpec& spec, std::uint32_t elem,
                                             DType view_dtype, std::uint64_t extent, const DeviceAllocation& device) {
    auto& slot = slots_[index];
    slot.start(spec, static_cast<std::uint8_t>(elem), view_dtype, extent, device);
    allocated_bytes_ += device.bytes;
    total_allocated_bytes_ += device.bytes;
    ++total_allocations_;
    peak_allocated_bytes_ = std::max(peak_allocated_bytes_, allocated_bytes_);
    return make_id(index, slot.version);
  }
  // Host memory adopted from region slot `region` in a slot just acquired:
  // the caller's memory, so not counted as allocated. Returns its id.
  std::uint64_t start_adopted(std::uint32_t index, const ObjectSpec& spec, std::uint32_t elem, DType view_dtype,
                              std::uint64_t extent, const DeviceAllocation& device, std::uint32_t region);

  // The slot goes back to the free list; its memory is the caller's to free,
  // cache or hand back to its region.
  [[gnu::always_inline]] void retire(std::uint32_t index) {
    auto& slot = slots_[index];
    if (!slot.adopted_region) allocated_bytes_ -= slot.device.bytes;
    slots_.retire(index);
  }

  // ---- orphans ----
  // Takes the slot out of `generation` as an orphan held by its views and
  // `fences` uses ending at a fence (the slot is retired).
  void orphan(std::uint32_t index, Generation generation, std::uint32_t fences);
  Orphan* find_orphan(const OrphanKey& key) noexcept;
  void erase_orphan(const OrphanKey& key) noexcept { orphans_.erase(key); }
  std::size_t orphan_count() const noexcept { return orphans_.size(); }
  template <class F>
  void for_each_orphan(F&& f) const {
    for (const auto& [key, orphan] : orphans_) f(key, orphan);
  }

  // ---- what the memory costs ----
  std::uint64_t allocated_bytes() const noexcept { return allocated_bytes_; }
  // The pool's segments, or without it the live allocations.
  std::uint64_t reserved_bytes(const DevicePool* pool) const noexcept;
  // What orphans of earlier generations keep allocated (adopted ones are the caller's memory).
  std::uint64_t orphaned_bytes() const noexcept;
  void count_backend_frees(std::uint64_t frees) noexcept { backend_frees_ += frees; }
  // A request through the pool, before its cache is looked at; then whether
  // the cache served it.
  void note_pool_request(std::uint64_t extent) noexcept { largest_request_ = std::max(largest_request_, extent); }
  void count_cache_lookup(bool hit) noexcept { ++(hit ? cache_hits_ : cache_misses_); }
  // A segment the pool got from the backend after a miss; then, once the
  // pool holds it, note_reserved() for the peak.
  void count_segment(std::uint64_t bytes) noexcept {
    ++backend_allocations_;
    total_reserved_bytes_ += bytes;
  }
  void note_reserved(const DevicePool& pool) noexcept;
  void count_oom_retry() noexcept { ++oom_retries_; }
  void count_oom_failure() noexcept { ++oom_failures_; }
  void reset_peaks(const DevicePool* pool) noexcept;

  // The allocations' part of BridgeStats: live and orphaned allocations,
  // their views, adopted memory.
  void fill(BridgeStats& s) const;
  void fill(MemoryStats& m, const DevicePool* pool) const;

 private:
  SlotTable<AllocationSlot> slots_;
  std::map<OrphanKey, Orphan> orphans_;
  std::uint64_t allocated_bytes_ = 0, peak_allocated_bytes_ = 0, total_allocated_bytes_ = 0;
  std::uint64_t peak_reserved_bytes_ = 0, total_reserved_bytes_ = 0;
  std::uint64_t total_allocations_ = 0, backend_allocations_ = 0, backend_frees_ = 0;
  std::uint64_t cache_hits_ = 0, cache_misses_ = 0, oom_retries_ = 0, oom_failures_ = 0;
  std::uint64_t largest_request_ = 0;
};

}  // namespace devbridge::detail
