// The fake backend: fences on its own queues and on consumers', held and
// signalled as the test says.
#include "backends/fake/fake_backend_impl.hpp"

namespace devbridge::fake {

Fence FakeBackend::record_fence(const QueueRef& where) {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  const bool pending = where.queue == Queue::Consumer ? s.blocked_consumers.contains(where.consumer)
                                                      : s.launches_held;
  return s.new_fence(where, pending);
}

bool FakeBackend::fence_passed(Fence fence) {
  std::lock_guard lock(state_->mutex);
  return state_->fence_record(fence).passed;
}

bool FakeBackend::wait_fence(Fence fence, std::chrono::nanoseconds timeout) {
  std::unique_lock lock(state_->mutex);
  auto& s = *state_;
  s.fence_record(fence);
  const auto passed = [&] {
    auto it = s.fences.find(fence.token);
    return it == s.fences.end() || it->second.passed;
  };
  const auto deadline = checked::deadline_after(timeout);
  if (deadline == checked::Clock::time_point::max()) {
    s.fence_passed.wait(lock, passed);
    return true;
  }
  return s.fence_passed.wait_until(lock, deadline, passed);
}

void FakeBackend::release_fence(Fence fence) noexcept {
  std::lock_guard lock(state_->mutex);
  state_->fences.erase(fence.token);
}

void FakeBackend::hold_launches(bool hold) {
  {
    std::lock_guard lock(state_->mutex);
    auto& s = *state_;
    s.launches_held = hold;
    if (!hold) s.pass_fences([](const QueueRef& where) { return where.queue != Queue::Consumer; });
  }
  state_->fence_passed.notify_all();
}

void FakeBackend::block_consumer_queue(std::uintptr_t queue) {
  std::lock_guard lock(state_->mutex);
  state_->blocked_consumers.insert(queue);
}

void FakeBackend::unblock_consumer_queue(std::uintptr_t queue) {
  {
    std::lock_guard lock(state_->mutex);
    auto& s = *state_;
    s.blocked_consumers.erase(queue);
    s.pass_fences([&](const QueueRef& where) { return where.queue == Queue::Consumer && where.consumer == queue; });
  }
  state_->fence_passed.notify_all();
}

bool FakeBackend::signal_fence(Fence fence) {
  {
    std::lock_guard lock(state_->mutex);
    auto it = state_->fences.find(fence.token);
    if (it == state_->fences.end() || it->second.passed) return false;
    it->second.passed = true;
  }
  state_->fence_passed.notify_all();
  return true;
}

std::vector<Fence> FakeBackend::pending_fences() const {
  std::lock_guard lock(state_->mutex);
  std::vector<Fence> out;
  for (const auto& [token, fence] : state_->fences)
    if (!fence.passed) out.push_back(Fence{token});
  return out;
}

std::uint64_t FakeBackend::live_fences() const {
  std::lock_guard lock(state_->mutex);
  return state_->fences.size();
}

}  // namespace devbridge::fake
