// The seam's host-memory group: the ring's own blocks, and host memory of the
// caller's imported beside it (IREE's import_buffer): registered as a staging
// source, read-only or not, or adopted in place as device memory.
//
// Threading: allocate_host and free_host come from the bridge's construction,
// restart and close; import_host and release_import from any client thread,
// without the bridge's lock (cuMemHostRegister can take milliseconds), never
// for the same memory concurrently with its release. A backend must be safe
// under that.
//
// Errors: as the device-memory group (device_memory.hpp): devbridge::Error
// naming the vendor error, fatal() when the device is unusable; releases are
// noexcept and log.
#pragma once

#include <cstddef>
#include <cstdint>

#include "devbridge/seam/device_memory.hpp"
#include "devbridge/seam/unsupported.hpp"

namespace devbridge {

// Host memory for the ring, page-locked where the backend can; also a
// registration of the caller's memory (an import's block).
struct HostBlock {
  std::byte* data = nullptr;
  std::uint64_t bytes = 0;
  bool page_locked = false;
  std::uintptr_t token = 0;
};

// What an import makes of host memory.
enum class ImportUse : std::uint8_t {
  // The caller's memory registered as a staging source beside the ring
  // (Bridge::register_host): the backend pins it where it can
  // (cuMemHostRegister; an OpenCL buffer over it, CL_MEM_USE_HOST_PTR) and
  // copies take addresses inside it like the ring's. By default it is used
  // as it is (host memory needs nothing more).
  Staging,
  // The same for memory the device only reads from (an immutable
  // object-store buffer, registered for uploads only): CUDA pins it with
  // CU_MEMHOSTREGISTER_READ_ONLY, which it needs for read-only pages. By
  // default the same as Staging. Every backend imports read-only memory.
  StagingReadOnly,
  // Bytes [offset, offset + bytes) of a read-only import (`region`) used in
  // place as device memory, no copy (Bridge::adopt_host): where the device
  // addresses host memory directly (BackendCapabilities::adopt). The bridge
  // has validated the range and keeps the region imported until the
  // adoption is released; the allocation is only ever read (copies from
  // it, views, launch inputs), never freed. Error(Unsupported) by default.
  Adopt,
};

struct ImportRequest {
  ImportUse use = ImportUse::Staging;
  std::byte* data = nullptr;  // Staging, StagingReadOnly: the caller's memory
  std::uint64_t bytes = 0;    // the bytes imported (adopted)
  HostBlock region{};         // Adopt: the read-only import the bytes lie in
  std::uint64_t offset = 0;   // Adopt: where in it they start
};

// What import_host made, and what release_import gets back: a registration
// (`block`), or an adoption (`device`, with `adopted` set).
struct HostImport {
  HostBlock block{};
  DeviceAllocation device{};
  bool adopted = false;
};

class HostMemory {
 public:
  // Host memory for the ring.
  virtual HostBlock allocate_host(std::uint64_t bytes) = 0;
  virtual void free_host(const HostBlock& block) noexcept = 0;

  // The caller's memory imported as `request.use` says. For a staging
  // import the bridge has checked that it overlaps no other registration,
  // and releases it only when no copy uses it and the device is done with
  // it; an adoption is released before the region it lies in.
  virtual HostImport import_host(const ImportRequest& request) {
    if (request.use == ImportUse::Adopt)
      seam::unsupported("way to use host memory in place as device memory (adopt_host)");
    return HostImport{.block = HostBlock{request.data, request.bytes, false, 0}};
  }
  virtual void release_import(const HostImport& /*imported*/) noexcept {}

 protected:
  ~HostMemory() = default;  // a backend is deleted through Backend
};

}  // namespace devbridge
