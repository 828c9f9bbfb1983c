// The one place sizes, offsets and timeouts a caller gives are combined.
//
// Every sum, product or round-up of a value that came from outside (a ring
// size, an extent, an offset, a padding added by a backend) goes through
// these helpers, so a value near 2^64 is refused with an error naming it
// instead of wrapping into a small allocation or a short copy. Durations
// saturate: a huge or infinite timeout means "until done", never "at once".
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>

#include "devbridge/error.hpp"

namespace devbridge::checked {

// a + b, or nothing when it does not fit in 64 bits.
[[nodiscard]] constexpr std::optional<std::uint64_t> add(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t sum;
  if (__builtin_add_overflow(a, b, &sum)) return std::nullopt;
  return sum;
}

// a * b, or nothing when it does not fit in 64 bits.
[[nodiscard]] constexpr std::optional<std::uint64_t> mul(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t product;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

// `value` rounded up to a multiple of `alignment` (a power of two), or
// nothing when the rounded value does not fit.
[[nodiscard]] constexpr std::optional<std::uint64_t> align_up(std::uint64_t value, std::uint64_t alignment) noexcept {
  const auto bumped = add(value, alignment - 1);
  if (!bumped) return std::nullopt;
  return *bumped & ~(alignment - 1);
}

// True when [offset, offset + len) lies inside [0, size), without overflow.
[[nodiscard]] constexpr bool range_within(std::uint64_t offset, std::uint64_t len, std::uint64_t size) noexcept {
  return offset <= size && len <= size - offset;
}

// The throwing forms: `what` names the quantity ("ring of 18446744073709551615
// bytes rounded up to 4096"), and the error kind is the caller's.
[[noreturn]] void overflow(ErrorKind kind, std::string_view what, std::uint64_t a, std::uint64_t b, char op);

inline std::uint64_t add_or_throw(std::uint64_t a, std::uint64_t b, ErrorKind kind, std::string_view what) {
  if (auto sum = add(a, b)) return *sum;
  overflow(kind, what, a, b, '+');
}
inline std::uint64_t mul_or_throw(std::uint64_t a, std::uint64_t b, ErrorKind kind, std::string_view what) {
  if (auto product = mul(a, b)) return *product;
  overflow(kind, what, a, b, '*');
}
inline std::uint64_t align_up_or_throw(std::uint64_t value, std::uint64_t alignment, ErrorKind kind,
                                       std::string_view what) {
  if (auto rounded = align_up(value, alignment)) return *rounded;
  overflow(kind, what, value, alignment, '^');
}

// ---- durations ----

using Clock = std::chrono::steady_clock;

// now + timeout, saturated at the clock's end of time: a timeout too large to
// add is "wait until done". A negative timeout is treated as zero.
[[nodiscard]] inline Clock::time_point deadline_after(std::chrono::nanoseconds timeout,
                                                      Clock::time_point now = Clock::now()) noexcept {
  if (timeout <= std::chrono::nanoseconds::zero()) return now;
  if (timeout >= Clock::time_point::max() - now) return Clock::time_point::max();
  return now + timeout;
}

// What is left of `deadline` (max() as deadline_after makes it: forever,
// nanoseconds::max()), zero once it has passed.
[[nodiscard]] inline std::chrono::nanoseconds time_left(Clock::time_point deadline,
                                                        Clock::time_point now = Clock::now()) noexcept {
  if (deadline == Clock::time_point::max()) return std::chrono::nanoseconds::max();
  return std::max(std::chrono::nanoseconds::zero(), std::chrono::nanoseconds(deadline - now));
}

// Seconds (as Python and the CLI give them) to nanoseconds: infinity and
// anything past ~292 years saturate to nanoseconds::max() ("until done").
// Negative or NaN is refused with InvalidRange naming `what`; the bindings
// check first and raise ValueError.
std::chrono::nanoseconds seconds_to_nanoseconds(double seconds, std::string_view what);

}  // namespace devbridge::checked
