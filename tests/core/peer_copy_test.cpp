// Bridge::copy_to_peer: device to device into another bridge's allocation
// where the backends have a direct path (two fakes here; CUDA in
// tests/cuda/cuda_peer_test.cpp), false and nothing changed where they have
// none, both ranges validated, both allocations held for the call.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "devbridge/backends.hpp"
#include "support.hpp"

namespace devbridge::testing {
namespace {

const ObjectSpec kBytes{1 << 20, 64, DType::UInt8, ShapeKind::Vector};

struct PeerCopyTest : ::testing::Test {
  std::shared_ptr<FakeBackend> fake_a = std::make_shared<FakeBackend>(), fake_b = std::make_shared<FakeBackend>();
  Bridge a{std::make_unique<ForwardingBackend>(fake_a), BridgeOptions{.ring_bytes = 1 << 16}};
  Bridge b{std::make_unique<ForwardingBackend>(fake_b), BridgeOptions{.ring_bytes = 1 << 16}};

  void write(Bridge& bridge, DeviceHandle h, std::uint64_t offset, const std::vector<std::byte>& data) {
    const auto r = bridge.reserve(data.size());
    std::memcpy(bridge.host_bytes(r).data(), data.data(), data.size());
    bridge.host_to_device(r, DeviceRange{h, offset, data.size()}, CopyMode::Sync);
    bridge.release_host(r);
  }
  std::vector<std::byte> read(Bridge& bridge, DeviceHandle h, std::uint64_t offset, std::uint64_t len) {
    const auto r = bridge.reserve(len);
    bridge.device_to_host(DeviceRange{h, offset, len}, r, CopyMode::Sync);
    std::vector<std::byte> out(bridge.host_bytes(r).begin(), bridge.host_bytes(r).end());
    bridge.release_host(r);
    return out;
  }
};

TEST_F(PeerCopyTest, BytesLandExactlyAndNothingAroundThemChanges) {
  const auto x = a.alloc_device(kBytes, 8192);
  const auto y = b.alloc_device(kBytes, 8192);
  std::vector<std::byte> data(3001), poison(8192, std::byte{0xA5});
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>(i * 7 + 1);
  write(a, x, 0, std::vector<std::byte>(8192, std::byte{0}));
  write(a, x, 11, data);
  write(b, y, 0, poison);
  EXPECT_TRUE(a.copy_to_peer(DeviceRange{x, 11, 3001}, b, DeviceRange{y, 1001, 3001}));
  const auto got = read(b, y, 0, 8192);
  EXPECT_TRUE(std::equal(got.begin(), got.begin() + 1001, poison.begin()));
  EXPECT_TRUE(std::equal(got.begin() + 1001, got.begin() + 4002, data.begin()));
  EXPECT_TRUE(std::equal(got.begin() + 4002, got.end(), poison.begin()));
  EXPECT_EQ(b.stats().copies_completed, 3u) << "the peer copy counts as the destination's copy";
  a.free_device(x);
  b.free_device(y);
  EXPECT_EQ(fake_a->live_allocations(), 0u);
  EXPECT_EQ(fake_b->live_allocations(), 0u);
}

TEST_F(PeerCopyTest, RangesAreValidatedInBothBridgesAndNothingIsHeldAfterARefusal) {
  const auto x = a.alloc_device(kBytes, 4096);
  const auto y = b.alloc_device(kBytes, 4096);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, a.copy_to_peer(DeviceRange{x, 4000, 200}, b, DeviceRange{y, 0, 200}));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, a.copy_to_peer(DeviceRange{x, 0, 200}, b, DeviceRange{y, ~0ull - 8, 200}));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, a.copy_to_peer(DeviceRange{x, 0, 200}, b, DeviceRange{y, 0, 100}));
  // A handle of the wrong bridge on either side is foreign there.
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::ForeignDomain, a.copy_to_peer(DeviceRange{y, 0, 8}, b, DeviceRange{y, 0, 8}));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::ForeignDomain, a.copy_to_peer(DeviceRange{x, 0, 8}, b, DeviceRange{x, 0, 8}));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Unsupported, a.copy_to_peer(DeviceRange{x, 0, 8}, a, DeviceRange{x, 8, 8}));
  a.free_device(x);  // nothing still holds either allocation
  b.free_device(y);
}

TEST_F(PeerCopyTest, ALiveViewOfTheDestinationRefusesTheWriteAsAnUploadWould) {
  const auto x = a.alloc_device(kBytes, 4096);
  const auto y = b.alloc_device(kBytes, 4096);
  auto view = b.view(y, ViewSpec{DType::UInt8, Dims{4096}, std::nullopt, 0});
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, a.copy_to_peer(DeviceRange{x, 0, 64}, b, DeviceRange{y, 0, 64}));
  view.reset();
  EXPECT_TRUE(a.copy_to_peer(DeviceRange{x, 0, 64}, b, DeviceRange{y, 0, 64}));
  a.free_device(x);
  b.free_device(y);
}

TEST_F(PeerCopyTest, BackendsWithoutADirectPathSayFalseAndChangeNothing) {
  Bridge host(make_backend("host"), BridgeOptions{.ring_bytes = 1 << 16});
  const auto x = a.alloc_device(kBytes, 4096);
  const auto h = host.alloc_device(kBytes, 4096);
  EXPECT_FALSE(a.copy_to_peer(DeviceRange{x, 0, 4096}, host, DeviceRange{h, 0, 4096}));
  EXPECT_FALSE(host.copy_to_peer(DeviceRange{h, 0, 4096}, a, DeviceRange{x, 0, 4096}));
  EXPECT_EQ(host.stats().copies_submitted, 0u);
  a.free_device(x);  // neither is held
  host.free_device(h);
}

}  // namespace
}  // namespace devbridge::testing
