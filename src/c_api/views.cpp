// Views across the C ABI: a DLTensor-bearing struct whose lease the caller
// ends, and a DLPack 1.0 managed tensor whose lease its deleter ends.
#include <memory>
#include <span>
#include <string>

#include "boundary.hpp"
#include "devbridge/dlpack_view.hpp"

using namespace devbridge;
using namespace devbridge::c_api;

// Everything a view's DLTensor points at, and the lease that keeps the
// allocation alive: one heap object per view, freed when the lease ends.
struct devbridge_view_lease {
  ViewLease lease;
  DLTensorDims dims;
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
  storage.tinygrad_device = std::string(view.device);
  describe_as_dltensor(view, tensor, storage.dims);
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
