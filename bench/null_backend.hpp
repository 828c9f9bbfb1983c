// A backend that does the least the seam allows, so the benchmarks measure the
// bridge's own bookkeeping and nothing else. Bench-only: it is not part of the
// library and not registered with make_backend().
//
// What "least" means here:
//  - allocate hands out a distinct fake address from a counter (the bridge may
//    rely on addresses being distinct) and never touches memory;
//  - free does nothing;
//  - copies move no bytes;
//  - an async copy queues a successful Completion that the next
//    drain_completions hands back, so the bridge observes completion exactly
//    as it would with a real device, through Bridge::poll();
//  - the ring's host block is real memory (the bridge may hand out spans of it).
//
// It is still safe to call from many threads, as the seam requires, but uses a
// one-word spin lock around the completion queue instead of a mutex: the
// critical sections are a push_back or a swap, and the benchmarks are
// single-threaded, so the lock is one uncontended atomic exchange.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include "devbridge/backend.hpp"
#include "devbridge/types.hpp"

namespace devbridge::bench {

class NullBackend final : public Backend {
 public:
  BackendInfo describe() override {
    BackendInfo info;
    info.name = "null";
    info.vendor = "null";
    info.device_name = "null device (benchmarks only)";
    info.device_kind = DeviceKind::Cpu;
    for (const auto& d : all_dtypes()) info.dtypes.push_back(d.dtype);
    info.notes = "moves no bytes; completes every async copy at the next drain";
    return info;
  }

  DeviceAllocation allocate(std::uint64_t bytes, std::uint64_t /*alignment*/) override {
    // Fake addresses a page apart, far from any real mapping; never dereferenced.
    // Each thread takes ids in blocks, so the common case is a plain increment
    // rather than an atomic one: the null backend should cost as little as the
    // reference's, which returns no address at all.
    thread_local IdBlock ids;
    if (ids.next == ids.end) {
      ids.next = next_id_block_.fetch_add(kIdBlock, std::memory_order_relaxed);
      ids.end = ids.next + kIdBlock;
    }
    const std::uint64_t id = ids.next++;
    return DeviceAllocation{kAddressBase + id * kAddressStride, bytes, static_cast<std::uintptr_t>(id)};
  }

  void free(const DeviceAllocation& /*allocation*/) noexcept override {}

  HostBlock allocate_host(std::uint64_t bytes) override {
    auto* data = static_cast<std::byte*>(::operator new(bytes, std::align_val_t{kHostAlignment}));
    return HostBlock{data, bytes, false, 0};
  }

  void free_host(const HostBlock& block) noexcept override {
    ::operator delete(block.data, std::align_val_t{kHostAlignment});
  }

  void submit_copy(const CopyRequest& request) override {
    if (request.mode == CopyMode::Sync) return;  // "done" on return, as Sync requires
    Completion done;
    done.event = request.event;
    SpinGuard guard(queue_lock_);
    queue_.push_back(std::move(done));
  }

  void drain_completions(std::vector<Completion>& out) override {
    SpinGuard guard(queue_lock_);
    if (queue_.empty()) return;
    if (out.empty()) {
      // Hand the whole buffer over and keep the caller's (empty) one, so the two
      // vectors' capacities circulate and nothing is allocated in steady state.
      std::swap(out, queue_);
    } else {
      for (auto& c : queue_) out.push_back(std::move(c));
      queue_.clear();
    }
  }

  bool wait_for_completions(std::chrono::nanoseconds /*timeout*/) override {
    // Completions are ready the moment they are queued; nothing to wait for.
    return true;
  }

  void quiesce() override {}

  // Nothing runs, so every launch and every queue is done at once.
  Fence launch_axpy(const AxpyLaunch& /*launch*/) override { return Fence{}; }
  Fence record_fence(const QueueRef& /*where*/) override { return Fence{}; }
  bool fence_passed(Fence /*fence*/) override { return true; }
  bool wait_fence(Fence /*fence*/, std::chrono::nanoseconds /*timeout*/) override { return true; }
  void release_fence(Fence /*fence*/) noexcept override {}

 private:
  static constexpr std::uint64_t kAddressBase = 0x7e00'0000'0000ull;
  static constexpr std::uint64_t kAddressStride = 4096;
  static constexpr std::size_t kHostAlignment = 4096;
  static constexpr std::uint64_t kIdBlock = 4096;

  struct IdBlock {
    std::uint64_t next = 0;
    std::uint64_t end = 0;
  };
  // Shared by every NullBackend in the process, so addresses never repeat.
  static inline std::atomic<std::uint64_t> next_id_block_{1};

  class SpinGuard {
   public:
    explicit SpinGuard(std::atomic<bool>& lock) : lock_(lock) {
      while (lock_.exchange(true, std::memory_order_acquire)) {
        while (lock_.load(std::memory_order_relaxed)) std::this_thread::yield();
      }
    }
    ~SpinGuard() { lock_.store(false, std::memory_order_release); }
    SpinGuard(const SpinGuard&) = delete;
    SpinGuard& operator=(const SpinGuard&) = delete;

   private:
    std::atomic<bool>& lock_;
  };

  std::atomic<bool> queue_lock_{false};
  std::vector<Completion> queue_;
};

}  // namespace devbridge::bench
