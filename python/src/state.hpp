// Shared state of the Python bindings: one BridgeState per devbridge.Bridge,
// shared by every Python object that can reach the bridge's memory (the host
// ring's buffers, tensor views, DLPack capsules, tinygrad tensors).
//
// Why the export count: Bridge::close() frees the host ring and the device
// allocations. A numpy array over a ring buffer, or a tinygrad tensor over a
// view, would then read freed memory. So Python's close() closes the C++
// bridge only once nothing exported is alive; until then the bridge refuses
// every call with Closed, exactly as if it were closed, and the memory stays
// valid for what was exported. The last export to go finishes the close.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <nanobind/nanobind.h>

#include "devbridge/bridge.hpp"
#include "devbridge/backends/fake.hpp"
#include "devbridge/error.hpp"

namespace devbridge::python {

struct BridgeState {
  std::unique_ptr<Bridge> bridge;
  fake::FakeBackend* fake = nullptr;  // set when the backend is the fake one; owned by `bridge`
  std::string backend_name;

  std::atomic<std::int64_t> exports{0};
  std::atomic<bool> close_requested{false};
  std::once_flag close_once;

  // The bridge, unless close() was asked for.
  Bridge& open() const {
    if (close_requested.load()) throw Error(ErrorKind::Closed, "the bridge is closed");
    return *bridge;
  }

  // Python's close(): from now on every call fails with Closed; the C++
  // bridge closes now, or when the last export ends.
  void request_close() {
    close_requested.store(true);
    if (exports.load() == 0) finish_close();
  }

  void finish_close() {
    std::call_once(close_once, [this] { bridge->close(); });
  }

  void finish_close_noexcept() noexcept {
    try {
      finish_close();
    } catch (...) {
      // Called from destructors (a DLPack deleter, a buffer release): the
      // bridge's own destructor closes again and has the last word.
    }
  }

  ~BridgeState() {
    // ~Bridge closes, quiescing the backend; nothing in it needs the GIL.
    bridge.reset();
  }
};

// Counts one export of `state` for as long as it lives. Movable.
class ExportGuard {
 public:
  ExportGuard() = default;
  explicit ExportGuard(std::shared_ptr<BridgeState> state) : state_(std::move(state)) {
    state_->exports.fetch_add(1);
  }
  ExportGuard(ExportGuard&& other) noexcept = default;
  ExportGuard& operator=(ExportGuard&& other) noexcept {
    if (this != &other) {
      reset();
      state_ = std::move(other.state_);
    }
    return *this;
  }
  ExportGuard(const ExportGuard&) = delete;
  ExportGuard& operator=(const ExportGuard&) = delete;
  ~ExportGuard() { reset(); }

  void reset() noexcept {
    std::shared_ptr<BridgeState> state = std::move(state_);
    state_.reset();
    if (!state) return;
    if (state->exports.fetch_sub(1) == 1 && state->close_requested.load()) state->finish_close_noexcept();
  }
  const std::shared_ptr<BridgeState>& state() const noexcept { return state_; }

 private:
  std::shared_ptr<BridgeState> state_;
};

// A view lease counted as an export. The lease ends before the count drops,
// so a deferred close never frees memory under a lease.
struct HeldLease {
  ExportGuard guard;
  ViewLease lease;

  HeldLease() = default;
  HeldLease(HeldLease&&) noexcept = default;
  HeldLease& operator=(HeldLease&& other) noexcept {
    if (this != &other) {
      reset();
      guard = std::move(other.guard);
      lease = std::move(other.lease);
    }
    return *this;
  }
  ~HeldLease() { reset(); }
  void reset() noexcept {
    lease.reset();
    guard.reset();
  }
  explicit operator bool() const noexcept { return static_cast<bool>(lease); }
};

// Takes a lease on `handle` described by `spec`. Releases the GIL while the
// bridge waits for copies into the allocation (ViewWait::Wait).
HeldLease acquire_lease(const std::shared_ptr<BridgeState>& state, DeviceHandle handle, const ViewSpec& spec,
                        ViewWait wait);

// Sets the Python error for a C++ exception the way the module's exception
// translator does (for raw CPython slots, which nanobind does not wrap).
void set_python_error(const std::exception& error) noexcept;

// ---- the DLPack export (dlpack_export.cpp) ----
// The DLPack version a versioned capsule claims.
struct DLPackAbi {
  std::uint32_t major = 1;
  std::uint32_t minor = 0;
};
// A capsule over a new lease on the view (taken once copies into the
// allocation completed): "dltensor_versioned" when `versioned` is set, else
// the unversioned "dltensor".
nanobind::object make_dlpack_capsule(const std::shared_ptr<BridgeState>& state, DeviceHandle handle,
                                     const ViewSpec& spec, std::optional<DLPackAbi> versioned);

// ---- the host ring's buffer-protocol object (ring_buffer.cpp) ----
struct RingBuffer {
  std::shared_ptr<BridgeState> state;
  HostRange range;
};
void bind_ring_buffer(nanobind::module_& m);

}  // namespace devbridge::python
