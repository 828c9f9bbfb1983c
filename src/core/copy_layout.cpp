// Pitched copy layouts: derived once from an array's shape and strides, and
// the spans a layout reaches, all through checked arithmetic.
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/fail.hpp"
#include "devbridge/checked.hpp"
#include "devbridge/types.hpp"

namespace devbridge {

namespace {

std::uint64_t layout_span(const CopyLayout& layout, std::uint64_t pitch, const char* side) {
  if (!layout.pitched()) return layout.row_bytes;
  if (layout.rows > 1 && pitch < layout.row_bytes)
    detail::fail(ErrorKind::InvalidRange, "{} pitch of {} bytes is shorter than a row of {} bytes: the rows would overlap",
                 side, pitch, layout.row_bytes);
  const auto before_last = checked::mul(layout.rows - 1, pitch);
  const auto span = before_last ? checked::add(*before_last, layout.row_bytes) : std::nullopt;
  if (!span)
    detail::fail(ErrorKind::InvalidRange, "{} rows at a {} pitch of {} bytes reach past 2^64 bytes", layout.rows, side,
                 pitch);
  return *span;
}

}  // namespace

std::uint64_t layout_host_span(const CopyLayout& layout) { return layout_span(layout, layout.host_pitch, "host"); }
std::uint64_t layout_device_span(const CopyLayout& layout) {
  return layout_span(layout, layout.device_pitch, "device");
}
std::uint64_t layout_bytes_moved(const CopyLayout& layout) {
  return checked::mul_or_throw(layout.rows, layout.row_bytes, ErrorKind::InvalidRange, "rows of a pitched copy");
}

CopyLayout pitched_layout(std::span<const std::int64_t> shape, std::span<const std::int64_t> byte_strides,
                          std::uint64_t element_size, std::uint64_t device_pitch) {
  const auto where = [&] { return fmt::format("shape ({}) with byte strides ({})", fmt::join(shape, ", "), fmt::join(byte_strides, ", ")); };
  if (shape.size() != byte_strides.size())
    detail::fail(ErrorKind::InvalidRange, "{}: {} dimensions but {} strides", where(), shape.size(), byte_strides.size());
  if (element_size == 0) detail::fail(ErrorKind::InvalidRange, "{}: element size 0", where());
  // Dimensions of one element say nothing about the memory: their strides
  // may be anything (numpy leaves them as they were), so they drop out.
  struct Dim {
    std::uint64_t size, stride;
    std::size_t index;
  };
  std::vector<Dim> dims;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) detail::fail(ErrorKind::InvalidRange, "{}: dimension {} has negative size", where(), i);
    if (shape[i] == 0)
      detail::fail(ErrorKind::InvalidRange, "{}: dimension {} is empty; a pitched copy moves at least one row", where(), i);
    if (shape[i] == 1) continue;
    if (byte_strides[i] < 0)
      detail::fail(ErrorKind::InvalidRange, "{}: dimension {} has a negative stride; not pitched row-major", where(), i);
    dims.push_back({static_cast<std::uint64_t>(shape[i]), static_cast<std::uint64_t>(byte_strides[i]), i});
  }
  CopyLayout layout;
  layout.rows = 1;
  layout.row_bytes = element_size;
  if (!dims.empty()) {
    const auto& inner = dims.back();
    if (inner.stride != element_size)
      detail::fail(ErrorKind::InvalidRange,
                   "{}: the elements of a row (dimension {}) are {} bytes apart, not adjacent ({}-byte elements); "
                   "not pitched row-major",
                   where(), inner.index, inner.stride, element_size);
    layout.row_bytes = checked::mul_or_throw(inner.size, element_size, ErrorKind::InvalidRange, "row of a pitched copy");
    if (dims.size() >= 2) {
      const auto& row = dims[dims.size() - 2];
      if (row.stride < layout.row_bytes)
        detail::fail(ErrorKind::InvalidRange,
                     "{}: rows (dimension {}) are {} bytes apart, less than a row's {} bytes; they would overlap",
                     where(), row.index, row.stride, layout.row_bytes);
      layout.rows = row.size;
      // Outer dimensions fold into the rows only where they continue them
      // evenly: stride(i) == size(i+1) * stride(i+1).
      for (std::size_t k = dims.size() - 2; k-- > 0;) {
        const auto expected =
            checked::mul_or_throw(dims[k + 1].size, dims[k + 1].stride, ErrorKind::InvalidRange, "stride of a pitched copy");
        if (dims[k].stride != expected)
          detail::fail(ErrorKind::InvalidRange,
                       "{}: dimension {} has stride {} where {} would continue the rows evenly; not pitched row-major "
                       "(copy each slice of it separately)",
                       where(), dims[k].index, dims[k].stride, expected);
        layout.rows = checked::mul_or_throw(layout.rows, dims[k].size, ErrorKind::InvalidRange, "rows of a pitched copy");
      }
      layout.host_pitch = row.stride;
    }
  }
  if (layout.rows == 1) layout.host_pitch = layout.row_bytes;
  if (device_pitch != 0 && device_pitch < layout.row_bytes)
    detail::fail(ErrorKind::InvalidRange, "{}: device pitch of {} bytes is shorter than a row of {} bytes", where(),
                 device_pitch, layout.row_bytes);
  layout.device_pitch = device_pitch != 0 ? device_pitch : layout.row_bytes;
  (void)layout_host_span(layout);  // the spans fit in 64 bits
  (void)layout_device_span(layout);
  return layout;
}

}  // namespace devbridge
