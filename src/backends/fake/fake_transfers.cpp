// The fake backend: copies, their completions as the test scripts them, quiesce
// and copies to a peer fake.
#include "backends/fake/fake_backend_impl.hpp"

namespace devbridge::fake {

void FakeBackend::submit_copy(const CopyRequest& request) {
  const Call call =
      request.direction == CopyDirection::HostToDevice ? Call::CopyHostToDevice : Call::CopyDeviceToHost;
  // Declared before the lock so that it notifies after unlocking, on every exit path.
  struct NotifyOnExit {
    std::condition_variable& cv;
    bool armed = false;
    ~NotifyOnExit() {
      if (armed) cv.notify_all();
    }
  } notify{state_->completions_ready};
  {
    std::lock_guard lock(state_->mutex);
    auto& s = *state_;
    {
      RecordedCall& recorded = s.calls[s.record(call)];
      recorded.bytes = request.len;
      recorded.address = request.device.address;
      recorded.host_offset = s.host_offset_of(request.host);
      recorded.device_offset = request.device_offset;
      recorded.layout = request.layout;
      recorded.mode = request.mode;
      recorded.event = request.event;
    }
    if (!s.late_after_quiesce.empty()) {
      s.late_released = true;
      notify.armed = true;
    }
    const Fired fired = s.fire(call);
    const std::string what = event_text(request.event) + ", " + std::to_string(request.len) + " bytes";
    if (fired.fatal) State::throw_fatal(call, "copying " + what);
    if (fired.copy_failed_at_submit) {
      throw Error(copy_error_kind(request.direction),
                  "fake " + std::string(call_name(call)) + ": injected failure at submit (" + what + "); no byte moved");
    }

    // The bridge validates every range; the fake re-checks so that a range
    // that slips through is caught here instead of corrupting memory.
    const State::Allocation* allocation = s.live(request.device);
    if (allocation == nullptr) {
      throw Error(ErrorKind::UnknownDeviceHandle, "fake " + std::string(call_name(call)) +
                                                      ": allocation not live in the backend (" + what + ")");
    }
    if (!checked::range_within(request.device_offset, request_device_span(request), allocation->bytes)) {
      throw Error(ErrorKind::InvalidRange, "fake " + std::string(call_name(call)) + ": device range [" +
                                               std::to_string(request.device_offset) + ", +" +
                                               std::to_string(request_device_span(request)) + ") outside allocation of " +
                                               std::to_string(allocation->bytes) + " bytes reached the backend");
    }
    if (allocation->unbacked) State::refuse_unbacked(call_name(call), request.device.address);
    const State::HostBlockRecord* host_block = s.find_host_block(request.host, request_host_span(request));
    if (host_block == nullptr) {
      throw Error(ErrorKind::InvalidRange, "fake " + std::string(call_name(call)) + ": host range (" + what +
                                               ") outside every host block reached the backend");
    }

    if (request.mode == CopyMode::Sync) {
      if (fired.copy_failed_at_completion) {
        throw Error(copy_error_kind(request.direction), "fake " + std::string(call_name(call)) +
                                                            ": injected failure at completion (" + what +
                                                            "); no byte moved");
      }
      State::move_bytes(request);
      return;
    }

    State::PendingCopy copy{request,
                            allocation->memory,
                            host_block->memory,
                            fired.copy_failed_at_completion,
                            fired.lost,
                            fired.duplicated,
                            fired.late};
    if (s.auto_complete && !copy.late) {
      s.finish(copy, /*ok=*/true, s.ready);
      notify.armed = true;
    } else {
      s.pending.push_back(std::move(copy));
      s.count_pending(s.pending.back(), true);
    }
  }
}

void FakeBackend::drain_completions(std::vector<Completion>& out) {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  for (auto& c : s.ready) out.push_back(std::move(c));
  s.ready.clear();
  if (s.late_released) {
    for (auto& c : s.late_after_quiesce) out.push_back(std::move(c));
    s.late_after_quiesce.clear();
    s.late_released = false;
  }
}

bool FakeBackend::wait_for_completions(std::chrono::nanoseconds timeout) {
  // wait_for would add the timeout to now() and wrap for a huge one (then
  // return at once): the deadline saturates instead, and "never" waits.
  const auto deadline = checked::deadline_after(timeout);
  std::unique_lock lock(state_->mutex);
  auto& s = *state_;
  const auto ready = [&] { return !s.ready.empty() || (s.late_released && !s.late_after_quiesce.empty()); };
  if (deadline == checked::Clock::time_point::max()) {
    s.completions_ready.wait(lock, ready);
    return true;
  }
  return s.completions_ready.wait_until(lock, deadline, ready);
}

void FakeBackend::quiesce() {
  {
    std::lock_guard lock(state_->mutex);
    auto& s = *state_;
    s.record(Call::Quiesce);
    const Fired fired = s.fire(Call::Quiesce);
    if (fired.fatal) State::throw_fatal(Call::Quiesce, "while quiescing");
    // Late copies finish now (memory is still live), but report only at the
    // next drain; everything else is dropped unmoved.
    for (const auto& copy : s.pending) {
      if (copy.late) s.finish(copy, /*ok=*/true, s.late_after_quiesce);
      s.count_pending(copy, false);
    }
    s.pending.clear();
    s.late_released = false;
    // The own queues are idle now; consumers' queues are not the fake's.
    s.launches_held = false;
    s.pass_fences([](const QueueRef& where) { return where.queue != Queue::Consumer; });
  }
  state_->completions_ready.notify_all();
  state_->fence_passed.notify_all();
}

bool FakeBackend::complete(CopyEvent event, bool ok) {
  {
    std::lock_guard lock(state_->mutex);
    auto it = std::find_if(state_->pending.begin(), state_->pending.end(),
                           [&](const State::PendingCopy& p) { return p.request.event == event; });
    if (it == state_->pending.end()) return false;
    State::PendingCopy copy = std::move(*it);
    state_->pending.erase(it);
    state_->count_pending(copy, false);
    state_->finish(copy, ok, state_->ready);
  }
  state_->completions_ready.notify_all();
  return true;
}

std::size_t FakeBackend::complete_all(bool ok) {
  std::size_t count = 0;
  {
    std::lock_guard lock(state_->mutex);
    while (!state_->pending.empty()) {
      State::PendingCopy copy = std::move(state_->pending.front());
      state_->pending.pop_front();
      state_->count_pending(copy, false);
      state_->finish(copy, ok, state_->ready);
      ++count;
    }
  }
  state_->completions_ready.notify_all();
  return count;
}

std::vector<CopyEvent> FakeBackend::pending() const {
  std::lock_guard lock(state_->mutex);
  std::vector<CopyEvent> events;
  events.reserve(state_->pending.size());
  for (const auto& p : state_->pending) events.push_back(p.request.event);
  return events;
}

void FakeBackend::report_completion(CopyEvent event, bool ok) {
  {
    std::lock_guard lock(state_->mutex);
    Completion c;
    c.event = event;
    c.ok = ok;
    if (!ok) c.message = "fake: forged failed completion for " + event_text(event);
    state_->ready.push_back(std::move(c));
  }
  state_->completions_ready.notify_all();
}

void FakeBackend::set_auto_complete(bool on) {
  std::lock_guard lock(state_->mutex);
  state_->auto_complete = on;
}


bool FakeBackend::copy_to_peer(const DeviceAllocation& source, std::uint64_t source_offset,
                               Backend& destination_backend, const DeviceAllocation& destination,
                               std::uint64_t destination_offset, std::uint64_t len) {
  auto* peer = dynamic_cast<FakeBackend*>(&destination_backend);
  if (peer == nullptr) return false;
  // Each fake checks its own side under its own mutex, one at a time.
  const auto live = [](FakeBackend& fake, const DeviceAllocation& a, std::uint64_t offset, std::uint64_t bytes) {
    std::lock_guard lock(fake.state_->mutex);
    const State::Allocation* allocation = fake.state_->live(a);
    if (allocation == nullptr || !checked::range_within(offset, bytes, allocation->bytes))
      throw Error(ErrorKind::InvalidRange, fmt::format("fake copy_to_peer: [{}, +{}) of the allocation at {:#x} is "
                                                       "not live in its backend", offset, bytes, a.address));
    if (allocation->unbacked) State::refuse_unbacked("copy_to_peer", a.address);
    return allocation->memory;
  };
  const SharedBytes from = live(*this, source, source_offset, len);
  const SharedBytes to = live(*peer, destination, destination_offset, len);
  std::memmove(to.get() + destination_offset, from.get() + source_offset, len);
  return true;
}

}  // namespace devbridge::fake
