// The CUDA backend: copies on the upload and download streams (1-D and
// pitched), their ordering and completions, quiesce, the hold, and
// device-to-device copies to a peer.
#include "backends/cuda/cuda_backend_impl.hpp"

namespace devbridge::cuda::detail {

template <typename EnqueueTheCopy>
inline void CudaBackend::enqueue_copy(CopyStream& lane, const CopyRequest& request, const Span& host_span,
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

void CudaBackend::submit_copy(const CopyRequest& request) {
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

void CudaBackend::drain_completions(std::vector<Completion>& out) {
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

bool CudaBackend::wait_for_completions(std::chrono::nanoseconds timeout) {
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

void CudaBackend::quiesce() {
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

void CudaBackend::hold(bool on) {
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

bool CudaBackend::copy_to_peer(const DeviceAllocation& source, std::uint64_t source_offset, Backend& destination_backend,
                  const DeviceAllocation& destination, std::uint64_t destination_offset,
                  std::uint64_t len) {
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

void CudaBackend::record_submitted(PeerEvents& out) {
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

Error CudaBackend::peer_copy_error(const Error& error, const std::string& detail) {
  ErrorKind kind = error.kind();
  if (kind == ErrorKind::Unavailable || kind == ErrorKind::Unsupported || kind == ErrorKind::Broken)
    kind = ErrorKind::DeviceCopyFailed;
  return Error(kind, std::string(error.message()) + "; " + detail, error.fatal());
}

void CudaBackend::open(Gate& gate) {
  {
    std::lock_guard gate_lock(gate.mutex);
    gate.open = true;
  }
  gate.opened.notify_all();
}

void CudaBackend::wait_at_gate(void* data) {
  std::unique_ptr<std::shared_ptr<Gate>> holder(static_cast<std::shared_ptr<Gate>*>(data));
  Gate& gate = **holder;
  std::unique_lock lock(gate.mutex);
  gate.opened.wait(lock, [&] { return gate.open; });
}

[[gnu::noinline]] void CudaBackend::submit_pitched_copy(CopyStream& lane, const CopyRequest& request) {
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

Error CudaBackend::copy_error(const CopyStream& lane, CUresult result, std::string_view call, const CopyRequest& request) {
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

void CudaBackend::order_after_last_launch(CopyStream& lane) {
  const std::uint64_t launches = launches_.load(std::memory_order_relaxed);
  if (lane.waited_launches.load(std::memory_order_relaxed) == launches) return;
  check(driver_, driver_.cuStreamWaitEvent(lane.stream, kernel_done_, 0),
        std::string(lane.call) + " after compute: cuStreamWaitEvent", lane.operation);
  lane.waited_launches.store(launches, std::memory_order_relaxed);
}

void CudaBackend::order_after_conflicting_copies(CopyStream& lane, const CopyStream& other_lane, const Span& host,
                                    const Span& device) {
  for (auto it = other_lane.pending.rbegin(); it != other_lane.pending.rend(); ++it) {
    if (!it->device.overlaps(device) && !it->host.overlaps(host)) continue;
    check(driver_, driver_.cuStreamWaitEvent(lane.stream, it->done, 0),
          std::string(lane.call) + " after a conflicting copy: cuStreamWaitEvent", lane.operation);
    return;
  }
}

void CudaBackend::record_marker(CopyStream& lane, CUevent marker) {
  std::lock_guard lane_lock(lane.mutex);
  check(driver_, driver_.cuEventRecord(marker, lane.stream), "cuEventRecord(lane marker)", Operation::Launch);
}

void CudaBackend::drain_lane(CopyStream& lane, std::vector<Completion>& out) {
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

CudaBackend::LaneState CudaBackend::peek() {
  LaneState state;
  for (CopyStream* lane : {&upload_, &download_}) {
    std::lock_guard lock(lane->mutex);
    if (lane->pending.empty()) continue;
    state.pending = true;
    if (driver_.cuEventQuery(lane->pending.front().done) != CUDA_ERROR_NOT_READY) state.ready = true;
  }
  return state;
}

void CudaBackend::wake_waiters() {
  if (waiting_.load() == 0) return;
  {
    std::lock_guard lock(waiters_mutex_);
    ++wake_generation_;
  }
  waiter_cv_.notify_all();
}

void CudaBackend::synchronize(CUstream stream, const char* which) {
  CUresult result = driver_.cuStreamSynchronize(stream);
  if (result != CUDA_SUCCESS)
    devbridge::detail::log().warn("devbridge cuda: {}",
                 driver_.describe_failure(std::string("cuStreamSynchronize(") + which + ")", result));
}

}  // namespace devbridge::cuda::detail
