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

namespace {

// Keeps an extracted node for reuse (dropping it when even that fails).
template <class Spares, class Node>
void keep_node(Spares& spares, Node&& node) noexcept {
  if (!node) return;
  try {
    spares.push_back(std::move(node));
  } catch (...) {
    // The node is simply freed.
  }
}

}  // namespace

void DevicePool::add_free(const Segment& s, FreeKey key) {
  auto& set = free_set(s);
  if (spare_free_nodes_.empty()) {
    set.insert(key);
    return;
  }
  auto node = std::move(spare_free_nodes_.back());
  spare_free_nodes_.pop_back();
  node.value() = key;
  set.insert(std::move(node));
}

void DevicePool::remove_free(const Segment& s, FreeKey key) noexcept {
  keep_node(spare_free_nodes_, free_set(s).extract(key));
}

void DevicePool::add_part(std::uint64_t address, Where where) {
  if (spare_part_nodes_.empty()) {
    parts_.emplace(address, where);
    return;
  }
  auto node = std::move(spare_part_nodes_.back());
  spare_part_nodes_.pop_back();
  node.key() = address;
  node.mapped() = where;
  parts_.insert(std::move(node));
}

std::optional<DevicePool::Where> DevicePool::remove_part(std::uint64_t address) noexcept {
  auto node = parts_.extract(address);
  if (!node) return std::nullopt;
  const Where where = node.mapped();
  keep_node(spare_part_nodes_, std::move(node));
  return where;
}

void DevicePool::add_span(Segment& s, std::uint64_t offset, Span span) {
  if (spare_span_nodes_.empty()) {
    s.spans.emplace(offset, span);
    return;
  }
  auto node = std::move(spare_span_nodes_.back());
  spare_span_nodes_.pop_back();
  node.key() = offset;
  node.mapped() = span;
  s.spans.insert(std::move(node));
}

void DevicePool::remove_span(Segment& s, std::map<std::uint64_t, Span>::iterator span) noexcept {
  keep_node(spare_span_nodes_, s.spans.extract(span));
}

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
    add_part(part.address, Where{id, offset});
    if (part_bytes < span->second.bytes) {
      const std::uint64_t rest = span->second.bytes - part_bytes;
      add_span(s, offset + part_bytes, Span{rest, true});
      try {
        add_free(s, FreeKey{rest, id, offset + part_bytes});
      } catch (...) {
        remove_span(s, s.spans.find(offset + part_bytes));
        throw;
      }
      remove_free(s, FreeKey{span->second.bytes, id, offset});
      span->second.bytes = part_bytes;
      ++splits_made_;
    }
  } catch (...) {
    remove_part(part.address);
    if (splits()) backend.release_part(part);
    throw;
  }
  mark_used(id, s, span);
  return part;
}

void DevicePool::mark_used(std::uint64_t id, Segment& s, std::map<std::uint64_t, Span>::iterator span) {
  remove_free(s, FreeKey{span->second.bytes, id, span->first});
  span->second.free = false;
  if (s.used_bytes == 0) {
    --free_segments_;
    free_segment_bytes_ -= s.block.bytes;
  }
  s.used_bytes += span->second.bytes;
  free_bytes_ -= span->second.bytes;
}

std::optional<DeviceAllocation> DevicePool::take_whole(std::uint64_t class_bytes, std::uint64_t alignment) noexcept {
  auto it = whole_free_.find(class_bytes);
  if (it == whole_free_.end()) return std::nullopt;
  auto& list = it->second;
  for (auto block = list.rbegin(); block != list.rend(); ++block) {
    if (block->alignment < alignment) continue;
    const DeviceAllocation found = block->block;
    list.erase(std::next(block).base());
    if (list.empty()) whole_free_.erase(it);
    free_bytes_ -= found.bytes;
    --free_segments_;
    return found;
  }
  return std::nullopt;
}

std::optional<DeviceAllocation> DevicePool::take(Backend& backend, std::uint64_t class_bytes, std::uint64_t alignment) {
  if (!splits()) return take_whole(class_bytes, alignment);
  const bool small = splits() && class_bytes <= kSmallLimit;
  auto& spans = small ? free_small_ : free_large_;
  for (auto it = spans.lower_bound(FreeKey{class_bytes, 0, 0}); it != spans.end(); ++it) {
    auto& segment = segments_.find(it->segment)->second;
    if (segment.alignment < alignment || it->offset % alignment != 0) continue;
    return carve(backend, it->segment, segment, it->offset, class_bytes);
  }
  return std::nullopt;
}

DeviceAllocation DevicePool::take_from_new(Backend& backend, const DeviceAllocation& block, std::uint64_t alignment,
                                           std::uint64_t class_bytes) {
  if (!splits()) {
    reserved_bytes_ += block.bytes;
    ++whole_segments_;
    return block;
  }
  const std::uint64_t id = next_segment_++;
  Segment segment{block, segment_alignment(alignment), splits() && class_bytes <= kSmallLimit, 0, {}};
  segment.spans.emplace(0, Span{block.bytes, true});
  auto& s = segments_.emplace(id, std::move(segment)).first->second;
  try {
    add_free(s, FreeKey{block.bytes, id, 0});
  } catch (...) {
    segments_.erase(id);
    throw;
  }
  reserved_bytes_ += block.bytes;
  free_bytes_ += block.bytes;
  ++free_segments_;
  free_segment_bytes_ += block.bytes;
  return carve(backend, id, s, 0, class_bytes);
}

std::optional<DeviceAllocation> DevicePool::give_back(Backend& backend, const DeviceAllocation& part,
                                                      std::uint64_t alignment) {
  // (A part's alignment is where it starts: the split path needs no hint.)
  if (!splits()) {
    // Every allocation of a pooled bridge came from the pool.
    if (part.bytes > cap_bytes_ - free_bytes_) {  // free_bytes_ <= cap_bytes_ here
      // Past the cap: a cached block of another size at least as large goes
      // back instead (a size this workload stopped asking for), else this one.
      auto other = whole_free_.lower_bound(part.bytes);
      if (other != whole_free_.end() && other->first == part.bytes) ++other;
      if (other == whole_free_.end()) {
        reserved_bytes_ -= part.bytes;
        --whole_segments_;
        return part;
      }
      const DeviceAllocation evicted = other->second.front().block;  // the oldest of its size
      other->second.erase(other->second.begin());
      if (other->second.empty()) whole_free_.erase(other);
      free_bytes_ -= evicted.bytes;
      reserved_bytes_ -= evicted.bytes;
      --free_segments_;
      --whole_segments_;
      whole_free_[part.bytes].push_back(WholeBlock{part, alignment});
      free_bytes_ += part.bytes;
      ++free_segments_;
      return evicted;
    }
    whole_free_[part.bytes].push_back(WholeBlock{part, alignment});
    free_bytes_ += part.bytes;
    ++free_segments_;
    return std::nullopt;
  }
  const auto found = remove_part(part.address);
  if (!found) return part;  // never the pool's: the backend's own allocation
  const Where where = *found;
  if (splits()) backend.release_part(part);
  auto& s = segments_.find(where.segment)->second;
  auto span = s.spans.find(where.offset);
  const std::uint64_t bytes = span->second.bytes;
  span->second.free = true;
  s.used_bytes -= bytes;
  free_bytes_ += bytes;
  // Coalesce with free neighbours: the span absorbs the next, the previous absorbs it.
  if (auto next = std::next(span); next != s.spans.end() && next->second.free) {
    remove_free(s, FreeKey{next->second.bytes, where.segment, next->first});
    span->second.bytes += next->second.bytes;
    remove_span(s, next);
    ++coalesces_;
  }
  if (span != s.spans.begin()) {
    if (auto previous = std::prev(span); previous->second.free) {
      remove_free(s, FreeKey{previous->second.bytes, where.segment, previous->first});
      previous->second.bytes += span->second.bytes;
      remove_span(s, span);
      span = previous;
      ++coalesces_;
    }
  }
  add_free(s, FreeKey{span->second.bytes, where.segment, span->first});
  if (s.used_bytes != 0) return std::nullopt;
  ++free_segments_;
  free_segment_bytes_ += s.block.bytes;
  if (free_segment_bytes_ <= cap_bytes_) return std::nullopt;
  // Past the cap: a whole free segment goes back. One of the other kind (small
  // or large) at least as large, if there is one: memory this workload stopped
  // asking for (another model's sizes). Giving back this one instead would
  // keep that memory cached for ever and make every later request of this
  // size allocate afresh.
  auto victim = segments_.find(where.segment);
  for (auto it = segments_.begin(); it != segments_.end(); ++it)
    if (it->second.used_bytes == 0 && it->second.small != s.small && it->second.block.bytes >= s.block.bytes) {
      victim = it;
      break;
    }
  auto& v = victim->second;
  remove_free(v, FreeKey{v.block.bytes, victim->first, 0});
  reserved_bytes_ -= v.block.bytes;
  free_bytes_ -= v.block.bytes;
  --free_segments_;
  free_segment_bytes_ -= v.block.bytes;
  const DeviceAllocation whole = v.block;
  segments_.erase(victim);
  return whole;
}

std::vector<DeviceAllocation> DevicePool::release_free_segments(std::uint64_t down_to) noexcept {
  std::vector<DeviceAllocation> all;
  if (free_segment_bytes() <= down_to) return all;
  try {
    all.reserve(free_segments_);
  } catch (...) {
    // Without room for the list, hand back what fits below; the rest stays
    // cached (never lost) for the next call.
  }
  for (auto it = whole_free_.begin(); it != whole_free_.end();) {
    auto& list = it->second;
    while (!list.empty() && all.size() < all.capacity() && free_segment_bytes() > down_to) {
      all.push_back(list.back().block);
      free_bytes_ -= list.back().block.bytes;
      reserved_bytes_ -= list.back().block.bytes;
      --free_segments_;
      --whole_segments_;
      list.pop_back();
    }
    it = list.empty() ? whole_free_.erase(it) : std::next(it);
  }
  for (auto it = segments_.begin();
       it != segments_.end() && all.size() < all.capacity() && free_segment_bytes() > down_to;) {
    auto& s = it->second;
    if (s.used_bytes != 0) {
      ++it;
      continue;
    }
    remove_free(s, FreeKey{s.block.bytes, it->first, 0});
    reserved_bytes_ -= s.block.bytes;
    free_bytes_ -= s.block.bytes;
    --free_segments_;
    free_segment_bytes_ -= s.block.bytes;
    all.push_back(s.block);
    it = segments_.erase(it);
  }
  return all;
}

std::uint64_t DevicePool::largest_block() const noexcept {
  std::uint64_t largest = whole_free_.empty() ? 0 : whole_free_.rbegin()->first;
  if (!free_small_.empty()) largest = free_small_.rbegin()->bytes;
  if (!free_large_.empty()) largest = std::max(largest, free_large_.rbegin()->bytes);
  return largest;
}

std::uint64_t DevicePool::bytes_below(std::uint64_t bytes) const noexcept {
  std::uint64_t below = 0;
  for (const auto& [block_bytes, list] : whole_free_) {
    if (block_bytes >= bytes) break;
    below += block_bytes * list.size();
  }
  for (const auto* spans : {&free_small_, &free_large_})
    for (const auto& key : *spans) {
      if (key.bytes >= bytes) break;
      below += key.bytes;
    }
  return below;
}

}  // namespace devbridge::detail
