// Whether a call may go ahead: the bridge's state bits (restarting, closed,
// broken, fences pending), why it broke, the calls running outside the lock
// that a restart or close must wait for, and the threads asleep until one of
// these changes. Guarded by the bridge's lock; `seen()` alone is read
// without it.
#pragma once

#include <atomic>
#include <new>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "core/fail.hpp"
#include "devbridge/error.hpp"

namespace devbridge::detail {

class BridgeGate;

// The host runtime's lock (BlockingHooks) let go for a wait the bridge's own
// lock is already dropped for, and taken back at the end of the scope.
class RuntimeLockReleased {
 public:
  RuntimeLockReleased() noexcept;
  ~RuntimeLockReleased();
  RuntimeLockReleased(const RuntimeLockReleased&) = delete;
  RuntimeLockReleased& operator=(const RuntimeLockReleased&) = delete;

 private:
  void* released_;
};

class BridgeGate {
 public:
  // Bits of one byte, so that every entry tests them with one compare.
  // FencesPending sends every entry to the slow path while the drop queue
  // holds fences, so that any call reclaims what passed.
  enum Bit : std::uint8_t { kRestarting = 1, kClosed = 2, kBroken = 4, kFencesPending = 8 };

  // Nothing stands in the way: the fast path of every entry.
  [[gnu::always_inline]] bool open() const noexcept { return bits_ == 0; }
  bool restarting() const noexcept { return bits_ & kRestarting; }
  bool closed() const noexcept { return bits_ & kClosed; }
  bool broken() const noexcept { return bits_ & kBroken; }
  bool fences_pending() const noexcept { return bits_ & kFencesPending; }
  void set(Bit bit, bool on) noexcept {
    bits_ = on ? static_cast<std::uint8_t>(bits_ | bit) : static_cast<std::uint8_t>(bits_ & ~bit);
    seen_.store(bits_, std::memory_order_relaxed);
  }
  // The bits as last set, for a look without the lock (an allocation's
  // early refusal); only a hint, the locked entry decides.
  bool seen_closed_or_broken() const noexcept {
    return seen_.load(std::memory_order_relaxed) & (kClosed | kBroken);
  }

  // Broken until restart; the first reason is kept. False when it was broken already.
  bool break_for(std::string reason) {
    if (broken()) return false;
    set(kBroken, true);
    broken_reason_ = std::move(reason);
    return true;
  }
  void mend() noexcept {
    set(kBroken, false);
    broken_reason_.clear();
  }
  const std::string& broken_reason() const noexcept { return broken_reason_; }

  void check_usable() const {
    check_not_closed();
    if (broken()) fail(ErrorKind::Broken, "the bridge is broken ({}); restart it to recover", broken_reason_);
  }
  void check_not_closed() const {
    if (closed()) throw Error(ErrorKind::Closed, "the bridge is closed");
  }

  // ---- sleepers ----
  // Sleeps on the condition variable while `busy()` holds; notify() wakes
  // sleepers only when there are some, so the hot paths never pay for it.
  // Every sleep lets the host runtime's lock go first (BlockingHooks: a
  // Python thread sleeping here with the GIL could deadlock a restart that
  // waits for a callback needing it) and takes it back after, with the
  // bridge's lock dropped meanwhile: a caller re-checks what it waited for.
  template <class Lock, class Busy>
  void block_while(Lock& lock, Busy busy) {
    while (busy()) {
      ++waiters_;
      void* released = release_runtime_lock();
      cv_.wait(lock);
      --waiters_;
      if (released) reacquire_runtime_lock(lock, released);
    }
  }
  // One sleep, until notified or `deadline` (nullopt: notified only).
  template <class Lock, class TimePoint>
  void sleep(Lock& lock, const std::optional<TimePoint>& deadline) {
    ++waiters_;
    void* released = release_runtime_lock();
    if (deadline)
      (void)cv_.wait_until(lock, *deadline);
    else
      cv_.wait(lock);
    --waiters_;
    if (released) reacquire_runtime_lock(lock, released);
  }
  void notify() {
    if (waiters_) cv_.notify_all();
  }

  // BlockingHooks' release, or nullptr without hooks.
  static void* release_runtime_lock() noexcept;
  template <class Lock>
  static void reacquire_runtime_lock(Lock& lock, void* released) {
    lock.unlock();  // never wait for the runtime's lock holding the bridge's
    reacquire_runtime_lock(released);
    lock.lock();
  }
  static void reacquire_runtime_lock(void* released) noexcept;

  // ---- calls outside the lock ----
  // Counted in and out, so a restart or close waits until none runs.
  void call_started() noexcept { ++calls_in_progress_; }
  void call_ended() {
    --calls_in_progress_;
    notify();
  }
  bool calls_running() const noexcept { return calls_in_progress_ != 0; }

  // Runs blocking backend work without the lock. The caller has pinned what
  // the work uses. Returns the backend's error, if any, with the lock held
  // again: whatever the backend throws, the lock is taken back and the call
  // counted out, so a restart waiting for it cannot hang.
  template <class Lock, class Work>
  std::optional<Error> run_unlocked(Lock& lock, Work work) {
    call_started();
    lock.unlock();
    std::optional<Error> failure;
    try {
      work();
    } catch (const Error& e) {
      failure.emplace(e);
    } catch (const std::bad_alloc&) {
      failure.emplace(ErrorKind::AllocationFailed, "the backend ran out of host memory");
    } catch (const std::exception& e) {
      failure.emplace(ErrorKind::Unavailable, fmt::format("the backend threw: {}", e.what()));
    } catch (...) {
      failure.emplace(ErrorKind::Unavailable, "the backend threw an unknown exception");
    }
    lock.lock();
    call_ended();
    return failure;
  }

 private:
  std::uint8_t bits_ = 0;
  std::atomic<std::uint8_t> seen_{0};
  std::string broken_reason_;
  std::uint32_t calls_in_progress_ = 0;
  std::uint32_t waiters_ = 0;
  std::condition_variable_any cv_;
};

}  // namespace devbridge::detail
