#include <zlib.h>

#include <algorithm>
#include <cstdio>

#include "devbridge/checkpoint_file.hpp"

namespace devbridge::checkpoint {

void Crc32::update(const void* data, std::size_t n) noexcept {
  // zlib's crc32 takes at most UINT_MAX bytes a call.
  const auto* bytes = static_cast<const Bytef*>(data);
  while (n > 0) {
    const auto part = static_cast<uInt>(std::min<std::size_t>(n, std::size_t{1} << 30));
    value_ = static_cast<std::uint32_t>(::crc32(value_, bytes, part));
    bytes += part;
    n -= part;
  }
}

std::string Crc32::hexdigest() const {
  char digits[9];
  std::snprintf(digits, sizeof digits, "%08x", static_cast<unsigned>(value_));
  return digits;
}

}  // namespace devbridge::checkpoint
