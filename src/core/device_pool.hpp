// The bridge's caching pool: device memory the bridge freed, kept for the
// next allocation instead of going back to the driver, since a driver
// allocation costs microseconds to milliseconds and may synchronize the
// device (cuMemAlloc, clCreateBuffer). PyTorch's caching allocator, RMM's
// pool and tinygrad's LRUAllocator do the same.
//
// Requests are rounded up to a size class: the next of 2^k, 1.25*2^k,
// 1.5*2^k, 1.75*2^k bytes (at least 512), so at most a fifth of a block is
// slack and same-sized tensors of a training loop reuse the same spans.
//
// Where the backend can address part of an allocation as an allocation of
// its own (Backend::part_alignment: host and CUDA memory is linear), the
// backend's allocations are segments the pool splits:
//  - small classes (up to 1 MiB) are packed into shared 2 MiB segments;
//  - a large class gets a segment of its own class, which a later, smaller
//    large request may split (when at least 1 MiB would be left over);
//  - a freed span coalesces with free neighbours, and a segment whose spans
//    are all free again is whole again (empty_cache gives it back).
// Small and large segments are kept apart, so small tensors never pin a large
// segment. Elsewhere (OpenCL: a buffer is a handle, and a sub-buffer per part
// costs what a buffer does) each allocation is a whole segment, reused only
// by a request of exactly its class. docs/DECISIONS.md.
//
// Lifetimes: a span reaches the pool only when the bridge frees it, which is
// after every copy, step, view and fence that used it has ended (the drop
// queue), so a free span is never touched by the device.
//
// Not thread-safe: the bridge calls it under its lock.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>
#include <vector>

#include "devbridge/backend.hpp"

namespace devbridge::detail {

class DevicePool {
 public:
  static constexpr std::uint64_t kSmallLimit = 1ull << 20;    // classes up to this are packed
  static constexpr std::uint64_t kSmallSegment = 2ull << 20;  // into segments of this size
  static constexpr std::uint64_t kSmallest = 512;

  // The bytes a request of `bytes` is rounded up to (`bytes` itself when the
  // round-up would not fit in 64 bits).
  static std::uint64_t size_class(std::uint64_t bytes) noexcept;

  // `part_alignment`: BackendCapabilities::part_alignment, 0 when the backend cannot
  // address parts (whole segments only).
  DevicePool(std::uint64_t cap_bytes, std::uint64_t part_alignment) noexcept;

  bool splits() const noexcept { return granularity_ != 0; }
  // What to ask the backend for when take() found no room for `class_bytes`.
  std::uint64_t segment_bytes(std::uint64_t class_bytes) const noexcept {
    return splits() && class_bytes <= kSmallLimit ? kSmallSegment : class_bytes;
  }
  // The alignment to ask the backend for, for a request aligned to `alignment`.
  std::uint64_t segment_alignment(std::uint64_t alignment) const noexcept {
    return std::max(alignment, granularity_);  // granularity_ is 0 without parts
  }

  // A part of a free span holding `class_bytes` at `alignment` (split off
  // where enough is left over), made by `backend`; nothing when no free
  // span fits. Throws only what make_part throws (the span stays free).
  std::optional<DeviceAllocation> take(Backend& backend, std::uint64_t class_bytes, std::uint64_t alignment);
  // Adds a segment the backend just made for a request that take() could
  // not serve, and takes the request's part of it. If making the part
  // throws, the segment stays in the pool, free.
  DeviceAllocation take_from_new(Backend& backend, const DeviceAllocation& segment, std::uint64_t alignment,
                                 std::uint64_t class_bytes);
  // A part no allocation uses any more. Returns what the backend must free:
  // the part's segment, when it is whole again and keeping it would pass
  // the cap (or the part itself, were it not the pool's). The cap bounds
  // the bytes of wholly free segments: free spans of a segment that still
  // holds a live part cannot go back (the backend frees whole allocations).
  // `alignment`: what the allocation's spec asked for (a whole block is
  // reused for requests asking no more).
  std::optional<DeviceAllocation> give_back(Backend& backend, const DeviceAllocation& part, std::uint64_t alignment);
  // Segments whose spans are all free, for the backend to free, until at
  // most `down_to` bytes of them are left: every one (0: empty_cache, out of
  // memory, restart, close), or those past the room a new segment needs
  // under the cap (make_room_for).
  std::vector<DeviceAllocation> release_free_segments(std::uint64_t down_to = 0) noexcept;
  // The free-segment bytes to keep so that a new segment of `bytes` still
  // fits under the cap once it is free again. A new segment is made only
  // when no free span could serve the request, so the wholly free segments
  // past that are memory this workload no longer asks for (another model's
  // sizes): they go back first, instead of the new segment when it is freed,
  // which would make every later request of its size allocate afresh.
  std::uint64_t keep_for(std::uint64_t bytes) const noexcept { return cap_bytes_ > bytes ? cap_bytes_ - bytes : 0; }

  // Bytes the backend holds for the pool (every segment), and of those the
  // free ones (cached), in how many free spans.
  std::uint64_t reserved_bytes() const noexcept { return reserved_bytes_; }
  std::uint64_t cached_bytes() const noexcept { return free_bytes_; }
  // Of those, the bytes of wholly free segments (what the cap bounds and
  // release_free_segments gives back).
  std::uint64_t free_segment_bytes() const noexcept { return splits() ? free_segment_bytes_ : free_bytes_; }
  std::uint64_t cached_blocks() const noexcept {
    return splits() ? free_small_.size() + free_large_.size() : free_segments_;
  }
  std::uint64_t segments() const noexcept { return splits() ? segments_.size() : whole_segments_; }
  std::uint64_t free_segments() const noexcept { return free_segments_; }
  std::uint64_t largest_block() const noexcept;
  // Free bytes in spans too small for a request of `bytes`.
  std::uint64_t bytes_below(std::uint64_t bytes) const noexcept;
  std::uint64_t cap_bytes() const noexcept { return cap_bytes_; }
  // How many times a span was split for a part, and two free spans merged,
  // since the pool was made: the flight recorder reports the changes.
  std::uint64_t splits_made() const noexcept { return splits_made_; }
  std::uint64_t coalesces() const noexcept { return coalesces_; }

  // Every block the pool knows, for the memory snapshot: f(segment, offset,
  // bytes, free) for each span of a split segment, and for each whole free
  // block (a live whole block is an allocation's; the pool keeps no record).
  template <class F>
  void for_each_block(F&& f) const {
    for (const auto& [bytes, list] : whole_free_)
      for (const auto& block : list) f(block.block, 0, block.block.bytes, true);
    for (const auto& [id, segment] : segments_)
      for (const auto& [offset, span] : segment.spans) f(segment.block, offset, span.bytes, span.free);
  }

 private:
  struct Span {
    std::uint64_t bytes = 0;
    bool free = false;
  };
  struct Segment {
    DeviceAllocation block;
    std::uint64_t alignment = 0;
    bool small = false;
    std::uint64_t used_bytes = 0;
    std::map<std::uint64_t, Span> spans;  // by offset; they tile the block
  };
  // Free spans in best-fit order.
  struct FreeKey {
    std::uint64_t bytes, segment, offset;
    friend auto operator<=>(const FreeKey&, const FreeKey&) = default;
  };
  struct Where {
    std::uint64_t segment, offset;
  };

  std::set<FreeKey>& free_set(const Segment& s) noexcept { return s.small ? free_small_ : free_large_; }
  // Free spans and live parts come and go on every allocation: their tree
  // and hash nodes are recycled (extracted, kept, reinserted) so that a
  // steady state allocates nothing (a node allocation each way cost more
  // than the rest of the pool's work).
  void add_free(const Segment& s, FreeKey key);
  void remove_free(const Segment& s, FreeKey key) noexcept;
  void add_part(std::uint64_t address, Where where);
  std::optional<Where> remove_part(std::uint64_t address) noexcept;
  void add_span(Segment& s, std::uint64_t offset, Span span);
  void remove_span(Segment& s, std::map<std::uint64_t, Span>::iterator span) noexcept;
  DeviceAllocation carve(Backend& backend, std::uint64_t id, Segment& s, std::uint64_t offset, std::uint64_t bytes);
  void mark_free(std::uint64_t id, Segment& s, std::map<std::uint64_t, Span>::iterator span);
  void mark_used(std::uint64_t id, Segment& s, std::map<std::uint64_t, Span>::iterator span);

  // Whole blocks (a backend without parts): a LIFO per exact size, nothing
  // to split or coalesce, so the steady state is a vector push and pop.
  struct WholeBlock {
    DeviceAllocation block;
    std::uint64_t alignment;
  };
  std::optional<DeviceAllocation> take_whole(std::uint64_t class_bytes, std::uint64_t alignment) noexcept;
  std::map<std::uint64_t, std::vector<WholeBlock>> whole_free_;  // by bytes, newest last
  std::uint64_t whole_segments_ = 0;

  std::uint64_t cap_bytes_;
  std::uint64_t granularity_;  // offsets of parts are multiples of it; 0: whole segments
  std::uint64_t next_segment_ = 1;
  std::unordered_map<std::uint64_t, Segment> segments_;
  std::set<FreeKey> free_small_, free_large_;
  std::unordered_map<std::uint64_t, Where> parts_;  // live parts by address
  std::vector<std::set<FreeKey>::node_type> spare_free_nodes_;
  std::vector<std::unordered_map<std::uint64_t, Where>::node_type> spare_part_nodes_;
  std::vector<std::map<std::uint64_t, Span>::node_type> spare_span_nodes_;
  std::uint64_t reserved_bytes_ = 0;
  std::uint64_t free_bytes_ = 0;
  std::uint64_t free_segments_ = 0;
  std::uint64_t free_segment_bytes_ = 0;  // split segments only (whole blocks: free_bytes_)
  std::uint64_t splits_made_ = 0;
  std::uint64_t coalesces_ = 0;
};

}  // namespace devbridge::detail
