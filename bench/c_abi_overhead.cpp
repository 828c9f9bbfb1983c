// What a call through the C ABI (libdevbridge_c.so) costs beyond the same call
// on devbridge::Bridge, on the operation sequences of the reference workloads
// a-d (bench/bridge_workloads.cpp), both sides in one process so that a reader
// compares them in one run.
//
// Both sides open the registered "host" backend with the same options (ring
// 1 MiB, generation 1, everything else default): the C ABI opens backends by
// name only, so bridge_workloads' null backend is out of its reach, and the
// fake backend records every call (a growing vector and a formatted string per
// copy), which would bury nanoseconds. On the host backend a 4 KiB async copy
// runs inline on the submitting thread (inline_async_max_bytes, 16 KiB) and
// alloc/free hit the caching pool, so the loops stay on one thread.
//
// Protocol, as bridge_workloads: a fresh bridge per repetition with its
// pre-fill untimed, the loop timed with steady_clock, one discarded warm-up
// repetition per workload and side. The sides run in BENCH_ROUNDS rounds
// (default 5), one repetition each per round, back to back, the order
// swapped every round, so the machine's drift (a shared VM) falls on both
// alike. The table gives each side's median, and the difference and ratio as
// the medians of the per-round pairs. Nothing here asserts on time.
//
// The C side checks every status, as any C caller must; that branch is part
// of what a C call costs.

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "devbridge/backends.hpp"
#include "devbridge/bridge.hpp"
#include "devbridge/c/devbridge.h"

namespace {

using namespace devbridge;
using Clock = std::chrono::steady_clock;

constexpr const char* kBackend = "host";
constexpr Generation kGeneration = 1;
constexpr std::uint64_t kExtent = 4096;
constexpr std::size_t kLive = 1024;
constexpr std::uint64_t kRingBytes = 1ull << 20;
constexpr ObjectSpec kSpec{1ull << 20, 64, DType::Float16, ShapeKind::Vector};

// ---- the two APIs behind one set of member names ----

class CppApi {
 public:
  using Handle = DeviceHandle;
  using Event = CopyEvent;
  using Device = DeviceRange;
  static constexpr auto kSync = CopyMode::Sync;
  static constexpr auto kAsync = CopyMode::Async;

  CppApi()
      : bridge_(make_backend(kBackend), BridgeOptions{kGeneration, kRingBytes, 0}), host_(bridge_.reserve(kExtent)) {}

  Handle alloc() { return bridge_.alloc_device(kSpec, kExtent); }
  void free(Handle h) { bridge_.free_device(h); }
  static Device whole(Handle h) { return DeviceRange{h, 0, kExtent}; }
  Event upload(const Device& d, CopyMode mode) { return bridge_.host_to_device(host_, d, mode); }
  Event download(const Device& d, CopyMode mode) { return bridge_.device_to_host(d, host_, mode); }
  std::size_t poll() { return bridge_.poll(); }
  bool safe_to_release_host(Event e) { return bridge_.safe_to_release_host(e); }

 private:
  Bridge bridge_;
  HostRange host_;
};

[[noreturn]] [[gnu::cold]] [[gnu::noinline]] void throw_c_failure(const char* call, devbridge_status status) {
  throw std::runtime_error(std::string(call) + ": " + devbridge_status_name(status) + ": " +
                           devbridge_last_error_message());
}

inline void check(devbridge_status status, const char* call) {
  if (status != DEVBRIDGE_OK) [[unlikely]]
    throw_c_failure(call, status);
}

class CApi {
 public:
  using Handle = devbridge_handle;
  using Event = devbridge_event;
  using Device = devbridge_device_range;
  static constexpr devbridge_copy_mode kSync = DEVBRIDGE_COPY_SYNC;
  static constexpr devbridge_copy_mode kAsync = DEVBRIDGE_COPY_ASYNC;

  CApi() {
    devbridge_open_options options{};
    options.size = sizeof options;
    options.backend = kBackend;
    options.generation = kGeneration;
    options.ring_bytes = kRingBytes;
    check(devbridge_open(&options, &bridge_), "devbridge_open");
    owned_.reset(bridge_);
    check(devbridge_reserve_host(bridge_, kExtent, 0, 0, &host_), "devbridge_reserve_host");
    spec_.size = sizeof spec_;
    spec_.max_extent = kSpec.max_extent;
    spec_.alignment = kSpec.alignment;
    spec_.dtype = DEVBRIDGE_DTYPE_FLOAT16;
    spec_.shape = DEVBRIDGE_SHAPE_VECTOR;
  }

  Handle alloc() {
    Handle h;
    check(devbridge_alloc_device(bridge_, &spec_, kExtent, &h), "devbridge_alloc_device");
    return h;
  }
  void free(Handle h) { check(devbridge_free_device(bridge_, h), "devbridge_free_device"); }
  static Device whole(Handle h) { return Device{h, 0, kExtent}; }
  Event upload(const Device& d, devbridge_copy_mode mode) {
    Event e;
    check(devbridge_host_to_device(bridge_, host_, d, mode, &e), "devbridge_host_to_device");
    return e;
  }
  Event download(const Device& d, devbridge_copy_mode mode) {
    Event e;
    check(devbridge_device_to_host(bridge_, d, host_, mode, &e), "devbridge_device_to_host");
    return e;
  }
  std::uint64_t poll() {
    std::uint64_t applied;
    check(devbridge_poll(bridge_, &applied), "devbridge_poll");
    return applied;
  }
  bool safe_to_release_host(Event e) {
    int32_t safe;
    check(devbridge_safe_to_release_host(bridge_, e, &safe), "devbridge_safe_to_release_host");
    return safe != 0;
  }

 private:
  struct Destroy {
    void operator()(devbridge_bridge* b) const noexcept { devbridge_destroy(b); }
  };
  devbridge_bridge* bridge_ = nullptr;
  std::unique_ptr<devbridge_bridge, Destroy> owned_;
  devbridge_host_range host_{};
  devbridge_object_spec spec_{};
};

// ---- workloads a-d, written once for both APIs ----

// A FIFO over a fixed power-of-two ring, so the loop allocates nothing (as
// bridge_workloads' HandleFifo, over either handle type).
template <class T>
class Fifo {
 public:
  explicit Fifo(std::size_t capacity) {
    std::size_t size = 1;
    while (size < capacity) size <<= 1;
    slots_.resize(size);
    mask_ = size - 1;
  }
  void push_back(T value) { slots_[tail_++ & mask_] = value; }
  T pop_front() { return slots_[head_++ & mask_]; }

 private:
  std::vector<T> slots_;
  std::size_t mask_ = 0;
  std::size_t head_ = 0;
  std::size_t tail_ = 0;
};

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Each workload: its name, operations per loop iteration (c counts copies)
// and C calls per operation, and the loop, timed, over either API.
struct AllocFree {
  static constexpr const char* kName = "a_alloc_free";
  static constexpr std::uint64_t kOpsPerIteration = 1;
  static constexpr int kCallsPerOp = 2;
  template <class Api>
  static double run(std::uint64_t iterations) {
    Api api;
    const auto start = Clock::now();
    for (std::uint64_t i = 0; i < iterations; ++i) {
      auto h = api.alloc();
      benchmark::DoNotOptimize(h);
      api.free(h);
    }
    return seconds_since(start);
  }
};

struct SteadyFifo {
  static constexpr const char* kName = "b_steady_fifo_1024";
  static constexpr std::uint64_t kOpsPerIteration = 1;
  static constexpr int kCallsPerOp = 4;
  template <class Api>
  static double run(std::uint64_t iterations) {
    Api api;
    Fifo<typename Api::Handle> live(kLive + 1);
    for (std::size_t i = 0; i < kLive; ++i) live.push_back(api.alloc());
    const auto start = Clock::now();
    for (std::uint64_t i = 0; i < iterations; ++i) {
      auto h = api.alloc();
      auto c = api.upload(Api::whole(h), Api::kAsync);
      benchmark::DoNotOptimize(c);
      auto applied = api.poll();
      benchmark::DoNotOptimize(applied);
      live.push_back(h);
      api.free(live.pop_front());
    }
    return seconds_since(start);
  }
};

struct SyncCopies {
  static constexpr const char* kName = "c_sync_h2d_d2h_per_copy";
  static constexpr std::uint64_t kOpsPerIteration = 2;
  static constexpr int kCallsPerOp = 1;
  template <class Api>
  static double run(std::uint64_t iterations) {
    Api api;
    const auto dev = Api::whole(api.alloc());
    const auto start = Clock::now();
    for (std::uint64_t i = 0; i < iterations; ++i) {
      auto c1 = api.upload(dev, Api::kSync);
      auto c2 = api.download(dev, Api::kSync);
      benchmark::DoNotOptimize(c1);
      benchmark::DoNotOptimize(c2);
    }
    return seconds_since(start);
  }
};

struct AsyncObserveRelease {
  static constexpr const char* kName = "d_async_observe_release";
  static constexpr std::uint64_t kOpsPerIteration = 1;
  static constexpr int kCallsPerOp = 3;
  template <class Api>
  static double run(std::uint64_t iterations) {
    Api api;
    const auto dev = Api::whole(api.alloc());
    const auto start = Clock::now();
    for (std::uint64_t i = 0; i < iterations; ++i) {
      auto c = api.upload(dev, Api::kAsync);
      benchmark::DoNotOptimize(c);
      auto applied = api.poll();
      benchmark::DoNotOptimize(applied);
      if (!api.safe_to_release_host(c)) throw std::runtime_error("an observed copy is not safe to release");
    }
    return seconds_since(start);
  }
};

// ---- harness ----

enum Side { kCpp = 0, kC = 1 };
constexpr const char* kSideName[] = {"cpp", "c"};

struct Workload {
  const char* name = nullptr;
  std::uint64_t ops_per_iteration = 1;
  int calls_per_op = 1;
  double (*run[2])(std::uint64_t iterations) = {nullptr, nullptr};
  bool warmed_up[2] = {false, false};
  std::vector<double> ns_per_op[2];  // indexed by round; negative: not run
  std::string error;
};

template <class W>
Workload workload() {
  Workload w;
  w.name = W::kName;
  w.ops_per_iteration = W::kOpsPerIteration;
  w.calls_per_op = W::kCallsPerOp;
  w.run[kCpp] = &W::template run<CppApi>;
  w.run[kC] = &W::template run<CApi>;
  return w;
}

void register_run(Workload* w, Side side, int round, std::uint64_t iterations) {
  const std::string name = std::string(w->name) + "/" + kSideName[side] + "/round:" + std::to_string(round + 1);
  const std::uint64_t ops = iterations * w->ops_per_iteration;
  benchmark::RegisterBenchmark(name.c_str(),
                               [w, side, round, iterations, ops](benchmark::State& state) {
                                 try {
                                   if (!w->warmed_up[side]) {
                                     (void)w->run[side](iterations);
                                     w->warmed_up[side] = true;
                                   }
                                   while (state.KeepRunningBatch(state.max_iterations)) {
                                     const double seconds = w->run[side](iterations);
                                     state.SetIterationTime(seconds);
                                     w->ns_per_op[side][round] = seconds * 1e9 / static_cast<double>(ops);
                                   }
                                 } catch (const std::exception& e) {
                                   w->error = e.what();
                                   state.SkipWithError(w->error.c_str());
                                 }
                               })
      ->Iterations(static_cast<benchmark::IterationCount>(ops))
      ->Repetitions(1)
      ->UseManualTime()
      ->Unit(benchmark::kNanosecond);
}

// One workload's figures over the rounds where both sides ran.
struct Summary {
  const Workload* workload;
  double cpp_median, c_median, difference_median, ratio_median, cpp_min, c_min;
};

std::vector<Summary> summarize(const std::vector<Workload>& workloads) {
  std::vector<Summary> summaries;
  for (const auto& w : workloads) {
    std::vector<double> cpp, c, difference, ratio;
    for (std::size_t r = 0; r < w.ns_per_op[kCpp].size(); ++r) {
      const double a = w.ns_per_op[kCpp][r], b = w.ns_per_op[kC][r];
      if (a <= 0 || b < 0) continue;  // not run: filtered out on the command line, or failed
      cpp.push_back(a);
      c.push_back(b);
      difference.push_back(b - a);
      ratio.push_back(b / a);
    }
    if (cpp.empty()) continue;
    summaries.push_back({&w, bench::median(cpp), bench::median(c), bench::median(difference), bench::median(ratio),
                         bench::min_of(cpp), bench::min_of(c)});
  }
  return summaries;
}

void print_results(const std::vector<Workload>& workloads) {
  for (const auto& w : workloads)
    if (!w.error.empty()) std::printf("# %s: FAILED: %s\n", w.name, w.error.c_str());
  const auto summaries = summarize(workloads);
  std::printf("\n%-26s %8s %10s %10s %10s %8s %12s\n", "workload", "calls/op", "C++ ns/op", "C ns/op", "C-C++ ns",
              "C/C++", "C-C++ /call");
  for (const auto& s : summaries) {
    std::printf("%-26s %8d %10.2f %10.2f %+10.2f %8.3f %+12.2f\n", s.workload->name, s.workload->calls_per_op,
                s.cpp_median, s.c_median, s.difference_median, s.ratio_median,
                s.difference_median / s.workload->calls_per_op);
  }
  std::printf("# C++ and C: medians over rounds; C-C++ and C/C++: medians of the per-round pairs (run back to "
              "back); /call: the difference spread over the C calls one operation makes\n");
  for (const auto& s : summaries) {
    std::printf("workload=%s cpp_ns_per_op=%.3f c_ns_per_op=%.3f diff_ns_per_op=%.3f ratio=%.4f cpp_min=%.3f "
                "c_min=%.3f\n",
                s.workload->name, s.cpp_median, s.c_median, s.difference_median, s.ratio_median, s.cpp_min, s.c_min);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::uint64_t n = bench::env_u64("BENCH_N", 1'000'000);
  const int rounds = static_cast<int>(bench::env_u64("BENCH_ROUNDS", 5));

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;

  std::printf("# C ABI (libdevbridge_c.so) vs C++ API (devbridge::Bridge), workloads a-d: backend=%s n=%llu "
              "rounds=%d (order swapped each round) warmup=1 extent=%llu live=%zu ring_bytes=%llu\n",
              kBackend, static_cast<unsigned long long>(n), rounds, static_cast<unsigned long long>(kExtent), kLive,
              static_cast<unsigned long long>(kRingBytes));
  std::fflush(stdout);

  std::vector<Workload> workloads = {workload<AllocFree>(), workload<SteadyFifo>(), workload<SyncCopies>(),
                                     workload<AsyncObserveRelease>()};
  for (auto& w : workloads)
    for (auto& per_round : w.ns_per_op) per_round.assign(static_cast<std::size_t>(rounds), -1.0);
  for (int round = 0; round < rounds; ++round) {
    const Side first = round % 2 == 0 ? kCpp : kC;
    for (auto& w : workloads) {
      register_run(&w, first, round, n);
      register_run(&w, first == kCpp ? kC : kCpp, round, n);
    }
  }

  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();

  std::fflush(stdout);
  print_results(workloads);
  bool any_error = false;
  for (const auto& w : workloads) any_error = any_error || !w.error.empty();
  return any_error ? 1 : 0;
}
