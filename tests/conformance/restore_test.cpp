// A checkpoint's restore (checkpoint::RestoreStream) on every backend: many
// small tensors and large ones bit-exact, the CRC-32 checked as the bytes
// are read, tensors landing in file order while later reads wait, and every
// failure (a flipped bit, a file that shrank, a read that fails, an
// allocation that fails, a stop) named and leaving the caller's frees to
// give back everything.
#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "conformance_support.hpp"
#include "devbridge/checkpoint_file.hpp"
#include "devbridge/checkpoint_restore.hpp"

namespace devbridge::conformance {
namespace {

namespace ckpt = devbridge::checkpoint;

struct Tensor {
  std::string name;
  Bytes bytes;
};

// A devbridge-format file of `tensors` (uint8 vectors) with its CRC-32.
class CheckpointOnDisk {
 public:
  explicit CheckpointOnDisk(std::vector<Tensor> tensors,
                            const std::filesystem::path& directory = std::filesystem::temp_directory_path())
      : tensors_(std::move(tensors)) {
    path_ = (directory /
             ("devbridge-restore-" + std::to_string(::getpid()) + "-" + std::to_string(counter_++) + ".safetensors"))
                .string();
    ckpt::Crc32 crc;
    std::string header = "{";
    std::uint64_t at = 0;
    for (const auto& t : tensors_) {
      header += "\"" + t.name + "\":{\"dtype\":\"U8\",\"shape\":[" + std::to_string(t.bytes.size()) +
                "],\"data_offsets\":[" + std::to_string(at) + "," + std::to_string(at + t.bytes.size()) + "]},";
      at += t.bytes.size();
      crc.update(t.bytes.data(), t.bytes.size());
    }
    header += "\"__metadata__\":{\"format\":\"devbridge-checkpoint\",\"checksum\":\"" + crc.text() + "\"}}";
    std::ofstream out(path_, std::ios::binary);
    std::uint64_t length = header.size();
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((length >> (8 * i)) & 0xff));
    out << header;
    for (const auto& t : tensors_) out.write(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
  }
  ~CheckpointOnDisk() { std::filesystem::remove(path_); }

  const std::string& path() const { return path_; }
  const std::vector<Tensor>& tensors() const { return tensors_; }

  // Flips one bit of byte `at` of the data section.
  void flip(std::uint64_t at) const {
    const auto file = ckpt::CheckpointFile::open(path_);
    std::fstream io(path_, std::ios::binary | std::ios::in | std::ios::out);
    io.seekg(static_cast<std::streamoff>(file.header().data_start() + at));
    char byte = 0;
    io.get(byte);
    io.seekp(static_cast<std::streamoff>(file.header().data_start() + at));
    io.put(static_cast<char>(byte ^ 1));
  }

 private:
  static inline std::atomic<int> counter_{0};
  std::vector<Tensor> tensors_;
  std::string path_;
};

// The reader's reads that `holds` picks wait, from the first of them, until
// release(): the stream stopped at a known point while the test looks.
class HeldReads {
 public:
  explicit HeldReads(std::function<bool(std::uint64_t offset, std::uint64_t bytes)> holds)
      : holds_(std::move(holds)) {}
  ~HeldReads() { release(); }

  ckpt::RestoreOptions options() {
    ckpt::RestoreOptions options;
    options.before_read = [this](std::uint64_t offset, std::uint64_t bytes) {
      if (!holds_(offset, bytes)) return;
      std::unique_lock lock(mutex_);
      reached_ = true;
      changed_.notify_all();
      changed_.wait(lock, [&] { return released_; });
    };
    return options;
  }
  // Whether a held read was reached within a minute.
  bool reached() {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, std::chrono::seconds(60), [&] { return reached_; });
  }
  void release() {
    {
      std::lock_guard lock(mutex_);
      released_ = true;
    }
    changed_.notify_all();
  }

 private:
  std::function<bool(std::uint64_t, std::uint64_t)> holds_;
  std::mutex mutex_;
  std::condition_variable changed_;
  bool reached_ = false, released_ = false;
};

class RestoreConformance : public DriverTest {
 protected:
  // A ring whose default chunk (a quarter of it) is past the 4 MiB from which
  // a read goes in two halves, one on the helper thread: with a smaller ring
  // every read fits a chunk below that, and the split is never taken.
  static constexpr std::uint64_t kSplittingRing = 32ull << 20;

  Bytes random_bytes(std::size_t n) {
    Bytes out(n);
    for (auto& b : out) b = static_cast<std::byte>(random_());
    return out;
  }

  // Many small tensors, two large ones (each read alone, in two parts) between them, small ones after.
  std::vector<Tensor> model() {
    std::vector<Tensor> out;
    for (int i = 0; i < 300; ++i) out.push_back({"small." + std::to_string(i), random_bytes(1 + (i * 7919) % 20000)});
    out.push_back({"big.a", random_bytes((5 << 20) + 123)});
    out.push_back({"big.b", random_bytes(9 << 20)});
    for (int i = 0; i < 40; ++i) out.push_back({"tail." + std::to_string(i), random_bytes(64 + i)});
    return out;
  }

  // One target per tensor of the file's header.
  static std::vector<ckpt::RestoreTarget> targets_of(const ckpt::Header& header) {
    std::vector<ckpt::RestoreTarget> targets;
    for (const auto& entry : header.tensors) {
      const std::uint64_t extent = (entry.nbytes() + 255) / 256 * 256;
      targets.push_back({entry.name, entry.begin, entry.end, bytes_spec(extent, 256), extent});
    }
    return targets;
  }

  // Starts the restore of `file` into `b`: one target per tensor, every one checked against the CRC.
  std::unique_ptr<ckpt::RestoreStream> start(Bridge& b, const CheckpointOnDisk& file, ckpt::RestoreOptions options = {},
                                             bool verify = true) {
    auto opened = ckpt::CheckpointFile::open(file.path());
    auto targets = targets_of(opened.header());
    if (verify) options.expected_crc32 = opened.header().checksum;
    const auto start = opened.header().data_start();
    return ckpt::RestoreStream::start(b, opened.release(), start, std::move(targets), std::move(options),
                                      ckpt::quoted(file.path()));
  }

  // Every landed tensor's copies waited for, then its bytes compared with the file's.
  void expect_restored(Bridge& b, ckpt::RestoreStream& stream, const CheckpointOnDisk& file) {
    TransferPlanner planner(b);
    for (std::size_t i = 0; i < file.tensors().size(); ++i) {
      ASSERT_TRUE(stream.landed(i, std::chrono::seconds(0)));
      for (const PendingCopy& copy : stream.copies(i)) ASSERT_EQ(b.wait(copy.event).state, CopyState::Completed);
      Bytes back(file.tensors()[i].bytes.size());
      planner.download(stream.handles()[i], 0, back);
      ASSERT_TRUE(bytes_equal(back, file.tensors()[i].bytes, file.tensors()[i].name));
    }
  }

  // Each landed tensor's copies waited for (failed or not), then every allocation freed.
  // The stream reads to the end and checks out; every tensor bit-exact; then all freed, nothing left.
  void expect_whole_restore(Bridge& b, ckpt::RestoreStream& stream, const CheckpointOnDisk& file) {
    EXPECT_TRUE(stream.finished(std::chrono::seconds(60)));
    EXPECT_TRUE(stream.done());
    expect_restored(b, stream, file);
    free_all(b, stream);
    expect_nothing_left(b);
  }

  static void free_all(Bridge& b, ckpt::RestoreStream& stream) {
    for (std::size_t i = 0; i < stream.handles().size(); ++i) {
      bool landed = false;
      try {
        landed = stream.landed(i, std::chrono::seconds(0));
      } catch (const std::exception&) {  // the reading stopped before it
      }
      if (landed)
        for (const PendingCopy& copy : stream.copies(i)) b.wait(copy.event);
      b.free_device(stream.handles()[i]);
    }
  }

  static void expect_nothing_left(Bridge& b) {
    const auto stats = b.stats();
    EXPECT_EQ(stats.live_allocations, 0u);
    EXPECT_EQ(stats.ring_reservations, 0u);
    EXPECT_EQ(stats.copies_in_flight, 0u);
  }

  std::mt19937_64 random_{std::hash<std::string>{}(::testing::UnitTest::GetInstance()->current_test_info()->name())};
};

TEST_P(RestoreConformance, RestoreReadsManySmallAndLargeTensorsBitExactAndChecksTheCrc) {
  auto& b = make_bridge(8ull << 20);
  const CheckpointOnDisk file(model());
  auto stream = start(b, file);
  ASSERT_EQ(stream->handles().size(), file.tensors().size());
  expect_whole_restore(b, *stream, file);
}

TEST_P(RestoreConformance, RestoreRefusesAnIndexPastItsTensorsAndATargetThatEndsBeforeItBegins) {
  auto& b = make_bridge(8ull << 20);
  const CheckpointOnDisk file(model());
  auto stream = start(b, file);
  const auto count = file.tensors().size();
  EXPECT_TRUE(stream->finished(std::chrono::seconds(60)));
  const auto refused = [](const std::function<void()>& call, const std::string& words) {
    try {
      call();
      ADD_FAILURE() << "nothing was thrown; expected InvalidRange with \"" << words << "\"";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidRange) << e.what();
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  refused([&] { stream->landed(count, std::chrono::seconds(0)); },
          "landed(" + std::to_string(count) + "): the restore has " + std::to_string(count) + " tensors");
  refused([&] { stream->copies(count); }, "copies(" + std::to_string(count) + ")");
  free_all(b, *stream);
  auto opened = ckpt::CheckpointFile::open(file.path());
  auto targets = targets_of(opened.header());
  std::swap(targets[0].begin, targets[0].end);
  const auto data_start = opened.header().data_start();
  refused([&] { ckpt::RestoreStream::start(b, opened.release(), data_start, std::move(targets), {}, "'x'"); },
          "past their end");
  expect_nothing_left(b);
}

// The helper thread reads only what the page cache holds (preadv2 with
// RWF_NOWAIT). A file system that refuses the flag outright (tmpfs says
// EOPNOTSUPP) leaves every byte to the reading thread: still bit-exact, and a
// flipped bit in a large tensor's second half still found.
TEST_P(RestoreConformance, RestoreFromAFileSystemThatRefusesCachedOnlyReadsReadsEverything) {
  const std::filesystem::path shm = "/dev/shm";
  std::error_code ignored;
  if (!std::filesystem::is_directory(shm, ignored)) GTEST_SKIP() << "no /dev/shm (tmpfs) here";
  {
    const CheckpointOnDisk probe({{"x", Bytes(4096)}}, shm);
    const int fd = ::open(probe.path().c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    std::byte buffer[64];
    iovec iov{buffer, sizeof buffer};
    const bool refused = ::preadv2(fd, &iov, 1, 0, RWF_NOWAIT) < 0 && errno == EOPNOTSUPP;
    ::close(fd);
    if (!refused) GTEST_SKIP() << "/dev/shm takes RWF_NOWAIT on this kernel: the fallback is not reached";
  }
  auto& b = make_bridge(kSplittingRing);
  const CheckpointOnDisk file(model(), shm);
  auto stream = start(b, file);
  expect_whole_restore(b, *stream, file);

  std::uint64_t big_a_end = 0;  // big.a is read in two halves
  for (const auto& t : file.tensors()) {
    big_a_end += t.bytes.size();
    if (t.name == "big.a") break;
  }
  file.flip(big_a_end - 7);
  auto damaged = start(b, file);
  EXPECT_THROW(damaged->finished(std::chrono::seconds(60)), ckpt::CheckpointError);
  free_all(b, *damaged);
  expect_nothing_left(b);
}

TEST_P(RestoreConformance, RestoreFindsAFlippedBitAnywhereAndLeavesTheTensorsToTheCallersFree) {
  auto& b = make_bridge(kSplittingRing);
  const CheckpointOnDisk file(model());
  std::uint64_t big_a = 0;
  for (const auto& t : file.tensors()) {
    if (t.name == "big.a") break;
    big_a += t.bytes.size();
  }
  for (const std::uint64_t at : {std::uint64_t{17}, big_a + (3 << 20), big_a + (5 << 20) + 123 + (9 << 20) + 5}) {
    file.flip(at);
    auto stream = start(b, file);
    try {
      stream->finished(std::chrono::seconds(60));
      ADD_FAILURE() << "a flipped bit at byte " << at << " went unseen";
    } catch (const ckpt::CheckpointError& error) {
      EXPECT_NE(std::string(error.what()).find("is corrupt: the data's checksum is crc32:"), std::string::npos)
          << error.what();
    }
    free_all(b, *stream);
    expect_nothing_left(b);
    file.flip(at);
  }
  auto unverified = start(b, file, {}, false);  // the file is whole again
  expect_whole_restore(b, *unverified, file);
}

TEST_P(RestoreConformance, RestoreOfAFileThatShrankNamesTheTensorsAndTheBytes) {
  auto& b = make_bridge(8ull << 20);
  const CheckpointOnDisk file(model());
  auto stream = [&] {
    auto opened = ckpt::CheckpointFile::open(file.path());
    std::filesystem::resize_file(file.path(), std::filesystem::file_size(file.path()) - 1000);
    auto targets = targets_of(opened.header());
    const auto data_start = opened.header().data_start();
    return ckpt::RestoreStream::start(b, opened.release(), data_start, std::move(targets), {}, "'shrunk'");
  }();
  try {
    stream->finished(std::chrono::seconds(60));
    ADD_FAILURE() << "a file that ends early was read whole";
  } catch (const ckpt::CheckpointError& error) {
    const std::string what = error.what();
    EXPECT_NE(what.find("restore 'shrunk': tensor 'tail."), std::string::npos) << what;
    // The file as it is now (fstat), not one read's figures.
    EXPECT_NE(what.find("found the end of the file (it is now " +
                        std::to_string(std::filesystem::file_size(file.path())) + " bytes)"),
              std::string::npos)
        << what;
  }
  EXPECT_TRUE(stream->landed(0, std::chrono::seconds(0)));  // those before the end landed
  EXPECT_THROW(stream->landed(file.tensors().size() - 1, std::chrono::seconds(0)), ckpt::CheckpointError);
  free_all(b, *stream);
  expect_nothing_left(b);
}

// Reads are held at big.b: every tensor before it has landed (usable), none after.
TEST_P(RestoreConformance, RestoreTensorsLandInFileOrderWhileLaterReadsWait) {
  auto& b = make_bridge(8ull << 20);
  const CheckpointOnDisk file(model());
  std::uint64_t big_b = 0;
  std::size_t big_b_index = 0;
  for (const auto& t : file.tensors()) {
    if (t.name == "big.b") break;
    big_b += t.bytes.size();
    ++big_b_index;
  }
  const auto data_start = ckpt::CheckpointFile::open(file.path()).header().data_start();
  HeldReads held([&](std::uint64_t offset, std::uint64_t) { return offset >= data_start + big_b; });
  auto stream = start(b, file, held.options());
  ASSERT_TRUE(held.reached());
  EXPECT_TRUE(stream->landed(big_b_index - 1, std::chrono::seconds(0)));
  EXPECT_FALSE(stream->landed(big_b_index, std::chrono::milliseconds(20)));
  EXPECT_FALSE(stream->finished(std::chrono::milliseconds(0)));
  EXPECT_FALSE(stream->done());
  held.release();
  expect_whole_restore(b, *stream, file);
}

// A target let go before the reader reached it (release_when_landed) is
// written, then released by the reader; one already landed goes at once; one
// a stopped reading never reached goes when the reading ends. The others
// restore bit-exact.
TEST_P(RestoreConformance, RestoreReleasesTargetsLetGoBeforeTheyLandedOnceTheyHave) {
  auto& b = make_bridge(8ull << 20);
  const CheckpointOnDisk file(model());
  const std::size_t last = file.tensors().size() - 1;
  const std::uint64_t tail_offset = std::filesystem::file_size(file.path()) - 64;
  HeldReads held([&](std::uint64_t offset, std::uint64_t bytes) { return offset + bytes > tail_offset; });
  auto stream = start(b, file, held.options());
  ASSERT_TRUE(held.reached());
  ASSERT_FALSE(stream->landed(last, std::chrono::milliseconds(0)));
  ASSERT_TRUE(stream->landed(0, std::chrono::milliseconds(0)));
  const std::uint64_t all = b.stats().live_allocations;
  for (const PendingCopy& copy : stream->copies(0)) b.wait(copy.event);
  stream->release_when_landed(0);     // landed: at once
  stream->release_when_landed(last);  // not yet: once it lands
  EXPECT_EQ(b.stats().live_allocations, all - 1);
  EXPECT_THROW(stream->release_when_landed(last + 1), Error);
  held.release();
  EXPECT_TRUE(stream->finished(std::chrono::seconds(60)));
  TransferPlanner planner(b);
  for (std::size_t i = 1; i < last; ++i) {
    for (const PendingCopy& copy : stream->copies(i)) ASSERT_EQ(b.wait(copy.event).state, CopyState::Completed);
    Bytes back(file.tensors()[i].bytes.size());
    planner.download(stream->handles()[i], 0, back);
    ASSERT_TRUE(bytes_equal(back, file.tensors()[i].bytes, file.tensors()[i].name));
    b.free_device(stream->handles()[i]);
  }
  for (const PendingCopy& copy : stream->copies(last)) b.wait(copy.event);
  b.poll();
  expect_nothing_left(b);  // the last one went with its copies

  // A reading stopped before a target let go: released when it ends.
  HeldReads first_read([](std::uint64_t, std::uint64_t) { return true; });
  auto stopped = start(b, file, first_read.options());
  ASSERT_TRUE(first_read.reached());
  stopped->release_when_landed(last);
  stopped->request_stop();
  first_read.release();
  stopped->stop();
  EXPECT_EQ(b.stats().live_allocations, stopped->handles().size() - 1);
  for (std::size_t i = 0; i < last; ++i) {
    bool landed = false;
    try {
      landed = stopped->landed(i, std::chrono::seconds(0));
    } catch (const std::exception&) {  // the reading stopped before it
    }
    if (landed)
      for (const PendingCopy& copy : stopped->copies(i)) b.wait(copy.event);
    b.free_device(stopped->handles()[i]);
  }
  expect_nothing_left(b);
}

TEST_P(RestoreConformance, RestoreStopsBeforeItsNextReadAndAFailingReadEndsIt) {
  auto& b = make_bridge(8ull << 20);
  const CheckpointOnDisk file(model());
  std::atomic<int> reads{0};
  std::atomic<bool> go{false};
  ckpt::RestoreOptions held;
  held.before_read = [&](std::uint64_t, std::uint64_t) {
    if (reads++ == 1)
      while (!go) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  auto stream = start(b, file, std::move(held));
  while (reads < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::thread stopper([&] { stream->stop(); });
  std::thread second_stopper([&] { stream->stop(); });  // two at once: one joins, the other waits for it
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  go = true;  // the read in progress ends; the next sees the stop
  stopper.join();
  second_stopper.join();
  EXPECT_TRUE(stream->done());
  EXPECT_EQ(reads.load(), 2);
  EXPECT_THROW(stream->finished(std::chrono::seconds(0)), ckpt::CheckpointError);
  free_all(b, *stream);
  expect_nothing_left(b);

  ckpt::RestoreOptions failing;
  failing.before_read = [&](std::uint64_t, std::uint64_t) { throw std::runtime_error("the disk went away"); };
  auto failed = start(b, file, std::move(failing));
  EXPECT_THROW(failed->finished(std::chrono::seconds(60)), std::runtime_error);
  EXPECT_THROW(failed->landed(0, std::chrono::seconds(0)), std::runtime_error);
  free_all(b, *failed);
  expect_nothing_left(b);
}

TEST_P(RestoreConformance, RestoreOfTargetsThatCannotAllFitFreesThoseItMadeAndNamesTheTensor) {
  auto& b = make_bridge(8ull << 20);
  const CheckpointOnDisk file(model());
  auto opened = ckpt::CheckpointFile::open(file.path());
  auto targets = targets_of(opened.header());
  targets[200].extent = 1ull << 62;  // more than any device holds
  targets[200].spec.max_extent = 1ull << 62;
  const auto data_start = opened.header().data_start();
  try {
    ckpt::RestoreStream::start(b, opened.release(), data_start, std::move(targets), {}, "'f'");
    ADD_FAILURE() << "an allocation of 2^62 bytes succeeded";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("restore 'f': tensor 'small.200'"), std::string::npos) << error.what();
  }
  b.poll();
  expect_nothing_left(b);
}

INSTANTIATE_TEST_SUITE_P(Backends, RestoreConformance, ::testing::ValuesIn(backend_drivers()),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace devbridge::conformance
