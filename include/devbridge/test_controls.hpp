// Test controls: what tests reach behind the seam to observe a backend and
// steer it (leak counts, holding copies, the fake's scripting and fault
// injection). One accessor reaches them, Backend::test_controls(); it returns
// null for a backend without any. Production paths never call it: the
// conformance suite, the backends' own suites, the model harness, the Python
// module's FakeControl and the CLI's --fake options do.
//
// What a backend lacks it says when asked: a count it does not keep is
// std::nullopt, can_hold_copies() is false where copies cannot be held, and
// fake() is null for every backend but the fake.
#pragma once

#include <cstdint>
#include <optional>

#include "devbridge/error.hpp"

namespace devbridge {

namespace fake {
class FakeBackend;
}

class TestControls {
 public:
  // Device allocations made and not yet freed (whole allocations: parts and
  // adopted host memory are not counted). A restart or close of the bridge
  // must bring it to 0, less what the bridge's pool keeps.
  virtual std::uint64_t live_allocations() const = 0;
  // Bytes of those allocations, as asked: what the backend holds for device
  // memory, the bridge's pool included. The host backend counts them.
  virtual std::optional<std::uint64_t> live_bytes() const { return std::nullopt; }
  // Host (ring) blocks allocated and not yet freed.
  virtual std::optional<std::uint64_t> live_host_blocks() const { return std::nullopt; }
  // Host memory registered (register_host) and not yet unregistered; kept
  // apart from live_allocations, which counts device memory only.
  virtual std::optional<std::uint64_t> live_registrations() const { return std::nullopt; }
  // Fences handed out (launch_axpy, record_fence) and not yet released.
  virtual std::optional<std::uint64_t> live_fences() const { return std::nullopt; }

  // Whether hold_copies works on this backend.
  virtual bool can_hold_copies() const noexcept { return false; }
  // While held, asynchronous copies and launches submitted from now on stay
  // pending (copies do not complete, fences on the backend's own queues do
  // not pass), so a test can observe the "pending" side of every rule
  // deterministically. quiesce() (and so Bridge::restart and close) lifts
  // the hold and finishes the work. A sync copy that must order after held
  // work waits until the hold is lifted. Error(Unsupported) where
  // can_hold_copies() is false.
  virtual void hold_copies(bool hold) {
    (void)hold;
    throw Error(ErrorKind::Unsupported, "this backend cannot hold copies (a test control)");
  }

  // The fake's own controls (scripted completions, fault injection, call
  // records, fences held and signalled): the fake itself, null for every
  // other backend.
  virtual fake::FakeBackend* fake() noexcept { return nullptr; }

 protected:
  TestControls() = default;
  TestControls(const TestControls&) = default;
  TestControls& operator=(const TestControls&) = default;
  ~TestControls() = default;  // owned by its backend, never deleted through this
};

}  // namespace devbridge
