// A TensorView described as DLPack's DLTensor: the one filling of the
// descriptor every exporter shares (the C ABI's views and DLPack tensors,
// the Python module's capsules). A template over the DLTensor type, so that
// this header needs no <dlpack/dlpack.h>: the Python module builds with its
// own copy of DLPack's ABI where the header is not installed.
#pragma once

#include <array>
#include <cstdint>

#include "devbridge/checked.hpp"
#include "devbridge/consumer_names.hpp"
#include "devbridge/types.hpp"

namespace devbridge {

// The shape and strides a DLTensor points at, kept by whoever keeps the lease.
struct DLTensorDims {
  std::array<std::int64_t, kMaxRank> shape{};
  std::array<std::int64_t, kMaxRank> strides{};  // elements, as DLPack counts them
};

// Fills `tensor` (device, data, byte_offset, dtype, rank, shape, strides)
// from `view`, pointing its shape and strides into `dims`.
template <class DLTensorT>
void describe_as_dltensor(const TensorView& view, DLTensorT& tensor, DLTensorDims& dims) {
  const DTypeInfo& info = dtype_info(view.dtype);
  tensor.device.device_type = static_cast<decltype(tensor.device.device_type)>(view.dlpack_device_type);
  tensor.device.device_id = view.device_ordinal;
  // CPU and CUDA consumers read `data` as the first element (torch and cupy
  // ignore byte_offset); an OpenCL address is a cl_mem, where the offset
  // must stay separate.
  if (view.dlpack_device_type == static_cast<int>(DLPackDevice::OpenCL)) {
    tensor.data = reinterpret_cast<void*>(static_cast<std::uintptr_t>(view.data));
    tensor.byte_offset = view.byte_offset;
  } else {
    const auto first = checked::add_or_throw(view.data, view.byte_offset, ErrorKind::InvalidTensorView,
                                             "view address plus byte_offset");
    tensor.data = reinterpret_cast<void*>(static_cast<std::uintptr_t>(first));
    tensor.byte_offset = 0;
  }
  tensor.ndim = static_cast<decltype(tensor.ndim)>(view.shape.size());
  tensor.dtype.code = static_cast<std::uint8_t>(info.dlpack_code);
  tensor.dtype.bits = info.dlpack_bits;
  tensor.dtype.lanes = 1;
  for (int i = 0; i < view.shape.size(); ++i) {
    dims.shape[i] = view.shape[i];
    dims.strides[i] = view.strides[i];
  }
  tensor.shape = dims.shape.data();
  tensor.strides = dims.strides.data();
}

}  // namespace devbridge
