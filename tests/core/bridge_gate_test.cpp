// The bridge's gate on its own: the state bits every entry tests, the first
// reason a bridge broke, the calls running outside the lock that a restart
// waits for, and the sleepers woken when something changes.
#include "core/bridge_gate.hpp"

#include <atomic>
#include <mutex>
#include <new>
#include <stdexcept>
#include <thread>

#include <gtest/gtest.h>

#include "core/tags.hpp"
#include "support.hpp"

namespace devbridge::detail {
namespace {

TEST(BridgeGate, OpenUntilABitIsSetAndAgainOnceCleared) {
  BridgeGate gate;
  EXPECT_TRUE(gate.open());
  for (const auto bit : {BridgeGate::kRestarting, BridgeGate::kClosed, BridgeGate::kBroken, BridgeGate::kFencesPending}) {
    gate.set(bit, true);
    EXPECT_FALSE(gate.open()) << int(bit);
    gate.set(bit, false);
    EXPECT_TRUE(gate.open()) << int(bit);
  }
  gate.set(BridgeGate::kRestarting, true);
  gate.set(BridgeGate::kFencesPending, true);
  EXPECT_TRUE(gate.restarting());
  EXPECT_TRUE(gate.fences_pending());
  EXPECT_FALSE(gate.closed());
  EXPECT_FALSE(gate.broken());
}

TEST(BridgeGate, TheUnlockedHintSeesOnlyClosedAndBroken) {
  BridgeGate gate;
  gate.set(BridgeGate::kRestarting, true);
  gate.set(BridgeGate::kFencesPending, true);
  EXPECT_FALSE(gate.seen_closed_or_broken());
  gate.set(BridgeGate::kClosed, true);
  EXPECT_TRUE(gate.seen_closed_or_broken());
  gate.set(BridgeGate::kClosed, false);
  gate.set(BridgeGate::kBroken, true);
  EXPECT_TRUE(gate.seen_closed_or_broken());
}

TEST(BridgeGate, TheFirstReasonToBreakIsKeptUntilMended) {
  BridgeGate gate;
  EXPECT_TRUE(gate.break_for("quiesce failed"));
  EXPECT_FALSE(gate.break_for("a later fault"));
  EXPECT_EQ(gate.broken_reason(), "quiesce failed");
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Broken, gate.check_usable());
  try {
    gate.check_usable();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("quiesce failed"), std::string::npos) << e.what();
  }
  gate.mend();
  EXPECT_TRUE(gate.open());
  EXPECT_TRUE(gate.broken_reason().empty());
  EXPECT_NO_THROW(gate.check_usable());
}

TEST(BridgeGate, ClosedIsRefusedBeforeBroken) {
  BridgeGate gate;
  gate.break_for("fault");
  gate.set(BridgeGate::kClosed, true);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Closed, gate.check_usable());
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Closed, gate.check_not_closed());
}

TEST(BridgeGate, ASleeperWakesWhenNotifiedOfTheChange) {
  BridgeGate gate;
  std::mutex lock;
  bool done = false;
  std::thread sleeper([&] {
    std::unique_lock hold(lock);
    gate.block_while(hold, [&] { return !done; });
  });
  {
    std::lock_guard hold(lock);
    done = true;
    gate.notify();
  }
  sleeper.join();  // hangs (the test times out) if the sleeper missed the change
}

TEST(BridgeGate, RunUnlockedCountsTheCallAndRetakesTheLock) {
  BridgeGate gate;
  std::mutex lock;
  std::unique_lock hold(lock);
  bool running_inside = false, unlocked_inside = false;
  const auto failure = gate.run_unlocked(hold, [&] {
    running_inside = gate.calls_running();
    unlocked_inside = lock.try_lock();
    if (unlocked_inside) lock.unlock();
  });
  EXPECT_FALSE(failure.has_value());
  EXPECT_TRUE(running_inside);
  EXPECT_TRUE(unlocked_inside);
  EXPECT_TRUE(hold.owns_lock());
  EXPECT_FALSE(gate.calls_running());
}

TEST(BridgeGate, RunUnlockedTurnsWhateverTheWorkThrowsIntoTheVocabulary) {
  BridgeGate gate;
  std::mutex lock;
  std::unique_lock hold(lock);
  auto kind_of = [&](auto work) {
    const auto failure = gate.run_unlocked(hold, work);
    EXPECT_TRUE(hold.owns_lock());
    EXPECT_FALSE(gate.calls_running());
    return failure ? failure->kind() : ErrorKind::Closed;
  };
  EXPECT_EQ(kind_of([] { throw Error(ErrorKind::DeviceCopyFailed, "copy"); }), ErrorKind::DeviceCopyFailed);
  EXPECT_EQ(kind_of([] { throw std::bad_alloc(); }), ErrorKind::AllocationFailed);
  EXPECT_EQ(kind_of([] { throw std::runtime_error("driver"); }), ErrorKind::Unavailable);
  EXPECT_EQ(kind_of([] { throw 7; }), ErrorKind::Unavailable);
}

TEST(Tags, ForeignOldAndNewerAreToldApart) {
  const DeviceHandle h{5, 3, 1};
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::ForeignDomain, fail_tag(h, 6, 3));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, fail_tag(h, 5, 4));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, fail_tag(h, 5, 2));
}

}  // namespace
}  // namespace devbridge::detail
