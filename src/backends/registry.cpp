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

BackendAvailability always_available(std::string_view name) { return {std::string(name), true, true, {}, {}}; }

// A vendor backend's probe as a row; its reason is prefixed with the vendor.
template <typename Probe>
[[maybe_unused]] BackendAvailability probed(std::string_view name, std::string_view vendor, const Probe& probe) {
  if (probe.available) return {std::string(name), true, true, {}, {}};
  return {std::string(name), true, false, fmt::format("{}: {}", vendor, probe.reason), probe.remedy};
}

// A backend this build was configured without: nothing on the machine can
// change that, only a rebuild (neither needs a vendor SDK at build time).
[[maybe_unused]] BackendAvailability not_built(std::string_view name, std::string_view option) {
  return {std::string(name), false, false, fmt::format("this build was configured with -D{}=OFF", option),
          fmt::format("rebuild with -D{}=ON (the default; no SDK or driver is needed to build it)", option)};
}
std::vector<std::string> one_device() { return {"0"}; }

const std::vector<Entry>& entries() {
  // Ordered by preference for "auto": the first available entry it may
  // choose wins (see chosen_by_auto).
  static const std::vector<Entry> table = {
#ifdef DEVBRIDGE_HAS_CUDA
      {"cuda",
       [] {
         const auto probe = cuda::probe();
         return probed("cuda", "CUDA", probe);
       },
       [](const BackendOptions& options) { return cuda::make_cuda_backend(options); }, cuda::device_ids},
#endif
#ifdef DEVBRIDGE_HAS_OPENCL
      {"opencl",
       [] {
         const auto probe = opencl::probe();
         return probed("opencl", "OpenCL", probe);
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
  out.push_back(not_built("cuda", "DEVBRIDGE_WITH_CUDA"));
#endif
#ifndef DEVBRIDGE_HAS_OPENCL
  out.push_back(not_built("opencl", "DEVBRIDGE_WITH_OPENCL"));
#endif
  return out;
}

std::string describe_availability(const BackendAvailability& availability) {
  if (availability.available) return "available";
  std::string line = availability.built ? "unavailable" : "not built";
  if (!availability.reason.empty()) line += ": " + availability.reason;
  if (!availability.remedy.empty()) line += "; to use it: " + availability.remedy;
  return line;
}

namespace {
[[noreturn]] void fail_unknown_backend(std::string_view name) {
  std::string known;
  for (const auto& entry : entries()) known += fmt::format("{}{}", known.empty() ? "" : ", ", entry.name);
  throw Error(ErrorKind::Unavailable, fmt::format("unknown backend '{}' (this build has: {}, auto)", name, known));
}
}  // namespace

std::unique_ptr<Backend> make_backend(std::string_view name, const BackendOptions& options) {
  const bool pick_best = name == "auto";
  std::string reasons;
  for (const auto& entry : entries()) {
    if (pick_best ? !entry.chosen_by_auto() : entry.name != name) continue;
    const auto availability = entry.probe();
    if (availability.available) return entry.make(options);
    // The probe judges the default device (for OpenCL, the one
    // $DEVBRIDGE_OPENCL_DEVICE picks); a device named explicitly is the
    // backend's to open or refuse, as its own options rule.
    if (!pick_best && availability.built && options.contains("device")) return entry.make(options);
    if (!pick_best) throw Error(ErrorKind::Unavailable, fmt::format("backend {} is unavailable: {}", name, availability.reason));
    reasons += availability.reason + "; ";
  }
  if (pick_best) throw Error(ErrorKind::Unavailable, fmt::format("no backend is available: {}", reasons));
  fail_unknown_backend(name);
}

std::vector<BackendInfo> list_devices(std::string_view name) {
  const bool pick_best = name == "auto";
  for (const auto& entry : entries()) {
    if (pick_best ? !entry.chosen_by_auto() : entry.name != name) continue;
    std::vector<BackendInfo> devices;
    if (!entry.probe().available) {
      if (pick_best) continue;  // "auto" lists the devices of the backend make_backend("auto") opens
      return devices;
    }
    for (const auto& id : entry.device_ids()) devices.push_back(entry.make({{"device", id}})->describe());
    return devices;
  }
  if (pick_best) return {};
  fail_unknown_backend(name);
}

}  // namespace devbridge
