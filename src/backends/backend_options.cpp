#include "backends/backend_options.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>

#include <fmt/format.h>

#include "devbridge/error.hpp"

namespace devbridge::detail {

std::optional<std::string> OptionReader::text(std::string_view key, std::string_view meaning) {
  taken_.emplace_back(key, meaning);
  const auto it = options_.find(key);
  if (it == options_.end()) return std::nullopt;
  return it->second;
}

std::optional<std::uint64_t> OptionReader::unsigned_integer(std::string_view key, std::string_view meaning) {
  const auto value = text(key, meaning);
  if (!value) return std::nullopt;
  // Decimal (a leading 0 too: "010" is ten, as a user writing sizes means) or 0x hexadecimal (a
  // CUcontext's address). strtoull would also take a sign, leading spaces and octal; an option has none.
  const bool hex = value->size() > 2 && (*value)[0] == '0' && ((*value)[1] == 'x' || (*value)[1] == 'X');
  const std::string_view digits = hex ? std::string_view(*value).substr(2) : std::string_view(*value);
  const bool digits_only = !digits.empty() && std::isxdigit(static_cast<unsigned char>(digits[0])) &&
                           (hex || std::isdigit(static_cast<unsigned char>(digits[0])));
  errno = 0;
  char* end = nullptr;
  const unsigned long long parsed = digits_only ? std::strtoull(digits.data(), &end, hex ? 16 : 10) : 0;
  if (!digits_only || errno == ERANGE || end != value->c_str() + value->size())
    refuse(key, *value, "not a non-negative integer that fits in 64 bits (decimal, or 0x hexadecimal)");
  return parsed;
}

void OptionReader::single_device() {
  // A device that is not there is Unavailable on every backend (backends.hpp), as CUDA's and OpenCL's say.
  if (const auto device = text("device", "the one device: 0"); device && *device != "0")
    throw Error(ErrorKind::Unavailable, fmt::format("backend {}: option device='{}': no such device; this backend has "
                                                    "one device, \"0\"",
                                                    backend_, *device));
}

void OptionReader::finish() const {
  for (const auto& option : options_) {
    const auto& key = option.first;
    if (std::any_of(taken_.begin(), taken_.end(), [&](const auto& taken) { return taken.first == key; })) continue;
    std::string takes;
    for (const auto& [name, meaning] : taken_) takes += fmt::format("{}{} ({})", takes.empty() ? "" : "; ", name, meaning);
    throw Error(ErrorKind::Unsupported,
                fmt::format("backend {} has no option '{}' (it takes: {})", backend_, key, takes.empty() ? "none" : takes));
  }
}

void OptionReader::refuse(std::string_view key, std::string_view value, std::string_view why) const {
  throw Error(ErrorKind::Unsupported, fmt::format("backend {}: option {}='{}': {}", backend_, key, value, why));
}

}  // namespace devbridge::detail
