// The host (CPU) backend, the default: device memory is aligned host memory,
// asynchronous copies and launches run on an engine of three queues (one
// thread per copy direction and one for launches, each in submission order),
// so the whole worker runs on a machine without a GPU, with the same
// "a launch is done at its fence, not at its return" as one.
// Device string "CPU", as tinygrad names it.
#pragma once

#include <cstdint>
#include <memory>

#include "devbridge/backend.hpp"

namespace devbridge::host {

struct Options {
  // An async copy of at most this many bytes, submitted while its
  // direction's engine thread has nothing queued and no queued copy touches
  // its bytes, runs at once on the submitting thread; its completion is still
  // reported through drain_completions, exactly as if the engine had run it.
  // Handing a small copy to another core costs more than the copy (a 4 KiB
  // memcpy is ~0.1 us; one cache-line round trip between cores is 0.3-0.8 us
  // on a small VM). A launch writing at most this many bytes runs inline on
  // the same terms (its queue idle, nothing queued on its bytes) and returns
  // the passed fence. Never while held. 0: every async copy and every launch
  // goes to the engine threads.
  std::uint64_t inline_async_max_bytes = 16 << 10;
};

std::unique_ptr<Backend> make_host_backend(const Options& options = {});
// From text (the registry's form): device ("0", the one device),
// inline_async_max_bytes (as Options).
std::unique_ptr<Backend> make_host_backend(const BackendOptions& options);

// Test controls (Backend::test_controls, devbridge/test_controls.hpp):
// live_allocations; live_bytes, the bytes of those allocations as asked (what
// the host backend holds for device memory, the bridge's pool included);
// live_host_blocks; and hold_copies: while held, the engine starts no new
// asynchronous copy or launch; queued work stays in flight and launches'
// fences pending. quiesce() (and so Bridge::restart/close) lifts the hold
// and finishes the work. A sync copy that must order after held work waits
// until the hold is lifted.

}  // namespace devbridge::host
