#include "devbridge/checked.hpp"

#include <fmt/format.h>

namespace devbridge::checked {

void overflow(ErrorKind kind, std::string_view what, std::uint64_t a, std::uint64_t b, char op) {
  if (op == '^')
    throw Error(kind, fmt::format("{}: {} rounded up to a multiple of {} does not fit in 64 bits", what, a, b));
  throw Error(kind, fmt::format("{}: {} {} {} does not fit in 64 bits", what, a, op, b));
}

std::chrono::nanoseconds seconds_to_nanoseconds(double seconds, std::string_view what) {
  if (std::isnan(seconds) || seconds < 0.0)
    throw Error(ErrorKind::InvalidRange, fmt::format("{} must be seconds >= 0 (got {})", what, seconds));
  // 2^63 ns is about 292 years; anything at or past it (infinity too) is
  // "until done". Below 2^63 the conversion to int64 is exact enough and safe.
  const double nanoseconds = seconds * 1e9;
  if (nanoseconds >= 0x1p63) return std::chrono::nanoseconds::max();
  return std::chrono::nanoseconds(static_cast<std::int64_t>(nanoseconds));
}

}  // namespace devbridge::checked
