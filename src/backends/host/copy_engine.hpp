// The host backend's copy engine: one thread per direction, each running its
// queue in submission order, so uploads and downloads overlap. Completions go
// to one queue the bridge drains.
//
// Ordering across directions and with work done on caller threads (sync
// copies, compute) is by byte ranges: every piece of work declares the bytes
// it reads and writes, and waits only for earlier work that conflicts with it
// (write/read, read/write or write/write on overlapping bytes). Two copies that
// touch unrelated bytes never wait for each other.
//
// Latency: an idle engine thread spins briefly before sleeping, and a waiter
// spins briefly on an atomic before sleeping, so a small copy's round trip
// costs no futex wake-up when the pipe is busy.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "devbridge/backend.hpp"

namespace devbridge::host::detail {

// A half-open range of addresses [begin, end). Device memory is host memory
// here, so device and host bytes live in one address space.
struct ByteSpan {
  std::uintptr_t begin = 0;
  std::uintptr_t end = 0;
  bool overlaps(const ByteSpan& other) const noexcept {
    return begin < other.end && other.begin < end;
  }
};

// What a piece of work touches; two accesses conflict unless both only read.
struct Access {
  ByteSpan reads;
  ByteSpan writes;
  bool conflicts_with(const Access& other) const noexcept {
    return writes.overlaps(other.reads) || reads.overlaps(other.writes) || writes.overlaps(other.writes);
  }
};

// The bytes a copy reads and writes.
Access access_of(const CopyRequest& request) noexcept;

// Moves a copy's bytes (device memory is host memory here).
void copy_bytes(const CopyRequest& request) noexcept;

class CopyEngine {
 public:
  // Starts both engine threads; throws Error(Unavailable) if it cannot.
  // Async copies up to `inline_max_bytes` may run on the submitting thread
  // (see host::Options).
  explicit CopyEngine(std::uint64_t inline_max_bytes);
  // Stops the threads after the copy each is running; copies not started are
  // dropped (their memory may already be gone), never run late.
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Queues an async copy, or runs a small one at once when nothing queued
  // must go first; either way its completion is posted when it has run.
  void submit(const CopyRequest& request);
  // Waits until every earlier queued copy that conflicts with `access` has
  // finished. Afterwards the caller may touch those bytes on its own thread
  // (sync copy, compute).
  void wait_for_conflicts(const Access& access);

  void drain_completions(std::vector<Completion>& out);
  bool wait_for_completions(std::chrono::nanoseconds timeout);
  // Lifts any hold and waits until everything submitted before the call ran.
  void quiesce();
  void set_held(bool held);
  // What the destructor does; idempotent. Afterwards no engine thread runs.
  void stop() noexcept;

 private:
  static constexpr int kLanes = 2;  // index = CopyDirection
  // x86-64 and most ARM cores; std::hardware_destructive_interference_size
  // would warn about ABI instability on GCC.
  static constexpr std::size_t kCacheLine = 64;

  struct QueuedCopy {
    CopyRequest request;
    Access access;
    std::uint64_t seq = 0;               // 1-based position in its lane
    std::uint64_t after_other_lane = 0;  // the other lane must have finished this seq first
  };

  // The spinning threads poll a few atomics; each one that is written often
  // gets its own cache line, so a poll never stalls on a line some other
  // core is busy writing (see kCacheLine).
  struct alignas(kCacheLine) Lane {
    std::deque<QueuedCopy> queue;  // unfinished copies; front is running or next
    std::uint64_t next_seq = 1;    // guarded by mutex_
    std::thread thread;
    alignas(kCacheLine) std::atomic<std::uint64_t> submitted{0};  // written by submitters
    alignas(kCacheLine) std::atomic<std::uint64_t> finished{0};   // written by the lane's thread
  };

  void run_lane(int lane);
  void post_completion(const CopyEvent& event);
  // Everything this lane has queued that conflicts with `access` (0 = nothing);
  // needs mutex_.
  std::uint64_t last_conflict(const Lane& lane, const Access& access) const noexcept;
  void wait_finished(int lane, std::uint64_t seq);
  void notify_progress();

  // Spins on `ready` (which reads only atomics) for up to `spin`, then sleeps
  // on cv_ until it holds.
  template <class Ready>
  void spin_then_sleep(std::chrono::nanoseconds spin, Ready ready);

  const std::uint64_t inline_max_bytes_;
  alignas(kCacheLine) std::mutex mutex_;  // guards the lane queues and next_seq
  std::condition_variable progress_cv_;
  std::atomic<int> progress_sleepers_{0};
  alignas(kCacheLine) std::atomic<bool> held_{false};  // read-mostly, polled by the lanes
  std::atomic<bool> stopping_{false};
  std::array<Lane, kLanes> lanes_;

  alignas(kCacheLine) std::mutex completions_mutex_;
  std::condition_variable completions_cv_;
  std::vector<Completion> completions_;
  std::atomic<int> completion_sleepers_{0};
  alignas(kCacheLine) std::atomic<std::size_t> completions_ready_{0};  // polled by waiters
  std::atomic<std::uint64_t> drains_{0};  // drains that took something; changes with completions_ready_
};

}  // namespace devbridge::host::detail
