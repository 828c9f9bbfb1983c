// Test controls of the OpenCL backend that the public header
// (devbridge/backends/opencl.hpp) does not carry: its own tests reach them
// through src/, like the error table.
#pragma once

#include <cstdint>

#include "devbridge/backend.hpp"

namespace devbridge::opencl::detail {

// Host memory registered (register_host) and not yet unregistered. Kept
// apart from live_allocations, which counts device buffers only: a
// registration is the caller's memory, and tests of the pool and of
// restarts count device buffers alone.
std::uint64_t live_registrations(const Backend& backend);

}  // namespace devbridge::opencl::detail
