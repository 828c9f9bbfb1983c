// The seam's compute group: the worker's built-in compute role.
//
// Threading: the bridge calls launch_axpy from many client threads at once,
// never for an allocation concurrently with its free. A backend must be safe
// under that.
//
// Errors: devbridge::Error naming the vendor error; fatal() when the device
// is unusable (the bridge turns Broken until restart).
#pragma once

#include <cstdint>

#include "devbridge/seam/device_memory.hpp"
#include "devbridge/seam/timeline.hpp"

namespace devbridge {

// y[i] = a * x[i] + b over float32.
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

class Compute {
 public:
  // Queues the compute role; returns a fence on Queue::Compute that passes
  // once the kernel finished. The fence is recorded with the launch, so no
  // kernel is ever left untracked: if it cannot be recorded, the backend
  // finishes the kernel before it throws.
  virtual Fence launch_axpy(const AxpyLaunch& launch) = 0;

 protected:
  ~Compute() = default;  // a backend is deleted through Backend
};

}  // namespace devbridge
