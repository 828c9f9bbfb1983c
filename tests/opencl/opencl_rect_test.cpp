// Pitched 2-D copies (clEnqueueWriteBufferRect / clEnqueueReadBufferRect)
// and registered host memory (a CL_MEM_USE_HOST_PTR buffer), on a device,
// through the Backend directly. Every copy lands on a buffer or host block
// filled with a sentinel first, so a byte written between rows or past the
// last one shows up.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backends/opencl/opencl_api.hpp"
#include "devbridge/backends.hpp"
#include "devbridge/backends/opencl.hpp"
#include "devbridge/bridge.hpp"
#include "devbridge/error.hpp"

namespace devbridge::opencl {
namespace {

using ::testing::HasSubstr;
using namespace abi;  // OpenCL's names, as cl.h would give them

// A staging import through the seam, and its release, as the tests below use them.
HostBlock register_host(Backend& backend, std::byte* data, std::uint64_t bytes) {
  return backend.import_host(ImportRequest{.use = ImportUse::Staging, .data = data, .bytes = bytes}).block;
}
void unregister_host(Backend& backend, const HostBlock& block) noexcept {
  backend.release_import(HostImport{.block = block});
}

constexpr std::byte kDeviceSentinel{0xEE};
constexpr std::byte kHostSentinel{0xCC};

template <class F>
Error error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "no devbridge::Error was thrown";
  return Error(ErrorKind::Broken, "nothing thrown");
}

// A byte that differs from row to row and column to column, and from both
// sentinels.
std::byte pattern(std::uint64_t row, std::uint64_t column, std::uint64_t salt) {
  auto value = static_cast<std::uint8_t>((row * 31 + column * 7 + salt) % 200 + 1);
  return std::byte{value};
}

struct Shape {
  std::uint64_t rows, row_bytes, host_pitch, device_pitch, device_offset;
};

std::string name_of(const Shape& s) {
  return std::to_string(s.rows) + " rows of " + std::to_string(s.row_bytes) + " bytes, host pitch " +
         std::to_string(s.host_pitch) + ", device pitch " + std::to_string(s.device_pitch) + ", device offset " +
         std::to_string(s.device_offset);
}

// Odd widths (3, 7, 4095 bytes), odd pitches and offsets, packed rows, and
// single rows whose pitch is shorter or longer than the row (OpenCL would
// refuse the shorter one as given).
const std::vector<Shape> kShapes = {
    {5, 3, 7, 5, 1},         {9, 7, 13, 11, 3},    {3, 4095, 4097, 4099, 17}, {4, 16, 16, 16, 0},
    {1, 7, 0, 3, 5},         {1, 4095, 5000, 8191, 1}, {2, 4095, 4095, 8193, 4095}, {33, 1, 3, 2, 0},
};

std::uint64_t host_span(const Shape& s) { return (s.rows - 1) * (s.rows == 1 ? 0 : s.host_pitch) + s.row_bytes; }
std::uint64_t device_span(const Shape& s) {
  return (s.rows - 1) * (s.rows == 1 ? 0 : s.device_pitch) + s.row_bytes;
}
CopyLayout layout_of(const Shape& s) { return CopyLayout{s.rows, s.row_bytes, s.host_pitch, s.device_pitch}; }

class OpenCLRect : public ::testing::Test {
 protected:
  static constexpr std::uint64_t kGuard = 64;  // sentinel bytes past every span

  void SetUp() override {
    const Probe found = probe();
    if (!found.available) GTEST_SKIP() << "no OpenCL device here: " << found.reason;
    backend_ = make_opencl_backend();
    ring_ = backend_->allocate_host(kRingBytes);
  }
  void TearDown() override {
    if (!backend_) return;
    backend_->quiesce();
    std::vector<Completion> drained;
    backend_->drain_completions(drained);
    backend_->free_host(ring_);
    EXPECT_EQ(backend_->test_controls()->live_allocations(), 0u);
    EXPECT_EQ(*backend_->test_controls()->live_registrations(), 0u);
  }

  // The ring's halves: what a test copies from or into, and a scratch area
  // for whole-buffer fills and read-backs.
  std::byte* host() { return ring_.data; }
  std::byte* scratch() { return ring_.data + kRingBytes / 2; }

  void whole(CopyDirection direction, const DeviceAllocation& buffer) {
    ASSERT_LE(buffer.bytes, kRingBytes / 2);
    backend_->submit_copy(CopyRequest{direction, CopyMode::Sync, CopyEvent{1, 1, 999}, scratch(), buffer, 0,
                                      buffer.bytes, CopyLayout{}});
  }
  void fill_device(const DeviceAllocation& buffer, std::byte value) {
    std::memset(scratch(), static_cast<int>(value), buffer.bytes);
    whole(CopyDirection::HostToDevice, buffer);
  }

  CopyRequest request(CopyDirection direction, CopyMode mode, std::uint64_t id, std::byte* host,
                      const DeviceAllocation& buffer, const Shape& s) {
    return CopyRequest{direction, mode, CopyEvent{1, 1, id}, host, buffer, s.device_offset, s.rows * s.row_bytes,
                       layout_of(s)};
  }

  // Submits, and for Async waits for exactly its completion.
  void run(const CopyRequest& r) {
    backend_->submit_copy(r);
    if (r.mode == CopyMode::Sync) return;
    std::vector<Completion> drained;
    const auto start = std::chrono::steady_clock::now();
    while (drained.empty()) {
      backend_->wait_for_completions(std::chrono::milliseconds(100));
      backend_->drain_completions(drained);
      ASSERT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30)) << "never completed";
    }
    ASSERT_EQ(drained.size(), 1u);
    EXPECT_EQ(drained[0].event, r.event);
    EXPECT_TRUE(drained[0].ok) << drained[0].message;
  }

  // Uploads `s` from host() and checks the buffer byte by byte: the rows
  // hold the host's rows, everything else kept the sentinel.
  void upload_and_check(const Shape& s, CopyMode mode, const std::byte* source) {
    const DeviceAllocation buffer = backend_->allocate(s.device_offset + device_span(s) + kGuard, 64);
    fill_device(buffer, kDeviceSentinel);
    run(request(CopyDirection::HostToDevice, mode, 11, const_cast<std::byte*>(source), buffer, s));
    std::memset(scratch(), 0, buffer.bytes);
    whole(CopyDirection::DeviceToHost, buffer);
    const std::byte* seen = scratch();
    std::uint64_t wrong = 0;
    for (std::uint64_t at = 0; at < buffer.bytes; ++at) {
      std::byte expected = kDeviceSentinel;
      if (at >= s.device_offset) {
        const std::uint64_t rel = at - s.device_offset;
        const std::uint64_t row = s.rows == 1 ? 0 : rel / s.device_pitch;
        const std::uint64_t column = s.rows == 1 ? rel : rel % s.device_pitch;
        if (row < s.rows && column < s.row_bytes) expected = source[row * s.host_pitch + column];
      }
      if (seen[at] != expected && wrong++ < 5)
        ADD_FAILURE() << "device byte " << at << " is " << int(seen[at]) << ", expected " << int(expected);
    }
    EXPECT_EQ(wrong, 0u);
    backend_->free(buffer);
  }

  std::unique_ptr<Backend> backend_;
  HostBlock ring_;
  static constexpr std::uint64_t kRingBytes = 1 << 20;
};

TEST_F(OpenCLRect, UploadsRowsAndLeavesTheDevicesPaddingUntouched) {
  for (const CopyMode mode : {CopyMode::Sync, CopyMode::Async}) {
    for (const Shape& s : kShapes) {
      SCOPED_TRACE(name_of(s) + (mode == CopyMode::Sync ? ", sync" : ", async"));
      // The host rows carry the pattern; the host padding a sentinel the
      // device must never receive.
      std::memset(host(), static_cast<int>(kHostSentinel), host_span(s) + kGuard);
      for (std::uint64_t r = 0; r < s.rows; ++r)
        for (std::uint64_t c = 0; c < s.row_bytes; ++c) host()[r * s.host_pitch + c] = pattern(r, c, 1);
      upload_and_check(s, mode, host());
    }
  }
}

TEST_F(OpenCLRect, DownloadsRowsAndLeavesTheHostsPaddingUntouched) {
  for (const CopyMode mode : {CopyMode::Sync, CopyMode::Async}) {
    for (const Shape& s : kShapes) {
      SCOPED_TRACE(name_of(s) + (mode == CopyMode::Sync ? ", sync" : ", async"));
      const DeviceAllocation buffer = backend_->allocate(s.device_offset + device_span(s) + kGuard, 64);
      // The whole buffer carries a pattern by address, so a row read from
      // the wrong place is caught too.
      for (std::uint64_t at = 0; at < buffer.bytes; ++at) scratch()[at] = pattern(at / 251, at % 251, 2);
      whole(CopyDirection::HostToDevice, buffer);
      std::vector<std::byte> device(scratch(), scratch() + buffer.bytes);

      std::memset(host(), static_cast<int>(kHostSentinel), host_span(s) + kGuard);
      run(request(CopyDirection::DeviceToHost, mode, 12, host(), buffer, s));
      std::uint64_t wrong = 0;
      for (std::uint64_t at = 0; at < host_span(s) + kGuard; ++at) {
        const std::uint64_t row = s.rows == 1 ? 0 : at / s.host_pitch;
        const std::uint64_t column = s.rows == 1 ? at : at % s.host_pitch;
        const std::byte expected = row < s.rows && column < s.row_bytes
                                       ? device[s.device_offset + row * s.device_pitch + column]
                                       : kHostSentinel;
        if (host()[at] != expected && wrong++ < 5)
          ADD_FAILURE() << "host byte " << at << " is " << int(host()[at]) << ", expected " << int(expected);
      }
      EXPECT_EQ(wrong, 0u);
      backend_->free(buffer);
    }
  }
}

// A pitched copy is one command: held, it pends like a 1-D copy, keeps its
// place in the queue, and reports under its own event.
TEST_F(OpenCLRect, AHeldPitchedCopyPendsAndCompletesInQueueOrder) {
  const Shape s{6, 7, 9, 13, 3};
  const DeviceAllocation buffer = backend_->allocate(s.device_offset + device_span(s) + kGuard, 64);
  fill_device(buffer, kDeviceSentinel);
  for (std::uint64_t r = 0; r < s.rows; ++r)
    for (std::uint64_t c = 0; c < s.row_bytes; ++c) host()[r * s.host_pitch + c] = pattern(r, c, 3);
  std::byte* back = host() + 4096;
  std::memset(back, static_cast<int>(kHostSentinel), host_span(s) + kGuard);

  backend_->test_controls()->hold_copies(true);
  backend_->submit_copy(request(CopyDirection::HostToDevice, CopyMode::Async, 21, host(), buffer, s));
  backend_->submit_copy(request(CopyDirection::DeviceToHost, CopyMode::Async, 22, back, buffer, s));
  std::vector<Completion> drained;
  backend_->wait_for_completions(std::chrono::milliseconds(20));  // may wake spuriously; the drain decides
  backend_->drain_completions(drained);
  EXPECT_TRUE(drained.empty()) << "a held pitched copy completed";
  EXPECT_EQ(back[0], kHostSentinel) << "the held download ran";

  backend_->test_controls()->hold_copies(false);
  const auto start = std::chrono::steady_clock::now();
  while (drained.size() < 2) {
    backend_->wait_for_completions(std::chrono::milliseconds(100));
    backend_->drain_completions(drained);
    ASSERT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30)) << "never completed";
  }
  ASSERT_EQ(drained.size(), 2u);
  EXPECT_EQ(drained[0].event.id, 21u);
  EXPECT_EQ(drained[1].event.id, 22u);
  EXPECT_TRUE(drained[0].ok && drained[1].ok) << drained[0].message << drained[1].message;
  // Round trip through the device: rows back where they were, padding kept.
  for (std::uint64_t at = 0; at < host_span(s) + kGuard; ++at) {
    const std::uint64_t row = at / s.host_pitch, column = at % s.host_pitch;
    const std::byte expected = row < s.rows && column < s.row_bytes ? host()[at] : kHostSentinel;
    ASSERT_EQ(back[at], expected) << "host byte " << at;
  }
  backend_->free(buffer);
}

// The backend's own check: a pitched request past the buffer, with rows
// that would overlap, or whose span does not fit in 64 bits, is the seam's
// InvalidRange naming it, in both modes, and nothing runs or is reported.
TEST_F(OpenCLRect, PitchedRangesOutsideTheBufferAreRefused) {
  const DeviceAllocation buffer = backend_->allocate(56, 64);
  fill_device(buffer, kDeviceSentinel);
  constexpr std::uint64_t kHuge = std::uint64_t{1} << 40;
  struct Case {
    CopyLayout layout;
    std::uint64_t offset, len;
    const char* says;
  };
  const std::vector<Case> cases = {
      {{4, 8, 16, 16}, 1, 32, "[1, +56)"},       // the last row ends one byte past the buffer
      {{4, 8, 8, 16}, 9, 32, "[9, +56)"},        // fits packed on the host, not at the device pitch
      {{1, 57, 57, 57}, 0, 57, "[0, +57)"},      // one row longer than the buffer
      {{2, 8, 16, 4}, 0, 16, "device pitch"},    // device rows would overlap
      {{2, 8, 4, 16}, 0, 16, "host pitch"},      // host rows would overlap
      {{kHuge, 8, kHuge, kHuge}, 0, kHuge * 8, "2^64"},
      {{4, 8, 8, 8}, 0, 31, "31 bytes"},         // len is not rows * row_bytes
      {{4, 0, 8, 8}, 0, 0, "0 bytes"},           // OpenCL has no empty region
  };
  for (const auto& c : cases) {
    for (const CopyDirection direction : {CopyDirection::HostToDevice, CopyDirection::DeviceToHost}) {
      for (const CopyMode mode : {CopyMode::Sync, CopyMode::Async}) {
        SCOPED_TRACE(std::string(c.says) + (mode == CopyMode::Sync ? " sync" : " async"));
        const CopyRequest r{direction, mode, CopyEvent{1, 1, 31}, host(), buffer, c.offset, c.len, c.layout};
        const Error refused = error_of([&] { backend_->submit_copy(r); });
        EXPECT_EQ(refused.kind(), ErrorKind::InvalidRange) << refused.what();
        EXPECT_THAT(refused.what(), HasSubstr(c.says));
      }
    }
  }
  backend_->quiesce();
  std::vector<Completion> drained;
  backend_->drain_completions(drained);
  EXPECT_TRUE(drained.empty()) << "a refused copy was reported";
  whole(CopyDirection::DeviceToHost, buffer);
  for (std::uint64_t at = 0; at < buffer.bytes; ++at) ASSERT_EQ(scratch()[at], kDeviceSentinel) << at;
  backend_->free(buffer);
}

// A request without a layout is the 1-D copy it always was.
TEST_F(OpenCLRect, ARequestWithoutALayoutIsAContiguousCopy) {
  const DeviceAllocation buffer = backend_->allocate(4096, 64);
  fill_device(buffer, kDeviceSentinel);
  for (std::uint64_t i = 0; i < 100; ++i) host()[i] = pattern(0, i, 4);
  run(CopyRequest{CopyDirection::HostToDevice, CopyMode::Async, CopyEvent{1, 1, 41}, host(), buffer, 5, 100, CopyLayout{}});
  whole(CopyDirection::DeviceToHost, buffer);
  for (std::uint64_t at = 0; at < buffer.bytes; ++at)
    ASSERT_EQ(scratch()[at], at >= 5 && at < 105 ? host()[at - 5] : kDeviceSentinel) << at;
  backend_->free(buffer);
}

// ---- registered host memory ----

const detail::Api& cl() { return detail::api(); }

template <class T>
T mem_info(cl_mem buffer, cl_mem_info what) {
  T value{};
  EXPECT_EQ(cl().clGetMemObjectInfo(buffer, what, sizeof value, &value, nullptr), CL_SUCCESS);
  return value;
}

TEST_F(OpenCLRect, RegisteredMemoryIsABufferOverItAndCopiesFromItRoundTrip) {
  // An odd address and an odd size: nothing about the caller's memory is aligned.
  constexpr std::uint64_t kBytes = 3 * 4096 + 5;
  std::vector<std::byte> memory(kBytes + 1);
  std::byte* data = memory.data() + 1;
  for (std::uint64_t i = 0; i < kBytes; ++i) data[i] = pattern(i / 97, i % 97, 5);
  const std::vector<std::byte> before(data, data + kBytes);

  const HostBlock block = register_host(*backend_, data, kBytes);
  EXPECT_EQ(block.data, data);
  EXPECT_EQ(block.bytes, kBytes);
  EXPECT_FALSE(block.page_locked) << "OpenCL cannot tell whether it pinned the memory";
  ASSERT_NE(block.token, 0u);
  auto* buffer = reinterpret_cast<cl_mem>(block.token);
  EXPECT_NE(mem_info<cl_mem_flags>(buffer, CL_MEM_FLAGS) & CL_MEM_USE_HOST_PTR, 0u);
  EXPECT_EQ(mem_info<void*>(buffer, CL_MEM_HOST_PTR), static_cast<void*>(data));
  EXPECT_EQ(mem_info<std::size_t>(buffer, CL_MEM_SIZE), kBytes);
  EXPECT_EQ(mem_info<cl_uint>(buffer, CL_MEM_REFERENCE_COUNT), 1u) << "unregister would not free it";
  EXPECT_EQ(*backend_->test_controls()->live_registrations(), 1u);
  EXPECT_EQ(backend_->test_controls()->live_allocations(), 0u) << "a registration counted as a device buffer";
  EXPECT_EQ(std::memcmp(data, before.data(), kBytes), 0) << "registering changed the memory";

  // Copies name addresses inside the block, 1-D and pitched, both ways.
  const DeviceAllocation device = backend_->allocate(kBytes, 64);
  run(CopyRequest{CopyDirection::HostToDevice, CopyMode::Async, CopyEvent{1, 1, 51}, data, device, 0, kBytes, CopyLayout{}});
  const Shape s{7, 101, 503, 211, 9};
  std::byte* rows_at = data + 1000;
  const std::vector<std::byte> padding(rows_at, rows_at + host_span(s));
  CopyRequest down = request(CopyDirection::DeviceToHost, CopyMode::Async, 52, rows_at, device, s);
  run(down);
  for (std::uint64_t at = 0; at < host_span(s); ++at) {
    const std::uint64_t row = at / s.host_pitch, column = at % s.host_pitch;
    const std::byte expected =
        row < s.rows && column < s.row_bytes ? before[s.device_offset + row * s.device_pitch + column] : padding[at];
    ASSERT_EQ(rows_at[at], expected) << "registered byte " << 1000 + at;
  }
  upload_and_check(s, CopyMode::Sync, rows_at);

  backend_->free(device);
  const std::vector<std::byte> last(data, data + kBytes);
  unregister_host(*backend_, block);
  EXPECT_EQ(*backend_->test_controls()->live_registrations(), 0u);
  EXPECT_EQ(std::memcmp(data, last.data(), kBytes), 0) << "releasing the buffer wrote into the caller's memory";
}

TEST_F(OpenCLRect, RegistrationsComeAndGoIndependently) {
  std::vector<std::byte> a(4096), b(10000);
  const HostBlock first = register_host(*backend_, a.data(), a.size());
  const HostBlock second = register_host(*backend_, b.data(), b.size());
  EXPECT_NE(first.token, second.token);
  EXPECT_EQ(*backend_->test_controls()->live_registrations(), 2u);
  unregister_host(*backend_, first);
  EXPECT_EQ(*backend_->test_controls()->live_registrations(), 1u);
  EXPECT_EQ(mem_info<std::size_t>(reinterpret_cast<cl_mem>(second.token), CL_MEM_SIZE), b.size());
  unregister_host(*backend_, second);
  EXPECT_EQ(*backend_->test_controls()->live_registrations(), 0u);
  // A block the backend never registered (no buffer) is nothing to release.
  unregister_host(*backend_, HostBlock{a.data(), a.size(), false, 0});
  EXPECT_EQ(*backend_->test_controls()->live_registrations(), 0u);
}

TEST_F(OpenCLRect, ARegistrationNoBufferCanHoldIsInvalidExtentNamingIt) {
  std::vector<std::byte> memory(16);
  const Error empty = error_of([&] { register_host(*backend_, memory.data(), 0); });
  EXPECT_EQ(empty.kind(), ErrorKind::InvalidExtent);
  EXPECT_THAT(empty.what(), HasSubstr("0 bytes"));

  // Never touched: refused before the driver sees the pointer.
  constexpr std::uint64_t kHuge = std::uint64_t{1} << 62;
  const Error huge = error_of([&] { register_host(*backend_, memory.data(), kHuge); });
  EXPECT_EQ(huge.kind(), ErrorKind::InvalidExtent);
  EXPECT_THAT(huge.what(), HasSubstr(std::to_string(kHuge)));
  EXPECT_THAT(huge.what(), HasSubstr("CL_DEVICE_MAX_MEM_ALLOC_SIZE"));
  EXPECT_EQ(*backend_->test_controls()->live_registrations(), 0u);
}

// The driver's own refusal names the call, the code, the address and size.
TEST_F(OpenCLRect, ADriversRefusalNamesTheAddressAndSize) {
  const Error refused = error_of([&] { register_host(*backend_, nullptr, 4096); });  // CL_INVALID_HOST_PTR
  EXPECT_EQ(refused.kind(), ErrorKind::AllocationFailed);
  EXPECT_FALSE(refused.fatal());
  EXPECT_THAT(refused.what(), HasSubstr("clCreateBuffer(CL_MEM_USE_HOST_PTR): CL_INVALID_HOST_PTR"));
  EXPECT_THAT(refused.what(), HasSubstr("4096 bytes of host memory at"));
  EXPECT_EQ(*backend_->test_controls()->live_registrations(), 0u);
}

// ---- through the bridge ----

// The bridge's pitched API over this backend, from the ring and from a
// registered region, both directions and modes: one event per copy, rows at
// their pitches, padding kept on both sides; registrations are released by
// unregister_host and by restart.
class OpenCLBridgeRect : public ::testing::Test {
 protected:
  void SetUp() override {
    const Probe found = probe();
    if (!found.available) GTEST_SKIP() << "no OpenCL device here: " << found.reason;
    bridge_ = std::make_unique<Bridge>(make_opencl_backend(), BridgeOptions{.ring_bytes = 1 << 20});
  }

  // Writes `source` (rows at s.host_pitch) up through `up`, reads it back
  // through `down`, and checks the device and the host byte by byte.
  // `up` and `down` submit a pitched copy and return its event.
  template <class Up, class Down>
  void round_trip(const Shape& s, CopyMode mode, std::span<std::byte> source, Up&& up, Down&& down,
                  std::span<std::byte> back) {
    Bridge& b = *bridge_;
    const std::uint64_t extent = s.device_offset + device_span(s) + 64;
    const DeviceHandle h = b.alloc_device(ObjectSpec{extent, 1, DType::UInt8, ShapeKind::Vector}, extent);
    const HostRange whole = b.reserve(extent);
    std::memset(b.host_bytes(whole).data(), static_cast<int>(kDeviceSentinel), extent);
    b.host_to_device(whole, DeviceRange{h, 0, extent}, CopyMode::Sync);

    const DeviceRange rows{h, s.device_offset, device_span(s)};
    const CopyEvent up_event = up(rows, layout_of(s), mode);
    if (mode == CopyMode::Async) {
      EXPECT_EQ(b.wait(up_event).state, CopyState::Completed);
    }
    EXPECT_TRUE(b.safe_to_release_host(up_event));
    b.device_to_host(DeviceRange{h, 0, extent}, whole, CopyMode::Sync);
    const std::byte* device = b.host_bytes(whole).data();
    for (std::uint64_t at = 0; at < extent; ++at) {
      std::byte expected = kDeviceSentinel;
      if (at >= s.device_offset) {
        const std::uint64_t rel = at - s.device_offset;
        const std::uint64_t row = s.rows == 1 ? 0 : rel / s.device_pitch;
        const std::uint64_t column = s.rows == 1 ? rel : rel % s.device_pitch;
        if (row < s.rows && column < s.row_bytes) expected = source[row * s.host_pitch + column];
      }
      ASSERT_EQ(device[at], expected) << "device byte " << at;
    }

    std::memset(back.data(), static_cast<int>(kHostSentinel), back.size());
    const CopyEvent down_event = down(rows, layout_of(s), mode);
    if (mode == CopyMode::Async) {
      EXPECT_EQ(b.wait(down_event).state, CopyState::Completed);
    }
    EXPECT_TRUE(b.host_bytes_valid(down_event));
    for (std::uint64_t at = 0; at < back.size(); ++at) {
      const std::uint64_t row = s.rows == 1 ? 0 : at / s.host_pitch;
      const std::uint64_t column = s.rows == 1 ? at : at % s.host_pitch;
      const std::byte expected = row < s.rows && column < s.row_bytes ? source[at] : kHostSentinel;
      ASSERT_EQ(back[at], expected) << "host byte " << at;
    }
    b.release_host(whole);
    b.free_device(h);
  }

  void fill_rows(std::span<std::byte> host, const Shape& s) {
    std::memset(host.data(), static_cast<int>(kHostSentinel), host.size());
    for (std::uint64_t r = 0; r < s.rows; ++r)
      for (std::uint64_t c = 0; c < s.row_bytes; ++c) host[r * s.host_pitch + c] = pattern(r, c, 6);
  }

  std::unique_ptr<Bridge> bridge_;
};

TEST_F(OpenCLBridgeRect, PitchedCopiesFromAndIntoTheRing) {
  Bridge& b = *bridge_;
  for (const CopyMode mode : {CopyMode::Sync, CopyMode::Async}) {
    for (const Shape& s : kShapes) {
      SCOPED_TRACE(name_of(s) + (mode == CopyMode::Sync ? ", sync" : ", async"));
      const HostRange src = b.reserve(host_span(s));
      const HostRange dst = b.reserve(host_span(s));
      fill_rows(b.host_bytes(src), s);
      round_trip(
          s, mode, b.host_bytes(src),
          [&](DeviceRange rows, const CopyLayout& layout, CopyMode m) {
            return b.copy(HostCopy{CopyDirection::HostToDevice, src, rows, layout, m});
          },
          [&](DeviceRange rows, const CopyLayout& layout, CopyMode m) {
            return b.copy(HostCopy{CopyDirection::DeviceToHost, dst, rows, layout, m});
          },
          b.host_bytes(dst));
      b.release_host(src);
      b.release_host(dst);
    }
  }
  b.empty_cache();  // the caching pool keeps freed buffers
  EXPECT_EQ(b.backend().test_controls()->live_allocations(), 0u);
}

TEST_F(OpenCLBridgeRect, PitchedCopiesFromAndIntoARegisteredRegion) {
  Bridge& b = *bridge_;
  std::vector<std::byte> memory(2 * (3 * 4099 + 64) + 3);
  const HostRegion region = b.register_host(std::span(memory).subspan(3));  // not aligned
  EXPECT_EQ(*b.backend().test_controls()->live_registrations(), 1u);
  EXPECT_EQ(b.backend().test_controls()->live_allocations(), 0u);
  const std::span<std::byte> bytes = b.region_bytes(region);
  for (const CopyMode mode : {CopyMode::Sync, CopyMode::Async}) {
    for (const Shape& s : kShapes) {
      SCOPED_TRACE(name_of(s) + (mode == CopyMode::Sync ? ", sync" : ", async"));
      const std::uint64_t span = host_span(s);
      if (2 * span > bytes.size()) continue;
      const RegionRange src{region, 0, span}, dst{region, bytes.size() - span, span};
      fill_rows(bytes.subspan(0, span), s);
      round_trip(
          s, mode, bytes.subspan(0, span),
          [&](DeviceRange rows, const CopyLayout& layout, CopyMode m) {
            return b.copy(HostCopy{CopyDirection::HostToDevice, src, rows, layout, m});
          },
          [&](DeviceRange rows, const CopyLayout& layout, CopyMode m) {
            return b.copy(HostCopy{CopyDirection::DeviceToHost, dst, rows, layout, m});
          },
          bytes.subspan(dst.offset, span));
    }
  }
  b.unregister_host(region);
  EXPECT_EQ(*b.backend().test_controls()->live_registrations(), 0u);

  // Regions still registered at a restart go back with the generation.
  const HostRegion again = b.register_host(memory);
  EXPECT_EQ(*b.backend().test_controls()->live_registrations(), 1u);
  b.restart(b.generation() + 1);
  EXPECT_EQ(*b.backend().test_controls()->live_registrations(), 0u);
  EXPECT_EQ(error_of([&] { b.region_bytes(again); }).kind(), ErrorKind::OldGenerationHandle);
}

TEST(OpenCLRegistrationControls, ABackendThatDoesNotCountThemSaysSo) {
  auto backend = make_backend("host");
  ASSERT_NE(backend->test_controls(), nullptr);
  EXPECT_FALSE(backend->test_controls()->live_registrations().has_value());
}

}  // namespace
}  // namespace devbridge::opencl
