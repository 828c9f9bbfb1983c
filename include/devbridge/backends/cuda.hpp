// The CUDA backend. The driver API is loaded at run time (dlopen of
// libcuda.so.1), so a build with this backend runs on machines without a GPU
// or driver; there probe() says why CUDA is unavailable.
#pragma once

#include <memory>
#include <string>

#include "devbridge/backend.hpp"

namespace devbridge::cuda {

struct Probe {
  bool available = false;
  std::string reason;  // e.g. "no driver (libcuda.so.1: cannot open shared object file)"
  int device_count = 0;
};

Probe probe();

struct Options {
  int ordinal = 0;
  // A CUcontext the caller owns (e.g. tinygrad's); null means the device's
  // primary context. Pointers handed out are valid in that context.
  void* context = nullptr;
};

// Throws Error(Unavailable) with the probe's reason.
std::unique_ptr<Backend> make_cuda_backend(const Options& options = {});

}  // namespace devbridge::cuda
