// The backend seam: the whole of what a device driver supplies to the bridge.
//
// Nothing here names a vendor type. A backend hands out opaque allocations
// (a device address plus a token of its own), copies bytes between the host
// ring and those allocations, reports completions of asynchronous copies, and
// runs the worker's built-in compute role. All validation, lifetime and
// generation logic lives in the Bridge, so a new backend never touches it.
//
// Threading: the bridge calls allocate/free/submit_copy/launch from many
// client threads at once, never for the same allocation concurrently with its
// free. drain_completions and wait_for_completions may also be called
// concurrently. A backend must be safe under that.
//
// Errors: hooks throw devbridge::Error with a kind from the vocabulary and a
// message naming the vendor error (e.g. "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY").
// An Error with fatal() set means the device is unusable; the bridge turns
// Broken until restart.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "devbridge/error.hpp"
#include "devbridge/types.hpp"

namespace devbridge {

// DLPack device types (dlpack.h DLDeviceType), kept here for the same reason
// as DLPackTypeCode.
enum class DLPackDevice : int { CPU = 1, CUDA = 2, CUDAHost = 3, OpenCL = 4 };

struct BackendInfo {
  std::string name;           // registry name: "host", "fake", "cuda", ...
  std::string vendor;         // "cpu", "nvidia", "fake", ...
  // What the "device" option of make_backend takes to bind this device
  // again: "0" (a CUDA ordinal, the one host or fake device), "0:1" (an
  // OpenCL platform:device).
  std::string device_id;
  std::string device_name;    // the CPU model, the GPU name
  std::string pci_bus_id;     // "0000:3b:00.0" where the driver reports one, else empty
  // What the device can do beyond moving bytes, in words a user greps for:
  // "cl_khr_fp16", "compute capability 9.0", "page-locked host memory".
  std::vector<std::string> capabilities;
  std::string device_string;  // tinygrad's device: "CPU", "CUDA:0"
  DLPackDevice dlpack_device = DLPackDevice::CPU;
  int device_ordinal = 0;
  std::uint64_t total_memory = 0;  // bytes, 0 where unknown
  std::uint64_t free_memory = 0;   // bytes at describe time, 0 where unknown
  std::vector<DType> dtypes;       // dtypes the backend can hold and view
  bool host_memory_page_locked = false;
  // Device memory is host memory the CPU reads and writes at a view's
  // address (the host backend): staging may copy through a view, once,
  // instead of twice through the ring. Not the fake: its copies are what
  // tests script and count.
  bool host_addressable = false;
  std::string notes;               // e.g. why the ring is not page-locked
};

// A backend's options as text, so that callers (the Python module, the CLI)
// pass them through without knowing which backend takes what. Every backend
// takes "device" (a BackendInfo::device_id from list_devices); the rest are
// its own (docs/BACKENDS.md). A key the backend does not take, or a value it
// cannot parse, is Error(Unsupported) naming the key and what it takes.
using BackendOptions = std::map<std::string, std::string, std::less<>>;

// An allocation as the backend made it. `address` is what views hand out;
// `token` is the backend's own bookkeeping (never read above the seam).
struct DeviceAllocation {
  std::uint64_t address = 0;
  std::uint64_t bytes = 0;
  std::uintptr_t token = 0;
};

// Host memory for the ring, page-locked where the backend can.
struct HostBlock {
  std::byte* data = nullptr;
  std::uint64_t bytes = 0;
  bool page_locked = false;
  std::uintptr_t token = 0;
};

// One validated copy: host and device ranges have already been checked
// against the ring and the allocation. For Async, the backend reports the
// outcome later through drain_completions under `event`; it must never report
// it from inside submit_copy's caller frame in a way the caller cannot see
// (queue it). For Sync, submit_copy returns once the copy is done, or throws.
struct CopyRequest {
  CopyDirection direction = CopyDirection::HostToDevice;
  CopyMode mode = CopyMode::Async;
  CopyEvent event;
  std::byte* host = nullptr;
  DeviceAllocation device;
  std::uint64_t device_offset = 0;
  std::uint64_t len = 0;
};

struct Completion {
  CopyEvent event;
  bool ok = true;
  ErrorKind error = ErrorKind::DeviceCopyFailed;
  std::string message;  // empty on success
  bool fatal = false;
};

// The worker's built-in compute role, y[i] = a * x[i] + b over float32.
// Ordering: it runs after every copy already submitted into x, and before any
// copy from y submitted after it returns (stream order on a GPU; a backend
// without streams may simply wait).
struct AxpyLaunch {
  DeviceAllocation x;
  std::uint64_t x_offset = 0;
  DeviceAllocation y;
  std::uint64_t y_offset = 0;
  std::uint64_t count = 0;  // elements
  float a = 1.0f;
  float b = 0.0f;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // Describe the device; cheap enough to call from `devbridge info`.
  virtual BackendInfo describe() = 0;

  // Device memory. `alignment` is a power of two; the backend may align more.
  // Refusal: Error(AllocationFailed) with bytes asked and free where known.
  virtual DeviceAllocation allocate(std::uint64_t bytes, std::uint64_t alignment) = 0;
  virtual void free(const DeviceAllocation& allocation) noexcept = 0;

  // Host memory for the ring.
  virtual HostBlock allocate_host(std::uint64_t bytes) = 0;
  virtual void free_host(const HostBlock& block) noexcept = 0;

  virtual void submit_copy(const CopyRequest& request) = 0;

  // Move every completion that is ready into `out` (appending).
  virtual void drain_completions(std::vector<Completion>& out) = 0;
  // Block until a completion may be ready to drain, or until `timeout`.
  // Returns false on timeout. Spurious true is allowed.
  virtual bool wait_for_completions(std::chrono::nanoseconds timeout) = 0;
  // Finish or cancel everything in flight. Afterwards nothing the backend was
  // given touches memory; completions of that work may still be drained.
  virtual void quiesce() = 0;

  virtual void launch_axpy(const AxpyLaunch& launch) = 0;

  // Last word on a view the bridge has already validated against the
  // allocation (dtype, bounds). A backend that cannot express it (no device
  // address, unsupported dtype) throws InvalidTensorView or Unsupported.
  virtual void validate_view(const DeviceAllocation& allocation, const TensorView& view) {
    (void)allocation;
    (void)view;
  }

  // ---- optional capabilities ----
  // What only some backends can do. Each answers Error(Unsupported) unless
  // the backend overrides it, so code above the seam (the Python module, the
  // CLI, the conformance suite) asks the backend instead of naming it.

  // The driver context the device addresses are valid in (CUDA: the
  // CUcontext), for a consumer that must compute in the same one.
  virtual std::uintptr_t native_context() { unsupported("native context"); }
  // Makes a consumer's queue wait, on the device and without blocking the
  // host, for everything submitted so far (DLPack's `stream` argument).
  // `queue` in the backend's numbering (CUDA: a CUstream; 1 the legacy
  // default stream, 2 the per-thread one).
  virtual void order_consumer_queue(std::uintptr_t queue) {
    (void)queue;
    unsupported("consumer queues");
  }
  // Test control: device allocations made and not yet freed (a restart or
  // close must bring it to 0).
  virtual std::uint64_t live_allocations() const { unsupported("live-allocation count"); }
  // Test control: while held, asynchronous copies submitted from now on stay
  // pending; quiesce() lifts the hold.
  virtual void hold_copies(bool hold) {
    (void)hold;
    unsupported("way to hold copies");
  }

 private:
  [[noreturn]] static void unsupported(std::string_view what) {
    throw Error(ErrorKind::Unsupported, std::string("this backend has no ") + std::string(what) + " (an optional capability)");
  }
};

}  // namespace devbridge
