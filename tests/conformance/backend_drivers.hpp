// The backends the conformance suite runs against, one row each. Adding a
// backend to the suite is one row in kBackendDrivers (backend_drivers.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <span>
#include <string>
#include <string_view>

#include <gtest/gtest.h>

#include "devbridge/backend.hpp"
#include "devbridge/bridge.hpp"

namespace devbridge::conformance {

struct BackendDriver {
  std::string_view name;  // registry name; also the test-name suffix
  // Empty when the backend can run on this machine; otherwise why not. Tests
  // of an unavailable backend are skipped with that reason, never passed.
  std::function<std::string()> unavailable_reason;
  // A backend whose async copies complete on their own (the fake is switched
  // to auto-complete here, so every test can simply wait).
  std::function<std::unique_ptr<Backend>()> make;
  // Device allocations the backend itself still holds (not the bridge's
  // bookkeeping). Null when the backend cannot count them; tests then fall
  // back to the bridge's count and say so.
  std::function<std::uint64_t(const Backend&)> live_allocations;
  // Stops async copies from completing (true) and lets them go again (false),
  // so a test can observe the pending side of each rule deterministically.
  // Quiesce (restart, close) must still end held work. Null when the backend
  // cannot hold copies; tests that need it are skipped.
  std::function<void(Backend&, bool)> hold_copies;
  // Device addresses are host memory the test may read directly.
  bool host_addressable = false;
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
    bridge_ = std::make_unique<Bridge>(driver().make(),
                                       BridgeOptions{.generation = 1, .ring_bytes = ring_bytes,
                                                     .inflight_budget_bytes = inflight_budget});
    return *bridge_;
  }
  Bridge& bridge() { return *bridge_; }

  bool can_hold() const { return static_cast<bool>(driver().hold_copies); }
  void hold(bool on) {
    driver().hold_copies(bridge_->backend(), on);
    held_ = on;
  }

  // Device allocations the backend holds (its own count where it has one).
  std::uint64_t backend_live_allocations() {
    if (driver().live_allocations) return driver().live_allocations(bridge_->backend());
    return bridge_->stats().live_allocations;
  }

  std::unique_ptr<Bridge> bridge_;
  bool held_ = false;
};

inline void PrintTo(const BackendDriver& driver, std::ostream* out) { *out << driver.name; }

}  // namespace devbridge::conformance
