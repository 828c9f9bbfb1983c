// A backend that forwards every hook to another one the test keeps, so the
// test can read the target's counts after the bridge that owned the
// forwarder is gone, or override the one hook it changes.
#pragma once

#include <memory>
#include <utility>

#include "devbridge/backend.hpp"

namespace devbridge::testing {

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(Backend& target) : target_(&target) {}
  // Shares ownership of the target.
  explicit ForwardingBackend(std::shared_ptr<Backend> target) : target_(target.get()), owner_(std::move(target)) {}

  BackendInfo describe() override { return target_->describe(); }
  DeviceAllocation allocate(std::uint64_t bytes, std::uint64_t alignment) override {
    return target_->allocate(bytes, alignment);
  }
  void free(const DeviceAllocation& allocation) noexcept override { target_->free(allocation); }
  HostBlock allocate_host(std::uint64_t bytes) override { return target_->allocate_host(bytes); }
  void free_host(const HostBlock& block) noexcept override { target_->free_host(block); }
  HostBlock register_host(std::byte* data, std::uint64_t bytes) override { return target_->register_host(data, bytes); }
  HostBlock register_host_read_only(const std::byte* data, std::uint64_t bytes) override {
    return target_->register_host_read_only(data, bytes);
  }
  void unregister_host(const HostBlock& block) noexcept override { target_->unregister_host(block); }
  DeviceAllocation adopt_host(const HostBlock& region, std::uint64_t offset, std::uint64_t bytes) override {
    return target_->adopt_host(region, offset, bytes);
  }
  void release_adopted(const DeviceAllocation& adopted) noexcept override { target_->release_adopted(adopted); }
  void submit_copy(const CopyRequest& request) override { target_->submit_copy(request); }
  void drain_completions(std::vector<Completion>& out) override { target_->drain_completions(out); }
  bool wait_for_completions(std::chrono::nanoseconds timeout) override {
    return target_->wait_for_completions(timeout);
  }
  void quiesce() override { target_->quiesce(); }
  Fence launch_axpy(const AxpyLaunch& launch) override { return target_->launch_axpy(launch); }
  Fence record_fence(const QueueRef& where) override { return target_->record_fence(where); }
  bool fence_passed(Fence fence) override { return target_->fence_passed(fence); }
  bool wait_fence(Fence fence, std::chrono::nanoseconds timeout) override {
    return target_->wait_fence(fence, timeout);
  }
  void release_fence(Fence fence) noexcept override { target_->release_fence(fence); }
  void validate_view(const DeviceAllocation& allocation, const TensorView& view) override {
    target_->validate_view(allocation, view);
  }
  // caches_allocations() is not forwarded: a bridge over a forwarder keeps no
  // pool unless the test asks for one, so the target's allocation count
  // follows the bridge's allocations one for one.
  std::uint64_t part_alignment() const override { return target_->part_alignment(); }
  DeviceAllocation make_part(const DeviceAllocation& whole, std::uint64_t offset, std::uint64_t bytes) override {
    return target_->make_part(whole, offset, bytes);
  }
  void release_part(const DeviceAllocation& part) noexcept override { target_->release_part(part); }
  bool copy_to_peer(const DeviceAllocation& source, std::uint64_t source_offset, Backend& destination_backend,
                    const DeviceAllocation& destination, std::uint64_t destination_offset,
                    std::uint64_t len) override {
    // A forwarder's peer is the backend it forwards to.
    auto* forwarder = dynamic_cast<ForwardingBackend*>(&destination_backend);
    return target_->copy_to_peer(source, source_offset, forwarder ? *forwarder->target_ : destination_backend,
                                 destination, destination_offset, len);
  }
  std::uintptr_t native_context() override { return target_->native_context(); }
  void order_consumer_queue(std::uintptr_t queue) override { target_->order_consumer_queue(queue); }
  TestControls* test_controls() noexcept override { return target_->test_controls(); }

 private:
  Backend* target_;
  std::shared_ptr<Backend> owner_;
};

}  // namespace devbridge::testing
