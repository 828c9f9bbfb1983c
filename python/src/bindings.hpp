// What the binding files share. Each Python class, or group of module
// functions, is bound by one bind_* function in its own file; module.cpp
// calls them in the order the module has always defined its names. Only what
// crosses files is here: objects that one class hands out and another binds
// (Bridge.ring, Bridge.fake, Bridge.view), and conversions more than one
// binding takes, so each is written once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <variant>

#include <nanobind/nanobind.h>
// The type casters the module has always bound with, in every binding file,
// so a std::string, std::vector or std::optional converts the same wherever
// its class is bound.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "devbridge/backend.hpp"
#include "devbridge/backends/fake.hpp"
#include "devbridge/bridge.hpp"
#include "lent_views.hpp"
#include "state.hpp"

namespace devbridge::python {

struct PyHostRing {
  std::shared_ptr<BridgeState> state;
};

struct PyFake {
  std::shared_ptr<BridgeState> state;
  fake::FakeBackend& backend() const { return *state->fake; }
};

// ---- conversions more than one binding takes ----
// value_types.cpp
std::string lower(std::string text);
DType parse_dtype(nanobind::handle object);
std::string handle_repr(const DeviceHandle& h);
// module.cpp
nanobind::dict backend_info_dict(const BackendInfo& info);
// views.cpp
nanobind::object tinygrad_helper(const char* name);
// transfer.cpp
// The state of `bridge`, a devbridge.Bridge (TypeError naming `what` otherwise).
std::shared_ptr<BridgeState> state_of(nanobind::handle bridge, const char* what);

// A view and the lease that keeps its allocation alive. The metadata stays
// readable after close(); the address does not.
struct PyTensorView {
  std::shared_ptr<BridgeState> state;
  ViewLease lease;  // survives close(): the memory stays valid until it ends
  TensorView meta;
  std::string device;  // meta.device points into the backend; keep our own copy
  ViewSpec spec;       // what the caller asked for, to take further leases

  // A consumer's queue (DLPack numbering) the lease ends after, set by a
  // hand-off to a consumer that computes on its own queue (tinygrad).
  std::optional<std::uintptr_t> end_after_queue;

  PyTensorView() = default;
  PyTensorView(PyTensorView&&) noexcept = default;
  PyTensorView& operator=(PyTensorView&&) noexcept = default;
  ~PyTensorView() { close(); }

  bool closed() const { return !lease; }

  // The lease is live and belongs to the bridge's current generation: a
  // restart retires the allocation under a view from before it.
  void check_usable(const char* what) const {
    if (closed()) throw Error(ErrorKind::Closed, std::string(what) + ": the view is closed");
    Generation current = state->open().generation();
    if (meta.handle.generation != current)
      throw Error(ErrorKind::OldGenerationHandle,
                  std::string(what) + ": the view's " + handle_repr(meta.handle) +
                      " is from generation " + std::to_string(meta.handle.generation) +
                      "; the bridge restarted into generation " + std::to_string(current));
  }

  void close() noexcept {
    if (lease) note_lease_end_stack();
    if (end_after_queue && lease)
      end_lease_after(lease, *end_after_queue);
    else
      lease.reset();
  }
  // Ends the lease once `queue` has run what was enqueued on it so far.
  void close_after(std::uintptr_t queue) {
    // Even on a closed bridge: the lease holds the memory, and refusing here
    // left it to end later with no fence, freed while `queue` may still read it.
    note_lease_end_stack();
    GilReleased no_gil;
    lease.end_after(ConsumerQueue{queue});
  }
};

// Bridge.view's arguments, parsed where the rest of a view's are.
ViewSpec parse_view_spec(nanobind::handle dtype, nanobind::handle shape, nanobind::handle strides,
                         nanobind::handle offset);
// Another lease of `view`'s (ViewLease::share), for a consumer it is handed
// to: it holds the memory even once the tensor the view came from is freed.
// Closed where the view's lease has ended.
ViewLease share_lease(const PyTensorView& view, const char* what);
PyTensorView make_view(const std::shared_ptr<BridgeState>& state, DeviceHandle handle, const ViewSpec& spec,
                       ViewWait wait);

// A buffer export (PyObject_GetBuffer) held for as long as this lives:
// TypeError naming `what` when the object has no buffer protocol; the
// exporter's own error (BufferError) when it refuses `flags`.
class HeldBuffer {
 public:
  HeldBuffer(nanobind::handle object, int flags, const std::string& what);
  ~HeldBuffer() { reset(); }
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;
  const Py_buffer& view() const noexcept { return view_; }
  // Ends the export now (with the GIL).
  void reset() noexcept;
  // Hands the export to the caller, who releases it (PyBuffer_Release).
  Py_buffer take() noexcept;

 private:
  Py_buffer view_{};
  bool held_ = false;
};
// The layout of an exported buffer's elements (strides in bytes, as the
// buffer protocol and numpy give them).
CopyLayout buffer_layout(const Py_buffer& view, std::uint64_t device_pitch);

// copy_layout.cpp
// Bridge copies' layout= argument: a CopyLayout, or None for a plain copy
// (TypeError for anything else).
std::optional<CopyLayout> parse_layout(nanobind::handle layout);
std::string layout_repr(const CopyLayout& layout);

// host_regions.cpp
// The host side of a copy: a ring range (HostRange) or a range of a
// registered region (RegionRange), as host_to_device / device_to_host take
// it; TypeError for anything else.
struct CopyHost {
  HostSide range;
  std::uint64_t len() const {
    return std::visit([](const auto& r) { return r.len; }, range);
  }
};
CopyHost parse_copy_host(nanobind::handle range);
// Bridge.register_host / unregister_host.
nanobind::object register_host(const std::shared_ptr<BridgeState>& state, nanobind::handle object, bool writable);
void unregister_host(const std::shared_ptr<BridgeState>& state, nanobind::handle region);
// Bridge.adopt_host: a RegionRange or a whole HostRegion (TypeError else).
DeviceHandle adopt_host(const std::shared_ptr<BridgeState>& state, nanobind::handle range, const ObjectSpec& spec);

// recorder.cpp: the flight recorder's entry points (Bridge.record,
// dump_trace, trace, memory_snapshot), and the Python stack a call attaches
// to what it records when recording with stacks (BridgeState::open).
void record(BridgeState& state, nanobind::handle max_events, nanobind::handle stacks, nanobind::handle oom_dump_dir);
void dump_trace(BridgeState& state, nanobind::handle path);
nanobind::object trace(BridgeState& state);
// layout: "devbridge" (docs/TRACING.md) or "torch" (PyTorch's memory_viz;
// devbridge/_memory_viz.py); anything else is a TypeError or ValueError.
nanobind::object memory_snapshot(BridgeState& state, nanobind::handle layout);

// ---- one per class or area, in the order module.cpp calls them ----
void bind_errors(nanobind::module_& m);             // errors.cpp
void bind_module_functions(nanobind::module_& m);   // module.cpp
void bind_value_types(nanobind::module_& m);        // value_types.cpp
void bind_ring(nanobind::module_& m);               // ring.cpp
void bind_views(nanobind::module_& m);              // views.cpp
void bind_fake_controls(nanobind::module_& m);      // fake_controls.cpp
void bind_copy_layout(nanobind::module_& m);        // copy_layout.cpp
void bind_host_regions(nanobind::module_& m);       // host_regions.cpp
void bind_bridge(nanobind::module_& m);             // bridge.cpp
void bind_checkpoint_file(nanobind::module_& m);    // checkpoint_file.cpp
void bind_transfer(nanobind::module_& m);           // transfer.cpp
void bind_lent_views(nanobind::module_& m);         // lent_views.cpp

}  // namespace devbridge::python
