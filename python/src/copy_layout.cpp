// CopyLayout: the rows of a pitched 2-D copy, and the ways to get one (from
// a shape and byte strides, or from a strided array), for Bridge copies'
// layout= argument.
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>

#include "devbridge/types.hpp"
#include "arguments.hpp"
#include "bindings.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace devbridge::python {

namespace {

std::string object_type_name(nb::handle object) {
  return nb::cast<std::string>(nb::str(object.type().attr("__name__")));
}

// A sequence of ints (or one int), each an int64 (OverflowError past it);
// the layout rules (sizes, strides) are the bridge's (InvalidRange).
std::vector<std::int64_t> parse_int64s(nb::handle object, const char* what) {
  std::vector<std::int64_t> values;
  if (PyIndex_Check(object.ptr()) && !PyFloat_Check(object.ptr())) {
    values.push_back(args::integer<std::int64_t>(object, what));
    return values;
  }
  if (!nb::isinstance<nb::sequence>(object) || nb::isinstance<nb::str>(object) || nb::isinstance<nb::bytes>(object))
    args::raise(PyExc_TypeError,
                std::string(what) + " must be an int or a sequence of ints, not " + object_type_name(object));
  for (nb::handle item : object) values.push_back(args::integer<std::int64_t>(item, what));
  return values;
}

std::size_t hash_layout(const CopyLayout& l) {
  std::uint64_t h = 0x436f70794c61796full;
  for (std::uint64_t v : {l.rows, l.row_bytes, l.host_pitch, l.device_pitch})
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  return static_cast<std::size_t>(h);
}

}  // namespace

HeldBuffer::HeldBuffer(nb::handle object, int flags, const std::string& what) {
  if (!PyObject_CheckBuffer(object.ptr()))
    args::raise(PyExc_TypeError, what + " must support the buffer protocol (a numpy array, bytearray, memoryview, "
                                        "mmap.mmap), not " + object_type_name(object));
  if (PyObject_GetBuffer(object.ptr(), &view_, flags) != 0) throw nb::python_error();
  held_ = true;
}

void HeldBuffer::reset() noexcept {
  if (held_) PyBuffer_Release(&view_);
  held_ = false;
}

Py_buffer HeldBuffer::take() noexcept {
  held_ = false;
  return view_;
}

CopyLayout buffer_layout(const Py_buffer& view, std::uint64_t device_pitch) {
  std::vector<std::int64_t> shape, strides;
  for (int i = 0; i < view.ndim; ++i) shape.push_back(view.shape != nullptr ? view.shape[i] : view.len / view.itemsize);
  if (view.strides != nullptr) {
    for (int i = 0; i < view.ndim; ++i) strides.push_back(view.strides[i]);
  } else {
    // No strides from the exporter: it is C-contiguous (PyBUF_ND).
    strides.resize(shape.size());
    std::int64_t stride = view.itemsize;
    for (std::size_t i = shape.size(); i-- > 0;) {
      strides[i] = stride;
      stride *= shape[i];
    }
  }
  return pitched_layout(shape, strides, static_cast<std::uint64_t>(view.itemsize), device_pitch);
}

std::optional<CopyLayout> parse_layout(nb::handle layout) {
  if (layout.is_none()) return std::nullopt;
  if (!nb::isinstance<CopyLayout>(layout))
    args::raise(PyExc_TypeError,
                "layout must be a devbridge.CopyLayout (CopyLayout.of(array), devbridge.pitched_layout(...)) or None, "
                "not " + object_type_name(layout));
  return nb::cast<CopyLayout>(layout);
}

std::string layout_repr(const CopyLayout& l) {
  return "CopyLayout(rows=" + std::to_string(l.rows) + ", row_bytes=" + std::to_string(l.row_bytes) +
         ", host_pitch=" + std::to_string(l.host_pitch) + ", device_pitch=" + std::to_string(l.device_pitch) + ")";
}

void bind_copy_layout(nb::module_& m) {
  nb::class_<CopyLayout>(m, "CopyLayout",
                         "A pitched 2-D copy: `rows` rows of `row_bytes`, row i at byte i * host_pitch of the host\n"
                         "range and i * device_pitch of the device range; the bytes between rows are never touched.\n"
                         "CopyLayout(rows, row_bytes, host_pitch=None, device_pitch=None): a pitch left None packs\n"
                         "the rows (pitch = row_bytes). CopyLayout.of(array) and devbridge.pitched_layout(...) derive\n"
                         "one from a strided array, checking it; a hand-made one is checked by the copy.")
      .def(
          "__init__",
          [](CopyLayout* self, nb::handle rows, nb::handle row_bytes, nb::handle host_pitch, nb::handle device_pitch) {
            const auto r = args::integer<std::uint64_t>(rows, "rows");
            const auto b = args::integer<std::uint64_t>(row_bytes, "row_bytes");
            const auto hp = args::optional_integer<std::uint64_t>(host_pitch, "host_pitch");
            const auto dp = args::optional_integer<std::uint64_t>(device_pitch, "device_pitch");
            new (self) CopyLayout{r, b, hp.value_or(b), dp.value_or(b)};
          },
          "rows"_a.none(), "row_bytes"_a.none(), "host_pitch"_a.none() = nb::none(),
          "device_pitch"_a.none() = nb::none())
      .def_static(
          "of",
          [](nb::handle array, nb::handle device_pitch) {
            const auto pitch = args::integer<std::uint64_t>(device_pitch, "device_pitch");
            HeldBuffer buffer(array, PyBUF_RECORDS_RO, "CopyLayout.of: array");
            return buffer_layout(buffer.view(), pitch);
          },
          "array"_a, "device_pitch"_a.none() = 0,
          "The layout of a copy between a strided array (numpy; any buffer-protocol object) and a device tensor:\n"
          "its rows, row bytes and host pitch from its shape and byte strides; device_pitch 0 packs the rows on the\n"
          "device. InvalidRange naming the dimension when the array is not pitched row-major (a negative or\n"
          "overlapping stride, elements not adjacent within a row).")
      .def_ro("rows", &CopyLayout::rows)
      .def_ro("row_bytes", &CopyLayout::row_bytes)
      .def_ro("host_pitch", &CopyLayout::host_pitch)
      .def_ro("device_pitch", &CopyLayout::device_pitch)
      .def_prop_ro("pitched", [](const CopyLayout& l) { return l.pitched(); }, "False for rows == 0 (no rows: not a pitched copy).")
      .def_prop_ro(
          "host_span", [](const CopyLayout& l) { return layout_host_span(l); },
          "Bytes the rows reach on the host: (rows - 1) * host_pitch + row_bytes; InvalidRange when rows would\n"
          "overlap or the span passes 2**64.")
      .def_prop_ro(
          "device_span", [](const CopyLayout& l) { return layout_device_span(l); },
          "Bytes the rows reach on the device: (rows - 1) * device_pitch + row_bytes.")
      .def_prop_ro(
          "bytes_moved", [](const CopyLayout& l) { return layout_bytes_moved(l); }, "rows * row_bytes.")
      .def(
          "__eq__",
          [](const CopyLayout& a, nb::handle b) { return nb::isinstance<CopyLayout>(b) && a == nb::cast<CopyLayout>(b); },
          "other"_a.none())
      .def("__hash__", &hash_layout)
      .def("__repr__", &layout_repr)
      .def("__getstate__",
           [](const CopyLayout& l) { return nb::make_tuple(l.rows, l.row_bytes, l.host_pitch, l.device_pitch); })
      .def("__setstate__", [](CopyLayout& l, const std::tuple<std::uint64_t, std::uint64_t, std::uint64_t,
                                                              std::uint64_t>& state) {
        new (&l) CopyLayout{std::get<0>(state), std::get<1>(state), std::get<2>(state), std::get<3>(state)};
      });

  m.def(
      "pitched_layout",
      [](nb::handle shape, nb::handle strides, nb::handle itemsize, nb::handle device_pitch) {
        const auto dims = parse_int64s(shape, "shape");
        const auto byte_strides = parse_int64s(strides, "strides");
        const auto element = args::integer<std::uint64_t>(itemsize, "itemsize");
        const auto pitch = args::integer<std::uint64_t>(device_pitch, "device_pitch");
        return pitched_layout(dims, byte_strides, element, pitch);
      },
      "shape"_a, "strides"_a, "itemsize"_a, "device_pitch"_a.none() = 0,
      "The CopyLayout of a copy between a strided host array and a device tensor, from the array's shape, its\n"
      "strides in bytes (numpy's .strides) and its element size. Leading dimensions that continue the rows\n"
      "evenly fold into them; anything else is not pitched row-major and raises InvalidRange naming the\n"
      "dimension and why. device_pitch 0 packs the rows on the device.");
}

}  // namespace devbridge::python
