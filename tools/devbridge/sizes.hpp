// Parsing and printing of the byte sizes and counts the command line takes.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace devbridge::cli {

// A command line that cannot work: main() prints what() on one line and exits 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// "4096", "4MiB", "1.5GiB", "2GB", "64k". Units are case-insensitive:
// B; K/KiB, M/MiB, G/GiB, T/TiB (powers of 1024); KB, MB, GB, TB (powers of
// 1000). A fraction is accepted only when the result is a whole number of
// bytes. Throws UsageError naming `option` and the text at fault.
std::uint64_t parse_size(std::string_view option, std::string_view text);

// A plain non-negative decimal integer (no sign, no unit).
std::uint64_t parse_count(std::string_view option, std::string_view text);

// "512 B", "4.00 MiB", "1.00 GiB".
std::string format_bytes(std::uint64_t bytes);

// Decimal gigabytes per second (1 GB/s = 1e9 bytes/s), as storage and
// interconnect vendors quote them.
double gigabytes_per_second(std::uint64_t bytes, double seconds);

}  // namespace devbridge::cli
