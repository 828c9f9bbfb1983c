// What the host backend reads about the machine it runs on: the CPU's name,
// memory totals and errno spellings for messages.
#pragma once

#include <cstdint>
#include <string>

namespace devbridge::host::detail {

struct MemoryInfo {
  std::uint64_t total = 0;      // bytes, 0 when unknown
  std::uint64_t available = 0;  // bytes, 0 when unknown
  std::string problem;          // why the figures are missing, empty when they are not
};

// /proc/meminfo (MemTotal, MemAvailable), else sysinfo(2).
MemoryInfo read_memory_info();

// /proc/cpuinfo "model name" (or the ARM spellings), else "<machine> CPU"
// from uname(2).
std::string cpu_model_name();

// "ENOMEM (Cannot allocate memory)".
std::string describe_errno(int error);

// "64 MiB", "4096 bytes".
std::string format_bytes(std::uint64_t bytes);

}  // namespace devbridge::host::detail
