// DLPack export of tensor views.
//
// Two capsules, as the DLPack Python spec asks: a consumer that passes
// max_version >= (1, 0) gets "dltensor_versioned" (DLManagedTensorVersioned,
// with flags: devbridge memory is writable, so numpy makes writable arrays,
// but for adopted read-only memory, flagged so);
// any other consumer gets the unversioned "dltensor" (DLManagedTensor), which
// every consumer accepts (numpy marks such arrays read-only: that ABI cannot
// say whether memory is writable). The installed dlpack.h (0.6) predates the
// versioned struct, so its ABI (frozen by DLPack 1.0) is declared here.
//
// Lifetime: each capsule owns its own view lease. The lease ends in the
// DLManagedTensor's deleter, which the consumer calls when its array dies, or
// in the capsule's destructor when no consumer ever took it. The deleter runs
// only C++ (no Python objects are reachable from it), so it is safe from any
// thread, with or without the GIL. The deleter runs once however often it is
// called, and the export is freed only once both the capsule and the deleter
// are done with it: torch 2.15 calls the deleter of a tensor on a device it
// cannot take (OpenCL) and raises without renaming the capsule, whose
// destructor then calls it again (a double free that aborted the process).
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>

#include <Python.h>
#include <nanobind/nanobind.h>

#include "devbridge/dlpack_view.hpp"
#include "arguments.hpp"
#include "bindings.hpp"
#include "state.hpp"

#if defined(DEVBRIDGE_HAVE_DLPACK_H)
#include <dlpack/dlpack.h>
#else
// DLPack's unversioned ABI (dlpack.h 0.6), frozen since: the same layout as
// the header's, declared here only when the header is not installed.
extern "C" {
typedef enum { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLOpenCL = 4 } DLDeviceType;
typedef struct {
  DLDeviceType device_type;
  int32_t device_id;
} DLDevice;
typedef struct {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} DLDataType;
typedef struct {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(struct DLManagedTensor* self);
} DLManagedTensor;
}
#endif

namespace nb = nanobind;

namespace devbridge::python {

namespace {

#if defined(DLPACK_MAJOR_VERSION) && DLPACK_MAJOR_VERSION >= 1
using PackVersion = DLPackVersion;
using ManagedTensorVersioned = DLManagedTensorVersioned;
#else
struct PackVersion {
  std::uint32_t major;
  std::uint32_t minor;
};
struct ManagedTensorVersioned {
  PackVersion version;
  void* manager_ctx;
  void (*deleter)(ManagedTensorVersioned* self);
  std::uint64_t flags;  // bit 0: read-only, bit 1: a copy made by the producer
  DLTensor dl_tensor;
};
#endif

constexpr const char* kCapsuleName = "dltensor";
constexpr const char* kUsedCapsuleName = "used_dltensor";
constexpr const char* kVersionedCapsuleName = "dltensor_versioned";
constexpr const char* kUsedVersionedCapsuleName = "used_dltensor_versioned";

// Owns everything the exported tensor points at; exactly one of the two
// managed structs is handed out. Its one owner is whoever may call the
// deleter: the capsule until a consumer takes it (renaming it "used_..."),
// the consumer after. A consumer may also clear the capsule's destructor
// (XLA does): nothing of the export may wait for that destructor.
struct DLPackExport {
  DLManagedTensor managed{};
  ManagedTensorVersioned versioned{};
  ViewLease lease;
  std::optional<std::uintptr_t> consumer_stream;  // the lease ends after it
  DLTensorDims dims;  // what the tensor's shape and strides point at
  std::unique_ptr<std::byte[]> copied;  // copy=True: the tensor's bytes, row-major (no lease then)
  std::atomic<bool> deleted{false};

  // The managed tensor's deleter: the lease ends (after close() the last
  // lease on an allocation frees it; C++ only, any thread), once.
  void end_use() noexcept {
    if (deleted.exchange(true, std::memory_order_acq_rel)) return;
    // What the lease's end records (a view's end, a deferred free) carries
    // the stack of the code that dropped the consumer's tensor.
    note_lease_end_stack();
    if (consumer_stream) end_lease_after(lease, *consumer_stream);
    lease.reset();
    delete this;
  }
};

void delete_export(DLManagedTensor* managed) { static_cast<DLPackExport*>(managed->manager_ctx)->end_use(); }
void delete_versioned_export(ManagedTensorVersioned* managed) {
  static_cast<DLPackExport*>(managed->manager_ctx)->end_use();
}

// A capsule nobody consumed still owns its tensor; a consumed one was renamed
// "used_..." and belongs to the consumer (the export may be gone already:
// nothing of it is read).
template <typename Managed>
void destroy_capsule(PyObject* capsule, const char* name, const char* used_name) {
  if (PyCapsule_IsValid(capsule, used_name)) return;
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);  // a destructor must not disturb a pending error
  auto* managed = static_cast<Managed*>(PyCapsule_GetPointer(capsule, name));
  if (managed == nullptr) {
    PyErr_WriteUnraisable(capsule);
  } else if (managed->deleter != nullptr) {
    managed->deleter(managed);
  }
  PyErr_Restore(type, value, traceback);
}

void destroy_unversioned(PyObject* capsule) {
  destroy_capsule<DLManagedTensor>(capsule, kCapsuleName, kUsedCapsuleName);
}
void destroy_versioned(PyObject* capsule) {
  destroy_capsule<ManagedTensorVersioned>(capsule, kVersionedCapsuleName, kUsedVersionedCapsuleName);
}

}  // namespace

namespace {

// The view's elements, row-major, into `out` (host memory: a CPU view).
void copy_row_major(const TensorView& view, std::size_t item, std::byte* out) {
  const auto* base = reinterpret_cast<const std::byte*>(static_cast<std::uintptr_t>(view.data + view.byte_offset));
  const int rank = view.shape.size();
  if (view.contiguous()) {
    std::int64_t count = 1;
    for (int i = 0; i < rank; ++i) count *= view.shape[i];
    std::memcpy(out, base, static_cast<std::size_t>(count) * item);
    return;
  }
  std::array<std::int64_t, kMaxRank> index{};
  for (bool more = true; more;) {
    std::int64_t at = 0;  // elements from the first, strides may be negative
    for (int i = 0; i < rank; ++i) at += index[i] * view.strides[i];
    std::memcpy(out, base + at * static_cast<std::int64_t>(item), item);
    out += item;
    more = false;
    for (int i = rank - 1; i >= 0; --i) {
      if (++index[i] < view.shape[i]) {
        more = true;
        break;
      }
      index[i] = 0;
    }
  }
}

}  // namespace

nb::object make_dlpack_capsule(ViewLease lease, std::optional<DLPackAbi> versioned,
                               std::optional<std::uintptr_t> consumer_stream, bool copy) {
  auto owned = std::make_unique<DLPackExport>();
  owned->lease = std::move(lease);
  const DeviceHandle handle = owned->lease.view().handle;
  owned->consumer_stream = consumer_stream;
  owned->lease.set_holder(ViewHolder::DLPackConsumer);
  TensorView view = owned->lease.view();
  const DTypeInfo& info = dtype_info(view.dtype);
  if (copy) {
    // DLPack's copy=True: the producer copies. Host memory only (a device's
    // copy would be a new allocation the consumer cannot give back).
    if (view.dlpack_device_type != static_cast<int>(DLPackDevice::CPU))
      args::raise(PyExc_BufferError, "__dlpack__: copy=True: devbridge copies views of host memory only; this one is on " +
                                         std::string(view.device) + " (download it instead: bridge.download(...))");
    std::int64_t count = 1;
    for (int i = 0; i < view.shape.size(); ++i) count *= view.shape[i];
    owned->copied = std::make_unique_for_overwrite<std::byte[]>(static_cast<std::size_t>(count) * info.size);
    {
      GilReleased no_gil;
      copy_row_major(view, info.size, owned->copied.get());
    }
    owned->lease.reset();  // the copy is the consumer's: nothing of the bridge's is held
    owned->consumer_stream.reset();
    view.data = reinterpret_cast<std::uintptr_t>(owned->copied.get());
    view.byte_offset = 0;
    view.strides = contiguous_strides(view.shape);
    view.read_only = false;
  }
  // As numpy does for its read-only arrays: the unversioned ABI cannot say
  // "read-only", and a consumer taking it would write into memory that is
  // not the bridge's to change (an adopted object-store buffer).
  if (view.read_only && !versioned)
    args::raise(PyExc_BufferError,
                "__dlpack__: " + handle_repr(handle) +
                    " is read-only memory (adopted host memory, adopt_host), which only a DLPack >= 1.0 consumer "
                    "(max_version=(1, 0), as numpy asks) can be told about, and this consumer asked for the "
                    "unversioned capsule (jax does); take a copy instead: bridge.download(...) or "
                    "DeviceTensor.numpy()");

  describe_as_dltensor(view, versioned ? owned->versioned.dl_tensor : owned->managed.dl_tensor, owned->dims);
  PyObject* capsule;
  if (versioned) {
    owned->versioned.version = PackVersion{versioned->major, versioned->minor};
    owned->versioned.flags = (view.read_only ? 1 : 0) | (copy ? 2 : 0);  // bit 0: read-only, bit 1: a copy
    owned->versioned.manager_ctx = owned.get();
    owned->versioned.deleter = &delete_versioned_export;
    capsule = PyCapsule_New(&owned->versioned, kVersionedCapsuleName, &destroy_versioned);
  } else {
    owned->managed.manager_ctx = owned.get();
    owned->managed.deleter = &delete_export;
    capsule = PyCapsule_New(&owned->managed, kCapsuleName, &destroy_unversioned);
  }
  if (capsule == nullptr) throw nb::python_error();
  owned.release();  // the capsule owns it now, and its consumer once taken
  return nb::steal(capsule);
}

}  // namespace devbridge::python
