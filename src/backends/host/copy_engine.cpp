#include "backends/host/copy_engine.hpp"
#include "backends/cpu_copy.hpp"

#include <pthread.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <iterator>
#include <optional>
#include <string>
#include <system_error>

#include <fmt/format.h>

#include "core/log.hpp"

#include "devbridge/checked.hpp"
#include "devbridge/error.hpp"

namespace devbridge::host::detail {

namespace {

using Clock = std::chrono::steady_clock;

// How long an idle lane thread keeps polling its queue before sleeping. A
// streaming client submits the next copy well within this, so the common path
// never pays a futex wake-up; an idle backend stops burning a core after it.
constexpr std::chrono::microseconds kEngineIdleSpin{80};
// How long a waiter (bridge wait, sync copy, fence wait) polls before
// sleeping. A 4 KiB copy takes well under a microsecond, so a short spin
// catches it.
constexpr std::chrono::microseconds kWaiterSpin{40};

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#else
  std::this_thread::yield();
#endif
}

// Polls `ready` for up to `spin`; true as soon as it holds. Yields the core
// every 64 polls (about 2 us): when the thread that will make `ready` true
// shares this core (the other cores busy), a spin that never yields keeps it
// off the core for the whole spin, and a waiter's spin plus a lane's idle
// spin add up to a 125 us round trip (measured on a loaded 2-core VM; with
// the yield it stays near 6 us, and a yield on a free core costs ~0.5 us).
template <class Ready>
bool spin_for(std::chrono::nanoseconds spin, Ready&& ready) {
  if (ready()) return true;
  const auto deadline = Clock::now() + spin;
  for (unsigned i = 1;; ++i) {
    cpu_relax();
    if (ready()) return true;
    if ((i & 15u) == 0) {
      if (Clock::now() >= deadline) return false;
      if ((i & 63u) == 0) std::this_thread::yield();
    }
  }
}

static_assert(static_cast<int>(Queue::CopyUp) == 0 && static_cast<int>(Queue::CopyDown) == 1 &&
                  static_cast<int>(Queue::Compute) == 2,
              "a lane's index is its Queue");

int lane_of(CopyDirection direction) noexcept {
  return static_cast<int>(direction == CopyDirection::HostToDevice ? Queue::CopyUp : Queue::CopyDown);
}

// A fence token is (seq << 2) | (lane + 1): never 0 (the passed fence), and
// it decodes without a table, so a fence costs nothing to make or release.
constexpr unsigned kLaneBits = 2;
constexpr std::uintptr_t kLaneMask = (std::uintptr_t{1} << kLaneBits) - 1;

Fence fence_of(int lane, std::uint64_t seq) noexcept {
  return Fence{static_cast<std::uintptr_t>(seq << kLaneBits) | static_cast<std::uintptr_t>(lane + 1)};
}

}  // namespace

void copy_bytes(const CopyRequest& request) noexcept {
  devbridge::detail::move_request_bytes(request, reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(request.device.address)) +
                                  request.device_offset);
}

// The sums below cannot wrap: the backend checks the device span against its
// allocation (range_within) and the bridge the host span against the ring
// before a request gets here, so each span lies inside live memory. A
// pitched copy's access is its whole span: the padding between its rows
// orders it after other work there too, which costs only concurrency.
Access access_of(const CopyRequest& request) noexcept {
  const auto host_len = request_host_span(request);  // checked by the bridge: cannot throw here
  const auto device_len = request_device_span(request);
  const auto host = reinterpret_cast<std::uintptr_t>(request.host);
  const auto device = static_cast<std::uintptr_t>(request.device.address + request.device_offset);
  const ByteSpan host_span{host, host + host_len};
  const ByteSpan device_span{device, device + device_len};
  if (request.direction == CopyDirection::HostToDevice) return Access{host_span, device_span};
  return Access{device_span, host_span};
}

// Cannot wrap either: the backend checked both ranges against live
// allocations.
Access access_of(const AxpyJob& job) noexcept {
  const auto bytes = static_cast<std::uintptr_t>(job.count * sizeof(float));
  const auto x = reinterpret_cast<std::uintptr_t>(job.x);
  const auto y = reinterpret_cast<std::uintptr_t>(job.y);
  return Access{{x, x + bytes}, {y, y + bytes}};
}

void run_axpy(const AxpyJob& job) noexcept {
  constexpr std::uint64_t kElement = sizeof(float);
  // memcpy loads and stores: offsets need not be float-aligned, and the
  // compiler turns them into plain (vectorised) moves.
  const float a = job.a;
  const float b = job.b;
  for (std::uint64_t i = 0; i < job.count; ++i) {
    float value;
    std::memcpy(&value, job.x + i * kElement, kElement);
    value = a * value + b;
    std::memcpy(job.y + i * kElement, &value, kElement);
  }
}

CopyEngine::CopyEngine(std::uint64_t inline_max_bytes) : inline_max_bytes_(inline_max_bytes) {
  static_assert(kThreadNames.size() == kLanes);
  for (int lane = 0; lane < kLanes; ++lane) {
    try {
      lanes_[lane].thread = std::thread([this, lane] { run_lane(lane); });
    } catch (const std::system_error& e) {
      stop();
      throw Error(ErrorKind::Unavailable,
                  std::string("host backend: cannot start engine thread ") + kThreadNames[lane] + ": " + e.what());
    }
    // Named threads make `top -H` and debuggers readable; failure is cosmetic
    // but still reported.
    if (int rc = pthread_setname_np(lanes_[lane].thread.native_handle(), kThreadNames[lane]); rc != 0) {
      devbridge::detail::log().warn("host backend: pthread_setname_np({}): {}", kThreadNames[lane], std::strerror(rc));
    }
  }
}

CopyEngine::~CopyEngine() { stop(); }

void CopyEngine::stop() noexcept {
  stopping_.store(true);
  {
    std::lock_guard lock(mutex_);
  }
  progress_cv_.notify_all();
  for (auto& lane : lanes_) lane.idle_cv.notify_all();
  for (auto& lane : lanes_) {
    if (lane.thread.joinable()) lane.thread.join();
  }
}

template <class Ready>
bool CopyEngine::spin_then_sleep(std::chrono::nanoseconds spin, Ready ready, std::condition_variable& cv,
                                 std::atomic<int>& sleepers, Clock::time_point deadline) {
  if (spin_for(spin, ready)) return true;
  // Announce the sleep before the last check under the lock: a notifier that
  // changes the state after this reads sleepers > 0 and takes the lock, so
  // the wake-up cannot fall between our check and our wait.
  sleepers.fetch_add(1);
  bool got = true;
  {
    std::unique_lock lock(mutex_);
    if (deadline == Clock::time_point::max()) {
      cv.wait(lock, ready);
    } else {
      got = cv.wait_until(lock, deadline, ready);
    }
  }
  sleepers.fetch_sub(1);
  return got;
}

void CopyEngine::notify_progress() {
  if (progress_sleepers_.load() == 0) return;
  {
    std::lock_guard lock(mutex_);
  }
  progress_cv_.notify_all();
}

void CopyEngine::wake_lane(Lane& lane) {
  if (lane.idle_sleepers.load() == 0) return;
  {
    std::lock_guard lock(mutex_);
  }
  lane.idle_cv.notify_one();
}

std::uint64_t CopyEngine::last_conflict(const Lane& lane, const Access& access) const noexcept {
  for (auto it = lane.queue.rbegin(); it != lane.queue.rend(); ++it) {
    if (it->access.conflicts_with(access)) return it->seq;
  }
  return 0;
}

void CopyEngine::run(const CopyRequest& request) {
  copy_bytes(request);
  post_completion(request.event);
}

template <class Job>
std::uint64_t CopyEngine::enqueue(int lane, const Job& job, bool may_run_inline) {
  Lane& mine = lanes_[lane];
  std::uint64_t seq;
  {
    std::lock_guard lock(mutex_);
    Work item{job, access_of(job), mine.next_seq, {}};
    bool must_wait = false;
    for (int other = 0; other < kLanes; ++other) {
      if (other == lane) continue;
      item.after[other] = last_conflict(lanes_[other], item.access);
      must_wait |= item.after[other] != 0;
    }
    if (may_run_inline && mine.queue.empty() && !must_wait && !held_.load()) {
      // Nothing may run before it, and the lock keeps anything submitted
      // after it from starting (or completing) first.
      run(job);
      return 0;
    }
    mine.queue.push_back(item);
    seq = mine.next_seq++;
    mine.submitted.store(seq);
  }
  wake_lane(mine);
  return seq;
}

void CopyEngine::submit(const CopyRequest& request) {
  (void)enqueue(lane_of(request.direction), request, request.len <= inline_max_bytes_);
}

Fence CopyEngine::launch(const AxpyJob& job) {
  // The bytes written decide, as for a copy: the loop costs about a memcpy.
  const bool small = job.count <= inline_max_bytes_ / sizeof(float);
  const std::uint64_t seq = enqueue(kComputeLane, job, small);
  return seq == 0 ? Fence{} : fence_of(kComputeLane, seq);
}

void CopyEngine::wait_finished(int lane, std::uint64_t seq) {
  if (seq == 0) return;
  const Lane& target = lanes_[lane];
  spin_then_sleep(kWaiterSpin, [&] { return target.finished.load() >= seq || stopping_.load(); }, progress_cv_,
                  progress_sleepers_);
}

void CopyEngine::wait_for_conflicts(const Access& access) {
  std::array<std::uint64_t, kLanes> last{};
  {
    std::lock_guard lock(mutex_);
    for (int lane = 0; lane < kLanes; ++lane) last[lane] = last_conflict(lanes_[lane], access);
  }
  for (int lane = 0; lane < kLanes; ++lane) wait_finished(lane, last[lane]);
}

Fence CopyEngine::record(Queue queue) noexcept {
  const int lane = static_cast<int>(queue);
  // Inline work never has a seq, but it only runs while its lane is empty,
  // so the last queued seq still covers everything enqueued before now.
  const std::uint64_t seq = lanes_[lane].submitted.load();
  if (lanes_[lane].finished.load() >= seq) return Fence{};
  return fence_of(lane, seq);
}

bool CopyEngine::passed(Fence fence) const {
  if (!fence.pending()) return true;
  const auto lane_bits = fence.token & kLaneMask;
  const std::uint64_t seq = fence.token >> kLaneBits;
  const int lane = static_cast<int>(lane_bits) - 1;
  if (lane_bits == 0 || lane >= kLanes || seq > lanes_[lane].submitted.load()) {
    throw Error(ErrorKind::Unsupported,
                fmt::format("host backend: fence 0x{:x} was not issued by this backend", fence.token));
  }
  return lanes_[lane].finished.load() >= seq || stopping_.load();
}

bool CopyEngine::wait(Fence fence, std::chrono::nanoseconds timeout) {
  if (passed(fence)) return true;
  if (timeout <= std::chrono::nanoseconds::zero()) return false;
  const auto start = Clock::now();
  const int lane = static_cast<int>(fence.token & kLaneMask) - 1;
  const std::uint64_t seq = fence.token >> kLaneBits;
  const Lane& target = lanes_[lane];
  // A timeout too large to add to the clock saturates: wait until done.
  return spin_then_sleep(std::min<std::chrono::nanoseconds>(timeout, kWaiterSpin),
                         [&] { return target.finished.load() >= seq || stopping_.load(); }, progress_cv_,
                         progress_sleepers_, checked::deadline_after(timeout, start));
}

void CopyEngine::run_lane(int lane) {
  Lane& mine = lanes_[lane];
  std::optional<Work> next;  // taken from the queue with the previous pop
  for (;;) {
    if (!next) {
      // `submitted` is read before `held_`: a test that holds and then
      // submits is then guaranteed to be seen holding.
      spin_then_sleep(
          kEngineIdleSpin,
          [&] { return stopping_.load() || (mine.submitted.load() > mine.finished.load() && !held_.load()); },
          mine.idle_cv, mine.idle_sleepers);
      if (stopping_.load()) return;
      std::lock_guard lock(mutex_);
      next = mine.queue.front();
    }
    const Work item = *next;
    next.reset();
    for (int other = 0; other < kLanes; ++other) wait_finished(other, item.after[other]);
    if (stopping_.load()) return;

    // A copy's completion is posted before the copy counts as finished, so
    // whoever sees it finished (quiesce above all) can already drain it.
    std::visit([this](const auto& job) { run(job); }, item.job);
    {
      // One lock per item while busy: pop this one and take the next.
      std::lock_guard lock(mutex_);
      mine.queue.pop_front();
      mine.finished.store(item.seq);
      if (!mine.queue.empty() && !held_.load()) next = mine.queue.front();
    }
    notify_progress();
  }
}

void CopyEngine::post_completion(const CopyEvent& event) {
  {
    std::lock_guard lock(completions_mutex_);
    completions_.push_back(Completion{event, true, ErrorKind::DeviceCopyFailed, {}, false});
    completions_ready_.store(completions_.size());
  }
  if (completion_sleepers_.load() == 0) return;
  {
    std::lock_guard lock(completions_mutex_);
  }
  completions_cv_.notify_all();
}

void CopyEngine::drain_completions(std::vector<Completion>& out) {
  if (completions_ready_.load() == 0) return;
  {
    std::lock_guard lock(completions_mutex_);
    if (completions_.empty()) return;
    if (out.empty()) {
      // Swapping hands the engine the caller's spare capacity, so a bridge
      // that reuses its vector makes the steady state allocation-free.
      out.swap(completions_);
    } else {
      out.insert(out.end(), std::make_move_iterator(completions_.begin()),
                 std::make_move_iterator(completions_.end()));
    }
    completions_.clear();
    completions_ready_.store(0);
    drains_.fetch_add(1);
  }
  // Another thread may be asleep waiting for a copy this drain just took:
  // wake it so it looks again (the bridge has applied it by the time that
  // thread gets the bridge's lock) instead of sleeping out its timeout.
  if (completion_sleepers_.load() > 0) completions_cv_.notify_all();
}

bool CopyEngine::wait_for_completions(std::chrono::nanoseconds timeout) {
  // Ready when there is something to drain, or when someone else drained
  // since we started looking (it may have been ours).
  const std::uint64_t drains_at_start = drains_.load();
  auto ready = [this, drains_at_start] { return completions_ready_.load() > 0 || drains_.load() != drains_at_start; };
  if (ready()) return true;
  if (timeout <= std::chrono::nanoseconds::zero()) return false;
  const auto start = Clock::now();
  if (spin_for(std::min<std::chrono::nanoseconds>(timeout, kWaiterSpin), ready)) return true;

  // A timeout too large to add to the clock saturates: wait until done.
  const auto deadline = checked::deadline_after(timeout, start);
  completion_sleepers_.fetch_add(1);
  bool got;
  {
    std::unique_lock lock(completions_mutex_);
    if (deadline == Clock::time_point::max()) {
      completions_cv_.wait(lock, ready);
      got = true;
    } else {
      got = completions_cv_.wait_until(lock, deadline, ready);
    }
  }
  completion_sleepers_.fetch_sub(1);
  return got;
}

void CopyEngine::quiesce() {
  set_held(false);
  std::array<std::uint64_t, kLanes> target{};
  for (int lane = 0; lane < kLanes; ++lane) target[lane] = lanes_[lane].submitted.load();
  for (int lane = 0; lane < kLanes; ++lane) wait_finished(lane, target[lane]);
}

void CopyEngine::set_held(bool held) {
  held_.store(held);
  if (held) return;
  for (auto& lane : lanes_) wake_lane(lane);
}

}  // namespace devbridge::host::detail
