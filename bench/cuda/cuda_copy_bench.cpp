// Upload, download and duplex throughput through the bridge on the CUDA
// backend, against raw cuMemcpy*Async on the same page-locked memory (the
// bridge's own ring), the same device buffers and the same chunk sizes.
//
//   cuda_copy_bench [--chunks-mib 1,4,16,64] [--bytes-mib 2048] [--repeats 5]
//                   [--ring-mib 512] [--json PATH] [--check] [--require-gpu]
//
// Each run moves --bytes-mib per direction in chunks, keeping every slot of
// the ring busy (a slot is reused once its previous copy completed). The
// bridge path is the public API (host_to_device / device_to_host, Async,
// wait); the raw path enqueues the same chunks on two non-blocking streams
// of the same context and synchronises once at the end. Figures are medians
// of --repeats runs after one warm-up, in GB/s (1e9 bytes/s); duplex counts
// the bytes of both directions.
//
// --check applies the acceptance bars of issue 5 and exits 1 when one fails:
// bridge >= 0.95 x raw for chunks of 4 MiB and up (each direction and
// duplex), and bridge duplex >= 1.6 x the mean of bridge upload and download.
// Without a usable GPU it prints why and exits 0 (77 with --require-gpu).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backends/cuda/cuda_driver.hpp"
#include "devbridge/backends/cuda.hpp"
#include "devbridge/bridge.hpp"
#include "devbridge/consumer_names.hpp"

namespace {

using namespace devbridge;
using devbridge::cuda::detail::CU_STREAM_NON_BLOCKING;
using devbridge::cuda::detail::CUcontext;
using devbridge::cuda::detail::CUDA_SUCCESS;
using devbridge::cuda::detail::CUdeviceptr;
using devbridge::cuda::detail::CUresult;
using devbridge::cuda::detail::CUstream;
using Clock = std::chrono::steady_clock;
constexpr std::uint64_t kMiB = 1ull << 20;

struct Options {
  std::vector<std::uint64_t> chunks_mib{1, 4, 16, 64};
  std::uint64_t bytes_mib = 2048;
  int repeats = 5;
  std::uint64_t ring_mib = 512;
  std::string json_path;
  bool check = false;
  bool require_gpu = false;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "cuda_copy_bench: %s\nusage: cuda_copy_bench [--chunks-mib 1,4,16,64] [--bytes-mib N] "
               "[--repeats N] [--ring-mib N] [--json PATH] [--check] [--require-gpu]\n",
               why.c_str());
  std::exit(2);
}

std::uint64_t parse_number(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || value == 0) usage(flag + ": '" + text + "' is not a positive integer");
  return value;
}

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--chunks-mib") {
      options.chunks_mib.clear();
      std::stringstream list(value());
      for (std::string item; std::getline(list, item, ',');) options.chunks_mib.push_back(parse_number(flag, item));
    } else if (flag == "--bytes-mib") {
      options.bytes_mib = parse_number(flag, value());
    } else if (flag == "--repeats") {
      options.repeats = static_cast<int>(parse_number(flag, value()));
    } else if (flag == "--ring-mib") {
      options.ring_mib = parse_number(flag, value());
    } else if (flag == "--json") {
      options.json_path = value();
    } else if (flag == "--check") {
      options.check = true;
    } else if (flag == "--require-gpu") {
      options.require_gpu = true;
    } else {
      usage("unknown option " + flag);
    }
  }
  for (std::uint64_t chunk : options.chunks_mib) {
    if (2 * chunk > options.ring_mib) usage("a chunk of " + std::to_string(chunk) + " MiB needs --ring-mib >= " +
                                            std::to_string(2 * chunk));
  }
  return options;
}

enum class Mode { Upload, Download, Duplex };
const char* mode_name(Mode mode) {
  switch (mode) {
    case Mode::Upload: return "upload";
    case Mode::Download: return "download";
    case Mode::Duplex: return "duplex";
  }
  return "?";
}

// One chunk size's slots: `slots` host ranges per direction in the ring,
// each paired with the same-offset chunk of that direction's device buffer.
struct Slots {
  std::uint64_t chunk = 0;
  std::vector<HostRange> up_host;
  std::vector<HostRange> down_host;
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2.0;
}

class Bench {
 public:
  Bench(const Options& options, Bridge& bridge)
      : options_(options), bridge_(bridge), driver_(cuda::detail::driver()),
        context_(static_cast<CUcontext>(cuda::context_of(bridge.backend()))) {
    half_ring_ = options.ring_mib * kMiB / 2;
    const ObjectSpec spec{half_ring_, 4096, DType::UInt8, ShapeKind::Tensor};
    up_device_ = bridge.alloc_device(spec, half_ring_);
    down_device_ = bridge.alloc_device(spec, half_ring_);
    up_address_ = address_of(up_device_);
    down_address_ = address_of(down_device_);

    check(driver_.cuCtxPushCurrent_v2(context_), "cuCtxPushCurrent");
    check(driver_.cuStreamCreate(&raw_up_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    check(driver_.cuStreamCreate(&raw_down_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    CUcontext popped = nullptr;
    driver_.cuCtxPopCurrent_v2(&popped);
  }

  ~Bench() {
    CUcontext popped = nullptr;
    if (driver_.cuCtxPushCurrent_v2(context_) == CUDA_SUCCESS) {
      driver_.cuStreamDestroy_v2(raw_up_);
      driver_.cuStreamDestroy_v2(raw_down_);
      driver_.cuCtxPopCurrent_v2(&popped);
    }
  }

  Slots reserve(std::uint64_t chunk) {
    Slots slots;
    slots.chunk = chunk;
    const std::uint64_t count = half_ring_ / chunk;
    std::mt19937_64 random(chunk);
    for (std::uint64_t i = 0; i < count; ++i) {
      for (auto* list : {&slots.up_host, &slots.down_host}) {
        const HostRange range = bridge_.reserve(chunk, 4096);
        // Random bytes, so nothing moves zeros a clever path could skip.
        auto bytes = bridge_.host_bytes(range);
        for (std::size_t at = 0; at + 8 <= bytes.size(); at += 4096) {
          const std::uint64_t word = random();
          std::memcpy(bytes.data() + at, &word, 8);
        }
        list->push_back(range);
      }
    }
    return slots;
  }

  void release(const Slots& slots) {
    for (const auto* list : {&slots.up_host, &slots.down_host}) {
      for (const HostRange& range : *list) bridge_.release_host(range);
    }
  }

  // Seconds to move the run's bytes through the bridge.
  double bridge_run(const Slots& slots, Mode mode) {
    const std::uint64_t chunks = options_.bytes_mib * kMiB / slots.chunk;
    const std::size_t count = slots.up_host.size();
    std::vector<std::optional<CopyEvent>> up_busy(count);
    std::vector<std::optional<CopyEvent>> down_busy(count);
    auto settle = [&](std::optional<CopyEvent>& busy) {
      if (!busy) return;
      const CopyStatus status = bridge_.wait(*busy);
      if (status.state != CopyState::Completed)
        throw std::runtime_error("bridge copy did not complete: " + status.message);
      busy.reset();
    };
    const auto start = Clock::now();
    for (std::uint64_t n = 0; n < chunks; ++n) {
      const std::size_t slot = n % count;
      const std::uint64_t offset = slot * slots.chunk;
      if (mode != Mode::Download) {
        settle(up_busy[slot]);
        up_busy[slot] = bridge_.host_to_device(slots.up_host[slot], DeviceRange{up_device_, offset, slots.chunk},
                                               CopyMode::Async);
      }
      if (mode != Mode::Upload) {
        settle(down_busy[slot]);
        down_busy[slot] = bridge_.device_to_host(DeviceRange{down_device_, offset, slots.chunk},
                                                 slots.down_host[slot], CopyMode::Async);
      }
    }
    for (auto& busy : up_busy) settle(busy);
    for (auto& busy : down_busy) settle(busy);
    return std::chrono::duration<double>(Clock::now() - start).count();
  }

  // Seconds to move the same chunks with cuMemcpy*Async alone.
  double raw_run(const Slots& slots, Mode mode) {
    const std::uint64_t chunks = options_.bytes_mib * kMiB / slots.chunk;
    const std::size_t count = slots.up_host.size();
    std::vector<std::byte*> up_host(count);
    std::vector<std::byte*> down_host(count);
    for (std::size_t i = 0; i < count; ++i) {
      up_host[i] = bridge_.host_bytes(slots.up_host[i]).data();
      down_host[i] = bridge_.host_bytes(slots.down_host[i]).data();
    }
    check(driver_.cuCtxPushCurrent_v2(context_), "cuCtxPushCurrent");
    const auto start = Clock::now();
    for (std::uint64_t n = 0; n < chunks; ++n) {
      const std::size_t slot = n % count;
      const std::uint64_t offset = slot * slots.chunk;
      if (mode != Mode::Download)
        check(driver_.cuMemcpyHtoDAsync_v2(up_address_ + offset, up_host[slot], slots.chunk, raw_up_),
              "cuMemcpyHtoDAsync");
      if (mode != Mode::Upload)
        check(driver_.cuMemcpyDtoHAsync_v2(down_host[slot], down_address_ + offset, slots.chunk, raw_down_),
              "cuMemcpyDtoHAsync");
    }
    check(driver_.cuStreamSynchronize(raw_up_), "cuStreamSynchronize");
    check(driver_.cuStreamSynchronize(raw_down_), "cuStreamSynchronize");
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    CUcontext popped = nullptr;
    driver_.cuCtxPopCurrent_v2(&popped);
    return seconds;
  }

  double gbps(double seconds, Mode mode) const {
    const double bytes = static_cast<double>(options_.bytes_mib * kMiB) * (mode == Mode::Duplex ? 2.0 : 1.0);
    return bytes / seconds / 1e9;
  }

 private:
  std::uint64_t address_of(DeviceHandle handle) {
    ViewSpec spec;
    spec.dtype = DType::UInt8;
    spec.shape = Dims{static_cast<std::int64_t>(half_ring_)};
    ViewLease lease = bridge_.view(handle, spec);
    return lease->data;
  }

  void check(CUresult result, const char* call) {
    if (result != CUDA_SUCCESS) throw std::runtime_error(driver_.describe_failure(call, result));
  }

  const Options& options_;
  Bridge& bridge_;
  const cuda::detail::Driver& driver_;
  CUcontext context_;
  std::uint64_t half_ring_ = 0;
  DeviceHandle up_device_;
  DeviceHandle down_device_;
  CUdeviceptr up_address_ = 0;
  CUdeviceptr down_address_ = 0;
  CUstream raw_up_ = nullptr;
  CUstream raw_down_ = nullptr;
};

struct Row {
  std::uint64_t chunk_mib;
  Mode mode;
  double bridge_gbps;
  double raw_gbps;
  double bridge_best;
  double raw_best;
};

std::string json_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') out.push_back('\\');
    if (static_cast<unsigned char>(c) >= 0x20) out.push_back(c);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  // Line by line even into a pipe, so a run cut short still shows its progress.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const Options options = parse(argc, argv);
  const cuda::Probe probe = cuda::probe();
  if (!probe.available) {
    std::printf("cuda_copy_bench: skipped: CUDA unavailable: %s\n", probe.reason.c_str());
    return options.require_gpu ? 77 : 0;
  }

  try {
    BridgeOptions bridge_options;
    // Slack beyond the slots, so the ring never has to be filled to its last byte.
    bridge_options.ring_bytes = options.ring_mib * kMiB + 4 * kMiB;
    Bridge bridge(cuda::make_cuda_backend(), bridge_options);
    const BackendInfo info = bridge.backend_info();
    std::printf("cuda_copy_bench: %s (%s), %s\n", info.device_name.c_str(),
                tinygrad_device(info.device_kind, info.device_ordinal).c_str(), info.notes.c_str());
    std::printf("  %llu MiB per direction per run, median of %d runs after a warm-up, ring %llu MiB page-locked\n\n",
                static_cast<unsigned long long>(options.bytes_mib), options.repeats,
                static_cast<unsigned long long>(options.ring_mib));

    Bench bench(options, bridge);
    std::vector<Row> rows;
    for (std::uint64_t chunk_mib : options.chunks_mib) {
      const Slots slots = bench.reserve(chunk_mib * kMiB);
      for (Mode mode : {Mode::Upload, Mode::Download, Mode::Duplex}) {
        (void)bench.bridge_run(slots, mode);  // warm-up: first-touch, DMA setup, event pool
        (void)bench.raw_run(slots, mode);
        std::vector<double> bridge_rates;
        std::vector<double> raw_rates;
        // Interleaved, so drift (clocks, other load) hits both alike.
        for (int r = 0; r < options.repeats; ++r) {
          bridge_rates.push_back(bench.gbps(bench.bridge_run(slots, mode), mode));
          raw_rates.push_back(bench.gbps(bench.raw_run(slots, mode), mode));
        }
        rows.push_back(Row{chunk_mib, mode, median(bridge_rates), median(raw_rates),
                           *std::max_element(bridge_rates.begin(), bridge_rates.end()),
                           *std::max_element(raw_rates.begin(), raw_rates.end())});
      }
      bench.release(slots);
      std::printf("  %3llu MiB chunks measured\n", static_cast<unsigned long long>(chunk_mib));
    }
    std::printf("\n");

    std::printf("| chunk | direction | bridge GB/s | raw cuMemcpyAsync GB/s | bridge / raw |\n");
    std::printf("|------:|-----------|------------:|-----------------------:|-------------:|\n");
    for (const Row& row : rows) {
      std::printf("| %3llu MiB | %-8s | %11.2f | %22.2f | %12.3f |\n", static_cast<unsigned long long>(row.chunk_mib),
                  mode_name(row.mode), row.bridge_gbps, row.raw_gbps, row.bridge_gbps / row.raw_gbps);
    }

    // The bars of issue 5.
    std::vector<std::string> failures;
    std::vector<std::string> checks;
    for (const Row& row : rows) {
      if (row.chunk_mib < 4) continue;
      const double ratio = row.bridge_gbps / row.raw_gbps;
      const std::string what = std::to_string(row.chunk_mib) + " MiB " + mode_name(row.mode) +
                               ": bridge/raw " + std::to_string(ratio).substr(0, 5) + " (>= 0.95)";
      checks.push_back(what);
      if (ratio < 0.95) failures.push_back(what);
    }
    for (std::uint64_t chunk_mib : options.chunks_mib) {
      if (chunk_mib < 4) continue;
      double up = 0, down = 0, duplex = 0;
      for (const Row& row : rows) {
        if (row.chunk_mib != chunk_mib) continue;
        (row.mode == Mode::Upload ? up : row.mode == Mode::Download ? down : duplex) = row.bridge_gbps;
      }
      const double factor = duplex / ((up + down) / 2);
      const std::string what = std::to_string(chunk_mib) + " MiB duplex: " + std::to_string(factor).substr(0, 5) +
                               "x one direction (>= 1.6)";
      checks.push_back(what);
      if (factor < 1.6) failures.push_back(what);
    }
    std::printf("\nchecks (chunks >= 4 MiB):\n");
    for (const std::string& c : checks) {
      const bool failed = std::find(failures.begin(), failures.end(), c) != failures.end();
      std::printf("  %s %s\n", failed ? "FAIL" : "ok  ", c.c_str());
    }

    if (!options.json_path.empty()) {
      std::ofstream json(options.json_path);
      json << "{\n  \"device\": \"" << json_escape(info.device_name) << "\",\n  \"notes\": \""
           << json_escape(info.notes) << "\",\n  \"bytes_per_run\": " << options.bytes_mib * kMiB
           << ",\n  \"repeats\": " << options.repeats << ",\n  \"rows\": [\n";
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const Row& row = rows[i];
        json << "    {\"chunk_mib\": " << row.chunk_mib << ", \"direction\": \"" << mode_name(row.mode)
             << "\", \"bridge_gbps\": " << row.bridge_gbps << ", \"raw_gbps\": " << row.raw_gbps
             << ", \"bridge_best_gbps\": " << row.bridge_best << ", \"raw_best_gbps\": " << row.raw_best << "}"
             << (i + 1 < rows.size() ? ",\n" : "\n");
      }
      json << "  ],\n  \"failures\": [";
      for (std::size_t i = 0; i < failures.size(); ++i)
        json << (i ? ", " : "") << "\"" << json_escape(failures[i]) << "\"";
      json << "]\n}\n";
      if (!json) {
        std::fprintf(stderr, "cuda_copy_bench: cannot write %s\n", options.json_path.c_str());
        return 1;
      }
    }
    if (options.check && !failures.empty()) {
      std::printf("\ncuda_copy_bench: %zu check(s) failed\n", failures.size());
      return 1;
    }
    return 0;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "cuda_copy_bench: %s\n", error.what());
    return 1;
  }
}
