// The flight recorder on its own (the ring, the dump's pairing of slices),
// and through a bridge on the fake backend: the out-of-memory message's
// fragmentation figure and holders, the dump on out-of-memory, stacks, the
// memory snapshot.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "../conformance/trace_checks.hpp"
#include "core/describe.hpp"
#include "core/flight_recorder.hpp"
#include "support.hpp"

namespace devbridge::testing {
namespace {

using detail::FlightRecorder;
using detail::TraceKind;
using detail::TraceRecord;
using detail::TraceTrack;
using nlohmann::json;

TraceRecord marked(std::uint64_t marker) {
  auto record = detail::trace_record(TraceKind::Allocate, 1, marker);
  record.bytes = marker;
  return record;
}

TEST(FlightRecorder, TheRingKeepsTheNewestEventsAndCountsTheDropped) {
  FlightRecorder recorder(RecordOptions{.max_events = 4});
  for (std::uint64_t i = 1; i <= 10; ++i) recorder.record(marked(i));
  EXPECT_EQ(recorder.size(), 4u);
  EXPECT_EQ(recorder.recorded(), 10u);
  EXPECT_EQ(recorder.dropped(), 6u);
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(recorder.at(i).bytes, 7 + i) << "oldest first";
    EXPECT_EQ(recorder.sequence(i), 6 + i);
  }
  detail::TraceDump dump;
  recorder.copy_to(dump);
  ASSERT_EQ(dump.records.size(), 4u);
  EXPECT_EQ(dump.records.front().bytes, 7u);
  EXPECT_EQ(dump.records.back().bytes, 10u);
  EXPECT_EQ(dump.dropped, 6u);
}

TEST(FlightRecorder, RecordsAreStampedInOrderWithTheirThread) {
  FlightRecorder recorder(RecordOptions{.max_events = 8});
  for (std::uint64_t i = 1; i <= 3; ++i) recorder.record(marked(i));
  EXPECT_LE(recorder.at(0).ts_ns, recorder.at(1).ts_ns);
  EXPECT_LE(recorder.at(1).ts_ns, recorder.at(2).ts_ns);
  EXPECT_EQ(recorder.at(0).thread, detail::trace_thread());
  EXPECT_NE(recorder.at(0).thread, 0u);
}

TEST(FlightRecorder, MaxEventsOutsideItsRangeIsRefusedNamingTheValue) {
  auto message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, FlightRecorder::check_max_events(0));
  EXPECT_NE(message.find("max_events of 0"), std::string::npos) << message;
  message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, FlightRecorder::check_max_events(kMaxRecordedEvents + 1));
  EXPECT_NE(message.find(std::to_string(kMaxRecordedEvents + 1)), std::string::npos) << message;
}

TEST(FlightRecorder, StacksAreInternedAndOnlyWhenAsked) {
  FlightRecorder with(RecordOptions{.max_events = 8, .stacks = true});
  FlightRecorder without(RecordOptions{.max_events = 8});
  {
    TraceStack stack("test.py:3 f");
    with.record(marked(1));
    with.record(marked(2));
    without.record(marked(1));
  }
  with.record(marked(3));
  EXPECT_EQ(with.at(0).stack, 1u);
  EXPECT_EQ(with.at(1).stack, 1u) << "one text, one number";
  EXPECT_EQ(with.at(2).stack, 0u) << "no stack outside the scope";
  EXPECT_EQ(without.at(0).stack, 0u);
  detail::TraceDump dump;
  with.copy_to(dump);
  ASSERT_EQ(dump.stacks.size(), 1u);
  const auto trace = json::parse(detail::trace_json(dump));
  EXPECT_EQ(trace["traceEvents"][7]["args"]["stack"], "test.py:3 f");
}

TEST(FlightRecorder, StacksOfDroppedRecordsDoNotAccumulate) {
  // Call sites without end (generated code, a notebook): the ring keeps 8 records, the table of texts
  // stays bounded, and every kept record still names its own text.
  FlightRecorder recorder(RecordOptions{.max_events = 8, .stacks = true});
  for (int i = 0; i < 5000; ++i) {
    TraceStack stack("cell_" + std::to_string(i) + ".py:1 <module>");
    recorder.record(marked(static_cast<std::uint64_t>(i) + 1));
  }
  detail::TraceDump dump;
  recorder.copy_to(dump);
  EXPECT_LE(dump.stacks.size(), 1024u);
  ASSERT_EQ(recorder.size(), 8u);
  for (std::size_t i = 0; i < 8; ++i) {
    const auto record = recorder.at(i);
    ASSERT_GE(record.stack, 1u);
    EXPECT_EQ(dump.stacks[record.stack - 1], "cell_" + std::to_string(4992 + i) + ".py:1 <module>");
  }
}

TEST(FlightRecorder, StackTextThatIsNotUtf8StaysValidJson) {
  FlightRecorder recorder(RecordOptions{.max_events = 8, .stacks = true});
  {
    // A lone continuation byte, a truncated sequence, an overlong form, a surrogate, and real UTF-8 beside them.
    TraceStack stack("caf\xe9.py:1 f\n\x80 \xe2\x82 \xc0\xaf \xed\xa0\x80 \xe2\x82\xac.py:2 g");
    recorder.record(marked(1));
  }
  detail::TraceDump dump;
  recorder.copy_to(dump);
  const auto trace = json::parse(detail::trace_json(dump));  // nlohmann refuses JSON that is not UTF-8
  EXPECT_EQ(trace["traceEvents"][7]["args"]["stack"],
            "caf\\xe9.py:1 f\n\\x80 \\xe2\\x82 \\xc0\\xaf \\xed\\xa0\\x80 \xe2\x82\xac.py:2 g");
}

TraceRecord slice(TraceKind kind, TraceTrack track, std::uint64_t key, std::uint64_t ts) {
  auto record = detail::trace_record(kind, 1, key);
  record.slice = key;
  record.track = track;
  record.ts_ns = ts;
  return record;
}

TEST(FlightRecorder, OverlappingSlicesGetLanesAndEveryBeginHasItsEnd) {
  detail::TraceDump dump;
  dump.backend = "fake";
  dump.device = "0";
  dump.domain = 3;
  dump.start_ns = 1000;
  dump.dump_ns = 9000;
  dump.records = {
      slice(TraceKind::CopyCompleted, TraceTrack::CopyUp, 9, 1500),  // its begin was dropped: left out
      slice(TraceKind::CopyBegin, TraceTrack::CopyUp, 1, 2000),
      slice(TraceKind::CopyBegin, TraceTrack::CopyUp, 2, 3000),      // overlaps the first: a lane of its own
      slice(TraceKind::CopyCompleted, TraceTrack::CopyUp, 1, 4000),
      slice(TraceKind::CopyFailed, TraceTrack::CopyUp, 2, 5000),
      slice(TraceKind::ViewBegin, TraceTrack::Views, 7, 6000),       // still open at the dump
  };
  dump.records[1].has_counters = true;
  dump.records[1].counters = {100, 200, 50, 64, 32};
  dump.recorded = dump.records.size();
  const auto trace = json::parse(detail::trace_json(dump));
  expect_valid_trace(trace);
  std::vector<std::pair<std::string, std::uint64_t>> slices;
  bool lane_named = false;
  for (const auto& event : trace["traceEvents"]) {
    if (event["ph"] == "B" || event["ph"] == "E") slices.emplace_back(event["ph"], event["tid"]);
    if (event["ph"] == "M" && event["name"] == "thread_name" && event["tid"] == 10000) {
      lane_named = event["args"]["name"] == "copy up #2";
    }
    if (event["ph"] == "C") EXPECT_EQ(event["args"]["reserved"], 200);
  }
  const std::vector<std::pair<std::string, std::uint64_t>> expected{
      {"B", 2}, {"B", 10000}, {"E", 2}, {"E", 10000}, {"B", 6}, {"E", 6}};  // lanes from 10000 up
  EXPECT_EQ(slices, expected);
  EXPECT_TRUE(lane_named);
  const auto& events = trace["traceEvents"];
  const auto open_end = std::find_if(events.begin(), events.end(), [](const json& e) {
    return e["ph"] == "E" && e["args"]["status"] == "open";
  });
  ASSERT_NE(open_end, events.end());
  EXPECT_DOUBLE_EQ((*open_end)["ts"].get<double>(), 8.0) << "ends at the dump, in microseconds";
  EXPECT_EQ(trace["otherData"]["backend"], "fake");
}

// ---- through a bridge on the fake ----

const ObjectSpec kBytes{1 << 20, 64, DType::UInt8, ShapeKind::Vector};

struct RecordedBridge : ::testing::Test {
  void make(std::uint64_t memory) {
    fake = std::make_shared<FakeBackend>(memory);
    fake->set_auto_complete(true);
    fake->set_parts(false);  // whole blocks: each cached block is a segment of its own
    bridge = std::make_unique<Bridge>(std::make_unique<ForwardingBackend>(fake),
                                      BridgeOptions{.ring_bytes = 4096, .caching_pool = CachingPool::On});
  }
  std::shared_ptr<FakeBackend> fake;
  std::unique_ptr<Bridge> bridge;
};

// Live 8 KiB under a view; 2 KiB and 4 KiB cached; a request of 12 KiB of a
// 16 KiB device cannot be met even after the cache goes back.
std::string fragmented_out_of_memory(Bridge& bridge, DeviceHandle& held, std::optional<ViewLease>& view) {
  const auto small = bridge.alloc_device(kBytes, 2048);
  const auto medium = bridge.alloc_device(kBytes, 4096);
  held = bridge.alloc_device(kBytes, 8192);
  bridge.free_device(small);
  bridge.free_device(medium);
  view.emplace(bridge.view(held, ViewSpec{DType::UInt8, Dims{8192}, std::nullopt, 0}));
  return EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationFailed, bridge.alloc_device(kBytes, 12288));
}

TEST_F(RecordedBridge, OutOfMemoryNamesTheFragmentationAndTheHolders) {
  make(16384);
  DeviceHandle held;
  std::optional<ViewLease> view;
  const auto message = fragmented_out_of_memory(*bridge, held, view);
  EXPECT_NE(message.find("fragmentation 33.3% = 1 - 4096 / 6144"), std::string::npos) << message;
  EXPECT_NE(message.find("6144 cached (the largest cached block 4096 bytes"), std::string::npos) << message;
  EXPECT_NE(message.find("the largest holders: " + detail::describe(held) + " of 8192 bytes"), std::string::npos)
      << message;
  EXPECT_NE(message.find("1 live view held by the caller"), std::string::npos) << message;
  EXPECT_EQ(message.find("flight recorder"), std::string::npos) << "no dump without the recorder";
  view.reset();
  bridge->free_device(held);
}

// Past the five largest, the rest are counted with their bytes: "and 7
// smaller" read wrong when they were as large as those shown.
TEST_F(RecordedBridge, OutOfMemoryCountsTheHoldersPastTheFiveItNames) {
  make(12 * 4096);
  std::vector<DeviceHandle> held;
  for (int i = 0; i < 12; ++i) held.push_back(bridge->alloc_device(kBytes, 4096));
  const auto message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationFailed, bridge->alloc_device(kBytes, 4096));
  EXPECT_NE(message.find("; and 7 more, none larger, 28672 bytes in all"), std::string::npos) << message;
  EXPECT_EQ(message.find("smaller"), std::string::npos) << message;
  for (const DeviceHandle& h : held) bridge->free_device(h);
}

// A view from before a restart keeps its allocation as an orphan: the
// memory a retry cannot get back is named, not "no live allocation".
TEST_F(RecordedBridge, OutOfMemoryNamesWhatAViewFromBeforeARestartKeeps) {
  make(16384);
  const auto old = bridge->alloc_device(kBytes, 12288);
  std::optional<ViewLease> view(bridge->view(old, ViewSpec{DType::UInt8, Dims{12288}, std::nullopt, 0}));
  bridge->restart(2);
  const auto message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationFailed, bridge->alloc_device(kBytes, 8192));
  EXPECT_NE(message.find("0 bytes in live allocations, 12288 kept from before a restart or close by views or fences"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("the largest holders: " + detail::describe(old) +
                         " of 12288 bytes, from before a restart or close, kept by 1 live view"),
            std::string::npos)
      << message;
  EXPECT_EQ(message.find("none (no live allocation)"), std::string::npos) << message;
  view.reset();
  bridge->empty_cache();
  EXPECT_EQ(fake->live_allocations(), 0u) << "the orphan goes once its view ends";
}

TEST_F(RecordedBridge, OutOfMemoryDumpsTheTraceWhereAskedAndNamesTheFile) {
  make(16384);
  const auto directory = std::filesystem::temp_directory_path() /
                         ("devbridge-oom-test-" + std::to_string(::getpid()));
  std::filesystem::create_directories(directory);
  bridge->record(RecordOptions{.max_events = 1000, .oom_dump_dir = directory.string()});
  DeviceHandle held;
  std::optional<ViewLease> view;
  const auto message = fragmented_out_of_memory(*bridge, held, view);
  const auto at = message.find("the flight recorder's trace is in ");
  ASSERT_NE(at, std::string::npos) << message;
  const std::filesystem::path path = message.substr(at + std::string("the flight recorder's trace is in ").size());
  EXPECT_EQ(path.parent_path(), directory);
  EXPECT_EQ(path.filename().string().rfind("devbridge-oom-" + std::to_string(::getpid()) + "-", 0), 0u)
      << path << ": named by the process too (domains restart at 1 in every process)";
  std::ifstream file(path);
  ASSERT_TRUE(file) << path;
  const auto trace = json::parse(file);
  expect_valid_trace(trace);
  const auto names = event_names(trace, {"oom retry", "view"});
  EXPECT_EQ(names, (std::vector<std::string>{"view B", "oom retry", "view E"}))
      << "the view still open at the dump";
  view.reset();
  bridge->free_device(held);
  std::filesystem::remove_all(directory);
}

TEST_F(RecordedBridge, AnOomDumpDirectoryItCannotWriteInIsRefusedWhenRecordingStarts) {
  make(16384);
  const auto missing = std::filesystem::temp_directory_path() / ("devbridge-no-such-dir-" + std::to_string(::getpid()));
  const auto file = std::filesystem::temp_directory_path() / ("devbridge-a-file-" + std::to_string(::getpid()));
  std::ofstream(file) << "x";
  // /proc takes no new file, though access(2) says it does to root.
  for (const auto& directory : {missing, file, std::filesystem::path("/proc")}) {
    try {
      bridge->record(RecordOptions{.max_events = 10, .oom_dump_dir = directory.string()});
      ADD_FAILURE() << directory << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Unavailable);
      EXPECT_NE(std::string(e.what()).find(directory.string()), std::string::npos) << e.what();
    }
  }
  std::filesystem::remove(file);
  bridge->free_device(bridge->alloc_device(kBytes, 4096));
  EXPECT_EQ(bridge->trace_json().find("\"allocate\""), std::string::npos) << "recording did not start";
}

TEST_F(RecordedBridge, TheSnapshotShowsBlocksTheirHoldersAndTheirEvents) {
  make(1 << 30);
  bridge->record(RecordOptions{.max_events = 100});
  const auto kept = bridge->alloc_device(kBytes, 4096);
  bridge->free_device(bridge->alloc_device(kBytes, 2048));
  auto view = bridge->view(kept, ViewSpec{DType::UInt8, Dims{16}, std::nullopt, 0});
  const auto snapshot = json::parse(bridge->memory_snapshot_json());
  EXPECT_EQ(snapshot["format"], "devbridge-memory-snapshot");
  EXPECT_EQ(snapshot["stats"]["allocated_bytes"], 4096);
  EXPECT_EQ(snapshot["stats"]["cached_bytes"], 2048);
  std::map<std::string, json> blocks;
  for (const auto& segment : snapshot["segments"])
    for (const auto& block : segment["blocks"]) blocks[block["state"]] = block;
  ASSERT_TRUE(blocks.contains("allocated")) << snapshot.dump(1);
  ASSERT_TRUE(blocks.contains("cached")) << snapshot.dump(1);
  const auto& live = blocks["allocated"];
  EXPECT_EQ(live["handle"], fmt::format("{}:{}:{}", kept.domain, kept.generation, kept.id));
  EXPECT_EQ(live["holders"]["views"], 1);
  EXPECT_FALSE(live["events"].empty()) << "its allocate and its view";
  EXPECT_EQ(blocks["cached"]["bytes"], 2048);
}

TEST_F(RecordedBridge, EachEventOfACallCarriesTheStackItsBindingSet) {
  make(1 << 30);
  bridge->record(RecordOptions{.max_events = 100, .stacks = true});
  EXPECT_TRUE(bridge->records_stacks());
  {
    TraceStack stack("model.py:12 step\ntrain.py:40 main");
    bridge->free_device(bridge->alloc_device(kBytes, 4096));
  }
  bridge->stop_recording();
  EXPECT_FALSE(bridge->records_stacks());
  const auto trace = json::parse(bridge->trace_json());
  int with_stack = 0;
  for (const auto& event : trace["traceEvents"])
    if (event["ph"] == "i") {
      EXPECT_EQ(event["args"]["stack"], "model.py:12 step\ntrain.py:40 main") << event.dump();
      ++with_stack;
    }
  EXPECT_GE(with_stack, 2) << "allocate and free at least";
}

// ---- the memory counters: allocated + cached is reserved, as memory_stats() has it ----

struct Sample {
  std::uint64_t allocated, reserved, cached;
};

std::vector<Sample> memory_samples(const Bridge& bridge) {
  std::vector<Sample> samples;
  const auto trace = json::parse(bridge.trace_json());
  for (const auto& event : trace["traceEvents"])
    if (event["ph"] == "C")
      samples.push_back({event["args"]["allocated"], event["args"]["reserved"], event["args"]["cached"]});
  return samples;
}

// The last sample says what memory_stats() says now, and every sample from
// `from` on adds up (no orphan is held: then memory_stats() adds up too).
void expect_samples_add_up(const Bridge& bridge, std::size_t from, const std::string& after) {
  SCOPED_TRACE(after);
  const auto samples = memory_samples(bridge);
  ASSERT_FALSE(samples.empty());
  const MemoryStats stats = bridge.memory_stats();
  ASSERT_EQ(stats.allocated_bytes + stats.cached_bytes, stats.reserved_bytes) << "memory_stats() adds up";
  EXPECT_EQ(samples.back().allocated, stats.allocated_bytes);
  EXPECT_EQ(samples.back().cached, stats.cached_bytes);
  EXPECT_EQ(samples.back().reserved, stats.reserved_bytes);
  for (std::size_t i = from; i < samples.size(); ++i)
    EXPECT_EQ(samples[i].allocated + samples[i].cached, samples[i].reserved)
        << "sample " << i << ": allocated " << samples[i].allocated << ", cached " << samples[i].cached
        << ", reserved " << samples[i].reserved;
}

struct PoolShape {
  const char* name;
  bool parts;                           // a pool that splits segments, or one of whole blocks
  std::optional<std::uint64_t> cap;     // 0: every wholly free segment goes back at once
};

void PrintTo(const PoolShape& shape, std::ostream* os) { *os << shape.name; }

class RecordedPoolCounters : public ::testing::TestWithParam<PoolShape> {};

TEST_P(RecordedPoolCounters, EverySampleAddsUpAsMemoryStatsDo) {
  auto fake = std::make_shared<FakeBackend>(1 << 30);
  fake->set_auto_complete(true);
  fake->set_parts(GetParam().parts);
  Bridge bridge(std::make_unique<ForwardingBackend>(fake),
                BridgeOptions{.ring_bytes = 4096, .caching_pool = CachingPool::On, .pool_cap_bytes = GetParam().cap});
  bridge.record(RecordOptions{.max_events = 10000});
  const ObjectSpec spec{1 << 24, 256, DType::UInt8, ShapeKind::Vector};
  // A miss (a new segment, split), then a hit in its rest (split again).
  const auto h1 = bridge.alloc_device(spec, 256);
  expect_samples_add_up(bridge, 0, "the first allocation");
  const auto h2 = bridge.alloc_device(spec, 256);
  expect_samples_add_up(bridge, 0, "the second");
  // The probe's case: the free's sample missed the 512 bytes it gave back.
  bridge.free_device(h1);
  expect_samples_add_up(bridge, 0, "free of the first");
  bridge.free_device(h2);  // coalesces; the segment is wholly free (and past a cap of 0: given back)
  expect_samples_add_up(bridge, 0, "free of the second");
  const auto again = bridge.alloc_device(spec, 256);  // from the cache, or a new segment
  expect_samples_add_up(bridge, 0, "an allocation after the frees");
  // A large one: a segment of its own; freed by the end of a deferred release.
  const auto large = bridge.alloc_device(spec, 3 << 20);
  {
    auto view = bridge.view(large, ViewSpec{DType::UInt8, Dims{16}, std::nullopt, 0});
    bridge.release(large);
  }
  expect_samples_add_up(bridge, 0, "the deferred free");
  const auto smaller = bridge.alloc_device(spec, 2 << 20);  // may split the large segment
  expect_samples_add_up(bridge, 0, "a smaller large allocation");
  bridge.free_device(smaller);
  bridge.free_device(again);
  expect_samples_add_up(bridge, 0, "the last frees");
  bridge.empty_cache();
  expect_samples_add_up(bridge, 0, "empty_cache");
  // An orphan: held by a view across a restart, freed with the view's end.
  const auto held = bridge.alloc_device(spec, 4096);
  std::optional<ViewLease> view(bridge.view(held, ViewSpec{DType::UInt8, Dims{16}, std::nullopt, 0}));
  bridge.restart(2);
  const std::size_t after_orphan = memory_samples(bridge).size();
  view.reset();
  expect_samples_add_up(bridge, after_orphan, "the orphan's free");
  bridge.close();
}

INSTANTIATE_TEST_SUITE_P(Pools, RecordedPoolCounters,
                         ::testing::Values(PoolShape{"split", true, std::nullopt}, PoolShape{"split_cap0", true, 0},
                                           PoolShape{"whole", false, std::nullopt},
                                           PoolShape{"whole_cap0", false, 0}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(RecordedCounters, WithoutThePoolReservedCountsAnOrphanAsMemoryStatsDoes) {
  auto fake = std::make_shared<FakeBackend>(1 << 30);
  Bridge bridge(std::make_unique<ForwardingBackend>(fake),
                BridgeOptions{.ring_bytes = 4096, .caching_pool = CachingPool::Off});
  bridge.record(RecordOptions{.max_events = 100});
  const auto held = bridge.alloc_device(kBytes, 4096);
  std::optional<ViewLease> view(bridge.view(held, ViewSpec{DType::UInt8, Dims{16}, std::nullopt, 0}));
  bridge.restart(2);
  ASSERT_EQ(bridge.memory_stats().reserved_bytes, 4096u) << "the orphan is still the backend's";
  auto samples = memory_samples(bridge);
  ASSERT_FALSE(samples.empty()) << bridge.trace_json();
  EXPECT_EQ(samples.back().reserved, 4096u) << "the restart's sample";
  EXPECT_EQ(samples.back().allocated, 0u);
  view.reset();
  expect_samples_add_up(bridge, samples.size(), "the orphan's free");
  samples = memory_samples(bridge);
  ASSERT_FALSE(samples.empty());
  EXPECT_EQ(samples.back().reserved, 0u);
}

// ---- the snapshot's orphans, with and without the pool ----

class SnapshotOrphans : public ::testing::TestWithParam<PoolShape> {};

TEST_P(SnapshotOrphans, AnOrphanIsASegmentWhateverThePool) {
  auto fake = std::make_shared<FakeBackend>(1 << 30);
  fake->set_parts(GetParam().parts);
  // cap: unset uses the pool; 0 here means no pool at all.
  const bool pooled = GetParam().cap != std::optional<std::uint64_t>(0);
  Bridge bridge(std::make_unique<ForwardingBackend>(fake),
                BridgeOptions{.ring_bytes = 4096, .caching_pool = pooled ? CachingPool::On : CachingPool::Off});
  const auto held = bridge.alloc_device(kBytes, 4096);
  std::optional<ViewLease> view(bridge.view(held, ViewSpec{DType::UInt8, Dims{16}, std::nullopt, 0}));
  const auto live = bridge.alloc_device(kBytes, 8192);  // a live one beside it, listed as before
  bridge.restart(2);
  const auto after_restart = bridge.alloc_device(kBytes, 2048);
  auto snapshot = json::parse(bridge.memory_snapshot_json());
  std::uint64_t orphan_bytes = 0, orphans = 0, listed = 0;
  for (const auto& segment : snapshot["segments"]) {
    listed += segment["bytes"].get<std::uint64_t>();
    for (const auto& block : segment["blocks"])
      if (block["state"] == "orphan") {
        ++orphans;
        orphan_bytes += block["bytes"].get<std::uint64_t>();
        EXPECT_FALSE(block.contains("handle")) << "no live handle names it";
      }
  }
  EXPECT_EQ(orphans, 1u) << snapshot.dump(1);
  EXPECT_GE(orphan_bytes, 4096u) << snapshot.dump(1);
  if (!pooled)
    EXPECT_EQ(listed, snapshot["stats"]["reserved_bytes"].get<std::uint64_t>())
        << "every reserved byte is in a segment: " << snapshot.dump(1);
  view.reset();
  snapshot = json::parse(bridge.memory_snapshot_json());
  for (const auto& segment : snapshot["segments"])
    for (const auto& block : segment["blocks"]) EXPECT_NE(block["state"], "orphan") << "freed with its view";
  bridge.free_device(after_restart);
  (void)live;  // freed by the restart
}

INSTANTIATE_TEST_SUITE_P(Pools, SnapshotOrphans,
                         ::testing::Values(PoolShape{"no_pool", true, 0}, PoolShape{"split", true, std::nullopt},
                                           PoolShape{"whole", false, std::nullopt}),
                         [](const auto& info) { return std::string(info.param.name); });

// ---- thread numbers ----

TEST(FlightRecorder, ThreadNumbersStayDistinctAndStablePastSixteenBits) {
  // 65,537 threads: a 16-bit count wrapped, gave one thread 0 (drawn again
  // on every record) and the next ones the numbers of earlier threads.
  constexpr std::size_t kThreads = (1u << 16) + 1;
  std::vector<std::uint32_t> numbers(kThreads);
  std::vector<char> stable(kThreads);
  // In batches of threads alive at once (one at a time took 15 s in a VM).
  constexpr std::size_t kBatch = 128;
  for (std::size_t first = 0; first < kThreads; first += kBatch) {
    std::vector<std::thread> batch;
    for (std::size_t i = first; i < std::min(first + kBatch, kThreads); ++i)
      batch.emplace_back([&numbers, &stable, i] {
        numbers[i] = detail::trace_thread();
        stable[i] = detail::trace_thread() == numbers[i];
      });
    for (auto& thread : batch) thread.join();
  }
  std::set<std::uint32_t> distinct(numbers.begin(), numbers.end());
  distinct.insert(detail::trace_thread());  // this thread's too
  EXPECT_EQ(distinct.size(), kThreads + 1) << "no two threads share a number";
  EXPECT_FALSE(distinct.contains(0u));
  EXPECT_EQ(std::count(stable.begin(), stable.end(), 1), static_cast<std::ptrdiff_t>(kThreads))
      << "each thread keeps its number";
}

// ---- the out-of-memory dump's directory ----

TEST(FlightRecorder, ARelativeOomDumpDirIsMadeAbsolute) {
  const auto options = FlightRecorder::check_options(RecordOptions{.max_events = 10, .oom_dump_dir = "."});
  EXPECT_TRUE(std::filesystem::path(options.oom_dump_dir).is_absolute()) << options.oom_dump_dir;
  EXPECT_TRUE(std::filesystem::equivalent(options.oom_dump_dir, std::filesystem::current_path()));
  EXPECT_EQ(FlightRecorder::check_options(RecordOptions{.max_events = 10}).oom_dump_dir, "") << "no dump: none";
}

TEST_F(RecordedBridge, ARelativeOomDumpDirStillHoldsTheDumpAfterAChdir) {
  make(16384);
  const auto parent = std::filesystem::temp_directory_path() / ("devbridge-oom-rel-" + std::to_string(::getpid()));
  std::filesystem::create_directories(parent / "dumps");
  const auto was = std::filesystem::current_path();
  std::filesystem::current_path(parent);
  bridge->record(RecordOptions{.max_events = 1000, .oom_dump_dir = "dumps"});
  std::filesystem::current_path(std::filesystem::temp_directory_path());  // where "dumps" is not
  DeviceHandle held;
  std::optional<ViewLease> view;
  const auto message = fragmented_out_of_memory(*bridge, held, view);
  std::filesystem::current_path(was);
  const std::string dumped = "the flight recorder's trace is in ";
  const auto at = message.find(dumped);
  ASSERT_NE(at, std::string::npos) << message;
  const std::filesystem::path path = message.substr(at + dumped.size());
  EXPECT_TRUE(path.is_absolute()) << path;
  EXPECT_TRUE(std::filesystem::equivalent(path.parent_path(), parent / "dumps")) << path;
  EXPECT_TRUE(std::filesystem::exists(path)) << path;
  view.reset();
  bridge->free_device(held);
  std::filesystem::remove_all(parent);
}

}  // namespace
}  // namespace devbridge::testing

namespace devbridge::testing {
namespace {

TEST(RecordedPeerCopy, EachBridgeShowsItsSideOnItsPeerTrack) {
  auto fake_a = std::make_shared<FakeBackend>(), fake_b = std::make_shared<FakeBackend>();
  Bridge a{std::make_unique<ForwardingBackend>(fake_a), BridgeOptions{.ring_bytes = 1 << 16}};
  Bridge b{std::make_unique<ForwardingBackend>(fake_b), BridgeOptions{.ring_bytes = 1 << 16}};
  a.record(RecordOptions{});
  b.record(RecordOptions{});
  const auto x = a.alloc_device(kBytes, 8192);
  const auto y = b.alloc_device(kBytes, 8192);
  ASSERT_TRUE(a.copy_to_peer(DeviceRange{x, 64, 4096}, b, DeviceRange{y, 128, 4096}));
  for (auto* bridge : {&a, &b}) {
    const auto trace = json::parse(bridge->trace_json());
    expect_valid_trace(trace);
    EXPECT_EQ(event_names(trace, {"peer"}), (std::vector<std::string>{"peer B", "peer E"}));
    double allocated = -1, began = -1, ended = -1;
    for (const auto& event : trace["traceEvents"]) {
      if (event["ph"] == "i" && event["name"] == "allocate") allocated = event["ts"];
      if (event["ph"] == "B") {
        EXPECT_EQ(event["tid"], 5);
        EXPECT_EQ(event["args"]["bytes"], 4096);
        EXPECT_EQ(event["args"]["offset"], bridge == &a ? 64 : 128);
        began = event["ts"];
      }
      if (event["ph"] == "E") {
        EXPECT_EQ(event["args"]["status"], "completed") << "ended by its own record, not left open at the dump";
        ended = event["ts"];
      }
    }
    // Stamped on the recorder's clock: after the allocation it copies into, and before its end.
    EXPECT_LE(allocated, began);
    EXPECT_LE(began, ended);
    EXPECT_GE(allocated, 0);
  }
  a.free_device(x);
  b.free_device(y);
}

}  // namespace
}  // namespace devbridge::testing
