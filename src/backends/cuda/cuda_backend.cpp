// The CUDA backend: device memory from cuMemAlloc, the ring from
// cuMemHostAlloc (and the caller's memory pinned with cuMemHostRegister),
// copies on two non-blocking streams (one per direction, so uploads and
// downloads overlap; a pitched copy is one cuMemcpy2DAsync), one pooled
// event per asynchronous copy, and the compute role on a third stream
// ordered by stream-event waits.
//
// Ordering between the three streams (all on the device, never a host wait):
//   - copies in one direction run in submission order (one stream each);
//   - a copy waits for the newest earlier copy of the other direction whose
//     device or host bytes overlap its own (read-after-write, write-after-
//     read, write-after-write); copies of unrelated bytes never wait for each
//     other, which is what lets uploads and downloads overlap (duplex);
//   - a launch waits for every upload and download submitted before it
//     (so it reads uploaded bytes and never overwrites bytes still being
//     downloaded);
//   - a copy submitted after a launch returns waits for that launch (so a
//     download reads the result, and an upload never overwrites an input the
//     kernel is still reading).
//
// Fences (the seam's Queue/Fence) are CUevents, and a fence's token is its
// CUevent. They come from a pool of their own, apart from the copies' events:
// a fence is the bridge's until release_fence, so its event can never be
// recycled under a copy that still waits on it, nor the other way round.
// kernel_done_ stays a separate event for the copies' ordering for the same
// reason (the bridge may release a launch's fence before a later copy is
// submitted).
//
// Device-to-device copies into another CUDA backend's allocation
// (copy_to_peer) run on a fourth stream, made on first use: after an event
// recorded on each of the six streams of both backends (a stream-event wait,
// never a host wait on their work), then cuMemcpyDtoDAsync within one
// context or cuMemcpyPeerAsync between two, then a host wait for that copy
// alone.
//
// Locks: hold_mutex_ before compute_mutex_ before the lanes' mutexes; a
// submission holds both lanes' mutexes (std::scoped_lock), everything else
// one at a time. peer_mutex_ is only ever held alone.
// Every driver call runs with the backend's context pushed (ContextGuard) and
// popped again before returning, so another library's current context is
// never disturbed.
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

namespace devbridge::cuda {
namespace {

using detail::check;
using detail::Driver;
using detail::make_error;
using detail::Operation;

// cuMemAlloc returns addresses aligned to at least this (CUDA guarantees 256).
constexpr std::uint64_t kDriverAlignment = 256;
constexpr unsigned kAxpyBlockSize = 256;
// Fence events kept for reuse: enough for every fence a busy bridge holds at
// once in steady state; a burst beyond it costs a create and a destroy each.
constexpr std::size_t kFreeFenceEvents = 256;

std::string hex(std::uint64_t value) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "0x%llx", static_cast<unsigned long long>(value));
  return buffer;
}

std::string describe_event(const CopyEvent& event) {
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

class CudaBackend final : public Backend {
 public:
  CudaBackend(const Driver& driver, const Options& options)
      : driver_(driver), events_(driver), fences_(driver, kFreeFenceEvents) {
    upload_.direction = CopyDirection::HostToDevice;
    upload_.call = "cuMemcpyHtoDAsync";
    upload_.operation = Operation::Upload;
    upload_.failure_kind = ErrorKind::DeviceCopyFailed;
    download_.direction = CopyDirection::DeviceToHost;
    download_.call = "cuMemcpyDtoHAsync";
    download_.operation = Operation::Download;
    download_.failure_kind = ErrorKind::OutputCopyFailed;
    try {
      set_up(options);
    } catch (...) {
      tear_down();
      throw;
    }
  }

  ~CudaBackend() override { tear_down(); }

  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  // ---- Backend -------------------------------------------------------------

  // The bridge caches freed buffers: cuMemAlloc synchronizes the device and cuMemFree waits for it.
  bool caches_allocations() const override { return true; }
  // Device memory is addressed linearly (cuMemAlloc aligns to 256 bytes):
  // the pool may hand out parts of one allocation.
  std::uint64_t part_alignment() const override { return 512; }

  BackendInfo describe() override {
    BackendInfo info;
    info.name = "cuda";
    info.vendor = "nvidia";
    info.device_name = device_name_;
    info.device_kind = DeviceKind::Cuda;
    info.device_ordinal = ordinal_;
    info.device_id = std::to_string(ordinal_);
    info.pci_bus_id = pci_bus_id_;
    info.capabilities.push_back(fmt::format("compute capability {}.{}", compute_capability_ / 10, compute_capability_ % 10));
    info.total_memory = total_memory_;
    for (const DTypeInfo& dtype : all_dtypes()) info.dtypes.push_back(dtype.dtype);
    info.host_memory_page_locked = true;
    info.notes = notes_;
    try {
      ContextGuard guard(driver_, context_, Operation::Query);
      std::size_t free_bytes = 0;
      std::size_t total_bytes = 0;
      CUresult result = driver_.cuMemGetInfo_v2(&free_bytes, &total_bytes);
      if (result == CUDA_SUCCESS) {
        info.free_memory = free_bytes;
      } else {
        info.notes += "; cuMemGetInfo failed: " + driver_.error_name(result);
      }
    } catch (const Error& error) {
      info.notes += "; ";
      info.notes += error.what();
    }
    return info;
  }

  DeviceAllocation allocate(std::uint64_t bytes, std::uint64_t alignment) override {
    if (bytes == 0) throw Error(ErrorKind::InvalidExtent, "CUDA allocation of 0 bytes on " + device_string_);
    if (!is_power_of_two(alignment))
      throw Error(ErrorKind::InvalidAlignment,
                  "CUDA allocation alignment " + std::to_string(alignment) + " is not a power of two");
    // Alignments above the driver's are met by over-allocating and rounding
    // the address up; the base stays in the token for cuMemFree.
    std::uint64_t slack = alignment > kDriverAlignment ? alignment - kDriverAlignment : 0;
    ContextGuard guard(driver_, context_, Operation::Allocate);
    for (int attempt = 0; attempt < 2; ++attempt) {
      const auto padded = checked::add(bytes, slack);
      if (!padded)
        throw Error(ErrorKind::AllocationFailed, "CUDA allocation of " + std::to_string(bytes) +
                                                     " bytes aligned to " + std::to_string(alignment) +
                                                     " overflows");
      CUdeviceptr base = 0;
      CUresult result = driver_.cuMemAlloc_v2(&base, *padded);
      if (result != CUDA_SUCCESS) throw allocation_error(result, "cuMemAlloc", bytes, *padded, alignment);
      // The aligned address must leave `bytes` inside the block: it may move
      // at most `slack` past the base (an address that does not even fit in
      // 64 bits when rounded up does not).
      const auto address = checked::align_up(base, alignment);
      if (address && *address - base <= slack) {
        live_allocations_.fetch_add(1, std::memory_order_relaxed);
        return DeviceAllocation{*address, bytes, base};
      }
      // The driver aligned less than it promises: retry with full slack.
      driver_.cuMemFree_v2(base);
      slack = alignment - 1;
    }
    throw Error(ErrorKind::AllocationFailed,
                "cuMemAlloc could not return " + std::to_string(alignment) + "-byte aligned memory");
  }

  void free(const DeviceAllocation& allocation) noexcept override {
    // Counted as gone even if the driver refuses: the bridge never hands this
    // allocation back again.
    live_allocations_.fetch_sub(1, std::memory_order_relaxed);
    try {
      ContextGuard guard(driver_, context_, Operation::Release);
      CUresult result = driver_.cuMemFree_v2(static_cast<CUdeviceptr>(allocation.token));
      if (result != CUDA_SUCCESS)
        devbridge::detail::log().warn("devbridge cuda: {} (allocation {}, {} bytes)", driver_.describe_failure("cuMemFree", result),
                     hex(allocation.address), allocation.bytes);
    } catch (const std::exception& error) {
      devbridge::detail::log().warn("devbridge cuda: cannot free allocation {}: {}", hex(allocation.address), error.what());
    }
  }

  HostBlock allocate_host(std::uint64_t bytes) override {
    if (bytes == 0) throw Error(ErrorKind::InvalidExtent, "page-locked host block of 0 bytes");
    ContextGuard guard(driver_, context_, Operation::Allocate);
    void* data = nullptr;
    // PORTABLE: the ring stays page-locked for every context in the process
    // (tinygrad's, torch's), not only ours.
    CUresult result = driver_.cuMemHostAlloc(&data, bytes, CU_MEMHOSTALLOC_PORTABLE);
    if (result != CUDA_SUCCESS)
      throw make_error(driver_, result, "cuMemHostAlloc", Operation::Allocate,
                       "asked " + std::to_string(bytes) + " bytes of page-locked host memory");
    return HostBlock{static_cast<std::byte*>(data), bytes, true, reinterpret_cast<std::uintptr_t>(data)};
  }

  void free_host(const HostBlock& block) noexcept override {
    if (block.data == nullptr) return;
    try {
      ContextGuard guard(driver_, context_, Operation::Release);
      CUresult result = driver_.cuMemFreeHost(block.data);
      if (result != CUDA_SUCCESS)
        devbridge::detail::log().warn("devbridge cuda: {} ({} bytes)", driver_.describe_failure("cuMemFreeHost", result), block.bytes);
    } catch (const std::exception& error) {
      devbridge::detail::log().warn("devbridge cuda: cannot free the page-locked block: {}", error.what());
    }
  }

  // Registers the caller's memory for DMA. PORTABLE for the same reason as
  // the ring: it stays page-locked for every context in the process.
  HostBlock register_host(std::byte* data, std::uint64_t bytes) override {
    return register_pages(data, bytes, CU_MEMHOSTREGISTER_PORTABLE);
  }
  // READ_ONLY: the driver pins pages it may not write (an immutable object
  // store's mapping), which it refuses without the flag.
  HostBlock register_host_read_only(const std::byte* data, std::uint64_t bytes) override {
    return register_pages(const_cast<std::byte*>(data), bytes,
                          CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY);
  }

  HostBlock register_pages(std::byte* data, std::uint64_t bytes, unsigned int flags) {
    const auto begin = reinterpret_cast<std::uintptr_t>(data);
    if (data == nullptr)
      throw Error(ErrorKind::InvalidRange, "cuMemHostRegister: null host pointer (" + std::to_string(bytes) + " bytes)");
    if (bytes == 0) throw Error(ErrorKind::InvalidExtent, "cuMemHostRegister: 0 bytes at " + hex(begin));
    const auto end = checked::add(begin, bytes);
    if (!end)
      throw Error(ErrorKind::InvalidRange, "cuMemHostRegister: " + std::to_string(bytes) + " bytes at " + hex(begin) +
                                               " reach past the end of the address space");
    ContextGuard guard(driver_, context_, Operation::Allocate);
    CUresult result = driver_.cuMemHostRegister_v2(data, bytes, flags);
    if (result != CUDA_SUCCESS)
      throw make_error(driver_, result, "cuMemHostRegister", Operation::Allocate,
                       "host range [" + hex(begin) + ", " + hex(*end) + ") of " + std::to_string(bytes) + " bytes on " +
                           device_string_);
    live_registrations_.fetch_add(1, std::memory_order_relaxed);
    return HostBlock{data, bytes, true, begin};
  }

  void unregister_host(const HostBlock& block) noexcept override {
    if (block.data == nullptr) return;
    const auto begin = reinterpret_cast<std::uintptr_t>(block.data);
    try {
      ContextGuard guard(driver_, context_, Operation::Release);
      CUresult result = driver_.cuMemHostUnregister(block.data);
      // Counted as gone even if the driver refuses otherwise (the bridge
      // never hands this block back again), but not when the driver says it
      // was never registered: then it was never counted either.
      if (result != CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)
        live_registrations_.fetch_sub(1, std::memory_order_relaxed);
      if (result != CUDA_SUCCESS)
        devbridge::detail::log().warn("devbridge cuda: {} (host range {} of {} bytes)",
                                      driver_.describe_failure("cuMemHostUnregister", result), hex(begin), block.bytes);
    } catch (const std::exception& error) {
      live_registrations_.fetch_sub(1, std::memory_order_relaxed);
      devbridge::detail::log().warn("devbridge cuda: cannot unregister host range {} of {} bytes: {}", hex(begin),
                                    block.bytes, error.what());
    }
  }

  void submit_copy(const CopyRequest& request) override {
    CopyStream& lane = request.direction == CopyDirection::HostToDevice ? upload_ : download_;
    if (request.host == nullptr)
      throw Error(ErrorKind::InvalidRange, std::string(lane.call) + ": null host pointer for " +
                                               describe_event(request.event));
    // The one branch between the shapes: a contiguous copy pays nothing
    // else for pitched ones.
    if (request.layout.pitched()) {
      submit_pitched_copy(lane, request);
      return;
    }
    if (!checked::range_within(request.device_offset, request.len, request.device.bytes))
      throw Error(ErrorKind::InvalidRange, std::string(lane.call) + ": device range [" +
                                               std::to_string(request.device_offset) + ", +" +
                                               std::to_string(request.len) + ") outside allocation " +
                                               hex(request.device.address) + " of " +
                                               std::to_string(request.device.bytes) + " bytes");
    // Inside the allocation (checked above), and the host range inside the
    // ring (checked by the bridge): none of these sums can wrap.
    const CUdeviceptr device = request.device.address + request.device_offset;
    const auto host_begin = reinterpret_cast<std::uintptr_t>(request.host);
    const Span host_span{host_begin, host_begin + request.len};
    const Span device_span{static_cast<std::uintptr_t>(device), static_cast<std::uintptr_t>(device + request.len)};
    enqueue_copy(lane, request, host_span, device_span, lane.call, [&] {
      return lane.direction == CopyDirection::HostToDevice
                 ? driver_.cuMemcpyHtoDAsync_v2(device, request.host, request.len, lane.stream)
                 : driver_.cuMemcpyDtoHAsync_v2(request.host, device, request.len, lane.stream);
    });
  }

  void drain_completions(std::vector<Completion>& out) override {
    ContextGuard guard(driver_, context_, Operation::Query);
    // Passes until one finds nothing: a copy seen complete in one lane may
    // have waited for a copy of the other lane that was still pending when
    // that lane was looked at. Reporting both in the same drain keeps the
    // bridge's view causal (a download is never complete before the upload
    // it read).
    const std::size_t first = out.size();
    for (;;) {
      const std::size_t before = out.size();
      drain_lane(upload_, out);
      drain_lane(download_, out);
      if (out.size() == before) break;
    }
    // A thread asleep in wait_for_completions may be waiting for one of these.
    if (out.size() != first) wake_waiters();
  }

  bool wait_for_completions(std::chrono::nanoseconds timeout) override {
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    const auto deadline = checked::deadline_after(timeout, start);  // saturates: a huge timeout never ends
    ContextGuard guard(driver_, context_, Operation::Query);
    // Spin (yielding) briefly for low latency on small copies, then back off
    // to short sleeps so a long wait does not burn a core.
    constexpr auto kSpinFor = std::chrono::microseconds(50);
    constexpr auto kMaxSleep = std::chrono::microseconds(200);
    auto sleep = std::chrono::microseconds(5);
    bool saw_pending = false;
    for (;;) {
      LaneState state = peek();
      if (state.ready) return true;
      auto now = Clock::now();
      if (now >= deadline) return false;
      // What was pending is gone: another thread drained it. The caller may
      // be waiting for exactly that, so let it look.
      if (saw_pending && !state.pending) return true;
      if (!state.pending) {
        // Nothing in flight: sleep until a submission or a drain (then let
        // the caller look), or the deadline.
        std::unique_lock lock(waiters_mutex_);
        waiting_.fetch_add(1);
        bool woken = true;
        if (!peek().pending) {
          const std::uint64_t seen = wake_generation_;
          const auto changed = [&] { return wake_generation_ != seen; };
          if (deadline == Clock::time_point::max())
            waiter_cv_.wait(lock, changed);
          else
            woken = waiter_cv_.wait_until(lock, deadline, changed);
        }
        waiting_.fetch_sub(1);
        return woken;
      }
      saw_pending = true;
      if (now - start < kSpinFor) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::min<Clock::duration>(sleep, deadline - now));
        sleep = std::min(sleep * 2, kMaxSleep);
      }
    }
  }

  void quiesce() override {
    hold(false);
    ContextGuard guard(driver_, context_, Operation::Query);
    // A failure here is a device fault; the pending events then report it as
    // each copy's completion, so nothing is thrown (and nothing is left
    // running: a faulted context runs nothing more, and fence_passed says
    // so). Every fence on the three streams has passed afterwards; a
    // consumer's stream is not ours to finish.
    {
      std::lock_guard lock(compute_mutex_);
      synchronize(compute_, "compute, quiesce");
    }
    synchronize(upload_.stream, "upload, quiesce");
    synchronize(download_.stream, "download, quiesce");
    // A device-to-device copy waits for its own end before it returns, and
    // the bridge quiesces only once its calls have returned: nothing of
    // ours is left there, but a failed one may have left its waits.
    std::lock_guard peer_lock(peer_mutex_);
    if (peer_ != nullptr) synchronize(peer_, "peer copies, quiesce");
  }

  // A fence that cannot be recorded after the kernel is handled by finishing
  // the kernel (cuStreamSynchronize on the compute stream) and then throwing
  // the mapped error: the caller never holds memory a kernel it has no fence
  // for may still touch. The fence's event is taken before the kernel is
  // queued, so running out of events refuses the launch instead.
  Fence launch_axpy(const AxpyLaunch& launch) override {
    if (launch.count == 0) return Fence{};  // nothing is queued: nothing to wait for
    check_axpy_range("x", launch.x, launch.x_offset, launch.count);
    check_axpy_range("y", launch.y, launch.y_offset, launch.count);
    // Both ranges lie inside their allocations (checked above): no wrap.
    CUdeviceptr x = launch.x.address + launch.x_offset;
    CUdeviceptr y = launch.y.address + launch.y_offset;
    unsigned long long count = launch.count;
    float a = launch.a;
    float b = launch.b;
    void* arguments[] = {&x, &y, &count, &a, &b};
    const unsigned long long wanted_blocks = count / kAxpyBlockSize + (count % kAxpyBlockSize != 0 ? 1 : 0);
    const unsigned blocks = static_cast<unsigned>(
        std::min<unsigned long long>(wanted_blocks, static_cast<unsigned long long>(multiprocessors_) * 16));

    ContextGuard guard(driver_, context_, Operation::Launch);
    FenceEvent fence(fences_, fences_.acquire(Operation::Launch, "cuEventCreate(launch fence)"));
    std::lock_guard compute_lock(compute_mutex_);
    // Wait (on the device) for everything already submitted on both lanes.
    record_marker(upload_, upload_marker_);
    record_marker(download_, download_marker_);
    check(driver_, driver_.cuStreamWaitEvent(compute_, upload_marker_, 0), "cuStreamWaitEvent(compute after uploads)",
          Operation::Launch);
    check(driver_, driver_.cuStreamWaitEvent(compute_, download_marker_, 0),
          "cuStreamWaitEvent(compute after downloads)", Operation::Launch);
    check(driver_,
          driver_.cuLaunchKernel(axpy_, blocks, 1, 1, kAxpyBlockSize, 1, 1, 0, compute_, arguments, nullptr),
          "cuLaunchKernel(" + std::string(detail::kAxpyKernelName) + ", " + std::to_string(count) + " elements)",
          Operation::Launch);
    for (auto [event, call] : {std::pair{kernel_done_, "cuEventRecord(after kernel)"},
                               std::pair{fence.get(), "cuEventRecord(launch fence)"}}) {
      CUresult recorded = driver_.cuEventRecord(event, compute_);
      if (recorded != CUDA_SUCCESS) {
        // Later copies could not be ordered after this kernel, or its end
        // could not be reported: finish it now.
        synchronize(compute_, "compute, after a failed cuEventRecord");
        throw make_error(driver_, recorded, call, Operation::Launch);
      }
    }
    launches_.fetch_add(1, std::memory_order_release);
    return Fence{reinterpret_cast<std::uintptr_t>(fence.release())};
  }

  Fence record_fence(const QueueRef& where) override {
    if (where.queue == Queue::Consumer) return record_consumer_fence(where.consumer);
    ContextGuard guard(driver_, context_, Operation::Query);
    FenceEvent fence(fences_, fences_.acquire(Operation::Query, "cuEventCreate(fence)"));
    // The queue's own lock: a fence lands after everything this backend has
    // enqueued there, in the same order its bookkeeping saw.
    CUresult recorded = CUDA_SUCCESS;
    const char* call = nullptr;
    switch (where.queue) {
      case Queue::CopyUp:
      case Queue::CopyDown: {
        CopyStream& lane = where.queue == Queue::CopyUp ? upload_ : download_;
        std::lock_guard lock(lane.mutex);
        recorded = driver_.cuEventRecord(fence.get(), lane.stream);
        call = where.queue == Queue::CopyUp ? "cuEventRecord(fence on the upload stream)"
                                            : "cuEventRecord(fence on the download stream)";
        break;
      }
      case Queue::Compute: {
        std::lock_guard lock(compute_mutex_);
        recorded = driver_.cuEventRecord(fence.get(), compute_);
        call = "cuEventRecord(fence on the compute stream)";
        break;
      }
      case Queue::Consumer:
        break;  // handled above
    }
    if (call == nullptr)
      throw Error(ErrorKind::InvalidRange,
                  "CUDA fence on an unknown queue " + std::to_string(static_cast<int>(where.queue)));
    if (recorded != CUDA_SUCCESS) throw make_error(driver_, recorded, call, Operation::Query);
    return Fence{reinterpret_cast<std::uintptr_t>(fence.release())};
  }

  bool fence_passed(Fence fence) override {
    if (!fence.pending()) return true;
    ContextGuard guard(driver_, context_, Operation::Query);
    return query_fence(fence);
  }

  // cuEventSynchronize has no timeout (and with blocking-sync off it spins a
  // core anyway), so poll: yield briefly for latency, then sleep with backoff.
  bool wait_fence(Fence fence, std::chrono::nanoseconds timeout) override {
    if (!fence.pending()) return true;
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    const auto deadline = checked::deadline_after(timeout, start);  // saturates: nanoseconds::max() never ends
    constexpr auto kSpinFor = std::chrono::microseconds(50);
    constexpr auto kMaxSleep = std::chrono::milliseconds(1);
    auto sleep = std::chrono::microseconds(5);
    ContextGuard guard(driver_, context_, Operation::Query);
    for (;;) {
      if (query_fence(fence)) return true;
      const auto now = Clock::now();
      if (now >= deadline) return false;
      if (now - start < kSpinFor) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::min<Clock::duration>(sleep, deadline - now));
        sleep = std::min<std::chrono::microseconds>(sleep * 2, kMaxSleep);
      }
    }
  }

  void release_fence(Fence fence) noexcept override {
    if (!fence.pending()) return;
    fences_.give_back(event_of(fence));
  }

  // ---- CUDA hooks ------------------------------------------------------------

  // A gate on both copy streams and the compute stream: a host function
  // that blocks the stream until the gate opens. Work queued behind it waits
  // on the device side, so copies stay pending and launches' fences do not
  // pass, while the host goes on submitting.
  void hold(bool on) {
    std::lock_guard lock(hold_mutex_);
    if (on == (gate_ != nullptr)) return;
    if (!on) {
      open(*gate_);
      gate_.reset();
      return;
    }
    auto gate = std::make_shared<Gate>();
    ContextGuard guard(driver_, context_, Operation::Query);
    // Under the streams' own locks, so nothing submitted after hold()
    // returns can slip in front of the gate.
    std::lock_guard compute_lock(compute_mutex_);
    std::scoped_lock lanes_lock(upload_.mutex, download_.mutex);
    for (CUstream stream : {upload_.stream, download_.stream, compute_}) {
      auto holder = std::make_unique<std::shared_ptr<Gate>>(gate);
      CUresult result = driver_.cuLaunchHostFunc(stream, &CudaBackend::wait_at_gate, holder.get());
      if (result != CUDA_SUCCESS) {
        open(*gate);  // lets the streams already gated go again
        throw make_error(driver_, result, "cuLaunchHostFunc(hold)", Operation::Query);
      }
      holder.release();  // the host function owns it now
    }
    gate_ = std::move(gate);
  }

  CUcontext context() const noexcept { return context_; }
  std::uint64_t live_allocations() const noexcept override { return live_allocations_.load(std::memory_order_relaxed); }
  void hold_copies(bool on) override { hold(on); }
  std::uintptr_t native_context() override { return reinterpret_cast<std::uintptr_t>(context()); }
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
                    std::uint64_t len) override {
    // Bounds first, whatever the destination: only ranges inside their
    // allocations give addresses that cannot wrap.
    if (!checked::range_within(source_offset, len, source.bytes))
      throw Error(ErrorKind::InvalidRange, "device-to-device copy: source range [" + std::to_string(source_offset) +
                                               ", +" + std::to_string(len) + ") outside allocation " +
                                               hex(source.address) + " of " + std::to_string(source.bytes) +
                                               " bytes on " + device_string_);
    if (!checked::range_within(destination_offset, len, destination.bytes))
      throw Error(ErrorKind::InvalidRange, "device-to-device copy: destination range [" +
                                               std::to_string(destination_offset) + ", +" + std::to_string(len) +
                                               ") outside allocation " + hex(destination.address) + " of " +
                                               std::to_string(destination.bytes) + " bytes");
    auto* peer = dynamic_cast<CudaBackend*>(&destination_backend);
    if (peer == nullptr) return false;  // another kind of device: the caller stages through the host
    if (len == 0) return true;
    const CUdeviceptr from = source.address + source_offset;
    const CUdeviceptr to = destination.address + destination_offset;
    const bool same_context = peer->context_ == context_;
    const auto detail = [&] {
      return "device-to-device copy of " + std::to_string(len) + " bytes from " + device_string_ + " " + hex(from) +
             " (allocation " + hex(source.address) + "+" + std::to_string(source_offset) + ") to " +
             peer->device_string_ + " " + hex(to) + " (allocation " + hex(destination.address) + "+" +
             std::to_string(destination_offset) + ")" + (same_context ? ", one context" : ", between contexts");
    };
    PeerEvents events;
    try {
      ContextGuard guard(driver_, context_, Operation::Upload);
      // Everything already submitted to either backend, then the copy.
      record_submitted(events);
      if (peer != this) peer->record_submitted(events);
      CUevent done = events_.acquire(Operation::Upload, "cuEventCreate(device-to-device copy)");
      events.add(events_, done);
      {
        std::lock_guard peer_lock(peer_mutex_);
        if (peer_ == nullptr)
          check(driver_, driver_.cuStreamCreate(&peer_, CU_STREAM_NON_BLOCKING), "cuStreamCreate(peer copies)",
                Operation::Upload);
        for (const auto& [pool, event] : events.events) {
          if (event == done) continue;
          check(driver_, driver_.cuStreamWaitEvent(peer_, event, 0),
                "cuStreamWaitEvent(device-to-device copy after submitted work)", Operation::Upload);
        }
        const CUresult copied = same_context
                                    ? driver_.cuMemcpyDtoDAsync_v2(to, from, len, peer_)
                                    : driver_.cuMemcpyPeerAsync(to, peer->context_, from, context_, len, peer_);
        check(driver_, copied, same_context ? "cuMemcpyDtoDAsync" : "cuMemcpyPeerAsync", Operation::Upload);
        const CUresult recorded = driver_.cuEventRecord(done, peer_);
        if (recorded != CUDA_SUCCESS) {
          // The copy may be running with nothing to report its end: let it
          // finish before the caller gets its allocations back.
          synchronize(peer_, "peer copies, after a failed cuEventRecord");
          check(driver_, recorded, "cuEventRecord(after device-to-device copy)", Operation::Upload);
        }
      }
      // Only this copy (and the waits before it): work submitted meanwhile
      // on either backend is not waited for.
      const CUresult finished = driver_.cuEventSynchronize(done);
      if (finished != CUDA_SUCCESS) {
        synchronize(peer_, "peer copies, after a failed cuEventSynchronize");
        check(driver_, finished, "cuEventSynchronize(device-to-device copy)", Operation::Upload);
      }
    } catch (const Error& error) {
      throw peer_copy_error(error, detail());
    }
    return true;
  }

  void order_stream(CUstream stream) {
    ContextGuard guard(driver_, context_, Operation::Query);
    std::lock_guard compute_lock(compute_mutex_);
    record_marker(upload_, upload_marker_);
    record_marker(download_, download_marker_);
    for (CUevent marker : {upload_marker_, download_marker_}) {
      check(driver_, driver_.cuStreamWaitEvent(stream, marker, 0), "cuStreamWaitEvent(consumer stream)",
            Operation::Query);
    }
    if (launches_.load(std::memory_order_relaxed) > 0) {
      check(driver_, driver_.cuStreamWaitEvent(stream, kernel_done_, 0), "cuStreamWaitEvent(consumer stream)",
            Operation::Query);
    }
  }

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
  void record_submitted(PeerEvents& out) {
    ContextGuard guard(driver_, context_, Operation::Upload);
    const auto record = [&](CUstream stream, std::mutex& mutex, const std::string& call) {
      CUevent event = events_.acquire(Operation::Upload, "cuEventCreate(device-to-device ordering)");
      out.add(events_, event);
      std::lock_guard lock(mutex);
      check(driver_, driver_.cuEventRecord(event, stream), call, Operation::Upload);
    };
    record(upload_.stream, upload_.mutex, "cuEventRecord(after the uploads of " + device_string_ + ")");
    record(download_.stream, download_.mutex, "cuEventRecord(after the downloads of " + device_string_ + ")");
    record(compute_, compute_mutex_, "cuEventRecord(after the launches of " + device_string_ + ")");
  }

  // A device-to-device copy's failure, whatever call it was: the copy's
  // error (DeviceCopyFailed unless the driver said more, such as an
  // allocation failure), naming both sides and the length; fatal stays fatal.
  static Error peer_copy_error(const Error& error, const std::string& detail) {
    ErrorKind kind = error.kind();
    if (kind == ErrorKind::Unavailable || kind == ErrorKind::Unsupported || kind == ErrorKind::Broken)
      kind = ErrorKind::DeviceCopyFailed;
    return Error(kind, std::string(error.message()) + "; " + detail, error.fatal());
  }

  struct Gate {
    std::mutex mutex;
    std::condition_variable opened;
    bool open = false;
  };

  static void open(Gate& gate) {
    {
      std::lock_guard gate_lock(gate.mutex);
      gate.open = true;
    }
    gate.opened.notify_all();
  }

  static void CUDA_CB wait_at_gate(void* data) {
    std::unique_ptr<std::shared_ptr<Gate>> holder(static_cast<std::shared_ptr<Gate>*>(data));
    Gate& gate = **holder;
    std::unique_lock lock(gate.mutex);
    gate.opened.wait(lock, [&] { return gate.open; });
  }

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
  static CUstream consumer_stream(std::uintptr_t consumer) {
    switch (consumer) {
      case 0:
        throw Error(ErrorKind::InvalidRange,
                    "CUDA consumer stream 0 is ambiguous (the legacy or the per-thread default stream, depending "
                    "on how the consumer was built); pass 1 for the legacy default stream, 2 for the per-thread "
                    "one, or a CUstream");
      case 1:
        return CU_STREAM_LEGACY;
      case 2:
        return CU_STREAM_PER_THREAD;
      default:
        return reinterpret_cast<CUstream>(consumer);
    }
  }

  Fence record_consumer_fence(std::uintptr_t consumer) {
    CUstream stream = consumer_stream(consumer);
    ContextGuard guard(driver_, context_, Operation::Query);
    FenceEvent fence(fences_, fences_.acquire(Operation::Query, "cuEventCreate(consumer fence)"));
    // Not the backend's stream: no lock of ours orders it.
    CUresult recorded = driver_.cuEventRecord(fence.get(), stream);
    if (recorded != CUDA_SUCCESS) {
      Error mapped = make_error(driver_, recorded, "cuEventRecord(fence on consumer stream " + hex(consumer) + ")",
                                Operation::Query);
      // A stream the driver does not know, or one of another context, is the
      // caller's mistake, not an unavailable device.
      if (!mapped.fatal() && (recorded == CUDA_ERROR_INVALID_HANDLE || recorded == CUDA_ERROR_INVALID_VALUE ||
                              recorded == CUDA_ERROR_INVALID_CONTEXT))
        throw Error(ErrorKind::InvalidRange,
                    std::string(mapped.message()) + " (not a stream of " + device_string_ + "'s context?)");
      throw mapped;
    }
    return Fence{reinterpret_cast<std::uintptr_t>(fence.release())};
  }

  // True when `result` says the context faulted for good: nothing enqueued
  // in it runs any more, so whatever a fence guarded is no longer touched.
  // CUDA_ERROR_UNKNOWN is sticky too, but says nothing about what still runs.
  static bool stopped_by_fault(CUresult result) noexcept {
    return result != CUDA_ERROR_UNKNOWN && detail::is_sticky(static_cast<int>(result));
  }

  // Needs the context current.
  bool query_fence(Fence fence) {
    const CUresult result = driver_.cuEventQuery(event_of(fence));
    if (result == CUDA_SUCCESS) return true;
    if (result == CUDA_ERROR_NOT_READY) return false;
    if (stopped_by_fault(result)) {
      if (!fault_logged_.exchange(true))
        devbridge::detail::log().error(
            "devbridge cuda: {}: {} faulted; its fences count as passed from now on (nothing in it runs any more)",
            driver_.describe_failure("cuEventQuery(fence)", result), device_string_);
      return true;
    }
    // Whether the work before the fence still runs is unknown: the bridge
    // must keep the memory and stop trusting the device.
    const Error mapped = make_error(driver_, result, "cuEventQuery(fence)", Operation::Query,
                                    "whether the work before the fence still runs is unknown");
    throw Error(mapped.kind(), mapped.message(), true);
  }

  void set_up(const Options& options) {
    if (options.context != nullptr) {
      context_ = static_cast<CUcontext>(options.context);
      ContextGuard guard(driver_, context_, Operation::Setup);
      check(driver_, driver_.cuCtxGetDevice(&device_), "cuCtxGetDevice(caller's context)", Operation::Setup);
      ordinal_ = ordinal_of(device_);
    } else {
      check(driver_, driver_.cuDeviceGet(&device_, options.ordinal),
            "cuDeviceGet(" + std::to_string(options.ordinal) + ")", Operation::Setup);
      ordinal_ = options.ordinal;
      check(driver_, driver_.cuDevicePrimaryCtxRetain(&context_, device_), "cuDevicePrimaryCtxRetain",
            Operation::Setup);
      owns_primary_context_ = true;
    }
    device_string_ = "CUDA:" + std::to_string(ordinal_);

    char name[256] = {};
    if (driver_.cuDeviceGetName(name, sizeof name - 1, device_) == CUDA_SUCCESS) device_name_ = name;
    std::size_t total = 0;
    if (driver_.cuDeviceTotalMem_v2(&total, device_) == CUDA_SUCCESS) total_memory_ = total;
    int major = 0;
    int minor = 0;
    check(driver_, driver_.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device_),
          "cuDeviceGetAttribute(compute capability)", Operation::Setup);
    check(driver_, driver_.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device_),
          "cuDeviceGetAttribute(compute capability)", Operation::Setup);
    if (driver_.cuDeviceGetAttribute(&multiprocessors_, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device_) !=
            CUDA_SUCCESS ||
        multiprocessors_ <= 0)
      multiprocessors_ = 16;
    int max_pitch = 0;
    if (driver_.cuDeviceGetAttribute(&max_pitch, CU_DEVICE_ATTRIBUTE_MAX_PITCH, device_) == CUDA_SUCCESS && max_pitch > 0)
      max_pitch_ = static_cast<std::uint64_t>(max_pitch);
    compute_capability_ = major * 10 + minor;
    // The bus id, where the driver reports it (an emulated one may not: then
    // none is shown, and nothing else depends on it).
    int domain = 0, bus = 0, slot = 0;
    if (driver_.cuDeviceGetAttribute(&domain, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, device_) == CUDA_SUCCESS &&
        driver_.cuDeviceGetAttribute(&bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, device_) == CUDA_SUCCESS &&
        driver_.cuDeviceGetAttribute(&slot, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, device_) == CUDA_SUCCESS)
      pci_bus_id_ = fmt::format("{:04x}:{:02x}:{:02x}.0", domain, bus, slot);

    ContextGuard guard(driver_, context_, Operation::Setup);
    check(driver_, driver_.cuStreamCreate(&upload_.stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate(upload)",
          Operation::Setup);
    check(driver_, driver_.cuStreamCreate(&download_.stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate(download)",
          Operation::Setup);
    check(driver_, driver_.cuStreamCreate(&compute_, CU_STREAM_NON_BLOCKING), "cuStreamCreate(compute)",
          Operation::Setup);
    for (CUevent* event : {&kernel_done_, &upload_marker_, &download_marker_}) {
      check(driver_, driver_.cuEventCreate(event, CU_EVENT_DISABLE_TIMING), "cuEventCreate", Operation::Setup);
    }
    std::string kernel_note = load_kernel();

    notes_ = "driver " + std::to_string(driver_.driver_version / 1000) + "." +
             std::to_string(driver_.driver_version % 1000 / 10) + " (" + driver_.path + "), compute capability " +
             std::to_string(major) + "." + std::to_string(minor) + ", " + std::to_string(multiprocessors_) +
             " SMs, " + kernel_note + ", " +
             (owns_primary_context_ ? "primary context" : "caller's context");
  }

  int ordinal_of(CUdevice device) const {
    int count = 0;
    if (driver_.cuDeviceGetCount(&count) == CUDA_SUCCESS) {
      for (int ordinal = 0; ordinal < count; ++ordinal) {
        CUdevice candidate = 0;
        if (driver_.cuDeviceGet(&candidate, ordinal) == CUDA_SUCCESS && candidate == device) return ordinal;
      }
    }
    return static_cast<int>(device);
  }

  // Loads the PTX image for this device (JIT by the driver). Returns a note
  // for describe(). Needs the context current.
  std::string load_kernel() {
    const detail::PtxImage* image = detail::select_ptx(compute_capability_);
    if (image == nullptr)
      throw Error(ErrorKind::Unsupported,
                  device_string_ + " (" + device_name_ + ") has compute capability " +
                      std::to_string(compute_capability_ / 10) + "." + std::to_string(compute_capability_ % 10) +
                      "; this build's kernel needs " +
                      std::to_string(detail::embedded_ptx().front().compute_capability / 10) + "." +
                      std::to_string(detail::embedded_ptx().front().compute_capability % 10) + " or newer");
    std::string note = "kernel JIT from compute_" + std::to_string(image->compute_capability) + " PTX";
    std::string text(image->text);
    CUresult result = load_module(text);
    if (result == CUDA_ERROR_UNSUPPORTED_PTX_VERSION) {
      // The driver predates the toolkit that wrote the PTX. The kernel uses
      // nothing newer than its target's ISA, so declare the driver's newest.
      const int driver_isa = detail::max_ptx_isa_for_driver(driver_.driver_version);
      const int image_isa = detail::ptx_isa_version(text);
      if (driver_isa > 0 && driver_isa < image_isa) {
        text = detail::with_ptx_isa_version(text, driver_isa);
        result = load_module(text);
        note += " (ISA lowered to " + std::to_string(driver_isa / 10) + "." + std::to_string(driver_isa % 10) +
                " for this driver)";
      }
    }
    if (result != CUDA_SUCCESS)
      throw make_error(driver_, result, "cuModuleLoadDataEx(compute_" + std::to_string(image->compute_capability) +
                                            " PTX)",
                       Operation::Setup, jit_log_.empty() ? std::string() : "JIT log: " + jit_log_);
    check(driver_, driver_.cuModuleGetFunction(&axpy_, module_, detail::kAxpyKernelName), "cuModuleGetFunction",
          Operation::Setup);
    return note;
  }

  CUresult load_module(const std::string& ptx) {
    char log[4096] = {};
    CUjit_option options[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
    void* values[] = {log, reinterpret_cast<void*>(static_cast<std::uintptr_t>(sizeof log - 1))};
    CUresult result = driver_.cuModuleLoadDataEx(&module_, ptx.c_str(), 2, options, values);
    jit_log_ = log;
    if (result != CUDA_SUCCESS) module_ = nullptr;
    return result;
  }

  void tear_down() noexcept {
    if (context_ == nullptr) return;
    try {
      hold(false);
    } catch (...) {
    }
    CUcontext popped = nullptr;
    if (driver_.cuCtxPushCurrent_v2(context_) == CUDA_SUCCESS) {
      // Nothing may still run on memory the owner is about to free.
      for (CUstream stream : {compute_, upload_.stream, download_.stream, peer_}) {
        if (stream != nullptr) driver_.cuStreamSynchronize(stream);
      }
      for (CopyStream* lane : {&upload_, &download_}) lane->pending.clear();
      // The pools destroy their events still out too (pending copies'; fences
      // the bridge never gave back, which it must not ask about any more).
      if (const std::uint64_t registered = live_registrations_.load(std::memory_order_relaxed))
        devbridge::detail::log().warn("devbridge cuda: {} host registration(s) never unregistered", registered);
      if (const std::size_t unreleased = fences_.out())
        devbridge::detail::log().warn("devbridge cuda: {} fence(s) never released; destroyed with the backend",
                                      unreleased);
      events_.destroy_all();
      fences_.destroy_all();
      for (CUevent event : {kernel_done_, upload_marker_, download_marker_}) {
        if (event != nullptr) driver_.cuEventDestroy_v2(event);
      }
      for (CUstream stream : {compute_, upload_.stream, download_.stream, peer_}) {
        if (stream != nullptr) driver_.cuStreamDestroy_v2(stream);
      }
      if (module_ != nullptr) driver_.cuModuleUnload(module_);
      driver_.cuCtxPopCurrent_v2(&popped);
    }
    kernel_done_ = upload_marker_ = download_marker_ = nullptr;
    compute_ = upload_.stream = download_.stream = peer_ = nullptr;
    module_ = nullptr;
    if (owns_primary_context_) driver_.cuDevicePrimaryCtxRelease_v2(device_);
    owns_primary_context_ = false;
    context_ = nullptr;
  }

  // A pitched copy: one cuMemcpy2DAsync, ordered and reported like any
  // other copy. Its ordering spans are the whole reach of its rows on each
  // side (padding included): conservative, and one comparison per copy.
  // Out of line, so the contiguous path's code stays as compact as before.
  [[gnu::noinline]] void submit_pitched_copy(CopyStream& lane, const CopyRequest& request) {
    const CopyLayout& layout = request.layout;
    const char* call = lane.direction == CopyDirection::HostToDevice ? "cuMemcpy2DAsync(host to device)"
                                                                     : "cuMemcpy2DAsync(device to host)";
    // The spans refuse rows that would overlap or reach past 2^64.
    const std::uint64_t device_reach = layout_device_span(layout);
    const std::uint64_t host_reach = layout_host_span(layout);
    // Spelled out only for an error: a copy that goes through builds no text.
    const auto shape = [&] {
      return std::to_string(layout.rows) + " rows of " + std::to_string(layout.row_bytes) + " bytes (host pitch " +
             std::to_string(layout.host_pitch) + ", device pitch " + std::to_string(layout.device_pitch) + ")";
    };
    if (layout_bytes_moved(layout) != request.len)
      throw Error(ErrorKind::InvalidRange, std::string(call) + ": " + std::to_string(request.len) +
                                               " bytes asked, but " + shape() + " move " +
                                               std::to_string(layout_bytes_moved(layout)));
    if (!checked::range_within(request.device_offset, device_reach, request.device.bytes))
      throw Error(ErrorKind::InvalidRange, std::string(call) + ": device range [" +
                                               std::to_string(request.device_offset) + ", +" +
                                               std::to_string(device_reach) + ") of " + shape() +
                                               " outside allocation " + hex(request.device.address) + " of " +
                                               std::to_string(request.device.bytes) + " bytes");
    const auto host_begin = reinterpret_cast<std::uintptr_t>(request.host);
    const auto host_end = checked::add(host_begin, host_reach);
    if (!host_end)
      throw Error(ErrorKind::InvalidRange, std::string(call) + ": host range at " + hex(host_begin) + " of " + shape() +
                                               " reaches past the end of the address space");
    // One row has no pitch to speak of; the driver still wants one of at
    // least a row.
    const std::uint64_t host_pitch = layout.rows == 1 ? layout.row_bytes : layout.host_pitch;
    const std::uint64_t device_pitch = layout.rows == 1 ? layout.row_bytes : layout.device_pitch;
    // The driver refuses pitches above its maximum; say which and why
    // before anything is queued.
    for (auto [pitch, side] : {std::pair{host_pitch, "host"}, std::pair{device_pitch, "device"}}) {
      if (max_pitch_ != 0 && pitch > max_pitch_)
        throw Error(ErrorKind::InvalidRange, std::string(call) + ": " + side + " pitch of " + std::to_string(pitch) +
                                                 " bytes exceeds " + device_string_ + "'s maximum of " +
                                                 std::to_string(max_pitch_) + " (" + shape() +
                                                 "); copy the rows separately");
    }
    // Inside the allocation (checked above): no wrap.
    const CUdeviceptr device = request.device.address + request.device_offset;

    CUDA_MEMCPY2D params{};
    params.WidthInBytes = layout.row_bytes;
    params.Height = layout.rows;
    if (lane.direction == CopyDirection::HostToDevice) {
      params.srcMemoryType = CU_MEMORYTYPE_HOST;
      params.srcHost = request.host;
      params.srcPitch = host_pitch;
      params.dstMemoryType = CU_MEMORYTYPE_DEVICE;
      params.dstDevice = device;
      params.dstPitch = device_pitch;
    } else {
      params.srcMemoryType = CU_MEMORYTYPE_DEVICE;
      params.srcDevice = device;
      params.srcPitch = device_pitch;
      params.dstMemoryType = CU_MEMORYTYPE_HOST;
      params.dstHost = request.host;
      params.dstPitch = host_pitch;
    }
    const Span host_span{host_begin, *host_end};
    const Span device_span{static_cast<std::uintptr_t>(device), static_cast<std::uintptr_t>(device + device_reach)};
    enqueue_copy(lane, request, host_span, device_span, call,
                 [&] { return driver_.cuMemcpy2DAsync_v2(&params, lane.stream); });
  }

  // What every copy shares once its ranges are checked: the waits that
  // order it (after the newest launch, after the newest conflicting copy of
  // the other direction), the copy itself (`enqueue_the_copy`, a driver call
  // on lane.stream), its event, and then the pending list (async) or a wait
  // for that event alone (sync). Always inline, so the contiguous path is
  // the same code it was before pitched copies shared this part.
  template <typename EnqueueTheCopy>
  [[gnu::always_inline]] inline void enqueue_copy(CopyStream& lane, const CopyRequest& request, const Span& host_span,
                                                  const Span& device_span, const char* call,
                                                  EnqueueTheCopy&& enqueue_the_copy) {
    CopyStream& other_lane = &lane == &upload_ ? download_ : upload_;
    ContextGuard guard(driver_, context_, lane.operation);
    CUevent done = events_.acquire(lane.operation);
    bool queued = false;
    try {
      std::unique_lock<std::mutex> compute_lock;
      const std::uint64_t launches = launches_.load(std::memory_order_acquire);
      if (launches != lane.waited_launches.load(std::memory_order_relaxed)) compute_lock = std::unique_lock(compute_mutex_);
      // Both lanes: the other lane's pending list is read, and its events
      // must not be recycled before this lane's wait on them is enqueued.
      std::scoped_lock lanes_lock(upload_.mutex, download_.mutex);
      if (compute_lock.owns_lock()) {
        order_after_last_launch(lane);
        compute_lock.unlock();
      }
      order_after_conflicting_copies(lane, other_lane, host_span, device_span);
      if (request.len > 0) {
        CUresult result = enqueue_the_copy();
        if (result != CUDA_SUCCESS) throw copy_error(lane, result, call, request);
      }
      CUresult recorded = driver_.cuEventRecord(done, lane.stream);
      if (recorded != CUDA_SUCCESS) {
        // The copy may be running with nothing to report its end: let it
        // finish before the caller gets its range back.
        driver_.cuStreamSynchronize(lane.stream);
        throw copy_error(lane, recorded, "cuEventRecord", request);
      }
      if (request.mode == CopyMode::Async) {
        lane.pending.push_back(PendingCopy{request.event, done, request.len, host_span, device_span});
        queued = true;
      }
    } catch (...) {
      events_.give_back(done);
      throw;
    }
    if (queued) {
      wake_waiters();
      return;
    }
    // Sync: the copy is ordered like any other; wait for this one alone.
    CUresult result = driver_.cuEventSynchronize(done);
    events_.give_back(done);
    if (result != CUDA_SUCCESS) throw copy_error(lane, result, "cuEventSynchronize", request);
  }

  Error allocation_error(CUresult result, std::string_view call, std::uint64_t bytes, std::uint64_t padded,
                         std::uint64_t alignment) {
    std::string detail = "asked " + std::to_string(bytes) + " bytes (alignment " + std::to_string(alignment) +
                         (padded != bytes ? ", " + std::to_string(padded) + " bytes with the slack to align" : "") +
                         ") on " + device_string_;
    std::size_t free_bytes = 0;
    std::size_t total_bytes = 0;
    if (driver_.cuMemGetInfo_v2(&free_bytes, &total_bytes) == CUDA_SUCCESS)
      detail += "; " + std::to_string(free_bytes) + " bytes free of " + std::to_string(total_bytes);
    return make_error(driver_, result, call, Operation::Allocate, detail);
  }

  Error copy_error(const CopyStream& lane, CUresult result, std::string_view call, const CopyRequest& request) {
    std::string detail = describe_event(request.event) + ", " + std::to_string(request.len) + " bytes " +
                         (lane.direction == CopyDirection::HostToDevice ? "to" : "from") + " device " +
                         hex(request.device.address) + "+" + std::to_string(request.device_offset);
    if (request.layout.pitched())
      detail += " in " + std::to_string(request.layout.rows) + " rows of " + std::to_string(request.layout.row_bytes) +
                " bytes (host pitch " + std::to_string(request.layout.host_pitch) + ", device pitch " +
                std::to_string(request.layout.device_pitch) + ")";
    Error mapped = make_error(driver_, result, call, lane.operation, detail);
    // Whatever the driver's code, a failed copy is a failed copy of its
    // direction; the fatal flag still says whether the device survived.
    if (mapped.kind() == ErrorKind::Unavailable || mapped.kind() == ErrorKind::Unsupported)
      return Error(lane.failure_kind, mapped.message(), mapped.fatal());
    return mapped;
  }

  // Needs compute_mutex_ and the lane's mutex held: make the lane wait for the
  // newest launch (kernel_done_ is re-recorded only under compute_mutex_).
  void order_after_last_launch(CopyStream& lane) {
    const std::uint64_t launches = launches_.load(std::memory_order_relaxed);
    if (lane.waited_launches.load(std::memory_order_relaxed) == launches) return;
    check(driver_, driver_.cuStreamWaitEvent(lane.stream, kernel_done_, 0),
          std::string(lane.call) + " after compute: cuStreamWaitEvent", lane.operation);
    lane.waited_launches.store(launches, std::memory_order_relaxed);
  }

  // Needs both lanes' mutexes held. Stream order makes the newest
  // conflicting copy of the other lane the only one worth waiting for.
  void order_after_conflicting_copies(CopyStream& lane, const CopyStream& other_lane, const Span& host,
                                      const Span& device) {
    for (auto it = other_lane.pending.rbegin(); it != other_lane.pending.rend(); ++it) {
      if (!it->device.overlaps(device) && !it->host.overlaps(host)) continue;
      check(driver_, driver_.cuStreamWaitEvent(lane.stream, it->done, 0),
            std::string(lane.call) + " after a conflicting copy: cuStreamWaitEvent", lane.operation);
      return;
    }
  }

  // Needs compute_mutex_ held (the marker is shared by launches).
  void record_marker(CopyStream& lane, CUevent marker) {
    std::lock_guard lane_lock(lane.mutex);
    check(driver_, driver_.cuEventRecord(marker, lane.stream), "cuEventRecord(lane marker)", Operation::Launch);
  }

  void drain_lane(CopyStream& lane, std::vector<Completion>& out) {
    std::lock_guard lock(lane.mutex);
    while (!lane.pending.empty()) {
      const PendingCopy& front = lane.pending.front();
      CUresult result = driver_.cuEventQuery(front.done);
      if (result == CUDA_ERROR_NOT_READY) break;
      Completion completion;
      completion.event = front.event;
      if (result != CUDA_SUCCESS) {
        detail::ResultClass cls = detail::classify(static_cast<int>(result), lane.operation);
        completion.ok = false;
        completion.error = lane.failure_kind;
        completion.fatal = cls.fatal;
        completion.message = driver_.describe_failure(std::string(lane.call) + " (completion)", result) + "; " +
                             describe_event(front.event) + ", " + std::to_string(front.bytes) + " bytes";
      }
      out.push_back(std::move(completion));
      events_.give_back(front.done);
      lane.pending.pop_front();
    }
  }

  LaneState peek() {
    LaneState state;
    for (CopyStream* lane : {&upload_, &download_}) {
      std::lock_guard lock(lane->mutex);
      if (lane->pending.empty()) continue;
      state.pending = true;
      if (driver_.cuEventQuery(lane->pending.front().done) != CUDA_ERROR_NOT_READY) state.ready = true;
    }
    return state;
  }

  void wake_waiters() {
    if (waiting_.load() == 0) return;
    {
      std::lock_guard lock(waiters_mutex_);
      ++wake_generation_;
    }
    waiter_cv_.notify_all();
  }

  // Logs rather than throws: its callers are already failing or quiescing,
  // and a faulted stream reports through its events anyway.
  void synchronize(CUstream stream, const char* which) {
    CUresult result = driver_.cuStreamSynchronize(stream);
    if (result != CUDA_SUCCESS)
      devbridge::detail::log().warn("devbridge cuda: {}",
                   driver_.describe_failure(std::string("cuStreamSynchronize(") + which + ")", result));
  }

  void check_axpy_range(const char* name, const DeviceAllocation& allocation, std::uint64_t offset,
                        std::uint64_t count) const {
    // A misaligned or out-of-bounds access faults the whole context
    // (sticky), so refuse it here with an ordinary error. Bounds first: only
    // an offset inside the allocation gives an address that cannot wrap.
    const auto bytes = checked::mul(count, sizeof(float));
    if (!bytes || !checked::range_within(offset, *bytes, allocation.bytes))
      throw Error(ErrorKind::InvalidRange, std::string("axpy ") + name + ": " + std::to_string(count) +
                                               " float32 at offset " + std::to_string(offset) +
                                               " overrun allocation " + hex(allocation.address) + " of " +
                                               std::to_string(allocation.bytes) + " bytes");
    const std::uint64_t address = allocation.address + offset;
    if (address % alignof(float) != 0)
      throw Error(ErrorKind::InvalidRange, std::string("axpy ") + name + " at " + hex(address) +
                                               " is not aligned to float32");
  }

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

CudaBackend& as_cuda(Backend& backend) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  if (cuda == nullptr) throw Error(ErrorKind::Unsupported, "not a CUDA backend");
  return *cuda;
}

const CudaBackend& as_cuda(const Backend& backend) {
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  if (cuda == nullptr) throw Error(ErrorKind::Unsupported, "not a CUDA backend");
  return *cuda;
}

}  // namespace

Probe probe() {
  const Driver& driver = detail::driver();
  Probe result;
  if (!driver.loaded()) {
    result.reason = "no driver (" + driver.load_error + ")";
    return result;
  }
  if (driver.init_result != CUDA_SUCCESS) {
    result.reason = "cuInit failed: " + driver.error_name(driver.init_result);
    return result;
  }
  int count = 0;
  CUresult counted = driver.cuDeviceGetCount(&count);
  if (counted != CUDA_SUCCESS) {
    result.reason = "cuDeviceGetCount failed: " + driver.error_name(counted);
    return result;
  }
  result.device_count = count;
  if (count <= 0) {
    result.reason = "no CUDA device";
    return result;
  }
  result.available = true;
  return result;
}

std::unique_ptr<Backend> make_cuda_backend(const Options& options) {
  Probe found = probe();
  if (!found.available) throw Error(ErrorKind::Unavailable, "CUDA: " + found.reason);
  if (options.context == nullptr && (options.ordinal < 0 || options.ordinal >= found.device_count))
    throw Error(ErrorKind::Unavailable, "CUDA: no device with ordinal " + std::to_string(options.ordinal) + " (" +
                                            std::to_string(found.device_count) + " present)");
  return std::make_unique<CudaBackend>(detail::driver(), options);
}

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options) {
  devbridge::detail::OptionReader reader("cuda", options);
  Options typed;
  if (const auto ordinal = reader.unsigned_integer("device", "the device ordinal, as devbridge info lists them")) {
    if (*ordinal > static_cast<std::uint64_t>(std::numeric_limits<int>::max()))
      reader.refuse("device", std::to_string(*ordinal), "not a device ordinal");
    typed.ordinal = static_cast<int>(*ordinal);
  }
  if (const auto context = reader.unsigned_integer(
          "context", "a CUcontext the caller owns, as an integer (e.g. tinygrad's); pointers are valid in it"))
    typed.context = reinterpret_cast<void*>(static_cast<std::uintptr_t>(*context));
  reader.finish();
  return make_cuda_backend(typed);
}

std::vector<std::string> device_ids() {
  std::vector<std::string> ids;
  for (int ordinal = 0; ordinal < probe().device_count; ++ordinal) ids.push_back(std::to_string(ordinal));
  return ids;
}

bool is_cuda_backend(const Backend& backend) noexcept {
  return dynamic_cast<const CudaBackend*>(&backend) != nullptr;
}

void* context_of(const Backend& backend) {
  return as_cuda(backend).context();
}

std::uint64_t live_allocations(const Backend& backend) {
  return as_cuda(backend).live_allocations();
}

void hold_copies(Backend& backend, bool hold) { as_cuda(backend).hold(hold); }

void order_stream_after_submitted_work(Backend& backend, std::uintptr_t stream) {
  as_cuda(backend).order_stream(reinterpret_cast<CUstream>(stream));
}

}  // namespace devbridge::cuda
