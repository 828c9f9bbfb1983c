// TensorView: a lease on an allocation, and its hand-offs to consumers
// (DLPack, tinygrad). The arguments those hand-offs take are parsed here,
// next to the protocol rules they follow.
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <Python.h>
#include <nanobind/nanobind.h>

#include "devbridge/bridge.hpp"
#include "devbridge/consumer_names.hpp"
#include "arguments.hpp"
#include "bindings.hpp"
#include "devbridge/wait_check.hpp"
#include "state.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace devbridge::python {
namespace {

// An int or a sequence of ints, each an int64 (OverflowError past it); the
// bridge checks the values (InvalidTensorView). More than kMaxRank entries
// is InvalidTensorView too (Dims::push_back).
Dims parse_dims(nb::handle object, const char* what) {
  Dims dims;
  if (PyIndex_Check(object.ptr()) && !PyFloat_Check(object.ptr())) {
    dims.push_back(args::integer<std::int64_t>(object, what));
    return dims;
  }
  if (!nb::isinstance<nb::sequence>(object) || nb::isinstance<nb::str>(object) || nb::isinstance<nb::bytes>(object))
    args::raise(PyExc_TypeError, std::string(what) + " must be an int or a sequence of ints, not " +
                                     nb::cast<std::string>(nb::str(object.type().attr("__name__"))));
  for (nb::handle item : object) dims.push_back(args::integer<std::int64_t>(item, what));
  return dims;
}

nb::tuple dims_tuple(const Dims& dims) {
  nb::list items;
  for (std::int64_t v : dims) items.append(v);
  return nb::tuple(items);
}

// ---- __dlpack__'s arguments ----
// Per the Array API spec, an argument of the wrong type or range is a
// TypeError/OverflowError (args::); what devbridge cannot export as asked (a
// stream on a device without streams, another device, a copy) is BufferError.

[[noreturn]] void raise_buffer_error(const std::string& message) { args::raise(PyExc_BufferError, message); }

// A (a, b) pair: a tuple or list of two items, else TypeError.
std::pair<nb::object, nb::object> parse_pair(nb::handle value, const char* what) {
  if (!(PyTuple_Check(value.ptr()) || PyList_Check(value.ptr())) || PySequence_Size(value.ptr()) != 2)
    args::raise(PyExc_TypeError, std::string(what) + " must be a tuple of two ints, not " +
                                     nb::cast<std::string>(nb::repr(value)));
  return {nb::borrow(PySequence_Fast_GET_ITEM(value.ptr(), 0)), nb::borrow(PySequence_Fast_GET_ITEM(value.ptr(), 1))};
}

// max_version: the highest DLPack version the consumer reads (uint32 each,
// as DLPack's version fields). >= (1, 0) gets the versioned ABI (it carries
// the writable flag); older consumers, and none named, the unversioned one.
std::optional<DLPackAbi> parse_dlpack_max_version(nb::handle max_version) {
  if (max_version.is_none()) return std::nullopt;
  auto [major_object, minor_object] = parse_pair(max_version, "__dlpack__: max_version");
  const auto major = args::integer<std::uint32_t>(major_object, "__dlpack__: max_version's major");
  const auto minor = args::integer<std::uint32_t>(minor_object, "__dlpack__: max_version's minor");
  if (major < 1) return std::nullopt;
  return DLPackAbi{1, major > 1 || minor >= 1 ? 1u : 0u};
}

// dl_device: (device type, device id) as __dlpack_device__ gives them
// (int32 each, as DLPack's DLDevice); only the view's own device exports.
void check_dlpack_device(const PyTensorView& view, nb::handle dl_device) {
  if (dl_device.is_none()) return;
  auto [type_object, id_object] = parse_pair(dl_device, "__dlpack__: dl_device");
  const auto type = args::integer<std::int32_t>(type_object, "__dlpack__: dl_device's device type");
  const auto id = args::integer<std::int32_t>(id_object, "__dlpack__: dl_device's device id");
  if (type != view.meta.dlpack_device_type || id != view.meta.device_ordinal)
    raise_buffer_error("__dlpack__: devbridge exports views only on their own device (" +
                       std::to_string(view.meta.dlpack_device_type) + ", " + std::to_string(view.meta.device_ordinal) +
                       "), not (" + std::to_string(type) + ", " + std::to_string(id) + ")");
}

// The stream rules of the DLPack Python spec, per device type. Returns the
// CUDA stream to order after the bridge's work (DLPack numbering: 1 legacy
// default, 2 per-thread default, else a CUstream), or nothing.
std::optional<std::uintptr_t> parse_dlpack_stream(const PyTensorView& view, nb::handle stream) {
  std::optional<std::int64_t> no_sync;  // -1: the consumer asks for no synchronisation
  std::uint64_t value = 0;
  if (!stream.is_none()) {
    // Any integer (an __index__: numpy's too), -1 among them.
    nb::object index = PyIndex_Check(stream.ptr()) ? nb::steal(PyNumber_Index(stream.ptr())) : nb::object();
    if (index.is_valid() && PyLong_AsLongLong(index.ptr()) == -1 && !PyErr_Occurred()) {
      no_sync = -1;
    } else {
      PyErr_Clear();
      value = args::integer<std::uint64_t>(stream, "__dlpack__: stream (None, -1 or a stream)");
    }
  }
  auto device = static_cast<DLPackDevice>(view.meta.dlpack_device_type);
  if (device == DLPackDevice::CUDA) {
    // None/1: legacy default stream, 2: per-thread default, >2: a CUstream,
    // -1: no synchronisation. 0 is ambiguous.
    if (no_sync) return std::nullopt;
    if (stream.is_none()) return std::uintptr_t{1};
    if (value == 0) raise_buffer_error("__dlpack__: stream 0 is ambiguous and not allowed for CUDA (use 1 or 2)");
    return static_cast<std::uintptr_t>(value);
  }
  // Host memory has no stream: the spec accepts only None; -1 ("do not
  // synchronise") is accepted as well, since there is nothing to skip.
  if (!stream.is_none() && !no_sync)
    raise_buffer_error("__dlpack__: a " + view.device + " view has no stream; pass stream=None (or -1)");
  return std::nullopt;
}

// The driver context the bridge's device addresses are valid in (a CUDA
// backend's CUcontext), 0 for a backend without one: read once, when the
// bridge opened (BackendCapabilities::native_context).
std::uint64_t native_context_of(BridgeState& state) { return state.native_context; }

// Makes a consumer's queue (DLPack numbering for CUDA: 1 legacy default, 2
// per-thread default, else a CUstream) wait on the device for everything
// submitted to the bridge's backend so far, compute steps included. A no-op
// for backends without queues.
void order_consumer_queue(BridgeState& state, std::uintptr_t queue) {
  Bridge& bridge = state.open();
  GilReleased no_gil;
  try {
    bridge.backend().order_consumer_queue(queue);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Unsupported) throw;
  }
}

}  // namespace

nb::object tinygrad_helper(const char* name) {
  return nb::module_::import_("devbridge._tinygrad").attr(name);
}

ViewSpec parse_view_spec(nb::handle dtype, nb::handle shape, nb::handle strides, nb::handle offset) {
  ViewSpec spec;
  spec.dtype = parse_dtype(dtype);
  spec.shape = parse_dims(shape, "shape");
  if (!strides.is_none()) spec.strides = parse_dims(strides, "strides");
  spec.byte_offset = args::integer<std::uint64_t>(offset, "offset");
  return spec;
}

PyTensorView make_view(const std::shared_ptr<BridgeState>& state, DeviceHandle handle, const ViewSpec& spec,
                       ViewWait wait) {
  PyTensorView view;
  view.state = state;
  view.lease = acquire_lease(state, handle, spec, wait);
  view.meta = view.lease.view();
  view.device = std::string(view.meta.device);
  view.meta.device = {};
  view.spec = spec;
  return view;
}

void end_lease_after(ViewLease& lease, std::uintptr_t queue) noexcept {
  try {
    lease.end_after(ConsumerQueue{queue});
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::Unsupported) return lease.reset();  // its consumers have no queues
    // The consumer may still read the memory on its queue and no fence can
    // say when it stops: keep the memory for good rather than free it under
    // that work.
    std::fprintf(stderr,
                 "devbridge: could not order the end of a view after consumer stream %#llx (%s); its memory stays "
                 "allocated\n",
                 static_cast<unsigned long long>(queue), e.what());
    new ViewLease(std::move(lease));  // NOLINT: deliberately never ended
  } catch (const std::exception& e) {
    std::fprintf(stderr, "devbridge: ending a view after consumer stream %#llx failed (%s); its memory stays allocated\n",
                 static_cast<unsigned long long>(queue), e.what());
    new ViewLease(std::move(lease));  // NOLINT: deliberately never ended
  }
}

ViewLease share_lease(const PyTensorView& view, const char* what) {
  ViewLease shared;
  {
    const InterruptibleCall waits;  // for uploads in flight into the allocation
    shared = view.lease.share();
  }
  if (!shared) throw Error(ErrorKind::Closed, std::string(what) + ": the view is closed");
  return shared;
}

ViewLease acquire_lease(const std::shared_ptr<BridgeState>& state, DeviceHandle handle, const ViewSpec& spec,
                        ViewWait wait) {
  Bridge& bridge = state->open();
  if (wait == ViewWait::Wait) {
    const InterruptibleCall waits;
    return bridge.view(handle, spec, wait);
  }
  return bridge.view(handle, spec, wait);
}

void bind_views(nb::module_& m) {
  m.attr("MAX_RANK") = kMaxRank;  // the most dimensions a view (and so a tensor) has
  nb::class_<PyTensorView>(
      m, "TensorView",
      "A zero-copy view over a live allocation. Holds a lease: the allocation is not freed while the view is open.\n"
      "close() (or the end of a `with` block, or garbage collection) ends the lease.")
      .def_prop_ro("ptr",
                   [](const PyTensorView& v) {
                     v.check_usable("TensorView.ptr");
                     return v.meta.data + v.meta.byte_offset;
                   },
                   "Address of the first element (the allocation's address plus the byte offset).")
      .def_prop_ro("data", [](const PyTensorView& v) { return v.meta.data; }, "The allocation's address.")
      .def_prop_ro("byte_offset", [](const PyTensorView& v) { return v.meta.byte_offset; })
      .def_prop_ro("device", [](const PyTensorView& v) { return v.device; }, "tinygrad's device name: CPU, CUDA:0, ...")
      .def_prop_ro("dtype", [](const PyTensorView& v) { return std::string(dtype_info(v.meta.dtype).name); })
      .def_prop_ro("itemsize", [](const PyTensorView& v) { return dtype_info(v.meta.dtype).size; })
      .def_prop_ro("shape", [](const PyTensorView& v) { return dims_tuple(v.meta.shape); })
      .def_prop_ro("strides", [](const PyTensorView& v) { return dims_tuple(v.meta.strides); }, "Element strides.")
      .def_prop_ro("size",
                   [](const PyTensorView& v) {
                     std::int64_t n = 1;
                     for (std::int64_t d : v.meta.shape) n *= d;
                     return n;
                   })
      .def_prop_ro("nbytes",
                   [](const PyTensorView& v) {
                     std::int64_t n = 1;
                     for (std::int64_t d : v.meta.shape) n *= d;
                     return n * static_cast<std::int64_t>(dtype_info(v.meta.dtype).size);
                   })
      .def_prop_ro("contiguous", [](const PyTensorView& v) { return v.meta.contiguous(); })
      .def_prop_ro("handle", [](const PyTensorView& v) { return v.meta.handle; })
      .def_prop_ro("read_only", [](const PyTensorView& v) { return v.meta.read_only; },
                   "True for a view of adopted read-only host memory (Bridge.adopt_host): write nothing through it.")
      .def_prop_ro("closed", [](const PyTensorView& v) { return v.closed(); })
      .def_prop_ro("_native_context", [](const PyTensorView& v) { return native_context_of(*v.state); },
                   "The driver context the bridge allocates in (CUDA: the CUcontext), 0 where there is none.")
      .def(
          "_order_consumer_stream",
          [](const PyTensorView& v, nb::handle stream) {
            order_consumer_queue(*v.state, args::integer<std::uintptr_t>(stream, "stream"));
          },
          "stream"_a,
          "Makes a consumer's stream (CUDA: 1 legacy default, 2 per-thread, else a CUstream) wait on the device for "
          "the bridge's submitted work.")
      .def(
          "_end_after_stream",
          [](PyTensorView& v, nb::handle stream) {
            v.end_after_queue = args::integer<std::uintptr_t>(stream, "stream");
          },
          "stream"_a, "When this lease ends, its memory stays held until the consumer's stream has passed it.")
      .def(
          "close",
          [](PyTensorView& v, nb::handle stream) {
            if (stream.is_none()) return v.close();
            const auto queue = args::integer<std::uintptr_t>(stream, "stream");  // checked on a closed view too
            if (v.closed()) return;
            v.close_after(queue);
          },
          "stream"_a.none() = nb::none(),
          "Ends the view's lease (idempotent). With stream= (a consumer's queue: CUDA 1 legacy default, 2 per-thread,\n"
          "else a CUstream; OpenCL a cl_command_queue), the memory stays held until that queue has run the work\n"
          "enqueued on it so far (PyTorch's record_stream); Unsupported where the device's consumers have no queues.")
      // Self for type checkers: `with Bridge() as b` is the subclass, with its methods.
      .def("__enter__", [](nb::handle self) { return nb::borrow(self); },
           nb::sig("def __enter__(self) -> typing_extensions.Self"))
      .def(
          "__exit__", [](PyTensorView& v, nb::handle, nb::handle, nb::handle) { v.close(); }, "exc_type"_a.none(),
          "exc"_a.none(), "tb"_a.none())
      .def(
          "_export_for_tinygrad",
          [](const PyTensorView& v) {
            // Everything to_tinygrad needs from the view, checked, in one call:
            // the hand-off runs right after large copies, with cold caches,
            // where every attribute access costs microseconds.
            v.check_usable("to_tinygrad");
            // tinygrad computes in what it is handed: a dtype the device only holds is refused here.
            v.state->open().require_compute(v.meta.dtype, "to_tinygrad");
            if (!v.meta.contiguous())
              throw Error(ErrorKind::Unsupported,
                          "to_tinygrad: tinygrad's Tensor.from_blob takes only row-major contiguous memory; this view has "
                          "shape " + nb::cast<std::string>(nb::repr(dims_tuple(v.meta.shape))) + " and strides " +
                              nb::cast<std::string>(nb::repr(dims_tuple(v.meta.strides))) +
                              " (elements). Take a contiguous view, or copy.");
            PyTensorView lease;
            lease.state = v.state;
            lease.lease = share_lease(v, "to_tinygrad");
            lease.meta = v.meta;
            lease.device = v.device;
            lease.spec = v.spec;
            lease.lease.set_holder(ViewHolder::TinygradTensor);
            const std::uint64_t ptr = lease.meta.data + lease.meta.byte_offset;
            nb::tuple shape = dims_tuple(lease.meta.shape);
            std::string device = lease.device;
            return nb::make_tuple(std::move(lease), ptr, shape, std::string(dtype_info(v.meta.dtype).tinygrad_name),
                                  device);
          },
          "(lease, ptr, shape, tinygrad dtype name, device): a new view with its own lease, taken after every copy\n"
          "into the allocation has completed, and what to_tinygrad needs from it.")
      .def(
          "to_tinygrad", [](nb::handle self) { return tinygrad_helper("to_tinygrad")(self); },
          nb::sig("def to_tinygrad(self) -> tinygrad.Tensor"),
          "A tinygrad.Tensor over this view's memory, zero-copy (see devbridge._tinygrad.to_tinygrad).")
      .def(
          "__dlpack__",
          [](const PyTensorView& v, nb::handle stream, nb::handle max_version, nb::handle dl_device,
             nb::handle copy) {
            std::optional<DLPackAbi> versioned = parse_dlpack_max_version(max_version);
            const bool wants_copy = !copy.is_none() && args::flag(copy, "__dlpack__: copy");
            v.check_usable("__dlpack__");
            check_dlpack_device(v, dl_device);
            const std::optional<std::uintptr_t> consumer_stream = parse_dlpack_stream(v, stream);
            if (consumer_stream) order_consumer_queue(*v.state, *consumer_stream);
            return make_dlpack_capsule(share_lease(v, "__dlpack__"), versioned, consumer_stream, wants_copy);
          },
          nb::kw_only(), "stream"_a.none() = nb::none(), "max_version"_a.none() = nb::none(),
          "dl_device"_a.none() = nb::none(), "copy"_a.none() = nb::none(),
          nb::sig("def __dlpack__(self, *, stream: object | None = None, max_version: object | None = None, "
                  "dl_device: object | None = None, copy: object | None = None) -> typing_extensions.CapsuleType"),
          "A DLPack capsule with its own lease (\"dltensor_versioned\" for max_version >= (1, 0), else\n"
          "\"dltensor\"); its deleter ends the lease, and on a device with streams the memory stays held until the\n"
          "consumer's stream has passed the work enqueued on it by then. Host views take stream None (or -1).")
      .def("__dlpack_device__",
           [](const PyTensorView& v) { return nb::make_tuple(v.meta.dlpack_device_type, v.meta.device_ordinal); })
      .def("__repr__", [](const PyTensorView& v) {
        std::string r = "TensorView(device=\"" + v.device + "\", dtype=\"" + std::string(dtype_info(v.meta.dtype).name) +
                        "\", shape=" + nb::cast<std::string>(nb::repr(dims_tuple(v.meta.shape))) +
                        ", strides=" + nb::cast<std::string>(nb::repr(dims_tuple(v.meta.strides))) +
                        ", byte_offset=" + std::to_string(v.meta.byte_offset) + ", " + handle_repr(v.meta.handle);
        return r + (v.closed() ? ", closed)" : ")");
      });
}

}  // namespace devbridge::python
