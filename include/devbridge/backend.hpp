// The backend seam: the whole of what a device driver supplies to the bridge.
//
// Nothing here names a vendor type. A backend hands out opaque allocations
// (a device address plus a token of its own), copies bytes between the host
// ring and those allocations, reports completions of asynchronous copies, and
// runs the worker's built-in compute role. All validation, lifetime and
// generation logic lives in the Bridge, so a new backend never touches it.
//
// The hooks come in groups, one concept and one header each (as IREE's HAL
// splits its driver interface), each header saying its threading and error
// rules:
//
//   seam/device_memory.hpp  DeviceMemory  allocate, free, make_part, release_part, validate_view
//   seam/host_memory.hpp    HostMemory    allocate_host, free_host, import_host, release_import
//   seam/transfers.hpp      Transfers     submit_copy, drain_completions, wait_for_completions, copy_to_peer
//   seam/timeline.hpp       Timeline      record_fence, fence_passed, wait_fence, release_fence,
//                                         order_consumer_queue, quiesce, stop_queues
//   seam/compute.hpp        Compute       launch_axpy
//
// and Backend, below, composes them with the one capabilities query
// (describe) and the test controls' accessor. A backend implements one class
// deriving from Backend. A new feature adds no virtual without fitting it
// into a group, and what only some backends can do is a field of
// BackendCapabilities, not a hook of its own.
//
// Errors: hooks throw devbridge::Error with a kind from the vocabulary and a
// message naming the vendor error (e.g. "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY").
// An Error with fatal() set means the device is unusable; the bridge turns
// Broken until restart.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "devbridge/error.hpp"
#include "devbridge/seam/compute.hpp"
#include "devbridge/seam/device_memory.hpp"
#include "devbridge/seam/host_memory.hpp"
#include "devbridge/seam/timeline.hpp"
#include "devbridge/seam/transfers.hpp"
#include "devbridge/test_controls.hpp"
#include "devbridge/types.hpp"

namespace devbridge {

// What the backend can do beyond the hooks every backend has, and the
// policies it asks of the bridge: the one capabilities query, a part of
// what describe() returns (BackendInfo). Code above the seam (the bridge,
// the transfer planner, the Python module, the CLI, the conformance suite)
// reads these instead of naming a backend or calling a hook per feature.
struct BackendCapabilities {
  // ---- device memory ----
  // Whether the bridge caches freed allocations for reuse by default
  // (BridgeOptions::caching_pool): where the driver's allocation is costly
  // or synchronizes the device (cuMemAlloc, clCreateBuffer).
  bool caches_allocations = false;
  // Whether the pool may split an allocation into parts that are
  // allocations of their own (DeviceMemory::make_part): the alignment part
  // offsets keep, or 0 when parts cannot be addressed (the pool then caches
  // whole allocations).
  std::uint64_t part_alignment = 0;
  // The caching pool's default cap (BridgeOptions::pool_cap_bytes unset):
  // the bytes of wholly free segments it keeps for reuse. Bounded where the
  // memory is the host's own (the host backend: 512 MiB), so an idle bridge
  // does not sit on the machine's RAM; unbounded on a device.
  std::uint64_t pool_cap_bytes = ~std::uint64_t{0};

  // ---- host memory ----
  // The ring's host memory is page-locked (the host backend: once a ring
  // block was allocated and locked).
  bool host_memory_page_locked = false;
  // Device memory is host memory the CPU reads and writes at the
  // allocation's address (the host backend): a stream may be written
  // straight into an allocation (Bridge::write_in_place, the planner's
  // WriteInPlace route), once, instead of twice through the ring. Not the
  // fake: its copies are what tests script and count.
  bool host_addressable = false;
  // One upload of a buffer is cheaper from a registration of it (register,
  // one copy, unregister) than through the ring (two copies): the device
  // shares host memory and registering pins nothing (host memory; OpenCL
  // with CL_DEVICE_HOST_UNIFIED_MEMORY). False where registering pins every
  // page (cuMemHostRegister costs about what the ring's extra copy does).
  bool cheap_registration = false;
  // HostMemory::import_host takes ImportUse::Adopt: host memory used in
  // place as device memory (host, OpenCL, the fake; not CUDA). Every
  // backend imports for staging, read-only or not.
  bool adopt = false;

  // ---- transfers ----
  // Transfers::copy_to_peer can move bytes to a peer's allocation without
  // the host (CUDA, to a CUDA backend; the fake, to a fake). A backend
  // without it answers false for every peer.
  bool peer_copy = false;
  // Transfers::write_mapped maps allocations for the CPU to write (OpenCL):
  // where device memory is not host memory, a stream is still written
  // straight into the allocations (Bridge::write_in_place, the planner's
  // WriteInPlace route), one copy instead of two through the ring.
  bool maps_for_write = false;

  // ---- timeline ----
  // Timeline::record_fence takes Queue::Consumer: a consumer's queue can be
  // fenced (CUDA, OpenCL, the fake). Not host memory: a CPU consumer is done
  // when its call returns. Timeline::order_consumer_queue is the device's
  // own (CUDA, OpenCL): the fake fences consumer queues but orders none.
  bool consumer_queues = false;

  // ---- native handles ----
  // The driver context the device addresses are valid in (CUDA: the
  // CUcontext; OpenCL: the cl_context), for a consumer that must compute in
  // the same one; 0 for a backend without one.
  std::uintptr_t native_context = 0;
};

// The device, as describe() gives it: what it is, and what it can do (its
// capabilities, the base).
struct BackendInfo : BackendCapabilities {
  std::string name;           // registry name: "host", "fake", "cuda", ...
  std::string vendor;         // "cpu", "nvidia", "fake", ...
  // What the "device" option of make_backend takes to bind this device
  // again: "0" (a CUDA ordinal, the one host or fake device), "0:1" (an
  // OpenCL platform:device).
  std::string device_id{};
  std::string device_name;    // the CPU model, the GPU name
  std::string pci_bus_id;     // "0000:3b:00.0" where the driver reports one, else empty
  // What the device can do beyond moving bytes, in words a user greps for:
  // "cl_khr_fp16", "compute capability 9.0", "page-locked host memory".
  std::vector<std::string> capabilities{};
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
  std::vector<DType> dtypes{};
  // Dtypes kernels on the device compute in (launch_axpy's float32, a
  // consumer's kernels): OpenCL without cl_khr_fp16 holds float16 but does
  // not compute in it. Empty: every dtype it holds. A call that computes
  // (launch_axpy), or hands a typed view to a consumer that computes in it
  // (Python's to_tinygrad, through Bridge::require_compute), is refused
  // (UnsupportedDType) for a dtype not listed here.
  std::vector<DType> compute_dtypes{};
  const std::vector<DType>& computed_dtypes() const noexcept { return compute_dtypes.empty() ? dtypes : compute_dtypes; }
  std::string notes;               // e.g. why the ring is not page-locked
};

// A backend's options as text, so that callers (the Python module, the CLI)
// pass them through without knowing which backend takes what. Every backend
// takes "device" (a BackendInfo::device_id from list_devices); the rest are
// its own (docs/BACKENDS.md). A key the backend does not take, or a value it
// cannot parse, is Error(Unsupported) naming the key and what it takes.
using BackendOptions = std::map<std::string, std::string, std::less<>>;

class Backend : public Transfers, public Timeline, public DeviceMemory, public HostMemory, public Compute {
 public:
  virtual ~Backend() = default;

  // Describe the device and what it can do (BackendCapabilities); cheap
  // enough to call from `devbridge info`. The bridge reads the memory
  // policies (caches_allocations, part_alignment, pool_cap_bytes) once, when
  // it opens.
  virtual BackendInfo describe() = 0;

  // ---- tests ----
  // What tests observe and steer behind the seam (leak counts, holding
  // copies, the fake's scripting): devbridge/test_controls.hpp. Null for a
  // backend without any. Production paths never call it.
  virtual TestControls* test_controls() noexcept { return nullptr; }
};

}  // namespace devbridge
