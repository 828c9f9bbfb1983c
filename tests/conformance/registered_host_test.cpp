// Registered host memory (Bridge::register_host) on every backend: the
// caller's buffer is a staging source with the ring's rules — ranges
// validated, safe-release and valid-bytes points, unregister refused while a
// copy uses it — and a restart or close unregisters it, refusing the old
// handle.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "conformance_support.hpp"

namespace devbridge::conformance {
namespace {

class RegisteredHostConformance : public BackendConformance {
 protected:
  // Page-aligned like a numpy array of this size or an mmap (a driver pins
  // whole pages; the bridge must not care).
  std::span<std::byte> buffer(std::size_t bytes) {
    storage_.emplace_back(new (std::align_val_t{4096}) std::byte[bytes]);
    return {storage_.back().get(), bytes};
  }
  struct AlignedDelete {
    void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{4096}); }
  };
  std::vector<std::unique_ptr<std::byte[], AlignedDelete>> storage_;
};

TEST_P(RegisteredHostConformance, CopiesToAndFromRegisteredMemoryMoveExactlyTheirBytes) {
  auto& b = make_bridge(1 << 20);
  constexpr std::uint64_t kBytes = 3 * 4096 + 17;
  auto memory = buffer(kBytes);
  const Bytes data = random_.bytes_not(kBytes, kHostPoison);
  std::memcpy(memory.data(), data.data(), kBytes);
  const auto region = b.register_host(memory);
  EXPECT_EQ(b.region_bytes(region).data(), memory.data());
  EXPECT_EQ(b.stats().host_regions, 1u);
  const auto h = b.alloc_device(bytes_spec(kBytes, 1), kBytes);
  for (const CopyMode mode : {CopyMode::Sync, CopyMode::Async}) {
    SCOPED_TRACE(mode == CopyMode::Sync ? "sync" : "async");
    const auto up = b.host_to_device(RegionRange{region, 0, kBytes}, DeviceRange{h, 0, kBytes}, mode);
    if (mode == CopyMode::Async) {
        EXPECT_EQ(b.wait(up).state, CopyState::Completed);
      }
    EXPECT_TRUE(b.safe_to_release_host(up));
    EXPECT_TRUE(bytes_equal(read_device(h, 0, kBytes), data, "device after an upload from registered memory"));
    // Down into the middle, odd offset and length: the rest stays as it was.
    std::memset(memory.data(), static_cast<int>(kHostPoison), kBytes);
    const auto down = b.device_to_host(DeviceRange{h, 101, 5001}, RegionRange{region, 333, 5001}, mode);
    if (mode == CopyMode::Async) {
        EXPECT_EQ(b.wait(down).state, CopyState::Completed);
      }
    EXPECT_TRUE(b.host_bytes_valid(down));
    EXPECT_TRUE(all_bytes_are(memory.first(333), kHostPoison, "before the download"));
    EXPECT_TRUE(bytes_equal(memory.subspan(333, 5001), slice(data, 101, 5001), "downloaded bytes"));
    EXPECT_TRUE(all_bytes_are(memory.subspan(333 + 5001), kHostPoison, "after the download"));
    std::memcpy(memory.data(), data.data(), kBytes);
  }
  // A pitched copy from registered memory too.
  const CopyLayout layout{3, 1000, 4096, 1000};
  b.host_to_device(RegionRange{region, 0, kBytes}, DeviceRange{h, 0, 3000}, layout, CopyMode::Sync);
  const Bytes device = read_device(h, 0, 3000);
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(bytes_equal(slice(device, r * 1000, 1000), slice(data, r * 4096, 1000), "pitched row"));
  b.unregister_host(region);
  EXPECT_EQ(b.stats().host_regions, 0u);
  EXPECT_KIND(ErrorKind::UnknownDeviceHandle, b.host_to_device(RegionRange{region, 0, 8}, DeviceRange{h, 0, 8}, CopyMode::Sync));
  EXPECT_KIND(ErrorKind::UnknownDeviceHandle, b.unregister_host(region));
  b.free_device(h);
}

TEST_P(RegisteredHostConformance, RangesAndRegistrationsAreValidated) {
  auto& b = make_bridge(1 << 20);
  auto memory = buffer(8192);
  const auto region = b.register_host(memory);
  const auto h = b.alloc_device(bytes_spec(8192, 1), 8192);
  EXPECT_KIND(ErrorKind::InvalidRange, b.host_to_device(RegionRange{region, 8000, 193}, DeviceRange{h, 0, 193}, CopyMode::Sync));
  EXPECT_KIND(ErrorKind::InvalidRange, b.host_to_device(RegionRange{region, ~0ull - 4, 8}, DeviceRange{h, 0, 8}, CopyMode::Sync));
  EXPECT_KIND(ErrorKind::InvalidRange, b.host_to_device(RegionRange{region, 0, 0}, DeviceRange{h, 0, 8}, CopyMode::Sync));
  EXPECT_KIND(ErrorKind::InvalidRange, b.host_to_device(RegionRange{region, 0, 16}, DeviceRange{h, 0, 8}, CopyMode::Sync));
  // Overlapping memory, nothing, and the ring itself are refused.
  EXPECT_KIND(ErrorKind::InvalidRange, b.register_host(memory.subspan(4096, 100)));
  EXPECT_KIND(ErrorKind::InvalidExtent, b.register_host(memory.first(0)));
  EXPECT_KIND(ErrorKind::InvalidRange, b.register_host(b.host_bytes(b.reserve(64))));
  // Another bridge's region is foreign.
  Bridge other(driver().make(), BridgeOptions{.ring_bytes = 1 << 16});
  const auto foreign = other.register_host(buffer(4096));
  EXPECT_KIND(ErrorKind::ForeignDomain, b.host_to_device(RegionRange{foreign, 0, 8}, DeviceRange{h, 0, 8}, CopyMode::Sync));
  EXPECT_EQ(b.stats().copies_submitted, 0u);
  b.unregister_host(region);
  b.free_device(h);
}

TEST_P(RegisteredHostConformance, UnregisterIsRefusedWhileACopyUsesTheRegion) {
  if (!can_hold()) GTEST_SKIP() << driver().name << " cannot hold copies";
  auto& b = make_bridge(1 << 20);
  auto memory = buffer(4096);
  const auto region = b.register_host(memory);
  const auto h = b.alloc_device(bytes_spec(4096, 1), 4096);
  hold(true);
  const auto up = b.host_to_device(RegionRange{region, 0, 4096}, DeviceRange{h, 0, 4096}, CopyMode::Async);
  EXPECT_FALSE(b.safe_to_release_host(up));
  EXPECT_KIND(ErrorKind::AllocationStillInUse, b.unregister_host(region));
  hold(false);
  EXPECT_EQ(b.wait(up).state, CopyState::Completed);
  b.unregister_host(region);
  b.free_device(h);
}

TEST_P(RegisteredHostConformance, RestartAndCloseUnregisterEverythingAndRefuseOldHandles) {
  auto& b = make_bridge(1 << 20);
  const auto first_memory = buffer(4096);
  const auto first = b.register_host(first_memory);
  const auto second = b.register_host(buffer(8192));
  EXPECT_EQ(b.stats().host_region_bytes, 4096u + 8192u);
  if (can_hold()) {
    const auto h = b.alloc_device(bytes_spec(4096, 1), 4096);
    hold(true);
    b.device_to_host(DeviceRange{h, 0, 4096}, RegionRange{first, 0, 4096}, CopyMode::Async);
  }
  b.restart(2);
  held_ = false;
  EXPECT_EQ(b.stats().host_regions, 0u);
  EXPECT_KIND(ErrorKind::OldGenerationHandle, b.unregister_host(second));
  EXPECT_KIND(ErrorKind::OldGenerationHandle, b.region_bytes(first));
  // The same memory registers again in the new generation.
  b.register_host(first_memory);
  b.close();
  EXPECT_EQ(b.stats().host_regions, 0u);
}

TEST_P(RegisteredHostConformance, AReadOnlyRegionTakesUploadsAndRefusesDownloads) {
  auto& b = make_bridge(1 << 20);
  auto memory = buffer(8192);
  const Bytes data = random_.bytes(8192);
  std::memcpy(memory.data(), data.data(), data.size());
  const std::span<const std::byte> immutable = memory;
  const auto region = b.register_host_read_only(immutable);
  const auto h = b.alloc_device(bytes_spec(8192, 1), 8192);
  b.wait(b.host_to_device(RegionRange{region, 0, 8192}, DeviceRange{h, 0, 8192}, CopyMode::Async));
  EXPECT_TRUE(bytes_equal(read_device(h, 0, 8192), data, "device after an upload from a read-only region"));
  EXPECT_KIND(ErrorKind::InvalidRange,
              b.device_to_host(DeviceRange{h, 0, 64}, RegionRange{region, 0, 64}, CopyMode::Sync));
  EXPECT_KIND(ErrorKind::InvalidRange, b.device_to_host(DeviceRange{h, 0, 64}, RegionRange{region, 0, 64},
                                                        CopyLayout{1, 64, 64, 64}, CopyMode::Async));
  EXPECT_TRUE(bytes_equal(memory, data, "the read-only region after refused downloads"));
  b.unregister_host(region);
  b.free_device(h);
}

INSTANTIATE_TEST_SUITE_P(Backends, RegisteredHostConformance, ::testing::ValuesIn(backend_drivers()),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace devbridge::conformance
