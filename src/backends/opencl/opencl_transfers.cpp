// The OpenCL backend: copies (1-D and rect), their completions, the hold and
// quiesce.
#include "backends/opencl/opencl_backend_impl.hpp"

namespace devbridge::opencl::detail {
namespace {

// How long quiesce waits for the driver's callbacks after clFinish returned.
constexpr std::chrono::seconds kCallbackDrainLimit{30};

}  // namespace

void OpenCLBackend::submit_copy(const CopyRequest& request) {
  const bool upload = request.direction == CopyDirection::HostToDevice;
  const Operation operation = upload ? Operation::Upload : Operation::Download;
  const bool pitched = request.layout.pitched();
  const char* call = pitched ? (upload ? "clEnqueueWriteBufferRect" : "clEnqueueReadBufferRect")
                             : (upload ? "clEnqueueWriteBuffer" : "clEnqueueReadBuffer");
  const auto fail = [&](cl_int result) -> Error {
    Error error = make_error(result, call, operation, describe_copy(request));
    if (error.fatal()) mark_queue_unusable();
    return error;
  };

  // The bridge has checked the range; a range that slips through is refused
  // here as the seam's InvalidRange rather than as a driver error.
  if (pitched) {
    check_pitched(request, call);
  } else if (!checked::range_within(request.device_offset, request.len, request.device.bytes)) {
    throw Error(ErrorKind::InvalidRange,
                fmt::format("opencl {}: device range [{}, +{}) outside a buffer of {} bytes", call,
                            request.device_offset, request.len, request.device.bytes));
  }

  if (request.mode == CopyMode::Sync) {
    if (const cl_int result = enqueue_copy(request, CL_TRUE, nullptr, nullptr); result != CL_SUCCESS)
      throw fail(result);
    return;
  }

  Owned<cl_event> gate = hold_gate();
  cl_event gate_event = gate.get();
  cl_event done = nullptr;
  if (const cl_int result = enqueue_copy(request, CL_FALSE, gate_event ? &gate_event : nullptr, &done);
      result != CL_SUCCESS)
    throw fail(result);
  try {
    std::lock_guard lock(mutex_);
    pending_.push_back(PendingCopy{request.event, operation, done});
  } catch (const std::bad_alloc&) {
    // Untracked, the copy would outlive the bridge's record of it: finish
    // it before reporting the failure, so its host range is free to reuse.
    cl_.clWaitForEvents(1, &done);
    cl_.clReleaseEvent(done);
    throw Error(backends::operation_kind(operation), "opencl: out of host memory to track an async copy");
  }
  // The callback only wakes waiters; it holds its own event reference.
  bool callback_set = false;
  if (cl_.clRetainEvent(done) == CL_SUCCESS) {
    callbacks_outstanding_.fetch_add(1, std::memory_order_relaxed);
    if (cl_.clSetEventCallback(done, CL_COMPLETE, &OpenCLBackend::on_command_finished, this) == CL_SUCCESS) {
      callback_set = true;
    } else {
      callbacks_outstanding_.fetch_sub(1, std::memory_order_relaxed);
      cl_.clReleaseEvent(done);
    }
  }
  if (const cl_int result = cl_.clFlush(queue_.get()); result != CL_SUCCESS)
    devbridge::detail::log().warn("devbridge opencl: {}", make_error(result, "clFlush", operation).what());
  // Without a callback nobody would wake a waiter: finish the copy here
  // (it is still reported through drain_completions like any other).
  if (!callback_set) cl_.clWaitForEvents(1, &done);
}

void OpenCLBackend::write_mapped(std::span<const MappedWrite> ranges,
                                 const std::function<void(std::span<const std::span<std::byte>>)>& write) {
  const auto fail = [&](cl_int result, const char* call) -> Error {
    Error error = make_error(result, call, Operation::Upload, fmt::format("{} ranges mapped for writing", ranges.size()));
    if (error.fatal()) mark_queue_unusable();
    return error;
  };
  for (const MappedWrite& range : ranges)
    if (range.len == 0 || !checked::range_within(range.offset, range.len, range.device.bytes))
      throw Error(ErrorKind::InvalidRange, fmt::format("opencl write_mapped: range [{}, +{}) of a buffer of {} bytes",
                                                       range.offset, range.len, range.device.bytes));
  // Every range mapped without blocking and waited for once: a blocking map
  // per range cost 15 us on PoCL, 3000 at once and one wait 2 us each.
  std::vector<std::span<std::byte>> bytes;
  bytes.reserve(ranges.size());
  const auto unmap_all = [&]() -> cl_int {
    cl_int first_failure = CL_SUCCESS;
    for (std::size_t i = 0; i < bytes.size(); ++i)
      if (const cl_int result = cl_.clEnqueueUnmapMemObject(queue_.get(), as_buffer(ranges[i].device), bytes[i].data(),
                                                            0, nullptr, nullptr);
          result != CL_SUCCESS && first_failure == CL_SUCCESS)
        first_failure = result;
    const cl_int finished = cl_.clFinish(queue_.get());
    return first_failure != CL_SUCCESS ? first_failure : finished;
  };
  cl_int mapped = CL_SUCCESS;
  for (const MappedWrite& range : ranges) {
    void* at = cl_.clEnqueueMapBuffer(queue_.get(), as_buffer(range.device), CL_FALSE, CL_MAP_WRITE_INVALIDATE_REGION,
                                      range.offset, range.len, 0, nullptr, nullptr, &mapped);
    if (mapped != CL_SUCCESS) break;
    bytes.emplace_back(static_cast<std::byte*>(at), static_cast<std::size_t>(range.len));
  }
  if (mapped == CL_SUCCESS) mapped = cl_.clFinish(queue_.get());
  if (mapped != CL_SUCCESS) {
    unmap_all();  // what was mapped goes back before the failure is reported
    throw fail(mapped, "clEnqueueMapBuffer");
  }
  try {
    write(bytes);
  } catch (...) {
    unmap_all();
    throw;
  }
  if (const cl_int result = unmap_all(); result != CL_SUCCESS) throw fail(result, "clEnqueueUnmapMemObject");
}

void OpenCLBackend::drain_completions(std::vector<Completion>& out) {
  std::lock_guard lock(mutex_);
  while (!pending_.empty()) {
    const PendingCopy& copy = pending_.front();
    cl_int status = CL_QUEUED;
    const cl_int queried = execution_status(copy.done, status);
    if (queried == CL_SUCCESS && status > CL_COMPLETE) break;  // still queued, submitted or running
    Completion completion;
    completion.event = copy.event;
    if (queried != CL_SUCCESS || status != CL_COMPLETE) {
      const cl_int code = queried != CL_SUCCESS ? queried : status;
      const Error error =
          make_error(code, copy.operation == Operation::Upload ? "async upload" : "async download", copy.operation);
      completion.ok = false;
      completion.error = error.kind();
      completion.message = error.what();
      completion.fatal = error.fatal();
      if (error.fatal()) queue_unusable_ = true;
    }
    out.push_back(std::move(completion));
    cl_.clReleaseEvent(copy.done);
    pending_.pop_front();
  }
}

bool OpenCLBackend::wait_for_completions(std::chrono::nanoseconds timeout) {
  // wait_for would add a huge timeout to now() and wrap (returning at
  // once); the deadline saturates instead and "never" waits until done.
  const auto deadline = checked::deadline_after(timeout);
  const auto seen = finished_signals_.load(std::memory_order_acquire);
  if (front_finished()) return true;
  std::unique_lock lock(signal_mutex_);
  const auto signalled = [&] { return finished_signals_.load(std::memory_order_acquire) != seen; };
  if (deadline == checked::Clock::time_point::max()) {
    signal_cv_.wait(lock, signalled);
    return true;
  }
  return signal_cv_.wait_until(lock, deadline, signalled);
}

void OpenCLBackend::quiesce() {
  hold_copies(false);
  // Unlike a faulted CUDA context, a queue whose clFinish failed gives no
  // promise that its commands stopped, and the fences on it may never
  // pass: the quiesce fails, so the bridge frees nothing the device may still touch,
  // and a later restart retries it.
  if (const cl_int result = cl_.clFinish(queue_.get()); result != CL_SUCCESS) {
    mark_queue_unusable();
    const Error error = make_error(result, "clFinish", Operation::Release, "quiesce");
    throw Error(error.kind(), error.message(), /*fatal=*/true);
  }
  // clFinish returns when the commands are done; their callbacks may still
  // be running on the driver's threads, and they point at this backend.
  {
    std::unique_lock lock(signal_mutex_);
    if (!signal_cv_.wait_for(lock, kCallbackDrainLimit,
                             [&] { return callbacks_outstanding_.load(std::memory_order_acquire) == 0; }))
      throw Error(ErrorKind::Unavailable,
                  fmt::format("opencl quiesce: {} event callbacks have not run yet; they point at this backend",
                              callbacks_outstanding_.load()),
                  /*fatal=*/true);
  }
  // After a fatal failure the in-order queue has no defined state: start a
  // new one (the bridge calls quiesce from restart, with no other call in
  // flight), so a restart recovers.
  bool replace;
  {
    std::lock_guard lock(mutex_);
    replace = std::exchange(queue_unusable_, false);
  }
  if (replace) {
    try {
      queue_ = make_queue();
    } catch (const Error& e) {
      devbridge::detail::log().error("devbridge opencl: a new queue after a fatal failure: {}", e.what());
    }
  }
}

void OpenCLBackend::hold_copies(bool hold) {
  if (hold) {
    std::lock_guard lock(mutex_);
    if (hold_ != nullptr) return;
    cl_int result = CL_SUCCESS;
    hold_ = cl_.clCreateUserEvent(context_.get(), &result);
    check(result, "clCreateUserEvent", Operation::Setup);
    return;
  }
  cl_event released;
  {
    std::lock_guard lock(mutex_);
    released = std::exchange(hold_, nullptr);
  }
  if (released == nullptr) return;
  cl_.clSetUserEventStatus(released, CL_COMPLETE);
  cl_.clReleaseEvent(released);
  cl_.clFlush(queue_.get());
}

void OpenCLBackend::on_command_finished(cl_event event, cl_int /*status*/, void* user) {
  auto* self = static_cast<OpenCLBackend*>(user);
  self->cl_.clReleaseEvent(event);  // the reference submit_copy took for this callback
  // Under signal_mutex_ so that quiesce, once it sees no callback
  // outstanding, knows none touches the backend any more.
  std::lock_guard lock(self->signal_mutex_);
  self->finished_signals_.fetch_add(1, std::memory_order_release);
  self->callbacks_outstanding_.fetch_sub(1, std::memory_order_release);
  self->signal_cv_.notify_all();
}

Owned<cl_event> OpenCLBackend::hold_gate() {
  Owned<cl_event> gate(nullptr, {cl_.clReleaseEvent});
  std::lock_guard lock(mutex_);
  if (hold_ != nullptr && cl_.clRetainEvent(hold_) == CL_SUCCESS) gate.reset(hold_);
  return gate;
}

cl_int OpenCLBackend::enqueue_copy(const CopyRequest& request, cl_bool blocking, const cl_event* wait_for, cl_event* done) {
  cl_mem buffer = as_buffer(request.device);
  const cl_uint waits = wait_for != nullptr ? 1 : 0;
  const bool upload = request.direction == CopyDirection::HostToDevice;
  if (request.layout.pitched()) {
    const CopyLayout& layout = request.layout;
    // OpenCL refuses a row pitch shorter than region[0] even when there is
    // no second row to step to; one row spans exactly its own bytes.
    // (check_pitched made sure every value fits a size_t.)
    const auto size = [](std::uint64_t value) { return static_cast<std::size_t>(value); };
    const std::size_t device_pitch = size(layout.rows == 1 ? layout.row_bytes : layout.device_pitch);
    const std::size_t host_pitch = size(layout.rows == 1 ? layout.row_bytes : layout.host_pitch);
    const std::size_t buffer_origin[3] = {size(request.device_offset), 0, 0};
    const std::size_t host_origin[3] = {0, 0, 0};
    const std::size_t region[3] = {size(layout.row_bytes), size(layout.rows), 1};
    // Slice pitches 0: one slice, so OpenCL derives them and never steps them.
    if (upload)
      return cl_.clEnqueueWriteBufferRect(queue_.get(), buffer, blocking, buffer_origin, host_origin, region,
                                          device_pitch, 0, host_pitch, 0, request.host, waits, wait_for, done);
    return cl_.clEnqueueReadBufferRect(queue_.get(), buffer, blocking, buffer_origin, host_origin, region,
                                       device_pitch, 0, host_pitch, 0, request.host, waits, wait_for, done);
  }
  if (upload)
    return cl_.clEnqueueWriteBuffer(queue_.get(), buffer, blocking, request.device_offset, request.len, request.host,
                                    waits, wait_for, done);
  return cl_.clEnqueueReadBuffer(queue_.get(), buffer, blocking, request.device_offset, request.len, request.host,
                                 waits, wait_for, done);
}

std::string OpenCLBackend::describe_copy(const CopyRequest& request) {
  if (!request.layout.pitched())
    return fmt::format("{} bytes at device offset {}", request.len, request.device_offset);
  const CopyLayout& layout = request.layout;
  return fmt::format("{} rows of {} bytes at device offset {} (device pitch {}, host pitch {}, host {})",
                     layout.rows, layout.row_bytes, request.device_offset, layout.device_pitch, layout.host_pitch,
                     static_cast<const void*>(request.host));
}

void OpenCLBackend::check_pitched(const CopyRequest& request, const char* call) {
  const CopyLayout& layout = request.layout;
  if (layout.row_bytes == 0)
    throw Error(ErrorKind::InvalidRange,
                fmt::format("opencl {}: {} rows of 0 bytes move nothing (OpenCL refuses an empty region)", call,
                            layout.rows));
  // Both throw InvalidRange naming the pitch when rows would overlap or
  // the span does not fit in 64 bits.
  const std::uint64_t device_span = layout_device_span(layout);
  (void)layout_host_span(layout);
  if (const auto moved = checked::mul(layout.rows, layout.row_bytes); !moved || *moved != request.len)
    throw Error(ErrorKind::InvalidRange,
                fmt::format("opencl {}: a copy of {} bytes does not match its {} rows of {} bytes", call,
                            request.len, layout.rows, layout.row_bytes));
  if (!checked::range_within(request.device_offset, device_span, request.device.bytes))
    throw Error(ErrorKind::InvalidRange,
                fmt::format("opencl {}: device range [{}, +{}) ({} rows of {} bytes at a pitch of {}) outside a "
                            "buffer of {} bytes",
                            call, request.device_offset, device_span, layout.rows, layout.row_bytes,
                            layout.device_pitch, request.device.bytes));
  // size_t is what the driver takes; on a 32-bit host a span past it would wrap.
  if constexpr (sizeof(std::size_t) < sizeof(std::uint64_t)) {
    constexpr std::uint64_t kMax = static_cast<std::size_t>(-1);
    if (request.device_offset > kMax || device_span > kMax - request.device_offset ||
        layout.device_pitch > kMax || layout.host_pitch > kMax)
      throw Error(ErrorKind::InvalidRange,
                  fmt::format("opencl {}: device range [{}, +{}) or its pitches do not fit this host's size_t",
                              call, request.device_offset, device_span));
  }
}

bool OpenCLBackend::front_finished() {
  std::lock_guard lock(mutex_);
  if (pending_.empty()) return false;
  cl_int status = CL_QUEUED;
  return execution_status(pending_.front().done, status) != CL_SUCCESS || status <= CL_COMPLETE;
}

cl_int OpenCLBackend::execution_status(cl_event event, cl_int& status) const {
  return cl_.clGetEventInfo(event, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof status, &status, nullptr);
}

void OpenCLBackend::mark_queue_unusable() {
  std::lock_guard lock(mutex_);
  queue_unusable_ = true;
}

}  // namespace devbridge::opencl::detail
