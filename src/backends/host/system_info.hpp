// What the host backend reads about the machine it runs on: the CPU's name
// and errno spellings for messages (its memory: backends/system_memory.hpp).
#pragma once

#include <cstdint>
#include <string>

namespace devbridge::host::detail {

// /proc/cpuinfo "model name" (or the ARM spellings), else "<machine> CPU"
// from uname(2).
std::string cpu_model_name();

// "ENOMEM (Cannot allocate memory)".
std::string describe_errno(int error);

// "64 MiB", "4096 bytes".
std::string format_bytes(std::uint64_t bytes);

}  // namespace devbridge::host::detail
