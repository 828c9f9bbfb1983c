#include "devbridge/checkpoint_restore.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "devbridge/checked.hpp"
#include "devbridge/checkpoint_file.hpp"

namespace devbridge::checkpoint {
namespace {

// Tensors next to each other in the file go as one batch up to this many
// bytes and tensors (fewer, larger reads, with less waiting between them).
// A batch lands as a whole, so a tensor of kAloneBytes or more goes alone:
// restore(wait=False)'s small tensors land before a large one behind them.
constexpr std::uint64_t kBatchBytes = 32ull << 20;
constexpr std::size_t kBatchTensors = 4096;
constexpr std::uint64_t kAloneBytes = 4ull << 20;
// A fill of this many bytes or more is read in two parts on two threads.
constexpr std::uint64_t kParallelBytes = 4ull << 20;
// A part is read and hashed this much at a time (the hash reads what the
// read just wrote while the CPU's cache holds it).
constexpr std::uint64_t kHashStep = 1ull << 20;
// The kernel is asked to read this far ahead of the bytes read (a cold
// file's disk works while a batch is hashed and copied).
constexpr std::uint64_t kReadAhead = 256ull << 20;
// preadv's limit on pieces per call (IOV_MAX on Linux).
constexpr std::size_t kMaxPieces = 1024;

// What `body` throws, with "restore <file>: <which>: " (`context()`, made
// only then) in front, kind kept.
template <class Context, class Body>
auto naming(Context&& context, Body&& body) {
  try {
    return body();
  } catch (const Error& error) {
    throw Error(error.kind(), context() + ": " + std::string(error.message()), error.fatal());
  } catch (const CheckpointError& error) {
    throw CheckpointError(context() + ": " + error.what(), error.os_error());
  }
}

// Bytes [first, last) of the run `pieces` make, as pieces.
std::vector<std::span<std::byte>> cut(std::span<const std::span<std::byte>> pieces, std::uint64_t first,
                                      std::uint64_t last) {
  std::vector<std::span<std::byte>> out;
  std::uint64_t at = 0;
  for (const auto& piece : pieces) {
    const std::uint64_t end = at + piece.size();
    if (end > first && at < last) {
      const auto from = std::max(first, at) - at;
      out.push_back(piece.subspan(from, std::min(last, end) - at - from));
    }
    at = end;
    if (at >= last) break;
  }
  return out;
}

// What read_run read: its first `bytes` bytes, and their CRC-32.
struct Read {
  std::uint64_t bytes = 0;
  std::uint32_t crc = 0;
};

// The CRC-32 of a run read a step at a time: each step hashed on `thread`
// while the next is read, or on the caller's thread where none is given. The
// step being hashed reads the pieces: it ends before the next starts, before
// value(), and before this goes (an exception leaving the read included).
class StepCrc {
 public:
  explicit StepCrc(detail::SideThread* thread) : thread_(thread) {}
  ~StepCrc() { settle(); }
  StepCrc(const StepCrc&) = delete;
  StepCrc& operator=(const StepCrc&) = delete;

  void add(std::vector<std::span<std::byte>> step) {
    settle();
    hashing_ = std::move(step);
    const auto hash = [this] {
      for (const auto& piece : hashing_) value_.update(piece.data(), piece.size());
    };
    if (thread_)
      thread_->start(hash);
    else
      hash();
  }
  std::uint32_t value() {
    settle();
    return value_.value();
  }

 private:
  void settle() noexcept {
    if (thread_) (void)thread_->finish();  // the hash cannot throw
  }
  detail::SideThread* thread_;
  Crc32 value_;
  std::vector<std::span<std::byte>> hashing_;
};

// Fills `pieces` from byte `at` of `fd` on, in order, kHashStep at a time,
// each step CRC-32'd right after it is read when `crc`: on `hasher` while the
// next step is read, when one is given (a cold file's reads wait on the disk,
// and the hash, on the reader's thread, held up the next read: a cold restore
// with checksums ran at 0.86-0.90x the raw read, without them 0.97x), else on
// this thread. `cached_only`: reads
// only what the page cache holds (RWF_NOWAIT) and stops at the first byte it
// does not, so that a second thread never sends the disk a second stream of
// requests (on this VM's disk a cold file read in two interleaved halves
// took 320 ms against 210-230 in one sequence); the caller reads the rest.
Read read_run(int fd, std::span<const std::span<std::byte>> pieces, std::uint64_t at, bool crc, const std::string& where,
              detail::SideThread* hasher, bool cached_only = false) {
  std::uint64_t total = 0;
  for (const auto& piece : pieces) total += piece.size();
  StepCrc value(hasher);
  std::vector<iovec> iov;
  std::uint64_t done = 0;
  for (std::uint64_t first = 0; first < total; first += kHashStep) {
    const auto step = cut(pieces, first, std::min(first + kHashStep, total));
    std::size_t next = 0;       // the first piece not read whole
    std::uint64_t into = 0;     // bytes of it read
    bool stopped = false;
    while (next < step.size()) {
      iov.clear();
      for (std::size_t i = next; i < step.size() && iov.size() < kMaxPieces; ++i) {
        const auto skip = i == next ? into : 0;
        iov.push_back(iovec{step[i].data() + skip, step[i].size() - skip});
      }
      const ssize_t got = ::preadv2(fd, iov.data(), static_cast<int>(iov.size()), static_cast<off_t>(at + done),
                                    cached_only ? RWF_NOWAIT : 0);
      if (got < 0) {
        if (errno == EINTR) continue;
        if (cached_only) {  // EAGAIN: not cached; EOPNOTSUPP and the rest: the caller reads it as usual
          stopped = true;
          break;
        }
        const int os_error = errno;
        throw CheckpointError(fmt::format("reading {} failed at byte {}: {}", where, at + done, std::strerror(os_error)),
                              os_error);
      }
      if (got == 0) {
        if (cached_only) {
          stopped = true;
          break;
        }
        // The figures of this read alone (one half of a large one, perhaps)
        // would not describe the file: its size now comes from fstat.
        struct stat st {};
        const std::string now = ::fstat(fd, &st) == 0 ? fmt::format("it is now {} bytes", st.st_size)
                                                       : fmt::format("its size now cannot be read: {}", std::strerror(errno));
        throw CheckpointError(fmt::format("{} shrank since its header was checked: a read of {} bytes at byte {} "
                                          "found the end of the file ({})",
                                          where, total - done, at + done, now));
      }
      done += static_cast<std::uint64_t>(got);
      auto left = static_cast<std::uint64_t>(got);
      while (next < step.size() && left >= step[next].size() - into) {
        left -= step[next].size() - into;
        into = 0;
        ++next;
      }
      into += left;
    }
    if (crc) value.add(cut(step, 0, done - first));
    if (stopped) break;
  }
  return Read{done, value.value()};
}

}  // namespace

// ---- the second reading thread ----

detail::SideThread::~SideThread() {
  {
    std::lock_guard lock(mutex_);
    quitting_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void detail::SideThread::start(std::function<void()> task) {
  {
    std::lock_guard lock(mutex_);
    task_ = std::move(task);
    failed_ = nullptr;
    busy_ = true;
  }
  if (!thread_.joinable()) thread_ = std::thread([this] { serve(); });
  changed_.notify_all();
}

std::exception_ptr detail::SideThread::finish() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return !busy_; });
  return std::exchange(failed_, nullptr);
}

void detail::SideThread::serve() {
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return busy_ || quitting_; });
    if (busy_) {
      auto task = std::move(task_);
      lock.unlock();
      std::exception_ptr failed;
      try {
        task();
      } catch (...) {
        failed = std::current_exception();
      }
      lock.lock();
      failed_ = failed;
      busy_ = false;
      changed_.notify_all();
      continue;
    }
    return;  // quitting, nothing to do
  }
}

std::unique_ptr<RestoreStream> RestoreStream::start(Bridge& bridge, int fd, std::uint64_t data_start,
                                                    std::vector<RestoreTarget> targets, RestoreOptions options,
                                                    std::string where) {
  std::unique_ptr<RestoreStream> stream(
      new RestoreStream(bridge, fd, data_start, std::move(targets), std::move(options), std::move(where)));
  stream->reader_ = std::thread([raw = stream.get()] { raw->run(); });
  return stream;
}

RestoreStream::RestoreStream(Bridge& bridge, int fd, std::uint64_t data_start, std::vector<RestoreTarget> targets,
                             RestoreOptions options, std::string where)
    : bridge_(bridge),
      fd_(fd),
      data_start_(data_start),
      targets_(std::move(targets)),
      options_(std::move(options)),
      where_(std::move(where)),
      copies_(targets_.size()),
      release_on_landing_(targets_.size(), false) {
  handles_.reserve(targets_.size());
  try {
    for (const auto& target : targets_)
      if (target.begin > target.end)
        throw Error(ErrorKind::InvalidRange,
                    fmt::format("restore {}: tensor {}: its bytes begin at {}, past their end at {}", where_,
                                checkpoint::quoted(target.name), target.begin, target.end));
    for (const auto& target : targets_)
      handles_.push_back(naming([&] { return fmt::format("restore {}: tensor {}", where_, checkpoint::quoted(target.name)); },
                                [&] { return bridge_.alloc_device(target.spec, target.extent); }));
  } catch (...) {
    for (const auto& handle : handles_) {
      try {
        bridge_.free_device(handle);  // nothing was read into them
      } catch (...) {                 // a closed bridge freed them already
      }
    }
    ::close(fd_);
    throw;
  }
}

RestoreStream::~RestoreStream() {
  stop();
  if (fd_ >= 0) ::close(fd_);  // a reader that never ran
}

void RestoreStream::request_stop() {
  std::lock_guard lock(mutex_);
  stopping_ = true;
}

void RestoreStream::stop() {
  request_stop();
  // Once, whoever comes first (two callers at once, an abandon() and the
  // destructor); the others wait for that join to end.
  if (reader_.get_id() != std::this_thread::get_id())
    std::call_once(joined_, [&] {
      if (reader_.joinable()) reader_.join();
    });
}

void RestoreStream::check_index(std::size_t index, const char* what) const {
  if (index >= targets_.size())
    throw Error(ErrorKind::InvalidRange,
                targets_.empty() ? fmt::format("restore {}: {}({}): the restore has no tensors", where_, what, index)
                                 : fmt::format("restore {}: {}({}): the restore has {} tensors (0 to {})", where_,
                                               what, index, targets_.size(), targets_.size() - 1));
}

bool RestoreStream::landed(std::size_t index, std::chrono::nanoseconds timeout) {
  check_index(index, "landed");
  std::unique_lock lock(mutex_);
  const auto ready = [&] { return landed_ > index || done_; };
  if (!ready()) {
    if (!changed_.wait_until(lock, checked::deadline_after(timeout), ready)) return false;
  }
  if (landed_ > index) return true;
  if (error_) std::rethrow_exception(error_);
  throw CheckpointError(fmt::format("the restore of {} was abandoned before tensor {} was read", where_,
                                    checkpoint::quoted(targets_.at(index).name)));
}

const std::vector<PendingCopy>& RestoreStream::copies(std::size_t index) const {
  check_index(index, "copies");
  return copies_[index];
}

bool RestoreStream::finished(std::chrono::nanoseconds timeout) {
  std::unique_lock lock(mutex_);
  if (!changed_.wait_until(lock, checked::deadline_after(timeout), [&] { return done_; })) return false;
  if (error_) std::rethrow_exception(error_);
  if (landed_ < targets_.size())
    throw CheckpointError(fmt::format("the restore of {} was abandoned", where_));
  return true;
}

bool RestoreStream::done() const {
  std::lock_guard lock(mutex_);
  return done_;
}

void RestoreStream::release_when_landed(std::size_t index) {
  check_index(index, "release_when_landed");
  {
    std::lock_guard lock(mutex_);
    if (landed_ <= index && !done_) {
      release_on_landing_[index] = true;
      return;
    }
  }
  release_all({handles_[index]});
}

std::vector<DeviceHandle> RestoreStream::take_releases(std::size_t first, std::size_t last) {
  std::vector<DeviceHandle> released;
  for (std::size_t i = first; i < last; ++i)
    if (release_on_landing_[i]) {
      release_on_landing_[i] = false;
      released.push_back(handles_[i]);
    }
  return released;
}

void RestoreStream::release_all(const std::vector<DeviceHandle>& handles) noexcept {
  for (const DeviceHandle& handle : handles) {
    try {
      bridge_.release(handle);  // deferred by the bridge until the copies into it end
    } catch (...) {
    }
  }
}

void RestoreStream::run() noexcept {
  std::exception_ptr error;
  try {
    TransferOptions transfer;
    transfer.wait_for_room = options_.wait_for_room;
    // A stop ends a wait for ring room the caller holds (up to wait_for_room,
    // and at least a minute while other transfers run) instead of keeping
    // the stop's join waiting for it.
    transfer.while_waiting = [this] { refuse_if_stopping(); };
    // A bridge closed (or restarting) before the first read refuses the
    // planner itself: named as a read's failure is, by the file and the
    // tensor the reading would have begun with.
    TransferPlanner planner = naming(
        [&] {
          return targets_.empty() ? fmt::format("restore {}", where_)
                                  : fmt::format("restore {}: tensor {}", where_, checkpoint::quoted(targets_[0].name));
        },
        [&] { return TransferPlanner(bridge_, transfer); });
    for (std::size_t first = 0; first < targets_.size();) {
      std::size_t last = first + 1;  // the batch is [first, last): adjacent in the file, within the bounds
      std::uint64_t bytes = targets_[first].end - targets_[first].begin;
      const bool small = bytes < kAloneBytes;
      const auto joins = [&](const RestoreTarget& next) {
        const std::uint64_t more = next.end - next.begin;
        return small && more < kAloneBytes && bytes + more <= kBatchBytes;
      };
      while (last < targets_.size() && last - first < kBatchTensors && targets_[last].begin == targets_[last - 1].end &&
             joins(targets_[last])) {
        bytes += targets_[last].end - targets_[last].begin;
        ++last;
      }
      read_batch(planner, first, last);
      first = last;
    }
    if (!options_.expected_crc32.empty()) {
      const std::string actual = Crc32::text_of(crc_);
      if (actual != options_.expected_crc32)
        throw CheckpointError(fmt::format("{} is corrupt: the data's checksum is {}, the file records {}; nothing was "
                                          "restored",
                                          where_, actual, options_.expected_crc32));
    }
  } catch (...) {
    error = std::current_exception();
  }
  // The reading is over (the helper's read too): the file is not kept open
  // until the stream goes, which a failed restore's Python objects, held
  // in a cycle by its error's traceback, put off until the collector ran.
  ::close(std::exchange(fd_, -1));
  std::vector<DeviceHandle> released;
  {
    std::lock_guard lock(mutex_);
    error_ = error;
    done_ = true;
    released = take_releases(landed_, targets_.size());  // never landed: nothing writes them
    changed_.notify_all();
  }
  release_all(released);
}

void RestoreStream::read_batch(TransferPlanner& planner, std::size_t first, std::size_t last) {
  std::vector<DeviceSpan> destinations;
  destinations.reserve(last - first);
  for (std::size_t i = first; i < last; ++i)
    destinations.push_back(DeviceSpan{handles_[i], 0, targets_[i].end - targets_[i].begin});
  const std::uint64_t start = data_start_ + targets_[first].begin;
  const auto context = [&] {
    const std::string tensor = fmt::format("restore {}: tensor {}", where_, checkpoint::quoted(targets_[first].name));
    return last - first == 1 ? tensor : fmt::format("{} and the {} after it", tensor, last - first - 1);
  };
  auto results = naming(context, [&] {
    const ScatterSource source{[&](std::uint64_t offset, std::span<const std::span<std::byte>> pieces) {
      fill(start + offset, pieces);
    }};
    return planner.submit_scatter(source, destinations);
  });
  land_batch(first, results);
}

void RestoreStream::land_batch(std::size_t first, std::vector<TransferResult>& results) {
  for (std::size_t i = 0; i < results.size(); ++i) copies_[first + i] = std::move(results[i].pending);
  std::vector<DeviceHandle> released;
  {
    std::lock_guard lock(mutex_);
    landed_ = first + results.size();
    released = take_releases(first, landed_);
    changed_.notify_all();
  }
  release_all(released);
}

void RestoreStream::refuse_if_stopping() {
  std::lock_guard lock(mutex_);
  if (stopping_) throw CheckpointError(fmt::format("the restore of {} was abandoned", where_));
}

void RestoreStream::fill(std::uint64_t at, std::span<const std::span<std::byte>> pieces) {
  std::uint64_t total = 0;
  for (const auto& piece : pieces) total += piece.size();
  refuse_if_stopping();
  if (options_.before_read) options_.before_read(at, total);
  read_ahead(at + total);
  const bool crc = !options_.expected_crc32.empty();
  if (total < kParallelBytes) {
    const Read read = read_run(fd_, pieces, at, crc, where_, &hasher_);
    if (crc) crc_ = Crc32::combine(crc_, read.crc, total);
  } else {
    // Two halves, the second on the helper thread as far as the page cache
    // holds it, each a multiple of 4 KiB but the last; what the helper left
    // is read here after the first half, in file order.
    const std::uint64_t half = ((total + 1) / 2 + 4095) / 4096 * 4096;
    const auto second = cut(pieces, half, total);
    Read cached;
    // The helper reads what the page cache holds (no wait on the disk): it hashes as it reads.
    helper_.start([&] {
      cached = read_run(fd_, second, at + half, crc, where_, nullptr, /*cached_only=*/true);
    });
    Read first;
    std::exception_ptr failed;
    try {
      first = read_run(fd_, cut(pieces, 0, half), at, crc, where_, &hasher_);
    } catch (...) {
      failed = std::current_exception();
    }
    // The helper has stopped writing into the pieces before a failure gives them back.
    if (auto helper_failed = helper_.finish(); helper_failed && !failed) failed = helper_failed;
    if (failed) std::rethrow_exception(failed);
    const Read rest = cached.bytes < total - half
                          ? read_run(fd_, cut(second, cached.bytes, total - half), at + half + cached.bytes, crc, where_,
                                     &hasher_)
                          : Read{};
    if (crc)
      crc_ = Crc32::combine(Crc32::combine(Crc32::combine(crc_, first.crc, half), cached.crc, cached.bytes), rest.crc,
                            rest.bytes);
  }
  if (options_.digest)
    for (const auto& piece : pieces) options_.digest(piece);
}

void RestoreStream::read_ahead(std::uint64_t end) {
  if (end + kReadAhead / 2 <= advised_to_) return;
  const std::uint64_t from = std::max(end, advised_to_);
  advised_to_ = end + kReadAhead;
  (void)::posix_fadvise(fd_, static_cast<off_t>(from), static_cast<off_t>(advised_to_ - from),
                        POSIX_FADV_WILLNEED);  // a hint: its failure changes nothing
}

}  // namespace devbridge::checkpoint
