#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "backends/dynamic_library.hpp"
#include "devbridge/checkpoint_file.hpp"

namespace devbridge::checkpoint {
namespace {

// ISA-L's gzip CRC is zlib's CRC-32, chained the same way, at about 5x zlib's
// speed here (carry-less multiply): a restore hashes every byte it reads and
// must keep pace with the page cache. Loaded at run time, as the vendor
// drivers are: the library and the Python wheel link no ISA-L, so they run
// where it is missing, with zlib (the same checksum, slower).
using IsalCrc32 = std::uint32_t (*)(std::uint32_t, const unsigned char*, std::uint64_t);

IsalCrc32 isal_crc32() noexcept {
  static const IsalCrc32 found = []() -> IsalCrc32 {
    std::string error, missing;
    void* library = backends::open_library_for_good("libisal.so.2", error);
    return library ? reinterpret_cast<IsalCrc32>(backends::find_symbol(library, "crc32_gzip_refl", missing)) : nullptr;
  }();
  return found;
}

}  // namespace

void Crc32::update(const void* data, std::size_t n) noexcept {
  if (const IsalCrc32 isal = isal_crc32()) {
    value_ = isal(value_, static_cast<const unsigned char*>(data), n);
    return;
  }
  // zlib's crc32 takes at most UINT_MAX bytes a call.
  const auto* bytes = static_cast<const Bytef*>(data);
  while (n > 0) {
    const auto part = static_cast<uInt>(std::min<std::size_t>(n, std::size_t{1} << 30));
    value_ = static_cast<std::uint32_t>(::crc32(value_, bytes, part));
    bytes += part;
    n -= part;
  }
}

std::uint32_t Crc32::combine(std::uint32_t first, std::uint32_t second, std::uint64_t second_bytes) noexcept {
  return static_cast<std::uint32_t>(::crc32_combine(first, second, static_cast<z_off_t>(second_bytes)));
}

std::string Crc32::hexdigest() const { return text_of(value_).substr(6); }  // after "crc32:"

std::string Crc32::text_of(std::uint32_t value) {
  char text[16];
  std::snprintf(text, sizeof text, "crc32:%08x", static_cast<unsigned>(value));
  return text;
}

}  // namespace devbridge::checkpoint
