// Replays the six workloads a–f of ../shared/bench/seed-rust/README.md op for
// op over the null backend, with the reference's constants and protocol, so
// devbridge's bookkeeping cost can be set beside the Rust reference's as a
// ratio measured in one `make bench`.
//
// Protocol (as the reference's src/bin/bench.rs):
//  - every repetition builds a fresh Bridge and does its pre-fill untimed; only
//    the loop is timed (steady_clock, i.e. CLOCK_MONOTONIC like Rust's
//    Instant); the bridge is destroyed after the clock is read;
//  - 1 warm-up repetition (discarded) + 7 timed, reported value = median;
//  - N = 1,000,000; workload f runs d at 1e5, 1e6 and 4e6 with the last 100k
//    iterations timed as a separate segment, and samples VmRSS while the bridge
//    that made N copies is still alive.
// Google Benchmark is the harness: one registered benchmark per workload with
// Iterations(ops per repetition), Repetitions(7), manual time (the loop's own
// clock), aggregates only. The machine-readable lines printed afterwards
// (`workload=<name> ns_per_op=<x>`, `peak_rss_kib=<n>`, `#` for information)
// use the reference's format so bench/compare.py parses both the same way.
//
// Mapping of the reference's operations onto devbridge:
//   alloc_device / free_device   -> Bridge::alloc_device / free_device
//   HOST (offset 0, len 4096)    -> one 4096-byte reservation of a 1 MiB ring,
//                                   made in the untimed pre-fill
//   dev(h)                       -> DeviceRange{h, 0, 4096}
//   observe(CopyCompleted{c})    -> Bridge::poll() (the null backend queued c's
//                                   completion at submit)
//   safe_to_release_host(c)      -> Bridge::safe_to_release_host(c)
//   wrap_for_tinygrad(h, VIEW)   -> Bridge::view(h, ViewSpec{Float16, {2048}}),
//                                   whose ViewLease ends in the same iteration
//                                   (the reference's wrap takes no lease).
// Nothing here asserts on time; a failed call ends that workload with its error.

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "devbridge/bridge.hpp"
#include "devbridge/error.hpp"
#include "null_backend.hpp"

namespace {

using namespace devbridge;
using bench::proc_status_kib;
using Clock = std::chrono::steady_clock;

constexpr Generation kGeneration = 1;
constexpr std::uint64_t kExtent = 4096;
constexpr std::size_t kLive = 1024;
constexpr std::uint64_t kTailWindow = 100'000;
constexpr std::uint64_t kRingBytes = 1ull << 20;
constexpr ObjectSpec kSpec{1ull << 20, 64, DType::Float16, ShapeKind::Vector};

ViewSpec view_spec() { return ViewSpec{DType::Float16, Dims{static_cast<std::int64_t>(kExtent / 2)}, std::nullopt, 0}; }

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "bridge_workloads: %s\n", what);
  std::abort();
}

// A fresh bridge over the null backend and the HOST reservation, built and
// torn down outside the timed loop.
struct Fixture {
  Bridge bridge;
  HostRange host;

  Fixture()
      : bridge(std::make_unique<bench::NullBackend>(), BridgeOptions{kGeneration, kRingBytes, 0}),
        host(bridge.reserve(kExtent)) {
    // BENCH_RECORD=<max_events>: the flight recorder on, for what it costs
    // when on (docs/TRACING.md); 0 (the default) leaves it off.
    static const std::uint64_t record_events = bench::env_u64("BENCH_RECORD", 0);
    if (record_events != 0) bridge.record(RecordOptions{.max_events = record_events});
  }

  DeviceRange dev(DeviceHandle h) const { return DeviceRange{h, 0, kExtent}; }
};

// One timed repetition.
struct Rep {
  double seconds = 0;       // the whole timed loop
  std::uint64_t ops = 0;    // operations it counts (iterations, or copies for c)
  double tail_seconds = 0;  // the last-100k segment (f); equals seconds elsewhere
  std::uint64_t tail_ops = 0;
  std::uint64_t rss_kib = 0;       // VmRSS while the bridge is alive (f)
  BridgeStats stats;               // the bridge's stats after the loop
  double ns_per_op() const { return seconds * 1e9 / static_cast<double>(ops); }
  double tail_ns_per_op() const { return tail_seconds * 1e9 / static_cast<double>(tail_ops); }
};

// The loop ran from t0 to t1 over `ops` operations; its last `tail_ops` from t_tail.
Rep make_rep(Clock::time_point t0, Clock::time_point t_tail, Clock::time_point t1, std::uint64_t ops,
             std::uint64_t tail_ops) {
  Rep r;
  r.seconds = seconds_between(t0, t1);
  r.ops = ops;
  r.tail_seconds = seconds_between(t_tail, t1);
  r.tail_ops = tail_ops;
  return r;
}

// A FIFO of handles over a fixed power-of-two ring, like Rust's VecDeque with
// capacity reserved: no allocation in the loop, so its cost matches the
// reference's FIFO.
class HandleFifo {
 public:
  explicit HandleFifo(std::size_t capacity) {
    std::size_t size = 1;
    while (size < capacity) size <<= 1;
    slots_.resize(size);
    mask_ = size - 1;
  }
  void push_back(DeviceHandle h) { slots_[tail_++ & mask_] = h; }
  DeviceHandle pop_front() { return slots_[head_++ & mask_]; }

 private:
  std::vector<DeviceHandle> slots_;
  std::size_t mask_ = 0;
  std::size_t head_ = 0;
  std::size_t tail_ = 0;
};

// (a) alloc_device + free_device, one live allocation at a time. ns per cycle.
Rep wl_alloc_free(std::uint64_t n) {
  Fixture f;
  const auto t0 = Clock::now();
  for (std::uint64_t i = 0; i < n; ++i) {
    DeviceHandle h = f.bridge.alloc_device(kSpec, kExtent);
    benchmark::DoNotOptimize(h);
    f.bridge.free_device(h);
  }
  const auto t1 = Clock::now();
  Rep r = make_rep(t0, t0, t1, n, n);
  r.stats = f.bridge.stats();
  return r;
}

// (b) steady state with 1024 live allocations in a FIFO. ns per iteration.
Rep wl_steady_fifo(std::uint64_t n) {
  Fixture f;
  HandleFifo live(kLive + 1);
  for (std::size_t i = 0; i < kLive; ++i) live.push_back(f.bridge.alloc_device(kSpec, kExtent));
  const auto t0 = Clock::now();
  for (std::uint64_t i = 0; i < n; ++i) {
    DeviceHandle h = f.bridge.alloc_device(kSpec, kExtent);
    CopyEvent c = f.bridge.host_to_device(f.host, f.dev(h), CopyMode::Async);
    benchmark::DoNotOptimize(c);
    std::size_t applied = f.bridge.poll();
    benchmark::DoNotOptimize(applied);
    live.push_back(h);
    f.bridge.free_device(live.pop_front());
  }
  const auto t1 = Clock::now();
  Rep r = make_rep(t0, t0, t1, n, n);
  r.stats = f.bridge.stats();
  return r;
}

// (c) sync host_to_device + sync device_to_host on one allocation. ns per copy.
Rep wl_sync_copies(std::uint64_t n) {
  Fixture f;
  const DeviceRange dev = f.dev(f.bridge.alloc_device(kSpec, kExtent));
  const auto t0 = Clock::now();
  for (std::uint64_t i = 0; i < n; ++i) {
    CopyEvent c1 = f.bridge.host_to_device(f.host, dev, CopyMode::Sync);
    CopyEvent c2 = f.bridge.device_to_host(dev, f.host, CopyMode::Sync);
    benchmark::DoNotOptimize(c1);
    benchmark::DoNotOptimize(c2);
  }
  const auto t1 = Clock::now();
  Rep r = make_rep(t0, t0, t1, 2 * n, 2 * n);
  r.stats = f.bridge.stats();
  return r;
}

inline void async_observe_release_step(Fixture& f, const DeviceRange& dev) {
  CopyEvent c = f.bridge.host_to_device(f.host, dev, CopyMode::Async);
  benchmark::DoNotOptimize(c);
  std::size_t applied = f.bridge.poll();
  benchmark::DoNotOptimize(applied);
  if (!f.bridge.safe_to_release_host(c)) fail("an observed copy is not safe to release");
}

// (d) async host_to_device + poll + safe_to_release_host. ns per iteration.
// Also (f): the last kTailWindow iterations are a separately timed segment,
// and VmRSS is read while the bridge that made n copies is alive.
Rep wl_async_observe_release(std::uint64_t n, bool sample_rss) {
  Fixture f;
  const DeviceRange dev = f.dev(f.bridge.alloc_device(kSpec, kExtent));
  const std::uint64_t tail_start = n > kTailWindow ? n - kTailWindow : 0;
  const auto t0 = Clock::now();
  for (std::uint64_t i = 0; i < tail_start; ++i) async_observe_release_step(f, dev);
  const auto t_tail = Clock::now();
  for (std::uint64_t i = tail_start; i < n; ++i) async_observe_release_step(f, dev);
  const auto t1 = Clock::now();
  Rep r = make_rep(t0, t_tail, t1, n, n - tail_start);
  if (sample_rss) r.rss_kib = proc_status_kib("VmRSS");
  r.stats = f.bridge.stats();
  return r;
}

// (e) a view of a live allocation, its lease ended in the same iteration. ns per call.
Rep wl_view(std::uint64_t n) {
  Fixture f;
  const DeviceHandle h = f.bridge.alloc_device(kSpec, kExtent);
  const ViewSpec spec = view_spec();
  const auto t0 = Clock::now();
  for (std::uint64_t i = 0; i < n; ++i) {
    ViewLease lease = f.bridge.view(h, spec);
    benchmark::DoNotOptimize(lease.view().data);
  }
  const auto t1 = Clock::now();
  Rep r = make_rep(t0, t0, t1, n, n);
  r.stats = f.bridge.stats();
  return r;
}

struct Workload {
  std::string name;
  std::function<Rep()> run;
  bool growth = false;          // print the last-100k line and RSS
  std::uint64_t copies = 0;     // copies the bridge made (f), for the RSS label
  bool warmed_up = false;
  std::vector<Rep> reps;
  std::string error;
};

// Order of registration is order of running and of printing.
std::vector<std::unique_ptr<Workload>> g_workloads;

double stat_min(const std::vector<double>& v) { return bench::min_of(v); }
double stat_max(const std::vector<double>& v) { return bench::max_of(v); }

void register_workload(Workload* w, std::uint64_t ops, int reps) {
  benchmark::RegisterBenchmark(w->name.c_str(),
                               [w](benchmark::State& state) {
                                 try {
                                   if (!w->warmed_up) {  // the reference's discarded warm-up repetition
                                     (void)w->run();
                                     w->warmed_up = true;
                                   }
                                   while (state.KeepRunningBatch(state.max_iterations)) {
                                     Rep r = w->run();
                                     state.SetIterationTime(r.seconds);
                                     if (w->growth) {
                                       state.counters["last100k_ns"] = r.tail_ns_per_op();
                                       state.counters["rss_kib"] = static_cast<double>(r.rss_kib);
                                     }
                                     state.counters["copy_records"] = static_cast<double>(r.stats.copy_records);
                                     w->reps.push_back(r);
                                   }
                                 } catch (const std::exception& e) {
                                   w->error = e.what();
                                   state.SkipWithError(w->error.c_str());
                                 }
                               })
      ->Iterations(static_cast<benchmark::IterationCount>(ops))
      ->Repetitions(reps)
      ->ReportAggregatesOnly(true)
      ->ComputeStatistics("min", stat_min)
      ->ComputeStatistics("max", stat_max)
      ->UseManualTime()
      ->Unit(benchmark::kNanosecond);
}

Workload* add(std::string name, std::function<Rep()> run) {
  g_workloads.push_back(std::make_unique<Workload>());
  Workload* w = g_workloads.back().get();
  w->name = std::move(name);
  w->run = std::move(run);
  return w;
}

void print_results() {
  for (const auto& w : g_workloads) {
    if (!w->error.empty()) {
      std::printf("# %s: FAILED: %s\n", w->name.c_str(), w->error.c_str());
      std::printf("workload=%s error=1\n", w->name.c_str());
      continue;
    }
    if (w->reps.empty()) continue;  // filtered out on the command line
    std::vector<double> whole;
    std::vector<double> tail;
    for (const auto& r : w->reps) {
      whole.push_back(r.ns_per_op());
      tail.push_back(r.tail_ns_per_op());
    }
    const Rep& last = w->reps.back();
    std::printf("workload=%s ns_per_op=%.3f\n", w->name.c_str(), bench::median(whole));
    if (w->growth) std::printf("workload=%s_last100k ns_per_op=%.3f\n", w->name.c_str(), bench::median(tail));
    std::printf("# %s: min=%.3f max=%.3f", w->name.c_str(), bench::min_of(whole), bench::max_of(whole));
    if (w->growth) {
      std::printf(" vm_rss_kib_with_%llu_copies_live=%llu", static_cast<unsigned long long>(w->copies),
                  static_cast<unsigned long long>(last.rss_kib));
    }
    std::printf(" copies_submitted=%llu copies_completed=%llu copy_records=%llu live_allocations=%llu\n",
                static_cast<unsigned long long>(last.stats.copies_submitted),
                static_cast<unsigned long long>(last.stats.copies_completed),
                static_cast<unsigned long long>(last.stats.copy_records),
                static_cast<unsigned long long>(last.stats.live_allocations));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::uint64_t n = bench::env_u64("BENCH_N", 1'000'000);
  const int reps = static_cast<int>(bench::env_u64("BENCH_REPS", 7));
  const bool skip_growth = bench::env_u64("BENCH_SKIP_GROWTH", 0) != 0;

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;

  std::printf("# devbridge replay of seed-rust workloads a-f: backend=null n=%llu reps=%d warmup=1 extent=%llu "
              "live=%zu stat=median ring_bytes=%llu\n",
              static_cast<unsigned long long>(n), reps, static_cast<unsigned long long>(kExtent), kLive,
              static_cast<unsigned long long>(kRingBytes));
  std::printf("# HOST = one 4096-byte ring reservation made before the loop; observe(CopyCompleted) = Bridge::poll()\n");
  std::printf("# e: devbridge's view() takes a lease (ViewLease) that ends in the same iteration; "
              "the reference's wrap_for_tinygrad takes none\n");
  std::printf("# timing is the loop's own steady_clock (manual time); Google Benchmark's \"Library was built as "
              "DEBUG\" warning is about Debian's libbenchmark build and does not touch it\n");
  std::printf("# start_vm_rss_kib=%llu\n", static_cast<unsigned long long>(proc_status_kib("VmRSS")));
  std::fflush(stdout);

  register_workload(add("a_alloc_free", [n] { return wl_alloc_free(n); }), n, reps);
  register_workload(add("b_steady_fifo_1024", [n] { return wl_steady_fifo(n); }), n, reps);
  register_workload(add("c_sync_h2d_d2h_per_copy", [n] { return wl_sync_copies(n); }), 2 * n, reps);
  register_workload(add("d_async_observe_release", [n] { return wl_async_observe_release(n, false); }), n, reps);
  register_workload(add("e_wrap_for_tinygrad", [n] { return wl_view(n); }), n, reps);
  if (!skip_growth) {
    const std::pair<const char*, std::uint64_t> sizes[] = {{"1e5", 100'000}, {"1e6", 1'000'000}, {"4e6", 4'000'000}};
    for (const auto& [label, total] : sizes) {
      Workload* w = add(std::string("f_growth_d_") + label,
                        [total = total] { return wl_async_observe_release(total, true); });
      w->growth = true;
      w->copies = total;
      register_workload(w, total, reps);
    }
  }

  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();

  std::fflush(stdout);
  print_results();
  std::printf("# end_vm_rss_kib=%llu\n", static_cast<unsigned long long>(proc_status_kib("VmRSS")));
  std::printf("peak_rss_kib=%llu\n", static_cast<unsigned long long>(proc_status_kib("VmHWM")));
  bool any_error = false;
  for (const auto& w : g_workloads) any_error = any_error || !w->error.empty();
  return any_error ? 1 : 0;
}
