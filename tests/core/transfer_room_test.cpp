// TransferRoom, RunningTransfer and RoomWatch (src/transfer/transfer_room.hpp):
// the room running transfers hold on a bridge's ring, and the rule for a
// transfer short of room: wait while neighbours hold room or give some back,
// refuse once they have been quiet for kQuietBeforeRefusing.
#include "transfer/transfer_room.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "devbridge/transfer.hpp"
#include "transfer/ring_chunks.hpp"
#include "support.hpp"

namespace devbridge::testing {
namespace {

using namespace std::chrono_literals;
using detail::kQuietBeforeRefusing;
using detail::RoomWatch;
using detail::RunningTransfer;
using detail::TransferRoom;

class TransferRoomTest : public BridgeTest {
 protected:
  static constexpr std::uint64_t kRing = 64 << 10;
  void SetUp() override {
    BridgeOptions options = default_options();
    options.ring_bytes = kRing;
    rebuild(options);
  }
  checked::Clock::time_point later(std::chrono::nanoseconds by) { return checked::Clock::now() + by; }
};

TEST_F(TransferRoomTest, AloneNoNeighbourRuns) {
  const RunningTransfer me(*bridge);
  const TransferRoom mine(*bridge, 4096);
  RoomWatch watch(*bridge, mine.bytes());
  EXPECT_FALSE(watch.others_running());
  EXPECT_FALSE(watch.others_quiet(checked::Clock::now()));  // quiet only once the time has passed
  EXPECT_TRUE(watch.others_quiet(later(kQuietBeforeRefusing)));
}

TEST_F(TransferRoomTest, ANeighbourHoldingNothingStillRuns) {
  const RunningTransfer me(*bridge), neighbour(*bridge);
  RoomWatch watch(*bridge, 0);
  EXPECT_TRUE(watch.others_running());  // it may be waiting too, or have reserved a moment ago
  EXPECT_TRUE(watch.others_quiet(later(kQuietBeforeRefusing)));
}

TEST_F(TransferRoomTest, RoomANeighbourHoldsOrGivesBackKeepsTheWatchWaiting) {
  const RunningTransfer me(*bridge);
  RoomWatch watch(*bridge, 0);
  {
    const RunningTransfer neighbour(*bridge);
    TransferRoom theirs(*bridge, 8192);
    EXPECT_TRUE(watch.others_running());
    EXPECT_FALSE(watch.others_quiet(later(2 * kQuietBeforeRefusing)));  // held: never quiet
    TransferRoom::give_back(*bridge, theirs.keep());                     // its range went back: room came back
  }
  const auto returned_at = later(2 * kQuietBeforeRefusing);
  EXPECT_FALSE(watch.others_quiet(returned_at));  // the return is news: the quiet starts over from here
  EXPECT_FALSE(watch.others_quiet(returned_at + kQuietBeforeRefusing / 2));
  EXPECT_TRUE(watch.others_quiet(returned_at + kQuietBeforeRefusing));
  EXPECT_FALSE(watch.others_running());
}

TEST_F(TransferRoomTest, AChunkStandingAsideHoldsNothingAndGivesNothingBack) {
  const RunningTransfer me(*bridge), neighbour(*bridge);
  TransferRoom theirs(*bridge, 8192);
  RoomWatch watch(*bridge, 0);
  EXPECT_FALSE(watch.others_quiet(checked::Clock::now()));
  {
    const TransferRoom::StandAside waiting(theirs);
    const auto start = checked::Clock::now();
    EXPECT_FALSE(watch.others_quiet(start));
    EXPECT_TRUE(watch.others_quiet(start + kQuietBeforeRefusing));  // standing aside is no room coming back
  }
  EXPECT_FALSE(watch.others_quiet(later(kQuietBeforeRefusing)));  // counted again
}

TEST_F(TransferRoomTest, RoomsAreCountedPerBridge) {
  BridgeOptions options = default_options();
  options.ring_bytes = kRing;
  auto other = std::make_unique<Bridge>(std::make_unique<FakeBackend>(), options);
  const RunningTransfer me(*bridge), elsewhere(*other);
  const TransferRoom theirs(*other, 8192);
  RoomWatch watch(*bridge, 0);
  EXPECT_FALSE(watch.others_running());
  EXPECT_TRUE(watch.others_quiet(later(kQuietBeforeRefusing)));
}

// The race RoomWatch exists for: a neighbour's reserve succeeded a moment
// before it counts the range (here: it never counts it, and gives the range
// back later). A transfer short of room waits for it rather than refusing on
// one look at the counts (threads sharing a small ring got Backpressure).
TEST_F(TransferRoomTest, ATransferWaitsForANeighbourWhoseRangeIsNotCountedYet) {
  fake->set_auto_complete(true);
  const std::vector<std::byte> data = random_bytes(kRing / 2, 7);
  const DeviceHandle h = bridge->alloc_device(bytes_spec(kRing), kRing);
  std::atomic<bool> reserved{false};
  std::thread neighbour([&] {
    const RunningTransfer running(*bridge);
    const HostRange taken = bridge->reserve(kRing - 4096);  // reserved, not counted yet
    reserved = true;
    std::this_thread::sleep_for(3 * kQuietBeforeRefusing / 4);
    bridge->release_host(taken);
  });
  while (!reserved) std::this_thread::yield();
  TransferPlanner planner(*bridge, {.chunk_bytes = kRing / 2, .route = Route::RingChunks});
  EXPECT_NO_THROW(planner.run(HostSource{data}, DeviceSpan{h, 0, data.size(), nullptr}));
  neighbour.join();
  EXPECT_EQ(device_contents(h, 0, data.size()), data);
  bridge->free_device(h);
}

// A range nobody running gives back (the caller's own) is refused promptly,
// alone at once, beside a neighbour that only waits once they have been quiet.
TEST_F(TransferRoomTest, RoomTheCallerKeepsIsRefused) {
  fake->set_auto_complete(true);
  const std::vector<std::byte> data = random_bytes(kRing / 2, 8);
  const DeviceHandle h = bridge->alloc_device(bytes_spec(kRing), kRing);
  const HostRange kept = bridge->reserve(kRing - 4096);
  TransferPlanner planner(*bridge, {.chunk_bytes = kRing / 2, .route = Route::RingChunks});
  expect_error(ErrorKind::Backpressure, [&] { planner.run(HostSource{data}, DeviceSpan{h, 0, data.size(), nullptr}); });
  {
    const RunningTransfer waiting_too(*bridge);
    const auto started = std::chrono::steady_clock::now();
    expect_error(ErrorKind::Backpressure, [&] { planner.run(HostSource{data}, DeviceSpan{h, 0, data.size(), nullptr}); });
    EXPECT_LT(std::chrono::steady_clock::now() - started, detail::kWaitForOtherTransfers / 2);
  }
  bridge->release_host(kept);
  bridge->free_device(h);
}

}  // namespace
}  // namespace devbridge::testing
