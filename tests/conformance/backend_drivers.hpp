// The backends the conformance suite runs against, one row each. Adding a
// backend to the suite is one row in kBackendDrivers (backend_drivers.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <span>
#include <string>
#include <string_view>

#include <gtest/gtest.h>

#include "devbridge/backend.hpp"
#include "devbridge/bridge.hpp"

namespace devbridge::conformance {

// A queue of the test's own playing a consumer's (the stream a DLPack
// consumer or a tinygrad tensor computes on). While blocked, nothing
// enqueued on it after block() runs, so a fence recorded on it stays pending
// until unblock().
class TestConsumerQueue {
 public:
  virtual ~TestConsumerQueue() = default;
  // What ConsumerQueue and QueueRef::consumer take (a CUstream, a cl_command_queue).
  virtual std::uintptr_t handle() const = 0;
  virtual void block() = 0;
  virtual void unblock() = 0;
};

// One per backend with consumer queues, each in its own file
// (consumer_queue_<backend>.cpp), so the rows below name no vendor type.
std::unique_ptr<TestConsumerQueue> make_fake_consumer_queue(Backend& backend);
#ifdef DEVBRIDGE_HAS_CUDA
std::unique_ptr<TestConsumerQueue> make_cuda_consumer_queue(Backend& backend);
#endif
#ifdef DEVBRIDGE_HAS_OPENCL
std::unique_ptr<TestConsumerQueue> make_opencl_consumer_queue(Backend& backend);
#endif

struct BackendDriver {
  std::string_view name;  // registry name; also the test-name suffix
  // Empty when the backend can run on this machine; otherwise why not. Tests
  // of an unavailable backend are skipped with that reason, never passed.
  std::function<std::string()> unavailable_reason;
  // A backend whose async copies complete on their own (the fake is switched
  // to auto-complete here, so every test can simply wait).
  // What the suite counts and holds comes from the backend's test controls
  // (Backend::test_controls): live_allocations, the backend's own count of
  // device allocations (without controls, tests fall back to the bridge's
  // count), and hold_copies (without it, tests that need it are skipped).
  std::function<std::unique_ptr<Backend>()> make;
  // Device addresses are host memory the test may read directly.
  bool host_addressable = false;
  // A blockable queue standing in for a consumer's; null when the backend's
  // consumers have no queues (host: a CPU consumer is done when it returns).
  std::function<std::unique_ptr<TestConsumerQueue>(Backend&)> consumer_queue;
};

std::span<const BackendDriver> backend_drivers();

// The fixture every suite run against the drivers derives from: skips an
// unavailable backend with its reason, makes the bridge, and lets held
// copies go after a failed assertion (the bridge's close would end them, but
// the fake would stay out of auto-complete).
class DriverTest : public ::testing::TestWithParam<BackendDriver> {
 protected:
  void SetUp() override {
    if (driver().unavailable_reason) {
      if (const auto why = driver().unavailable_reason(); !why.empty())
        GTEST_SKIP() << "backend " << driver().name << " is unavailable here: " << why;
    }
  }
  void TearDown() override {
    if (bridge_ && held_) hold(false);
  }

  const BackendDriver& driver() const { return GetParam(); }

  Bridge& make_bridge(std::uint64_t ring_bytes, std::uint64_t inflight_budget = 0) {
    return make_bridge(BridgeOptions{.generation = 1, .ring_bytes = ring_bytes, .inflight_budget_bytes = inflight_budget});
  }
  Bridge& make_bridge(const BridgeOptions& options) {
    bridge_ = std::make_unique<Bridge>(driver().make(), options);
    return *bridge_;
  }
  Bridge& bridge() { return *bridge_; }

  // Whether the backend can hold copies: its controls say, asked once per
  // backend (a test asks before it makes its bridge).
  bool can_hold() const {
    static std::map<std::string_view, bool> known;
    static std::mutex mutex;
    std::lock_guard lock(mutex);
    auto [it, fresh] = known.try_emplace(driver().name, false);
    if (fresh) {
      auto backend = driver().make();
      const TestControls* controls = backend->test_controls();
      it->second = controls != nullptr && controls->can_hold_copies();
    }
    return it->second;
  }
  // Stops async copies from completing (true) and lets them go again
  // (false); quiesce (restart, close) must still end held work.
  void hold(bool on) {
    bridge_->backend().test_controls()->hold_copies(on);
    held_ = on;
  }

  // Device allocations the backend holds for the bridge's allocations (its
  // own count where it has one), not counting segments the bridge's caching
  // pool keeps wholly free for reuse (on by default for CUDA and OpenCL).
  std::uint64_t backend_live_allocations() {
    if (const TestControls* controls = bridge_->backend().test_controls())
      return controls->live_allocations() - bridge_->memory_stats().free_segments;
    return bridge_->stats().live_allocations;
  }

  std::unique_ptr<Bridge> bridge_;
  bool held_ = false;
};

inline void PrintTo(const BackendDriver& driver, std::ostream* out) { *out << driver.name; }

}  // namespace devbridge::conformance
