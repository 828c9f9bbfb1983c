// The bridge's caching pool: device memory the bridge freed, kept for the next
// allocation of the same size class instead of going back to the driver, since
// a driver allocation costs microseconds to milliseconds and may synchronize
// the device (cuMemAlloc, clCreateBuffer). PyTorch's caching allocator, RMM's
// pool and tinygrad's LRUAllocator do the same.
//
// Blocks are whole backend allocations, cached by size class: a request is
// rounded up to the next of 2^k, 1.25*2^k, 1.5*2^k, 1.75*2^k bytes (at least
// 512), so at most a fifth of a block is slack and same-sized tensors of a
// training loop hit the cache every step. Blocks are never split or
// coalesced: a backend's allocation is what its copies and views are checked
// against (an OpenCL buffer is a handle, not an address to offset), so a
// sub-block would need the seam to carry offsets. docs/DECISIONS.md.
//
// Lifetimes: a block reaches the pool only when the bridge frees it, which is
// after every copy, step, view and fence that used it has ended (the drop
// queue), so a cached block is never touched by the device.
//
// Not thread-safe: the bridge calls it under its lock.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "devbridge/backend.hpp"

namespace devbridge::detail {

class DevicePool {
 public:
  // Keyed by allocation.bytes, which is what the bridge asked the backend
  // for: a size class, or, where the class could not be had, the exact size
  // (then it serves only requests whose class is exactly that).
  struct Block {
    DeviceAllocation allocation;
    std::uint64_t alignment = 0;  // what the backend was asked for
  };

  // The bytes a request of `bytes` is rounded up to (`bytes` itself when the
  // round-up would not fit in 64 bits).
  static std::uint64_t size_class(std::uint64_t bytes) noexcept;

  explicit DevicePool(std::uint64_t cap_bytes) : cap_bytes_(cap_bytes) {}

  // A cached block of exactly `class_bytes` whose alignment covers `alignment`, the
  // most recently cached first (its pages are the warmest).
  std::optional<DeviceAllocation> take(std::uint64_t class_bytes, std::uint64_t alignment) noexcept;
  // Keeps a freed block; false when it would take the cache past its cap
  // (the caller frees it in the backend).
  bool keep(const Block& block);
  // Everything cached, for the backend to free (empty_cache, out of
  // memory, restart, close).
  std::vector<Block> take_all() noexcept;

  std::uint64_t cached_bytes() const noexcept { return cached_bytes_; }
  std::uint64_t cached_blocks() const noexcept { return cached_blocks_; }
  std::uint64_t largest_block() const noexcept;
  // Cached bytes in blocks too small for a request of `bytes`.
  std::uint64_t bytes_below(std::uint64_t bytes) const noexcept;
  std::uint64_t cap_bytes() const noexcept { return cap_bytes_; }

 private:
  std::map<std::uint64_t, std::vector<Block>> blocks_;  // by bytes, newest last
  std::uint64_t cap_bytes_;
  std::uint64_t cached_bytes_ = 0;
  std::uint64_t cached_blocks_ = 0;
};

}  // namespace devbridge::detail
