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
  b.copy(HostCopy{CopyDirection::HostToDevice, RegionRange{region, 0, kBytes}, DeviceRange{h, 0, 3000}, layout, CopyMode::Sync});
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
  EXPECT_KIND(ErrorKind::InvalidRange, b.copy(HostCopy{CopyDirection::DeviceToHost, RegionRange{region, 0, 64},
                                                       DeviceRange{h, 0, 64}, CopyLayout{1, 64, 64, 64}, CopyMode::Async}));
  EXPECT_TRUE(bytes_equal(memory, data, "the read-only region after refused downloads"));
  b.unregister_host(region);
  b.free_device(h);
}

// ---- host memory adopted in place (Bridge::adopt_host) ----
// Where the device addresses host memory (host, fake) a read-only region
// becomes an allocation with no copy; elsewhere adopt_host is Unsupported
// and the rows below skip.

// Where a view's address is a host address the CPU reads (host memory, and
// the fake's records over it), not an OpenCL buffer's handle.
bool views_are_host_addresses(Bridge& b) {
  const auto info = b.backend_info();
  return info.host_addressable || info.name == "fake";
}

// The region's bytes as a read-only allocation, or a skip; either way as
// the backend's capabilities say (BackendCapabilities::adopt).
#define ADOPT_OR_SKIP(handle, b, range, spec)                                                        \
  DeviceHandle handle;                                                                              \
  try {                                                                                             \
    handle = (b).adopt_host((range), (spec));                                                       \
  } catch (const Error& e) {                                                                        \
    if (e.kind() != ErrorKind::Unsupported) throw;                                                  \
    EXPECT_FALSE((b).backend_info().adopt) << "describe() says it adopts; adopt_host: " << e.what(); \
    GTEST_SKIP() << driver().name << " cannot use host memory in place: " << e.what();              \
  }                                                                                                 \
  EXPECT_TRUE((b).backend_info().adopt) << "adopt_host works, but describe() does not say so"

TEST_P(RegisteredHostConformance, AnAdoptedRegionIsTheAllocationWithNoCopyAndRefusesEveryWrite) {
  auto& b = make_bridge(1 << 20);
  constexpr std::uint64_t kBytes = 4 * 4096;
  auto memory = buffer(kBytes);
  Bytes data(kBytes);  // finite floats: axpy(1, 0) gives them back bit for bit (a NaN's payload might not be)
  for (std::uint64_t i = 0; i < kBytes / 4; ++i) {
    const float value = static_cast<float>(random_.below(1 << 20)) - 524288.0f;
    std::memcpy(data.data() + 4 * i, &value, 4);
  }
  std::memcpy(memory.data(), data.data(), kBytes);
  const auto baseline = backend_live_allocations();
  const auto region = b.register_host_read_only(std::span<const std::byte>(memory));
  const ObjectSpec spec{kBytes, 256, DType::Float32, ShapeKind::Vector};
  const auto submitted = b.stats().copies_submitted;
  ADOPT_OR_SKIP(h, b, (RegionRange{region, 4096, 2 * 4096}), spec);
  EXPECT_EQ(b.stats().copies_submitted, submitted) << "adopting copies nothing";
  EXPECT_EQ(b.extent(h), 2u * 4096);
  EXPECT_EQ(b.stats().adopted_allocations, 1u);
  EXPECT_EQ(b.stats().adopted_bytes, 2u * 4096);
  EXPECT_EQ(b.memory_stats().allocated_bytes, 0u) << "adopted bytes are not the device's";
  {
    const auto lease = b.view(h, view_spec(DType::Float32, {2048}));
    EXPECT_TRUE(lease->read_only);
    if (views_are_host_addresses(b))
      EXPECT_EQ(lease->data, reinterpret_cast<std::uintptr_t>(memory.data() + 4096)) << "the view is the region itself";
  }
  EXPECT_TRUE(bytes_equal(read_device(h, 0, 2 * 4096), slice(data, 4096, 2 * 4096), "adopted bytes read back"));
  // Every way of writing into it is refused, and changes nothing.
  const auto other = b.alloc_device(spec, 2 * 4096);
  write_device(other, 0, slice(data, 0, 2 * 4096));
  EXPECT_KIND(ErrorKind::InvalidRange, write_device(h, 0, Bytes(64, std::byte{1})));
  EXPECT_KIND(ErrorKind::InvalidRange, write_device(h, 0, Bytes(64, std::byte{1}), CopyMode::Async));
  EXPECT_KIND(ErrorKind::InvalidRange, b.copy(HostCopy{CopyDirection::HostToDevice, RegionRange{region, 0, 128},
                                                       DeviceRange{h, 0, 128}, CopyLayout{2, 64, 64, 64}, CopyMode::Sync}));
  EXPECT_KIND(ErrorKind::InvalidRange, b.launch_axpy(DeviceRange{other, 0, 256}, DeviceRange{h, 0, 256}, 2.0f, 1.0f));
  EXPECT_TRUE(bytes_equal(memory, data, "the region after refused writes"));
  // It reads like any allocation: a launch's input, a download's source.
  b.launch_axpy(DeviceRange{h, 0, 2 * 4096}, DeviceRange{other, 0, 2 * 4096}, 1.0f, 0.0f);
  EXPECT_TRUE(bytes_equal(read_device(other, 0, 2 * 4096), slice(data, 4096, 2 * 4096), "axpy(1, 0) of adopted x"));
  EXPECT_KIND(ErrorKind::AllocationStillInUse, b.unregister_host(region));
  b.free_device(h);
  EXPECT_EQ(b.stats().adopted_allocations, 0u);
  b.unregister_host(region);
  b.free_device(other);
  EXPECT_EQ(backend_live_allocations(), baseline);
  EXPECT_EQ(b.memory_stats().cached_bytes + b.memory_stats().allocated_bytes,
            b.memory_stats().pool_enabled ? b.memory_stats().cached_bytes : 0u)
      << "adopted memory never enters the pool";
}

TEST_P(RegisteredHostConformance, AdoptionIsValidated) {
  auto& b = make_bridge(1 << 20);
  auto memory = buffer(8192);
  const auto region = b.register_host_read_only(std::span<const std::byte>(memory));
  const ObjectSpec spec{8192, 256, DType::Float32, ShapeKind::Vector};
  ADOPT_OR_SKIP(whole, b, (RegionRange{region, 0, 8192}), spec);
  b.free_device(whole);
  EXPECT_KIND(ErrorKind::InvalidAlignment, b.adopt_host(RegionRange{region, 64, 4096}, spec));
  EXPECT_KIND(ErrorKind::InvalidRange, b.adopt_host(RegionRange{region, 4096, 8192}, spec));
  EXPECT_KIND(ErrorKind::InvalidExtent, b.adopt_host(RegionRange{region, 0, 6}, ObjectSpec{8192, 2, DType::Float32,
                                                                                            ShapeKind::Vector}));
  EXPECT_KIND(ErrorKind::InvalidExtent, b.adopt_host(RegionRange{region, 0, 8192}, ObjectSpec{4096, 256, DType::Float32,
                                                                                               ShapeKind::Vector}));
  auto writable_memory = buffer(4096);
  const auto writable = b.register_host(writable_memory);
  EXPECT_KIND(ErrorKind::InvalidRange, b.adopt_host(RegionRange{writable, 0, 4096}, spec));
  EXPECT_EQ(b.stats().live_allocations, 0u) << "a refused adoption leaves nothing";
  b.restart(2);
  EXPECT_KIND(ErrorKind::OldGenerationHandle, b.adopt_host(RegionRange{region, 0, 4096}, spec));
}

TEST_P(RegisteredHostConformance, AnAdoptionAViewOutlivesRestartKeepsItsRegionUntilTheViewEnds) {
  auto& b = make_bridge(1 << 20);
  auto memory = buffer(4096);
  const Bytes data = random_.bytes(4096);
  std::memcpy(memory.data(), data.data(), 4096);
  const auto region = b.register_host_read_only(std::span<const std::byte>(memory));
  ADOPT_OR_SKIP(h, b, (RegionRange{region, 0, 4096}), bytes_spec(4096));
  ADOPT_OR_SKIP(released, b, (RegionRange{region, 0, 4096}), bytes_spec(4096));
  auto lease = b.view(h, view_spec(DType::UInt8, {4096}));
  auto released_lease = b.view(released, view_spec(DType::UInt8, {4096}));
  b.release(released);  // deferred: the view reads it
  EXPECT_TRUE(b.region_retained(region));
  EXPECT_KIND(ErrorKind::AllocationStillInUse, b.unregister_host(region));
  released_lease.reset();
  b.restart(2);
  EXPECT_EQ(b.stats().orphaned_allocations, 1u);
  EXPECT_TRUE(b.region_retained(region)) << "the orphan a view reads keeps its region registered";
  EXPECT_EQ(b.stats().host_regions, 1u);
  EXPECT_KIND(ErrorKind::OldGenerationHandle, b.unregister_host(region));
  EXPECT_KIND(ErrorKind::InvalidRange, b.register_host(memory)) << "the retained region's memory is still taken";
  if (views_are_host_addresses(b))
    EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(lease->data), data.data(), 4096), 0);
  lease.reset();
  EXPECT_FALSE(b.region_retained(region));
  EXPECT_EQ(b.stats().host_regions, 0u);
  EXPECT_EQ(b.stats().host_region_bytes, 0u);
  EXPECT_EQ(b.stats().orphaned_allocations, 0u);
  const auto again = b.register_host(memory);  // free to register again
  b.unregister_host(again);
}

TEST_P(RegisteredHostConformance, CloseUnderAViewOfAnAdoptionKeepsTheRegionUntilTheViewEnds) {
  auto& b = make_bridge(1 << 20);
  auto memory = buffer(4096);
  const auto region = b.register_host_read_only(std::span<const std::byte>(memory));
  ADOPT_OR_SKIP(h, b, (RegionRange{region, 0, 4096}), bytes_spec(4096));
  auto lease = b.view(h, view_spec(DType::UInt8, {4096}));
  b.close();
  EXPECT_TRUE(b.region_retained(region));
  lease.reset();
  EXPECT_FALSE(b.region_retained(region));
  EXPECT_EQ(b.stats().host_regions, 0u);
}

INSTANTIATE_TEST_SUITE_P(Backends, RegisteredHostConformance, ::testing::ValuesIn(backend_drivers()),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace devbridge::conformance
