// Reads a backend's text options (BackendOptions) into typed values, and
// refuses what the backend does not take, so each factory only says which
// keys it takes and what they mean.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "devbridge/backend.hpp"

namespace devbridge::detail {

class OptionReader {
 public:
  OptionReader(std::string_view backend, const BackendOptions& options) : backend_(backend), options_(options) {}

  // The value of `key`, if given. `meaning` is how the refusal of an unknown
  // key describes this one ("device: the platform:device to bind").
  std::optional<std::string> text(std::string_view key, std::string_view meaning);
  // A non-negative decimal (or 0x hexadecimal) integer that fits 64 bits.
  std::optional<std::uint64_t> unsigned_integer(std::string_view key, std::string_view meaning);
  // The "device" option of a backend with exactly one device: "0" or absent.
  void single_device();

  // Throws Unsupported naming any key no call above asked for.
  void finish() const;

  // Unsupported: "backend opencl: option device='x': <why>".
  [[noreturn]] void refuse(std::string_view key, std::string_view value, std::string_view why) const;

 private:
  std::string backend_;
  const BackendOptions& options_;
  std::vector<std::pair<std::string, std::string>> taken_;  // key and meaning, for the refusal
};

}  // namespace devbridge::detail
