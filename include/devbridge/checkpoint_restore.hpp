// Restoring a checkpoint's tensors from its file into new allocations: the
// one reader behind Python's devbridge.restore and the C ABI's
// devbridge_restore (the header is checked first by CheckpointFile).
//
// Every tensor is allocated before the first byte is read (an allocation
// that fails frees the others: nothing half-made), then a thread of the
// stream's own reads the data section in file order, tensors next to each
// other in the file together: one TransferPlanner::submit_scatter a batch,
// so where device memory is host memory one preadv lands many small tensors
// in their own bytes, and elsewhere the bytes go through the ring's chunks.
// A large batch is read in two parts on two threads. The CRC-32 is computed
// as the bytes are read (parts combined); any other checksum is the
// caller's, handed the bytes in file order. Tensors become ready in file
// order, each as soon as its batch is submitted (landed()), so compute can
// start on the first layers while the rest is read.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "devbridge/bridge.hpp"
#include "devbridge/transfer.hpp"

namespace devbridge::checkpoint {

// One tensor a restore makes: bytes [begin, end) of the data section into a
// new allocation of `spec` and `extent` (at least end - begin).
struct RestoreTarget {
  std::string name;  // the file's name for it, in errors
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  ObjectSpec spec;
  std::uint64_t extent = 0;
};

namespace detail {

// A thread for a restore reader's side work (the second half of a large read,
// or the hash of what the reader read): one each for the stream's life (a
// thread made per read ran at times on the reader's core, and a read took
// half as long again).
class SideThread {
 public:
  SideThread() = default;
  ~SideThread();
  SideThread(const SideThread&) = delete;
  SideThread& operator=(const SideThread&) = delete;
  // Runs `task` on the thread; finish() waits for it and returns what it threw.
  void start(std::function<void()> task);
  std::exception_ptr finish();

 private:
  void serve();
  std::mutex mutex_;
  std::condition_variable changed_;
  std::function<void()> task_;
  std::exception_ptr failed_;
  bool busy_ = false;
  bool quitting_ = false;
  std::thread thread_;
};

}  // namespace detail

struct RestoreOptions {
  // "crc32:<8 hex>": checked on the fly, the verdict at the end (the
  // targets must then tile the data section). Empty: nothing checked here.
  std::string expected_crc32;
  // Handed every byte read, in file order, on the reading thread (another
  // checksum, computed by the caller). It may throw: the restore fails.
  std::function<void(std::span<const std::byte>)> digest{};
  // Called on the reading thread before each read of bytes [offset, offset
  // + bytes) of the file: tests inject faults and hold reads with it, the
  // benchmark throttles storage. It may throw: the restore fails.
  std::function<void(std::uint64_t offset, std::uint64_t bytes)> before_read{};
  // How long a batch waits for ring room other callers hold
  // (TransferOptions::wait_for_room).
  std::chrono::nanoseconds wait_for_room = std::chrono::seconds(30);
};

class RestoreStream {
 public:
  // Allocates every target on `bridge` (an allocation that fails frees the
  // others and throws, naming the tensor), then starts reading `fd` (a
  // descriptor the stream owns from now on and closes), whose data section
  // starts at byte `data_start`. `where` names the file in errors ("'m.st'").
  static std::unique_ptr<RestoreStream> start(Bridge& bridge, int fd, std::uint64_t data_start,
                                              std::vector<RestoreTarget> targets, RestoreOptions options,
                                              std::string where);
  // Stops the reading before its next read and waits for the thread. The
  // allocations are the caller's (handles()): it frees them.
  ~RestoreStream();
  RestoreStream(const RestoreStream&) = delete;
  RestoreStream& operator=(const RestoreStream&) = delete;

  // The allocations, one per target, in the order given.
  const std::vector<DeviceHandle>& handles() const noexcept { return handles_; }
  // Waits up to `timeout` for target `index`'s bytes to be written or their
  // copies submitted: false when not yet; throws the error that stopped the
  // reading before it got there, and InvalidRange for an index past the last.
  bool landed(std::size_t index, std::chrono::nanoseconds timeout);
  // Target `index`'s copies still in flight when it landed (offsets from its
  // start; empty where its bytes were written in place). Only once landed().
  const std::vector<PendingCopy>& copies(std::size_t index) const;
  // Waits up to `timeout` for the whole file: true once every target landed
  // and the CRC-32 matched; throws the error that stopped the reading.
  bool finished(std::chrono::nanoseconds timeout);
  // True once the reading ended, by success or failure (never blocks).
  bool done() const;
  // Stops the reading before its next read and waits for it to stop
  // (idempotent): every later landed()/finished() of a target not landed
  // throws.
  void stop();
  // Asks the reading to stop before its next read, without waiting for the
  // read in progress (an interrupted caller: Ctrl-C must not wait for slow
  // storage). The reader ends on its own; the stream, which it uses until
  // then, is destroyed (stop(), joining it) only by its owner. What the read
  // in progress writes into is safe to let go meanwhile: ring ranges are the
  // planner's, and an allocation written in place is held as a copy into it,
  // so the bridge defers its release until the write ends.
  void request_stop();
  // Lets go of target `index`'s allocation (Bridge::release) once its bytes
  // have landed: at once if they have, or the reading has ended, else when
  // they land or the reading ends first. A caller may so drop a tensor the
  // reader has not reached yet, without waiting for it and without the
  // reader finding its allocation gone. InvalidRange past the last target.
  void release_when_landed(std::size_t index);

 private:
  RestoreStream(Bridge& bridge, int fd, std::uint64_t data_start, std::vector<RestoreTarget> targets,
                RestoreOptions options, std::string where);
  void run() noexcept;
  // InvalidRange naming `what`, `index` and how many targets there are, past the last.
  void check_index(std::size_t index, const char* what) const;
  void read_batch(TransferPlanner& planner, std::size_t first, std::size_t last);
  // CheckpointError "was abandoned" once a stop was asked for: before each
  // read, and while the planner waits for ring room or a copy.
  void refuse_if_stopping();
  void fill(std::uint64_t file_offset, std::span<const std::span<std::byte>> pieces);
  void read_ahead(std::uint64_t end);
  // Batch [first, first + results.size()) landed: its copies kept, waiters
  // woken, the allocations release_when_landed asked for let go.
  void land_batch(std::size_t first, std::vector<TransferResult>& results);
  // Under mutex_: the allocations of targets [first, last) that wait in
  // release_when_landed, no longer waiting.
  std::vector<DeviceHandle> take_releases(std::size_t first, std::size_t last);
  // Bridge::release of each (outside mutex_); one a restart or close retired is gone already.
  void release_all(const std::vector<DeviceHandle>& handles) noexcept;

  Bridge& bridge_;
  int fd_;  // a duplicate of the caller's; closed (-1) by the reader as it ends
  std::uint64_t data_start_;
  std::vector<RestoreTarget> targets_;
  RestoreOptions options_;
  std::string where_;
  std::vector<DeviceHandle> handles_;
  std::vector<std::vector<PendingCopy>> copies_;
  std::uint32_t crc_ = 0;
  std::uint64_t advised_to_ = 0;  // file offsets: the kernel was asked to read ahead up to here

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::size_t landed_ = 0;  // targets [0, landed_) landed
  std::vector<bool> release_on_landing_;  // by target: release_when_landed asked before it landed
  bool done_ = false;
  bool stopping_ = false;
  std::exception_ptr error_;
  detail::SideThread helper_;  // before reader_: the reader, joined first, uses it
  detail::SideThread hasher_;  // hashes each MiB the reader read while it reads the next; before reader_ too
  std::thread reader_;
  std::once_flag joined_;  // stop() joins reader_ once
};

}  // namespace devbridge::checkpoint
