// Views across the C ABI: a DLTensor-bearing struct whose lease the caller
// ends, and a DLPack 1.0 managed tensor whose lease its deleter ends.
#include <array>
#include <memory>
#include <span>
#include <string>

#include "boundary.hpp"
#include "devbridge/checked.hpp"
#include "devbridge/consumer_names.hpp"

using namespace devbridge;
using namespace devbridge::c_api;

// Everything a view's DLTensor points at, and the lease that keeps the
// allocation alive: one heap object per view, freed when the lease ends.
struct devbridge_view_lease {
  ViewLease lease;
  std::array<std::int64_t, kMaxRank> shape{};
  std::array<std::int64_t, kMaxRank> strides{};
  std::string tinygrad_device;
};

namespace {

ViewSpec view_spec_from_c(const devbridge_view_spec* spec) {
  const auto& given = sized(spec, "spec");
  require_reserved_zero(given.reserved, "spec->reserved");
  if (given.ndim < 0 || given.ndim > kMaxRank)
    throw Error(ErrorKind::InvalidTensorView,
                "spec->ndim is " + std::to_string(given.ndim) + "; a view has 0 to " + std::to_string(kMaxRank) +
                    " dimensions");
  const auto rank = static_cast<std::size_t>(given.ndim);
  ViewSpec result;
  result.dtype = dtype_from_c(given.dtype, "spec->dtype");
  result.shape = Dims(array_argument(given.shape, rank, "spec->shape"));
  if (given.strides != nullptr) result.strides = Dims(array_argument(given.strides, rank, "spec->strides"));
  result.byte_offset = given.byte_offset;
  return result;
}

ViewWait view_wait_from_c(const devbridge_view_spec& spec) {
  switch (spec.wait) {
    case DEVBRIDGE_VIEW_REFUSE_IN_FLIGHT: return ViewWait::Refuse;
    case DEVBRIDGE_VIEW_WAIT_IN_FLIGHT: return ViewWait::Wait;
  }
  invalid_argument("spec->wait is " + std::to_string(spec.wait) + ", not a DEVBRIDGE_VIEW_ constant");
}

// Takes a lease and describes its view as a DLTensor pointing into `storage`.
void open_view(devbridge_bridge* bridge, devbridge_handle handle, const devbridge_view_spec* spec,
               devbridge_view_lease& storage, DLTensor& tensor) {
  const ViewSpec cpp_spec = view_spec_from_c(spec);
  storage.lease = bridge_of(bridge).view(to_cpp(handle), cpp_spec, view_wait_from_c(*spec));
  const TensorView& view = storage.lease.view();
  const DTypeInfo& info = dtype_info(view.dtype);
  storage.tinygrad_device = std::string(view.device);
  tensor.device.device_type = static_cast<DLDeviceType>(view.dlpack_device_type);
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
  tensor.ndim = view.shape.size();
  tensor.dtype.code = static_cast<std::uint8_t>(info.dlpack_code);
  tensor.dtype.bits = info.dlpack_bits;
  tensor.dtype.lanes = 1;
  for (int i = 0; i < view.shape.size(); ++i) {
    storage.shape[i] = view.shape[i];
    storage.strides[i] = view.strides[i];
  }
  tensor.shape = storage.shape.data();
  tensor.strides = storage.strides.data();
}

// A DLPack export owns its storage; the deleter frees both.
struct DLPackExport {
  devbridge_dlpack_tensor managed{};
  devbridge_view_lease storage;
};

void delete_export(devbridge_dlpack_tensor* managed) noexcept {
  // The lease ends in ~ViewLease, which never throws.
  delete static_cast<DLPackExport*>(managed->manager_ctx);
}

}  // namespace

extern "C" {

devbridge_status devbridge_view_open(devbridge_bridge* bridge, devbridge_handle handle,
                                     const devbridge_view_spec* spec, devbridge_view* out_view) {
  return guarded([&] {
    auto& out = sized(out_view, "out_view");
    auto storage = std::make_unique<devbridge_view_lease>();
    devbridge_view view{};
    open_view(bridge, handle, spec, *storage, view.dl_tensor);
    const TensorView& described = storage->lease.view();
    view.handle = to_c(described.handle);
    view.dtype = static_cast<devbridge_dtype>(described.dtype);
    view.read_only = described.read_only ? 1 : 0;
    view.tinygrad_device = storage->tinygrad_device.c_str();
    view.lease = storage.release();
    write_result(out, view);
  });
}

devbridge_status devbridge_view_end(devbridge_view* view) {
  return guarded([&] {
    auto& given = sized(view, "view");
    delete given.lease;
    given.lease = nullptr;
  });
}

devbridge_status devbridge_view_end_after(devbridge_view* view, uintptr_t consumer_queue) {
  return guarded([&] {
    auto& given = sized(view, "view");
    if (given.lease == nullptr) return;
    // Throws (and the lease stays live) where consumers have no queues.
    given.lease->lease.end_after(ConsumerQueue{consumer_queue});
    delete given.lease;
    given.lease = nullptr;
  });
}

devbridge_status devbridge_export_dlpack(devbridge_bridge* bridge, devbridge_handle handle,
                                         const devbridge_view_spec* spec, devbridge_dlpack_tensor** out_tensor) {
  return guarded([&] {
    auto& out = required(out_tensor, "out_tensor");
    auto owned = std::make_unique<DLPackExport>();
    open_view(bridge, handle, spec, owned->storage, owned->managed.dl_tensor);
    owned->storage.lease.set_holder(ViewHolder::DLPackConsumer);
    owned->managed.version.major = 1;
    owned->managed.version.minor = 0;
    owned->managed.flags = owned->storage.lease.view().read_only ? DEVBRIDGE_DLPACK_FLAG_READ_ONLY : 0;
    owned->managed.manager_ctx = owned.get();
    owned->managed.deleter = &delete_export;
    out = &owned.release()->managed;
  });
}

}  // extern "C"
