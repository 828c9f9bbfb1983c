#include <zlib.h>

#include <algorithm>
#include <cstdio>

#if DEVBRIDGE_HAVE_ISAL
#include <isa-l/crc.h>
#endif

#include "devbridge/checkpoint_file.hpp"

namespace devbridge::checkpoint {

void Crc32::update(const void* data, std::size_t n) noexcept {
#if DEVBRIDGE_HAVE_ISAL
  // ISA-L's gzip CRC is zlib's CRC-32, chained the same way, at 5x zlib's
  // speed here (carry-less multiply): the restore hashes every byte it reads.
  value_ = crc32_gzip_refl(value_, static_cast<const unsigned char*>(data), n);
#else
  // zlib's crc32 takes at most UINT_MAX bytes a call.
  const auto* bytes = static_cast<const Bytef*>(data);
  while (n > 0) {
    const auto part = static_cast<uInt>(std::min<std::size_t>(n, std::size_t{1} << 30));
    value_ = static_cast<std::uint32_t>(::crc32(value_, bytes, part));
    bytes += part;
    n -= part;
  }
#endif
}

std::uint32_t Crc32::combine(std::uint32_t first, std::uint32_t second, std::uint64_t second_bytes) noexcept {
  return static_cast<std::uint32_t>(::crc32_combine(first, second, static_cast<z_off_t>(second_bytes)));
}

std::string Crc32::hexdigest() const {
  char digits[9];
  std::snprintf(digits, sizeof digits, "%08x", static_cast<unsigned>(value_));
  return digits;
}

std::string Crc32::text_of(std::uint32_t value) {
  char text[16];
  std::snprintf(text, sizeof text, "crc32:%08x", static_cast<unsigned>(value));
  return text;
}

}  // namespace devbridge::checkpoint
