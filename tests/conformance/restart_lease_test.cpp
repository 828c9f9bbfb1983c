// A view ended while a restart is giving back the caching pool.
//
// A restart orphans the allocations live views still lease, then drops its
// lock to free the pool's cached segments in the backend, and only then
// advances the generation. A lease that ended in that window named the
// current generation, found its slot already retired, and was dropped: the
// orphan kept one view and its memory for good. Four Python threads racing
// restart on OpenCL (the pool is on there, off for host and the fake) ended
// with live_views 1, orphaned_allocations 1 in every run
// (tests/python/test_threads_restart.py). Here the backend's free ends the
// view from inside that window, so the interleaving is pinned.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <utility>

#include "devbridge/backends/fake.hpp"
#include "devbridge/bridge.hpp"
#include "forwarding_backend.hpp"

namespace devbridge::conformance {
namespace {

class FreeHookBackend final : public testing::ForwardingBackend {
 public:
  explicit FreeHookBackend(std::shared_ptr<fake::FakeBackend> fake) : ForwardingBackend(std::move(fake)) {}
  void free(const DeviceAllocation& allocation) noexcept override {
    ForwardingBackend::free(allocation);
    if (auto hook = std::exchange(on_free, nullptr)) hook();
  }
  std::function<void()> on_free;
};

TEST(RestartLease, AViewEndedWhileRestartGivesBackTheCacheFreesItsOrphan) {
  auto fake = std::make_shared<fake::FakeBackend>();
  fake->set_auto_complete(true);
  auto owned = std::make_unique<FreeHookBackend>(fake);
  auto& backend = *owned;
  Bridge b(std::move(owned), BridgeOptions{.ring_bytes = 1 << 20, .caching_pool = CachingPool::On});
  // Large enough for a segment of its own each: the cached one is wholly free.
  constexpr std::uint64_t kBytes = 4 << 20;
  const ObjectSpec spec{kBytes, 64, DType::UInt8};
  const auto viewed = b.alloc_device(spec, kBytes);
  b.free_device(b.alloc_device(spec, kBytes));  // cached: the restart gives it back
  ViewLease lease = b.view(viewed, ViewSpec{DType::UInt8, Dims{64}});

  bool ended_in_window = false;
  backend.on_free = [&] {
    ended_in_window = b.stats().orphaned_allocations == 1;
    lease.reset();
  };
  b.restart(2);
  ASSERT_TRUE(ended_in_window) << "the view did not end inside the restart's give-back";

  const auto stats = b.stats();
  EXPECT_EQ(stats.live_views, 0u);
  EXPECT_EQ(stats.orphaned_allocations, 0u);
  b.empty_cache();
  EXPECT_EQ(fake->live_allocations(), 0u);
}

}  // namespace
}  // namespace devbridge::conformance
