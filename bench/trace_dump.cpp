// The flight recorder's dump (issue 28): the time to turn 10^6 recorded
// events into trace-event JSON (Bridge::trace_json), the goal being under
// a second. The events are a training loop's: alloc, an async upload, its
// wait, a view, a free, over the fake backend (copies complete at once), so
// the dump has instants, copy and view slices and counters in the usual mix.
// Google Benchmark is the harness; no timed assertions.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <memory>

#include "devbridge/backends/fake.hpp"
#include "devbridge/bridge.hpp"

namespace {

constexpr std::size_t kEvents = 1'000'000;

std::unique_ptr<devbridge::Bridge> recorded_bridge() {
  using namespace devbridge;
  auto fake = std::make_unique<fake::FakeBackend>();
  fake->set_auto_complete(true);
  auto bridge = std::make_unique<Bridge>(std::move(fake), BridgeOptions{.ring_bytes = 1 << 20});
  bridge->record(RecordOptions{.max_events = kEvents});
  const ObjectSpec spec{1 << 20, 64, DType::Float32, ShapeKind::Vector};
  const auto range = bridge->reserve(4096);
  // Each round records allocate, copy begin and end, view begin and end, free.
  for (std::size_t round = 0; round < kEvents / 6 + 1; ++round) {
    const auto h = bridge->alloc_device(spec, 4096);
    bridge->wait(bridge->host_to_device(range, DeviceRange{h, 0, 4096}, CopyMode::Async));
    { auto view = bridge->view(h, ViewSpec{DType::Float32, Dims{16}, std::nullopt, 0}); }
    bridge->free_device(h);
  }
  bridge->release_host(range);
  return bridge;
}

void BM_TraceJsonOfAMillionEvents(benchmark::State& state) {
  const auto bridge = recorded_bridge();
  std::size_t bytes = 0;
  for (auto _ : state) {
    const auto json = bridge->trace_json();
    bytes = json.size();
    benchmark::DoNotOptimize(json.data());
  }
  state.counters["events"] = static_cast<double>(kEvents);
  state.counters["MB"] = static_cast<double>(bytes) / 1e6;
}
BENCHMARK(BM_TraceJsonOfAMillionEvents)->Unit(benchmark::kMillisecond)->Iterations(3);

}  // namespace

int main(int argc, char** argv) {
  std::printf("flight recorder: trace_json of %zu recorded events (goal: under 1 s)\n", kEvents);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
