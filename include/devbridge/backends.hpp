// Which backends this build has, whether each can run here, and a factory.
// Adding a backend: a folder under src/backends/<name>/ with a factory, and
// one row in src/backends/registry.cpp. Nothing else changes.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "devbridge/backend.hpp"

namespace devbridge {

struct BackendAvailability {
  std::string name;       // "fake", "host", "cuda", ...
  bool built = false;     // compiled into this build
  bool available = false; // can run on this machine now
  std::string reason;     // why not, when it cannot ("CUDA: no driver (libcuda.so.1 not found)")
  std::string remedy;     // what to install or set so that it can ("install the NVIDIA driver ..."); empty when it runs
};

std::vector<BackendAvailability> list_backends();

// One line a user can act on: "available", or "unavailable: <reason>; to use
// it: <remedy>" (also "not built: ..."). What `devbridge info` and Python's
// devbridge.info() print after the backend's name.
std::string describe_availability(const BackendAvailability& availability);

// "auto" picks the best available: cuda, then an OpenCL GPU or accelerator,
// then host (never fake). Unknown or unavailable names, and a device that is
// not there, throw Error(Unavailable) naming the reason; an option the
// backend does not take, Error(Unsupported) naming what it takes.
std::unique_ptr<Backend> make_backend(std::string_view name, const BackendOptions& options = {});

// Every device `name` can bind, each as describe() gives it once bound (its
// device_id is what the "device" option takes). Empty when the backend is
// unavailable here. "auto" lists the devices of the backend make_backend("auto")
// opens (none when none is available); an unknown name throws
// Error(Unavailable) naming the known ones.
std::vector<BackendInfo> list_devices(std::string_view name);

}  // namespace devbridge
