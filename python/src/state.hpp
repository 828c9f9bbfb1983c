// Shared state of the Python bindings: one BridgeState per devbridge.Bridge,
// shared by the Python objects that call into the bridge (the bridge, its
// ring, its fake controls, tensor views, ring buffers).
//
// One lifetime mechanism: leases. Memory handed to a consumer that may
// outlive the bridge is held by a lease of the C++ bridge, never by counting
// here: a ring buffer export (a memoryview, a numpy array over the ring)
// holds a HostLease, a view, DLPack capsule or tinygrad tensor a ViewLease.
// close() closes the C++ bridge at once: every call blocked in it (a wait, a
// view waiting for copies, a wait for room) and every later call fails with
// Closed; the memory under live leases stays valid until each lease ends
// (the C++ bridge frees it then, with or without the GIL).
//
// The one exception runs the other way: a caller's buffer registered with the
// bridge (Bridge.register_host) is memory the bindings must keep from its
// owner, not from the bridge. Its buffer export stays in `registrations` until
// the C++ bridge has let go of the memory (host_regions.cpp).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>

#include "devbridge/bridge.hpp"
#include "devbridge/checked.hpp"
#include "devbridge/backends/fake.hpp"
#include "devbridge/error.hpp"
#include "devbridge/wait_check.hpp"
#include "forks.hpp"
#include "gil.hpp"

namespace devbridge::python {

// One registration of a caller's buffer (Bridge.register_host): the held
// buffer export and the C++ region. Defined in host_regions.cpp.
struct HostRegistration;

// Sets this thread's TraceStack to the interpreter's current stack (recorder.cpp).
void annotate_call_stack() noexcept;
// The same for a lease that ends outside any call through BridgeState::open
// (a view's close or collection, a DLPack consumer's deleter): noted afresh
// when this thread's calls carry stacks, so that what the end records (a
// deferred free) names where it ended, not the thread's last call.
void note_lease_end_stack() noexcept;

struct BridgeState {
  std::unique_ptr<Bridge> bridge;
  // A process forked from the one that made the bridge inherits its memory
  // but neither its copy threads nor its device context: there it is never
  // used, closed or torn down (joining threads it does not have crashed).
  const std::uint64_t made_after_forks = forks_so_far();
  bool inherited_by_fork() const noexcept { return forks_so_far() != made_after_forks; }
  [[noreturn]] void fail_inherited_by_fork() const;
  fake::FakeBackend* fake = nullptr;  // set when the backend is the fake one; owned by `bridge`
  std::string backend_name;
  std::string device;  // "<backend>:<device_id>", the device the bridge binds (storage identity)
  // The backend's capabilities the bindings show or hand on, read once
  // (BackendCapabilities).
  bool host_addressable = false;
  bool cheap_registration = false;
  std::uint64_t native_context = 0;  // for a consumer's view (_native_context)
  // Set by close() before the C++ bridge closes, so accessors the C++ bridge
  // answers without checking (ring_capacity) refuse as well.
  std::atomic<bool> closed{false};
  // Buffers registered with the bridge whose export the bindings still hold:
  // each is let go only once the C++ bridge no longer lets the device touch
  // it (an unregister, a restart or close that succeeded). Read and changed
  // with the GIL held only.
  std::vector<std::shared_ptr<HostRegistration>> registrations;

  // The bridge, unless close() was called. The C++ bridge refuses on its own
  // too (a call that passed this check while close() ran gets Closed there).
  // Every call into the bridge comes here first, with the GIL: when the
  // bridge records stacks, the caller's Python stack is attached to what
  // the call records (recorder.cpp).
  Bridge& open() const {
    if (closed.load(std::memory_order_acquire)) throw Error(ErrorKind::Closed, "the bridge is closed");
    if (inherited_by_fork()) [[unlikely]]
      fail_inherited_by_fork();
    if (interpreter_exiting()) [[unlikely]]
      stop_at_exit_door();
    if (bridge->records_stacks()) [[unlikely]]
      annotate_call_stack();
    return *bridge;
  }

  // With the GIL, for a call that does not pass through open() (close): its
  // Python stack for what it records, when the bridge records stacks; the
  // last call's stack stayed in effect and named the wrong line.
  void note_call_stack() const {
    if (!inherited_by_fork() && bridge->records_stacks()) [[unlikely]]
      annotate_call_stack();
  }

  // Python's close(): wakes every blocked caller with Closed, frees what no
  // lease holds. Call without the GIL. Repeating it retries a close whose
  // quiesce failed. A close refused before it began (AllocationStillInUse:
  // called from inside the bridge's own in-place callback) leaves the
  // bridge open.
  void close() {
    closed.store(true, std::memory_order_release);
    if (inherited_by_fork()) return;  // the parent's to close: here only refused from now on
    try {
      bridge->close();
    } catch (const Error& error) {
      if (error.kind() == ErrorKind::AllocationStillInUse) closed.store(false, std::memory_order_release);
      throw;
    }
  }

  ~BridgeState();
};

// The buffers the C++ bridge let go of, handed back to their objects: after
// a restart that succeeded (regions of older generations), after a close
// that succeeded (all). With the GIL.
void release_regions_after_restart(BridgeState& state);
void release_regions_after_close(BridgeState& state);
// Lets go of buffers the C++ bridge no longer holds since: a HostRegion
// dropped while a copy or an adoption used it, a region retained past a
// restart or close for an adopted allocation a view read. With the GIL.
void reap_released_regions(BridgeState& state);

// Takes a lease on `handle` described by `spec`. Releases the GIL while the
// bridge waits for copies into the allocation (ViewWait::Wait); close() wakes
// that wait with Closed.
ViewLease acquire_lease(const std::shared_ptr<BridgeState>& state, DeviceHandle handle, const ViewSpec& spec,
                        ViewWait wait);

// Ends `lease` once the consumer's queue (DLPack numbering) has run the work
// enqueued on it so far. Where the backend's consumers have no queues it ends
// at once; where the fence cannot be recorded (a faulted device) the memory
// is kept for good, never freed under work that may still read it. Any
// thread, with or without the GIL.
void end_lease_after(ViewLease& lease, std::uintptr_t queue) noexcept;

// A blocking call made in slices of at most 100 ms (the GIL released in
// each), running Python's signal handlers between them, so Ctrl-C ends it
// with KeyboardInterrupt even when what it waits for never comes (a hung
// copy, room nobody gives back). `attempt(slice, last)` returns the result
// once there is one, nothing to go on waiting; `last` marks the slice that
// reaches the caller's `limit` (nothing: no limit), which must return or throw.
template <class Attempt>
auto wait_interruptibly(std::optional<std::chrono::nanoseconds> limit, Attempt attempt) {
  constexpr std::chrono::nanoseconds kSlice = std::chrono::milliseconds(100);
  const auto deadline = limit ? checked::deadline_after(*limit) : checked::Clock::time_point::max();
  for (;;) {
    const std::chrono::nanoseconds left = checked::time_left(deadline);
    const bool last = left <= kSlice;
    {
      GilReleased no_gil;
      if (auto done = attempt(last ? left : kSlice, last)) return std::move(*done);
    }
    if (PyErr_CheckSignals() != 0) throw nanobind::python_error();
  }
}

// Runs Python's signal handlers from a thread inside a blocking call (the
// GIL taken for it): what a handler raises (Ctrl-C's KeyboardInterrupt) is
// thrown, to end the wait. A transfer's while_waiting and a WaitCheck call it.
inline void look_for_signals() {
  GilTaken gil;
  if (PyErr_CheckSignals() != 0) throw nanobind::python_error();
}

// How often a bridge call waiting without an end of its own runs Python's signal handlers.
inline constexpr std::chrono::milliseconds kSignalsEvery{100};

// Around a bridge call that may wait with no end of its own (room for a copy
// under wait_for_room=math.inf, views to end under writes_under_view "wait",
// uploads into a viewed allocation): the GIL released, and Ctrl-C ends the
// wait with KeyboardInterrupt, the call having taken nothing (WaitCheck).
struct InterruptibleCall {
  GilReleased no_gil;
  WaitCheck interruptible{look_for_signals, kSignalsEvery};
};

// Sets the Python error for a C++ exception the way the module's exception
// translator does (for raw CPython slots, which nanobind does not wrap).
void set_python_error(const std::exception& error) noexcept;

// ---- the DLPack export (dlpack_export.cpp) ----
// The DLPack version a versioned capsule claims.
struct DLPackAbi {
  std::uint32_t major = 1;
  std::uint32_t minor = 0;
};
// A capsule that owns `lease` (a share of the exporting view's,
// ViewLease::share): "dltensor_versioned" when `versioned` is set, else the
// unversioned "dltensor".
// `consumer_stream`: the stream the consumer named (DLPack numbering); the
// lease then ends after it (end_lease_after).
// `copy` (DLPack's copy=True, host memory only, else BufferError): the
// capsule owns a row-major copy of the view's bytes and no lease.
nanobind::object make_dlpack_capsule(ViewLease lease, std::optional<DLPackAbi> versioned,
                                     std::optional<std::uintptr_t> consumer_stream, bool copy = false);

}  // namespace devbridge::python
