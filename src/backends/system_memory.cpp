#include "backends/system_memory.hpp"

#include <sys/sysinfo.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "devbridge/checked.hpp"
#include "devbridge/error.hpp"

namespace devbridge::detail {

namespace {

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

double gib(std::uint64_t bytes) { return static_cast<double>(bytes) / static_cast<double>(1ull << 30); }

}  // namespace

MemoryInfo read_memory_info() {
  MemoryInfo info;
  std::ifstream meminfo("/proc/meminfo");
  bool have_total = false;
  bool have_available = false;
  bool have_swap = false;
  if (meminfo) {
    for (std::string line; std::getline(meminfo, line);) {
      have_total = have_total || parse_meminfo_line(line, "MemTotal", info.total);
      have_available = have_available || parse_meminfo_line(line, "MemAvailable", info.available);
      have_swap = have_swap || parse_meminfo_line(line, "SwapFree", info.swap_free);
    }
  }
  if (have_total && have_available && have_swap) return info;

  struct sysinfo si {};
  if (sysinfo(&si) != 0) {
    if (!have_total || !have_available)
      info.problem = fmt::format("memory unknown: /proc/meminfo unreadable and sysinfo failed: {}",
                                 std::strerror(errno));
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
  if (!have_swap) info.swap_free = checked::mul(si.freeswap, unit).value_or(UINT64_MAX);
  return info;
}

void check_the_machine_can_back(std::uint64_t mapped, std::string_view call, std::uint64_t asked) {
  const MemoryInfo memory = read_memory_info();
  if (!memory.problem.empty() || memory.available == 0) return;
  const std::uint64_t can_back = checked::add(memory.available, memory.swap_free).value_or(UINT64_MAX);
  if (mapped <= can_back) return;
  throw Error(ErrorKind::AllocationFailed,
              fmt::format("{} of {} bytes: the machine has {} bytes ({:.1f} GiB) to back it ({:.1f} GiB of memory available and "
                          "{:.1f} GiB of free swap, of {:.1f} GiB in all); mapped anyway, the process would be killed "
                          "as its pages were used",
                          call, asked, can_back, gib(can_back), gib(memory.available), gib(memory.swap_free),
                          gib(memory.total)));
}

}  // namespace devbridge::detail
