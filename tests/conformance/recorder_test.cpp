// The flight recorder on every backend: a known sequence of calls gives the
// expected events in order, in a trace that validates (every slice ends on
// its track, counters never negative, time never goes back); the ring stays
// bounded; restart and close are recorded; nothing is recorded when off.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "backend_drivers.hpp"
#include "conformance_support.hpp"
#include "devbridge/bridge.hpp"
#include "trace_checks.hpp"

namespace devbridge::conformance {
namespace {

using nlohmann::json;
using testing::event_names;
using testing::expect_valid_trace;

const ObjectSpec kFloats{1 << 20, 64, DType::Float32, ShapeKind::Vector};
constexpr std::uint64_t kBytes = 4096;

std::string handle_text(const DeviceHandle& h) {
  return std::to_string(h.domain) + ":" + std::to_string(h.generation) + ":" + std::to_string(h.id);
}

// The message of the devbridge::Error `statement` throws, expected of `kind`.
template <class Statement>
std::string error_message(ErrorKind kind, Statement statement) {
  try {
    statement();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "nothing was thrown";
  return {};
}

class RecorderConformance : public BackendConformance {};

TEST_P(RecorderConformance, AKnownSequenceGivesItsEventsInOrder) {
  auto& b = make_bridge();
  b.record(RecordOptions{.max_events = 10000});
  const auto handle = b.alloc_device(kFloats, kBytes);
  const auto range = b.reserve(kBytes);
  const auto event = b.host_to_device(range, DeviceRange{handle, 0, kBytes}, CopyMode::Async);
  ASSERT_EQ(b.wait(event).state, CopyState::Completed);
  b.release_host(range);
  { auto view = b.view(handle, ViewSpec{DType::Float32, Dims{16}, std::nullopt, 0}); }
  b.free_device(handle);
  b.restart(2);
  b.close();

  const auto trace = json::parse(b.trace_json());
  expect_valid_trace(trace);
  EXPECT_EQ(trace["otherData"]["backend"], b.backend_info().name);
  EXPECT_EQ(trace["otherData"]["dropped_events"], 0);
  const auto names = event_names(trace, {"allocate", "copy up", "view", "free", "restart", "close"});
  EXPECT_EQ(names, (std::vector<std::string>{"allocate", "copy up B", "copy up E", "view B", "view E", "free",
                                             "restart", "close"}));
  // The copy's slice names its event and handle; the allocation's end is a
  // "free" of the same handle (what replay reads).
  std::set<std::string> allocated, freed;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "B" && e["name"] == "copy up") {
      EXPECT_EQ(e["args"]["event"], handle_text(DeviceHandle{event.domain, event.generation, event.id}));
      EXPECT_EQ(e["args"]["handle"], handle_text(handle));
      EXPECT_EQ(e["args"]["bytes"], kBytes);
      EXPECT_EQ(e["tid"], 2);
    }
    if (e["ph"] == "E" && e["name"] == "copy up") EXPECT_EQ(e["args"]["status"], "completed");
    if (e["ph"] == "i" && e["cat"] == "memory" && e["name"] == "allocate") allocated.insert(e["args"]["handle"]);
    if (e["ph"] == "i" && e["cat"] == "memory" && e["name"] == "free") freed.insert(e["args"]["handle"]);
  }
  EXPECT_EQ(allocated, std::set<std::string>{handle_text(handle)});
  EXPECT_EQ(freed, allocated);
}

TEST_P(RecorderConformance, CopiesAndLaunchesAreSlicesOnTheirTracks) {
  auto& b = make_bridge();
  b.record(RecordOptions{});
  const auto x = b.alloc_device(kFloats, kBytes);
  const auto y = b.alloc_device(kFloats, kBytes);
  const auto range = b.reserve(2 * kBytes);
  // Two uploads in flight at once: the second may overlap the first on its track.
  const auto first = b.host_to_device(HostRange{range.offset, kBytes}, DeviceRange{x, 0, kBytes}, CopyMode::Async);
  const auto second =
      b.host_to_device(HostRange{range.offset + kBytes, kBytes}, DeviceRange{y, 0, kBytes}, CopyMode::Async);
  ASSERT_EQ(b.wait(first).state, CopyState::Completed);
  ASSERT_EQ(b.wait(second).state, CopyState::Completed);
  b.launch_axpy(DeviceRange{x, 0, kBytes}, DeviceRange{y, 0, kBytes}, 2.0f, 1.0f);
  b.device_to_host(DeviceRange{y, 0, kBytes}, HostRange{range.offset, kBytes}, CopyMode::Sync);
  b.release(x);
  b.release(y);
  b.release_host(range);
  // The launch's fence passes when the device says so (at once on some
  // backends, a moment after the download on others, emulated CUDA's): close
  // waits for it, and the trace is still there to dump. (A loop of poll and
  // sleep here made LeakSanitizer's exit-time tracer crash on PoCL's threads
  // in most runs under ASan.)
  b.close();
  const auto trace = json::parse(b.trace_json());
  expect_valid_trace(trace);
  const auto names = event_names(trace, {"axpy", "copy down"});
  // The launch's slice ends when the bridge sees its fence pass: before the
  // download on a backend that runs kernels at once, after it elsewhere.
  auto sorted = names;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, (std::vector<std::string>{"axpy B", "axpy E", "copy down B", "copy down E"}));
  EXPECT_EQ(names.front(), "axpy B");
  std::size_t frees = 0;
  for (const auto& e : trace["traceEvents"]) frees += e["ph"] == "i" && e["name"] == "free";
  EXPECT_EQ(frees, 2u) << "both released allocations retired";
}

// The slices named `track` ("copy up", "copy down") of `b`'s trace, each
// on that track (tid `track_id`) or one of its lanes, as sorted text: "B
// <event> <offset>" for a begin, "E <status>" for an end.
std::vector<std::string> in_place_slices(Bridge& b, const std::string& track, int track_id) {
  const auto trace = json::parse(b.trace_json());
  expect_valid_trace(trace);
  std::map<int, std::string> thread_names;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "M" && e["name"] == "thread_name") thread_names[e["tid"].get<int>()] = e["args"]["name"];
  std::vector<std::string> seen;
  for (const auto& e : trace["traceEvents"]) {
    if (e["name"] != track) continue;
    const int tid = e["tid"];
    EXPECT_TRUE(tid == track_id || thread_names[tid].rfind(track + " #", 0) == 0)
        << e.dump() << ": the " << track << " track or a lane of it";
    seen.push_back(e["ph"] == "B" ? "B " + e["args"]["event"].get<std::string>() + " " +
                                        std::to_string(e["args"]["offset"].get<std::uint64_t>())
                                  : "E " + e["args"]["status"].get<std::string>());
  }
  std::sort(seen.begin(), seen.end());
  return seen;
}

// Both halves of an allocation in one call, then its first half in a call that threw.
std::vector<std::string> two_halves_then_one_failed() {
  const std::string half = std::to_string(kBytes / 2);
  return {"B in_place 0", "B in_place 0", "B in_place " + half, "E completed", "E completed", "E failed"};
}

// A restore on a backend whose device memory is host memory moves no copy:
// write_in_place fills the tensors. The trace still shows the bytes landing,
// as copy-up slices marked in_place (failed when the fill threw).
TEST_P(RecorderConformance, WritesInPlaceAreSlicesOnTheCopyUpTrack) {
  auto& b = make_bridge();
  if (!b.backend_info().host_addressable) GTEST_SKIP() << "device memory is not host memory here";
  b.record(RecordOptions{});
  const auto x = b.alloc_device(kFloats, kBytes);
  const DeviceRange ranges[] = {DeviceRange{x, 0, kBytes / 2}, DeviceRange{x, kBytes / 2, kBytes / 2}};
  b.write_in_place(ranges, [](std::span<const std::span<std::byte>> pieces) {
    for (const auto piece : pieces) std::fill(piece.begin(), piece.end(), std::byte{7});
  });
  EXPECT_THROW(b.write_in_place(std::span(ranges, 1), [](auto) { throw std::runtime_error("the file ended"); }),
               std::runtime_error);
  b.free_device(x);

  EXPECT_EQ(in_place_slices(b, "copy up", 2), two_halves_then_one_failed());
}

// A checkpoint on such a backend reads the tensors in place (read_in_place):
// copy-down slices marked in_place, failed when the reader threw.
TEST_P(RecorderConformance, ReadsInPlaceAreSlicesOnTheCopyDownTrack) {
  auto& b = make_bridge();
  if (!b.backend_info().host_addressable) GTEST_SKIP() << "device memory is not host memory here";
  b.record(RecordOptions{});
  const auto x = b.alloc_device(kFloats, kBytes);
  const DeviceRange ranges[] = {DeviceRange{x, 0, kBytes / 2}, DeviceRange{x, kBytes / 2, kBytes / 2}};
  b.read_in_place(ranges, [](std::span<const std::span<const std::byte>> pieces) { EXPECT_EQ(pieces.size(), 2u); });
  EXPECT_THROW(b.read_in_place(std::span(ranges, 1), [](auto) { throw std::runtime_error("the disk is full"); }),
               std::runtime_error);
  b.free_device(x);

  EXPECT_EQ(in_place_slices(b, "copy down", 3), two_halves_then_one_failed());
}

TEST_P(RecorderConformance, TheRingStaysBounded) {
  auto& b = make_bridge();
  b.record(RecordOptions{.max_events = 16});
  for (int i = 0; i < 100; ++i) b.free_device(b.alloc_device(kFloats, kBytes));
  const auto trace = json::parse(b.trace_json());
  expect_valid_trace(trace);
  const auto recorded = trace["otherData"]["recorded_events"].get<std::uint64_t>();
  EXPECT_GE(recorded, 200u);
  EXPECT_EQ(trace["otherData"]["dropped_events"].get<std::uint64_t>(), recorded - 16);
  std::size_t kept = 0;
  for (const auto& e : trace["traceEvents"]) kept += e["ph"] == "i" || e["ph"] == "B" || e["ph"] == "E";
  EXPECT_LE(kept, 16u);
}

TEST_P(RecorderConformance, NothingIsRecordedWhenOff) {
  auto& b = make_bridge();
  b.free_device(b.alloc_device(kFloats, kBytes));
  auto trace = json::parse(b.trace_json());
  EXPECT_EQ(trace["otherData"]["recorded_events"], 0);
  b.record(RecordOptions{.max_events = 100});
  b.free_device(b.alloc_device(kFloats, kBytes));
  b.stop_recording();
  const auto recorded = json::parse(b.trace_json())["otherData"]["recorded_events"].get<std::uint64_t>();
  EXPECT_GE(recorded, 2u);
  b.free_device(b.alloc_device(kFloats, kBytes));
  b.restart(2);
  trace = json::parse(b.trace_json());
  EXPECT_EQ(trace["otherData"]["recorded_events"], recorded) << "stopped: kept, not added to";
  expect_valid_trace(trace);
}

TEST_P(RecorderConformance, MaxEventsIsChecked) {
  auto& b = make_bridge();
  auto message = error_message(ErrorKind::InvalidRange, [&] { b.record(RecordOptions{.max_events = 0}); });
  EXPECT_NE(message.find("max_events of 0"), std::string::npos) << message;
  message = error_message(ErrorKind::InvalidRange, [&] {
    b.record(RecordOptions{.max_events = std::size_t{1} << 40});
  });
  EXPECT_NE(message.find(std::to_string(std::size_t{1} << 40)), std::string::npos) << message;
}

TEST_P(RecorderConformance, DumpTraceWritesTheSameJsonAtomically) {
  auto& b = make_bridge();
  b.record(RecordOptions{});
  const auto handle = b.alloc_device(kFloats, kBytes);
  const auto path = std::filesystem::temp_directory_path() /
                    ("devbridge-recorder-" + std::string(driver().name) + "-" + std::to_string(::getpid()) + ".json");
  b.dump_trace(path);
  std::ifstream file(path);
  const auto trace = json::parse(file);
  expect_valid_trace(trace);
  EXPECT_EQ(event_names(trace, {"allocate"}), std::vector<std::string>{"allocate"});
  for (const auto& entry : std::filesystem::directory_iterator(path.parent_path()))
    EXPECT_EQ(entry.path().string().find(path.string() + ".tmp"), std::string::npos) << "no temporary left";
  std::filesystem::remove(path);
  const auto snapshot = json::parse(b.memory_snapshot_json());
  EXPECT_EQ(snapshot["stats"]["allocations"], 1);
  b.free_device(handle);
}

// Each memory sample is what the bridge holds once its event happened: on
// every backend (with its own pool policy), the last sample after each call
// is memory_stats(), and allocated + cached is reserved in every one (a
// free's used to miss what it gave back to the pool).
TEST_P(RecorderConformance, MemorySamplesAddUpAsMemoryStatsDo) {
  auto& b = make_bridge();
  b.record(RecordOptions{});
  const auto expect_last_sample_is_the_stats = [&](const char* after) {
    SCOPED_TRACE(after);
    const auto trace = json::parse(b.trace_json());
    const json* last = nullptr;
    for (const auto& e : trace["traceEvents"]) {
      if (e["ph"] != "C") continue;
      const auto& c = e["args"];
      EXPECT_EQ(c["allocated"].get<std::uint64_t>() + c["cached"].get<std::uint64_t>(),
                c["reserved"].get<std::uint64_t>())
          << e.dump();
      last = &e;
    }
    ASSERT_NE(last, nullptr);
    const MemoryStats stats = b.memory_stats();
    EXPECT_EQ((*last)["args"]["allocated"], stats.allocated_bytes);
    EXPECT_EQ((*last)["args"]["cached"], stats.cached_bytes);
    EXPECT_EQ((*last)["args"]["reserved"], stats.reserved_bytes);
  };
  const auto h1 = b.alloc_device(kFloats, 256);
  const auto h2 = b.alloc_device(kFloats, 256);
  expect_last_sample_is_the_stats("two allocations");
  b.free_device(h1);
  expect_last_sample_is_the_stats("the first freed");
  const auto h3 = b.alloc_device(kFloats, 256);
  expect_last_sample_is_the_stats("a third, from the cache where there is one");
  b.free_device(h2);
  b.free_device(h3);
  expect_last_sample_is_the_stats("all freed");
  b.empty_cache();
  expect_last_sample_is_the_stats("empty_cache");
}

INSTANTIATE_TEST_SUITE_P(Backends, RecorderConformance, ::testing::ValuesIn(backend_drivers()),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace devbridge::conformance
