#include "backends/host/system_info.hpp"

#include <sys/utsname.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string_view>

#include "devbridge/checked.hpp"

namespace devbridge::host::detail {

namespace {

std::string_view trim(std::string_view s) {
  const auto first = s.find_first_not_of(" \t");
  if (first == std::string_view::npos) return {};
  const auto last = s.find_last_not_of(" \t\r\n");
  return s.substr(first, last - first + 1);
}

}  // namespace

std::string cpu_model_name() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  if (cpuinfo) {
    // x86 says "model name"; ARM kernels say "Model" or "Hardware".
    static constexpr std::string_view kKeys[] = {"model name", "Model", "Hardware", "cpu model"};
    std::string fallback;
    for (std::string line; std::getline(cpuinfo, line);) {
      const auto colon = line.find(':');
      if (colon == std::string::npos) continue;
      const auto key = trim(std::string_view(line).substr(0, colon));
      const auto value = trim(std::string_view(line).substr(colon + 1));
      if (value.empty()) continue;
      if (key == kKeys[0]) return std::string(value);
      for (auto other : kKeys) {
        if (key == other && fallback.empty()) fallback = std::string(value);
      }
    }
    if (!fallback.empty()) return fallback;
  }
  struct utsname names {};
  if (uname(&names) == 0) return std::string(names.machine) + " CPU";
  return "unknown CPU (uname: " + describe_errno(errno) + ")";
}

std::string describe_errno(int error) {
  const char* name = strerrorname_np(error);
  std::string text = name != nullptr ? name : "errno " + std::to_string(error);
  text += " (";
  text += std::strerror(error);
  text += ")";
  return text;
}

std::string format_bytes(std::uint64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024 || bytes % 1024 != 0) return std::to_string(bytes) + " bytes";
  std::uint64_t value = bytes / 1024;
  int unit = 0;
  while (unit + 1 < 4 && value >= 1024 && value % 1024 == 0) {
    value /= 1024;
    ++unit;
  }
  return std::to_string(value) + " " + kUnits[unit];
}

}  // namespace devbridge::host::detail
