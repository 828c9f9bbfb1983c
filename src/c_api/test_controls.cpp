// The test-only C entry points: the few controls behind the backend seam
// (include/devbridge/test_controls.hpp) that C suites need to script faults
// and count leaks. Production code never calls them.
#include <string>

#include "boundary.hpp"
#include "devbridge/backends/fake.hpp"

using namespace devbridge;
using namespace devbridge::c_api;

namespace {

static_assert(fake::kCallCount == DEVBRIDGE_FAKE_CALL_UNREGISTER_HOST + 1, "every fake call has a constant");
static_assert(static_cast<int>(fake::Call::CopyHostToDevice) == DEVBRIDGE_FAKE_CALL_COPY_HOST_TO_DEVICE);
static_assert(static_cast<int>(fake::Call::ValidateView) == DEVBRIDGE_FAKE_CALL_VALIDATE_VIEW);
static_assert(static_cast<int>(fake::Failure::CopyFailedAtCompletion) == DEVBRIDGE_FAKE_FAIL_COPY_AT_COMPLETION);
static_assert(static_cast<int>(fake::Failure::Fatal) == DEVBRIDGE_FAKE_FAIL_FATAL);

TestControls& controls_of(devbridge_bridge* bridge) {
  auto& backend = bridge_of(bridge).backend();
  auto* controls = backend.test_controls();
  if (controls == nullptr)
    throw Error(ErrorKind::Unsupported, "backend " + backend.describe().name + " has no test controls");
  return *controls;
}

fake::FakeBackend& fake_of(devbridge_bridge* bridge) {
  auto* fake = controls_of(bridge).fake();
  if (fake == nullptr) throw Error(ErrorKind::Unsupported, "this control is the fake backend's; open backend \"fake\"");
  return *fake;
}

}  // namespace

extern "C" {

devbridge_status devbridge_fake_inject(devbridge_bridge* bridge, devbridge_fake_call call,
                                       devbridge_fake_failure failure, int32_t nth) {
  return guarded([&] {
    auto& fake = fake_of(bridge);
    if (call < 0 || call > DEVBRIDGE_FAKE_CALL_UNREGISTER_HOST)
      invalid_argument("call is " + std::to_string(call) + ", not a DEVBRIDGE_FAKE_CALL_ constant");
    if (failure < 0 || failure > DEVBRIDGE_FAKE_FAIL_FATAL)
      invalid_argument("failure is " + std::to_string(failure) + ", not a DEVBRIDGE_FAKE_FAIL_ constant");
    fake.inject(static_cast<fake::Call>(call), static_cast<fake::Failure>(failure), nth);
  });
}

devbridge_status devbridge_fake_set_auto_complete(devbridge_bridge* bridge, int32_t on) {
  return guarded([&] { fake_of(bridge).set_auto_complete(on != 0); });
}

devbridge_status devbridge_fake_complete_all(devbridge_bridge* bridge, int32_t ok, uint64_t* out_completed) {
  return guarded([&] {
    const auto completed = fake_of(bridge).complete_all(ok != 0);
    if (out_completed != nullptr) *out_completed = completed;
  });
}

devbridge_status devbridge_test_live_allocations(devbridge_bridge* bridge, uint64_t* out_count) {
  return guarded([&] {
    auto& out = required(out_count, "out_count");
    out = controls_of(bridge).live_allocations();
  });
}

devbridge_status devbridge_test_hold_copies(devbridge_bridge* bridge, int32_t hold) {
  return guarded([&] { controls_of(bridge).hold_copies(hold != 0); });
}

}  // extern "C"
