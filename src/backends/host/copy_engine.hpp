// The host backend's engine: three lanes, one thread each, each running its
// queue in order: uploads, downloads and launches (the compute role). They are
// the host's queues (Queue::CopyUp, CopyDown, Compute), so uploads, downloads
// and compute overlap the way a GPU's copy engines and kernels do, and a
// launch returns while it runs, like a kernel: what ends its use of memory is
// its fence, not the call's return. Copy completions go to one queue the
// bridge drains.
//
// Ordering across lanes and with work done on caller threads (sync copies) is
// by byte ranges: every piece of work declares the bytes it reads and writes,
// and waits only for earlier work that conflicts with it (write/read,
// read/write or write/write on overlapping bytes). Two pieces of work that
// touch unrelated bytes never wait for each other; a launch waits for the
// upload into its x, and a download of its y waits for the launch.
//
// Fences are the lanes' sequence numbers: a lane runs in order, so "the lane
// has finished seq n" is exactly "everything queued there up to n is done".
// They need no allocation, no release and no lock to test.
//
// Latency: an idle lane thread spins briefly before sleeping, and a waiter
// spins briefly on an atomic before sleeping, so a small copy's round trip
// costs no futex wake-up when the pipe is busy. An idle lane sleeps on its own
// condition variable, so streaming in one direction never wakes the other
// two lanes (the 4 KiB engine round trip's p99 went from ~6 us to ~1 us when
// the idle download lane stopped being woken by every upload).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <variant>
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

// A launch of the compute role, y[i] = a * x[i] + b over `count` floats, at
// addresses already checked against their allocations (neither need be
// float-aligned).
struct AxpyJob {
  const std::byte* x = nullptr;
  std::byte* y = nullptr;
  std::uint64_t count = 0;
  float a = 1.0f;
  float b = 0.0f;
};

Access access_of(const AxpyJob& job) noexcept;

void run_axpy(const AxpyJob& job) noexcept;

class CopyEngine {
 public:
  // The lanes' thread names (index = Queue), at most 15 characters each: the
  // kernel's limit. Tests find the engine's threads by them.
  static constexpr std::array<const char*, 3> kThreadNames = {"devbridge-h2d", "devbridge-d2h", "devbridge-comp"};

  // Starts the lane threads; throws Error(Unavailable) if it cannot. Async
  // copies, and launches, of up to `inline_max_bytes` may run on the
  // submitting thread (see host::Options).
  explicit CopyEngine(std::uint64_t inline_max_bytes);
  // Stops the threads after the work each is running; work not started is
  // dropped (its memory may already be gone), never run late.
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Queues an async copy, or runs a small one at once when nothing queued
  // must go first; either way its completion is posted when it has run.
  void submit(const CopyRequest& request);
  // Queues a launch on the compute lane, or runs a small one at once on the
  // same terms as a copy. Its fence; Fence{} when it already ran.
  Fence launch(const AxpyJob& job);
  // Waits until every earlier queued piece of work that conflicts with
  // `access` has finished. Afterwards the caller may touch those bytes on its
  // own thread (sync copy).
  void wait_for_conflicts(const Access& access);

  // A fence after everything queued on `queue` (CopyUp, CopyDown or Compute)
  // so far; Fence{} when that lane has nothing unfinished.
  Fence record(Queue queue) noexcept;
  // Whether the fence passed; also true once the engine stopped (dropped
  // work never runs). Throws Error(Unsupported) for a token this engine
  // never issued.
  bool passed(Fence fence) const;
  // Blocks until passed(fence) or `timeout` (nanoseconds::max(): forever).
  bool wait(Fence fence, std::chrono::nanoseconds timeout);

  void drain_completions(std::vector<Completion>& out);
  bool wait_for_completions(std::chrono::nanoseconds timeout);
  // Lifts any hold and waits until everything submitted before the call ran,
  // so every fence issued before it has passed.
  void quiesce();
  // While held, no lane starts new work: copies stay pending, launches too
  // and their fences with them.
  void set_held(bool held);
  // What the destructor does; idempotent. Afterwards no lane thread runs.
  void stop() noexcept;

 private:
  // Index = Queue: CopyUp, CopyDown, Compute.
  static constexpr int kLanes = 3;
  static constexpr int kComputeLane = static_cast<int>(Queue::Compute);
  // x86-64 and most ARM cores; std::hardware_destructive_interference_size
  // would warn about ABI instability on GCC.
  static constexpr std::size_t kCacheLine = 64;

  struct Work {
    std::variant<CopyRequest, AxpyJob> job;  // a copy on lanes 0 and 1, a launch on the compute lane
    Access access;
    std::uint64_t seq = 0;  // 1-based position in its lane
    // Lane i must have finished after[i] first (0: nothing). Own-lane order
    // is the queue order, so after[own lane] stays 0.
    std::array<std::uint64_t, kLanes> after{};
  };

  // The spinning threads poll a few atomics; each one that is written often
  // gets its own cache line, so a poll never stalls on a line some other
  // core is busy writing (see kCacheLine).
  struct alignas(kCacheLine) Lane {
    std::deque<Work> queue;      // unfinished work; front is running or next
    std::uint64_t next_seq = 1;  // guarded by mutex_
    std::thread thread;
    // An idle lane sleeps on a condition of its own: only work for it (or
    // lifting a hold, or stop) wakes it, never another lane's progress.
    std::condition_variable idle_cv;
    std::atomic<int> idle_sleepers{0};  // read by every submit to the lane
    alignas(kCacheLine) std::atomic<std::uint64_t> submitted{0};  // written by submitters
    alignas(kCacheLine) std::atomic<std::uint64_t> finished{0};   // written by the lane's thread
  };

  // Queues `job` on `lane` (or runs it here when `may_run_inline` and nothing
  // must go first); its seq, 0 when it ran here.
  template <class Job>
  std::uint64_t enqueue(int lane, const Job& job, bool may_run_inline);
  void run(const CopyRequest& request);
  static void run(const AxpyJob& job) noexcept { run_axpy(job); }
  void run_lane(int lane);
  void post_completion(const CopyEvent& event);
  // Everything this lane has queued that conflicts with `access` (0 = nothing);
  // needs mutex_.
  std::uint64_t last_conflict(const Lane& lane, const Access& access) const noexcept;
  void wait_finished(int lane, std::uint64_t seq);
  // Wakes whoever sleeps on progress_cv_ (a lane's `finished` moved).
  void notify_progress();
  // Wakes the lane's thread if it sleeps idle (it has work, or may start it).
  void wake_lane(Lane& lane);

  // Spins on `ready` (which reads only atomics) for up to `spin`, then sleeps
  // on `cv` (announced in `sleepers`) until it holds or `deadline` passes;
  // whether it holds.
  template <class Ready>
  bool spin_then_sleep(std::chrono::nanoseconds spin, Ready ready, std::condition_variable& cv,
                       std::atomic<int>& sleepers,
                       std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max());

  const std::uint64_t inline_max_bytes_;
  alignas(kCacheLine) std::mutex mutex_;  // guards the lane queues and next_seq
  // Waiters on some lane's `finished`: sync copies, fence waits, quiesce, and
  // lanes whose next item waits for another lane.
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
