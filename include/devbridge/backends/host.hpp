// The host (CPU) backend, the default: device memory is aligned host memory,
// asynchronous copies run on a copy engine (one thread per direction, in
// submission order), so the whole worker runs on a machine without a GPU.
// Device string "CPU", as tinygrad names it.
#pragma once

#include <cstdint>
#include <memory>

#include "devbridge/backend.hpp"

namespace devbridge::host {

std::unique_ptr<Backend> make_host_backend();

// ---- observation and test controls ----
// Each throws Error(Unsupported) when `backend` is not a host backend.

// Device allocations made and not yet freed. Tests use it to prove that a
// restart or close leaks nothing.
std::uint64_t live_allocations(const Backend& backend);
// Host (ring) blocks allocated and not yet freed.
std::uint64_t live_host_blocks(const Backend& backend);

// While held, the copy engine starts no new asynchronous copy; queued copies
// stay in flight, so a test can observe the "pending" side of every rule
// deterministically. quiesce() (and so Bridge::restart/close) lifts the hold
// and finishes the work. A sync copy or launch that must order after a held
// copy waits until the hold is lifted.
void hold_copies(Backend& backend, bool hold);

}  // namespace devbridge::host
