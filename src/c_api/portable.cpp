// Portable tensors through the C ABI: export out of a bridge into
// library-owned row-major bytes, import of such bytes (anyone's) into a new
// allocation. The bytes travel through the ring in chunks by the C++
// TransferPlanner, so a tensor larger than the ring works.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "boundary.hpp"
#include "devbridge/transfer.hpp"

using namespace devbridge;
using namespace devbridge::c_api;

struct devbridge_portable {
  devbridge_dtype dtype = 0;
  std::vector<std::int64_t> dims;
  std::vector<std::byte> bytes;
};

namespace {

constexpr std::uint64_t kDefaultImportAlignment = 256;  // Python's spec_for_array default

void require_held(Bridge& bridge, DType dtype) {
  const auto held = bridge.backend_info().dtypes;
  if (std::find(held.begin(), held.end(), dtype) == held.end())
    throw Error(ErrorKind::UnsupportedDType,
                "the bridge's device does not hold dtype " + std::string(dtype_info(dtype).name));
}

}  // namespace

extern "C" {

devbridge_status devbridge_export_tensor(devbridge_bridge* bridge, devbridge_handle handle, devbridge_dtype dtype,
                                         const int64_t* dims, uint32_t rank, uint64_t offset,
                                         devbridge_portable** out_tensor) {
  return guarded([&] {
    auto& out = required(out_tensor, "out_tensor");
    auto& target = bridge_of(bridge);
    const auto type = dtype_from_c(dtype, "dtype");
    const auto shape = array_argument(dims, rank, "dims");
    const auto nbytes = tensor_bytes(type, shape, "dims");
    require_held(target, type);
    const auto device = to_cpp(handle);
    const auto extent = target.extent(device);
    const auto end = checked::add_or_throw(offset, nbytes, ErrorKind::InvalidRange, "offset + tensor bytes");
    if (end > extent)
      throw Error(ErrorKind::InvalidRange, "export of bytes " + std::to_string(offset) + ".." + std::to_string(end) +
                                               " passes the extent " + std::to_string(extent) + " of " +
                                               to_string(device));
    // The bytes are read as `dtype` whatever the allocation's (a float32 row as uint8 bytes), each item at
    // an offset of its own size, as a view's.
    if (offset % dtype_info(type).size != 0)
      throw Error(ErrorKind::InvalidRange, "export of " + std::string(dtype_info(type).name) + " at byte offset " +
                                               std::to_string(offset) + " of " + to_string(device) +
                                               ": the offset is not a multiple of its " +
                                               std::to_string(dtype_info(type).size) + "-byte items");
    auto tensor = std::make_unique<devbridge_portable>();
    tensor->dtype = dtype;
    tensor->dims.assign(shape.begin(), shape.end());
    tensor->bytes.resize(static_cast<std::size_t>(nbytes));
    if (nbytes != 0) TransferPlanner(target).download(device, offset, tensor->bytes);
    out = tensor.release();
  });
}

devbridge_status devbridge_portable_describe(const devbridge_portable* tensor, devbridge_portable_view* out_view) {
  return guarded([&] {
    const auto& given = required(tensor, "tensor");
    auto& out = sized(out_view, "out_view");
    devbridge_portable_view view{};
    view.dtype = given.dtype;
    view.rank = static_cast<std::uint32_t>(given.dims.size());
    view.dims = given.dims.empty() ? nullptr : given.dims.data();
    view.data = given.bytes.empty() ? nullptr : given.bytes.data();
    view.len = given.bytes.size();
    write_result(out, view);
  });
}

void devbridge_portable_free(devbridge_portable* tensor) { delete tensor; }

devbridge_status devbridge_import_tensor(devbridge_bridge* bridge, const devbridge_portable_view* tensor,
                                         const devbridge_object_spec* spec, devbridge_handle* out_handle) {
  return guarded([&] {
    auto& out = required(out_handle, "out_handle");
    auto& target = bridge_of(bridge);
    const auto& given = sized(tensor, "tensor");
    const auto type = dtype_from_c(given.dtype, "tensor->dtype");
    const auto shape = array_argument(given.dims, given.rank, "tensor->dims");
    const auto nbytes = tensor_bytes(type, shape, "tensor->dims");
    if (nbytes != given.len)
      invalid_argument("tensor->len is " + std::to_string(given.len) + ", but its dims of " +
                       std::string(dtype_info(type).name) + " make " + std::to_string(nbytes) + " bytes");
    const auto data = array_argument(static_cast<const std::byte*>(given.data), given.len, "tensor->data");
    if (nbytes == 0) throw Error(ErrorKind::InvalidExtent, "the tensor is empty: a device allocation cannot be empty");

    ObjectSpec allocation;
    if (spec == nullptr) {
      allocation.alignment = kDefaultImportAlignment;
      allocation.dtype = type;
      allocation.shape = ShapeKind::Tensor;
    } else {
      allocation = object_spec_from_c(spec);
      if (allocation.dtype && *allocation.dtype != type)
        throw Error(ErrorKind::UnsupportedDType, "spec->dtype is " + std::string(dtype_info(*allocation.dtype).name) +
                                                     ", the tensor's " + std::string(dtype_info(type).name));
    }
    if (allocation.alignment == 0 || (allocation.alignment & (allocation.alignment - 1)) != 0)
      throw Error(ErrorKind::InvalidAlignment,
                  "spec->alignment " + std::to_string(allocation.alignment) + " is not a power of two");
    const auto rounded = checked::add_or_throw(nbytes, allocation.alignment - 1, ErrorKind::InvalidExtent,
                                               "tensor bytes rounded up to the alignment");
    const auto extent = rounded - rounded % allocation.alignment;
    if (spec == nullptr) allocation.max_extent = extent;
    if (extent > allocation.max_extent)
      throw Error(ErrorKind::InvalidExtent, "the tensor's " + std::to_string(nbytes) + " bytes (" +
                                                std::to_string(extent) + " at alignment " +
                                                std::to_string(allocation.alignment) +
                                                ") do not fit spec->max_extent of " +
                                                std::to_string(allocation.max_extent));
    out = to_c(TransferPlanner(target).upload(data, allocation, extent));
  });
}

}  // extern "C"
