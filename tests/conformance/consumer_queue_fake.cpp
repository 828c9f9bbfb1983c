// The fake's consumer queue: a number the fake was told to block, so fences
// recorded on it stay pending until the test unblocks it.
#include "backend_drivers.hpp"
#include "devbridge/backends/fake.hpp"

namespace devbridge::conformance {

namespace {

class FakeConsumerQueue final : public TestConsumerQueue {
 public:
  explicit FakeConsumerQueue(fake::FakeBackend& fake) : fake_(fake) {}
  ~FakeConsumerQueue() override { unblock(); }
  std::uintptr_t handle() const override { return kHandle; }
  void block() override { fake_.block_consumer_queue(kHandle); }
  void unblock() override { fake_.unblock_consumer_queue(kHandle); }

 private:
  static constexpr std::uintptr_t kHandle = 0xc0ffee;
  fake::FakeBackend& fake_;
};

}  // namespace

std::unique_ptr<TestConsumerQueue> make_fake_consumer_queue(Backend& backend) {
  return std::make_unique<FakeConsumerQueue>(*backend.test_controls()->fake());
}

}  // namespace devbridge::conformance
