// The seam's device-memory group: allocations, the pool's parts of them, and
// the last word on a view over one.
//
// Threading: the bridge calls allocate and free from many client threads at
// once, never for the same allocation concurrently with its free; make_part
// and release_part come from the pool under the bridge's lock; validate_view
// from any thread. A backend must be safe under that.
//
// Errors: hooks throw devbridge::Error with a kind from the vocabulary and a
// message naming the vendor error (e.g. "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY");
// an Error with fatal() set means the device is unusable (the bridge turns
// Broken until restart). Frees and releases are noexcept: a backend logs what
// goes wrong there.
#pragma once

#include <cstdint>

#include "devbridge/types.hpp"

namespace devbridge {

// An allocation as the backend made it. `address` is what views hand out;
// `token` is the backend's own bookkeeping (never read above the seam).
struct DeviceAllocation {
  std::uint64_t address = 0;
  std::uint64_t bytes = 0;
  std::uintptr_t token = 0;
};

class DeviceMemory {
 public:
  // `alignment` is a power of two; the backend may align more.
  // Refusal: Error(AllocationFailed) with bytes asked and free where known.
  virtual DeviceAllocation allocate(std::uint64_t bytes, std::uint64_t alignment) = 0;
  virtual void free(const DeviceAllocation& allocation) noexcept = 0;

  // Parts, where BackendCapabilities::part_alignment is not 0: the pool may
  // split an allocation into parts that are allocations of their own
  // (packing small tensors into one segment, splitting a large one), each
  // starting at a multiple of part_alignment. A part is used like any
  // allocation (copies, launches, views) but never freed: the pool releases
  // it, and frees the whole allocation once every part of it is released.
  //
  // Bytes [offset, offset + bytes) of `whole` as an allocation of its own.
  // The default is address arithmetic over the whole's token, for devices
  // whose memory is addressed linearly (host memory, CUDA).
  virtual DeviceAllocation make_part(const DeviceAllocation& whole, std::uint64_t offset, std::uint64_t bytes) {
    return DeviceAllocation{whole.address + offset, bytes, whole.token};
  }
  virtual void release_part(const DeviceAllocation& /*part*/) noexcept {}

  // Last word on a view the bridge has already validated against the
  // allocation (dtype, bounds). A backend that cannot express it (no device
  // address, unsupported dtype) throws InvalidTensorView or Unsupported.
  virtual void validate_view(const DeviceAllocation& /*allocation*/, const TensorView& /*view*/) {}

 protected:
  ~DeviceMemory() = default;  // a backend is deleted through Backend
};

}  // namespace devbridge
