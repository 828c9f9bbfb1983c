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
#include "devbridge/test_controls.hpp"
#include "devbridge/types.hpp"

namespace devbridge {

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
  // What the device is (consumer_names.hpp names it for tinygrad and
  // DLPack): its kind, and its ordinal among the devices of that kind the
  // driver lists (a CUDA ordinal; an OpenCL device's index in its platform).
  DeviceKind device_kind = DeviceKind::Cpu;
  int device_ordinal = 0;
  std::uint64_t total_memory = 0;  // bytes, 0 where unknown
  std::uint64_t free_memory = 0;   // bytes at describe time, 0 where unknown
  // Dtypes the device holds: stores, moves, checkpoints and views as bytes.
  // Every backend holds every dtype (a buffer holds any bytes); only the
  // fake's `dtypes` option narrows it, for tests.
  std::vector<DType> dtypes;
  // Dtypes kernels on the device compute in (launch_axpy's float32, a
  // consumer's kernels): OpenCL without cl_khr_fp16 holds float16 but does
  // not compute in it. Empty: every dtype it holds. A call that computes
  // (launch_axpy), or hands a typed view to a consumer that computes in it
  // (Python's to_tinygrad, through Bridge::require_compute), is refused
  // (UnsupportedDType) for a dtype not listed here.
  std::vector<DType> compute_dtypes;
  const std::vector<DType>& computed_dtypes() const noexcept { return compute_dtypes.empty() ? dtypes : compute_dtypes; }
  bool host_memory_page_locked = false;
  // Device memory is host memory the CPU reads and writes at a view's
  // address (the host backend): staging may copy through a view, once,
  // instead of twice through the ring. Not the fake: its copies are what
  // tests script and count.
  bool host_addressable = false;
  // One upload of a buffer is cheaper from a registration of it (register,
  // one copy, unregister) than through the ring (two copies): the device
  // shares host memory and registering pins nothing (host memory; OpenCL
  // with CL_DEVICE_HOST_UNIFIED_MEMORY). False where registering pins every
  // page (cuMemHostRegister costs about what the ring's extra copy does).
  bool cheap_registration = false;
  // The caching pool's default cap (BridgeOptions::pool_cap_bytes unset):
  // the bytes of wholly free segments it keeps for reuse. Bounded where the
  // memory is the host's own (the host backend: 512 MiB), so an idle bridge
  // does not sit on the machine's RAM; unbounded on a device.
  std::uint64_t pool_cap_bytes = ~std::uint64_t{0};
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
// against the ring (or a registered region) and the allocation. For Async,
// the backend reports the outcome later through drain_completions under
// `event`; it must never report it from inside submit_copy's caller frame in
// a way the caller cannot see (queue it). For Sync, submit_copy returns once
// the copy is done, or throws.
//
// A pitched copy (layout.pitched()) moves layout.rows rows of
// layout.row_bytes, row i from host + i * host_pitch to device_offset + i *
// device_pitch (or back), as one copy with one event (cuMemcpy2DAsync,
// clEnqueueWriteBufferRect); `len` is the bytes moved, rows * row_bytes. The
// bytes between rows are never touched.
struct CopyRequest {
  CopyDirection direction = CopyDirection::HostToDevice;
  CopyMode mode = CopyMode::Async;
  CopyEvent event;
  std::byte* host = nullptr;
  DeviceAllocation device;
  std::uint64_t device_offset = 0;
  std::uint64_t len = 0;
  CopyLayout layout;  // rows == 0: one contiguous run of `len` bytes
};

// Bytes a request reaches from its host pointer, and from its device offset:
// `len` for a plain copy, the layout's spans for a pitched one (which the
// bridge has checked fit in 64 bits).
inline std::uint64_t request_host_span(const CopyRequest& request) {
  return request.layout.pitched() ? layout_host_span(request.layout) : request.len;
}
inline std::uint64_t request_device_span(const CopyRequest& request) {
  return request.layout.pitched() ? layout_device_span(request.layout) : request.len;
}

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

// ---- queues and fences ----
// A backend runs work on queues; each runs its work in order. The bridge
// never frees memory on the word of a host call alone: a use that ends on a
// queue (a launch, a consumer's step, a consumer reading a view) ends at a
// fence recorded on that queue, and the memory waits in the bridge's drop
// queue until the fence passes (docs/ARCHITECTURE.md, "Lifetimes on the
// device").
enum class Queue : std::uint8_t {
  CopyUp,    // host ring -> device copies
  CopyDown,  // device -> host ring copies
  Compute,   // the built-in compute role (launch_axpy)
  Consumer,  // a queue of someone else's, handed in (QueueRef::consumer)
};

// Where a fence goes: one of the backend's own queues, or a consumer's queue
// in the backend's numbering (CUDA: a CUstream, 1 the legacy default stream,
// 2 the per-thread one; OpenCL: a cl_command_queue).
struct QueueRef {
  Queue queue = Queue::Compute;
  std::uintptr_t consumer = 0;  // Queue::Consumer only
  bool operator==(const QueueRef&) const = default;
};

// A point on a queue, owned by the backend: it passes once everything
// enqueued there before it has finished. The bridge tests it, may wait on
// it, and gives it back exactly once (release_fence). The zero fence has
// already passed: work that finished before its call returned gets it, and
// the backend is never asked about it.
struct Fence {
  std::uintptr_t token = 0;
  bool pending() const noexcept { return token != 0; }
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

  // Host memory of the caller's, registered as a staging source beside the
  // ring (Bridge::register_host): the backend pins it where it can
  // (cuMemHostRegister; an OpenCL buffer over it, CL_MEM_USE_HOST_PTR) and
  // copies take addresses inside it like the ring's. The bridge has checked
  // that it overlaps no other registration, and unregisters it only when no
  // copy uses it and the device is done with it. By default it is used as
  // it is (host memory needs nothing more).
  virtual HostBlock register_host(std::byte* data, std::uint64_t bytes) { return HostBlock{data, bytes, false, 0}; }
  // Memory the device only reads from (an immutable object-store buffer,
  // registered for uploads only): CUDA pins it with
  // CU_MEMHOSTREGISTER_READ_ONLY, which it needs for read-only pages.
  virtual HostBlock register_host_read_only(const std::byte* data, std::uint64_t bytes) {
    return register_host(const_cast<std::byte*>(data), bytes);
  }
  virtual void unregister_host(const HostBlock& block) noexcept { (void)block; }
  // Bytes [offset, offset + bytes) of a read-only registered region used in
  // place as device memory, no copy (Bridge::adopt_host): where the device
  // addresses host memory directly. The bridge has validated the range and
  // keeps the region registered until release_adopted; the allocation is
  // only ever read (copies from it, views, launch inputs), never freed.
  // Optional: Unsupported by default.
  virtual DeviceAllocation adopt_host(const HostBlock& region, std::uint64_t offset, std::uint64_t bytes) {
    (void)region, (void)offset, (void)bytes;
    unsupported("way to use host memory in place as device memory (adopt_host)");
  }
  virtual void release_adopted(const DeviceAllocation& adopted) noexcept { (void)adopted; }

  virtual void submit_copy(const CopyRequest& request) = 0;

  // Move every completion that is ready into `out` (appending).
  virtual void drain_completions(std::vector<Completion>& out) = 0;
  // Block until a completion may be ready to drain, or until `timeout`.
  // Returns false on timeout. Spurious true is allowed.
  virtual bool wait_for_completions(std::chrono::nanoseconds timeout) = 0;
  // Finish or cancel everything in flight on the backend's own queues
  // (copies and launches). Afterwards nothing the backend was given touches
  // memory and every fence on its own queues has passed; completions of that
  // work may still be drained. A consumer's queue is not the backend's to
  // finish: its fences pass when the consumer's work does.
  virtual void quiesce() = 0;

  // Queues the compute role; returns a fence on Queue::Compute that passes
  // once the kernel finished. The fence is recorded with the launch, so no
  // kernel is ever left untracked: if it cannot be recorded, the backend
  // finishes the kernel before it throws.
  virtual Fence launch_axpy(const AxpyLaunch& launch) = 0;

  // Records a fence after everything enqueued on `where` so far.
  // Queue::Consumer is optional: Error(Unsupported) from a backend whose
  // consumers have no queues (host memory: a CPU consumer is done when its
  // call returns).
  virtual Fence record_fence(const QueueRef& where) = 0;
  // True once the fence passed; also true when the work before it failed
  // and nothing of it runs any more. Never blocks. A fault that leaves the
  // device's state unknown throws (fatal); the bridge then keeps the memory.
  virtual bool fence_passed(Fence fence) = 0;
  // Blocks until the fence passed (true) or `timeout` went by (false).
  virtual bool wait_fence(Fence fence, std::chrono::nanoseconds timeout) = 0;
  // The bridge will not ask about the fence again.
  virtual void release_fence(Fence fence) noexcept = 0;

  // Last word on a view the bridge has already validated against the
  // allocation (dtype, bounds). A backend that cannot express it (no device
  // address, unsupported dtype) throws InvalidTensorView or Unsupported.
  virtual void validate_view(const DeviceAllocation& allocation, const TensorView& view) {
    (void)allocation;
    (void)view;
  }

  // ---- policy ----
  // Whether the bridge caches freed allocations for reuse by default
  // (BridgeOptions::caching_pool): where the driver's allocation is costly
  // or synchronizes the device (cuMemAlloc, clCreateBuffer).
  virtual bool caches_allocations() const { return false; }

  // Whether the pool may split an allocation into parts that are
  // allocations of their own (packing small tensors into one segment,
  // splitting a large one): the alignment part offsets keep, or 0 when
  // parts cannot be addressed (the pool then caches whole allocations).
  // A part is used like any allocation (copies, launches, views) but never
  // freed: the pool releases it, and frees the whole allocation once every
  // part of it is released.
  virtual std::uint64_t part_alignment() const { return 0; }
  // Bytes [offset, offset + bytes) of `whole` as an allocation of its own.
  // The default is address arithmetic over the whole's token, for devices
  // whose memory is addressed linearly (host memory, CUDA).
  virtual DeviceAllocation make_part(const DeviceAllocation& whole, std::uint64_t offset, std::uint64_t bytes) {
    return DeviceAllocation{whole.address + offset, bytes, whole.token};
  }
  virtual void release_part(const DeviceAllocation& part) noexcept { (void)part; }

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
  // Copies `len` bytes device to device, from `source` + source_offset of
  // this backend into `destination` + destination_offset of
  // `destination_backend` (another bridge's), without the host: CUDA's copy
  // within one context, or its peer copy between two devices. Ordered after
  // everything already submitted to either backend; returns once the bytes
  // have landed. Returns false, touching nothing, where there is no such
  // path (another vendor, another kind of device): the caller stages through
  // the host instead. The bridges have checked both ranges and hold both
  // allocations for the call.
  virtual bool copy_to_peer(const DeviceAllocation& source, std::uint64_t source_offset,
                            Backend& destination_backend, const DeviceAllocation& destination,
                            std::uint64_t destination_offset, std::uint64_t len) {
    (void)source, (void)source_offset, (void)destination_backend, (void)destination, (void)destination_offset,
        (void)len;
    return false;
  }

  // ---- tests ----
  // What tests observe and steer behind the seam (leak counts, holding
  // copies, the fake's scripting): devbridge/test_controls.hpp. Null for a
  // backend without any. Production paths never call it.
  virtual TestControls* test_controls() noexcept { return nullptr; }

 private:
  [[noreturn]] static void unsupported(std::string_view what) {
    throw Error(ErrorKind::Unsupported, std::string("this backend has no ") + std::string(what) + " (an optional capability)");
  }
};

}  // namespace devbridge
