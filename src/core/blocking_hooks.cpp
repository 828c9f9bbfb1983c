#include "devbridge/blocking_hooks.hpp"

#include <atomic>

#include "core/bridge_gate.hpp"

namespace devbridge {
namespace {
// Set once at a module's init, read at every sleep: atomics, never a lock.
std::atomic<void* (*)()> g_release{nullptr};
std::atomic<void (*)(void*)> g_reacquire{nullptr};
}  // namespace

void set_blocking_hooks(BlockingHooks hooks) noexcept {
  g_reacquire.store(hooks.reacquire, std::memory_order_release);
  g_release.store(hooks.release, std::memory_order_release);
}

namespace detail {

void* BridgeGate::release_runtime_lock() noexcept {
  auto* release = g_release.load(std::memory_order_acquire);
  return release ? release() : nullptr;
}

void BridgeGate::reacquire_runtime_lock(void* released) noexcept {
  if (auto* reacquire = g_reacquire.load(std::memory_order_acquire)) reacquire(released);
}

RuntimeLockReleased::RuntimeLockReleased() noexcept : released_(BridgeGate::release_runtime_lock()) {}
RuntimeLockReleased::~RuntimeLockReleased() {
  if (released_) BridgeGate::reacquire_runtime_lock(released_);
}

}  // namespace detail
}  // namespace devbridge
