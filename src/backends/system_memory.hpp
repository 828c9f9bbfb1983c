// The machine's memory, for the backends whose "device" memory is host
// memory (host, fake): what there is, and the refusal of an allocation the
// machine cannot back.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace devbridge::detail {

struct MemoryInfo {
  std::uint64_t total = 0;      // bytes, 0 when unknown
  std::uint64_t available = 0;  // bytes, 0 when unknown
  std::uint64_t swap_free = 0;  // bytes, 0 when unknown or none
  std::string problem;          // why the figures are missing, empty when they are not
};

// /proc/meminfo (MemTotal, MemAvailable, SwapFree), else sysinfo(2).
MemoryInfo read_memory_info();

// Allocations this large or larger are checked against the machine's memory
// (reading /proc costs microseconds; a smaller one is any program's malloc).
inline constexpr std::uint64_t kMemoryCheckFrom = 64ull << 20;

// Throws AllocationFailed, naming the call ("host backend: allocate") and the
// bytes its caller asked for, when `mapped` (what the call would map: `asked`
// rounded up) is more than the machine can back now: its available memory
// plus free swap. The kernel would map it (overcommit), and the process would
// be killed once its pages were touched (mlock touches them all at once).
// Below kMemoryCheckFrom nothing is read; nothing is refused when the figures
// are unknown.
// (The check itself is out of line: most allocations never reach it.)
[[gnu::cold]] void check_the_machine_can_back(std::uint64_t mapped, std::string_view call, std::uint64_t asked);

inline void refuse_more_than_the_machine_has(std::uint64_t mapped, std::string_view call, std::uint64_t asked) {
  if (mapped >= kMemoryCheckFrom) check_the_machine_can_back(mapped, call, asked);
}

}  // namespace devbridge::detail
