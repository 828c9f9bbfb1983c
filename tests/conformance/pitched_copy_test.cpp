// Pitched 2-D copies (CopyLayout) on every backend: each row lands at its
// pitch on the other side, the bytes between rows are never touched on
// either side, and a layout that does not fit is refused before the backend
// sees it. Odd widths and pitches, so nothing may round to a word or a line.
// Bridge::copy, the one entry point pitched copies go through, is held to
// the everyday wrappers (host_to_device / device_to_host) for plain copies.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "conformance_support.hpp"

namespace devbridge::conformance {
namespace {

struct Shape {
  std::uint64_t rows, row_bytes, host_pitch, device_pitch;
};
// 3-byte rows, a 4095-byte row at an odd pitch, one row, and the pitch of a
// 4096-column matrix under a 4095-column window.
constexpr Shape kShapes[] = {{5, 3, 7, 11}, {3, 4095, 4099, 4097}, {1, 7, 7, 9}, {17, 4095 * 4, 4096 * 4, 4095 * 4}};

class PitchedCopyConformance : public BackendConformance {
 protected:
  static CopyLayout layout_of(const Shape& s) { return CopyLayout{s.rows, s.row_bytes, s.host_pitch, s.device_pitch}; }
  static HostCopy h2d(HostSide host, DeviceRange device, std::optional<CopyLayout> layout, CopyMode mode) {
    return HostCopy{CopyDirection::HostToDevice, host, device, layout, mode};
  }
  static HostCopy d2h(DeviceRange device, HostSide host, std::optional<CopyLayout> layout, CopyMode mode) {
    return HostCopy{CopyDirection::DeviceToHost, host, device, layout, mode};
  }
  static std::uint64_t span(std::uint64_t rows, std::uint64_t row_bytes, std::uint64_t pitch) {
    return (rows - 1) * pitch + row_bytes;
  }
  // What `rows` rows of `src` at `src_pitch` look like written over `dst`
  // (poison) at `dst_pitch`.
  static Bytes scatter(Bytes dst, std::span<const std::byte> src, const Shape& s, std::uint64_t src_pitch,
                       std::uint64_t dst_pitch, std::uint64_t dst_offset = 0) {
    for (std::uint64_t r = 0; r < s.rows; ++r)
      std::memcpy(dst.data() + dst_offset + r * dst_pitch, src.data() + r * src_pitch, s.row_bytes);
    return dst;
  }
};

TEST_P(PitchedCopyConformance, RowsLandAtTheirPitchAndThePaddingIsUntouched) {
  auto& b = make_bridge();
  for (const auto& s : kShapes) {
    for (const CopyMode mode : {CopyMode::Sync, CopyMode::Async}) {
      SCOPED_TRACE(testing::Message() << s.rows << " rows of " << s.row_bytes << " bytes, host pitch " << s.host_pitch
                                      << ", device pitch " << s.device_pitch << (mode == CopyMode::Sync ? ", sync" : ", async"));
      const auto layout = layout_of(s);
      const std::uint64_t host_span = span(s.rows, s.row_bytes, s.host_pitch);
      const std::uint64_t device_span = span(s.rows, s.row_bytes, s.device_pitch);
      constexpr std::uint64_t kDeviceOffset = 13;  // an odd start inside the allocation
      const std::uint64_t extent = device_span + 2 * kDeviceOffset;
      const auto h = b.alloc_device(bytes_spec(extent, 1), extent);
      write_device(h, 0, Bytes(extent, kDevicePoison));

      // Up: the host range holds rows at host_pitch, padding poisoned.
      const Bytes source = random_.bytes_not(host_span, kDevicePoison);
      const auto up = reserve_with(source);
      const auto up_event = b.copy(h2d(up, DeviceRange{h, kDeviceOffset, device_span}, layout, mode));
      if (mode == CopyMode::Async) {
        EXPECT_EQ(b.wait(up_event).state, CopyState::Completed);
      }
      EXPECT_TRUE(b.safe_to_release_host(up_event));
      b.release_host(up);
      const Bytes expected_device = scatter(Bytes(extent, kDevicePoison), source, s, s.host_pitch, s.device_pitch, kDeviceOffset);
      EXPECT_TRUE(bytes_equal(read_device(h, 0, extent), expected_device, "device after a pitched upload"));

      // Down: back into a poisoned host range at host_pitch.
      const auto down = reserve_poisoned(host_span);
      const auto down_event = b.copy(d2h(DeviceRange{h, kDeviceOffset, device_span}, down, layout, mode));
      if (mode == CopyMode::Async) {
        EXPECT_EQ(b.wait(down_event).state, CopyState::Completed);
      }
      EXPECT_TRUE(b.host_bytes_valid(down_event));
      const Bytes expected_host = scatter(Bytes(host_span, kHostPoison), source, s, s.host_pitch, s.host_pitch);
      const auto got = b.host_bytes(down);
      EXPECT_TRUE(bytes_equal(Bytes(got.begin(), got.end()), expected_host, "host after a pitched download"));
      b.release_host(down);
      b.free_device(h);
    }
  }
  EXPECT_EQ(backend_live_allocations(), 0u);
}

TEST_P(PitchedCopyConformance, ALayoutThatDoesNotFitIsRefusedBeforeTheBackendSeesIt) {
  auto& b = make_bridge();
  const auto h = b.alloc_device(bytes_spec(4096, 1), 4096);
  const auto host = b.reserve(4096);
  const DeviceRange device{h, 0, 4096};
  // Rows overlapping on either side, reaching past either range, or moving nothing.
  EXPECT_KIND(ErrorKind::InvalidRange, b.copy(h2d(host, device, CopyLayout{4, 100, 99, 100}, CopyMode::Sync)));
  EXPECT_KIND(ErrorKind::InvalidRange, b.copy(h2d(host, device, CopyLayout{4, 100, 100, 50}, CopyMode::Sync)));
  EXPECT_KIND(ErrorKind::InvalidRange, b.copy(h2d(host, device, CopyLayout{5, 100, 1000, 100}, CopyMode::Sync)));
  EXPECT_KIND(ErrorKind::InvalidRange, b.copy(d2h(device, host, CopyLayout{5, 100, 100, 1000}, CopyMode::Sync)));
  EXPECT_KIND(ErrorKind::InvalidRange, b.copy(h2d(host, device, CopyLayout{0, 100, 100, 100}, CopyMode::Sync)));
  EXPECT_KIND(ErrorKind::InvalidRange, b.copy(h2d(host, device, CopyLayout{3, 0, 100, 100}, CopyMode::Sync)));
  // Pitches whose span wraps 2^64.
  EXPECT_KIND(ErrorKind::InvalidRange,
              b.copy(h2d(host, device, CopyLayout{1ull << 40, 8, 1ull << 40, 8}, CopyMode::Async)));
  // A typed allocation's rows may not split its elements.
  const auto floats = b.alloc_device(ObjectSpec{4096, 64, DType::Float32, ShapeKind::Matrix}, 4096);
  EXPECT_KIND(ErrorKind::InvalidRange,
              b.copy(h2d(host, DeviceRange{floats, 0, 4096}, CopyLayout{2, 6, 8, 8}, CopyMode::Sync)));
  EXPECT_EQ(b.stats().copies_submitted, 0u);
  b.release_host(host);
  b.free_device(h);
  b.free_device(floats);
}

TEST_P(PitchedCopyConformance, ALayoutFromAStridedArrayMatchesItsRows) {
  // A 7x5 float32 window of a 9x6 matrix starting at row 1, column 1.
  const std::int64_t shape[] = {7, 5};
  const std::int64_t strides[] = {6 * 4, 4};
  const auto layout = pitched_layout(shape, strides, 4);
  EXPECT_EQ(layout, (CopyLayout{7, 20, 24, 20}));
  auto& b = make_bridge();
  const auto h = b.alloc_device(ObjectSpec{7 * 20, 4, DType::Float32, ShapeKind::Matrix}, 7 * 20);
  std::vector<float> matrix(9 * 6);
  for (std::size_t i = 0; i < matrix.size(); ++i) matrix[i] = static_cast<float>(i);
  const auto host = b.reserve(matrix.size() * 4);
  std::memcpy(b.host_bytes(host).data(), matrix.data(), matrix.size() * 4);
  const std::uint64_t window = (1 * 6 + 1) * 4;
  b.copy(h2d(HostRange{host.offset + window, host.len - window}, DeviceRange{h, 0, 7 * 20}, layout, CopyMode::Sync));
  const Bytes device = read_device(h, 0, 7 * 20);
  std::vector<float> got(35);
  std::memcpy(got.data(), device.data(), device.size());
  for (int r = 0; r < 7; ++r)
    for (int c = 0; c < 5; ++c) EXPECT_EQ(got[r * 5 + c], matrix[(r + 1) * 6 + c + 1]) << "row " << r << " column " << c;
  b.release_host(host);
  b.free_device(h);
}

// copy() without a layout is the wrappers' copy, from the ring and from a
// registered region, both ways and in both modes: the same bytes land, one
// copy is counted, and the event answers alike. With a layout only the rows
// move.
TEST_P(PitchedCopyConformance, TheOneEntryPointMovesWhatTheWrappersMove) {
  auto& b = make_bridge();
  constexpr std::uint64_t kBytes = 3001;
  constexpr Shape kRows{3, 701, 1000, 703};  // spans 2701 bytes on the host, 2107 on the device
  std::vector<std::byte> memory(kBytes);
  const HostRegion region = b.register_host(memory);
  const HostRange ring = b.reserve(kBytes);
  const auto h = b.alloc_device(bytes_spec(kBytes, 1), kBytes);
  const DeviceRange device{h, 0, kBytes};
  for (const bool from_region : {false, true}) {
    const HostSide host = from_region ? HostSide{RegionRange{region, 0, kBytes}} : HostSide{ring};
    const std::span<std::byte> bytes = from_region ? std::span<std::byte>(memory) : b.host_bytes(ring);
    for (const CopyMode mode : {CopyMode::Sync, CopyMode::Async}) {
      SCOPED_TRACE(std::string(from_region ? "registered region" : "ring") + (mode == CopyMode::Sync ? ", sync" : ", async"));
      const auto one_copy = [&](const std::function<CopyEvent()>& submit) {
        const auto before = b.stats().copies_submitted;
        const CopyEvent event = submit();
        EXPECT_EQ(b.stats().copies_submitted, before + 1);
        if (mode == CopyMode::Async) {
          EXPECT_EQ(b.wait(event).state, CopyState::Completed);
        }
        EXPECT_EQ(b.copy_status(event).state, CopyState::Completed);
        EXPECT_TRUE(b.safe_to_release_host(event));
        EXPECT_TRUE(b.host_bytes_valid(event));
      };
      for (const bool wrapper : {false, true}) {
        SCOPED_TRACE(wrapper ? "host_to_device / device_to_host" : "copy(HostCopy) without a layout");
        const Bytes source = random_.bytes_not(kBytes, kDevicePoison);
        std::memcpy(bytes.data(), source.data(), kBytes);
        write_device(h, 0, Bytes(kBytes, kDevicePoison));
        one_copy([&] {
          return wrapper ? std::visit([&](auto r) { return b.host_to_device(r, device, mode); }, host)
                         : b.copy(h2d(host, device, std::nullopt, mode));
        });
        EXPECT_TRUE(bytes_equal(read_device(h, 0, kBytes), source, "device after the upload"));
        std::memset(bytes.data(), static_cast<int>(kHostPoison), kBytes);
        one_copy([&] {
          return wrapper ? std::visit([&](auto r) { return b.device_to_host(device, r, mode); }, host)
                         : b.copy(d2h(device, host, std::nullopt, mode));
        });
        EXPECT_TRUE(bytes_equal(Bytes(bytes.begin(), bytes.end()), source, "host after the download"));
      }
      SCOPED_TRACE("copy(HostCopy) with a layout");
      const Bytes source = random_.bytes_not(kBytes, kDevicePoison);
      std::memcpy(bytes.data(), source.data(), kBytes);
      write_device(h, 0, Bytes(kBytes, kDevicePoison));
      one_copy([&] { return b.copy(h2d(host, device, layout_of(kRows), mode)); });
      EXPECT_TRUE(bytes_equal(read_device(h, 0, kBytes),
                              scatter(Bytes(kBytes, kDevicePoison), source, kRows, kRows.host_pitch, kRows.device_pitch),
                              "device after the pitched upload"));
      std::memset(bytes.data(), static_cast<int>(kHostPoison), kBytes);
      one_copy([&] { return b.copy(d2h(device, host, layout_of(kRows), mode)); });
      EXPECT_TRUE(bytes_equal(Bytes(bytes.begin(), bytes.end()),
                              scatter(Bytes(kBytes, kHostPoison), source, kRows, kRows.host_pitch, kRows.host_pitch),
                              "host after the pitched download"));
    }
  }
  b.release_host(ring);
  b.unregister_host(region);
  b.free_device(h);
}

// A refused request names the range at fault, whichever host range it is and
// whichever way it goes; copy() without a layout refuses as the wrappers do.
TEST_P(PitchedCopyConformance, ARefusedRequestNamesTheRangeAtFault) {
  auto& b = make_bridge();
  std::vector<std::byte> memory(4096);
  const HostRegion region = b.register_host(memory);
  const HostRange ring = b.reserve(4096);
  const auto h = b.alloc_device(bytes_spec(4096, 1), 4096);
  const DeviceRange device{h, 0, 4096};
  const auto refusal = [&](const std::function<void()>& statement) -> std::string {
    try {
      statement();
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidRange) << e.what();
      return e.what();
    }
    ADD_FAILURE() << "not refused";
    return {};
  };
  const HostRange ring_part{ring.offset, 1000};
  const RegionRange region_part{region, 10, 1000};
  const std::string ring_name = "host range [offset " + std::to_string(ring.offset) + ", len 1000]";
  const std::string region_name = "range [offset 10, len 1000] of host region";
  for (const auto direction : {CopyDirection::HostToDevice, CopyDirection::DeviceToHost}) {
    SCOPED_TRACE(direction == CopyDirection::HostToDevice ? "up" : "down");
    // Rows reaching past the host range: 3 rows at a pitch of 400 span 1100 bytes.
    const CopyLayout too_long{3, 300, 400, 300};
    for (const auto& [host, name] : {std::pair<HostSide, std::string>{ring_part, ring_name},
                                     std::pair<HostSide, std::string>{region_part, region_name}}) {
      const std::string pitched = refusal([&] { b.copy(HostCopy{direction, host, device, too_long, CopyMode::Sync}); });
      EXPECT_NE(pitched.find(name), std::string::npos) << pitched;
      EXPECT_NE(pitched.find("reach 1100 bytes"), std::string::npos) << pitched;
      // Without a layout: lengths that differ, refused word for word as the wrappers refuse them.
      const std::string plain = refusal([&] { b.copy(HostCopy{direction, host, device, std::nullopt, CopyMode::Async}); });
      EXPECT_NE(plain.find(name), std::string::npos) << plain;
      const std::string wrapped = refusal([&] {
        std::visit(
            [&](auto r) {
              (void)(direction == CopyDirection::HostToDevice ? b.host_to_device(r, device, CopyMode::Async)
                                                              : b.device_to_host(device, r, CopyMode::Async));
            },
            host);
      });
      EXPECT_EQ(plain, wrapped);
    }
    // The device range at fault: rows reaching past it.
    const std::string device_side = refusal([&] {
      b.copy(HostCopy{direction, ring, DeviceRange{h, 0, 500}, CopyLayout{3, 100, 100, 250}, CopyMode::Sync});
    });
    EXPECT_NE(device_side.find("reach 600 bytes, past the device range [offset 0, len 500]"), std::string::npos) << device_side;
  }
  EXPECT_EQ(b.stats().copies_submitted, 0u);
  b.release_host(ring);
  b.unregister_host(region);
  b.free_device(h);
}

INSTANTIATE_TEST_SUITE_P(Backends, PitchedCopyConformance, ::testing::ValuesIn(backend_drivers()),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace devbridge::conformance
