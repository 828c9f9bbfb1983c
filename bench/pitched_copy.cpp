// Pitched 2-D copies (issue 14): a 4096 x 4095 float32 window of a 4096 x
// 4096 host matrix (every row but its last column) uploaded into a packed
// device tensor and downloaded back, as one pitched copy (one call, one
// event) against a row loop of 4096 one-row copies, in one process, per
// backend this machine runs. Rows: median ms per copy over
// PITCHED_BENCH_REPS repetitions (default 5) and the pitched copy's speed-up.
// Every result is checked against the source (the bench stops on a
// mismatch); nothing here is timed against a threshold.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "devbridge/backends.hpp"
#include "devbridge/bridge.hpp"

namespace {

using namespace devbridge;
using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kRows = 4096, kColumns = 4096, kWindowColumns = 4095;
constexpr std::uint64_t kHostPitch = kColumns * 4, kRowBytes = kWindowColumns * 4;
constexpr std::uint64_t kMatrixBytes = kRows * kHostPitch, kTensorBytes = kRows * kRowBytes;

std::map<std::string, std::vector<double>> g_ms;  // "backend/direction/kind" -> per repetition

struct Setup {
  Bridge bridge;
  HostRange matrix;
  DeviceHandle tensor;
  explicit Setup(const std::string& backend)
      : bridge(make_backend(backend), BridgeOptions{.ring_bytes = 2 * kMatrixBytes + (1 << 20)}) {
    matrix = bridge.reserve(kMatrixBytes, 4096);
    auto bytes = bridge.host_bytes(matrix);
    for (std::uint64_t i = 0; i < kMatrixBytes / 4; ++i) {
      const auto value = static_cast<float>(i % 100003);
      std::memcpy(bytes.data() + i * 4, &value, 4);
    }
    tensor = bridge.alloc_device(ObjectSpec{kTensorBytes, 64, DType::Float32, ShapeKind::Matrix}, kTensorBytes);
  }
};

void copy(Setup& s, CopyDirection direction, bool pitched) {
  const DeviceRange device{s.tensor, 0, kTensorBytes};
  if (pitched) {
    const CopyLayout layout{kRows, kRowBytes, kHostPitch, kRowBytes};
    const auto event = s.bridge.copy(HostCopy{direction, s.matrix, device, layout, CopyMode::Async});
    s.bridge.wait(event);
    return;
  }
  // The loop a caller writes without pitched copies: one copy per row,
  // waited for at the end (copies on one queue complete in order).
  CopyEvent last{};
  for (std::uint64_t r = 0; r < kRows; ++r) {
    const HostRange row{s.matrix.offset + r * kHostPitch, kRowBytes};
    const DeviceRange to{s.tensor, r * kRowBytes, kRowBytes};
    last = direction == CopyDirection::HostToDevice
               ? s.bridge.host_to_device(row, to, CopyMode::Async, Admission{std::chrono::seconds(60)})
               : s.bridge.device_to_host(to, row, CopyMode::Async, Admission{std::chrono::seconds(60)});
  }
  s.bridge.wait(last);
  s.bridge.poll();
}

// Downloads into the matrix's window and checks it against the values the
// matrix was filled with (the last column, never copied, keeps its own).
bool round_trip_exact(Setup& s) {
  auto bytes = s.bridge.host_bytes(s.matrix);
  std::vector<std::byte> saved(bytes.begin(), bytes.end());
  std::memset(bytes.data(), 0, bytes.size());
  copy(s, CopyDirection::DeviceToHost, true);
  for (std::uint64_t r = 0; r < kRows; ++r)
    if (std::memcmp(bytes.data() + r * kHostPitch, saved.data() + r * kHostPitch, kRowBytes) != 0) return false;
  std::memcpy(bytes.data(), saved.data(), saved.size());
  return true;
}

void run(benchmark::State& state, std::string backend, CopyDirection direction, bool pitched) {
  Setup s(backend);
  copy(s, CopyDirection::HostToDevice, true);
  if (!round_trip_exact(s)) {
    state.SkipWithError("the pitched round trip did not return the window exactly");
    return;
  }
  copy(s, direction, pitched);  // warm
  auto& out = g_ms[backend + (direction == CopyDirection::HostToDevice ? "/up" : "/down") + (pitched ? "/2d" : "/rows")];
  for (auto _ : state) {
    const auto start = Clock::now();
    copy(s, direction, pitched);
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    out.push_back(seconds * 1e3);
    state.SetIterationTime(seconds);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kTensorBytes));
}

}  // namespace

int main(int argc, char** argv) {
  const auto reps = static_cast<benchmark::IterationCount>(bench::env_u64("PITCHED_BENCH_REPS", 5));
  std::vector<std::string> backends;
  for (const auto& entry : list_backends())
    if (entry.available && (entry.name == "host" || entry.name == "opencl" || entry.name == "cuda"))
      backends.push_back(entry.name);
  for (const auto& name : backends)
    for (const auto direction : {CopyDirection::HostToDevice, CopyDirection::DeviceToHost})
      for (const bool pitched : {false, true}) {
        const std::string label = "pitched/" + name + (direction == CopyDirection::HostToDevice ? "/up" : "/down") +
                                  (pitched ? "/2d" : "/rows");
        benchmark::RegisterBenchmark(label.c_str(), run, name, direction, pitched)->UseManualTime()->Iterations(reps);
      }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();

  std::printf("\n4096 x 4095 float32 window of a 4096 x 4096 matrix (%.1f MiB), median ms per copy\n",
              static_cast<double>(kTensorBytes) / (1 << 20));
  std::printf("%-10s %-5s %12s %12s %14s\n", "backend", "dir", "row loop ms", "2-D copy ms", "2-D speed-up");
  for (const auto& name : backends)
    for (const char* dir : {"up", "down"}) {
      const double rows = bench::median(g_ms[name + "/" + dir + "/rows"]);
      const double pitched = bench::median(g_ms[name + "/" + dir + "/2d"]);
      if (rows == 0 || pitched == 0) continue;  // filtered out
      std::printf("%-10s %-5s %12.2f %12.2f %13.2fx\n", name.c_str(), dir, rows, pitched, rows / pitched);
    }
  return 0;
}
