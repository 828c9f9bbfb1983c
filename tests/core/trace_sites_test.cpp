// The recording sites on their own, over the components whose counters they
// read: what each event carries, that a restart's generation is read at each
// event, that completions of other generations are left out, and the
// recorder kept for the dumps once recording stops.
#include "core/trace_sites.hpp"

#include <gtest/gtest.h>

#include <vector>

namespace devbridge::detail {
namespace {

constexpr std::uint64_t kDomain = 7;
const ObjectSpec kSpec{1 << 20, 64, DType::Float32, ShapeKind::Tensor};

struct TraceSitesTest : ::testing::Test {
  AllocationTable allocations;
  std::optional<DevicePool> pool;  // none: reserved is what is allocated
  std::vector<std::byte> memory = std::vector<std::byte>(1 << 16);
  HostRing ring{HostBlock{memory.data(), memory.size()}};
  CopyTimeline copies{kDomain, 1 << 20, 16};
  Generation generation = 1;
  TraceSites sites{allocations, pool, ring, copies, generation};

  void start(std::size_t max_events = 64) {
    EXPECT_EQ(sites.start(std::make_unique<FlightRecorder>(RecordOptions{.max_events = max_events})), nullptr);
  }
  TraceRecord at(std::size_t i) const { return sites.kept()->at(i); }
  std::size_t size() const { return sites.kept()->size(); }
};

TEST_F(TraceSitesTest, OffUntilStartedAndKeptAfterStop) {
  EXPECT_FALSE(sites.on());
  EXPECT_EQ(sites.kept(), nullptr);
  start();
  EXPECT_TRUE(sites.on());
  sites.memory(TraceKind::Register, generation, 5, 4096);
  sites.stop();
  EXPECT_FALSE(sites.on());
  ASSERT_NE(sites.kept(), nullptr);
  EXPECT_EQ(size(), 1u) << "what was recorded stays for the dumps";
  EXPECT_EQ(sites.next_oom_dump(), 1u);
  EXPECT_EQ(sites.next_oom_dump(), 2u);
}

TEST_F(TraceSitesTest, AMemoryEventCarriesTheCountersOfTheComponentsNow) {
  start();
  const auto index = allocations.acquire();
  const auto id = allocations.start(index, kSpec, 4, DType::Float32, 4096, DeviceAllocation{0x1000, 4096, 0});
  const HostRange range = ring.reserve(1024, 64);
  sites.memory(TraceKind::Allocate, generation, id, 4096, 0x1000);
  const auto record = at(0);
  EXPECT_EQ(record.kind, TraceKind::Allocate);
  EXPECT_EQ(record.id, id);
  EXPECT_EQ(record.bytes, 4096u);
  EXPECT_EQ(record.offset, 0x1000u);
  ASSERT_TRUE(record.has_counters);
  EXPECT_EQ(record.counters.allocated, 4096u);
  EXPECT_EQ(record.counters.reserved, 4096u);
  EXPECT_EQ(record.counters.cached, 0u);
  EXPECT_EQ(record.counters.ring_used, 1024u);
  EXPECT_EQ(record.counters.in_flight, 0u);
  ring.release(range);
  // Retired, its slot keeps its fields: the free names the allocation, at the generation of now.
  allocations.retire(index);
  generation = 2;
  sites.freed_slot(index);
  const auto freed = at(1);
  EXPECT_EQ(freed.kind, TraceKind::Free);
  EXPECT_EQ(freed.id, id);
  EXPECT_EQ(freed.generation, 2u) << "the bridge's generation is read at each event";
  EXPECT_EQ(freed.counters.allocated, 0u);
  EXPECT_EQ(freed.counters.ring_used, 0u);
}

TEST_F(TraceSitesTest, CompletionsOfThisDomainAndGenerationEndTheirSlicesAndTheBytesInFlight) {
  start();
  const auto first = copies.begin_async(CopyDirection::HostToDevice, 0, 0, 300);
  copies.submitted();
  const auto second = copies.begin_async(CopyDirection::DeviceToHost, 0, 0, 200);
  copies.submitted();
  sites.copy_begin(CopyDirection::DeviceToHost, DeviceRange{DeviceHandle{kDomain, generation, 9}, 16, 200}, second,
                   200);
  const std::vector<Completion> drained{
      Completion{CopyEvent{kDomain, generation, first}, true},
      Completion{CopyEvent{kDomain + 1, generation, second}, true},  // another bridge's: never applied here
      Completion{CopyEvent{kDomain, generation + 1, second}, true},  // another generation's
      Completion{CopyEvent{kDomain, generation, second}, false},
  };
  sites.completions(drained, kDomain);
  ASSERT_EQ(size(), 3u);
  EXPECT_EQ(at(0).kind, TraceKind::CopyBegin);
  EXPECT_EQ(at(0).track, TraceTrack::CopyDown);
  EXPECT_EQ(at(0).counters.in_flight, 500u);
  EXPECT_EQ(at(1).kind, TraceKind::CopyCompleted);
  EXPECT_EQ(at(1).slice, first);
  EXPECT_EQ(at(1).track, TraceTrack::CopyUp);
  EXPECT_EQ(at(1).counters.in_flight, 200u) << "what is in flight once this end applies";
  EXPECT_EQ(at(2).kind, TraceKind::CopyFailed);
  EXPECT_EQ(at(2).slice, second);
  EXPECT_EQ(at(2).counters.in_flight, 0u);
}

TEST_F(TraceSitesTest, AWholeSliceStartedBeforeRecordingBeganEndsWhereItIsRecorded) {
  start();
  const DeviceRange range{DeviceHandle{kDomain, generation, 3}, 64, 128};
  sites.whole_slice(TraceTrack::CopyUp, range, 0, true);
  sites.whole_slice(TraceTrack::CopyUp, range, 0, false, /*in_place=*/true);
  EXPECT_EQ(at(0).kind, TraceKind::WholeSlice);
  EXPECT_EQ(at(0).begin_ns, at(0).ts_ns) << "0: recording began during the call";
  EXPECT_EQ(at(1).kind, TraceKind::InPlaceWriteFailed);
  EXPECT_EQ(at(1).offset, 64u);
  EXPECT_EQ(at(1).bytes, 128u);
}

}  // namespace
}  // namespace devbridge::detail
