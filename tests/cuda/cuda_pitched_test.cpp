// Pitched 2-D copies (cuMemcpy2DAsync) and registered host memory
// (cuMemHostRegister) in the CUDA backend, through the Backend directly and
// through a Bridge. Skipped with the probe's reason without a usable driver;
// run against the emulated driver by the emulated.* ctest entries. Tests that
// need an emulator hook (a copy failure, a smaller maximum pitch, the count
// of live registrations) skip on a real driver.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "backends/cuda/cuda_driver.hpp"
#include "cuda_test_support.hpp"
#include "devbridge/backends/cuda.hpp"
#include "devbridge/bridge.hpp"

namespace devbridge::cuda {
namespace {

using namespace std::chrono_literals;
using testing::AllocationHolder;
using testing::HostBlockHolder;
using testing::ScopedEnv;
using detail::CUDA_ERROR_INVALID_VALUE;
using detail::CUDA_SUCCESS;

// A staging import through the seam, and its release, as the tests below use them.
HostBlock register_host(Backend& backend, std::byte* data, std::uint64_t bytes) {
  return backend.import_host(ImportRequest{.use = ImportUse::Staging, .data = data, .bytes = bytes}).block;
}
void unregister_host(Backend& backend, const HostBlock& block) noexcept {
  backend.release_import(HostImport{.block = block});
}

constexpr std::byte kDevicePoison{0xA5};
constexpr std::byte kHostPoison{0x5A};

using RegistrationCount = unsigned long long (*)();
using FailCopy = void (*)(long long, int);

RegistrationCount registration_count() {
  return testing::emulator_hook<RegistrationCount>("devbridge_emulated_cuda_host_registrations");
}

// Where the driver counts them (the emulator does), host registrations now live.
void expect_live_registrations(unsigned long long expected) {
  if (RegistrationCount count = registration_count()) {
    EXPECT_EQ(count(), expected) << "live host registrations";
  }
}

// Never a poison byte, so a row that was not copied cannot pass for one that was.
void fill_random(std::byte* data, std::size_t bytes, std::uint64_t seed) {
  std::mt19937_64 generator(seed);
  for (std::size_t i = 0; i < bytes; ++i) {
    std::byte value;
    do {
      value = static_cast<std::byte>(generator() & 0xff);
    } while (value == kDevicePoison || value == kHostPoison);
    data[i] = value;
  }
}

std::string describe(const CopyLayout& layout) {
  return std::to_string(layout.rows) + " rows of " + std::to_string(layout.row_bytes) + " bytes, host pitch " +
         std::to_string(layout.host_pitch) + ", device pitch " + std::to_string(layout.device_pitch);
}

std::uint64_t span_of(const CopyLayout& layout, std::uint64_t pitch) {
  return (layout.rows - 1) * pitch + layout.row_bytes;
}

// Checks `pitched` (one side of a pitched copy, `pitch` apart, starting
// `offset` into it) against `packed` rows (`packed_pitch` apart): rows equal,
// every other byte of `pitched` still `poison`. Reports the first few
// differences only.
void expect_rows(const std::byte* pitched, std::uint64_t pitched_bytes, std::uint64_t offset, std::uint64_t pitch,
                 const std::byte* packed, std::uint64_t packed_pitch, const CopyLayout& layout, std::byte poison,
                 const std::string& what) {
  std::vector<bool> in_row(pitched_bytes, false);
  for (std::uint64_t row = 0; row < layout.rows; ++row) {
    const std::uint64_t at = offset + row * pitch;
    for (std::uint64_t i = 0; i < layout.row_bytes; ++i) in_row[at + i] = true;
    if (std::memcmp(pitched + at, packed + row * packed_pitch, layout.row_bytes) != 0) {
      ADD_FAILURE() << what << ": row " << row << " differs (" << describe(layout) << ")";
      return;
    }
  }
  int reported = 0;
  for (std::uint64_t i = 0; i < pitched_bytes; ++i) {
    if (in_row[i] || pitched[i] == poison) continue;
    ADD_FAILURE() << what << ": byte " << i << " outside the rows changed (" << describe(layout) << ", offset "
                  << offset << ")";
    if (++reported == 4) return;
  }
}

class CudaPitchedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const Probe found = probe();
    if (!found.available) GTEST_SKIP() << "no usable CUDA device: " << found.reason;
    backend_ = make_cuda_backend();
  }

  void TearDown() override {
    backend_.reset();
    // Every registration a test made is given back, whatever it did.
    expect_live_registrations(0);
  }

  static CopyRequest request(CopyDirection direction, CopyMode mode, std::uint64_t id, std::byte* host,
                             const DeviceAllocation& device, std::uint64_t offset, std::uint64_t len,
                             const CopyLayout& layout = {}) {
    return testing::copy_request(9, direction, mode, id, host, device, offset, len, layout);
  }

  static CopyRequest pitched(CopyDirection direction, CopyMode mode, std::uint64_t id, std::byte* host,
                             const DeviceAllocation& device, std::uint64_t offset, const CopyLayout& layout) {
    return request(direction, mode, id, host, device, offset, layout.rows * layout.row_bytes, layout);
  }

  // Waits for and drains completions until every event in `ids` has one.
  std::map<std::uint64_t, Completion> collect(const std::set<std::uint64_t>& ids) {
    std::map<std::uint64_t, Completion> seen;
    std::vector<Completion> drained;
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (seen.size() < ids.size() && std::chrono::steady_clock::now() < deadline) {
      backend_->wait_for_completions(100ms);
      drained.clear();
      backend_->drain_completions(drained);
      for (Completion& completion : drained) {
        EXPECT_TRUE(ids.count(completion.event.id)) << "unexpected completion " << completion.event.id;
        EXPECT_TRUE(seen.emplace(completion.event.id, completion).second)
            << "completion " << completion.event.id << " reported twice";
      }
    }
    EXPECT_EQ(seen.size(), ids.size()) << "completions missing after 60 s";
    return seen;
  }

  // Submits `r` and, when async, waits for its completion, which must be ok.
  void run(const CopyRequest& r) {
    backend_->submit_copy(r);
    if (r.mode == CopyMode::Sync) return;
    for (const auto& [id, completion] : collect({r.event.id})) EXPECT_TRUE(completion.ok) << completion.message;
  }

  std::unique_ptr<Backend> backend_;
  std::uint64_t next_id_ = 1;
};

// Odd widths and pitches, both modes: every row lands at its device pitch,
// and the device bytes between and around the rows keep their poison.
TEST_F(CudaPitchedTest, UploadWritesEveryRowAndNoPadding) {
  struct Case {
    std::uint64_t rows, row_bytes, host_pitch, device_pitch, device_offset;
  };
  const Case cases[] = {
      {1, 3, 3, 3, 0},           {5, 3, 4, 7, 1},      {9, 7, 7, 7, 0},         {9, 7, 13, 8, 5},
      {33, 7, 7, 64, 3},         {4, 4095, 4095, 4096, 0}, {3, 4095, 4103, 8191, 17}, {2, 1, 1, 2, 0},
      {257, 16, 31, 17, 4096},   {1, 4095, 1, 0, 9},  // one row: the pitches play no part
  };
  for (const CopyMode mode : {CopyMode::Sync, CopyMode::Async}) {
    for (const Case& c : cases) {
      const CopyLayout layout{c.rows, c.row_bytes, c.host_pitch, c.device_pitch};
      const std::uint64_t host_span = c.rows == 1 ? c.row_bytes : span_of(layout, c.host_pitch);
      const std::uint64_t device_span = c.rows == 1 ? c.row_bytes : span_of(layout, c.device_pitch);
      const std::uint64_t device_bytes = c.device_offset + device_span + 11;  // odd slack after the rows
      SCOPED_TRACE(describe(layout) + (mode == CopyMode::Sync ? ", sync" : ", async"));

      HostBlockHolder host{*backend_, backend_->allocate_host(host_span + 2 * device_bytes)};
      AllocationHolder device{*backend_, backend_->allocate(device_bytes, 256)};
      std::byte* source = host.block.data;
      std::byte* poison = source + host_span;
      std::byte* back = poison + device_bytes;
      fill_random(source, host_span, c.rows * 131 + c.row_bytes);
      std::memset(poison, static_cast<int>(kDevicePoison), device_bytes);
      run(request(CopyDirection::HostToDevice, CopyMode::Sync, next_id_++, poison, device.allocation, 0,
                  device_bytes));

      run(pitched(CopyDirection::HostToDevice, mode, next_id_++, source, device.allocation, c.device_offset, layout));

      std::memset(back, 0, device_bytes);
      run(request(CopyDirection::DeviceToHost, CopyMode::Sync, next_id_++, back, device.allocation, 0, device_bytes));
      expect_rows(back, device_bytes, c.device_offset, c.rows == 1 ? c.row_bytes : c.device_pitch, source,
                  c.rows == 1 ? c.row_bytes : c.host_pitch, layout, kDevicePoison, "device");
    }
  }
  std::vector<Completion> drained;
  backend_->drain_completions(drained);
  EXPECT_TRUE(drained.empty()) << "a sync copy reported a completion";
}

// The other way: rows land at their host pitch, and the host bytes between
// and around them are never written.
TEST_F(CudaPitchedTest, DownloadWritesEveryRowAndNoPadding) {
  struct Case {
    std::uint64_t rows, row_bytes, host_pitch, device_pitch, device_offset, host_offset;
  };
  const Case cases[] = {
      {1, 3, 3, 3, 0, 0},      {5, 3, 7, 4, 1, 3},   {9, 7, 7, 7, 0, 1},     {9, 7, 8, 13, 5, 0},
      {33, 7, 64, 7, 3, 7},    {4, 4095, 4096, 4095, 0, 0}, {3, 4095, 8191, 4103, 17, 5}, {2, 1, 2, 1, 0, 1},
      {257, 16, 17, 31, 4096, 2},
  };
  for (const CopyMode mode : {CopyMode::Sync, CopyMode::Async}) {
    for (const Case& c : cases) {
      const CopyLayout layout{c.rows, c.row_bytes, c.host_pitch, c.device_pitch};
      const std::uint64_t host_bytes = c.host_offset + span_of(layout, c.host_pitch) + 13;
      const std::uint64_t device_bytes = c.device_offset + span_of(layout, c.device_pitch);  // rows end at its end
      SCOPED_TRACE(describe(layout) + (mode == CopyMode::Sync ? ", sync" : ", async"));

      HostBlockHolder host{*backend_, backend_->allocate_host(device_bytes + host_bytes)};
      AllocationHolder device{*backend_, backend_->allocate(device_bytes, 256)};
      std::byte* contents = host.block.data;
      std::byte* destination = contents + device_bytes;
      fill_random(contents, device_bytes, c.rows * 71 + c.row_bytes);
      run(request(CopyDirection::HostToDevice, CopyMode::Sync, next_id_++, contents, device.allocation, 0,
                  device_bytes));
      std::memset(destination, static_cast<int>(kHostPoison), host_bytes);

      run(pitched(CopyDirection::DeviceToHost, mode, next_id_++, destination + c.host_offset, device.allocation,
                  c.device_offset, layout));

      expect_rows(destination, host_bytes, c.host_offset, c.host_pitch, contents + c.device_offset, c.device_pitch,
                  layout, kHostPoison, "host");
    }
  }
}

// A device span past the allocation (by one byte, or with an offset that
// wraps), rows that would overlap, and a length that is not rows x width
// are all refused before anything is queued; the backend is fine after.
TEST_F(CudaPitchedTest, OutOfRangeLayoutsAreInvalidRange) {
  constexpr std::uint64_t kBytes = 4096;
  HostBlockHolder host{*backend_, backend_->allocate_host(2 * kBytes)};
  AllocationHolder device{*backend_, backend_->allocate(kBytes, 256)};
  fill_random(host.block.data, 2 * kBytes, 5);

  const CopyLayout fits{4, 100, 100, 1332};  // reaches 3 * 1332 + 100 = 4096: exactly the allocation
  run(pitched(CopyDirection::HostToDevice, CopyMode::Sync, next_id_++, host.block.data, device.allocation, 0, fits));

  struct Bad {
    CopyRequest request;
    std::string names;  // what the message must name
  };
  const std::vector<Bad> bad = {
      {pitched(CopyDirection::HostToDevice, CopyMode::Async, 1001, host.block.data, device.allocation, 1, fits),
       "device range [1, +4096)"},
      {pitched(CopyDirection::DeviceToHost, CopyMode::Sync, 1002, host.block.data, device.allocation, 0,
               CopyLayout{4, 100, 100, 1333}),
       "device range [0, +4099)"},
      {pitched(CopyDirection::HostToDevice, CopyMode::Sync, 1003, host.block.data, device.allocation,
               ~std::uint64_t{0} - 10, CopyLayout{2, 8, 8, 16}),
       "outside allocation"},
      {pitched(CopyDirection::DeviceToHost, CopyMode::Async, 1004, host.block.data, device.allocation, 0,
               CopyLayout{3, 64, 63, 64}),
       "host pitch of 63 bytes is shorter than a row of 64"},
      {pitched(CopyDirection::HostToDevice, CopyMode::Async, 1005, host.block.data, device.allocation, 0,
               CopyLayout{3, 64, 64, 10}),
       "device pitch of 10 bytes is shorter than a row of 64"},
      {pitched(CopyDirection::HostToDevice, CopyMode::Async, 1006, host.block.data, device.allocation, 0,
               CopyLayout{2, 8, ~std::uint64_t{0}, 8}),
       "past 2^64"},
      {request(CopyDirection::HostToDevice, CopyMode::Async, 1007, host.block.data, device.allocation, 0, 100,
               CopyLayout{2, 8, 8, 8}),
       "100 bytes asked"},
  };
  for (const Bad& b : bad) {
    try {
      backend_->submit_copy(b.request);
      ADD_FAILURE() << "accepted: " << describe(b.request.layout) << " at device offset " << b.request.device_offset;
    } catch (const Error& error) {
      EXPECT_EQ(error.kind(), ErrorKind::InvalidRange) << error.what();
      EXPECT_FALSE(error.fatal());
      EXPECT_NE(std::string(error.message()).find(b.names), std::string::npos) << error.what();
    }
  }
  std::vector<Completion> drained;
  backend_->drain_completions(drained);
  EXPECT_TRUE(drained.empty()) << "a refused copy reported a completion";

  // Still healthy: the fitting layout round-trips.
  std::memset(host.block.data + kBytes, 0, kBytes);
  run(pitched(CopyDirection::DeviceToHost, CopyMode::Async, next_id_++, host.block.data + kBytes, device.allocation,
              0, fits));
  for (std::uint64_t row = 0; row < fits.rows; ++row)
    EXPECT_EQ(std::memcmp(host.block.data + kBytes + row * 100, host.block.data + row * 100, 100), 0) << row;
}

// Rows of zero bytes move nothing, yet still complete in order.
TEST_F(CudaPitchedTest, EmptyRowsCompleteWithoutMovingBytes) {
  HostBlockHolder host{*backend_, backend_->allocate_host(4096)};
  AllocationHolder device{*backend_, backend_->allocate(4096, 256)};
  backend_->submit_copy(
      pitched(CopyDirection::HostToDevice, CopyMode::Async, 77, host.block.data, device.allocation, 0,
              CopyLayout{3, 0, 16, 16}));
  for (const auto& [id, completion] : collect({77})) EXPECT_TRUE(completion.ok) << completion.message;
}

// The ordering bookkeeping covers a pitched copy's whole reach: a later copy
// of the other direction that touches only its last row (past rows x width
// from its start) still waits for it, on the device and on the host side.
TEST_F(CudaPitchedTest, OrderingCoversTheWholeSpanOfAPitchedCopy) {
  constexpr std::uint64_t kRows = 20000;
  constexpr std::uint64_t kWidth = 64;
  constexpr std::uint64_t kPitch = 4 * kWidth;
  const CopyLayout layout{kRows, kWidth, kPitch, kPitch};
  const std::uint64_t span = span_of(layout, kPitch);
  const std::uint64_t last_row = (kRows - 1) * kPitch;
  HostBlockHolder host{*backend_, backend_->allocate_host(2 * span + 2 * kWidth)};
  AllocationHolder device{*backend_, backend_->allocate(span, 256)};
  std::byte* rows = host.block.data;
  std::byte* out = rows + span;
  std::byte* in = out + span;

  // Device side: upload every row, then download only the last one.
  for (int round = 0; round < 3; ++round) {
    fill_random(rows, span, 40 + round);
    std::memset(in, 0, kWidth);
    backend_->test_controls()->hold_copies(true);  // both submitted before either runs
    backend_->submit_copy(
        pitched(CopyDirection::HostToDevice, CopyMode::Async, 1, rows, device.allocation, 0, layout));
    backend_->submit_copy(request(CopyDirection::DeviceToHost, CopyMode::Async, 2, in, device.allocation, last_row,
                                  kWidth));
    backend_->test_controls()->hold_copies(false);
    for (const auto& [id, completion] : collect({1, 2})) EXPECT_TRUE(completion.ok) << completion.message;
    ASSERT_EQ(std::memcmp(in, rows + last_row, kWidth), 0)
        << "the download of the last row did not wait for the pitched upload (round " << round << ")";
  }

  // Host side: download every row into `out`, then upload only the last one
  // from there; the upload must read what the download wrote.
  AllocationHolder scratch{*backend_, backend_->allocate(kWidth, 256)};
  for (int round = 0; round < 3; ++round) {
    fill_random(rows, span, 50 + round);
    run(request(CopyDirection::HostToDevice, CopyMode::Sync, 3, rows, device.allocation, 0, span));
    std::memset(out, 0, span);
    backend_->test_controls()->hold_copies(true);
    backend_->submit_copy(
        pitched(CopyDirection::DeviceToHost, CopyMode::Async, 4, out, device.allocation, 0, layout));
    backend_->submit_copy(request(CopyDirection::HostToDevice, CopyMode::Async, 5, out + last_row,
                                  scratch.allocation, 0, kWidth));
    backend_->test_controls()->hold_copies(false);
    for (const auto& [id, completion] : collect({4, 5})) EXPECT_TRUE(completion.ok) << completion.message;
    run(request(CopyDirection::DeviceToHost, CopyMode::Sync, 6, in, scratch.allocation, 0, kWidth));
    ASSERT_EQ(std::memcmp(in, rows + last_row, kWidth), 0)
        << "the upload of the last row did not wait for the pitched download (round " << round << ")";
  }
}

// A pitched copy held back stays pending like any other, and quiesce()
// finishes it.
TEST_F(CudaPitchedTest, HeldPitchedCopyStaysPendingUntilQuiesce) {
  const CopyLayout layout{16, 100, 128, 112};
  HostBlockHolder host{*backend_, backend_->allocate_host(2 * 4096)};
  AllocationHolder device{*backend_, backend_->allocate(4096, 256)};
  fill_random(host.block.data, 4096, 8);
  backend_->test_controls()->hold_copies(true);
  backend_->submit_copy(
      pitched(CopyDirection::HostToDevice, CopyMode::Async, 31, host.block.data, device.allocation, 0, layout));
  EXPECT_FALSE(backend_->wait_for_completions(20ms)) << "a held pitched copy completed";
  backend_->quiesce();
  std::vector<Completion> drained;
  backend_->drain_completions(drained);
  ASSERT_EQ(drained.size(), 1u);
  EXPECT_TRUE(drained[0].ok) << drained[0].message;
  std::memset(host.block.data + 4096, 0, 4096);
  run(pitched(CopyDirection::DeviceToHost, CopyMode::Sync, 32, host.block.data + 4096, device.allocation, 0, layout));
  for (std::uint64_t row = 0; row < layout.rows; ++row)
    EXPECT_EQ(std::memcmp(host.block.data + 4096 + row * 128, host.block.data + row * 128, 100), 0) << row;
}

// The driver's refusal of a submission is the copy's direction's kind, names
// the layout, and leaves no event or pending copy behind (emulator only).
TEST_F(CudaPitchedTest, RefusedSubmissionNamesTheLayout) {
  auto fail_copy = testing::emulator_hook<FailCopy>("devbridge_emulated_cuda_fail_copy");
  if (fail_copy == nullptr) GTEST_SKIP() << "needs the emulated driver's copy failure hook";
  const CopyLayout layout{4, 10, 16, 12};
  HostBlockHolder host{*backend_, backend_->allocate_host(4096)};
  AllocationHolder device{*backend_, backend_->allocate(4096, 256)};
  for (const auto& [direction, kind] : {std::pair{CopyDirection::HostToDevice, ErrorKind::DeviceCopyFailed},
                                       std::pair{CopyDirection::DeviceToHost, ErrorKind::OutputCopyFailed}}) {
    for (const CopyMode mode : {CopyMode::Sync, CopyMode::Async}) {
      fail_copy(0, CUDA_ERROR_INVALID_VALUE);
      try {
        backend_->submit_copy(pitched(direction, mode, 41, host.block.data, device.allocation, 8, layout));
        ADD_FAILURE() << "the injected failure was not reported";
      } catch (const Error& error) {
        EXPECT_EQ(error.kind(), kind) << error.what();
        EXPECT_FALSE(error.fatal());
        const std::string message(error.message());
        EXPECT_NE(message.find("cuMemcpy2DAsync"), std::string::npos) << message;
        EXPECT_NE(message.find("CUDA_ERROR_INVALID_VALUE"), std::string::npos) << message;
        EXPECT_NE(message.find("4 rows of 10 bytes (host pitch 16, device pitch 12)"), std::string::npos) << message;
      }
    }
  }
  fail_copy(-1, CUDA_SUCCESS);
  EXPECT_FALSE(backend_->wait_for_completions(1ms)) << "a refused copy left something pending";
  run(pitched(CopyDirection::HostToDevice, CopyMode::Async, 42, host.block.data, device.allocation, 8, layout));
}

// A pitch above CU_DEVICE_ATTRIBUTE_MAX_PITCH is refused before the driver
// sees it, naming the pitch and the limit (the emulator's limit is made
// small; a real GPU's is 2^31 - 1).
TEST_F(CudaPitchedTest, PitchAboveTheDeviceMaximumIsRefused) {
  if (registration_count() == nullptr) GTEST_SKIP() << "needs the emulated driver (its maximum pitch is settable)";
  ScopedEnv small_pitch("DEVBRIDGE_EMULATED_CUDA_MAX_PITCH", "1024");
  auto backend = make_cuda_backend();
  HostBlockHolder host{*backend, backend->allocate_host(8192)};
  AllocationHolder device{*backend, backend->allocate(8192, 256)};
  backend->submit_copy(pitched(CopyDirection::HostToDevice, CopyMode::Sync, 51, host.block.data, device.allocation,
                               0, CopyLayout{2, 64, 1024, 1024}));
  for (const CopyLayout& layout : {CopyLayout{2, 64, 1025, 64}, CopyLayout{2, 64, 64, 2048}}) {
    try {
      backend->submit_copy(
          pitched(CopyDirection::DeviceToHost, CopyMode::Sync, 52, host.block.data, device.allocation, 0, layout));
      ADD_FAILURE() << "accepted " << describe(layout);
    } catch (const Error& error) {
      EXPECT_EQ(error.kind(), ErrorKind::InvalidRange) << error.what();
      EXPECT_NE(std::string(error.message()).find("maximum of 1024"), std::string::npos) << error.what();
    }
  }
}

// ---- registered host memory ----------------------------------------------

// Pageable memory of the test's own, page-aligned so ranges inside it can
// be registered piecewise.
struct PageableBuffer {
  explicit PageableBuffer(std::size_t bytes)
      : data(static_cast<std::byte*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096))), size(bytes) {}
  ~PageableBuffer() { std::free(data); }
  PageableBuffer(const PageableBuffer&) = delete;
  PageableBuffer& operator=(const PageableBuffer&) = delete;
  std::byte* data;
  std::size_t size;
};

struct RegistrationHolder {
  Backend& backend;
  HostBlock block;
  ~RegistrationHolder() { unregister_host(backend, block); }
};

TEST_F(CudaPitchedTest, RegisteredMemoryCarriesCopiesBothWays) {
  constexpr std::size_t kBytes = 3 * 4096 + 123;
  PageableBuffer buffer(kBytes);
  fill_random(buffer.data, kBytes, 60);
  {
    RegistrationHolder registered{*backend_, register_host(*backend_, buffer.data, kBytes)};
    EXPECT_EQ(registered.block.data, buffer.data);
    EXPECT_EQ(registered.block.bytes, kBytes);
    EXPECT_TRUE(registered.block.page_locked);
    expect_live_registrations(1);

    AllocationHolder device{*backend_, backend_->allocate(kBytes, 256)};
    run(request(CopyDirection::HostToDevice, CopyMode::Async, 61, buffer.data, device.allocation, 0, kBytes));
    // Back into the registered memory, pitched: the rows land, the rest of
    // the registered bytes stay as they were.
    std::vector<std::byte> before(buffer.data, buffer.data + kBytes);
    std::memset(buffer.data, static_cast<int>(kHostPoison), kBytes);
    const CopyLayout layout{9, 333, 1000, 1200};
    run(pitched(CopyDirection::DeviceToHost, CopyMode::Sync, 62, buffer.data + 7, device.allocation, 5, layout));
    expect_rows(buffer.data, kBytes, 7, layout.host_pitch, before.data() + 5, layout.device_pitch, layout,
                kHostPoison, "registered host");
  }
  expect_live_registrations(0);
}

TEST_F(CudaPitchedTest, OverlappingRegistrationIsInvalidRangeNamingTheRange) {
  PageableBuffer buffer(4 * 4096);
  RegistrationHolder first{*backend_, register_host(*backend_, buffer.data, 2 * 4096)};
  struct Attempt {
    std::byte* data;
    std::uint64_t bytes;
  };
  for (const Attempt attempt : {Attempt{buffer.data, 2 * 4096},             // the same range again
                                Attempt{buffer.data + 4096, 2 * 4096},      // its second half and beyond
                                Attempt{buffer.data + 100, 10}}) {          // strictly inside
    try {
      RegistrationHolder again{*backend_, register_host(*backend_, attempt.data, attempt.bytes)};
      ADD_FAILURE() << "registered " << attempt.bytes << " bytes overlapping a registration";
    } catch (const Error& error) {
      EXPECT_EQ(error.kind(), ErrorKind::InvalidRange) << error.what();
      EXPECT_FALSE(error.fatal());
      const std::string message(error.message());
      EXPECT_NE(message.find("CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"), std::string::npos) << message;
      char address[32];
      std::snprintf(address, sizeof address, "0x%llx",
                    static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(attempt.data)));
      EXPECT_NE(message.find(address), std::string::npos) << message;
      EXPECT_NE(message.find(std::to_string(attempt.bytes) + " bytes"), std::string::npos) << message;
    }
  }
  // The ring is page-locked already.
  HostBlockHolder ring{*backend_, backend_->allocate_host(4096)};
  EXPECT_THROW(unregister_host(*backend_, register_host(*backend_, ring.block.data, 4096)), Error);
  // Right beside it is fine.
  RegistrationHolder beside{*backend_, register_host(*backend_, buffer.data + 2 * 4096, 4096)};
  expect_live_registrations(2);
}

TEST_F(CudaPitchedTest, RegistrationRefusesNothingToRegister) {
  PageableBuffer buffer(4096);
  try {
    (void)register_host(*backend_, buffer.data, 0);
    ADD_FAILURE() << "registered 0 bytes";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::InvalidExtent) << error.what();
  }
  try {
    (void)register_host(*backend_, nullptr, 4096);
    ADD_FAILURE() << "registered a null pointer";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::InvalidRange) << error.what();
  }
}

// Unregistering what was never registered (or twice) is logged, never thrown.
TEST_F(CudaPitchedTest, UnregisteringUnknownMemoryIsNotThrown) {
  PageableBuffer buffer(4096);
  const HostBlock block = register_host(*backend_, buffer.data, 4096);
  unregister_host(*backend_, block);
  EXPECT_NO_THROW(unregister_host(*backend_, block));
  EXPECT_NO_THROW(unregister_host(*backend_, HostBlock{buffer.data + 64, 64, true, 0}));
  EXPECT_NO_THROW(unregister_host(*backend_, HostBlock{}));
  expect_live_registrations(0);
}

// ---- through a Bridge ------------------------------------------------------

TEST_F(CudaPitchedTest, BridgePitchedCopiesThroughTheRingAndARegisteredRegion) {
  Bridge bridge(make_cuda_backend(), BridgeOptions{1, 1 << 20, 0});
  constexpr std::uint64_t kRows = 37;
  constexpr std::uint64_t kWidth = 4095;
  constexpr std::uint64_t kHostPitch = 4099;
  constexpr std::uint64_t kDevicePitch = 4111;
  const CopyLayout layout{kRows, kWidth, kHostPitch, kDevicePitch};
  const std::uint64_t host_span = span_of(layout, kHostPitch);
  const std::uint64_t device_span = span_of(layout, kDevicePitch);
  const std::uint64_t extent = (device_span + 255) / 256 * 256;  // a multiple of the spec's alignment
  const ObjectSpec spec{extent, 256, DType::UInt8, ShapeKind::Tensor};
  const DeviceHandle handle = bridge.alloc_device(spec, extent);

  // Poison the whole allocation through the ring, then upload the rows.
  const HostRange staging = bridge.reserve(extent);
  std::memset(bridge.host_bytes(staging).data(), static_cast<int>(kDevicePoison), extent);
  (void)bridge.host_to_device(staging, DeviceRange{handle, 0, extent}, CopyMode::Sync);
  const HostRange rows = bridge.reserve(host_span);
  fill_random(bridge.host_bytes(rows).data(), host_span, 70);
  const CopyEvent up =
      bridge.copy(HostCopy{CopyDirection::HostToDevice, rows, DeviceRange{handle, 0, device_span}, layout, CopyMode::Async});
  EXPECT_EQ(bridge.wait(up, 30s).state, CopyState::Completed);
  (void)bridge.device_to_host(DeviceRange{handle, 0, extent}, staging, CopyMode::Sync);
  expect_rows(bridge.host_bytes(staging).data(), extent, 0, kDevicePitch, bridge.host_bytes(rows).data(),
              kHostPitch, layout, kDevicePoison, "bridge upload");

  // Down into a registered region, sync: only the rows change.
  PageableBuffer buffer(host_span + 100);
  std::memset(buffer.data, static_cast<int>(kHostPoison), buffer.size);
  const HostRegion region = bridge.register_host(std::span<std::byte>(buffer.data, buffer.size));
  expect_live_registrations(1);
  (void)bridge.copy(HostCopy{CopyDirection::DeviceToHost, RegionRange{region, 50, host_span},
                             DeviceRange{handle, 0, device_span}, layout, CopyMode::Sync});
  expect_rows(buffer.data, buffer.size, 50, kHostPitch, bridge.host_bytes(rows).data(), kHostPitch, layout,
              kHostPoison, "bridge download into a region");

  // A layout that reaches past the device range is refused.
  try {
    (void)bridge.copy(HostCopy{CopyDirection::HostToDevice, rows, DeviceRange{handle, 0, device_span - 1}, layout,
                               CopyMode::Sync});
    ADD_FAILURE() << "a layout past its device range was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::InvalidRange) << error.what();
  }

  bridge.unregister_host(region);
  expect_live_registrations(0);
  bridge.release_host(rows);
  bridge.release_host(staging);
}

// Regions left registered are given back by a restart (and the backend's
// count of them by its teardown).
TEST_F(CudaPitchedTest, BridgeRestartUnregistersEveryRegion) {
  Bridge bridge(make_cuda_backend(), BridgeOptions{1, 1 << 20, 0});
  PageableBuffer a(8192);
  PageableBuffer b(4096);
  (void)bridge.register_host(std::span<std::byte>(a.data, a.size));
  (void)bridge.register_host(std::span<std::byte>(b.data, b.size));
  expect_live_registrations(2);
  bridge.restart(2);
  expect_live_registrations(0);
}

}  // namespace
}  // namespace devbridge::cuda
