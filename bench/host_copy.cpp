// Host (CPU) backend through the Bridge, against plain memcpy in the same
// process (issue 3, item 6):
//  1. asynchronous upload of 1 GiB in 1, 4 and 16 MiB chunks from a 64 MiB
//     ring, a few copies in flight, each ring range released as its copy
//     completes; versus memcpy of the same bytes between the same addresses
//     (the ring's and the allocation's), in the same chunk order, on one thread,
//     each repetition running the two back to back;
//  2. the round trip of a 4 KiB async copy: submit -> completion observed
//     through Bridge::wait, per trip, median and p99 over 100k trips. A second,
//     informational line observes completion by spinning on Bridge::poll(), to
//     tell the wake-up cost from the copy engine's.
// Google Benchmark is the harness (manual time); a side-by-side table follows.
// No timed assertions: the targets are printed beside the figures.
//
// Environment overrides for smoke runs: HOST_BENCH_BYTES (default 1 GiB),
// HOST_BENCH_REPS (5), HOST_BENCH_TRIPS (100000).

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bench_util.hpp"
#include "devbridge/backends/host.hpp"
#include "devbridge/bridge.hpp"
#include "devbridge/error.hpp"

namespace {

using namespace devbridge;
using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kMiB = 1ull << 20;
constexpr std::uint64_t kRingBytes = 64 * kMiB;
constexpr std::size_t kInflightDepth = 4;
constexpr std::uint64_t kTripBytes = 4096;
constexpr std::chrono::seconds kCopyTimeout{30};
const std::uint64_t kChunkSizes[] = {1 * kMiB, 4 * kMiB, 16 * kMiB};

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

void require_completed(const CopyStatus& status, const char* what) {
  if (status.state == CopyState::Completed) return;
  throw std::runtime_error(std::string(what) + ": copy " +
                           (status.state == CopyState::Pending ? "still pending after the timeout"
                                                               : "failed: " + status.message));
}

// One bridge over the host backend for the whole program, with a device
// allocation the size of the upload and a 4 KiB one for the round trips.
class HostSetup {
 public:
  explicit HostSetup(std::uint64_t upload_bytes)
      : bridge_(host::make_host_backend(), BridgeOptions{1, kRingBytes, 0}), upload_bytes_(upload_bytes) {
    info_ = bridge_.backend_info();
    upload_target_ = bridge_.alloc_device(ObjectSpec{upload_bytes, 4096, DType::UInt8, ShapeKind::Vector}, upload_bytes);
    trip_target_ = bridge_.alloc_device(ObjectSpec{kTripBytes, 64, DType::UInt8, ShapeKind::Vector}, kTripBytes);
    fill_ring();
  }

  Bridge& bridge() { return bridge_; }
  const BackendInfo& info() const { return info_; }
  std::uint64_t upload_bytes() const { return upload_bytes_; }

  // Uploads upload_bytes in `chunk` pieces, keeping kInflightDepth copies in
  // flight and releasing each ring range once its copy is done. Seconds taken.
  double upload(std::uint64_t chunk) {
    std::deque<std::pair<HostRange, CopyEvent>> inflight;
    auto retire_oldest = [&] {
      auto [range, event] = inflight.front();
      inflight.pop_front();
      require_completed(bridge_.wait(event, kCopyTimeout), "upload");
      bridge_.release_host(range);
    };
    const auto t0 = Clock::now();
    for (std::uint64_t offset = 0; offset < upload_bytes_; offset += chunk) {
      const std::uint64_t len = std::min(chunk, upload_bytes_ - offset);
      if (inflight.size() == kInflightDepth) retire_oldest();
      std::optional<HostRange> range;
      while (!range) {
        try {
          range = bridge_.reserve(len, 4096);
        } catch (const Error& e) {
          // The ring may not fit kInflightDepth chunks end to end; make room.
          if (e.kind() != ErrorKind::Backpressure || inflight.empty()) throw;
          retire_oldest();
        }
      }
      const CopyEvent event = bridge_.host_to_device(*range, DeviceRange{upload_target_, offset, len}, CopyMode::Async,
                                                     Admission{kCopyTimeout});
      inflight.emplace_back(*range, event);
    }
    while (!inflight.empty()) retire_oldest();
    return seconds_between(t0, Clock::now());
  }

  // memcpy of the same bytes the bridge uploads: ring addresses walked in
  // `chunk` steps, into the allocation's memory, in the same order. Seconds.
  double memcpy_same_bytes(std::uint64_t chunk) {
    // The host backend's device address is host memory; hold a view lease so
    // the allocation stays put while it is written directly.
    ViewLease lease = bridge_.view(upload_target_, ViewSpec{DType::UInt8, Dims{static_cast<std::int64_t>(upload_bytes_)},
                                                             std::nullopt, 0});
    auto* device = reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(lease->data + lease->byte_offset));
    const std::uint64_t ring_span = kRingBytes - kRingBytes % chunk;
    const auto t0 = Clock::now();
    std::uint64_t ring_offset = 0;
    for (std::uint64_t offset = 0; offset < upload_bytes_; offset += chunk) {
      const std::uint64_t len = std::min(chunk, upload_bytes_ - offset);
      std::memcpy(device + offset, ring_base_ + ring_offset, len);
      ring_offset = (ring_offset + chunk) % ring_span;
    }
    benchmark::ClobberMemory();
    return seconds_between(t0, Clock::now());
  }

  // One 4 KiB async copy, submit to completion observed. Seconds.
  double round_trip(bool spin_on_poll) {
    const auto t0 = Clock::now();
    const CopyEvent event =
        bridge_.host_to_device(trip_range_, DeviceRange{trip_target_, 0, kTripBytes}, CopyMode::Async);
    if (spin_on_poll) {
      while (!bridge_.safe_to_release_host(event)) bridge_.poll();
    } else {
      require_completed(bridge_.wait(event, kCopyTimeout), "round trip");
    }
    return seconds_between(t0, Clock::now());
  }

  void begin_round_trips() { trip_range_ = bridge_.reserve(kTripBytes, 64); }
  void end_round_trips() { bridge_.release_host(trip_range_); }

 private:
  // Real, non-zero bytes in every ring page: memcpy from untouched anonymous
  // memory would read the kernel's shared zero page and flatter both sides.
  void fill_ring() {
    std::vector<HostRange> pieces;
    try {
      for (;;) pieces.push_back(bridge_.reserve(kMiB, 4096));
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::Backpressure) throw;
    }
    std::uint64_t x = 0x9e3779b97f4a7c15ull;
    for (const HostRange& r : pieces) {
      auto bytes = bridge_.host_bytes(r);
      for (std::size_t i = 0; i + 8 <= bytes.size(); i += 8) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        std::memcpy(bytes.data() + i, &x, 8);
      }
      if (r.offset == 0) ring_base_ = bytes.data();
    }
    for (const HostRange& r : pieces) bridge_.release_host(r);
    if (ring_base_ == nullptr) throw std::runtime_error("could not locate the ring's first byte");
  }

  Bridge bridge_;
  BackendInfo info_;
  std::uint64_t upload_bytes_;
  DeviceHandle upload_target_;
  DeviceHandle trip_target_;
  HostRange trip_range_;
  std::byte* ring_base_ = nullptr;
};

std::unique_ptr<HostSetup> g_setup;
std::string g_error;

struct UploadResult {
  bool warmed_up = false;
  std::vector<double> bridge_gbps;
  std::vector<double> memcpy_gbps;
};
std::vector<UploadResult> g_uploads(std::size(kChunkSizes));
std::vector<double> g_trip_wait_us;
std::vector<double> g_trip_spin_us;

void skip_with(benchmark::State& state, const std::exception& e) {
  if (g_error.empty()) g_error = e.what();
  state.SkipWithError(g_error.c_str());
}

// One benchmark per chunk size. Each repetition runs one bridge upload and one
// memcpy of the same bytes back to back, alternating which goes first, so a
// change in machine load between repetitions hits both sides alike. The
// reported time is the bridge's; memcpy's throughput and the ratio are
// counters.
void register_upload(std::size_t index, int reps) {
  const std::uint64_t chunk = kChunkSizes[index];
  const std::string label = std::to_string(chunk / kMiB) + "MiB";
  benchmark::RegisterBenchmark(("bridge_upload_vs_memcpy/" + label).c_str(),
                               [index, chunk](benchmark::State& state) {
                                 try {
                                   UploadResult& result = g_uploads[index];
                                   if (!result.warmed_up) {  // faults in the allocation's pages, untimed
                                     (void)g_setup->upload(chunk);
                                     (void)g_setup->memcpy_same_bytes(chunk);
                                     result.warmed_up = true;
                                   }
                                   const double gb = static_cast<double>(g_setup->upload_bytes()) / 1e9;
                                   for (auto _ : state) {
                                     const bool bridge_first = result.bridge_gbps.size() % 2 == 0;
                                     double memcpy_s = 0;
                                     if (!bridge_first) memcpy_s = g_setup->memcpy_same_bytes(chunk);
                                     const double bridge_s = g_setup->upload(chunk);
                                     if (bridge_first) memcpy_s = g_setup->memcpy_same_bytes(chunk);
                                     state.SetIterationTime(bridge_s);
                                     result.bridge_gbps.push_back(gb / bridge_s);
                                     result.memcpy_gbps.push_back(gb / memcpy_s);
                                     state.counters["bridge_GBps"] = gb / bridge_s;
                                     state.counters["memcpy_GBps"] = gb / memcpy_s;
                                     state.counters["ratio"] = memcpy_s / bridge_s;
                                   }
                                   state.SetBytesProcessed(static_cast<std::int64_t>(g_setup->upload_bytes()) *
                                                           state.iterations());
                                 } catch (const std::exception& e) {
                                   skip_with(state, e);
                                 }
                               })
      ->Iterations(1)
      ->Repetitions(reps)
      ->ReportAggregatesOnly(true)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

void register_round_trip(const char* name, bool spin_on_poll, std::vector<double>* samples_us,
                         std::uint64_t trips) {
  benchmark::RegisterBenchmark(name,
                               [spin_on_poll, samples_us](benchmark::State& state) {
                                 try {
                                   g_setup->begin_round_trips();
                                   for (int i = 0; i < 1000; ++i) (void)g_setup->round_trip(spin_on_poll);  // warm-up
                                   samples_us->reserve(static_cast<std::size_t>(state.max_iterations));
                                   for (auto _ : state) {
                                     const double s = g_setup->round_trip(spin_on_poll);
                                     state.SetIterationTime(s);
                                     samples_us->push_back(s * 1e6);
                                   }
                                   g_setup->end_round_trips();
                                   state.counters["median_us"] = bench::median(*samples_us);
                                   state.counters["p99_us"] = bench::percentile(*samples_us, 99.0);
                                 } catch (const std::exception& e) {
                                   skip_with(state, e);
                                 }
                               })
      ->Iterations(static_cast<benchmark::IterationCount>(trips))
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
}

void print_table() {
  const BackendInfo& info = g_setup->info();
  std::printf("\n== host backend vs memcpy (same process) ==\n");
  std::printf("backend: %s (%s), ring %llu MiB page-locked: %s%s%s\n", info.name.c_str(), info.device_name.c_str(),
              static_cast<unsigned long long>(kRingBytes / kMiB), info.host_memory_page_locked ? "yes" : "no",
              info.notes.empty() ? "" : " - ", info.notes.c_str());
  std::printf("upload: %.0f MiB per run, %zu copies in flight, median of %zu paired runs (bridge and memcpy back to "
              "back); GB = 1e9 bytes\n",
              g_setup->upload_bytes() / double(kMiB), kInflightDepth, g_uploads[0].bridge_gbps.size());
  std::printf("%-8s | %18s | %12s | %18s | %s\n", "chunk", "bridge async GB/s", "memcpy GB/s", "ratio (bridge/mem)",
              "target >= 0.90");
  std::printf("---------+--------------------+--------------+--------------------+---------------\n");
  for (std::size_t i = 0; i < std::size(kChunkSizes); ++i) {
    const auto& u = g_uploads[i];
    if (u.bridge_gbps.empty() || u.memcpy_gbps.empty()) continue;
    const double b = bench::median(u.bridge_gbps);
    const double m = bench::median(u.memcpy_gbps);
    // Median of the per-repetition ratios: each pair ran back to back.
    std::vector<double> ratios;
    for (std::size_t r = 0; r < u.bridge_gbps.size() && r < u.memcpy_gbps.size(); ++r)
      ratios.push_back(u.bridge_gbps[r] / u.memcpy_gbps[r]);
    const double ratio = bench::median(ratios);
    std::printf("%3llu MiB  | %18.2f | %12.2f | %18.3f | %s\n", static_cast<unsigned long long>(kChunkSizes[i] / kMiB),
                b, m, ratio, ratio >= 0.9 ? "pass" : "FAIL");
    std::printf("host_upload chunk_mib=%llu bridge_gbps=%.3f memcpy_gbps=%.3f ratio=%.4f\n",
                static_cast<unsigned long long>(kChunkSizes[i] / kMiB), b, m, ratio);
  }
  auto trip_line = [](const char* how, const std::vector<double>& us, bool targeted) {
    if (us.empty()) return;
    const double med = bench::median(us);
    std::printf("%-34s | %10.2f | %10.2f | %10.2f | %s\n", how, med, bench::percentile(us, 99.0),
                bench::percentile(us, 99.9), targeted ? (med < 2.0 ? "pass (< 2 us)" : "FAIL (>= 2 us)") : "(info)");
  };
  std::printf("\n4 KiB async round trip (submit -> completion observed), %zu trips\n", g_trip_wait_us.size());
  std::printf("%-34s | %10s | %10s | %10s | %s\n", "observed through", "median us", "p99 us", "p99.9 us",
              "target median < 2 us");
  std::printf("-----------------------------------+------------+------------+------------+---------------------\n");
  trip_line("Bridge::wait", g_trip_wait_us, true);
  trip_line("spin on Bridge::poll (info only)", g_trip_spin_us, false);
  if (!g_trip_wait_us.empty()) {
    std::printf("round_trip_4k wait_median_us=%.3f wait_p99_us=%.3f\n", bench::median(g_trip_wait_us),
                bench::percentile(g_trip_wait_us, 99.0));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::uint64_t bytes = bench::env_u64("HOST_BENCH_BYTES", 1ull << 30);
  const int reps = static_cast<int>(bench::env_u64("HOST_BENCH_REPS", 5));
  const std::uint64_t trips = bench::env_u64("HOST_BENCH_TRIPS", 100'000);

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;

  try {
    g_setup = std::make_unique<HostSetup>(bytes);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "host_copy: cannot set up the host backend bridge: %s\n", e.what());
    return 1;
  }
  std::printf("# timing is manual (steady_clock around each run or trip); Google Benchmark's \"Library was built as "
              "DEBUG\" warning is about Debian's libbenchmark build and does not touch it\n");
  std::fflush(stdout);
  for (std::size_t i = 0; i < std::size(kChunkSizes); ++i) register_upload(i, reps);
  register_round_trip("round_trip_4KiB/wait", false, &g_trip_wait_us, trips);
  register_round_trip("round_trip_4KiB/poll_spin", true, &g_trip_spin_us, trips);

  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  std::fflush(stdout);
  print_table();
  g_setup.reset();
  if (!g_error.empty()) {
    std::printf("host_copy: FAILED: %s\n", g_error.c_str());
    return 1;
  }
  return 0;
}
