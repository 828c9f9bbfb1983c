// The value types (DeviceHandle, CopyEvent, HostRange, ObjectSpec) and the
// names callers give for dtypes and shape kinds.
#include <cctype>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include "devbridge/types.hpp"
#include "arguments.hpp"
#include "bindings.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace devbridge::python {
namespace {

std::string known_dtype_names() {
  std::string names;
  for (const DTypeInfo& info : all_dtypes()) {
    if (!names.empty()) names += ", ";
    names += info.name;
  }
  return names;
}

// A C or tinygrad spelling numpy reads as another dtype ("float": numpy's
// float64, tinygrad's float32) would relabel bytes silently either way.
void refuse_if_numpy_reads_otherwise(const std::string& name, DType dtype) {
  std::string numpy_name;
  try {
    numpy_name = nb::cast<std::string>(nb::module_::import_("numpy").attr("dtype")(name).attr("name"));
  } catch (const nb::python_error&) {
    return;  // a name numpy does not know ("fp8e4m3", "dtypes.float") is ours alone
  }
  if (dtype_from_name(numpy_name) == dtype) return;
  throw nb::value_error(("dtype \"" + name + "\" is ambiguous: devbridge and tinygrad read it as " +
                         std::string(dtype_info(dtype).name) + ", numpy as " + numpy_name +
                         "; name the dtype (\"" + std::string(dtype_info(dtype).name) + "\")")
                            .c_str());
}

}  // namespace

std::string lower(std::string text) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

namespace {

[[noreturn]] void fail_unknown_dtype(const std::string& name) {
  throw nb::value_error(("unknown dtype \"" + name + "\"; devbridge knows: " + known_dtype_names()).c_str());
}

// numpy's reading of `object` (a dtype, a type, or a spelling such as
// "<f4"), in devbridge's name; nothing when numpy does not know it.
std::optional<std::string> numpy_dtype_name(nb::handle object) {
  nb::object numpy_dtype;
  try {
    numpy_dtype = nb::module_::import_("numpy").attr("dtype")(object);
  } catch (const nb::python_error&) {
    return std::nullopt;
  }
  std::string name = nb::cast<std::string>(numpy_dtype.attr("name"));
  // numpy's name leaves the byte order out: ">f4" would read as float32.
  if (nb::cast<std::string>(numpy_dtype.attr("byteorder")) == ">")
    throw nb::value_error(("dtype " + nb::cast<std::string>(nb::str(numpy_dtype)) + " is big-endian and devbridge's "
                           "bytes are little-endian: name the little-endian dtype (" + name + ") and convert the "
                           "data (array.astype(array.dtype.newbyteorder('<')))").c_str());
  return name;
}

}  // namespace

// A dtype named as devbridge, numpy or tinygrad name it ("float32", "<f4"),
// or given as a numpy dtype/type or a tinygrad DType.
DType parse_dtype(nb::handle object) {
  if (nb::isinstance<nb::str>(object)) {
    const std::string name = nb::cast<std::string>(object);
    if (std::optional<DType> dtype = dtype_from_name(name)) {
      if (name != dtype_info(*dtype).name) refuse_if_numpy_reads_otherwise(name, *dtype);
      return *dtype;
    }
    const std::optional<std::string> numpy_name = numpy_dtype_name(object);
    if (!numpy_name) fail_unknown_dtype(name);
    if (std::optional<DType> dtype = dtype_from_name(*numpy_name)) return *dtype;
    fail_unknown_dtype(*numpy_name);
  }
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
  const std::optional<std::string> name = numpy_dtype_name(object);
  if (!name)
    throw nb::type_error(("dtype must be a name such as \"float32\", a numpy dtype or a tinygrad DType, not " +
                          nb::cast<std::string>(nb::repr(object))).c_str());
  if (std::optional<DType> dtype = dtype_from_name(*name)) return *dtype;
  fail_unknown_dtype(*name);
}

std::string handle_repr(const DeviceHandle& h) {
  return "DeviceHandle(domain=" + std::to_string(h.domain) + ", generation=" + std::to_string(h.generation) +
         ", id=" + std::to_string(h.id) + ")";
}

namespace {

// An ObjectSpec's dtype: any dtype parse_dtype takes, or "bytes" / None for
// an untyped allocation.
std::optional<DType> parse_spec_dtype(nb::handle object) {
  if (object.is_none()) return std::nullopt;
  if (nb::isinstance<nb::str>(object) && nb::cast<std::string>(object) == "bytes") return std::nullopt;
  return parse_dtype(object);
}

ShapeKind parse_shape_kind(const std::string& name) {
  std::string n = lower(name);
  if (n == "scalar") return ShapeKind::Scalar;
  if (n == "vector") return ShapeKind::Vector;
  if (n == "matrix") return ShapeKind::Matrix;
  if (n == "tensor") return ShapeKind::Tensor;
  throw nb::value_error(("shape kind must be scalar, vector, matrix or tensor, not \"" + name + "\"").c_str());
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

// An ObjectSpec's dtype and shape kind as one number: what __eq__ and __hash__ compare beside its sizes.
std::uint64_t spec_key(const ObjectSpec& s) {
  const std::uint64_t dtype = s.dtype ? static_cast<std::uint64_t>(*s.dtype) + 1 : 0;
  return (dtype << 8) | static_cast<std::uint64_t>(s.shape);
}

bool same_spec(const ObjectSpec& a, const ObjectSpec& b) {
  return a.max_extent == b.max_extent && a.alignment == b.alignment && spec_key(a) == spec_key(b);
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
      .def("__eq__", [](const Tagged&, nb::handle) { return false; }, nb::arg().none())  // == None is False
      .def("__hash__", [](const Tagged& t) { return hash_triple(t.domain, t.generation, t.id); })
      .def("__repr__", repr)
      // copy.copy/deepcopy give an equal value. No pickling: domains restart
      // at 1 in every process, so a handle unpickled elsewhere could name
      // another bridge's allocation.
      .def("__copy__", [](const Tagged& t) { return t; })
      .def("__deepcopy__", [](const Tagged& t, nb::handle) { return t; }, "memo"_a.none());
}

}  // namespace

void bind_value_types(nb::module_& m) {
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
      .def("__eq__", [](const HostRange&, nb::handle) { return false; }, nb::arg().none())
      .def("__hash__", [](const HostRange& r) { return hash_triple(r.offset, r.len, 0x486f737452616e67ull); })
      .def("__copy__", [](const HostRange& r) { return r; })
      .def("__deepcopy__", [](const HostRange& r, nb::handle) { return r; }, "memo"_a.none())
      .def("__getstate__", [](const HostRange& r) { return nb::make_tuple(r.offset, r.len); })
      .def("__setstate__",
           [](HostRange& r, const std::tuple<std::uint64_t, std::uint64_t>& state) {
             new (&r) HostRange{std::get<0>(state), std::get<1>(state)};
           })
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
      .def_static(
          "for_array",
          // The staging layer's spec_for_array (one implementation of its checks), reached at call time:
          // nothing is attached to this class when devbridge is imported.
          [](nb::handle shape, nb::handle dtype, nb::handle alignment) {
            return nb::module_::import_("devbridge._staging").attr("spec_for_array")(shape, dtype, alignment);
          },
          "shape"_a, "dtype"_a, "alignment"_a = 256,
          nb::sig("def for_array(shape: object, dtype: object, alignment: object = 256) -> tuple[ObjectSpec, int]"),
          "(ObjectSpec, extent) for one array of shape and dtype, the extent rounded up to alignment (a power of\n"
          "two): devbridge.spec_for_array.")
      .def(
          "__eq__",
          [](const ObjectSpec& a, nb::handle b) { return nb::isinstance<ObjectSpec>(b) && same_spec(a, nb::cast<ObjectSpec>(b)); },
          "other"_a.none())
      .def("__hash__", [](const ObjectSpec& s) { return hash_triple(s.max_extent, s.alignment, spec_key(s)); })
      .def("__copy__", [](const ObjectSpec& s) { return s; })
      .def("__deepcopy__", [](const ObjectSpec& s, nb::handle) { return s; }, "memo"_a.none())
      .def("__getstate__",
           [](const ObjectSpec& s) {
             return nb::make_tuple(s.max_extent, s.alignment, std::string(spec_dtype_name(s)),
                                   std::string(shape_kind_name(s.shape)));
           })
      .def("__setstate__",
           [](ObjectSpec& s, const std::tuple<std::uint64_t, std::uint64_t, std::string, std::string>& state) {
             new (&s) ObjectSpec{std::get<0>(state), std::get<1>(state), parse_spec_dtype(nb::str(std::get<2>(state).c_str())),
                                 parse_shape_kind(std::get<3>(state))};
           })
      .def("__repr__", [](const ObjectSpec& s) {
        return "ObjectSpec(max_extent=" + std::to_string(s.max_extent) + ", alignment=" + std::to_string(s.alignment) +
               ", dtype=\"" + std::string(spec_dtype_name(s)) + "\", shape=\"" +
               std::string(shape_kind_name(s.shape)) + "\")";
      });
}

}  // namespace devbridge::python
