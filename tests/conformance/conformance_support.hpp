// What every conformance suite shares: seeded random data, byte checks with
// poison around each range, error-kind checks, and the BackendConformance
// fixture (a bridge over the driver's backend, with helpers that write and
// read device bytes through the ring).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backend_drivers.hpp"
#include "devbridge/bridge.hpp"

namespace devbridge::conformance {

inline constexpr std::byte kDevicePoison{0xA5};
inline constexpr std::byte kHostPoison{0x5A};
inline constexpr std::uint64_t kGuard = 64;  // poisoned bytes either side of a copy's host range

using Bytes = std::vector<std::byte>;

// ---- data ----------------------------------------------------------------

class Random {
 public:
  explicit Random(std::uint64_t seed) : engine_(seed) {}

  void fill(std::span<std::byte> out) {
    std::size_t i = 0;
    for (; i + 8 <= out.size(); i += 8) {
      const std::uint64_t word = engine_();
      std::memcpy(out.data() + i, &word, 8);
    }
    if (i < out.size()) {
      const std::uint64_t word = engine_();
      std::memcpy(out.data() + i, &word, out.size() - i);
    }
    // A byte check must be able to fail: never a constant block.
    if (out.size() > 1 && out[0] == out[1]) out[1] = ~out[0];
  }
  Bytes bytes(std::size_t n) {
    Bytes out(n);
    fill(out);
    return out;
  }
  // Random bytes that differ from `avoid` everywhere, for ranges whose
  // neighbours are checked against that poison.
  Bytes bytes_not(std::size_t n, std::byte avoid) {
    Bytes out = bytes(n);
    for (auto& b : out)
      if (b == avoid) b = ~avoid;
    return out;
  }
  std::uint64_t below(std::uint64_t n) { return std::uniform_int_distribution<std::uint64_t>(0, n - 1)(engine_); }
  bool coin() { return below(2) == 1; }
  std::mt19937_64& engine() { return engine_; }

 private:
  std::mt19937_64 engine_;
};

inline std::uint64_t seed_for_current_test() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::hash<std::string>{}(std::string(info->test_suite_name()) + "." + info->name());
}

inline ::testing::AssertionResult bytes_equal(std::span<const std::byte> actual, std::span<const std::byte> expected,
                                       std::string_view what) {
  if (actual.size() != expected.size())
    return ::testing::AssertionFailure() << what << ": " << actual.size() << " bytes, expected " << expected.size();
  if (std::memcmp(actual.data(), expected.data(), actual.size()) == 0) return ::testing::AssertionSuccess();
  const auto [a, e] = std::mismatch(actual.begin(), actual.end(), expected.begin());
  std::size_t differing = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) differing += actual[i] != expected[i];
  return ::testing::AssertionFailure() << what << ": first difference at byte " << (a - actual.begin()) << " (got 0x"
                                       << std::hex << static_cast<int>(*a) << ", expected 0x" << static_cast<int>(*e)
                                       << std::dec << "), " << differing << " of " << actual.size()
                                       << " bytes differ";
}

inline ::testing::AssertionResult all_bytes_are(std::span<const std::byte> actual, std::byte value, std::string_view what) {
  return bytes_equal(actual, Bytes(actual.size(), value), what);
}

inline std::span<const std::byte> slice(std::span<const std::byte> bytes, std::uint64_t offset, std::uint64_t len) {
  return bytes.subspan(offset, len);
}

// Runs `statement`, expects devbridge::Error of `kind`.
inline ::testing::AssertionResult throws_kind(ErrorKind kind, const std::function<void()>& statement) {
  try {
    statement();
  } catch (const Error& e) {
    if (e.kind() == kind) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "expected " << kind_name(kind) << ", got " << e.what();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "expected " << kind_name(kind) << ", got std::exception " << e.what();
  }
  return ::testing::AssertionFailure() << "expected " << kind_name(kind) << ", nothing was thrown";
}
#define EXPECT_KIND(kind, statement) EXPECT_TRUE(throws_kind((kind), [&] { statement; }))

// A contiguous view of `shape` at byte offset 0.
inline ViewSpec view_spec(DType dtype, Dims shape) { return ViewSpec{dtype, shape, std::nullopt, 0}; }

inline ObjectSpec bytes_spec(std::uint64_t max_extent, std::uint64_t alignment = 64) {
  return ObjectSpec{max_extent, alignment, DType::UInt8, ShapeKind::Vector};
}

// ---- the fixture ---------------------------------------------------------

class BackendConformance : public DriverTest {
 protected:
  Bridge& make_bridge(std::uint64_t ring_bytes = 8ull << 20, std::uint64_t inflight_budget = 0) {
    return DriverTest::make_bridge(ring_bytes, inflight_budget);
  }

  // A reservation of `len` bytes filled with `data` (or poison).
  HostRange reserve_with(std::span<const std::byte> data) {
    const auto range = bridge().reserve(data.size());
    auto bytes = bridge().host_bytes(range);
    std::memcpy(bytes.data(), data.data(), data.size());
    return range;
  }
  HostRange reserve_poisoned(std::uint64_t len, std::byte poison = kHostPoison) {
    return reserve_with(Bytes(len, poison));
  }

  void write_device(DeviceHandle handle, std::uint64_t offset, std::span<const std::byte> data,
                    CopyMode mode = CopyMode::Sync) {
    const auto range = reserve_with(data);
    const auto event = bridge().host_to_device(range, DeviceRange{handle, offset, data.size()}, mode);
    if (mode == CopyMode::Async) {
      ASSERT_EQ(bridge().wait(event).state, CopyState::Completed);
    }
    bridge().release_host(range);
  }

  // The device bytes [offset, offset + len), read back through a sync copy
  // into the middle of a poisoned reservation whose guards must survive.
  Bytes read_device(DeviceHandle handle, std::uint64_t offset, std::uint64_t len) {
    const auto range = reserve_poisoned(len + 2 * kGuard);
    bridge().device_to_host(DeviceRange{handle, offset, len}, HostRange{range.offset + kGuard, len}, CopyMode::Sync);
    const auto host = bridge().host_bytes(range);
    EXPECT_TRUE(all_bytes_are(host.first(kGuard), kHostPoison, "guard before the download"));
    EXPECT_TRUE(all_bytes_are(host.last(kGuard), kHostPoison, "guard after the download"));
    Bytes out(host.begin() + kGuard, host.begin() + kGuard + len);
    bridge().release_host(range);
    return out;
  }

  Random random_{seed_for_current_test()};
};

}  // namespace devbridge::conformance
