// The CUDA backend's class, shared by its source files: cuda_backend.cpp
// (set-up, teardown, describe, the factory), cuda_memory.cpp (device memory
// and the ring), cuda_import.cpp (registered host memory),
// cuda_transfers.cpp (copies, completions, quiesce, the hold, peer copies),
// cuda_fences.cpp (fences and consumer streams), cuda_compute.cpp (the
// kernel and its launch). The design notes (ordering, fences, locks) are at
// the top of cuda_backend.cpp.
#pragma once

#include "devbridge/backends/cuda.hpp"

#include <fmt/format.h>

#include "core/log.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "backends/backend_options.hpp"
#include "backends/cuda/cuda_driver.hpp"
#include "backends/cuda/cuda_ptx.hpp"
#include "devbridge/checked.hpp"

namespace devbridge::cuda::detail {

inline std::string hex(std::uint64_t value) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "0x%llx", static_cast<unsigned long long>(value));
  return buffer;
}

inline std::string describe_event(const CopyEvent& event) {
  return "copy event {domain " + std::to_string(event.domain) + ", generation " + std::to_string(event.generation) +
         ", id " + std::to_string(event.id) + "}";
}

// Pushes the backend's context for the length of one call and pops it again,
// restoring whatever the thread had current before.
class ContextGuard {
 public:
  ContextGuard(const Driver& driver, CUcontext context, Operation operation) : driver_(driver) {
    check(driver, driver.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent", operation);
  }
  ~ContextGuard() {
    CUcontext popped = nullptr;
    driver_.cuCtxPopCurrent_v2(&popped);
  }
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  const Driver& driver_;
};

// Creating and destroying an event per copy or fence costs more than the
// submission itself; events that are done with come back here instead. The
// pool remembers every event it made and not yet destroyed, so teardown
// destroys events still out (a pending copy's, a fence the bridge never gave
// back) as well as the free ones.
class EventPool {
 public:
  // Keeps at most `max_free` events for reuse; beyond that a returned event
  // is destroyed (fences: a burst of them must not pin events for good).
  EventPool(const Driver& driver, std::size_t max_free = std::numeric_limits<std::size_t>::max())
      : driver_(driver), max_free_(max_free) {}
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  // Needs the context current.
  CUevent acquire(Operation operation, std::string_view call = "cuEventCreate") {
    {
      std::lock_guard lock(mutex_);
      if (!free_.empty()) {
        CUevent event = free_.back();
        free_.pop_back();
        return event;
      }
    }
    CUevent event = nullptr;
    check(driver_, driver_.cuEventCreate(&event, CU_EVENT_DISABLE_TIMING), call, operation);
    try {
      std::lock_guard lock(mutex_);
      live_.insert(event);
    } catch (...) {
      destroy(event);
      throw;
    }
    return event;
  }

  // Needs no current context: an event belongs to its own.
  void give_back(CUevent event) noexcept {
    std::lock_guard lock(mutex_);
    if (free_.size() < max_free_) {
      try {
        free_.push_back(event);
        return;
      } catch (...) {
      }
    }
    destroy(event);
    live_.erase(event);
  }

  // Needs the context current.
  void destroy_all() noexcept {
    std::lock_guard lock(mutex_);
    for (CUevent event : live_) destroy(event);
    live_.clear();
    free_.clear();
  }

  // Events made and not destroyed, free ones included.
  std::size_t live() const {
    std::lock_guard lock(mutex_);
    return live_.size();
  }
  // Events made and not yet given back (pending copies, unreleased fences).
  std::size_t out() const {
    std::lock_guard lock(mutex_);
    return live_.size() > free_.size() ? live_.size() - free_.size() : 0;
  }

 private:
  void destroy(CUevent event) noexcept {
    CUresult result = driver_.cuEventDestroy_v2(event);
    if (result != CUDA_SUCCESS)
      devbridge::detail::log().warn("devbridge cuda: {}", driver_.describe_failure("cuEventDestroy", result));
  }

  const Driver& driver_;
  const std::size_t max_free_;
  mutable std::mutex mutex_;
  std::vector<CUevent> free_;
  std::unordered_set<CUevent> live_;
};

// A half-open address range [begin, end); host and device addresses are
// compared only with their own kind.
struct Span {
  std::uintptr_t begin = 0;
  std::uintptr_t end = 0;
  bool overlaps(const Span& other) const noexcept { return begin < other.end && other.begin < end; }
};

struct PendingCopy {
  CopyEvent event;
  CUevent done = nullptr;
  std::uint64_t bytes = 0;
  Span host;
  Span device;
};

struct CopyStream {
  CopyDirection direction;
  const char* call;  // the driver call that enqueues this direction's copies
  Operation operation;
  ErrorKind failure_kind;
  CUstream stream = nullptr;
  std::mutex mutex;
  // Submission order is stream order, so completions arrive front first.
  std::deque<PendingCopy> pending;
  // Launches this stream has been made to wait for (see launches_).
  std::atomic<std::uint64_t> waited_launches{0};
};

class CudaBackend final : public Backend, private TestControls {
 public:
  CudaBackend(const Driver& driver, const Options& options);

  ~CudaBackend() override { tear_down(); }

  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  // ---- Backend -------------------------------------------------------------

  // Capabilities: the pool on by default (cuMemAlloc synchronizes the device
  // and cuMemFree waits for it) with 512-byte parts (device memory is
  // addressed linearly; cuMemAlloc aligns to 256 bytes), the ring
  // page-locked, consumer streams, peer copies, the context.
  BackendInfo describe() override;

  // ---- device memory ----
  DeviceAllocation allocate(std::uint64_t bytes, std::uint64_t alignment) override;

  void free(const DeviceAllocation& allocation) noexcept override;

  // ---- host memory ----
  HostBlock allocate_host(std::uint64_t bytes) override;

  void free_host(const HostBlock& block) noexcept override;

  // A staging import registers the caller's memory for DMA. PORTABLE for the
  // same reason as the ring: it stays page-locked for every context in the
  // process. A read-only one adds READ_ONLY: the driver pins pages it may
  // not write (an immutable object store's mapping), which it refuses
  // without the flag. No adoption (BackendCapabilities::adopt is false).
  HostImport import_host(const ImportRequest& request) override;

  HostBlock register_pages(std::byte* data, std::uint64_t bytes, unsigned int flags);

  void release_import(const HostImport& imported) noexcept override;

  // ---- transfers ----
  void submit_copy(const CopyRequest& request) override;

  void drain_completions(std::vector<Completion>& out) override;

  bool wait_for_completions(std::chrono::nanoseconds timeout) override;

  void quiesce() override;

  // ---- compute ----
  // A fence that cannot be recorded after the kernel is handled by finishing
  // the kernel (cuStreamSynchronize on the compute stream) and then throwing
  // the mapped error: the caller never holds memory a kernel it has no fence
  // for may still touch. The fence's event is taken before the kernel is
  // queued, so running out of events refuses the launch instead.
  Fence launch_axpy(const AxpyLaunch& launch) override;

  // ---- timeline ----
  Fence record_fence(const QueueRef& where) override;

  bool fence_passed(Fence fence) override;

  // cuEventSynchronize has no timeout (and with blocking-sync off it spins a
  // core anyway), so poll: yield briefly for latency, then sleep with backoff.
  bool wait_fence(Fence fence, std::chrono::nanoseconds timeout) override;

  void release_fence(Fence fence) noexcept override;

  // ---- CUDA hooks ------------------------------------------------------------

  // A gate on both copy streams and the compute stream: a host function
  // that blocks the stream until the gate opens. Work queued behind it waits
  // on the device side, so copies stay pending and launches' fences do not
  // pass, while the host goes on submitting.
  void hold(bool on);

  CUcontext context() const noexcept { return context_; }
  std::uint64_t live_allocations() const noexcept override { return live_allocations_.load(std::memory_order_relaxed); }
  std::optional<std::uint64_t> live_registrations() const override {
    return live_registrations_.load(std::memory_order_relaxed);
  }
  bool can_hold_copies() const noexcept override { return true; }
  void hold_copies(bool on) override { hold(on); }
  TestControls* test_controls() noexcept override { return this; }
  void order_consumer_queue(std::uintptr_t queue) override { order_stream(reinterpret_cast<CUstream>(queue)); }

  // Device to device, into `destination_backend`'s allocation when it is a
  // CUDA backend too: cuMemcpyDtoDAsync when both backends share a context
  // (two bridges on one device's primary context), cuMemcpyPeerAsync when
  // they do not (two devices, or a caller's context), on this backend's peer
  // stream with this backend's context pushed. Returns once the bytes have
  // landed.
  //
  // Ordering: an event is recorded on each stream of both backends (upload,
  // download, compute; under each stream's own lock, as record_fence does)
  // and the peer stream waits for them on the device, rather than a host
  // cuStreamSynchronize of those six streams first. Both orders put the copy
  // after everything already submitted to either backend, but a synchronize
  // would also wait for whatever other threads submit while it waits (a
  // steady stream of copies could keep it waiting indefinitely) and would
  // block on each stream in turn; the events capture exactly the work
  // submitted before this call, and the host waits once, for the copy.
  bool copy_to_peer(const DeviceAllocation& source, std::uint64_t source_offset, Backend& destination_backend,
                    const DeviceAllocation& destination, std::uint64_t destination_offset,
                    std::uint64_t len) override;

  void order_stream(CUstream stream);
  // A driver call on a consumer's stream: a stream it does not know (or of
  // another context) is InvalidRange, the caller's; anything else as check().
  void check_consumer_stream_call(CUresult result, const std::string& call);

 private:
  struct LaneState {
    bool pending = false;
    bool ready = false;
  };

  // Events a device-to-device copy waits for (and its own), each with the
  // pool it goes back to: a destination's events are its backend's, made
  // and recorded in its context. Given back however the copy ends; a wait
  // already enqueued on them uses the record it saw when it was enqueued.
  struct PeerEvents {
    std::vector<std::pair<EventPool*, CUevent>> events;
    PeerEvents() = default;
    PeerEvents(const PeerEvents&) = delete;
    PeerEvents& operator=(const PeerEvents&) = delete;
    ~PeerEvents() {
      for (const auto& [pool, event] : events) pool->give_back(event);
    }
    // Never loses the event: given back at once when it cannot be kept.
    void add(EventPool& pool, CUevent event) {
      try {
        events.emplace_back(&pool, event);
      } catch (...) {
        pool.give_back(event);
        throw;
      }
    }
  };

  // Records an event after everything submitted so far on each of this
  // backend's streams (under that stream's own lock, so it lands after what
  // the bookkeeping saw, as record_fence does) into `out`, with this
  // backend's context pushed.
  void record_submitted(PeerEvents& out);

  // A device-to-device copy's failure, whatever call it was: the copy's
  // error (DeviceCopyFailed unless the driver said more, such as an
  // allocation failure), naming both sides and the length; fatal stays fatal.
  static Error peer_copy_error(const Error& error, const std::string& detail);

  struct Gate {
    std::mutex mutex;
    std::condition_variable opened;
    bool open = false;
  };

  static void open(Gate& gate);

  static void wait_at_gate(void* data);

  // A fence's event until it is handed to the bridge: every way out of a
  // failed record gives it back to the pool.
  class FenceEvent {
   public:
    FenceEvent(EventPool& pool, CUevent event) noexcept : pool_(pool), event_(event) {}
    ~FenceEvent() {
      if (event_ != nullptr) pool_.give_back(event_);
    }
    FenceEvent(const FenceEvent&) = delete;
    FenceEvent& operator=(const FenceEvent&) = delete;
    CUevent get() const noexcept { return event_; }
    CUevent release() noexcept { return std::exchange(event_, nullptr); }

   private:
    EventPool& pool_;
    CUevent event_;
  };

  static CUevent event_of(Fence fence) noexcept { return reinterpret_cast<CUevent>(fence.token); }

  // A consumer's stream in DLPack's numbering, which the seam uses: 1 the
  // legacy default stream, 2 the per-thread one (the calling thread's, as in
  // DLPack), any other value a CUstream of this context. 0 is refused: it is
  // the legacy or the per-thread default stream depending on how the
  // consumer was compiled, and guessing wrong frees memory too early.
  static CUstream consumer_stream(std::uintptr_t consumer);

  Fence record_consumer_fence(std::uintptr_t consumer);

  // True when `result` says the context faulted for good: nothing enqueued
  // in it runs any more, so whatever a fence guarded is no longer touched.
  // CUDA_ERROR_UNKNOWN is sticky too, but says nothing about what still runs.
  static bool stopped_by_fault(CUresult result) noexcept;

  // Needs the context current.
  bool query_fence(Fence fence);

  void set_up(const Options& options);

  int ordinal_of(CUdevice device) const;

  // Loads the PTX image for this device (JIT by the driver). Returns a note
  // for describe(). Needs the context current.
  std::string load_kernel();

  CUresult load_module(const std::string& ptx);

  void tear_down() noexcept;

  // A pitched copy: one cuMemcpy2DAsync, ordered and reported like any
  // other copy. Its ordering spans are the whole reach of its rows on each
  // side (padding included): conservative, and one comparison per copy.
  // Out of line, so the contiguous path's code stays as compact as before.
  [[gnu::noinline]] void submit_pitched_copy(CopyStream& lane, const CopyRequest& request);

  // What every copy shares once its ranges are checked: the waits that
  // order it (after the newest launch, after the newest conflicting copy of
  // the other direction), the copy itself (`enqueue_the_copy`, a driver call
  // on lane.stream), its event, and then the pending list (async) or a wait
  // for that event alone (sync). Always inline, so the contiguous path is
  // the same code it was before pitched copies shared this part.
  template <typename EnqueueTheCopy>
  [[gnu::always_inline]] inline void enqueue_copy(CopyStream& lane, const CopyRequest& request, const Span& host_span,
                                                  const Span& device_span, const char* call,
                                                  EnqueueTheCopy&& enqueue_the_copy);

  Error allocation_error(CUresult result, std::string_view call, std::uint64_t bytes, std::uint64_t padded,
                         std::uint64_t alignment);

  Error copy_error(const CopyStream& lane, CUresult result, std::string_view call, const CopyRequest& request);

  // Needs compute_mutex_ and the lane's mutex held: make the lane wait for the
  // newest launch (kernel_done_ is re-recorded only under compute_mutex_).
  void order_after_last_launch(CopyStream& lane);

  // Needs both lanes' mutexes held. Stream order makes the newest
  // conflicting copy of the other lane the only one worth waiting for.
  void order_after_conflicting_copies(CopyStream& lane, const CopyStream& other_lane, const Span& host,
                                      const Span& device);

  // Needs compute_mutex_ held (the marker is shared by launches).
  void record_marker(CopyStream& lane, CUevent marker);

  void drain_lane(CopyStream& lane, std::vector<Completion>& out);

  LaneState peek();

  void wake_waiters();

  // Logs rather than throws: its callers are already failing or quiescing,
  // and a faulted stream reports through its events anyway.
  void synchronize(CUstream stream, const char* which);

  void check_axpy_range(const char* name, const DeviceAllocation& allocation, std::uint64_t offset,
                        std::uint64_t count) const;

  const Driver& driver_;
  CUdevice device_ = 0;
  int ordinal_ = 0;
  CUcontext context_ = nullptr;
  bool owns_primary_context_ = false;
  std::string device_string_;
  std::string device_name_;
  std::uint64_t total_memory_ = 0;
  int compute_capability_ = 0;
  std::string pci_bus_id_;
  int multiprocessors_ = 0;
  std::string notes_;
  std::string jit_log_;

  CopyStream upload_;
  CopyStream download_;
  EventPool events_;  // the copies' events; never more than copies in flight
  EventPool fences_;  // the bridge's fences (tokens are these events)
  std::atomic<bool> fault_logged_{false};

  std::mutex compute_mutex_;
  CUstream compute_ = nullptr;
  CUmodule module_ = nullptr;
  CUfunction axpy_ = nullptr;
  CUevent kernel_done_ = nullptr;      // re-recorded after every launch
  CUevent upload_marker_ = nullptr;    // "everything uploaded so far", for a launch
  CUevent download_marker_ = nullptr;  // "everything downloaded so far"
  std::atomic<std::uint64_t> launches_{0};
  std::atomic<std::uint64_t> live_allocations_{0};
  std::atomic<std::uint64_t> live_registrations_{0};
  // CU_DEVICE_ATTRIBUTE_MAX_PITCH, the largest pitch a 2-D copy may use; 0
  // where the driver does not say (its own refusal is then reported).
  std::uint64_t max_pitch_ = 0;

  std::mutex hold_mutex_;
  std::shared_ptr<Gate> gate_;

  // Device-to-device copies from this backend (copy_to_peer); made on first use.
  std::mutex peer_mutex_;
  CUstream peer_ = nullptr;

  std::mutex waiters_mutex_;
  std::condition_variable waiter_cv_;
  std::atomic<int> waiting_{0};
  std::uint64_t wake_generation_ = 0;  // guarded by waiters_mutex_
};

}  // namespace devbridge::cuda::detail
