// Where workload e's time goes. Issue 2 asks devbridge's view (workload e) to
// cost no more than the reference's wrap_for_tinygrad. This program measures,
// in one process and interleaved, three ways of answering e's call:
//
//  1. devbridge: Bridge::view over the null backend, its ViewLease ended in the
//     same iteration (exactly workload e of bridge_workloads);
//  2. unsynchronized: the checks Bridge::view makes for this view and the same
//     TensorView, but no lock and no atomic read-modify-write: taking the lease
//     is a plain store to a per-thread slot, ending it a plain store and a load.
//     That is the least any lease that `free_device` can see costs: a lock-free
//     design would have to move a full fence (membarrier) onto the freeing side
//     to get here. It is a model, correct on one thread only; nothing in the
//     library uses it;
//  3. reference-like: what the seed's wrap_for_tinygrad does, in C++: an
//     ordered-map lookup, a dtype compare and a three-field descriptor (handle,
//     dtype, shape kind). No lease, no shape check, no hazard check.
//
// Each prints its median ns per call, and the ratios between them. If (2) is
// already above (3), no lease design meets e's target; the gap between (1) and
// (2) is what synchronization costs.
//
// Harness: Google Benchmark, manual time, repetitions in random interleaved
// order (the VM's speed drifts). Environment: VIEW_FLOOR_N calls per
// repetition (default 1e6), VIEW_FLOOR_REPS (15). No timed assertions.

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "bench_util.hpp"
#include "devbridge/bridge.hpp"
#include "null_backend.hpp"

namespace {

using namespace devbridge;
using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kExtent = 4096;
constexpr ObjectSpec kSpec{1ull << 20, 64, DType::Float16, ShapeKind::Vector};
const ViewSpec kViewSpec{DType::Float16, Dims{static_cast<std::int64_t>(kExtent / 2)}, std::nullopt, 0};

[[noreturn, gnu::cold, gnu::noinline]] void refuse(const char* why) { throw std::runtime_error(why); }

// ---- 2. the unsynchronized model ----
struct ModelSlot {
  std::uint32_t version = 0;
  bool in_use = false;
  bool released = false;
  bool free_waiting = false;  // a freeing thread saw a lease and waits for its end
  DType dtype = DType::UInt8;
  std::uint64_t extent = 0;
  std::uint64_t address = 0;
  std::uint32_t uploads = 0;
};

struct ModelBridge {
  std::uint64_t domain = 0;
  Generation generation = 0;
  std::uint8_t state = 0;
  std::vector<ModelSlot> slots;
  std::string_view device = "CPU";
  int dlpack_device = 1;
  int device_ordinal = 0;
};

thread_local const ModelSlot* t_lease_slot = nullptr;

struct ModelLease {
  const ModelSlot** hazard = nullptr;
  TensorView view;
};

// Out of line, as Bridge::view is (it lives in the library).
[[gnu::noinline]] void model_view(const ModelBridge& bridge, const DeviceHandle& h, const ViewSpec& spec,
                                  ModelLease& lease) {
  if (bridge.state != 0) refuse("bridge not usable");
  if (h.domain != bridge.domain || h.generation != bridge.generation) refuse("foreign or old handle");
  const auto index = static_cast<std::uint32_t>(h.id);
  if (index >= bridge.slots.size()) refuse("unknown handle");
  const ModelSlot& slot = bridge.slots[index];
  if (t_lease_slot != nullptr) refuse("the model holds one lease per thread");
  t_lease_slot = &slot;  // announced before the checks, as an asymmetric-fence design must
  if (!slot.in_use || slot.released || slot.version != (h.id >> 32)) refuse("unknown handle");
  if (slot.uploads != 0) refuse("copy in flight");
  if (spec.dtype != slot.dtype) refuse("dtype");
  if (spec.strides) refuse("the model handles contiguous views only");
  const std::int64_t elem = dtype_size(spec.dtype);
  if (spec.byte_offset & (elem - 1)) refuse("offset");
  std::int64_t elements = 1;
  for (const auto n : spec.shape)
    if (n <= 0 || __builtin_mul_overflow(elements, n, &elements)) refuse("shape");
  std::int64_t end;
  if (__builtin_mul_overflow(elements, elem, &end) ||
      __builtin_add_overflow(end, static_cast<std::int64_t>(spec.byte_offset), &end) ||
      static_cast<std::uint64_t>(end) > slot.extent)
    refuse("extent");
  TensorView& v = lease.view;
  v.data = slot.address;
  v.device = bridge.device;
  v.dlpack_device_type = bridge.dlpack_device;
  v.device_ordinal = bridge.device_ordinal;
  v.dtype = spec.dtype;
  v.shape = spec.shape;
  v.strides.assign_contiguous_strides(spec.shape);
  v.byte_offset = spec.byte_offset;
  v.handle = h;
  lease.hazard = &t_lease_slot;
}

[[gnu::noinline]] void model_end(ModelLease& lease) {
  const ModelSlot* slot = *lease.hazard;
  *lease.hazard = nullptr;
  if (slot->free_waiting) refuse("a free waits (never in this model)");
}

// ---- 3. the reference-like wrap ----
struct ReferenceView {
  DeviceHandle handle;
  DType dtype;
  ShapeKind shape;
};

[[gnu::noinline]] ReferenceView reference_wrap(const std::map<std::uint64_t, ObjectSpec>& objects,
                                               const DeviceHandle& h, DType dtype, ShapeKind shape) {
  const auto it = objects.find(h.id);
  if (it == objects.end()) refuse("unknown handle");
  if (it->second.dtype != dtype) refuse("dtype");
  return ReferenceView{h, dtype, shape};
}

// ---- the three loops ----
double ns_per_call(Clock::time_point t0, Clock::time_point t1, std::uint64_t n) {
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(n);
}

double run_devbridge(std::uint64_t n) {
  Bridge bridge(std::make_unique<bench::NullBackend>(), BridgeOptions{1, 1ull << 20, 0});
  const DeviceHandle h = bridge.alloc_device(kSpec, kExtent);
  const auto t0 = Clock::now();
  for (std::uint64_t i = 0; i < n; ++i) {
    ViewLease lease = bridge.view(h, kViewSpec);
    benchmark::DoNotOptimize(lease.view().data);
  }
  return ns_per_call(t0, Clock::now(), n);
}

double run_unsynchronized(std::uint64_t n) {
  ModelBridge bridge;
  bridge.domain = 7;
  bridge.generation = 1;
  bridge.slots.resize(2);
  bridge.slots[1] = ModelSlot{0, true, false, false, DType::Float16, kExtent, 0x10000, 0};
  const DeviceHandle h{7, 1, 1};
  const auto t0 = Clock::now();
  for (std::uint64_t i = 0; i < n; ++i) {
    ModelLease lease;
    model_view(bridge, h, kViewSpec, lease);
    benchmark::DoNotOptimize(lease.view.data);
    model_end(lease);
  }
  return ns_per_call(t0, Clock::now(), n);
}

double run_reference_like(std::uint64_t n) {
  std::map<std::uint64_t, ObjectSpec> objects{{1, kSpec}};
  const DeviceHandle h{7, 1, 1};
  const auto t0 = Clock::now();
  for (std::uint64_t i = 0; i < n; ++i) {
    ReferenceView view = reference_wrap(objects, h, DType::Float16, ShapeKind::Vector);
    benchmark::DoNotOptimize(view);
  }
  return ns_per_call(t0, Clock::now(), n);
}

struct Variant {
  const char* name;
  double (*run)(std::uint64_t);
  std::vector<double> samples;
};

Variant g_variants[] = {
    {"devbridge_view_and_end", run_devbridge, {}},
    {"unsynchronized_model", run_unsynchronized, {}},
    {"reference_like_wrap", run_reference_like, {}},
};

}  // namespace

int main(int argc, char** argv) {
  const std::uint64_t n = bench::env_u64("VIEW_FLOOR_N", 1'000'000);
  const int reps = static_cast<int>(bench::env_u64("VIEW_FLOOR_REPS", 15));

  // Interleave repetitions unless the command line says otherwise.
  std::vector<char*> args(argv, argv + argc);
  std::string interleave = "--benchmark_enable_random_interleaving=true";
  bool interleave_given = false;
  for (int i = 1; i < argc; ++i)
    interleave_given |= std::string_view(argv[i]).starts_with("--benchmark_enable_random_interleaving");
  if (!interleave_given) args.push_back(interleave.data());
  int args_count = static_cast<int>(args.size());
  benchmark::Initialize(&args_count, args.data());
  if (benchmark::ReportUnrecognizedArguments(args_count, args.data())) return 2;

  for (auto& variant : g_variants) {
    benchmark::RegisterBenchmark(variant.name,
                                 [&variant, n](benchmark::State& state) {
                                   (void)variant.run(n / 10 + 1);  // warm-up, discarded
                                   while (state.KeepRunningBatch(state.max_iterations)) {
                                     const double ns = variant.run(n);
                                     variant.samples.push_back(ns);
                                     state.SetIterationTime(ns * 1e-9 * static_cast<double>(n));
                                   }
                                 })
        ->Iterations(static_cast<benchmark::IterationCount>(n))
        ->Repetitions(reps)
        ->ReportAggregatesOnly(true)
        ->UseManualTime()
        ->Unit(benchmark::kNanosecond);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();

  double median[3];
  for (int i = 0; i < 3; ++i) {
    if (g_variants[i].samples.empty()) {
      std::printf("view_floor: %s did not run (filtered out?)\n", g_variants[i].name);
      return 0;
    }
    median[i] = bench::median(g_variants[i].samples);
  }
  std::printf("\nworkload e, one process, medians of %d interleaved repetitions of %llu calls:\n", reps,
              static_cast<unsigned long long>(n));
  std::printf("  %-56s %8.2f ns   %5.2fx the reference-like wrap\n", "devbridge Bridge::view + lease end", median[0],
              median[0] / median[2]);
  std::printf("  %-56s %8.2f ns   %5.2fx\n", "same checks and TensorView, no synchronization (model)", median[1],
              median[1] / median[2]);
  std::printf("  %-56s %8.2f ns   1.00x\n", "reference-like wrap (map lookup, dtype, 3 fields)", median[2]);
  std::printf("  synchronization and bookkeeping beyond the model: %.2f ns (%.0f%% of devbridge's call)\n",
              median[0] - median[1], 100.0 * (median[0] - median[1]) / median[0]);
  return 0;
}
