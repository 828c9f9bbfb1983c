// The one table of backends this build knows. A new backend adds a row.
#include "devbridge/backends.hpp"

#include <functional>

#include <fmt/format.h>

#include "devbridge/backends/fake.hpp"
#include "devbridge/backends/host.hpp"
#ifdef DEVBRIDGE_HAS_CUDA
#include "devbridge/backends/cuda.hpp"
#endif

namespace devbridge {

namespace {

struct Entry {
  std::string_view name;
  std::function<BackendAvailability()> probe;
  std::function<std::unique_ptr<Backend>()> make;
};

BackendAvailability always_available(std::string_view name) { return {std::string(name), true, true, {}}; }

const std::vector<Entry>& entries() {
  // Ordered by preference for "auto": the first available wins, except fake,
  // which is for tests and never chosen automatically.
  static const std::vector<Entry> table = {
#ifdef DEVBRIDGE_HAS_CUDA
      {"cuda",
       [] {
         const auto probe = cuda::probe();
         return BackendAvailability{"cuda", true, probe.available, probe.available ? "" : "CUDA: " + probe.reason};
       },
       [] { return cuda::make_cuda_backend(); }},
#endif
      {"host", [] { return always_available("host"); }, [] { return host::make_host_backend(); }},
      {"fake", [] { return always_available("fake"); }, [] { return fake::make_fake_backend(); }},
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
  return out;
}

std::unique_ptr<Backend> make_backend(std::string_view name) {
  const bool pick_best = name == "auto";
  std::string reasons;
  for (const auto& entry : entries()) {
    if (pick_best ? entry.name == "fake" : entry.name != name) continue;
    const auto availability = entry.probe();
    if (availability.available) return entry.make();
    if (!pick_best) throw Error(ErrorKind::Unavailable, fmt::format("backend {} is unavailable: {}", name, availability.reason));
    reasons += availability.reason + "; ";
  }
  if (pick_best) throw Error(ErrorKind::Unavailable, fmt::format("no backend is available: {}", reasons));
  std::string known;
  for (const auto& entry : entries()) known += fmt::format("{}{}", known.empty() ? "" : ", ", entry.name);
  throw Error(ErrorKind::Unavailable, fmt::format("unknown backend '{}' (this build has: {}, auto)", name, known));
}

}  // namespace devbridge
