// devbridge._devbridge.TransferPlanner: the C++ transfer planner
// (include/devbridge/transfer.hpp) over any buffer-protocol object. The
// planner chooses the route (registered copy, ring chunks, peer copy, ...)
// from the backend's capabilities, so Python code never reads
// host_addressable / cheap_registration to pick one.
//
// Each call holds the buffer's export for the call only and releases the GIL
// around the C++ work; a progress callback takes the GIL back for each call
// (the one place below the bindings that calls into Python). Adoption is not
// offered here: an adopted allocation aliases the buffer for its whole life,
// and only Bridge.adopt holds a buffer export that long.
//
// upload and submit_upload hand a new allocation back as a bare DeviceHandle,
// the caller's to free; the staging layer's _upload_owned and
// _submit_upload_owned hand it back owned (owned_allocation.hpp), so that an
// exception between the call and the DeviceTensor (Ctrl-C) leaks nothing.
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "arguments.hpp"
#include "bindings.hpp"
#include "devbridge/transfer.hpp"
#include "owned_allocation.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace devbridge::python {

std::shared_ptr<BridgeState> state_of(nb::handle bridge, const char* what) {
  // Every devbridge.Bridge hands out its ring; its state is the bridge's.
  if (!nb::hasattr(bridge, "ring") || !nb::isinstance<PyHostRing>(bridge.attr("ring")))
    args::raise(PyExc_TypeError,
                std::string(what) + " must be a devbridge.Bridge, not " + nb::type_name(bridge.type()).c_str());
  return nb::cast<PyHostRing&>(bridge.attr("ring")).state;
}

namespace {

constexpr Route kRoutes[] = {Route::Nothing,    Route::AdoptInPlace, Route::RegisteredCopy,    Route::DirectCopy,
                             Route::RingChunks, Route::PeerCopy,     Route::StagedThroughRings, Route::WriteInPlace,
                             Route::ReadInPlace};

std::optional<Route> parse_route(nb::handle value) {
  if (value.is_none()) return std::nullopt;
  if (!nb::isinstance<nb::str>(value))
    args::raise(PyExc_TypeError, "route must be a str or None, not " + std::string(nb::type_name(value.type()).c_str()));
  const std::string name = nb::cast<std::string>(value);
  for (const Route route : kRoutes)
    if (route_name(route) == name) {
      if (route == Route::AdoptInPlace)
        args::raise(PyExc_ValueError,
                    "route \"adopt_in_place\": the allocation would alias the buffer for its whole life; use "
                    "Bridge.adopt, which holds the buffer that long");
      return route;
    }
  args::raise(PyExc_ValueError, "route \"" + name +
                                    "\" is not one of registered_copy, direct_copy, ring_chunks, peer_copy, "
                                    "staged_through_rings, write_in_place, read_in_place (or None: the planner chooses)");
}

nb::dict plan_dict(const TransferPlan& plan) {
  nb::dict d;
  d["route"] = std::string(route_name(plan.route));
  d["reason"] = plan.reason;
  d["bytes"] = plan.bytes;
  d["chunk_bytes"] = plan.chunk_bytes;
  return d;
}

// The bytes of an exported buffer (C-contiguous: the planner moves one span).
std::span<const std::byte> bytes_of(const HeldBuffer& buffer) {
  return {static_cast<const std::byte*>(buffer.view().buf), static_cast<std::size_t>(buffer.view().len)};
}
std::span<std::byte> writable_bytes_of(const HeldBuffer& buffer) {
  return {static_cast<std::byte*>(buffer.view().buf), static_cast<std::size_t>(buffer.view().len)};
}

// An upload's destination: into= an existing allocation at offset=, else a
// new allocation of spec and extent (default: the buffer's size).
TransferDestination upload_destination(std::size_t size, nb::handle spec, nb::handle extent, nb::handle into,
                                       nb::handle offset, const char* what) {
  if (!into.is_none())
    return DeviceSpan{args::bound<DeviceHandle>(into, "into"), args::integer<std::uint64_t>(offset, "offset")};
  if (spec.is_none()) args::raise(PyExc_TypeError, std::string(what) + ": give spec= (a new allocation) or into=");
  return NewAllocation{args::bound<ObjectSpec>(spec, "spec"),
                       extent.is_none() ? size : args::integer<std::uint64_t>(extent, "extent")};
}

void check_callable(nb::handle f, const char* what) {
  if (!PyCallable_Check(f.ptr())) args::raise(PyExc_TypeError, std::string(what) + " must be a callable(offset, chunk)");
}

struct PyTransferPlanner {
  std::shared_ptr<BridgeState> state;  // declared first: outlives the planner over its bridge
  std::unique_ptr<TransferPlanner> planner;
  nb::object progress;  // a callable or None, called with the GIL
  // A planner is not thread-safe; Python threads may share this object.
  // Taken without the GIL, so a progress callback never waits on it.
  std::mutex mutex;
  std::atomic<std::thread::id> running_on{};  // the thread inside a call, while one is
  std::atomic<Route> last_route{Route::Nothing};

  // Runs `work(planner)` without the GIL, one call at a time, Ctrl-C able to
  // end the core's waits inside it (room, views to end: InterruptibleCall;
  // the planner's own waits run options.while_waiting). A call from inside
  // one of this planner's own (a sink, fill or progress callback) is
  // refused: it would wait for the mutex its own thread holds.
  template <class Work>
  auto locked(Work work) {
    state->open();  // Closed before anything else
    if (running_on.load(std::memory_order_relaxed) == std::this_thread::get_id())
      args::raise(PyExc_RuntimeError,
                  "TransferPlanner: called from inside one of its own transfers (a sink, fill or progress "
                  "callback); a planner makes one transfer at a time: use another TransferPlanner there");
    const InterruptibleCall waits;
    std::lock_guard lock(mutex);
    running_on.store(std::this_thread::get_id(), std::memory_order_relaxed);
    const struct Done {
      std::atomic<std::thread::id>& running_on;
      ~Done() { running_on.store(std::thread::id{}, std::memory_order_relaxed); }
    } done{running_on};
    return work(*planner);
  }
};

// The progress callback may reach its planner (a closure over it, an
// object holding both): the collector must see that reference to free the
// cycle, and with it the bridge the planner keeps alive.
int transfer_planner_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  Py_VISIT(nb::inst_ptr<PyTransferPlanner>(self)->progress.ptr());
  return 0;
}

// Only an unreachable planner is cleared: no call of it, and so no progress call, can be running.
int transfer_planner_clear(PyObject* self) {
  nb::inst_ptr<PyTransferPlanner>(self)->progress = nb::none();
  return 0;
}

PyType_Slot transfer_planner_slots[] = {
    {Py_tp_traverse, reinterpret_cast<void*>(&transfer_planner_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(&transfer_planner_clear)},
    {0, nullptr},
};

// An upload's buffer, held for the call, and where its bytes go (upload_destination).
struct HeldUpload {
  HeldBuffer held;
  std::span<const std::byte> bytes;
  TransferDestination destination;

  HeldUpload(nb::handle buffer, nb::handle spec, nb::handle extent, nb::handle into, nb::handle offset,
             const char* what)
      : held(buffer, PyBUF_C_CONTIGUOUS, "buffer"),
        bytes(bytes_of(held)),
        destination(upload_destination(bytes.size(), spec, extent, into, offset, what)) {}
};

// TransferPlanner::submit, one call at a time.
TransferResult submitted_result(PyTransferPlanner& p, const TransferSource& source,
                                const TransferDestination& destination) {
  return p.locked([&](TransferPlanner& t) {
    TransferResult r = t.submit(source, destination);
    p.last_route = r.route;
    return r;
  });
}

// A result's copies still in flight as a list of (event, offset, nbytes).
nb::list pending_list(const TransferResult& result) {
  nb::list pending;
  for (const PendingCopy& copy : result.pending) pending.append(nb::make_tuple(copy.event, copy.offset, copy.bytes));
  return pending;
}

// TransferPlanner::submit, one call at a time: the result, and its copies
// still in flight as a list of (event, offset, nbytes).
std::pair<TransferResult, nb::list> submitted(PyTransferPlanner& p, const TransferSource& source,
                                              const TransferDestination& destination) {
  TransferResult result = submitted_result(p, source, destination);
  nb::list pending = pending_list(result);
  return {std::move(result), std::move(pending)};
}

// upload(): a new allocation of spec and extent holding the buffer's bytes, run to the end.
DeviceHandle uploaded(PyTransferPlanner& p, nb::handle buffer, const ObjectSpec& spec, nb::handle extent) {
  HeldBuffer held(buffer, PyBUF_C_CONTIGUOUS, "buffer");
  const auto bytes = bytes_of(held);
  const std::uint64_t n = extent.is_none() ? bytes.size() : args::integer<std::uint64_t>(extent, "extent");
  return p.locked([&](TransferPlanner& t) {
    const TransferResult result = t.run(HostSource{bytes}, NewAllocation{spec, n});
    p.last_route = result.route;
    return *result.handle;
  });
}

// copy() and plan_copy()'s arguments: the two ends, the destination's
// bridge (held for the call) defaulting to the planner's.
struct DeviceCopy {
  std::shared_ptr<BridgeState> other;
  DeviceSpan from, to;

  DeviceCopy(DeviceHandle source, nb::handle source_offset, nb::handle nbytes, DeviceHandle destination,
             nb::handle destination_offset, nb::handle destination_bridge) {
    from = DeviceSpan{source, args::integer<std::uint64_t>(source_offset, "source_offset"),
                      args::integer<std::uint64_t>(nbytes, "nbytes")};
    to = DeviceSpan{destination, args::integer<std::uint64_t>(destination_offset, "destination_offset")};
    if (!destination_bridge.is_none()) {
      other = state_of(destination_bridge, "destination_bridge");
      to.bridge = &other->open();
    }
  }
};

// download() and plan_download()'s arguments: the allocation's bytes from
// `offset` and the writable buffer (its export held for the call).
struct Download {
  DeviceSpan from;  // first: the offset is checked before the buffer is exported
  HeldBuffer held;
  HostDestination to;

  Download(DeviceHandle handle, nb::handle offset, nb::handle out)
      : from{handle, args::integer<std::uint64_t>(offset, "offset")},
        held(out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, "out"),
        to{writable_bytes_of(held)} {}
};

}  // namespace

void bind_transfer(nb::module_& m) {
  nb::class_<PyTransferPlanner>(
      m, "TransferPlanner",
      "Moves bytes between Python buffers and device memory by the route the bridge's backend makes cheapest\n"
      "(the C++ TransferPlanner): a registered copy where registering host memory is cheap, ring chunks\n"
      "elsewhere, a peer copy or both rings between bridges. plan_*() say which route and why.",
      nb::type_slots(transfer_planner_slots))
      .def(
          "__init__",
          [](PyTransferPlanner* self, nb::handle bridge, nb::handle chunk_bytes, nb::handle max_chunks_in_flight,
             nb::handle cleanup_timeout, nb::handle registration_from_bytes, nb::handle route, nb::object progress,
             nb::handle wait_for_room) {
            TransferOptions options;
            options.chunk_bytes = args::integer<std::uint64_t>(chunk_bytes, "chunk_bytes");
            options.max_chunks_in_flight = args::integer<std::uint32_t>(max_chunks_in_flight, "max_chunks_in_flight");
            options.cleanup_timeout = args::seconds(cleanup_timeout, "cleanup_timeout");
            options.wait_for_room = args::seconds(wait_for_room, "wait_for_room");
            options.registration_from_bytes =
                args::integer<std::uint64_t>(registration_from_bytes, "registration_from_bytes");
            options.route = parse_route(route);
            if (!progress.is_none() && !PyCallable_Check(progress.ptr()))
              args::raise(PyExc_TypeError, "progress must be a callable(done, total) or None");
            auto state = state_of(bridge, "bridge");
            if (!progress.is_none())
              // Runs only inside calls on the constructed object below.
              options.progress = [self](std::uint64_t done, std::uint64_t total) {
                GilTaken gil;
                self->progress(done, total);
              };
            // Ctrl-C (and any signal handler that raises) ends a wait for a copy or for room, which a lost
            // completion would otherwise make endless: the transfer cleans up and the error is raised.
            options.while_waiting = look_for_signals;
            auto planner = std::make_unique<TransferPlanner>(state->open(), std::move(options));
            new (self) PyTransferPlanner{std::move(state), std::move(planner), progress};
          },
          "bridge"_a, nb::kw_only(), "chunk_bytes"_a = 0, "max_chunks_in_flight"_a = 4, "cleanup_timeout"_a = 30.0,
          "registration_from_bytes"_a = std::uint64_t{1} << 20, "route"_a = nb::none(), "progress"_a = nb::none(),
          "wait_for_room"_a = 0.0,
          "chunk_bytes: bytes per ring chunk (0: a quarter of the ring); route: force one route by name (tests);\n"
          "progress: called as progress(done, total) as bytes land; wait_for_room: seconds a call waits for ring\n"
          "or in-flight room another caller holds before Backpressure (0: refuse at once; math.inf: until room).")
      .def(
          "plan_upload",
          [](PyTransferPlanner& p, nb::handle buffer, nb::handle spec, nb::handle extent, nb::handle into,
             nb::handle offset) {
            const HeldUpload upload(buffer, spec, extent, into, offset, "plan_upload");
            return plan_dict(
                p.locked([&](TransferPlanner& t) { return t.plan(HostSource{upload.bytes}, upload.destination); }));
          },
          "buffer"_a, "spec"_a = nb::none(), "extent"_a = nb::none(), nb::kw_only(), "into"_a = nb::none(),
          "offset"_a = 0,
          "The route an upload of `buffer` would take (into a new allocation of spec/extent, or into= an existing\n"
          "one at offset=): a dict of route, reason, bytes, chunk_bytes. Validates as the upload would.")
      .def(
          "upload",
          [](PyTransferPlanner& p, nb::handle buffer, const ObjectSpec& spec, nb::handle extent) {
            return uploaded(p, buffer, spec, extent);
          },
          "buffer"_a, "spec"_a, "extent"_a = nb::none(),
          "A new allocation of spec and extent (default: the buffer's size) holding the buffer's bytes at 0.")
      .def(
          "_upload_owned",
          [](PyTransferPlanner& p, nb::handle buffer, const ObjectSpec& spec, nb::handle extent) {
            const DeviceHandle handle = uploaded(p, buffer, spec, extent);
            return owned_allocation(p.state, handle);
          },
          "buffer"_a, "spec"_a, "extent"_a = nb::none(),
          "As upload, the new allocation returned as an _OwnedAllocation (the staging layer's: an exception\n"
          "before the caller keeps it releases it).")
      .def(
          "submit_upload",
          [](PyTransferPlanner& p, nb::handle buffer, nb::handle spec, nb::handle extent, nb::handle into,
             nb::handle offset) {
            const HeldUpload upload(buffer, spec, extent, into, offset, "submit_upload");
            auto [result, pending] = submitted(p, HostSource{upload.bytes}, upload.destination);
            return nb::make_tuple(result.handle ? nb::cast(*result.handle) : nb::none(), pending);
          },
          "buffer"_a, "spec"_a = nb::none(), "extent"_a = nb::none(), nb::kw_only(), "into"_a = nb::none(),
          "offset"_a = 0,
          "As upload (spec=) or upload_into (into=, offset=), without waiting for ring-chunk copies: returns\n"
          "(handle or None, [(event, offset, nbytes), ...]), the chunk copies still in flight (offsets from the\n"
          "buffer's start), their ring ranges already handed to the bridge (release_host_after). The buffer is\n"
          "not needed once it returns. On failure nothing is left allocated and the error names the chunk.")
      .def(
          "_submit_upload_owned",
          [](PyTransferPlanner& p, nb::handle buffer, const ObjectSpec& spec, nb::handle extent) {
            HeldBuffer held(buffer, PyBUF_C_CONTIGUOUS, "buffer");
            const auto bytes = bytes_of(held);
            const std::uint64_t n = extent.is_none() ? bytes.size() : args::integer<std::uint64_t>(extent, "extent");
            const TransferResult result = submitted_result(p, HostSource{bytes}, NewAllocation{spec, n});
            // A new allocation's result always names it: owned before anything else (the list) can fail.
            nb::object owner = owned_allocation(p.state, *result.handle);
            return nb::make_tuple(owner, pending_list(result));
          },
          "buffer"_a, "spec"_a, "extent"_a = nb::none(),
          "As submit_upload into a new allocation (spec=), the allocation returned as an _OwnedAllocation:\n"
          "(owner, [(event, offset, nbytes), ...]).")
      .def(
          "submit_stream",
          [](PyTransferPlanner& p, nb::object fill, nb::handle nbytes, DeviceHandle into, nb::handle offset) {
            check_callable(fill, "fill");
            StreamSource source{args::integer<std::uint64_t>(nbytes, "nbytes"),
                                [&fill](std::uint64_t at, std::span<std::byte> chunk) {
                                  GilTaken gil;
                                  lend_for_call(fill, "fill", at, chunk, true);
                                }};
            const DeviceSpan destination{into, args::integer<std::uint64_t>(offset, "offset")};
            return submitted(p, source, destination).second;
          },
          "fill"_a, "nbytes"_a, nb::kw_only(), "into"_a, "offset"_a = 0,
          "Uploads nbytes made chunk by chunk into `into` at offset, through the ring: fill(at, chunk) writes\n"
          "bytes [at, at + len(chunk)) into chunk (a writable memoryview over a ring range, lent for the call only:\n"
          "released when it returns), in order. Returns the copies still in flight as submit_upload does; an exception fill raises\n"
          "ends the transfer as it is.")
      .def(
          "submit_scatter",
          [](PyTransferPlanner& p, nb::object fill, nb::handle targets) {
            check_callable(fill, "fill");
            std::vector<DeviceSpan> destinations;
            for (nb::handle target : nb::iter(targets)) {
              if (!PySequence_Check(target.ptr()) || nb::isinstance<nb::str>(target) ||
                  nb::isinstance<nb::bytes>(target) || PySequence_Size(target.ptr()) != 3) {
                PyErr_Clear();
                args::raise(PyExc_TypeError, std::string("submit_scatter: each target is (handle, offset, nbytes), not ") +
                                                 nb::type_name(target.type()).c_str());
              }
              const nb::sequence t = nb::borrow<nb::sequence>(target);
              destinations.push_back(DeviceSpan{args::bound<DeviceHandle>(t[0], "submit_scatter: a target's handle"),
                                                args::integer<std::uint64_t>(t[1], "offset"),
                                                args::integer<std::uint64_t>(t[2], "nbytes")});
            }
            const ScatterSource source{[&fill](std::uint64_t at, std::span<const std::span<std::byte>> pieces) {
              GilTaken gil;
              LentViews lent(true);
              nb::list views;
              for (const auto& piece : pieces) views.append(lent.lend(piece));
              fill(at, views);
              lent.end("fill", at);
            }};
            std::vector<TransferResult> results = p.locked([&](TransferPlanner& t) {
              auto r = t.submit_scatter(source, destinations);
              if (!r.empty()) p.last_route = r.front().route;
              return r;
            });
            nb::list out;
            for (const TransferResult& result : results) {
              nb::list pending;
              for (const PendingCopy& copy : result.pending)
                pending.append(nb::make_tuple(copy.event, copy.offset, copy.bytes));
              out.append(pending);
            }
            return out;
          },
          "fill"_a, "targets"_a,
          "One stream of bytes into several allocations, in order: targets is [(handle, offset, nbytes), ...],\n"
          "each taking the next nbytes of the stream; fill(at, pieces) writes bytes [at, at + their total) into\n"
          "pieces (writable memoryviews, lent for the call only, each the next bytes of one target). Where\n"
          "device memory is host memory the pieces are the allocations' own bytes (write_in_place: one call may\n"
          "cover many small targets), else one ring chunk per call. Returns, per target, its copies still in\n"
          "flight as submit_upload does (offsets from the target's start).")
      .def(
          "download_stream",
          [](PyTransferPlanner& p, DeviceHandle handle, nb::handle offset, nb::handle nbytes, nb::object sink) {
            check_callable(sink, "sink");
            const DeviceSpan source{handle, args::integer<std::uint64_t>(offset, "offset")};
            StreamDestination destination{args::integer<std::uint64_t>(nbytes, "nbytes"),
                                          [&sink](std::uint64_t at, std::span<const std::byte> chunk) {
                                            GilTaken gil;
                                            lend_for_call(sink, "sink", at, chunk, false);
                                          }};
            p.locked([&](TransferPlanner& t) { p.last_route = t.run(source, destination).route; });
          },
          "handle"_a, "offset"_a, "nbytes"_a, "sink"_a,
          "nbytes of the allocation from offset, handed to sink(at, chunk) chunk by chunk through the ring, in\n"
          "order: chunk is a read-only memoryview over a ring range (or, where device memory is host memory, the\n"
          "allocation's own bytes), lent for the call only: released when it returns (copy it, hash it, write it\n"
          "to a file; a numpy.frombuffer of it kept past the call fails the transfer with BufferError). An exception sink raises ends the transfer as it is.")
      .def(
          "upload_into",
          [](PyTransferPlanner& p, DeviceHandle handle, nb::handle offset, nb::handle buffer) {
            const auto device_offset = args::integer<std::uint64_t>(offset, "offset");
            HeldBuffer held(buffer, PyBUF_C_CONTIGUOUS, "buffer");
            const auto bytes = bytes_of(held);
            p.locked([&](TransferPlanner& t) {
              p.last_route = t.run(HostSource{bytes}, DeviceSpan{handle, device_offset}).route;
            });
          },
          "handle"_a, "offset"_a, "buffer"_a, "The buffer's bytes into an existing allocation at offset.")
      .def(
          "plan_download",
          [](PyTransferPlanner& p, DeviceHandle handle, nb::handle offset, nb::handle out) {
            const Download download(handle, offset, out);
            return plan_dict(p.locked([&](TransferPlanner& t) { return t.plan(download.from, download.to); }));
          },
          "handle"_a, "offset"_a, "out"_a, "The route download(handle, offset, out) would take, as plan_upload.")
      .def(
          "download",
          [](PyTransferPlanner& p, DeviceHandle handle, nb::handle offset, nb::handle out) {
            const Download download(handle, offset, out);
            p.locked([&](TransferPlanner& t) { p.last_route = t.run(download.from, download.to).route; });
          },
          "handle"_a, "offset"_a, "out"_a, "len(out) bytes of the allocation from offset into out (writable).")
      .def(
          "copy",
          [](PyTransferPlanner& p, DeviceHandle source, nb::handle source_offset, nb::handle nbytes,
             DeviceHandle destination, nb::handle destination_offset, nb::handle destination_bridge) {
            const DeviceCopy copy(source, source_offset, nbytes, destination, destination_offset, destination_bridge);
            return p.locked([&](TransferPlanner& t) {
              const TransferResult result = t.run(copy.from, copy.to);
              p.last_route = result.route;
              return std::string(route_name(result.route));
            });
          },
          "source"_a, "source_offset"_a, "nbytes"_a, "destination"_a, "destination_offset"_a = 0, nb::kw_only(),
          "destination_bridge"_a = nb::none(),
          "nbytes of source from source_offset into destination at destination_offset, device to device (in\n"
          "destination_bridge, default this bridge): a peer copy where the backends have a direct path, else\n"
          "through the rings. Returns the route taken.")
      .def(
          "plan_copy",
          [](PyTransferPlanner& p, DeviceHandle source, nb::handle source_offset, nb::handle nbytes,
             DeviceHandle destination, nb::handle destination_offset, nb::handle destination_bridge) {
            const DeviceCopy copy(source, source_offset, nbytes, destination, destination_offset, destination_bridge);
            return plan_dict(p.locked([&](TransferPlanner& t) { return t.plan(copy.from, copy.to); }));
          },
          "source"_a, "source_offset"_a, "nbytes"_a, "destination"_a, "destination_offset"_a = 0, nb::kw_only(),
          "destination_bridge"_a = nb::none(), "The route copy() would take, as plan_upload.")
      .def_prop_ro("last_route", [](const PyTransferPlanner& p) { return std::string(route_name(p.last_route)); },
                   "The route the last upload, upload_into, download or copy took.")
      .def_prop_ro("chunk_bytes", [](const PyTransferPlanner& p) { return p.planner->chunk_bytes(); })
      .def_prop_ro("stranded_ranges", [](const PyTransferPlanner& p) { return p.planner->stranded_ranges(); },
                   "Ring ranges the bridge still holds for release_host_after (stats()['ring_releases_pending'],\n"
                   "every caller's): a failed call hands over the ranges its copies may still use, and the bridge\n"
                   "releases each once its copy ends.");
}

}  // namespace devbridge::python
