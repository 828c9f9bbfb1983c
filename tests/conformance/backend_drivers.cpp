#include "backend_drivers.hpp"

#include "devbridge/backends/fake.hpp"
#include "devbridge/backends/host.hpp"
#ifdef DEVBRIDGE_HAS_CUDA
#include "devbridge/backends/cuda.hpp"
#endif
#ifdef DEVBRIDGE_HAS_OPENCL
#include "devbridge/backends/opencl.hpp"
#endif

namespace devbridge::conformance {

namespace {

std::string always_available() { return {}; }

// The fake completes nothing unless told; the suite runs it in auto-complete
// mode (an async copy completes at submit, bytes moved), which is how an
// infinitely fast device behaves. Holding (its TestControls::hold_copies)
// switches auto-complete off, so copies stay pending until released, oldest
// first.
std::unique_ptr<Backend> make_auto_completing_fake() {
  auto fake = std::make_unique<fake::FakeBackend>();
  fake->set_auto_complete(true);
  return fake;
}

#ifdef DEVBRIDGE_HAS_CUDA
std::string cuda_unavailable_reason() {
  const auto probe = cuda::probe();
  if (probe.available) return {};
  return probe.reason.empty() ? std::string("cuda probe says unavailable (no reason given)") : probe.reason;
}
#endif

#ifdef DEVBRIDGE_HAS_OPENCL
std::string opencl_unavailable_reason() {
  const auto probe = opencl::probe();
  return probe.available ? std::string() : probe.reason;
}
#endif

const BackendDriver kBackendDrivers[] = {
    // name    available?               factory                                     host memory  consumer queue
    {"fake", always_available, make_auto_completing_fake, true, make_fake_consumer_queue},
    {"host", always_available, [] { return host::make_host_backend(); }, true, nullptr},
#ifdef DEVBRIDGE_HAS_CUDA
    {"cuda", cuda_unavailable_reason, [] { return cuda::make_cuda_backend(); }, false, make_cuda_consumer_queue},
#endif
#ifdef DEVBRIDGE_HAS_OPENCL
    {"opencl", opencl_unavailable_reason, [] { return opencl::make_opencl_backend(); }, false,
     make_opencl_consumer_queue},
#endif
};

}  // namespace

std::span<const BackendDriver> backend_drivers() { return kBackendDrivers; }

}  // namespace devbridge::conformance
