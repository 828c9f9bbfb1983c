#include "core/device_pool.hpp"

#include <algorithm>
#include <bit>
#include <iterator>

namespace devbridge::detail {

std::uint64_t DevicePool::size_class(std::uint64_t bytes) noexcept {
  constexpr std::uint64_t kSmallest = 512;
  if (bytes <= kSmallest) return kSmallest;
  // Four classes per octave: the top bit, then quarters of it.
  const int top = std::bit_width(bytes) - 1;
  if (top < 2) return bytes;
  const std::uint64_t quarter = std::uint64_t{1} << (top - 2);
  const std::uint64_t rounded = (bytes + quarter - 1) / quarter * quarter;  // cannot wrap: top < 64
  return rounded < bytes ? bytes : rounded;
}

std::optional<DeviceAllocation> DevicePool::take(std::uint64_t class_bytes, std::uint64_t alignment) noexcept {
  auto it = blocks_.find(class_bytes);
  if (it == blocks_.end()) return std::nullopt;
  auto& list = it->second;
  for (auto block = list.rbegin(); block != list.rend(); ++block) {
    if (block->alignment < alignment) continue;
    const DeviceAllocation found = block->allocation;
    list.erase(std::next(block).base());
    if (list.empty()) blocks_.erase(it);
    cached_bytes_ -= found.bytes;
    --cached_blocks_;
    return found;
  }
  return std::nullopt;
}

bool DevicePool::keep(const Block& block) {
  if (block.allocation.bytes > cap_bytes_ - cached_bytes_) return false;  // cached_bytes_ <= cap_bytes_
  blocks_[block.allocation.bytes].push_back(block);
  cached_bytes_ += block.allocation.bytes;
  ++cached_blocks_;
  return true;
}

std::vector<DevicePool::Block> DevicePool::take_all() noexcept {
  std::vector<Block> all;
  try {
    all.reserve(cached_blocks_);
  } catch (...) {
    // Without room for the list, hand back what fits below; the rest stays
    // cached (never lost) for the next call.
  }
  for (auto it = blocks_.begin(); it != blocks_.end();) {
    auto& list = it->second;
    while (!list.empty() && all.size() < all.capacity()) {
      all.push_back(list.back());
      cached_bytes_ -= list.back().allocation.bytes;
      --cached_blocks_;
      list.pop_back();
    }
    it = list.empty() ? blocks_.erase(it) : std::next(it);
  }
  return all;
}

std::uint64_t DevicePool::largest_block() const noexcept {
  std::uint64_t largest = 0;
  for (const auto& [class_bytes, list] : blocks_)
    for (const auto& block : list) largest = std::max(largest, block.allocation.bytes);
  return largest;
}

std::uint64_t DevicePool::bytes_below(std::uint64_t bytes) const noexcept {
  std::uint64_t below = 0;
  for (const auto& [class_bytes, list] : blocks_) {
    if (class_bytes >= bytes) break;
    for (const auto& block : list) below += block.allocation.bytes;
  }
  return below;
}

}  // namespace devbridge::detail
