#include "sizes.hpp"

#include <array>
#include <cctype>
#include <limits>

#include <fmt/format.h>

namespace devbridge::cli {
namespace {

struct Unit {
  std::string_view name;  // lower case
  std::uint64_t bytes;
};

constexpr std::array<Unit, 14> kUnits{{
    {"", 1},
    {"b", 1},
    {"k", 1ull << 10},
    {"kib", 1ull << 10},
    {"m", 1ull << 20},
    {"mib", 1ull << 20},
    {"g", 1ull << 30},
    {"gib", 1ull << 30},
    {"t", 1ull << 40},
    {"tib", 1ull << 40},
    {"kb", 1000ull},
    {"mb", 1000ull * 1000},
    {"gb", 1000ull * 1000 * 1000},
    {"tb", 1000ull * 1000 * 1000 * 1000},
}};

// 128 bits hold any 24-digit mantissa (< 2^80) times the largest unit (< 2^41).
__extension__ typedef unsigned __int128 Wide;

bool is_digit(char c) { return c >= '0' && c <= '9'; }

std::string lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

[[noreturn]] void malformed(std::string_view option, std::string_view text, std::string_view why) {
  throw UsageError(fmt::format("{}: '{}' is not a size ({}); examples: 4096, 64KiB, 4MiB, 1.5GiB", option, text, why));
}

}  // namespace

std::uint64_t parse_size(std::string_view option, std::string_view text) {
  if (text.empty()) malformed(option, text, "empty");
  std::size_t pos = 0;
  // The digits, with an optional fraction, read as mantissa / 10^fraction_digits.
  Wide mantissa = 0;
  int digits = 0;
  int fraction_digits = 0;
  bool seen_point = false;
  for (; pos < text.size(); ++pos) {
    const char c = text[pos];
    if (is_digit(c)) {
      if (++digits > 24) malformed(option, text, "too many digits");
      mantissa = mantissa * 10 + static_cast<unsigned>(c - '0');
      if (seen_point) ++fraction_digits;
    } else if (c == '.' && !seen_point) {
      seen_point = true;
    } else {
      break;
    }
  }
  if (digits == 0) malformed(option, text, "no number");
  if (seen_point && fraction_digits == 0) malformed(option, text, "nothing after the decimal point");

  const std::string unit_text = lower(text.substr(pos));
  const Unit* unit = nullptr;
  for (const Unit& u : kUnits) {
    if (u.name == unit_text) unit = &u;
  }
  if (unit == nullptr) malformed(option, text, fmt::format("unknown unit '{}'", text.substr(pos)));

  Wide scale = 1;
  for (int i = 0; i < fraction_digits; ++i) scale *= 10;
  const Wide numerator = mantissa * unit->bytes;
  if (numerator % scale != 0) malformed(option, text, "not a whole number of bytes");
  const Wide bytes = numerator / scale;
  if (bytes > std::numeric_limits<std::uint64_t>::max()) malformed(option, text, "too large");
  return static_cast<std::uint64_t>(bytes);
}

std::uint64_t parse_count(std::string_view option, std::string_view text) {
  if (text.empty()) throw UsageError(fmt::format("{}: '' is not a whole number (empty)", option));
  std::uint64_t value = 0;
  for (char c : text) {
    if (!is_digit(c)) throw UsageError(fmt::format("{}: '{}' is not a whole number", option, text));
    const std::uint64_t digit = static_cast<std::uint64_t>(c - '0');
    if (value > (std::numeric_limits<std::uint64_t>::max() - digit) / 10) {
      throw UsageError(fmt::format("{}: '{}' is too large", option, text));
    }
    value = value * 10 + digit;
  }
  return value;
}

std::string format_bytes(std::uint64_t bytes) {
  constexpr std::array<std::string_view, 6> names{"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return fmt::format("{} B", bytes);
  double value = static_cast<double>(bytes);
  std::size_t i = 0;
  while (value >= 1024.0 && i + 1 < names.size()) {
    value /= 1024.0;
    ++i;
  }
  return fmt::format("{:.2f} {}", value, names[i]);
}

double gigabytes_per_second(std::uint64_t bytes, double seconds) {
  if (seconds <= 0.0) return 0.0;
  return static_cast<double>(bytes) / seconds / 1e9;
}

}  // namespace devbridge::cli
