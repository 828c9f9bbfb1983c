#include "core/host_ring.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace devbridge::detail {

namespace {
constexpr std::uint64_t kMaxReserveAlignment = 4096;  // the block is at least page-aligned
constexpr bool is_power_of_two(std::uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }
}  // namespace

HostRange HostRing::reserve(std::uint64_t bytes, std::uint64_t alignment) {
  if (!is_power_of_two(alignment) || alignment > kMaxReserveAlignment)
    throw Error(ErrorKind::InvalidAlignment,
                fmt::format("ring reservation alignment {} is not a power of two in [1, {}]", alignment,
                            kMaxReserveAlignment));
  const std::uint64_t cap = capacity();
  if (bytes == 0 || bytes > cap)
    throw Error(ErrorKind::InvalidRange,
                fmt::format("ring reservation of {} bytes: must be in [1, {}] (the ring's capacity)", bytes, cap));
  if (reservations_.empty()) {
    // An empty ring starts the next reservation at offset 0 of a fresh lap,
    // so a drained ring never fragments.
    head_ = tail_ = (head_ + cap - 1) / cap * cap;
  }
  const std::uint64_t offset = head_ % cap;
  std::uint64_t aligned = (offset + alignment - 1) & ~(alignment - 1);
  Position begin = head_ + (aligned - offset);
  if (aligned + bytes > cap) begin = head_ + (cap - offset);  // never span the end: start the next lap
  if (begin + bytes - tail_ > cap)
    throw Error(ErrorKind::Backpressure,
                fmt::format("host ring full: {} bytes (alignment {}) asked, {} of {} bytes free, oldest reservation "
                            "at offset {} still owned",
                            bytes, alignment, free_bytes(), cap, tail_ % cap));
  reservations_.push_back(Reservation{begin, bytes});
  ++live_;
  head_ = begin + bytes;
  return HostRange{begin % cap, bytes};
}

std::deque<HostRing::Reservation>::const_iterator HostRing::locate(HostRange range) const {
  const std::uint64_t cap = capacity();
  if (cap == 0 || range.offset >= cap || range.len == 0 || range.len > cap - range.offset) return reservations_.end();
  // Every live byte lies in [tail, tail + cap); map the offset into that window.
  const Position at = tail_ + (range.offset + cap - tail_ % cap) % cap;
  auto it = std::upper_bound(reservations_.begin(), reservations_.end(), at,
                             [](Position p, const Reservation& r) { return p < r.begin; });
  if (it == reservations_.begin()) return reservations_.end();
  --it;
  if (it->released || at + range.len > it->begin + it->len) return reservations_.end();
  return it;
}

HostRing::Position HostRing::find(HostRange range) const {
  auto it = locate(range);
  if (it == reservations_.end())
    throw Error(ErrorKind::InvalidRange,
                fmt::format("host range [offset {}, len {}] is not inside one live reservation of the {}-byte ring",
                            range.offset, range.len, capacity()));
  return it->begin;
}

HostRing::Reservation* HostRing::lookup(Position key) noexcept {
  auto it = std::lower_bound(reservations_.begin(), reservations_.end(), key,
                             [](const Reservation& r, Position p) { return r.begin < p; });
  return (it != reservations_.end() && it->begin == key) ? &*it : nullptr;
}

void HostRing::pin(Position key) {
  if (auto* r = lookup(key)) ++r->pins;
}

void HostRing::unpin(Position key) noexcept {
  if (auto* r = lookup(key); r && r->pins > 0) --r->pins;
}

void HostRing::unpin_all() noexcept {
  for (auto& r : reservations_) r.pins = 0;
}

void HostRing::release(HostRange range) {
  auto it = locate(range);
  if (it == reservations_.end() || it->begin % capacity() != range.offset || it->len != range.len)
    throw Error(ErrorKind::InvalidRange,
                fmt::format("host range [offset {}, len {}] is not a live reservation (release takes exactly the "
                            "range reserve returned)",
                            range.offset, range.len));
  if (it->pins > 0)
    throw Error(ErrorKind::AllocationStillInUse,
                fmt::format("host range [offset {}, len {}] is used by {} in-flight cop{}; wait for them first",
                            range.offset, range.len, it->pins, it->pins == 1 ? "y" : "ies"));
  reservations_[static_cast<std::size_t>(it - reservations_.begin())].released = true;
  --live_;
  // The tail advances over the released prefix only.
  while (!reservations_.empty() && reservations_.front().released) reservations_.pop_front();
  tail_ = reservations_.empty() ? head_ : reservations_.front().begin;
}

}  // namespace devbridge::detail
