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

  // The target's description, but for caches_allocations: a bridge over a
  // forwarder keeps no pool unless the test asks for one, so the target's
  // allocation count follows the bridge's allocations one for one.
  BackendInfo describe() override {
    BackendInfo info = target_->describe();
    info.caches_allocations = false;
    return info;
  }

  // ---- device memory ----
  DeviceAllocation allocate(std::uint64_t bytes, std::uint64_t alignment) override {
    return target_->allocate(bytes, alignment);
  }
  void free(const DeviceAllocation& allocation) noexcept override { target_->free(allocation); }
  DeviceAllocation make_part(const DeviceAllocation& whole, std::uint64_t offset, std::uint64_t bytes) override {
    return target_->make_part(whole, offset, bytes);
  }
  void release_part(const DeviceAllocation& part) noexcept override { target_->release_part(part); }
  void validate_view(const DeviceAllocation& allocation, const TensorView& view) override {
    target_->validate_view(allocation, view);
  }

  // ---- host memory ----
  HostBlock allocate_host(std::uint64_t bytes) override { return target_->allocate_host(bytes); }
  void free_host(const HostBlock& block) noexcept override { target_->free_host(block); }
  HostImport import_host(const ImportRequest& request) override { return target_->import_host(request); }
  void release_import(const HostImport& imported) noexcept override { target_->release_import(imported); }

  // ---- transfers ----
  void submit_copy(const CopyRequest& request) override { target_->submit_copy(request); }
  void drain_completions(std::vector<Completion>& out) override { target_->drain_completions(out); }
  bool wait_for_completions(std::chrono::nanoseconds timeout) override {
    return target_->wait_for_completions(timeout);
  }
  bool copy_to_peer(const DeviceAllocation& source, std::uint64_t source_offset, Backend& destination_backend,
                    const DeviceAllocation& destination, std::uint64_t destination_offset,
                    std::uint64_t len) override {
    // A forwarder's peer is the backend it forwards to.
    auto* forwarder = dynamic_cast<ForwardingBackend*>(&destination_backend);
    return target_->copy_to_peer(source, source_offset, forwarder ? *forwarder->target_ : destination_backend,
                                 destination, destination_offset, len);
  }

  // ---- timeline ----
  Fence record_fence(const QueueRef& where) override { return target_->record_fence(where); }
  bool fence_passed(Fence fence) override { return target_->fence_passed(fence); }
  bool wait_fence(Fence fence, std::chrono::nanoseconds timeout) override {
    return target_->wait_fence(fence, timeout);
  }
  void release_fence(Fence fence) noexcept override { target_->release_fence(fence); }
  void order_consumer_queue(std::uintptr_t queue) override { target_->order_consumer_queue(queue); }
  void quiesce() override { target_->quiesce(); }

  // ---- compute ----
  Fence launch_axpy(const AxpyLaunch& launch) override { return target_->launch_axpy(launch); }

  TestControls* test_controls() noexcept override { return target_->test_controls(); }

 private:
  Backend* target_;
  std::shared_ptr<Backend> owner_;
};

}  // namespace devbridge::testing
