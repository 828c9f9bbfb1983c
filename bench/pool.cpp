// The caching pool (issue 14): alloc_device + free_device of mixed sizes
// through the pool, against the same calls with the pool off (every one a
// driver allocation and free: malloc/free on the host backend,
// clCreateBuffer/clReleaseMemObject on OpenCL), in one process, per backend
// this machine runs. The workload keeps a window of 8 live allocations of
// sizes drawn (fixed seed) from 4 KiB to 4 MiB, as a training step's
// activations come and go; a second pair of rows adds each allocation's
// first use (a 4 KiB sync upload), where a driver that creates buffers
// lazily (PoCL) really allocates. Rows: median ns per alloc+free pair over
// POOL_BENCH_REPS repetitions (default 5) of POOL_BENCH_OPS pairs (20000),
// and the pool's speed-up. Google Benchmark is the harness (manual time). No
// timed assertions.
#include <benchmark/benchmark.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "devbridge/backends.hpp"
#include "devbridge/bridge.hpp"

namespace {

using namespace devbridge;
using Clock = std::chrono::steady_clock;

constexpr std::array<std::uint64_t, 6> kSizes = {4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20};
constexpr std::size_t kWindow = 8;

std::map<std::string, std::vector<double>> g_ns_per_pair;  // "backend/pool" -> per repetition

double run_pairs(Bridge& bridge, std::uint64_t pairs, bool touch) {
  std::mt19937_64 rng(7);
  std::deque<DeviceHandle> live;
  const HostRange scratch = touch ? bridge.reserve(4096) : HostRange{};
  const auto start = Clock::now();
  for (std::uint64_t i = 0; i < pairs; ++i) {
    const std::uint64_t bytes = kSizes[rng() % kSizes.size()];
    live.push_back(bridge.alloc_device(ObjectSpec{bytes, 64, DType::UInt8, ShapeKind::Vector}, bytes));
    // First use: a driver that creates buffers lazily (PoCL) allocates here.
    if (touch) bridge.host_to_device(scratch, DeviceRange{live.back(), 0, 4096}, CopyMode::Sync);
    if (live.size() > kWindow) {
      bridge.free_device(live.front());
      live.pop_front();
    }
  }
  for (const auto h : live) bridge.free_device(h);
  const double ns = std::chrono::duration<double, std::nano>(Clock::now() - start).count() / static_cast<double>(pairs);
  if (touch) bridge.release_host(scratch);
  return ns;
}

void pairs(benchmark::State& state, std::string backend, CachingPool pool, bool touch) {
  const std::uint64_t n = bench::env_u64("POOL_BENCH_OPS", 20000);
  Bridge bridge(make_backend(backend), BridgeOptions{.ring_bytes = 1 << 20, .caching_pool = pool});
  run_pairs(bridge, kWindow * 4, touch);  // warm: the pool holds each class once
  auto& out = g_ns_per_pair[backend + (pool == CachingPool::On ? "/pool" : "/driver") + (touch ? "/touch" : "")];
  for (auto _ : state) {
    const double ns = run_pairs(bridge, n, touch);
    out.push_back(ns);
    state.SetIterationTime(ns * 1e-9 * static_cast<double>(n));
  }
  const auto stats = bridge.memory_stats();
  state.counters["cache_hits"] = static_cast<double>(stats.cache_hits);
  state.counters["backend_allocations"] = static_cast<double>(stats.backend_allocations);
}

}  // namespace

int main(int argc, char** argv) {
  const auto reps = static_cast<benchmark::IterationCount>(bench::env_u64("POOL_BENCH_REPS", 5));
  std::vector<std::string> backends;
  for (const auto& entry : list_backends())
    if (entry.available && (entry.name == "host" || entry.name == "opencl" || entry.name == "cuda"))
      backends.push_back(entry.name);
  for (const auto& name : backends)
    for (const bool touch : {false, true})
      for (const auto pool : {CachingPool::Off, CachingPool::On}) {
        const std::string label =
            "pool/" + name + (pool == CachingPool::On ? "/pool" : "/driver") + (touch ? "/touch" : "");
        benchmark::RegisterBenchmark(label.c_str(), pairs, name, pool, touch)->UseManualTime()->Iterations(reps);
      }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();

  std::printf("\nalloc_device + free_device, mixed sizes 4 KiB-4 MiB, window of %zu (median ns per pair);\n"
              "\"+ first use\": each allocation also takes a 4 KiB sync upload, where a lazy driver (PoCL)\n"
              "really allocates\n", kWindow);
  std::printf("%-10s %-12s %14s %14s %12s\n", "backend", "", "driver ns", "pool ns", "pool speed-up");
  for (const auto& name : backends)
    for (const char* touch : {"", "/touch"}) {
      const double driver = bench::median(g_ns_per_pair[name + "/driver" + touch]);
      const double pool = bench::median(g_ns_per_pair[name + "/pool" + touch]);
      if (driver == 0 || pool == 0) continue;  // filtered out
      std::printf("%-10s %-12s %14.0f %14.0f %11.1fx\n", name.c_str(), *touch ? "+ first use" : "alloc+free",
                  driver, pool, driver / pool);
    }
  return 0;
}
