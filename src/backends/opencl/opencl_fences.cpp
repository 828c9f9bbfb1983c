// The OpenCL backend: fences (a launch's event or a marker) on the bridge's
// queue and on consumers', and ordering a consumer's queue.
#include "backends/opencl/opencl_backend_impl.hpp"

#include <sys/uio.h>

#include <cerrno>

namespace devbridge::opencl::detail {
namespace {

// wait_fence polls (clWaitForEvents has no timeout): a few status reads
// catch a fence that is about to pass without a sleep's latency, then sleeps
// that double up to a cap bound both the latency and the cost of a poll.
constexpr int kFenceSpins = 64;
constexpr std::chrono::microseconds kFirstFenceSleep{2};
constexpr std::chrono::microseconds kFenceSleepCap{1000};

}  // namespace

Fence OpenCLBackend::record_fence(const QueueRef& where) {
  switch (where.queue) {
    case Queue::CopyUp:
    case Queue::CopyDown:
    case Queue::Compute:
      return record_marker(queue_.get(), /*ours=*/true, "the bridge's queue");
    case Queue::Consumer: {
      cl_command_queue consumer = consumer_queue(where.consumer, "record a fence on");
      return record_marker(consumer, /*ours=*/false, fmt::format("consumer queue {:#x}", where.consumer));
    }
  }
  throw Error(ErrorKind::Unsupported,
              fmt::format("opencl record_fence: no queue {}", static_cast<unsigned>(where.queue)));
}

bool OpenCLBackend::fence_passed(Fence fence) {
  if (!fence.pending()) return true;
  cl_event event = as_event(fence);
  cl_int status = CL_QUEUED;
  if (const cl_int queried = execution_status(event, status); queried != CL_SUCCESS)
    throw make_error(queried, "clGetEventInfo(CL_EVENT_COMMAND_EXECUTION_STATUS)", Operation::Query,
                     "testing a fence");
  if (status > CL_COMPLETE) return false;  // queued, submitted or running
  // A negative status: the command was terminated abnormally and nothing
  // of it runs any more, so whatever the fence holds may go.
  if (status < 0) note_failed_fence(event, status);
  return true;
}

bool OpenCLBackend::wait_fence(Fence fence, std::chrono::nanoseconds timeout) {
  const auto deadline = checked::deadline_after(timeout);
  std::chrono::nanoseconds pause = kFirstFenceSleep;
  for (int polls = 0;; ++polls) {
    if (fence_passed(fence)) return true;
    const auto now = checked::Clock::now();
    if (now >= deadline) return false;
    if (polls < kFenceSpins) {
      std::this_thread::yield();
      continue;
    }
    // deadline - now is positive here, and representable even when the
    // deadline is the clock's end of time.
    std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(pause, deadline - now));
    pause = std::min<std::chrono::nanoseconds>(pause * 2, kFenceSleepCap);
  }
}

void OpenCLBackend::release_fence(Fence fence) noexcept {
  if (!fence.pending()) return;
  if (const cl_int result = cl_.clReleaseEvent(as_event(fence)); result != CL_SUCCESS)
    log_failure(result, "clReleaseEvent(fence)", Operation::Release);
  live_fences_.fetch_sub(1, std::memory_order_relaxed);
}

void OpenCLBackend::order_consumer_queue(std::uintptr_t handle) {
  cl_command_queue consumer = consumer_queue(handle, "order");
  const Fence marker = record_marker(queue_.get(), /*ours=*/true, "the bridge's queue, to order a consumer after");
  cl_event after = as_event(marker);
  const cl_int result = cl_.clEnqueueBarrierWithWaitList(consumer, 1, &after, nullptr);
  // The barrier keeps what it waits for alive on its own: our reference can go.
  release_fence(marker);
  if (result != CL_SUCCESS)
    throw make_error(result, "clEnqueueBarrierWithWaitList", Operation::Query,
                     fmt::format("ordering consumer queue {:#x} after the bridge's work", handle));
  // Their queue's later commands would submit the barrier too; flushing
  // now lets it start waiting at once.
  if (const cl_int flushed = cl_.clFlush(consumer); flushed != CL_SUCCESS)
    log_failure(flushed, "clFlush(consumer queue)", Operation::Query);
}

Fence OpenCLBackend::adopt_fence(cl_event event) noexcept {
  live_fences_.fetch_add(1, std::memory_order_relaxed);
  return Fence{reinterpret_cast<std::uintptr_t>(event)};
}

Fence OpenCLBackend::record_marker(cl_command_queue queue, bool ours, std::string_view where) {
  cl_event marker = nullptr;
  if (const cl_int result = cl_.clEnqueueMarkerWithWaitList(queue, 0, nullptr, &marker); result != CL_SUCCESS) {
    Error error = make_error(result, "clEnqueueMarkerWithWaitList", Operation::Query, where);
    if (error.fatal() && ours) mark_queue_unusable();
    throw error;
  }
  Owned<cl_event> owned(marker, {cl_.clReleaseEvent});
  if (const cl_int result = cl_.clFlush(queue); result != CL_SUCCESS) {
    Error error = make_error(result, "clFlush", Operation::Query, where);
    if (error.fatal() && ours) mark_queue_unusable();
    throw error;
  }
  return adopt_fence(owned.release());
}

namespace {

// The pointer-sized word at `address`, or nothing where no memory of this
// process is there (read by the kernel, which reports EFAULT rather than
// fault). Where the call itself is refused (a sandbox), nothing is known and
// the word is not read: the caller goes on as if it were readable.
enum class WordRead : std::uint8_t { Read, Unmapped, Unknown };
WordRead read_word(std::uintptr_t address, std::uintptr_t& word) noexcept {
  iovec local{&word, sizeof word};
  iovec remote{reinterpret_cast<void*>(address), sizeof word};
  const ssize_t read = ::process_vm_readv(::getpid(), &local, 1, &remote, 1, 0);
  if (read == static_cast<ssize_t>(sizeof word)) return WordRead::Read;
  return read < 0 && errno != EFAULT ? WordRead::Unknown : WordRead::Unmapped;
}

// The first word of an OpenCL object (the ICD dispatch table every object
// of one implementation shares, cl_khr_icd), where `object` is one of ours.
std::uintptr_t dispatch_of(const void* object) noexcept { return *static_cast<const std::uintptr_t*>(object); }

}  // namespace

cl_command_queue OpenCLBackend::consumer_queue(std::uintptr_t handle, std::string_view doing) {
  if (handle == 0)
    throw Error(ErrorKind::Unsupported,
                fmt::format("opencl: cannot {} consumer queue 0: OpenCL has no default queue; pass a "
                            "cl_command_queue made on this bridge's context (native_context)",
                            doing));
  // The driver dereferences whatever it is handed: a number that cannot be
  // a queue of this implementation is refused before it gets there (a CUDA
  // stream number, 1 or 2, crashed the process). What passes is an object
  // of the same implementation, which the driver can check itself.
  const auto not_a_queue = [&](std::string_view why) {
    return Error(ErrorKind::Unsupported,
                 fmt::format("opencl: cannot {} consumer queue {:#x}: it is not a cl_command_queue ({}); pass the "
                             "address of a cl_command_queue made on this bridge's context (native_context), not a "
                             "CUDA stream number (1 and 2 are CUDA's default streams)",
                             doing, handle, why));
  };
  constexpr std::uintptr_t kLowestObjectAddress = 1u << 16;  // Linux maps nothing below vm.mmap_min_addr (64 KiB)
  if (handle < kLowestObjectAddress) throw not_a_queue("no object lies at so low an address");
  if (handle % alignof(void*) != 0) throw not_a_queue("not aligned as an object is");
  std::uintptr_t first_word = 0;
  switch (read_word(handle, first_word)) {
    case WordRead::Unmapped:
      throw not_a_queue("no memory of this process is there");
    case WordRead::Read:
      // Our own context and queue share their first word where the
      // implementation is reached through the ICD loader (which routes every
      // call by that word): then a queue of it must have the same.
      if (const auto dispatch = dispatch_of(context_.get());
          dispatch == dispatch_of(queue_.get()) && first_word != dispatch)
        throw not_a_queue("not an object of this OpenCL implementation");
      break;
    case WordRead::Unknown:
      break;
  }
  auto* queue = reinterpret_cast<cl_command_queue>(handle);
  cl_context context = nullptr;
  if (const cl_int result =
          cl_.clGetCommandQueueInfo(queue, CL_QUEUE_CONTEXT, sizeof context, &context, nullptr);
      result != CL_SUCCESS)
    throw make_error(result, "clGetCommandQueueInfo(CL_QUEUE_CONTEXT)", Operation::Query,
                     fmt::format("consumer queue {:#x} is not a usable cl_command_queue", handle));
  if (context != context_.get())
    throw Error(ErrorKind::ForeignDomain,
                fmt::format("opencl: cannot {} consumer queue {:#x}: it belongs to OpenCL context {}, not to this "
                            "bridge's context {} (make the queue on describe().native_context)",
                            doing, handle, static_cast<const void*>(context),
                            static_cast<const void*>(context_.get())));
  return queue;
}

void OpenCLBackend::note_failed_fence(cl_event event, cl_int status) {
  cl_command_queue queue = nullptr;
  const bool ours = cl_.clGetEventInfo(event, CL_EVENT_COMMAND_QUEUE, sizeof queue, &queue, nullptr) == CL_SUCCESS &&
                    queue != nullptr && queue == queue_.get();
  const bool poisoned = ours && detail::classify(status, Operation::Launch).fatal;
  if (poisoned) mark_queue_unusable();
  try {
    devbridge::detail::log().warn("devbridge opencl: a command before a fence on {} ended abnormally: {} ({}){}",
                                  ours ? "the bridge's queue" : "another queue", detail::error_name(status), status,
                                  poisoned ? "; the queue is replaced at the next restart" : "");
  } catch (...) {
    // Logging is best effort; the fence has passed either way.
  }
}

}  // namespace devbridge::opencl::detail
