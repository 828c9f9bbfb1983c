#include "core/host_ring.hpp"

#include <algorithm>

#include "core/fail.hpp"
#include "devbridge/checked.hpp"

namespace devbridge::detail {

namespace {
constexpr std::uint64_t kMaxReserveAlignment = 4096;  // the block is at least page-aligned
}  // namespace

// Arithmetic: bytes and alignment come from the caller; every sum of them is
// checked. Invariants the rest relies on: tail_ <= head_, head_ - tail_ <=
// capacity, every reservation lies in [tail_, head_), offsets < capacity.
HostRange HostRing::reserve(std::uint64_t bytes, std::uint64_t alignment) {
  if (!is_power_of_two(alignment) || alignment > kMaxReserveAlignment)
    fail(ErrorKind::InvalidAlignment, "ring reservation alignment {} is not a power of two in [1, {}]", alignment,
         kMaxReserveAlignment);
  const std::uint64_t cap = capacity();
  if (bytes == 0 || bytes > cap)
    fail(ErrorKind::InvalidRange, "ring reservation of {} bytes: must be in [1, {}] (the ring's capacity)", bytes, cap);
  const bool drained = empty();
  if (drained) {
    // An empty ring starts the next reservation at offset 0 of a fresh lap,
    // so a drained ring never fragments. No position is live, so positions
    // start over.
    head_ = tail_ = 0;
    head_offset_ = tail_offset_ = 0;
  }
  // Aligned up from the head, unless that spans the end (or, for a ring
  // within 4095 bytes of 2^64, does not even fit): then the next lap.
  std::uint64_t offset = 0;
  if (const auto aligned = checked::align_up(head_offset_, alignment);
      aligned && checked::range_within(*aligned, bytes, cap))
    offset = *aligned;
  // Distance from the tail to the new reservation: what is in use plus the
  // bytes skipped (alignment padding, or the rest of the lap). Each part is
  // at most cap; their sum may not fit, and is then surely too much.
  const std::uint64_t skipped = offset >= head_offset_ ? offset - head_offset_ : cap - head_offset_;
  const auto from_tail = checked::add(used(), skipped);
  if (!from_tail || *from_tail > cap - bytes)
    fail(ErrorKind::Backpressure,
         "host ring full: {} bytes (alignment {}) asked, {} of {} bytes free, oldest reservation at offset {} still "
         "owned",
         bytes, alignment, free_bytes(), cap, tail_offset_);
  // *from_tail + bytes <= cap. Positions must fit: rebase when this end would not.
  const std::uint64_t end_from_tail = *from_tail + bytes;
  if (!checked::add(tail_, end_from_tail)) rebase();
  const Position begin = tail_ + *from_tail;
  make_room();
  at_key(next_key_) = Reservation{begin, offset, bytes};
  if (!drained && (offset < head_offset_ || head_offset_ == 0)) ++wraps_;
  ++next_key_;
  ++live_;
  head_ = tail_ + end_from_tail;
  head_offset_ = bytes == cap - offset ? 0 : offset + bytes;  // offset + bytes <= cap
  return HostRange{offset, bytes};
}

HostRing::Key HostRing::locate(HostRange range) const noexcept {
  const std::uint64_t cap = capacity();
  if (range.len == 0 || !checked::range_within(range.offset, range.len, cap) || empty())
    return kNoKey;
  // Every live byte lies in [tail, head), at most cap past the tail: map the
  // offset into that window.
  const std::uint64_t from_tail =
      range.offset >= tail_offset_ ? range.offset - tail_offset_ : cap - (tail_offset_ - range.offset);
  if (from_tail >= used()) return kNoKey;
  const Position at = tail_ + from_tail;  // < head_: fits
  const auto holds = [&](const Reservation& r) {
    return at >= r.begin && !r.released && checked::range_within(at - r.begin, range.len, r.len);
  };
  // The newest reservation is the likeliest, and needs no search.
  if (const auto& newest = at_key(next_key_ - 1); at >= newest.begin)
    return holds(newest) ? next_key_ - 1 : kNoKey;
  // The last older reservation beginning at or before `at`: the oldest does
  // (at >= tail_, its begin), the newest does not.
  Key low = front_key_, high = next_key_ - 1;
  while (high - low > 1) {
    const Key middle = low + (high - low) / 2;
    (at_key(middle).begin <= at ? low : high) = middle;
  }
  return holds(at_key(low)) ? low : kNoKey;
}

HostRing::Key HostRing::find(HostRange range) const {
  const auto key = locate(range);
  if (key == kNoKey)
    fail(ErrorKind::InvalidRange, "host range [offset {}, len {}] is not inside one live reservation of the {}-byte ring",
         range.offset, range.len, capacity());
  return key;
}

void HostRing::unpin(Key key) noexcept {
  if (key - front_key_ < next_key_ - front_key_ && at_key(key).pins > 0) --at_key(key).pins;
}

void HostRing::unpin_all() noexcept {
  for (Key key = front_key_; key != next_key_; ++key) at_key(key).pins = 0;
}

void HostRing::release(HostRange range) {
  const auto key = locate(range);
  auto* reservation = key != kNoKey ? &at_key(key) : nullptr;
  if (!reservation || reservation->offset != range.offset || reservation->len != range.len)
    fail(ErrorKind::InvalidRange,
         "host range [offset {}, len {}] is not a live reservation (release takes exactly the range reserve returned)",
         range.offset, range.len);
  if (reservation->pins > 0)
    fail(ErrorKind::AllocationStillInUse, "host range [offset {}, len {}] is used by {} in-flight cop{}; wait for them first",
         range.offset, range.len, reservation->pins, reservation->pins == 1 ? "y" : "ies");
  reservation->released = true;
  --live_;
  advance_tail();
}

HostRing::Key HostRing::exact(HostRange range, const char* what) const {
  const auto key = locate(range);
  const auto* reservation = key != kNoKey ? &at_key(key) : nullptr;
  if (!reservation || reservation->offset != range.offset || reservation->len != range.len)
    fail(ErrorKind::InvalidRange,
         "host range [offset {}, len {}] is not a live reservation ({} takes exactly the range reserve returned)",
         range.offset, range.len, what);
  return key;
}

HostRing::KeyRelease HostRing::release(Key key, HostRange range) noexcept {
  if (key < front_key_ || key >= next_key_) return KeyRelease::Gone;
  auto& reservation = at_key(key);
  if (reservation.released || reservation.offset != range.offset || reservation.len != range.len)
    return KeyRelease::Gone;
  if (reservation.pins > 0) return KeyRelease::Pinned;
  reservation.released = true;
  --live_;
  advance_tail();
  return KeyRelease::Released;
}

void HostRing::make_room() {
  if (next_key_ - front_key_ < slots_.size()) return;
  // Twice the slots; each live key moves to its slot under the new mask.
  std::vector<Reservation> wider(slots_.empty() ? 8 : 2 * slots_.size());
  const Key wider_mask = wider.size() - 1;
  for (Key key = front_key_; key != next_key_; ++key) wider[key & wider_mask] = at_key(key);
  slots_ = std::move(wider);
  mask_ = wider_mask;
}

// The tail advances over the released prefix only.
void HostRing::advance_tail() noexcept {
  while (!empty() && at_key(front_key_).released) ++front_key_;
  if (empty()) {
    tail_ = head_;
    tail_offset_ = head_offset_;
  } else {
    tail_ = at_key(front_key_).begin;
    tail_offset_ = at_key(front_key_).offset;
  }
}

// Positions are only ever compared with each other, so shifting them all by
// the same amount changes nothing. Reached only after ~2^64 - capacity bytes
// have passed through without the ring ever emptying.
void HostRing::rebase() noexcept {
  for (Key key = front_key_; key != next_key_; ++key) at_key(key).begin -= tail_;
  head_ -= tail_;
  tail_ = 0;
}

}  // namespace devbridge::detail
