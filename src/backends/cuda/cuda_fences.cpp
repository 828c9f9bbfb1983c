// The CUDA backend: fences (pooled CUevents) on its own streams and on
// consumers', and ordering a consumer's stream.
#include "backends/cuda/cuda_backend_impl.hpp"

namespace devbridge::cuda::detail {

Fence CudaBackend::record_fence(const QueueRef& where) {
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

bool CudaBackend::fence_passed(Fence fence) {
  if (!fence.pending()) return true;
  ContextGuard guard(driver_, context_, Operation::Query);
  return query_fence(fence);
}

bool CudaBackend::wait_fence(Fence fence, std::chrono::nanoseconds timeout) {
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

void CudaBackend::release_fence(Fence fence) noexcept {
  if (!fence.pending()) return;
  fences_.give_back(event_of(fence));
}

void CudaBackend::order_stream(CUstream stream) {
  ContextGuard guard(driver_, context_, Operation::Query);
  std::lock_guard compute_lock(compute_mutex_);
  record_marker(upload_, upload_marker_);
  record_marker(download_, download_marker_);
  for (CUevent marker : {upload_marker_, download_marker_})
    check_consumer_stream_call(driver_.cuStreamWaitEvent(stream, marker, 0), "cuStreamWaitEvent(consumer stream)");
  if (launches_.load(std::memory_order_relaxed) > 0)
    check_consumer_stream_call(driver_.cuStreamWaitEvent(stream, kernel_done_, 0),
                               "cuStreamWaitEvent(consumer stream)");
}

CUstream CudaBackend::consumer_stream(std::uintptr_t consumer) {
  switch (consumer) {
    case 0:
      throw Error(ErrorKind::InvalidRange,
                  "CUDA consumer stream 0 is ambiguous (the legacy or the per-thread default stream, depending "
                  "on how the consumer was built); pass 1 for the legacy default stream, 2 for the per-thread "
                  "one, or a CUstream");
    case 1:
      return legacy_default_stream();
    case 2:
      return per_thread_default_stream();
    default:
      return reinterpret_cast<CUstream>(consumer);
  }
}

Fence CudaBackend::record_consumer_fence(std::uintptr_t consumer) {
  CUstream stream = consumer_stream(consumer);
  ContextGuard guard(driver_, context_, Operation::Query);
  FenceEvent fence(fences_, fences_.acquire(Operation::Query, "cuEventCreate(consumer fence)"));
  // Not the backend's stream: no lock of ours orders it.
  check_consumer_stream_call(driver_.cuEventRecord(fence.get(), stream),
                             "cuEventRecord(fence on consumer stream " + hex(consumer) + ")");
  return Fence{reinterpret_cast<std::uintptr_t>(fence.release())};
}

void CudaBackend::check_consumer_stream_call(CUresult result, const std::string& call) {
  if (result == CUDA_SUCCESS) return;
  Error mapped = make_error(driver_, result, call, Operation::Query);
  // A stream the driver does not know, or one of another context, is the
  // caller's mistake, not an unavailable device.
  if (!mapped.fatal() && (result == CUDA_ERROR_INVALID_HANDLE || result == CUDA_ERROR_INVALID_VALUE ||
                          result == CUDA_ERROR_INVALID_CONTEXT))
    throw Error(ErrorKind::InvalidRange,
                std::string(mapped.message()) + " (not a stream of " + device_string_ + "'s context?)");
  throw mapped;
}

bool CudaBackend::stopped_by_fault(CUresult result) noexcept {
  return result != CUDA_ERROR_UNKNOWN && detail::is_sticky(static_cast<int>(result));
}

bool CudaBackend::query_fence(Fence fence) {
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

}  // namespace devbridge::cuda::detail
