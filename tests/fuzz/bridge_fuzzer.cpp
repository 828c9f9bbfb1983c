// libFuzzer target: decodes the input into a sequence of Bridge operations
// over the fake backend (allocations, ring reservations, sync and async
// copies, completions ok and failed, forged completions, events and handles,
// steps, axpy, views, fault injection including during restart and close,
// restarts to valid and invalid generations, close, hostile sizes, fences:
// held launches, views and steps ended after blocked consumer queues,
// registered host memory and allocations adopted from it) and
// checks every outcome against the reference model (tests/model). Any
// disagreement aborts with the operation trace; ASan and UBSan catch the rest.
//
// Input layout: 3 configuration bytes (ring size; in-flight budget (bits
// 0-1), which leases finish ends after a consumer queue (bits 2-6) and
// whether leases outlive the bridge (bit 7); failed-record limit and the
// writes-under-view policy), then 9 bytes per
// operation (tests/model/harness.hpp: Op). tests/fuzz/make_corpus.py writes
// the seed corpus in this format.
//
// DEVBRIDGE_MODEL_RELAX=rank,ring,stride,closeview,retained (environment; see
// tests/model/bridge_model.hpp, Config::relax) lets a long run look past known
// findings.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <spdlog/spdlog.h>

#include "harness.hpp"

namespace {

devbridge::model::Config g_base;  // relaxations from the environment

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g_base.relax(std::getenv("DEVBRIDGE_MODEL_RELAX"));
  g_base.trace = std::getenv("DEVBRIDGE_MODEL_TRACE") != nullptr;
  // Stale completions, Broken: expected here, and slow to print, unless tracing.
  spdlog::set_level(g_base.trace ? spdlog::level::debug : spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace devbridge::model;
  if (size < 3) return 0;
  static const std::uint64_t rings[] = {4096, 8192, 1024, 16384, 1000, 256, 0, ~0ull};
  static const std::uint64_t budgets[] = {0, 256, 1000, 4096};
  static const std::uint32_t limits[] = {1024, 1, 2, 3, 1024, 0};
  Config config = g_base;
  config.backend = BackendKind::Fake;
  config.fake_memory = 1u << 20;
  config.ring_bytes = rings[data[0] % 8];
  if (config.ring_bytes == ~0ull && (data[0] & 0x80)) config.ring_bytes -= 4095;  // the other wrap-around
  if (config.ring_bytes > (1ull << 40) && !config.hostile_rings) return 0;
  config.inflight_budget_bytes = budgets[data[1] % 4];
  config.failed_record_limit = limits[data[2] % 6];
  using devbridge::WritesUnderView;
  static const WritesUnderView writes[] = {WritesUnderView::Allow, WritesUnderView::Refuse, WritesUnderView::Wait};
  config.writes_under_view = writes[data[2] / 6 % 3];
  const bool leases_outlive_bridge = data[1] & 0x80;
  const auto end_after_queue = static_cast<std::uint8_t>(data[1] >> 2 & 0x1f);
  data += 3;
  size -= 3;
  try {
    Harness harness(config);
    if (!harness.constructed()) return 0;
    constexpr std::size_t kMaxOps = 256;
    for (std::size_t n = 0; size >= kOpBytes && n < kMaxOps; ++n, data += kOpBytes, size -= kOpBytes)
      harness.step(decode_op(data));
    harness.finish(leases_outlive_bridge, end_after_queue);
  } catch (const Mismatch& m) {
    std::fprintf(stderr, "\n==== devbridge model mismatch ====\n%s\n", m.what());
    std::abort();
  }
  return 0;
}
