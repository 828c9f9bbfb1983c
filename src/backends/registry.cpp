// The one table of backends this build knows. A new backend adds a row.
#include "devbridge/backends.hpp"

#include <functional>

#include <fmt/format.h>

#include "devbridge/backends/fake.hpp"
#include "devbridge/backends/host.hpp"
#ifdef DEVBRIDGE_HAS_CUDA
#include "devbridge/backends/cuda.hpp"
#endif
#ifdef DEVBRIDGE_HAS_OPENCL
#include "devbridge/backends/opencl.hpp"
#endif

namespace devbridge {

namespace {

struct Entry {
  std::string_view name;
  std::function<BackendAvailability()> probe;
  std::function<std::unique_ptr<Backend>(const BackendOptions&)> make;
  // The ids its "device" option takes, one per device (when available).
  std::function<std::vector<std::string>()> device_ids;
  // Whether "auto" may pick it when available (the fake never; OpenCL only
  // for a GPU or accelerator, since on a CPU the host backend does better).
  std::function<bool()> chosen_by_auto = [] { return true; };
};

BackendAvailability always_available(std::string_view name) { return {std::string(name), true, true, {}}; }
std::vector<std::string> one_device() { return {"0"}; }

const std::vector<Entry>& entries() {
  // Ordered by preference for "auto": the first available entry it may
  // choose wins (see chosen_by_auto).
  static const std::vector<Entry> table = {
#ifdef DEVBRIDGE_HAS_CUDA
      {"cuda",
       [] {
         const auto probe = cuda::probe();
         return BackendAvailability{"cuda", true, probe.available, probe.available ? "" : "CUDA: " + probe.reason};
       },
       [](const BackendOptions& options) { return cuda::make_cuda_backend(options); }, cuda::device_ids},
#endif
#ifdef DEVBRIDGE_HAS_OPENCL
      {"opencl",
       [] {
         const auto probe = opencl::probe();
         return BackendAvailability{"opencl", true, probe.available, probe.available ? "" : "OpenCL: " + probe.reason};
       },
       [](const BackendOptions& options) { return opencl::make_opencl_backend(options); }, opencl::device_ids,
       [] { return opencl::probe().has_gpu; }},
#endif
      {"host", [] { return always_available("host"); },
       [](const BackendOptions& options) { return host::make_host_backend(options); }, one_device},
      {"fake", [] { return always_available("fake"); }, fake::make_fake_backend, one_device, [] { return false; }},
  };
  return table;
}

}  // namespace

std::vector<BackendAvailability> list_backends() {
  std::vector<BackendAvailability> out;
  for (const auto& entry : entries()) out.push_back(entry.probe());
#ifndef DEVBRIDGE_HAS_CUDA
  out.push_back({"cuda", false, false, "CUDA: not built (no CUDA toolkit headers at configure time)"});
#endif
#ifndef DEVBRIDGE_HAS_OPENCL
  out.push_back({"opencl", false, false, "OpenCL: not built (no CL/cl.h at configure time)"});
#endif
  return out;
}

std::unique_ptr<Backend> make_backend(std::string_view name, const BackendOptions& options) {
  const bool pick_best = name == "auto";
  std::string reasons;
  for (const auto& entry : entries()) {
    if (pick_best ? !entry.chosen_by_auto() : entry.name != name) continue;
    const auto availability = entry.probe();
    if (availability.available) return entry.make(options);
    if (!pick_best) throw Error(ErrorKind::Unavailable, fmt::format("backend {} is unavailable: {}", name, availability.reason));
    reasons += availability.reason + "; ";
  }
  if (pick_best) throw Error(ErrorKind::Unavailable, fmt::format("no backend is available: {}", reasons));
  std::string known;
  for (const auto& entry : entries()) known += fmt::format("{}{}", known.empty() ? "" : ", ", entry.name);
  throw Error(ErrorKind::Unavailable, fmt::format("unknown backend '{}' (this build has: {}, auto)", name, known));
}

std::vector<BackendInfo> list_devices(std::string_view name) {
  for (const auto& entry : entries()) {
    if (entry.name != name) continue;
    std::vector<BackendInfo> devices;
    if (!entry.probe().available) return devices;
    for (const auto& id : entry.device_ids()) devices.push_back(entry.make({{"device", id}})->describe());
    return devices;
  }
  throw Error(ErrorKind::Unavailable, fmt::format("unknown backend '{}'", name));
}

}  // namespace devbridge
