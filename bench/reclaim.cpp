// Deferred-free reclamation latency (issue 11): how long from release() until
// the memory is back in the backend, on the host backend, in one process:
//  - "no fence": nothing uses the allocation; release() frees it at once;
//  - "after a launch": an axpy was just queued over it, so its use ends at the
//    launch's fence; release() puts it in the drop queue and the next bridge
//    call after the kernel finished frees it (here: stats(), in a loop, as a
//    caller that never polls would make calls anyway);
//  - "fence already passed": the same, but the kernel finished before the
//    release (200 us later, no bridge call between): the release reaps the
//    fence and frees at once (the drop queue's bookkeeping alone).
// Each row is the median over RECLAIM_TRIPS trips (default 20000) of a 64 KiB
// float32 allocation; the table sets them beside "no fence". Google Benchmark
// is the harness (manual time). No timed assertions.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "devbridge/backends/host.hpp"
#include "devbridge/bridge.hpp"

namespace {

using namespace devbridge;
using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kBytes = 64 << 10;
const ObjectSpec kFloats{kBytes, 64, DType::Float32, ShapeKind::Vector};

enum class Case { NoFence, AfterLaunch, FencePassed };

std::map<Case, std::vector<double>> g_trips;

double ns_since(Clock::time_point start) {
  return std::chrono::duration<double, std::nano>(Clock::now() - start).count();
}

void reclaim(benchmark::State& state, Case which) {
  Bridge bridge(host::make_host_backend(), BridgeOptions{.ring_bytes = 1 << 20});
  Backend& backend = bridge.backend();
  const auto x = bridge.alloc_device(kFloats, kBytes);
  const std::uint64_t base = backend.test_controls()->live_allocations();  // x and nothing else
  auto& trips = g_trips[which];
  for (auto _ : state) {
    const auto y = bridge.alloc_device(kFloats, kBytes);
    if (which != Case::NoFence)
      bridge.launch_axpy(DeviceRange{x, 0, kBytes}, DeviceRange{y, 0, kBytes}, 2.0f, 1.0f);
    if (which != Case::AfterLaunch) {
      // Long enough for the kernel (a few microseconds) without a bridge
      // call: the release below finds the fence passed but not yet reaped.
      // The no-fence case waits as long, so both start from the same caches.
      const auto until = Clock::now() + std::chrono::microseconds(200);
      while (Clock::now() < until) {
      }
    }
    const auto start = Clock::now();
    bridge.release(y);
    while (backend.test_controls()->live_allocations() != base) (void)bridge.stats();
    const double ns = ns_since(start);
    trips.push_back(ns);
    state.SetIterationTime(ns * 1e-9);
  }
  bridge.free_device(x);
}

}  // namespace

int main(int argc, char** argv) {
  const auto n = static_cast<benchmark::IterationCount>(bench::env_u64("RECLAIM_TRIPS", 20000));
  benchmark::RegisterBenchmark("reclaim/no_fence", reclaim, Case::NoFence)->UseManualTime()->Iterations(n);
  benchmark::RegisterBenchmark("reclaim/after_launch", reclaim, Case::AfterLaunch)->UseManualTime()->Iterations(n);
  benchmark::RegisterBenchmark("reclaim/fence_passed", reclaim, Case::FencePassed)->UseManualTime()->Iterations(n);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();

  const double baseline = bench::median(g_trips[Case::NoFence]);
  std::printf("\nrelease -> memory back in the host backend (64 KiB, median of %lld trips)\n",
              static_cast<long long>(n));
  std::printf("%-44s %12s %10s %12s\n", "case", "median ns", "p99 ns", "vs no fence");
  const std::pair<Case, const char*> rows[] = {
      {Case::NoFence, "no fence (freed inside release)"},
      {Case::FencePassed, "fence already passed (drop queue bookkeeping)"},
      {Case::AfterLaunch, "pending launch fence (kernel + next call)"},
  };
  for (const auto& [which, label] : rows) {
    const double median = bench::median(g_trips[which]);
    std::printf("%-44s %12.0f %10.0f %11.2fx\n", label, median, bench::percentile(g_trips[which], 99),
                baseline > 0 ? median / baseline : 0.0);
  }
  return 0;
}
