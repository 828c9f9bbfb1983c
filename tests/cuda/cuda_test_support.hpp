// Shared helpers for the CUDA tests.
#pragma once

#include <dlfcn.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "backends/cuda/cuda_driver.hpp"
#include "cuda_test_entry_points.hpp"
#include "devbridge/backend.hpp"

namespace devbridge::cuda::testing {

// Sets an environment variable for one scope and restores it afterwards.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

inline constexpr const char* kMissingDriver = "/nonexistent/devbridge-test/libcuda.so.1";

// Releases a page-locked block however the test ends.
// A copy request as the bridge would submit it (tests call the backend
// directly); `domain` tags its event.
inline CopyRequest copy_request(std::uint64_t domain, CopyDirection direction, CopyMode mode, std::uint64_t id,
                                std::byte* host, const DeviceAllocation& device, std::uint64_t offset,
                                std::uint64_t len, const CopyLayout& layout = {}) {
  CopyRequest r;
  r.direction = direction;
  r.mode = mode;
  r.event = CopyEvent{domain, 1, id};
  r.host = host;
  r.device = device;
  r.device_offset = offset;
  r.len = len;
  r.layout = layout;
  return r;
}

struct HostBlockHolder {
  Backend& backend;
  HostBlock block;
  ~HostBlockHolder() { backend.free_host(block); }
};

struct AllocationHolder {
  Backend& backend;
  DeviceAllocation allocation;
  ~AllocationHolder() { backend.free(allocation); }
};

// Gives a fence back however the test ends (the backend warns at teardown
// about fences never released).
// Not copyable: a copy would give the fence back twice.
struct FenceHolder {
  FenceHolder(Backend& backend_, Fence fence_) : backend(backend_), fence(fence_) {}
  ~FenceHolder() { backend.release_fence(fence); }
  FenceHolder(const FenceHolder&) = delete;
  FenceHolder& operator=(const FenceHolder&) = delete;
  Backend& backend;
  Fence fence;
};

// A symbol of the loaded driver that only the emulated one has (its test
// hooks); null on a real driver.
template <typename Function>
Function emulator_hook(const char* name) {
  void* library = dlopen(cuda::detail::driver().path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  return library == nullptr ? nullptr : reinterpret_cast<Function>(dlsym(library, name));
}

// A context of the test's own (cuCtxCreate_v2), so a test may fault it
// without harming the primary context the others share.
struct OwnContext {
  detail::CUcontext context = nullptr;
  PFN_cuCtxDestroy_v2 destroy = nullptr;

  OwnContext() {
    const cuda::detail::Driver& driver = cuda::detail::driver();
    void* library = dlopen(driver.path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (library == nullptr) return;
    auto create = reinterpret_cast<PFN_cuCtxCreate_v2>(dlsym(library, "cuCtxCreate_v2"));
    destroy = reinterpret_cast<PFN_cuCtxDestroy_v2>(dlsym(library, "cuCtxDestroy_v2"));
    detail::CUdevice device = 0;
    if (create == nullptr || destroy == nullptr || driver.cuDeviceGet(&device, 0) != detail::CUDA_SUCCESS) return;
    if (create(&context, 0, device) != detail::CUDA_SUCCESS) {
      context = nullptr;
      return;
    }
    // cuCtxCreate makes the new context current; hand the thread back clean.
    detail::CUcontext popped = nullptr;
    driver.cuCtxPopCurrent_v2(&popped);
  }
  ~OwnContext() {
    if (context != nullptr) destroy(context);
  }
  OwnContext(const OwnContext&) = delete;
  OwnContext& operator=(const OwnContext&) = delete;
};

}  // namespace devbridge::cuda::testing
