// OpenCL backend through the Bridge, against raw OpenCL in the same process:
// asynchronous uploads of 256 MiB in 256 KiB and 4 MiB chunks, 4 copies in
// flight, each ring range released as its copy completes; versus the same
// clEnqueueWriteBuffer calls made directly, from a mapped
// CL_MEM_ALLOC_HOST_PTR buffer into the same number of device buffers, 4 in
// flight, each waited for through its event. Each repetition runs the two
// back to back; the table gives medians and their ratio.
//
// Skips (exit 0, saying why) where there is no OpenCL device. Environment:
// OPENCL_BENCH_BYTES (default 256 MiB), OPENCL_BENCH_REPS (5). No timed
// assertions: the figures are for reading.

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "backends/opencl/opencl_api.hpp"
#include "bench_util.hpp"
#include "devbridge/backends/opencl.hpp"
#include "devbridge/bridge.hpp"

namespace {

using namespace devbridge;
using namespace devbridge::opencl::abi;  // OpenCL's names, as cl.h would give them
using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kKiB = 1024;
constexpr std::size_t kInflight = 4;
constexpr std::size_t kDeviceBuffers = 8;
const std::uint64_t kChunks[] = {256 * kKiB, 4096 * kKiB};

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

void require(cl_int result, const char* call) {
  if (result != CL_SUCCESS) throw std::runtime_error(std::string(call) + " failed: " + std::to_string(result));
}

// The bridge side, on device 0:0 (as the raw side): a ring of kInflight
// chunks, kDeviceBuffers allocations.
double bridge_upload(std::uint64_t total, std::uint64_t chunk) {
  Bridge bridge(opencl::make_opencl_backend(opencl::Options{.platform = 0, .device = 0}),
                BridgeOptions{.ring_bytes = kInflight * chunk});
  std::vector<DeviceHandle> targets;
  for (std::size_t i = 0; i < kDeviceBuffers; ++i)
    targets.push_back(bridge.alloc_device(ObjectSpec{chunk, 64, DType::UInt8, ShapeKind::Vector}, chunk));
  std::deque<std::pair<HostRange, CopyEvent>> inflight;
  const auto retire_oldest = [&] {
    if (bridge.wait(inflight.front().second).state != CopyState::Completed)
      throw std::runtime_error("bridge upload did not complete");
    bridge.release_host(inflight.front().first);
    inflight.pop_front();
  };
  const auto start = Clock::now();
  for (std::uint64_t offset = 0, i = 0; offset < total; offset += chunk, ++i) {
    if (inflight.size() == kInflight) retire_oldest();
    const HostRange range = bridge.reserve(chunk);
    inflight.emplace_back(
        range, bridge.host_to_device(range, DeviceRange{targets[i % kDeviceBuffers], 0, chunk}, CopyMode::Async));
  }
  while (!inflight.empty()) retire_oldest();
  return seconds_since(start);
}

// The raw side: device 0:0, with the context, in-order queue and mapped ring
// the backend makes.
double raw_upload(std::uint64_t total, std::uint64_t chunk) {
  const auto& cl = opencl::detail::api();
  cl_platform_id platform;
  cl_device_id device;
  require(cl.clGetPlatformIDs(1, &platform, nullptr), "clGetPlatformIDs");
  require(cl.clGetDeviceIDs(platform, CL_DEVICE_TYPE_ALL, 1, &device, nullptr), "clGetDeviceIDs");
  cl_int result = CL_SUCCESS;
  cl_context context = cl.clCreateContext(nullptr, 1, &device, nullptr, nullptr, &result);
  require(result, "clCreateContext");
  cl_command_queue queue = cl.clCreateCommandQueue(context, device, 0, &result);
  require(result, "clCreateCommandQueue");
  const std::uint64_t ring_bytes = kInflight * chunk;
  cl_mem ring = cl.clCreateBuffer(context, CL_MEM_READ_WRITE | CL_MEM_ALLOC_HOST_PTR, ring_bytes, nullptr, &result);
  require(result, "clCreateBuffer(ring)");
  auto* host = static_cast<std::byte*>(cl.clEnqueueMapBuffer(queue, ring, CL_TRUE, CL_MAP_READ | CL_MAP_WRITE, 0,
                                                             ring_bytes, 0, nullptr, nullptr, &result));
  require(result, "clEnqueueMapBuffer");
  std::memset(host, 0x5A, ring_bytes);
  std::vector<cl_mem> targets;
  for (std::size_t i = 0; i < kDeviceBuffers; ++i) {
    targets.push_back(cl.clCreateBuffer(context, CL_MEM_READ_WRITE, chunk, nullptr, &result));
    require(result, "clCreateBuffer(device)");
  }
  std::deque<cl_event> inflight;
  const auto retire_oldest = [&] {
    require(cl.clWaitForEvents(1, &inflight.front()), "clWaitForEvents");
    cl.clReleaseEvent(inflight.front());
    inflight.pop_front();
  };
  const auto start = Clock::now();
  for (std::uint64_t offset = 0, i = 0; offset < total; offset += chunk, ++i) {
    if (inflight.size() == kInflight) retire_oldest();
    cl_event done = nullptr;
    require(cl.clEnqueueWriteBuffer(queue, targets[i % kDeviceBuffers], CL_FALSE, 0, chunk,
                                    host + (i % kInflight) * chunk, 0, nullptr, &done),
            "clEnqueueWriteBuffer");
    require(cl.clFlush(queue), "clFlush");
    inflight.push_back(done);
  }
  while (!inflight.empty()) retire_oldest();
  const double seconds = seconds_since(start);
  for (cl_mem target : targets) cl.clReleaseMemObject(target);
  cl.clEnqueueUnmapMemObject(queue, ring, host, 0, nullptr, nullptr);
  cl.clFinish(queue);
  cl.clReleaseMemObject(ring);
  cl.clReleaseCommandQueue(queue);
  cl.clReleaseContext(context);
  return seconds;
}

struct Row {
  std::uint64_t chunk = 0;
  bool warmed_up = false;  // first use of each side (contexts, pages) happens once, untimed
  std::vector<double> bridge_gbps, raw_gbps, ratios;
};

}  // namespace

int main(int argc, char** argv) {
  const std::uint64_t total = bench::env_u64("OPENCL_BENCH_BYTES", 256ull << 20);
  const int reps = static_cast<int>(bench::env_u64("OPENCL_BENCH_REPS", 5));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;

  const opencl::Probe probe = opencl::probe();
  if (!probe.available) {
    std::printf("opencl_copy: skipped: %s\n", probe.reason.c_str());
    return 0;
  }

  std::vector<Row> rows;
  for (const std::uint64_t chunk : kChunks) rows.push_back(Row{chunk, false, {}, {}, {}});
  for (Row& row : rows) {
    const std::string name = "opencl_upload_vs_raw/" + std::to_string(row.chunk / kKiB) + "KiB";
    benchmark::RegisterBenchmark(name.c_str(),
                                 [&row, total](benchmark::State& state) {
                                   if (!row.warmed_up) {
                                     (void)bridge_upload(total / 8, row.chunk);
                                     (void)raw_upload(total / 8, row.chunk);
                                     row.warmed_up = true;
                                   }
                                   for (auto _ : state) {
                                     const double bridge = bridge_upload(total, row.chunk);
                                     const double raw = raw_upload(total, row.chunk);
                                     state.SetIterationTime(bridge);
                                     row.bridge_gbps.push_back(static_cast<double>(total) / bridge / 1e9);
                                     row.raw_gbps.push_back(static_cast<double>(total) / raw / 1e9);
                                     row.ratios.push_back(raw / bridge);
                                   }
                                 })
        ->Iterations(1)
        ->Repetitions(reps)
        ->ReportAggregatesOnly(true)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();

  std::printf("\n== OpenCL backend vs raw OpenCL (same process) ==\n");
  const std::string device =
      opencl::make_opencl_backend(opencl::Options{.platform = 0, .device = 0})->describe().device_name;
  std::printf(
      "device 0:0 (%s); upload %llu MiB per run, %zu copies in flight, median of %d paired runs; GB = 1e9 bytes\n",
      device.c_str(), static_cast<unsigned long long>(total >> 20), kInflight, reps);
  std::printf("chunk     | bridge async GB/s | raw OpenCL GB/s | ratio (bridge/raw)\n");
  std::printf("----------+-------------------+-----------------+-------------------\n");
  for (const Row& row : rows) {
    if (row.ratios.empty()) continue;  // filtered out
    std::printf("%5llu KiB | %17.2f | %15.2f | %18.3f\n", static_cast<unsigned long long>(row.chunk / kKiB),
                bench::median(row.bridge_gbps), bench::median(row.raw_gbps), bench::median(row.ratios));
  }
  return 0;
}
