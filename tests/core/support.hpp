// Shared fixtures for the core suite: a Bridge over a FakeBackend the test
// keeps a pointer to, random data, and readable call sequences.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "forwarding_backend.hpp"
#include "devbridge/backends/fake.hpp"
#include "devbridge/bridge.hpp"

namespace devbridge::testing {

using fake::Call;
using fake::FakeBackend;
using fake::Failure;
using fake::RecordedCall;

inline std::vector<std::byte> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 1);
  std::vector<std::byte> out(n);
  std::size_t i = 0;
  while (i < n) {
    std::uint64_t word = rng();
    for (int b = 0; b < 8 && i < n; ++b, ++i) out[i] = static_cast<std::byte>(word >> (8 * b));
  }
  // Never all-zero, never constant: a byte check must be able to fail.
  if (n > 1 && out[0] == out[1]) out[1] = ~out[0];
  return out;
}

inline std::vector<std::byte> to_vector(std::span<const std::byte> bytes) {
  return {bytes.begin(), bytes.end()};
}

// Runs `fn`, expects devbridge::Error of `kind`; returns its message.
inline std::string expect_error(ErrorKind kind, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(kind_name(e.kind()), kind_name(kind)) << "message: " << e.what();
    return std::string(e.message());
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected devbridge::Error(" << kind_name(kind) << "), got std::exception: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected devbridge::Error(" << kind_name(kind) << "), nothing was thrown";
  return {};
}

#define EXPECT_DEVBRIDGE_ERROR(kind, stmt) ::devbridge::testing::expect_error((kind), [&] { stmt; })

inline std::vector<Call> call_kinds(const std::vector<RecordedCall>& calls) {
  std::vector<Call> out;
  for (const auto& c : calls) out.push_back(c.call);
  return out;
}

inline std::string describe_calls(const std::vector<RecordedCall>& calls) {
  std::string out;
  for (const auto& c : calls) {
    out += std::string(fake::call_name(c.call)) + "(bytes=" + std::to_string(c.bytes) +
           " align=" + std::to_string(c.alignment) + " host_off=" + std::to_string(c.host_offset) +
           " dev_off=" + std::to_string(c.device_offset) + (c.mode == CopyMode::Sync ? " sync" : " async") +
           " event=" + std::to_string(c.event.generation) + "/" + std::to_string(c.event.id) + ")\n";
  }
  return out;
}

// Asserts the exact kinds, in order, of the calls the fake recorded.
#define EXPECT_CALLS(fake_ptr, ...)                                                        \
  do {                                                                                     \
    const auto recorded_calls_ = (fake_ptr)->calls();                                      \
    EXPECT_EQ(::devbridge::testing::call_kinds(recorded_calls_), (std::vector<::devbridge::fake::Call>{__VA_ARGS__})) \
        << ::devbridge::testing::describe_calls(recorded_calls_);                          \
  } while (0)

inline ObjectSpec bytes_spec(std::uint64_t max_extent = 1 << 20, std::uint64_t alignment = 64) {
  return ObjectSpec{max_extent, alignment, DType::UInt8, ShapeKind::Vector};
}

inline ObjectSpec float_spec(std::uint64_t max_extent = 1 << 20, std::uint64_t alignment = 64) {
  return ObjectSpec{max_extent, alignment, DType::Float32, ShapeKind::Tensor};
}

// A Bridge over a FakeBackend, with the fake's construction calls (the ring's
// allocate_host) already cleared.
class BridgeTest : public ::testing::Test {
 public:
  static constexpr std::uint64_t kRingBytes = 64 * 1024;

  static BridgeOptions default_options() {
    BridgeOptions options;
    options.generation = 1;
    options.ring_bytes = kRingBytes;
    return options;
  }

 protected:

  void SetUp() override { rebuild(default_options()); }

  void rebuild(BridgeOptions options, std::uint64_t device_memory = 1ull << 30) {
    bridge.reset();
    auto backend = std::make_unique<FakeBackend>(device_memory);
    fake = backend.get();
    bridge = std::make_unique<Bridge>(std::move(backend), options);
    fake->clear_calls();
  }

  // A reserved host range filled with random bytes; returns the bytes too.
  HostRange filled_range(std::uint64_t len, std::uint64_t seed, std::vector<std::byte>* data = nullptr) {
    HostRange range = bridge->reserve(len);
    auto bytes = random_bytes(len, seed);
    std::memcpy(bridge->host_bytes(range).data(), bytes.data(), len);
    if (data != nullptr) *data = std::move(bytes);
    return range;
  }

  std::vector<std::byte> host_contents(HostRange range) { return to_vector(bridge->host_bytes(range)); }

  // The backend address of an allocation, read through a view.
  std::uint64_t address_of(DeviceHandle handle) {
    ViewLease lease = bridge->view(handle, ViewSpec{bridge->spec(handle).dtype.value_or(DType::UInt8), {1}, std::nullopt, 0});
    return lease->data;
  }

  // The device bytes [offset, offset + len) of a live allocation, read directly
  // (the fake's device memory is host memory).
  std::vector<std::byte> device_contents(DeviceHandle handle, std::uint64_t offset, std::uint64_t len) {
    const auto* base = reinterpret_cast<const std::byte*>(address_of(handle));
    return {base + offset, base + offset + len};
  }

  // Completes the event in the fake and lets the bridge apply it.
  void complete(CopyEvent event, bool ok = true) {
    ASSERT_TRUE(fake->complete(event, ok));
    bridge->poll();
  }

  FakeBackend* fake = nullptr;
  std::unique_ptr<Bridge> bridge;
};

}  // namespace devbridge::testing
