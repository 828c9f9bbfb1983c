#include "backends/host/copy_engine.hpp"

#include <pthread.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <iterator>
#include <optional>
#include <string>
#include <system_error>

#include "core/log.hpp"

#include "devbridge/checked.hpp"
#include "devbridge/error.hpp"

namespace devbridge::host::detail {

namespace {

using Clock = std::chrono::steady_clock;

// How long an idle engine thread keeps polling its queue before sleeping. A
// streaming client submits the next copy well within this, so the common path
// never pays a futex wake-up; an idle backend stops burning a core after it.
constexpr std::chrono::microseconds kEngineIdleSpin{80};
// How long a waiter (bridge wait, sync copy, compute) polls before sleeping.
// A 4 KiB copy takes well under a microsecond, so a short spin catches it.
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

// Polls `ready` for up to `spin`; true as soon as it holds.
template <class Ready>
bool spin_for(std::chrono::nanoseconds spin, Ready&& ready) {
  if (ready()) return true;
  const auto deadline = Clock::now() + spin;
  for (unsigned i = 1;; ++i) {
    cpu_relax();
    if (ready()) return true;
    if ((i & 15u) == 0 && Clock::now() >= deadline) return false;
  }
}

int lane_of(CopyDirection direction) noexcept { return direction == CopyDirection::HostToDevice ? 0 : 1; }

}  // namespace

void copy_bytes(const CopyRequest& request) noexcept {
  std::byte* device = reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(request.device.address)) +
                      request.device_offset;
  if (request.direction == CopyDirection::HostToDevice) {
    std::memcpy(device, request.host, request.len);
  } else {
    std::memcpy(request.host, device, request.len);
  }
}

// The sums below cannot wrap: the backend checks the device range against its
// allocation (range_within) and the bridge the host range against the ring
// before a request gets here, so each span lies inside live memory.
Access access_of(const CopyRequest& request) noexcept {
  const auto host = reinterpret_cast<std::uintptr_t>(request.host);
  const auto device = static_cast<std::uintptr_t>(request.device.address + request.device_offset);
  const ByteSpan host_span{host, host + request.len};
  const ByteSpan device_span{device, device + request.len};
  if (request.direction == CopyDirection::HostToDevice) return Access{host_span, device_span};
  return Access{device_span, host_span};
}

CopyEngine::CopyEngine(std::uint64_t inline_max_bytes) : inline_max_bytes_(inline_max_bytes) {
  static constexpr const char* kThreadNames[kLanes] = {"devbridge-h2d", "devbridge-d2h"};
  for (int lane = 0; lane < kLanes; ++lane) {
    try {
      lanes_[lane].thread = std::thread([this, lane] { run_lane(lane); });
    } catch (const std::system_error& e) {
      stop();
      throw Error(ErrorKind::Unavailable,
                  std::string("host backend: cannot start copy engine thread ") + kThreadNames[lane] + ": " + e.what());
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
  for (auto& lane : lanes_) {
    if (lane.thread.joinable()) lane.thread.join();
  }
}

template <class Ready>
void CopyEngine::spin_then_sleep(std::chrono::nanoseconds spin, Ready ready) {
  if (spin_for(spin, ready)) return;
  // Announce the sleep before the last check under the lock: a notifier that
  // changes the state after this reads progress_sleepers_ > 0 and takes the
  // lock, so the wake-up cannot fall between our check and our wait.
  progress_sleepers_.fetch_add(1);
  {
    std::unique_lock lock(mutex_);
    progress_cv_.wait(lock, ready);
  }
  progress_sleepers_.fetch_sub(1);
}

void CopyEngine::notify_progress() {
  if (progress_sleepers_.load() == 0) return;
  {
    std::lock_guard lock(mutex_);
  }
  progress_cv_.notify_all();
}

std::uint64_t CopyEngine::last_conflict(const Lane& lane, const Access& access) const noexcept {
  for (auto it = lane.queue.rbegin(); it != lane.queue.rend(); ++it) {
    if (it->access.conflicts_with(access)) return it->seq;
  }
  return 0;
}

void CopyEngine::submit(const CopyRequest& request) {
  const int lane = lane_of(request.direction);
  Lane& mine = lanes_[lane];
  const Lane& other = lanes_[1 - lane];
  {
    std::lock_guard lock(mutex_);
    QueuedCopy item{request, access_of(request), mine.next_seq, 0};
    // Same-lane order is the queue order; only the other lane needs an
    // explicit dependency.
    item.after_other_lane = last_conflict(other, item.access);
    if (request.len <= inline_max_bytes_ && mine.queue.empty() && item.after_other_lane == 0 && !held_.load()) {
      // Nothing may run before it, and the lock keeps anything submitted
      // after it from starting (or completing) first.
      copy_bytes(request);
      post_completion(request.event);
      return;
    }
    mine.queue.push_back(item);
    ++mine.next_seq;
    mine.submitted.store(item.seq);
  }
  notify_progress();
}

void CopyEngine::wait_finished(int lane, std::uint64_t seq) {
  if (seq == 0) return;
  const Lane& target = lanes_[lane];
  spin_then_sleep(kWaiterSpin, [&] { return target.finished.load() >= seq || stopping_.load(); });
}

void CopyEngine::wait_for_conflicts(const Access& access) {
  std::array<std::uint64_t, kLanes> last{};
  {
    std::lock_guard lock(mutex_);
    for (int lane = 0; lane < kLanes; ++lane) last[lane] = last_conflict(lanes_[lane], access);
  }
  for (int lane = 0; lane < kLanes; ++lane) wait_finished(lane, last[lane]);
}

void CopyEngine::run_lane(int lane) {
  Lane& mine = lanes_[lane];
  std::optional<QueuedCopy> next;  // taken from the queue with the previous pop
  for (;;) {
    if (!next) {
      // `submitted` is read before `held_`: a test that holds and then
      // submits is then guaranteed to be seen holding.
      spin_then_sleep(kEngineIdleSpin, [&] {
        return stopping_.load() || (mine.submitted.load() > mine.finished.load() && !held_.load());
      });
      if (stopping_.load()) return;
      std::lock_guard lock(mutex_);
      next = mine.queue.front();
    }
    const QueuedCopy item = *next;
    next.reset();
    wait_finished(1 - lane, item.after_other_lane);
    if (stopping_.load()) return;

    copy_bytes(item.request);
    // Posted before the copy counts as finished, so whoever sees it finished
    // (quiesce above all) can already drain its completion.
    post_completion(item.request.event);
    {
      // One lock per copy while busy: pop this one and take the next.
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
  if (!held) notify_progress();
}

}  // namespace devbridge::host::detail
