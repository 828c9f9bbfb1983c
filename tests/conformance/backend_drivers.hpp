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

#include "devbridge/backend.hpp"

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

inline void PrintTo(const BackendDriver& driver, std::ostream* out) { *out << driver.name; }

}  // namespace devbridge::conformance
