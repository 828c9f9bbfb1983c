// Bridge: one per (worker, device). Its backend options pass through to the
// registry as text, so no backend is named here.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>


#include <nanobind/nanobind.h>

#include "devbridge/backends.hpp"
#include "devbridge/backends/fake.hpp"
#include "devbridge/bridge.hpp"
#include "arguments.hpp"
#include "bindings.hpp"
#include "state.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace devbridge::python {

void BridgeState::fail_inherited_by_fork() const {
  throw Error(ErrorKind::Unavailable,
              "this bridge was made in the process this one was forked from: its copy threads and device context "
              "stayed there, so it cannot be used here. Make a Bridge in this process (multiprocessing: the "
              "\"spawn\" or \"forkserver\" start method, or a DataLoader's worker_init_fn)");
}

namespace {

[[noreturn]] void throw_unsupported(std::string message) {
  throw Error(ErrorKind::Unsupported, message);
}

CopyMode parse_mode(const std::string& mode) {
  std::string m = lower(mode);
  if (m == "async") return CopyMode::Async;
  if (m == "sync") return CopyMode::Sync;
  throw nb::value_error(("copy mode must be \"async\" or \"sync\", not \"" + mode + "\"").c_str());
}

// Seconds to wait for in-flight budget: 0 fails fast with Backpressure, a
// huge or infinite wait lasts until there is room (or close()).
Admission parse_admission(nb::handle wait_for_room) {
  return Admission{args::seconds(wait_for_room, "wait_for_room")};
}

const char* state_name(CopyState state) {
  switch (state) {
    case CopyState::Pending: return "pending";
    case CopyState::Completed: return "completed";
    case CopyState::Failed: return "failed";
  }
  return "unknown";
}

WritesUnderView parse_writes_under_view(nb::handle object) {
  if (!nb::isinstance<nb::str>(object))
    throw nb::type_error(("writes_under_view must be \"refuse\", \"wait\" or \"allow\", not " +
                          nb::cast<std::string>(nb::str(object.type().attr("__name__"))))
                             .c_str());
  const std::string name = nb::cast<std::string>(object);
  if (name == "refuse") return WritesUnderView::Refuse;
  if (name == "wait") return WritesUnderView::Wait;
  if (name == "allow") return WritesUnderView::Allow;
  throw nb::value_error(("writes_under_view must be \"refuse\", \"wait\" or \"allow\", not \"" + name + "\"").c_str());
}

nb::dict stats_dict(const BridgeStats& s) {
  nb::dict d;
  d["generation"] = s.generation;
  d["domain"] = s.domain;
  d["broken"] = s.broken;
  d["closed"] = s.closed;
  d["live_allocations"] = s.live_allocations;
  d["allocated_bytes"] = s.allocated_bytes;
  d["copies_submitted"] = s.copies_submitted;
  d["copies_completed"] = s.copies_completed;
  d["copies_failed"] = s.copies_failed;
  d["copies_in_flight"] = s.copies_in_flight;
  d["inflight_bytes"] = s.inflight_bytes;
  d["inflight_budget_bytes"] = s.inflight_budget_bytes;
  d["copy_records"] = s.copy_records;
  d["stale_completions"] = s.stale_completions;
  d["live_views"] = s.live_views;
  d["orphaned_allocations"] = s.orphaned_allocations;
  d["pending_fences"] = s.pending_fences;
  d["abandoned_fences"] = s.abandoned_fences;
  d["active_steps"] = s.active_steps;
  d["restarts"] = s.restarts;
  d["host_regions"] = s.host_regions;
  d["host_region_bytes"] = s.host_region_bytes;
  d["adopted_allocations"] = s.adopted_allocations;
  d["adopted_bytes"] = s.adopted_bytes;
  d["failed_records"] = s.failed_records;
  d["failed_records_evicted"] = s.failed_records_evicted;
  d["ring_capacity"] = s.ring_capacity;
  d["ring_used"] = s.ring_used;
  d["ring_reservations"] = s.ring_reservations;
  d["ring_releases_pending"] = s.ring_releases_pending;
  d["ring_wraps"] = s.ring_wraps;
  return d;
}

// Bridge.release_host_after and its alias release_when_safe: one C++ call (bind_bridge's release_host_after).
constexpr const char* kReleaseHostAfterDoc =
    "Returns `range` (exactly as ring.reserve gave it) to the ring once `event` says its host bytes may be\n"
    "released (an upload's safe_to_release_host, a download's host_bytes_valid, or the copy failed): nothing\n"
    "for the caller to poll. The bridge checks whenever it applies completions (wait, poll, copy_status, ...)\n"
    "and before ring.reserve looks for room, so a reserve waiting for room is woken by it; an event already\n"
    "settled releases at once. A failure stays the event's to observe (wait raises it). Refused, changing\n"
    "nothing: ForeignDomain / OldGenerationHandle / UnknownDeviceHandle for the event, InvalidRange for a\n"
    "range that is not a live reservation or already waits here. A restart releases the waiting ranges once\n"
    "the device is idle; close() drops them with the ring. stats()['ring_releases_pending'] counts them.";

// Every MemoryStats field under its name (for_each_field: the snapshot's "stats" too).
nb::dict memory_stats_dict(const MemoryStats& s) {
  nb::dict d;
  for_each_field(s, [&](const char* name, auto value) { d[name] = value; });
  return d;
}

// A backend option's value as the registry takes it (text). str and
// integers (anything with __index__: numpy's too, as every other integer
// argument) only: anything else would have to be guessed at.
std::string option_text(nb::handle value, const std::string& key) {
  if (nb::isinstance<nb::str>(value)) return nb::cast<std::string>(value);
  if (!nb::isinstance<nb::bool_>(value) && nb::hasattr(value, "__index__")) {
    const nb::object integer = nb::steal(PyNumber_Index(value.ptr()));
    if (!integer.is_valid()) throw nb::python_error();
    return nb::cast<std::string>(nb::str(integer));
  }
  const auto type_name = nb::cast<std::string>(nb::str(value.type().attr("__name__")));
  throw nb::type_error(("backend option " + key + " must be a str or an int, not " + type_name).c_str());
}

// Bridge(**options) into the registry's form. `device` and `context` are
// options like any other; cuda_ordinal and cuda_context are their older
// names. context="tinygrad" names tinygrad's own context (found in Python).
BackendOptions backend_options(nb::handle device, nb::handle cuda_ordinal, nb::handle cuda_context,
                               const nb::kwargs& extra) {
  BackendOptions options;
  for (auto [key, value] : extra) {
    const auto name = nb::cast<std::string>(key);
    if (!value.is_none()) options[name] = option_text(value, name);
  }
  const auto alias = [&](nb::handle value, const char* old_name, const char* name) {
    if (value.is_none()) return;
    if (options.count(name)) throw nb::value_error((std::string("give ") + name + " or " + old_name + ", not both").c_str());
    options[name] = option_text(value, old_name);
  };
  alias(device, "device", "device");
  alias(cuda_ordinal, "cuda_ordinal", "device");
  alias(cuda_context, "cuda_context", "context");
  if (const auto it = options.find("context"); it != options.end() && it->second == "tinygrad") {
    const auto ordinal = options.count("device") ? options["device"] : std::string("0");
    it->second = option_text(tinygrad_helper("cuda_context")("tinygrad", nb::int_(nb::str(ordinal.c_str()))), "context");
  }
  return options;
}

struct PyBridge {
  std::shared_ptr<BridgeState> state;
};

// host_to_device and device_to_host take the same arguments (in their own
// order) and check them in the same order: the Python types first, then the
// bridge's rules.
CopyEvent submit_copy(PyBridge& b, CopyDirection direction, nb::handle range, DeviceHandle h,
                      nb::handle offset_object, const std::string& mode, nb::handle wait_for_room,
                      nb::handle layout_object) {
  const CopyHost host = parse_copy_host(range);
  const auto offset = args::integer<std::uint64_t>(offset_object, "offset");
  CopyMode m = parse_mode(mode);
  Admission admission = parse_admission(wait_for_room);
  const std::optional<CopyLayout> layout = parse_layout(layout_object);
  Bridge& bridge = b.state->open();
  // A pitched copy's device range is what its rows reach from `offset`; a
  // plain one's is as long as the host range.
  std::uint64_t device_len = host.len();
  if (layout) {
    if (!layout->pitched())
      throw Error(ErrorKind::InvalidRange, "layout " + layout_repr(*layout) +
                                               " has no rows; pass layout=None for a plain copy of the whole range");
    device_len = layout_device_span(*layout);
  }
  const DeviceRange device{h, offset, device_len};
  const HostCopy request{direction, host.range, device, layout, m, admission};
  const InterruptibleCall waits;  // for room, for views of the range to end
  return bridge.copy(request);
}

}  // namespace

void bind_bridge(nb::module_& m) {
  const auto release_host_after = [](PyBridge& b, HostRange range, CopyEvent event) {
    b.state->open().release_host_after(range, event);
  };
  nb::class_<PyBridge>(m, "Bridge",
                       "One bridge per (worker, device): a host ring, device allocations, copies and views.\n"
                       "Bridge(backend=\"host\", generation=1, ring_bytes=64 << 20, inflight_bytes=None,\n"
                       "       *, device=None, writes_under_view=\"refuse\", writes_under_view_timeout=None,\n"
                       "       caching_pool=None, pool_cap_bytes=None, close_fence_timeout=10.0, **options)\n"
                       "device: which device (a device_id from devbridge.devices(backend)); options: the\n"
                       "backend's own (str or int; e.g. context=<CUcontext> or \"tinygrad\" for cuda;\n"
                       "docs/BACKENDS.md). cuda_ordinal/cuda_context are older names of device/context.\n"
                       "writes_under_view: what an upload into an allocation a live view still reads does:\n"
                       "\"refuse\" (AllocationStillInUse naming the views), \"wait\" for them to end (at most\n"
                       "writes_under_view_timeout seconds; None: until they end or close()), or \"allow\".\n"
                       "caching_pool: keep freed device memory for reuse (None: as the backend prefers, on for host,\n"
                       "CUDA and OpenCL, off for the fake), at most pool_cap_bytes of it; memory_stats() says how it goes.\n"
                       "close_fence_timeout: seconds close() waits for consumers' streams still reading memory.")
      .def(
          "__init__",
          [](PyBridge* self, const std::string& backend, nb::handle generation_object, nb::handle ring_bytes_object,
             nb::handle inflight_bytes_object, nb::handle device, nb::handle cuda_ordinal, nb::handle cuda_context,
             nb::handle writes_under_view, nb::handle writes_under_view_timeout, nb::handle caching_pool,
             nb::handle pool_cap_bytes, nb::handle close_fence_timeout, nb::kwargs extra) {
            const auto generation = args::integer<Generation>(generation_object, "generation");
            const auto ring_bytes = args::integer<std::uint64_t>(ring_bytes_object, "ring_bytes");
            const auto inflight_bytes = args::optional_integer<std::uint64_t>(inflight_bytes_object, "inflight_bytes");
            const auto device_options = backend_options(device, cuda_ordinal, cuda_context, extra);
            auto state = std::make_shared<BridgeState>();
            state->backend_name = backend;
            BridgeOptions options;
            options.generation = generation;
            options.ring_bytes = ring_bytes;
            options.inflight_budget_bytes = inflight_bytes.value_or(0);
            options.writes_under_view = parse_writes_under_view(writes_under_view);
            options.writes_under_view_timeout =
                args::optional_seconds(writes_under_view_timeout, "writes_under_view_timeout")
                    .value_or(std::chrono::nanoseconds::max());
            if (!caching_pool.is_none())
              options.caching_pool = args::flag(caching_pool, "caching_pool") ? CachingPool::On : CachingPool::Off;
            if (auto cap = args::optional_integer<std::uint64_t>(pool_cap_bytes, "pool_cap_bytes"))
              options.pool_cap_bytes = *cap;
            if (auto timeout = args::optional_seconds(close_fence_timeout, "close_fence_timeout"))
              options.close_fence_timeout = *timeout;
            {
              GilReleased no_gil;
              std::unique_ptr<Backend> made = make_backend(backend, device_options);
              state->fake = made->test_controls() != nullptr ? made->test_controls()->fake() : nullptr;
              state->bridge = std::make_unique<Bridge>(std::move(made), options);
              const BackendInfo info = state->bridge->backend_info();
              state->backend_name = info.name;  // what "auto" chose
              state->device = info.name + ":" + info.device_id;
              state->host_addressable = info.host_addressable;
              state->cheap_registration = info.cheap_registration;
              state->native_context = info.native_context;
            }
            new (self) PyBridge{std::move(state)};
          },
          "backend"_a = "host", "generation"_a.none() = 1, "ring_bytes"_a.none() = std::uint64_t{64} << 20,
          "inflight_bytes"_a.none() = nb::none(), nb::kw_only(), "device"_a.none() = nb::none(),
          "cuda_ordinal"_a.none() = nb::none(), "cuda_context"_a.none() = nb::none(),
          "writes_under_view"_a.none() = "refuse", "writes_under_view_timeout"_a.none() = nb::none(),
          "caching_pool"_a.none() = nb::none(), "pool_cap_bytes"_a.none() = nb::none(),
          "close_fence_timeout"_a.none() = nb::none(), "options"_a)
      .def_prop_ro("backend", [](const PyBridge& b) { return b.state->backend_name; })
      .def_prop_ro(
          "host_addressable", [](const PyBridge& b) { return b.state->host_addressable; },
          "Whether device memory is host memory the CPU reads and writes at a view's address (the host backend):\n"
          "upload/download then copy once, through a view, instead of twice through the ring.")
      .def_prop_ro(
          "cheap_registration", [](const PyBridge& b) { return b.state->cheap_registration; },
          "Whether one upload of a buffer is cheaper from a registration of it (register_host, one copy,\n"
          "unregister) than through the ring (two copies): import_tensor then goes that way for large buffers.")
      .def_prop_ro(
          "device", [](const PyBridge& b) { return b.state->device; },
          "The device the bridge binds, \"<backend>:<device_id>\" (\"opencl:0:0\", \"host:0\"); every handle and view\n"
          "of the bridge lives there.")
      .def_prop_ro("domain", [](const PyBridge& b) { return b.state->bridge->domain(); })
      .def_prop_ro("generation", [](const PyBridge& b) { return b.state->open().generation(); })
      .def_prop_ro("closed", [](const PyBridge& b) { return b.state->closed.load(); })
      .def("backend_info", [](const PyBridge& b) { return backend_info_dict(b.state->open().backend_info()); })
      // Read after close() too, as dump_trace: what close abandoned (abandoned_fences) or left held by
      // views is counted there, and nothing else says it.
      .def("stats", [](const PyBridge& b) { return stats_dict(b.state->bridge->stats()); })
      .def(
          "memory_stats", [](const PyBridge& b) { return memory_stats_dict(b.state->bridge->memory_stats()); },
          "Device memory as the bridge sees it (PyTorch's memory_stats): current, peak and total allocated and\n"
          "reserved bytes, allocation counts, backend calls, cache hits and misses, out-of-memory retries and\n"
          "failures, fragmentation (cached bytes too small for the largest request).")
      .def(
          "reset_peak_memory", [](PyBridge& b) { b.state->open().reset_peak_memory(); },
          "Peaks start again from the current figures.")
      .def(
          "empty_cache",
          [](PyBridge& b) {
            Bridge& bridge = b.state->open();
            GilReleased no_gil;
            bridge.empty_cache();
          },
          "Gives every cached block back to the backend.")
      .def(
          "restart",
          [](PyBridge& b, nb::handle generation_object) {
            // Old handles are refused at once; memory that live views still
            // lease (tinygrad tensors, DLPack arrays) is freed when they end.
            const auto generation = args::integer<Generation>(generation_object, "generation");
            Bridge& bridge = b.state->open();
            {
              GilReleased no_gil;
              bridge.restart(generation);
            }
            // The restart unregistered every region: their buffers go back.
            release_regions_after_restart(*b.state);
          },
          "generation"_a.none(),
          "Quiesce, free every allocation of the current generation, move to `generation` (> current).")
      .def(
          "close",
          [](PyBridge& b) {
            b.state->note_call_stack();
            {
              GilReleased no_gil;
              b.state->close();
            }
            release_regions_after_close(*b.state);
          },
          "Closes the bridge at once: every blocked call (wait, a waiting view, a wait for room) and every later\n"
          "call raises Closed. Memory still exported (ring arrays, views, DLPack arrays, tinygrad tensors) stays\n"
          "valid and is freed when the last of it goes.")
      // Self for type checkers: `with Bridge() as b` is the subclass, with its methods.
      .def("__enter__", [](nb::handle self) { return nb::borrow(self); },
           nb::sig("def __enter__(self) -> typing_extensions.Self"))
      .def(
          "__exit__",
          [](PyBridge& b, nb::handle, nb::handle, nb::handle) {
            b.state->note_call_stack();
            {
              GilReleased no_gil;
              b.state->close();
            }
            release_regions_after_close(*b.state);
          },
          "exc_type"_a.none(), "exc"_a.none(), "tb"_a.none())
      .def_prop_ro("ring", [](const PyBridge& b) { return PyHostRing{b.state}; })
      .def_prop_ro("fake",
                   [](const PyBridge& b) {
                     // AttributeError, as for any attribute an object lacks: hasattr() and the tools
                     // that list an object's members (Ray's pickling check) expect it.
                     if (b.state->fake == nullptr)
                       throw nb::attribute_error(("Bridge.fake: the bridge's backend is \"" + b.state->backend_name +
                                                  "\", not \"fake\"").c_str());
                     return PyFake{b.state};
                   })
      // ---- allocation ----
      .def(
          "alloc",
          [](PyBridge& b, const ObjectSpec& spec, nb::handle extent) {
            return b.state->open().alloc_device(spec, args::integer<std::uint64_t>(extent, "extent"));
          },
          "spec"_a, "extent"_a.none(), "Allocates `extent` bytes for objects of `spec`.")
      .def(
          "free",
          [](PyBridge& b, DeviceHandle h) {
            b.state->open().free_device(h);
            reap_released_regions(*b.state);  // an adopted allocation may have held the last use of a region
          },
          "handle"_a, "Frees now, or raises AllocationStillInUse (copies, steps or views use it) and changes nothing.")
      .def(
          "release",
          [](PyBridge& b, DeviceHandle h) {
            b.state->open().release(h);
            reap_released_regions(*b.state);
          },
          "handle"_a, "Deferred free: unusable now, freed when its last copy, step and view end.")
      .def(
          "adopt_host",
          [](PyBridge& b, nb::handle range, const ObjectSpec& spec) { return adopt_host(b.state, range, spec); },
          "range"_a, "spec"_a,
          "The bytes of a region registered with writable=False (a RegionRange, or a whole HostRegion) used in\n"
          "place as a device allocation, with no copy, where the device addresses host memory (the host\n"
          "backend); Unsupported elsewhere. Read-only: uploads and launches into it raise InvalidRange, its\n"
          "views are read-only (DLPack's read-only flag). The region cannot be unregistered while it lives.\n"
          "InvalidAlignment when the range does not start at a multiple of spec.alignment.")
      .def(
          "extent", [](PyBridge& b, DeviceHandle h) { return b.state->open().extent(h); }, "handle"_a)
      .def(
          "spec", [](PyBridge& b, DeviceHandle h) { return b.state->open().spec(h); }, "handle"_a)
      // ---- copies ----
      .def(
          "host_to_device",
          [](PyBridge& b, nb::handle r, DeviceHandle h, nb::handle offset, const std::string& mode,
             nb::handle wait_for_room, nb::handle layout) {
            return submit_copy(b, CopyDirection::HostToDevice, r, h, offset, mode, wait_for_room, layout);
          },
          "range"_a, "handle"_a, "offset"_a.none() = 0, "mode"_a = "async", nb::kw_only(), "wait_for_room"_a.none() = 0.0,
          "layout"_a.none() = nb::none(),
          "Copies the host range (a ring HostRange, a RegionRange of a registered buffer, or a whole HostRegion)\n"
          "to {handle, offset, range.len}; returns the CopyEvent. layout=CopyLayout: a pitched copy of its rows,\n"
          "row i from byte i * host_pitch of the range to offset + i * device_pitch; the padding between rows\n"
          "is never touched.")
      .def(
          "device_to_host",
          [](PyBridge& b, DeviceHandle h, nb::handle r, nb::handle offset, const std::string& mode,
             nb::handle wait_for_room, nb::handle layout) {
            return submit_copy(b, CopyDirection::DeviceToHost, r, h, offset, mode, wait_for_room, layout);
          },
          "handle"_a, "range"_a, "offset"_a.none() = 0, "mode"_a = "async", nb::kw_only(), "wait_for_room"_a.none() = 0.0,
          "layout"_a.none() = nb::none(),
          "Copies {handle, offset, range.len} into the host range (as host_to_device takes it); returns the\n"
          "CopyEvent. layout=CopyLayout: a pitched copy, row i from offset + i * device_pitch to byte\n"
          "i * host_pitch of the range; the padding between rows is never touched.")
      .def(
          "copy_to_peer",
          [](PyBridge& b, DeviceHandle h, PyBridge& destination, DeviceHandle to, nb::handle length,
             nb::handle offset, nb::handle destination_offset) {
            const auto len = args::integer<std::uint64_t>(length, "length");
            const DeviceRange source{h, args::integer<std::uint64_t>(offset, "offset"), len};
            const DeviceRange target{to, args::integer<std::uint64_t>(destination_offset, "destination_offset"), len};
            Bridge& from = b.state->open();
            Bridge& into = destination.state->open();
            const InterruptibleCall waits;  // for views of the target to end
            return from.copy_to_peer(source, into, target);
          },
          "handle"_a, "destination"_a, "destination_handle"_a, "length"_a, nb::kw_only(), "offset"_a.none() = 0,
          "destination_offset"_a.none() = 0,
          "Copies length bytes of handle (from offset) into destination_handle of the destination bridge (from\n"
          "destination_offset), device to device, where the two backends have a direct path (CUDA within a\n"
          "context or between peer devices; two fakes): returns True once the bytes have landed, False (nothing\n"
          "changed) where there is none. devbridge.transfer uses it before staging through both rings.")
      // ---- registered host memory ----
      .def(
          "register_host",
          [](PyBridge& b, nb::handle obj, nb::handle writable) {
            return register_host(b.state, obj, args::flag(writable, "writable"));
          },
          "obj"_a, nb::kw_only(), "writable"_a = true,
          nb::sig("def register_host(self, obj: object, *, writable: object = True) -> HostRegion"),
          "Registers a C-contiguous buffer (numpy array, bytearray, mmap.mmap, memoryview) as a staging source\n"
          "beside the ring; returns a HostRegion, which holds the buffer until unregistered (or a restart or\n"
          "close). writable=False takes a read-only buffer (bytes, a read-only array) for host_to_device only.\n"
          "InvalidRange when it overlaps a registered region or the ring.")
      .def(
          "unregister_host", [](PyBridge& b, nb::handle region) { unregister_host(b.state, region); }, "region"_a,
          "region.unregister(): AllocationStillInUse while a copy uses it.")
      .def(
          "wait",
          [](PyBridge& b, CopyEvent e, nb::handle timeout) {
            // None, or a huge or infinite timeout, waits until done (or close()).
            const std::optional<std::chrono::nanoseconds> limit = args::optional_seconds(timeout, "timeout");
            Bridge& bridge = b.state->open();
            const CopyStatus status =
                wait_interruptibly(limit, [&](std::chrono::nanoseconds slice, bool last) -> std::optional<CopyStatus> {
                  CopyStatus now = bridge.wait(e, slice);
                  if (now.state == CopyState::Pending && !last) return std::nullopt;
                  return now;
                });
            if (status.state == CopyState::Failed)
              throw Error(status.error.value_or(ErrorKind::DeviceCopyFailed), status.message);
            return std::string(state_name(status.state));
          },
          "event"_a, "timeout"_a.none() = nb::none(),
          "Blocks until the copy completes (\"completed\") or the timeout (seconds; None or inf: no limit) passes\n"
          "(\"pending\"); raises the copy's error (DeviceCopyFailed / OutputCopyFailed) when it failed, Closed when\n"
          "close() is called meanwhile.")
      .def("poll", [](PyBridge& b) { return b.state->open().poll(); }, "Applies every completion the backend has.")
      .def(
          "copy_status", [](PyBridge& b, CopyEvent e) { return std::string(state_name(b.state->open().copy_status(e).state)); },
          "event"_a, "\"pending\", \"completed\" or \"failed\".")
      .def(
          "copy_info",
          [](PyBridge& b, CopyEvent e) {
            CopyStatus status = b.state->open().copy_status(e);
            nb::dict d;
            d["state"] = state_name(status.state);
            d["error"] = status.error ? nb::cast(std::string(kind_name(*status.error))) : nb::none();
            d["message"] = status.message;
            return d;
          },
          "event"_a, "{state, error (kind name or None), message}.")
      .def(
          "safe_to_release_host", [](PyBridge& b, CopyEvent e) { return b.state->open().safe_to_release_host(e); },
          "event"_a)
      .def("release_host_after", release_host_after, "range"_a, "event"_a, kReleaseHostAfterDoc)
      .def("release_when_safe", release_host_after, "range"_a, "event"_a,
           "release_host_after under its older name (the same call).")
      .def(
          "host_bytes_valid", [](PyBridge& b, CopyEvent e) { return b.state->open().host_bytes_valid(e); }, "event"_a)
      // ---- compute ----
      .def(
          "begin_step",
          [](PyBridge& b, nb::handle step, const std::vector<DeviceHandle>& handles) {
            b.state->open().begin_step(args::integer<StepId>(step, "step_id"), handles);
          },
          "step_id"_a.none(), "handles"_a)
      .def(
          "end_step",
          [](PyBridge& b, nb::handle step, nb::handle stream) {
            const auto id = args::integer<StepId>(step, "step_id");
            if (stream.is_none()) return b.state->open().end_step(id);
            b.state->open().end_step(id, ConsumerQueue{args::integer<std::uintptr_t>(stream, "stream")});
          },
          "step_id"_a.none(), "stream"_a.none() = nb::none(),
          "Ends a step. With stream= (a consumer's queue: CUDA 1 legacy default, 2 per-thread, else a CUstream;\n"
          "OpenCL a cl_command_queue), its allocations stay held until that queue has run the work enqueued on it\n"
          "so far: release() frees them then, free_device refuses until then.")
      .def(
          "axpy",
          [](PyBridge& b, DeviceHandle x, DeviceHandle y, float a, float c, nb::handle x_offset_object,
             nb::handle y_offset_object, nb::handle nbytes_object) {
            const auto x_offset = args::integer<std::uint64_t>(x_offset_object, "x_offset");
            const auto y_offset = args::integer<std::uint64_t>(y_offset_object, "y_offset");
            const auto nbytes = args::optional_integer<std::uint64_t>(nbytes_object, "nbytes");
            Bridge& bridge = b.state->open();
            std::uint64_t len = nbytes ? *nbytes : bridge.extent(x) - std::min(x_offset, bridge.extent(x));
            GilReleased no_gil;
            bridge.launch_axpy(DeviceRange{x, x_offset, len}, DeviceRange{y, y_offset, len}, a, c);
          },
          "x"_a, "y"_a, "a"_a = 1.0f, "b"_a = 0.0f, nb::kw_only(), "x_offset"_a.none() = 0, "y_offset"_a.none() = 0,
          "nbytes"_a.none() = nb::none(), "The built-in role y = a*x + b over float32 (default: all of x).")
      // ---- views ----
      .def(
          "view",
          [](PyBridge& b, DeviceHandle h, nb::handle dtype, nb::handle shape, nb::handle strides,
             nb::handle offset, bool wait) {
            return make_view(b.state, h, parse_view_spec(dtype, shape, strides, offset),
                             wait ? ViewWait::Wait : ViewWait::Refuse);
          },
          "handle"_a, "dtype"_a, "shape"_a.none(), "strides"_a.none() = nb::none(), "offset"_a.none() = 0, nb::kw_only(),
          "wait"_a = true,
          "A TensorView over the allocation (strides in elements, offset in bytes). wait=True waits for copies into\n"
          "the allocation to complete first; wait=False refuses (AllocationStillInUse) while one is in flight.")
      // ---- the flight recorder (recorder.cpp, docs/TRACING.md) ----
      .def(
          "record",
          [](PyBridge& b, nb::handle max_events, nb::handle stacks, nb::handle oom_dump_dir) {
            record(*b.state, max_events, stacks, oom_dump_dir);
          },
          "max_events"_a.none() = 100000, "stacks"_a.none() = false, "oom_dump_dir"_a.none() = nb::none(),
          "Starts recording what the bridge does into a ring of the newest max_events events (1 to 2**24; a\n"
          "recording in progress is dropped). stacks=True attaches each call's Python stack to its events.\n"
          "oom_dump_dir: where an allocation that fails for good dumps the trace (the error names the file).")
      .def(
          "stop_recording", [](PyBridge& b) { b.state->bridge->stop_recording(); },
          "Stops recording; what was recorded stays for dump_trace and trace.")
      .def(
          "dump_trace", [](PyBridge& b, nb::handle path) { dump_trace(*b.state, path); }, "path"_a,
          "Writes the recorded events to path (str or os.PathLike) as Chrome/Perfetto trace-event JSON,\n"
          "atomically (docs/TRACING.md, \"Trace format\").")
      .def(
          "trace", [](PyBridge& b) { return trace(*b.state); },
          nb::sig("def trace(self) -> dict[str, typing.Any]"),
          "The recorded events as a dict, the JSON dump_trace writes.")
      .def(
          "memory_snapshot", [](PyBridge& b, nb::handle layout) { return memory_snapshot(*b.state, layout); },
          "layout"_a.none() = nb::none(),
          nb::sig("def memory_snapshot(self, layout: str | None = None) -> dict[str, typing.Any]"),
          "Segments and blocks with their state, holders and recorded events, the ring and memory_stats(),\n"
          "as a dict (docs/TRACING.md, \"Memory snapshot format\"); layout None or \"devbridge\". layout=\"torch\": the dict PyTorch's\n"
          "torch.cuda.memory._snapshot() returns (segments, blocks and the recorded allocations and frees as\n"
          "device_traces), which https://pytorch.org/memory_viz opens pickled.")
      .def("__repr__", [](const PyBridge& b) {
        return "Bridge(backend=\"" + b.state->backend_name + "\", domain=" + std::to_string(b.state->bridge->domain()) +
               (b.state->closed.load() ? ", closed)" : ")");
      });
}

}  // namespace devbridge::python
