#include "core/host_ring.hpp"

#include <algorithm>

#include "core/fail.hpp"

namespace devbridge::detail {

namespace {
constexpr std::uint64_t kMaxReserveAlignment = 4096;  // the block is at least page-aligned
}  // namespace

HostRange HostRing::reserve(std::uint64_t bytes, std::uint64_t alignment) {
  if (!is_power_of_two(alignment) || alignment > kMaxReserveAlignment)
    fail(ErrorKind::InvalidAlignment, "ring reservation alignment {} is not a power of two in [1, {}]", alignment,
         kMaxReserveAlignment);
  const std::uint64_t cap = capacity();
  if (bytes == 0 || bytes > cap)
    fail(ErrorKind::InvalidRange, "ring reservation of {} bytes: must be in [1, {}] (the ring's capacity)", bytes, cap);
  if (reservations_.empty()) {
    // An empty ring starts the next reservation at offset 0 of a fresh lap,
    // so a drained ring never fragments.
    head_ = tail_ = (head_ + cap - 1) / cap * cap;
    tail_offset_ = 0;
  }
  const std::uint64_t head_offset = head_ % cap;
  std::uint64_t offset = (head_offset + alignment - 1) & ~(alignment - 1);
  if (offset + bytes > cap) offset = 0;  // never span the end: start the next lap
  const Position begin = offset >= head_offset ? head_ + (offset - head_offset) : head_ + (cap - head_offset);
  if (begin + bytes - tail_ > cap)
    fail(ErrorKind::Backpressure,
         "host ring full: {} bytes (alignment {}) asked, {} of {} bytes free, oldest reservation at offset {} still "
         "owned",
         bytes, alignment, free_bytes(), cap, tail_offset_);
  reservations_.push_back(Reservation{begin, offset, bytes});
  ++live_;
  head_ = begin + bytes;
  return HostRange{offset, bytes};
}

std::ptrdiff_t HostRing::locate(HostRange range) const noexcept {
  const std::uint64_t cap = capacity();
  if (range.offset >= cap || range.len == 0 || range.len > cap - range.offset || reservations_.empty()) return -1;
  // Every live byte lies in [tail, tail + cap); map the offset into that window.
  const Position at =
      tail_ + (range.offset >= tail_offset_ ? range.offset - tail_offset_ : range.offset + cap - tail_offset_);
  // The newest reservation is the likeliest; check it before searching.
  auto it = std::prev(reservations_.end());
  if (at < it->begin)
    it = std::prev(std::upper_bound(reservations_.begin(), it, at,
                                    [](Position p, const Reservation& r) { return p < r.begin; }));
  if (at < it->begin || it->released || at + range.len > it->begin + it->len) return -1;
  return it - reservations_.begin();
}

HostRing::Key HostRing::find(HostRange range) const {
  const auto index = locate(range);
  if (index < 0)
    fail(ErrorKind::InvalidRange, "host range [offset {}, len {}] is not inside one live reservation of the {}-byte ring",
         range.offset, range.len, capacity());
  return front_key_ + static_cast<Key>(index);
}

void HostRing::unpin(Key key) noexcept {
  const auto index = key - front_key_;
  if (index < reservations_.size() && reservations_[index].pins > 0) --reservations_[index].pins;
}

void HostRing::unpin_all() noexcept {
  for (auto& r : reservations_) r.pins = 0;
}

void HostRing::release(HostRange range) {
  const auto index = locate(range);
  if (index < 0 || reservations_[index].offset != range.offset || reservations_[index].len != range.len)
    fail(ErrorKind::InvalidRange,
         "host range [offset {}, len {}] is not a live reservation (release takes exactly the range reserve returned)",
         range.offset, range.len);
  auto& reservation = reservations_[index];
  if (reservation.pins > 0)
    fail(ErrorKind::AllocationStillInUse, "host range [offset {}, len {}] is used by {} in-flight cop{}; wait for them first",
         range.offset, range.len, reservation.pins, reservation.pins == 1 ? "y" : "ies");
  reservation.released = true;
  --live_;
  advance_tail();
}

// The tail advances over the released prefix only.
void HostRing::advance_tail() noexcept {
  while (!reservations_.empty() && reservations_.front().released) {
    reservations_.pop_front();
    ++front_key_;
  }
  if (reservations_.empty()) {
    tail_ = head_;
    tail_offset_ = capacity() ? head_ % capacity() : 0;
  } else {
    tail_ = reservations_.front().begin;
    tail_offset_ = reservations_.front().offset;
  }
}

}  // namespace devbridge::detail
