// HostRing: the bridge's host ring. HostRing.buffer(range) is a writable
// buffer-protocol object over exactly the bytes of one reserved range, so
// numpy.frombuffer / memoryview work on the ring without a copy.
//
// Each buffer export (a memoryview, a numpy array) holds a HostLease on the
// ring, so close() cannot free the ring under it (see state.hpp): the bytes
// stay valid until the export is released. The range is re-validated at
// every export: a released range cannot be exported, nor can anything once
// the bridge is closed.
#include <memory>
#include <string>

#include <Python.h>
#include <nanobind/nanobind.h>

#include "devbridge/types.hpp"
#include "arguments.hpp"
#include "bindings.hpp"
#include "state.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace devbridge::python {
namespace {

struct RingBuffer {
  std::shared_ptr<BridgeState> state;
  HostRange range;
};

int ring_buffer_get(PyObject* self, Py_buffer* view, int flags) {
  RingBuffer* buffer = nb::inst_ptr<RingBuffer>(self);
  try {
    // The lease is taken under the bridge's lock: a concurrent close() either
    // refuses it (Closed) or keeps the ring allocated until it ends.
    auto lease = std::make_unique<HostLease>(buffer->state->open().lease_host(buffer->range));
    std::span<std::byte> bytes = lease->bytes();
    if (PyBuffer_FillInfo(view, self, bytes.data(), static_cast<Py_ssize_t>(bytes.size()), /*readonly=*/0, flags) != 0)
      return -1;
    view->internal = lease.release();  // owned by the export until ring_buffer_release
    return 0;
  } catch (const std::exception& error) {
    set_python_error(error);
    return -1;
  }
}

void ring_buffer_release(PyObject*, Py_buffer* view) {
  // Ends the lease; after close() the last one frees the ring (C++ only).
  delete static_cast<HostLease*>(view->internal);
}

PyType_Slot ring_buffer_slots[] = {
    {Py_bf_getbuffer, reinterpret_cast<void*>(&ring_buffer_get)},
    {Py_bf_releasebuffer, reinterpret_cast<void*>(&ring_buffer_release)},
    {0, nullptr},
};

}  // namespace

void bind_ring(nb::module_& m) {
  nb::class_<RingBuffer>(m, "RingBuffer", nb::type_slots(ring_buffer_slots),
                         "Writable buffer over one reserved range of the host ring (numpy.frombuffer, memoryview).")
      .def_prop_ro("range", [](const RingBuffer& b) { return b.range; })
      .def("__len__", [](const RingBuffer& b) { return b.range.len; })
      .def("__repr__", [](const RingBuffer& b) {
        return "RingBuffer(offset=" + std::to_string(b.range.offset) + ", len=" + std::to_string(b.range.len) + ")";
      });

  nb::class_<PyHostRing>(m, "HostRing", "The bridge's host ring: reserve ranges, fill or read them, release them.")
      .def(
          "reserve",
          [](PyHostRing& ring, nb::handle nbytes, nb::handle alignment, nb::handle timeout) {
            const auto n = args::integer<std::uint64_t>(nbytes, "nbytes");
            const auto a = args::integer<std::uint64_t>(alignment, "alignment");
            const auto wait = args::seconds(timeout, "timeout");
            Bridge& bridge = ring.state->open();
            if (wait.count() == 0) return bridge.reserve(n, a);
            // Other threads release the room waited for (the GIL is released meanwhile).
            return wait_interruptibly(wait, [&](std::chrono::nanoseconds slice, bool last) -> std::optional<HostRange> {
              try {
                return bridge.reserve(n, a, slice);
              } catch (const Error& error) {
                if (error.kind() != ErrorKind::Backpressure || last) throw;
                return std::nullopt;
              }
            });
          },
          "nbytes"_a, "alignment"_a = 64, nb::kw_only(), "timeout"_a = 0.0,
          "Reserves `nbytes` aligned to `alignment` (power of two, <= 4096). Backpressure when full after "
          "`timeout` seconds (0: at once; math.inf: until there is room); a release wakes the wait, close() ends "
          "it with Closed. The ring frees in order: room comes back when the oldest range is released.")
      .def(
          "buffer",
          [](PyHostRing& ring, HostRange range) {
            (void)ring.state->open().host_bytes(range);  // refuse an unreserved range now, not at first use
            return RingBuffer{ring.state, range};
          },
          "range"_a, "A writable buffer-protocol object over exactly the range's bytes.")
      .def(
          "ndarray",
          [](PyHostRing& ring, HostRange range, nb::handle dtype) {
            (void)ring.state->open().host_bytes(range);
            std::string name(dtype_info(parse_dtype(dtype)).name);
            nb::object buffer = nb::cast(RingBuffer{ring.state, range});
            return nb::module_::import_("numpy").attr("frombuffer")(buffer, "dtype"_a = name);
          },
          nb::sig("def ndarray(self, range: HostRange, dtype: object = 'uint8') -> numpy.ndarray"),
          "range"_a, "dtype"_a = "uint8", "numpy.frombuffer over the range (zero-copy, writable).")
      .def(
          "release", [](PyHostRing& ring, HostRange range) { ring.state->open().release_host(range); }, "range"_a,
          "Ends the reservation; AllocationStillInUse while an async copy uses it.")
      .def_prop_ro("capacity", [](PyHostRing& ring) { return ring.state->open().ring_capacity(); })
      .def_prop_ro("free_bytes", [](PyHostRing& ring) { return ring.state->open().ring_free_bytes(); });
}

}  // namespace devbridge::python
