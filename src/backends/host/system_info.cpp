#include "backends/host/system_info.hpp"

#include <sys/sysinfo.h>
#include <sys/utsname.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
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

// "MemTotal:       24683392 kB" -> bytes; false when the line is not `key`.
bool parse_meminfo_line(std::string_view line, std::string_view key, std::uint64_t& bytes) {
  if (line.substr(0, key.size()) != key || line.size() <= key.size() || line[key.size()] != ':') return false;
  std::istringstream in{std::string(line.substr(key.size() + 1))};
  std::uint64_t value = 0;
  std::string unit;
  if (!(in >> value)) return false;
  in >> unit;
  bytes = unit == "kB" ? checked::mul(value, 1024).value_or(UINT64_MAX) : value;  // saturates, never wraps
  return true;
}

}  // namespace

MemoryInfo read_memory_info() {
  MemoryInfo info;
  std::ifstream meminfo("/proc/meminfo");
  bool have_total = false;
  bool have_available = false;
  if (meminfo) {
    for (std::string line; std::getline(meminfo, line);) {
      have_total = have_total || parse_meminfo_line(line, "MemTotal", info.total);
      have_available = have_available || parse_meminfo_line(line, "MemAvailable", info.available);
    }
  }
  if (have_total && have_available) return info;

  struct sysinfo si {};
  if (sysinfo(&si) != 0) {
    info.problem = "memory unknown: /proc/meminfo unreadable and sysinfo failed: " + describe_errno(errno);
    return info;
  }
  const std::uint64_t unit = si.mem_unit == 0 ? 1 : si.mem_unit;
  // Figures that do not fit in 64 bits saturate.
  if (!have_total) info.total = checked::mul(si.totalram, unit).value_or(UINT64_MAX);
  // Without MemAvailable, free plus buffers is the closest sysinfo offers.
  if (!have_available) {
    const auto pages = checked::add(si.freeram, si.bufferram);
    info.available = pages ? checked::mul(*pages, unit).value_or(UINT64_MAX) : UINT64_MAX;
  }
  return info;
}

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
