// devbridge._devbridge: the nanobind bindings of the C++ bridge.
//
// The public Python API lives in python/devbridge/__init__.py, which
// re-exports these classes and defines the exception classes (BridgeError and
// one subclass per ErrorKind, registered back here so every devbridge::Error
// surfaces as the subclass named after its kind).
//
// GIL: calls that can block (waits, sync copies, views that wait for copies,
// restart, close, bridge construction) release it; nothing below the
// bindings ever calls back into Python, so that is always safe.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "devbridge/backends.hpp"
#include "devbridge/bridge.hpp"
#include "devbridge/backends/fake.hpp"
#include "arguments.hpp"
#include "state.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace devbridge::python {

// ============================================================================
// Errors
// ============================================================================

namespace {

// devbridge.<Kind> exception classes, indexed by ErrorKind; set by
// devbridge/__init__.py at import. Strong references kept for the life of
// the process (module teardown order is not ours to rely on).
PyObject* g_error_classes[kErrorKindCount] = {};

PyObject* utf8(std::string_view text) {
  return PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "replace");
}

void raise_bridge_error(const Error& error) {
  PyObject* cls = g_error_classes[static_cast<int>(error.kind())];
  if (cls == nullptr) {  // the extension imported without its package
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return;
  }
  PyObject* what = utf8(error.what());
  if (what == nullptr) return;
  PyObject* instance = PyObject_CallOneArg(cls, what);
  Py_DECREF(what);
  if (instance == nullptr) return;
  PyObject* message = utf8(error.message());
  if (message == nullptr || PyObject_SetAttrString(instance, "message", message) != 0 ||
      PyObject_SetAttrString(instance, "fatal", error.fatal() ? Py_True : Py_False) != 0) {
    Py_XDECREF(message);
    Py_DECREF(instance);
    return;
  }
  Py_DECREF(message);
  PyErr_SetObject(cls, instance);
  Py_DECREF(instance);
}

}  // namespace

void set_python_error(const std::exception& error) noexcept {
  if (const auto* bridge_error = dynamic_cast<const Error*>(&error)) {
    raise_bridge_error(*bridge_error);
  } else if (dynamic_cast<const std::bad_alloc*>(&error) != nullptr) {
    PyErr_NoMemory();
  } else if (auto* python_error = dynamic_cast<nb::python_error*>(const_cast<std::exception*>(&error))) {
    python_error->restore();  // restore() hands the Python error back; it is not const
  } else if (const auto* builtin = dynamic_cast<const nb::builtin_exception*>(&error)) {
    PyErr_SetString(builtin->type() == nb::exception_type::value_error ? PyExc_ValueError : PyExc_TypeError,
                    builtin->what());
  } else {
    PyErr_SetString(PyExc_RuntimeError, error.what());
  }
}

namespace {

[[noreturn]] void throw_unsupported(std::string message) {
  throw Error(ErrorKind::Unsupported, message);
}

// ============================================================================
// Argument parsing
// ============================================================================

std::string lower(std::string text) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

std::string known_dtype_names() {
  std::string names;
  for (const DTypeInfo& info : all_dtypes()) {
    if (!names.empty()) names += ", ";
    names += info.name;
  }
  return names;
}

// A dtype named as numpy and tinygrad name it ("float32"), or given as a
// numpy dtype/type or a tinygrad DType.
DType parse_dtype(nb::handle object) {
  std::string name;
  if (nb::isinstance<nb::str>(object)) {
    name = nb::cast<std::string>(object);
  } else {
    nb::handle type = object.type();
    std::string module_name = nb::hasattr(type, "__module__") ? nb::cast<std::string>(nb::str(type.attr("__module__"))) : "";
    if (module_name.rfind("tinygrad", 0) == 0) {
      // tinygrad's DType names are C names ("float", "__bf16"): match the object.
      nb::object tinygrad_dtypes = nb::module_::import_("tinygrad").attr("dtypes");
      for (const DTypeInfo& info : all_dtypes()) {
        nb::object candidate = nb::getattr(tinygrad_dtypes, std::string(info.tinygrad_name).c_str(), nb::none());
        if (!candidate.is_none() && candidate.equal(object)) return info.dtype;
      }
      throw nb::value_error(("dtype " + nb::cast<std::string>(nb::repr(object)) + " has no devbridge equivalent").c_str());
    }
    try {
      name = nb::cast<std::string>(nb::module_::import_("numpy").attr("dtype")(object).attr("name"));
    } catch (const nb::python_error&) {
      throw nb::type_error(("dtype must be a name such as \"float32\", a numpy dtype or a tinygrad DType, not " +
                            nb::cast<std::string>(nb::repr(object))).c_str());
    }
  }
  if (std::optional<DType> dtype = dtype_from_name(name)) return *dtype;
  throw nb::value_error(("unknown dtype \"" + name + "\"; devbridge knows: " + known_dtype_names()).c_str());
}

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

// An ObjectSpec's dtype: any dtype parse_dtype takes, or "bytes" / None for
// an untyped allocation.
std::optional<DType> parse_spec_dtype(nb::handle object) {
  if (object.is_none()) return std::nullopt;
  if (nb::isinstance<nb::str>(object) && nb::cast<std::string>(object) == "bytes") return std::nullopt;
  return parse_dtype(object);
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

ShapeKind parse_shape_kind(const std::string& name) {
  std::string n = lower(name);
  if (n == "scalar") return ShapeKind::Scalar;
  if (n == "vector") return ShapeKind::Vector;
  if (n == "matrix") return ShapeKind::Matrix;
  if (n == "tensor") return ShapeKind::Tensor;
  throw nb::value_error(("shape kind must be scalar, vector, matrix or tensor, not \"" + name + "\"").c_str());
}

template <typename Enum>
Enum parse_named(std::string_view name, int count, std::string_view (*namer)(Enum) noexcept, const char* what) {
  std::string known;
  for (int i = 0; i < count; ++i) {
    auto value = static_cast<Enum>(i);
    if (namer(value) == name) return value;
    if (!known.empty()) known += ", ";
    known += namer(value);
  }
  throw nb::value_error((std::string("unknown fake ") + what + " \"" + std::string(name) + "\"; known: " + known).c_str());
}

std::string handle_repr(const DeviceHandle& h) {
  return "DeviceHandle(domain=" + std::to_string(h.domain) + ", generation=" + std::to_string(h.generation) +
         ", id=" + std::to_string(h.id) + ")";
}

std::string event_repr(const CopyEvent& e) {
  return "CopyEvent(domain=" + std::to_string(e.domain) + ", generation=" + std::to_string(e.generation) +
         ", id=" + std::to_string(e.id) + ")";
}

std::size_t hash_triple(std::uint64_t a, std::uint64_t b, std::uint64_t c) {
  std::uint64_t h = a * 0x9E3779B97F4A7C15ull;
  h ^= b + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  h ^= c + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  return static_cast<std::size_t>(h);
}

// DeviceHandle and CopyEvent: the same {domain, generation, id} value type.
template <class Tagged>
void bind_tagged(nb::module_& m, const char* name, const char* doc, std::string (*repr)(const Tagged&)) {
  nb::class_<Tagged>(m, name, doc)
      .def(
          "__init__",
          [](Tagged* self, nb::handle domain, nb::handle generation, nb::handle id) {
            new (self) Tagged{args::integer<std::uint64_t>(domain, "domain"),
                              args::integer<std::uint64_t>(generation, "generation"),
                              args::integer<std::uint64_t>(id, "id")};
          },
          "domain"_a, "generation"_a, "id"_a)
      .def_ro("domain", &Tagged::domain)
      .def_ro("generation", &Tagged::generation)
      .def_ro("id", &Tagged::id)
      .def("__eq__", [](const Tagged& a, const Tagged& b) { return a == b; })
      .def("__eq__", [](const Tagged&, nb::handle) { return false; })
      .def("__hash__", [](const Tagged& t) { return hash_triple(t.domain, t.generation, t.id); })
      .def("__repr__", repr);
}

// ============================================================================
// Python-facing objects
// ============================================================================

struct PyBridge {
  std::shared_ptr<BridgeState> state;
};

struct PyHostRing {
  std::shared_ptr<BridgeState> state;
};

struct PyFake {
  std::shared_ptr<BridgeState> state;
  fake::FakeBackend& backend() const { return *state->fake; }
};

// A view and the lease that keeps its allocation alive. The metadata stays
// readable after close(); the address does not.
struct PyTensorView {
  std::shared_ptr<BridgeState> state;
  ViewLease lease;  // survives close(): the memory stays valid until it ends
  TensorView meta;
  std::string device;  // meta.device points into the backend; keep our own copy
  ViewSpec spec;       // what the caller asked for, to take further leases

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

  void close() {
    lease.reset();
  }
};

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
  d["active_steps"] = s.active_steps;
  d["restarts"] = s.restarts;
  d["ring_capacity"] = s.ring_capacity;
  d["ring_used"] = s.ring_used;
  d["ring_reservations"] = s.ring_reservations;
  return d;
}

const char* dlpack_device_name(DLPackDevice device) {
  switch (device) {
    case DLPackDevice::CPU: return "cpu";
    case DLPackDevice::CUDA: return "cuda";
    case DLPackDevice::CUDAHost: return "cuda_host";
    case DLPackDevice::OpenCL: return "opencl";
  }
  return "unknown";
}

nb::dict backend_info_dict(const BackendInfo& info) {
  nb::dict d;
  d["name"] = info.name;
  d["vendor"] = info.vendor;
  d["device_id"] = info.device_id;
  d["device_name"] = info.device_name;
  d["pci_bus_id"] = info.pci_bus_id;
  d["device_string"] = info.device_string;
  d["dlpack_device"] = nb::make_tuple(static_cast<int>(info.dlpack_device), info.device_ordinal);
  d["dlpack_device_name"] = dlpack_device_name(info.dlpack_device);
  d["device_ordinal"] = info.device_ordinal;
  d["total_memory"] = info.total_memory;
  d["free_memory"] = info.free_memory;
  nb::list dtypes;
  for (DType dtype : info.dtypes) dtypes.append(std::string(dtype_info(dtype).name));
  d["dtypes"] = dtypes;
  nb::list capabilities;
  for (const std::string& capability : info.capabilities) capabilities.append(capability);
  d["capabilities"] = capabilities;
  d["host_memory_page_locked"] = info.host_memory_page_locked;
  d["host_addressable"] = info.host_addressable;
  d["notes"] = info.notes;
  return d;
}

nb::object tinygrad_helper(const char* name);

// A backend option's value as the registry takes it (text). str and int
// only: anything else would have to be guessed at.
std::string option_text(nb::handle value, const std::string& key) {
  if (nb::isinstance<nb::str>(value)) return nb::cast<std::string>(value);
  if (nb::isinstance<nb::int_>(value) && !nb::isinstance<nb::bool_>(value)) return nb::cast<std::string>(nb::str(value));
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

nb::dict recorded_call_dict(const fake::RecordedCall& call) {
  nb::dict d;
  d["call"] = std::string(fake::call_name(call.call));
  d["bytes"] = call.bytes;
  d["alignment"] = call.alignment;
  d["address"] = call.address;
  d["host_offset"] = call.host_offset;
  d["device_offset"] = call.device_offset;
  d["mode"] = call.mode == CopyMode::Async ? "async" : "sync";
  d["event"] = nb::cast(call.event);
  return d;
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
    if (PyLong_Check(stream.ptr()) && PyLong_AsLongLong(stream.ptr()) == -1 && !PyErr_Occurred()) {
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
// backend's CUcontext), 0 for a backend without one.
std::uint64_t native_context_of(BridgeState& state) {
  try {
    return state.bridge->backend().native_context();
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::Unsupported) return 0;
    throw;
  }
}

// Makes a consumer's queue (DLPack numbering for CUDA: 1 legacy default, 2
// per-thread default, else a CUstream) wait on the device for everything
// submitted to the bridge's backend so far, compute steps included. A no-op
// for backends without queues.
void order_consumer_queue(BridgeState& state, std::uintptr_t queue) {
  Bridge& bridge = state.open();
  nb::gil_scoped_release no_gil;
  try {
    bridge.backend().order_consumer_queue(queue);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Unsupported) throw;
  }
}

nb::object tinygrad_helper(const char* name) {
  return nb::module_::import_("devbridge._tinygrad").attr(name);
}

}  // namespace

ViewLease acquire_lease(const std::shared_ptr<BridgeState>& state, DeviceHandle handle, const ViewSpec& spec,
                        ViewWait wait) {
  Bridge& bridge = state->open();
  if (wait == ViewWait::Wait) {
    nb::gil_scoped_release no_gil;
    return bridge.view(handle, spec, wait);
  }
  return bridge.view(handle, spec, wait);
}

// ============================================================================
// Module
// ============================================================================

void bind_module(nb::module_& m) {
  m.doc() = "devbridge: host ring <-> device memory bridge with zero-copy tensor views (C++ core bindings)";

  nb::register_exception_translator(
      [](const std::exception_ptr& pointer, void*) {
        try {
          std::rethrow_exception(pointer);
        } catch (const Error& error) {
          raise_bridge_error(error);
        }
      },
      nullptr);

  m.def("_error_kinds", [] {
    nb::list kinds;
    for (int i = 0; i < kErrorKindCount; ++i) kinds.append(std::string(kind_name(static_cast<ErrorKind>(i))));
    return kinds;
  });
  m.def(
      "_register_errors",
      [](nb::list classes) {
        if (nb::len(classes) != static_cast<std::size_t>(kErrorKindCount))
          throw nb::value_error("_register_errors: one class per error kind, in ErrorKind order");
        for (int i = 0; i < kErrorKindCount; ++i) {
          PyObject* cls = classes[i].ptr();
          Py_INCREF(cls);
          Py_XDECREF(g_error_classes[i]);
          g_error_classes[i] = cls;
        }
      },
      "classes"_a);
  m.def("_raise_for_test", [](const std::string& kind, const std::string& message) {
    for (int i = 0; i < kErrorKindCount; ++i)
      if (kind_name(static_cast<ErrorKind>(i)) == kind) throw Error(static_cast<ErrorKind>(i), message);
    throw nb::value_error("unknown kind");
  });

  m.def(
      "dtypes",
      [] {
        nb::list names;
        for (const DTypeInfo& info : all_dtypes()) names.append(std::string(info.name));
        return names;
      },
      "The dtype names devbridge knows, as numpy and tinygrad spell them.");
  m.def(
      "dtype_info",
      [](nb::handle dtype) {
        const DTypeInfo& info = dtype_info(parse_dtype(dtype));
        nb::dict d;
        d["name"] = std::string(info.name);
        d["tinygrad_name"] = std::string(info.tinygrad_name);
        d["itemsize"] = info.size;
        d["dlpack_code"] = static_cast<int>(info.dlpack_code);
        d["dlpack_bits"] = static_cast<int>(info.dlpack_bits);
        return d;
      },
      "dtype"_a);
  m.def(
      "list_backends",
      [] {
        nb::list out;
        for (const BackendAvailability& b : list_backends()) {
          nb::dict d;
          d["name"] = b.name;
          d["built"] = b.built;
          d["available"] = b.available;
          d["reason"] = b.reason;
          out.append(d);
        }
        return out;
      },
      "The backends of this build: name, built, available here, and why not.");
  m.def(
      "devices",
      [](const std::string& backend) {
        std::vector<BackendInfo> found;
        {
          nb::gil_scoped_release no_gil;
          found = list_devices(backend);
        }
        nb::list out;
        for (const BackendInfo& info : found) out.append(backend_info_dict(info));
        return out;
      },
      "backend"_a,
      "The devices `backend` can bind, as Bridge.backend_info() describes each; its device_id is what\n"
      "Bridge(backend, device=...) takes. Empty when the backend is unavailable here.");

  // ---- value types ----
  bind_tagged<DeviceHandle>(m, "DeviceHandle", "{domain, generation, id}: names one device allocation of one bridge.",
                            &handle_repr);
  bind_tagged<CopyEvent>(m, "CopyEvent", "{domain, generation, id}: names one copy; never aliases a later copy.",
                         &event_repr);

  nb::class_<HostRange>(m, "HostRange", "A reserved range of the host ring: byte offset into the ring and length.")
      .def(
          "__init__",
          [](HostRange* self, nb::handle offset, nb::handle len) {
            new (self) HostRange{args::integer<std::uint64_t>(offset, "offset"), args::integer<std::uint64_t>(len, "len")};
          },
          "offset"_a, "len"_a)
      .def_ro("offset", &HostRange::offset)
      .def_ro("len", &HostRange::len)
      .def("__len__", [](const HostRange& r) { return r.len; })
      .def("__eq__", [](const HostRange& a, const HostRange& b) { return a == b; })
      .def("__eq__", [](const HostRange&, nb::handle) { return false; })
      .def("__hash__", [](const HostRange& r) { return hash_triple(r.offset, r.len, 0x486f737452616e67ull); })
      .def("__repr__", [](const HostRange& r) {
        return "HostRange(offset=" + std::to_string(r.offset) + ", len=" + std::to_string(r.len) + ")";
      });

  nb::class_<ObjectSpec>(m, "ObjectSpec",
                         "What an allocation may hold: max extent (bytes), alignment (bytes), dtype, shape kind.")
      .def(
          "__init__",
          [](ObjectSpec* self, nb::handle max_extent, nb::handle alignment, nb::handle dtype,
             const std::string& shape) {
            new (self) ObjectSpec{args::integer<std::uint64_t>(max_extent, "max_extent"),
                                  args::integer<std::uint64_t>(alignment, "alignment"), parse_spec_dtype(dtype),
                                  parse_shape_kind(shape)};
          },
          "max_extent"_a, "alignment"_a, "dtype"_a.none(), "shape"_a = "tensor",
          "dtype: a dtype name (\"float32\"), a numpy or tinygrad dtype, or \"bytes\"/None for an untyped "
          "allocation that views of any dtype may share at offsets aligned to their dtype.")
      .def_ro("max_extent", &ObjectSpec::max_extent)
      .def_ro("alignment", &ObjectSpec::alignment)
      .def_prop_ro("dtype", [](const ObjectSpec& s) { return std::string(spec_dtype_name(s)); },
                   "The dtype's name; \"bytes\" for an untyped allocation.")
      .def_prop_ro("shape", [](const ObjectSpec& s) { return std::string(shape_kind_name(s.shape)); })
      .def("__repr__", [](const ObjectSpec& s) {
        return "ObjectSpec(max_extent=" + std::to_string(s.max_extent) + ", alignment=" + std::to_string(s.alignment) +
               ", dtype=\"" + std::string(spec_dtype_name(s)) + "\", shape=\"" +
               std::string(shape_kind_name(s.shape)) + "\")";
      });

  bind_ring_buffer(m);

  // ---- host ring ----
  nb::class_<PyHostRing>(m, "HostRing", "The bridge's host ring: reserve ranges, fill or read them, release them.")
      .def(
          "reserve",
          [](PyHostRing& ring, nb::handle nbytes, nb::handle alignment) {
            const auto n = args::integer<std::uint64_t>(nbytes, "nbytes");
            const auto a = args::integer<std::uint64_t>(alignment, "alignment");
            return ring.state->open().reserve(n, a);
          },
          "nbytes"_a, "alignment"_a = 64,
          "Reserves `nbytes` aligned to `alignment` (power of two, <= 4096); Backpressure when full.")
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
          "range"_a, "dtype"_a = "uint8", "numpy.frombuffer over the range (zero-copy, writable).")
      .def(
          "release", [](PyHostRing& ring, HostRange range) { ring.state->open().release_host(range); }, "range"_a,
          "Ends the reservation; AllocationStillInUse while an async copy uses it.")
      .def_prop_ro("capacity", [](PyHostRing& ring) { return ring.state->open().ring_capacity(); })
      .def_prop_ro("free_bytes", [](PyHostRing& ring) { return ring.state->open().ring_free_bytes(); });

  // ---- tensor views ----
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
      .def_prop_ro("closed", [](const PyTensorView& v) { return v.closed(); })
      .def_prop_ro("_cuda_context", [](const PyTensorView& v) { return native_context_of(*v.state); },
                   "The CUcontext the bridge allocates in (0 when not CUDA).")
      .def(
          "_order_cuda_stream",
          [](const PyTensorView& v, nb::handle stream) {
            order_consumer_queue(*v.state, args::integer<std::uintptr_t>(stream, "stream"));
          },
          "stream"_a, "Orders a CUDA stream (1: legacy default, 2: per-thread) after the bridge's submitted work.")
      .def("close", &PyTensorView::close, "Ends the view's lease (idempotent).")
      .def("__enter__", [](nb::handle self) { return nb::borrow(self); })
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
            if (!v.meta.contiguous())
              throw Error(ErrorKind::Unsupported,
                          "to_tinygrad: tinygrad's Tensor.from_blob takes only row-major contiguous memory; this view has "
                          "shape " + nb::cast<std::string>(nb::repr(dims_tuple(v.meta.shape))) + " and strides " +
                              nb::cast<std::string>(nb::repr(dims_tuple(v.meta.strides))) +
                              " (elements). Take a contiguous view, or copy.");
            PyTensorView lease = make_view(v.state, v.meta.handle, v.spec, ViewWait::Wait);
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
          "A tinygrad.Tensor over this view's memory, zero-copy (see devbridge._tinygrad.to_tinygrad).")
      .def(
          "__dlpack__",
          [](const PyTensorView& v, nb::handle stream, nb::handle max_version, nb::handle dl_device,
             nb::handle copy) {
            std::optional<DLPackAbi> versioned = parse_dlpack_max_version(max_version);
            const bool wants_copy = !copy.is_none() && args::flag(copy, "__dlpack__: copy");
            v.check_usable("__dlpack__");
            check_dlpack_device(v, dl_device);
            if (wants_copy) raise_buffer_error("__dlpack__: devbridge views export zero-copy only (copy=True)");
            if (std::optional<std::uintptr_t> order_after = parse_dlpack_stream(v, stream))
              order_consumer_queue(*v.state, *order_after);
            return make_dlpack_capsule(v.state, v.meta.handle, v.spec, versioned);
          },
          nb::kw_only(), "stream"_a.none() = nb::none(), "max_version"_a.none() = nb::none(),
          "dl_device"_a.none() = nb::none(), "copy"_a.none() = nb::none(),
          "A DLPack capsule with its own lease (\"dltensor_versioned\" for max_version >= (1, 0), else\n"
          "\"dltensor\"); its deleter ends the lease. Host views take stream None (or -1).")
      .def("__dlpack_device__",
           [](const PyTensorView& v) { return nb::make_tuple(v.meta.dlpack_device_type, v.meta.device_ordinal); })
      .def("__repr__", [](const PyTensorView& v) {
        std::string r = "TensorView(device=\"" + v.device + "\", dtype=\"" + std::string(dtype_info(v.meta.dtype).name) +
                        "\", shape=" + nb::cast<std::string>(nb::repr(dims_tuple(v.meta.shape))) +
                        ", strides=" + nb::cast<std::string>(nb::repr(dims_tuple(v.meta.strides))) +
                        ", byte_offset=" + std::to_string(v.meta.byte_offset) + ", " + handle_repr(v.meta.handle);
        return r + (v.closed() ? ", closed)" : ")");
      });

  // ---- fake backend controls ----
  nb::class_<PyFake>(m, "FakeControl", "Test controls of the fake backend (Bridge(backend=\"fake\").fake).")
      .def(
          "inject",
          [](PyFake& f, const std::string& call, const std::string& failure, nb::handle nth_object) {
            auto c = parse_named<fake::Call>(call, static_cast<int>(fake::Call::Quiesce) + 1, &fake::call_name, "call");
            auto k = parse_named<fake::Failure>(failure, static_cast<int>(fake::Failure::Fatal) + 1,
                                                &fake::failure_name, "failure");
            const int nth = args::integer<int>(nth_object, "nth");
            if (nth < 1) throw nb::value_error("nth counts from 1");
            f.backend().inject(c, k, nth);
          },
          "call"_a, "failure"_a, "nth"_a = 1, "Fail the nth next call of that kind, once.")
      .def(
          "complete", [](PyFake& f, CopyEvent event, bool ok) { return f.backend().complete(event, ok); }, "event"_a,
          "ok"_a = true, "Deliver a pending copy's outcome; False when the event is not pending.")
      .def(
          "complete_all", [](PyFake& f, bool ok) { return f.backend().complete_all(ok); }, "ok"_a = true)
      .def("pending", [](PyFake& f) { return f.backend().pending(); })
      .def(
          "report_completion", [](PyFake& f, CopyEvent event, bool ok) { f.backend().report_completion(event, ok); },
          "event"_a, "ok"_a = true, "Deliver a completion for an event the backend never saw.")
      .def("calls",
           [](PyFake& f) {
             nb::list out;
             for (const fake::RecordedCall& call : f.backend().calls()) out.append(recorded_call_dict(call));
             return out;
           })
      .def("clear_calls", [](PyFake& f) { f.backend().clear_calls(); })
      .def("live_allocations", [](PyFake& f) { return f.backend().live_allocations(); })
      .def("live_host_blocks", [](PyFake& f) { return f.backend().live_host_blocks(); })
      .def(
          "set_auto_complete", [](PyFake& f, bool on) { f.backend().set_auto_complete(on); }, "on"_a);

  // ---- the bridge ----
  nb::class_<PyBridge>(m, "Bridge",
                       "One bridge per (worker, device): a host ring, device allocations, copies and views.\n"
                       "Bridge(backend=\"host\", generation=1, ring_bytes=64 << 20, inflight_bytes=None,\n"
                       "       *, device=None, writes_under_view=\"refuse\", writes_under_view_timeout=None,\n"
                       "       **options)\n"
                       "device: which device (a device_id from devbridge.devices(backend)); options: the\n"
                       "backend's own (str or int; e.g. context=<CUcontext> or \"tinygrad\" for cuda;\n"
                       "docs/BACKENDS.md). cuda_ordinal/cuda_context are older names of device/context.\n"
                       "writes_under_view: what an upload into an allocation a live view still reads does:\n"
                       "\"refuse\" (AllocationStillInUse naming the views), \"wait\" for them to end (at most\n"
                       "writes_under_view_timeout seconds; None: until they end or close()), or \"allow\".")
      .def(
          "__init__",
          [](PyBridge* self, const std::string& backend, nb::handle generation_object, nb::handle ring_bytes_object,
             nb::handle inflight_bytes_object, nb::handle device, nb::handle cuda_ordinal, nb::handle cuda_context,
             nb::handle writes_under_view, nb::handle writes_under_view_timeout, nb::kwargs extra) {
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
            {
              nb::gil_scoped_release no_gil;
              std::unique_ptr<Backend> made = make_backend(backend, device_options);
              state->fake = dynamic_cast<fake::FakeBackend*>(made.get());
              state->bridge = std::make_unique<Bridge>(std::move(made), options);
              const BackendInfo info = state->bridge->backend_info();
              state->backend_name = info.name;  // what "auto" chose
              state->device = info.name + ":" + info.device_id;
              state->host_addressable = info.host_addressable;
            }
            new (self) PyBridge{std::move(state)};
          },
          "backend"_a = "host", "generation"_a.none() = 1, "ring_bytes"_a.none() = std::uint64_t{64} << 20,
          "inflight_bytes"_a.none() = nb::none(), nb::kw_only(), "device"_a.none() = nb::none(),
          "cuda_ordinal"_a.none() = nb::none(), "cuda_context"_a.none() = nb::none(),
          "writes_under_view"_a.none() = "refuse", "writes_under_view_timeout"_a.none() = nb::none(), "options"_a)
      .def_prop_ro("backend", [](const PyBridge& b) { return b.state->backend_name; })
      .def_prop_ro(
          "host_addressable", [](const PyBridge& b) { return b.state->host_addressable; },
          "Whether device memory is host memory the CPU reads and writes at a view's address (the host backend):\n"
          "upload/download then copy once, through a view, instead of twice through the ring.")
      .def_prop_ro(
          "device", [](const PyBridge& b) { return b.state->device; },
          "The device the bridge binds, \"<backend>:<device_id>\" (\"opencl:0:0\", \"host:0\"); every handle and view\n"
          "of the bridge lives there.")
      .def_prop_ro("domain", [](const PyBridge& b) { return b.state->bridge->domain(); })
      .def_prop_ro("generation", [](const PyBridge& b) { return b.state->open().generation(); })
      .def_prop_ro("closed", [](const PyBridge& b) { return b.state->closed.load(); })
      .def("backend_info", [](const PyBridge& b) { return backend_info_dict(b.state->open().backend_info()); })
      .def("stats", [](const PyBridge& b) { return stats_dict(b.state->open().stats()); })
      .def(
          "restart",
          [](PyBridge& b, nb::handle generation_object) {
            // Old handles are refused at once; memory that live views still
            // lease (tinygrad tensors, DLPack arrays) is freed when they end.
            const auto generation = args::integer<Generation>(generation_object, "generation");
            Bridge& bridge = b.state->open();
            nb::gil_scoped_release no_gil;
            bridge.restart(generation);
          },
          "generation"_a.none(),
          "Quiesce, free every allocation of the current generation, move to `generation` (> current).")
      .def(
          "close",
          [](PyBridge& b) {
            nb::gil_scoped_release no_gil;
            b.state->close();
          },
          "Closes the bridge at once: every blocked call (wait, a waiting view, a wait for room) and every later\n"
          "call raises Closed. Memory still exported (ring arrays, views, DLPack arrays, tinygrad tensors) stays\n"
          "valid and is freed when the last of it goes.")
      .def("__enter__", [](nb::handle self) { return nb::borrow(self); })
      .def(
          "__exit__",
          [](PyBridge& b, nb::handle, nb::handle, nb::handle) {
            nb::gil_scoped_release no_gil;
            b.state->close();
          },
          "exc_type"_a.none(), "exc"_a.none(), "tb"_a.none())
      .def_prop_ro("ring", [](const PyBridge& b) { return PyHostRing{b.state}; })
      .def_prop_ro("fake",
                   [](const PyBridge& b) {
                     if (b.state->fake == nullptr)
                       throw_unsupported("Bridge.fake: the bridge's backend is \"" + b.state->backend_name +
                                         "\", not \"fake\"");
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
          "free", [](PyBridge& b, DeviceHandle h) { b.state->open().free_device(h); }, "handle"_a,
          "Frees now, or raises AllocationStillInUse (copies, steps or views use it) and changes nothing.")
      .def(
          "release", [](PyBridge& b, DeviceHandle h) { b.state->open().release(h); }, "handle"_a,
          "Deferred free: unusable now, freed when its last copy, step and view end.")
      .def(
          "extent", [](PyBridge& b, DeviceHandle h) { return b.state->open().extent(h); }, "handle"_a)
      .def(
          "spec", [](PyBridge& b, DeviceHandle h) { return b.state->open().spec(h); }, "handle"_a)
      // ---- copies ----
      .def(
          "host_to_device",
          [](PyBridge& b, HostRange r, DeviceHandle h, nb::handle offset_object, const std::string& mode,
             nb::handle wait_for_room) {
            const auto offset = args::integer<std::uint64_t>(offset_object, "offset");
            CopyMode m = parse_mode(mode);
            Admission admission = parse_admission(wait_for_room);
            Bridge& bridge = b.state->open();
            nb::gil_scoped_release no_gil;
            return bridge.host_to_device(r, DeviceRange{h, offset, r.len}, m, admission);
          },
          "range"_a, "handle"_a, "offset"_a.none() = 0, "mode"_a = "async", nb::kw_only(), "wait_for_room"_a.none() = 0.0,
          "Copies the host range to {handle, offset, range.len}; returns the CopyEvent.")
      .def(
          "device_to_host",
          [](PyBridge& b, DeviceHandle h, HostRange r, nb::handle offset_object, const std::string& mode,
             nb::handle wait_for_room) {
            const auto offset = args::integer<std::uint64_t>(offset_object, "offset");
            CopyMode m = parse_mode(mode);
            Admission admission = parse_admission(wait_for_room);
            Bridge& bridge = b.state->open();
            nb::gil_scoped_release no_gil;
            return bridge.device_to_host(DeviceRange{h, offset, r.len}, r, m, admission);
          },
          "handle"_a, "range"_a, "offset"_a.none() = 0, "mode"_a = "async", nb::kw_only(), "wait_for_room"_a.none() = 0.0,
          "Copies {handle, offset, range.len} into the host range; returns the CopyEvent.")
      .def(
          "wait",
          [](PyBridge& b, CopyEvent e, nb::handle timeout) {
            // None, or a huge or infinite timeout, waits until done (or close()).
            const std::optional<std::chrono::nanoseconds> limit = args::optional_seconds(timeout, "timeout");
            Bridge& bridge = b.state->open();
            CopyStatus status;
            {
              nb::gil_scoped_release no_gil;
              status = bridge.wait(e, limit);
            }
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
          [](PyBridge& b, nb::handle step) { b.state->open().end_step(args::integer<StepId>(step, "step_id")); },
          "step_id"_a.none())
      .def(
          "axpy",
          [](PyBridge& b, DeviceHandle x, DeviceHandle y, float a, float c, nb::handle x_offset_object,
             nb::handle y_offset_object, nb::handle nbytes_object) {
            const auto x_offset = args::integer<std::uint64_t>(x_offset_object, "x_offset");
            const auto y_offset = args::integer<std::uint64_t>(y_offset_object, "y_offset");
            const auto nbytes = args::optional_integer<std::uint64_t>(nbytes_object, "nbytes");
            Bridge& bridge = b.state->open();
            std::uint64_t len = nbytes ? *nbytes : bridge.extent(x) - std::min(x_offset, bridge.extent(x));
            nb::gil_scoped_release no_gil;
            bridge.launch_axpy(DeviceRange{x, x_offset, len}, DeviceRange{y, y_offset, len}, a, c);
          },
          "x"_a, "y"_a, "a"_a = 1.0f, "b"_a = 0.0f, nb::kw_only(), "x_offset"_a.none() = 0, "y_offset"_a.none() = 0,
          "nbytes"_a.none() = nb::none(), "The built-in role y = a*x + b over float32 (default: all of x).")
      // ---- views ----
      .def(
          "view",
          [](PyBridge& b, DeviceHandle h, nb::handle dtype, nb::handle shape, nb::handle strides,
             nb::handle offset, bool wait) {
            ViewSpec spec;
            spec.dtype = parse_dtype(dtype);
            spec.shape = parse_dims(shape, "shape");
            if (!strides.is_none()) spec.strides = parse_dims(strides, "strides");
            spec.byte_offset = args::integer<std::uint64_t>(offset, "offset");
            return make_view(b.state, h, spec, wait ? ViewWait::Wait : ViewWait::Refuse);
          },
          "handle"_a, "dtype"_a, "shape"_a.none(), "strides"_a.none() = nb::none(), "offset"_a.none() = 0, nb::kw_only(),
          "wait"_a = true,
          "A TensorView over the allocation (strides in elements, offset in bytes). wait=True waits for copies into\n"
          "the allocation to complete first; wait=False refuses (AllocationStillInUse) while one is in flight.")
      .def("__repr__", [](const PyBridge& b) {
        return "Bridge(backend=\"" + b.state->backend_name + "\", domain=" + std::to_string(b.state->bridge->domain()) +
               (b.state->closed.load() ? ", closed)" : ")");
      });
}

}  // namespace devbridge::python

NB_MODULE(_devbridge, m) { devbridge::python::bind_module(m); }
