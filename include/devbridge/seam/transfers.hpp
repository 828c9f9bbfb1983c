// The seam's transfers group: copies between host memory (the ring, or an
// import) and device memory, their completions, and device-to-device copies
// to another bridge's backend.
//
// Threading: the bridge calls submit_copy from many client threads at once,
// never for an allocation concurrently with its free; drain_completions and
// wait_for_completions may also be called concurrently. A backend must be
// safe under that.
//
// Errors: devbridge::Error with a kind from the vocabulary (DeviceCopyFailed
// up, OutputCopyFailed down) and a message naming the vendor error; fatal()
// when the device is unusable (the bridge turns Broken until restart). A copy
// that fails after submit_copy returned reports it as its Completion.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "devbridge/error.hpp"
#include "devbridge/seam/device_memory.hpp"
#include "devbridge/seam/unsupported.hpp"
#include "devbridge/types.hpp"

namespace devbridge {

class Backend;

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

// A range of an allocation the CPU writes through Transfers::write_mapped.
struct MappedWrite {
  DeviceAllocation device;
  std::uint64_t offset = 0;
  std::uint64_t len = 0;
};

struct Completion {
  CopyEvent event;
  bool ok = true;
  ErrorKind error = ErrorKind::DeviceCopyFailed;
  std::string message;  // empty on success
  bool fatal = false;
};

class Transfers {
 public:
  virtual void submit_copy(const CopyRequest& request) = 0;

  // Move every completion that is ready into `out` (appending).
  virtual void drain_completions(std::vector<Completion>& out) = 0;
  // Block until a completion may be ready to drain, or until `timeout`.
  // Returns false on timeout. Spurious true is allowed.
  virtual bool wait_for_completions(std::chrono::nanoseconds timeout) = 0;

  // Copies `len` bytes device to device, from `source` + source_offset of
  // this backend into `destination` + destination_offset of
  // `destination_backend` (another bridge's), without the host: CUDA's copy
  // within one context, or its peer copy between two devices. Ordered after
  // everything already submitted to either backend; returns once the bytes
  // have landed. Returns false, touching nothing, where there is no such
  // path (another vendor, another kind of device; every peer of a backend
  // without BackendCapabilities::peer_copy): the caller stages through the
  // host instead. The bridges have checked both ranges and hold both
  // allocations for the call.
  virtual bool copy_to_peer(const DeviceAllocation& /*source*/, std::uint64_t /*source_offset*/,
                            Backend& /*destination_backend*/, const DeviceAllocation& /*destination*/,
                            std::uint64_t /*destination_offset*/, std::uint64_t /*len*/) {
    return false;
  }
  // Maps `ranges` for the CPU to write (their old bytes need not be kept),
  // calls `write` with their bytes in order, unmaps them, and returns once
  // the device sees the bytes: a stream written straight into device memory
  // that is not host memory (OpenCL: clEnqueueMapBuffer; on a device that
  // shares host memory, PoCL's CPU device, no copy at all). Ordered after
  // what was already submitted on the backend's queue. Where `write` throws,
  // the ranges are unmapped (their bytes undefined) and the exception goes
  // on. The bridge has checked the ranges and holds the allocations for the
  // call. Only where BackendCapabilities::maps_for_write; Unsupported
  // elsewhere.
  virtual void write_mapped(std::span<const MappedWrite> /*ranges*/,
                            const std::function<void(std::span<const std::span<std::byte>>)>& /*write*/) {
    seam::unsupported("mapping device memory for writing");
  }

 protected:
  ~Transfers() = default;  // a backend is deleted through Backend
};

}  // namespace devbridge
