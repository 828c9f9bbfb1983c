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
// infinitely fast device behaves. Holding switches auto-complete off, so
// copies stay pending until released, oldest first.
std::unique_ptr<Backend> make_auto_completing_fake() {
  auto fake = std::make_unique<fake::FakeBackend>();
  fake->set_auto_complete(true);
  return fake;
}

fake::FakeBackend& as_fake(Backend& backend) { return dynamic_cast<fake::FakeBackend&>(backend); }

void hold_fake_copies(Backend& backend, bool hold) {
  auto& fake = as_fake(backend);
  fake.set_auto_complete(!hold);
  fake.hold_launches(hold);
  if (!hold) fake.complete_all();
}

// The seam's test-control capabilities, which every backend but the fake
// answers the same way.
std::uint64_t live_allocations_of(const Backend& backend) { return backend.live_allocations(); }
void hold_copies_of(Backend& backend, bool hold) { backend.hold_copies(hold); }

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
    // name    available?               factory                         live allocations        hold copies host memory
    // consumer queue
    {"fake", always_available, make_auto_completing_fake, live_allocations_of, hold_fake_copies, true,
     make_fake_consumer_queue},
    {"host", always_available, [] { return host::make_host_backend(); }, live_allocations_of, hold_copies_of, true,
     nullptr},
#ifdef DEVBRIDGE_HAS_CUDA
    {"cuda", cuda_unavailable_reason, [] { return cuda::make_cuda_backend(); }, live_allocations_of, hold_copies_of,
     false, make_cuda_consumer_queue},
#endif
#ifdef DEVBRIDGE_HAS_OPENCL
    {"opencl", opencl_unavailable_reason, [] { return opencl::make_opencl_backend(); }, live_allocations_of,
     hold_copies_of, false, make_opencl_consumer_queue},
#endif
};

}  // namespace

std::span<const BackendDriver> backend_drivers() { return kBackendDrivers; }

}  // namespace devbridge::conformance
