#include "core/device_pool.hpp"

#include <algorithm>
#include <bit>
#include <iterator>

#include "devbridge/checked.hpp"

namespace devbridge::detail {

std::uint64_t DevicePool::size_class(std::uint64_t bytes) noexcept {
  if (bytes <= kSmallest) return kSmallest;
  // Four classes per octave: the top bit, then quarters of it.
  const int top = std::bit_width(bytes) - 1;
  if (top < 2) return bytes;
  const std::uint64_t quarter = std::uint64_t{1} << (top - 2);
  const std::uint64_t rounded = (bytes + quarter - 1) / quarter * quarter;  // cannot wrap: top < 64
  return rounded < bytes ? bytes : rounded;
}

DevicePool::DevicePool(std::uint64_t cap_bytes, std::uint64_t part_alignment) noexcept
    : cap_bytes_(cap_bytes),
      granularity_(part_alignment == 0 ? 0 : std::max(part_alignment, kSmallest)) {}

DeviceAllocation DevicePool::carve(Backend& backend, std::uint64_t id, Segment& s, std::uint64_t offset,
                                   std::uint64_t class_bytes) {
  auto span = s.spans.find(offset);
  std::uint64_t part_bytes = span->second.bytes;
  if (splits()) {
    // Parts start on the granularity, so a part's size is rounded to it too.
    const auto wanted = checked::align_up(class_bytes, granularity_).value_or(part_bytes);
    const std::uint64_t least_left = s.small ? granularity_ : kSmallLimit;
    if (wanted < part_bytes && part_bytes - wanted >= least_left) part_bytes = wanted;
  }
  // The backend first: if it refuses, nothing here has changed.
  const DeviceAllocation part = splits() ? backend.make_part(s.block, offset, part_bytes) : s.block;
  try {
    parts_.emplace(part.address, Where{id, offset});
    if (part_bytes < span->second.bytes) {
      const std::uint64_t rest = span->second.bytes - part_bytes;
      free_set(s).erase(FreeKey{span->second.bytes, id, offset});
      free_set(s).insert(FreeKey{rest, id, offset + part_bytes});
      s.spans.emplace(offset + part_bytes, Span{rest, true});
      span->second.bytes = part_bytes;
    }
  } catch (...) {
    parts_.erase(part.address);
    if (splits()) backend.release_part(part);
    throw;
  }
  mark_used(id, s, span);
  return part;
}

void DevicePool::mark_used(std::uint64_t id, Segment& s, std::map<std::uint64_t, Span>::iterator span) {
  free_set(s).erase(FreeKey{span->second.bytes, id, span->first});
  span->second.free = false;
  if (s.used_bytes == 0) --free_segments_;
  s.used_bytes += span->second.bytes;
  free_bytes_ -= span->second.bytes;
}

std::optional<DeviceAllocation> DevicePool::take(Backend& backend, std::uint64_t class_bytes, std::uint64_t alignment) {
  const bool small = splits() && class_bytes <= kSmallLimit;
  auto& spans = small ? free_small_ : free_large_;
  for (auto it = spans.lower_bound(FreeKey{class_bytes, 0, 0}); it != spans.end(); ++it) {
    // Whole segments serve only their own class: a larger one would waste
    // the difference for as long as the allocation lives.
    if (!splits() && it->bytes != class_bytes) break;
    auto& segment = segments_.find(it->segment)->second;
    if (segment.alignment < alignment || it->offset % alignment != 0) continue;
    return carve(backend, it->segment, segment, it->offset, class_bytes);
  }
  return std::nullopt;
}

DeviceAllocation DevicePool::take_from_new(Backend& backend, const DeviceAllocation& block, std::uint64_t alignment,
                                           std::uint64_t class_bytes) {
  const std::uint64_t id = next_segment_++;
  Segment segment{block, segment_alignment(alignment), splits() && class_bytes <= kSmallLimit, 0, {}};
  segment.spans.emplace(0, Span{block.bytes, true});
  auto& s = segments_.emplace(id, std::move(segment)).first->second;
  try {
    free_set(s).insert(FreeKey{block.bytes, id, 0});
  } catch (...) {
    segments_.erase(id);
    throw;
  }
  reserved_bytes_ += block.bytes;
  free_bytes_ += block.bytes;
  ++free_segments_;
  return carve(backend, id, s, 0, class_bytes);
}

std::optional<DeviceAllocation> DevicePool::give_back(Backend& backend, const DeviceAllocation& part) {
  const auto found = parts_.find(part.address);
  if (found == parts_.end()) return part;  // never the pool's: the backend's own allocation
  const Where where = found->second;
  parts_.erase(found);
  if (splits()) backend.release_part(part);
  auto& s = segments_.find(where.segment)->second;
  auto span = s.spans.find(where.offset);
  const std::uint64_t bytes = span->second.bytes;
  span->second.free = true;
  s.used_bytes -= bytes;
  free_bytes_ += bytes;
  // Coalesce with free neighbours: the span absorbs the next, the previous absorbs it.
  if (auto next = std::next(span); next != s.spans.end() && next->second.free) {
    free_set(s).erase(FreeKey{next->second.bytes, where.segment, next->first});
    span->second.bytes += next->second.bytes;
    s.spans.erase(next);
  }
  if (span != s.spans.begin()) {
    if (auto previous = std::prev(span); previous->second.free) {
      free_set(s).erase(FreeKey{previous->second.bytes, where.segment, previous->first});
      previous->second.bytes += span->second.bytes;
      s.spans.erase(span);
      span = previous;
    }
  }
  free_set(s).insert(FreeKey{span->second.bytes, where.segment, span->first});
  if (s.used_bytes != 0) return std::nullopt;
  ++free_segments_;
  if (free_bytes_ <= cap_bytes_) return std::nullopt;
  // Past the cap: a whole free segment goes back.
  free_set(s).erase(FreeKey{s.block.bytes, where.segment, 0});
  reserved_bytes_ -= s.block.bytes;
  free_bytes_ -= s.block.bytes;
  --free_segments_;
  const DeviceAllocation whole = s.block;
  segments_.erase(where.segment);
  return whole;
}

std::vector<DeviceAllocation> DevicePool::release_free_segments() noexcept {
  std::vector<DeviceAllocation> all;
  try {
    all.reserve(free_segments_);
  } catch (...) {
    // Without room for the list, hand back what fits below; the rest stays
    // cached (never lost) for the next call.
  }
  for (auto it = segments_.begin(); it != segments_.end() && all.size() < all.capacity();) {
    auto& s = it->second;
    if (s.used_bytes != 0) {
      ++it;
      continue;
    }
    free_set(s).erase(FreeKey{s.block.bytes, it->first, 0});
    reserved_bytes_ -= s.block.bytes;
    free_bytes_ -= s.block.bytes;
    --free_segments_;
    all.push_back(s.block);
    it = segments_.erase(it);
  }
  return all;
}

std::uint64_t DevicePool::largest_block() const noexcept {
  std::uint64_t largest = 0;
  if (!free_small_.empty()) largest = free_small_.rbegin()->bytes;
  if (!free_large_.empty()) largest = std::max(largest, free_large_.rbegin()->bytes);
  return largest;
}

std::uint64_t DevicePool::bytes_below(std::uint64_t bytes) const noexcept {
  std::uint64_t below = 0;
  for (const auto* spans : {&free_small_, &free_large_})
    for (const auto& key : *spans) {
      if (key.bytes >= bytes) break;
      below += key.bytes;
    }
  return below;
}

}  // namespace devbridge::detail
