// A rapidcheck state-machine test of Bridge: random sequences of operations
// (tests/model/harness.hpp: allocations, ring reservations, sync and async
// copies, completions ok and failed, forged events and handles, steps, axpy,
// views, host leases, registered host memory (copies to and from it,
// unregistering, regions retained past a restart or close for an adopted
// allocation), host memory adopted read-only as allocations, restarts to
// valid and invalid generations, close, and
// on the fake backend fault injection, including a quiesce that fails during
// restart and close, and fences: held launches, views and steps ended after a
// blocked consumer queue, fences passed in and out of order, restart orphaning
// and close abandoning what they hold) run against a real Bridge and the reference model
// (tests/model/bridge_model.hpp) side by side. Every refusal's error kind,
// every returned range and event, byte contents, pins, the statistics and the
// backend's live allocation count must agree; a disagreement fails with the
// shrunk sequence of operations.
//
// On the host backend the copy engine is held, so async copies and launches
// (and their fences) stay pending until the harness settles them with bounded
// waits; faults are injected only on the fake.
#include <gtest/gtest.h>

#ifdef DEVBRIDGE_HAVE_RAPIDCHECK
#include <rapidcheck.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "harness.hpp"

namespace {

using devbridge::model::BackendKind;
using devbridge::WritesUnderView;
using devbridge::model::Config;
using devbridge::model::Harness;
using devbridge::model::Op;
using devbridge::model::OpKind;

rc::Gen<Op> gen_op(BackendKind backend) {
  // Weights: the state-building operations (alloc, reserve, copies) often,
  // restart and close rarely, so sequences get deep before they end.
  std::vector<std::pair<int, OpKind>> weights = {
      {18, OpKind::Alloc},     {3, OpKind::Free},         {3, OpKind::Release},      {3, OpKind::Extent},
      {18, OpKind::Reserve},   {6, OpKind::ReleaseHost},  {9, OpKind::WriteRing},    {6, OpKind::ReadRing},
      {18, OpKind::HostToDevice}, {15, OpKind::DeviceToHost}, {12, OpKind::Complete},  {3, OpKind::CompleteAll},
      {6, OpKind::Poll},      {9, OpKind::CopyStatus},   {6, OpKind::Wait},         {6, OpKind::SafeToRelease},
      {3, OpKind::BeginStep}, {3, OpKind::EndStep},      {6, OpKind::Axpy},         {9, OpKind::View},
      {6, OpKind::EndView},   {1, OpKind::Restart},      {1, OpKind::Close},        {6, OpKind::ReadDevice},
      {3, OpKind::LeaseHost}, {3, OpKind::EndHostLease}, {8, OpKind::HoldLaunches}, {8, OpKind::EndViewAfter},
      {3, OpKind::EndStepAfter}, {12, OpKind::PitchedCopy},
      {6, OpKind::RegisterHost}, {3, OpKind::UnregisterHost}, {8, OpKind::RegionCopy}, {4, OpKind::RegionPitchedCopy},
      {6, OpKind::AdoptHost},    {4, OpKind::RegionBytes},
  };
  if (backend == BackendKind::Fake) {
    weights.push_back({6, OpKind::Inject});
    weights.push_back({3, OpKind::ReportCompletion});
    weights.push_back({8, OpKind::BlockQueue});
    weights.push_back({3, OpKind::SignalFence});
  }
  std::size_t total = 0;
  for (auto [n, k] : weights) total += static_cast<std::size_t>(n);
  // An index into the weighted list (shrinks toward the first kinds).
  auto kind = rc::gen::map(rc::gen::inRange<std::size_t>(0, total), [weights](std::size_t x) {
    for (auto [n, k] : weights) {
      if (x < static_cast<std::size_t>(n)) return k;
      x -= static_cast<std::size_t>(n);
    }
    return weights.back().second;
  });
  return rc::gen::apply(
      [](OpKind k, std::vector<std::uint8_t> p) {
        Op op;
        op.kind = k;
        for (std::size_t i = 0; i < 8; ++i) op.p[i] = p[i];
        return op;
      },
      kind, rc::gen::container<std::vector<std::uint8_t>>(8, rc::gen::arbitrary<std::uint8_t>()));
}

Config gen_config(BackendKind backend) {
  Config config;
  config.relax(std::getenv("DEVBRIDGE_MODEL_RELAX"));  // see Config::relax
  config.backend = backend;
  config.ring_bytes = *rc::gen::weightedElement<std::uint64_t>({{6, 4096}, {3, 1024}, {3, 8192}, {1, 1000}, {1, ~0ull}});
  if (!config.hostile_rings && config.ring_bytes == ~0ull) config.ring_bytes = 4096;
  config.inflight_budget_bytes = *rc::gen::element<std::uint64_t>(0, 0, 1000, 256, 512, 2048);
  config.failed_record_limit = *rc::gen::element<std::uint32_t>(1024, 1, 2, 3);
  config.writes_under_view = *rc::gen::element(WritesUnderView::Refuse, WritesUnderView::Allow, WritesUnderView::Wait);
  return config;
}

void run(BackendKind backend) {
  Harness harness(gen_config(backend));
  if (!harness.constructed()) return;
  const auto ops = *rc::gen::scale(2.0, rc::gen::container<std::vector<Op>>(gen_op(backend)));
  const bool leases_outlive_bridge = *rc::gen::arbitrary<bool>();
  // Which leases finish ends after a consumer queue (see Harness::finish).
  const auto end_after_queue = *rc::gen::weightedElement<std::uint8_t>({{3, 0}, {1, 0x1f}, {1, 0x05}});
  for (const auto& op : ops) harness.step(op);
  // How deep the sequences got (printed with the result).
  const auto& m = harness.model();
  RC_CLASSIFY(m.events.size() >= 4, "4+ copies");
  RC_CLASSIFY(ops.size() >= 100, "100+ operations");
  RC_CLASSIFY(m.failed > 0, "a copy failed");
  RC_CLASSIFY(m.restarts > 0, "restarted");
  RC_CLASSIFY(m.closed, "closed");
  RC_CLASSIFY(m.broken, "broken");
  RC_CLASSIFY(m.fences_recorded > 0, "a fence held memory");
  RC_CLASSIFY(!m.drops.empty(), "fences pending");
  RC_CLASSIFY(m.abandoned_fences > 0, "fences abandoned");
  RC_CLASSIFY(std::any_of(m.allocs.begin(), m.allocs.end(), [](const auto& a) { return a.adopted(); }), "adopted");
  RC_CLASSIFY(m.regions_retained > 0, "a region retained");
  harness.finish(leases_outlive_bridge, end_after_queue);
}

// rc::check, but each round from its own seed (the configured one, then
// stepped per round): rc::check uses the one seed of the configuration, so
// its rounds would all replay the same sequences. RC_PARAMS="seed=S" and the
// round printed with a failure reproduce it.
template <class Testable>
bool check_round(const std::string& description, int round, Testable&& testable) {
  auto params = rc::detail::configuration().testParams;  // its message first, as rc::check does
  params.seed += static_cast<std::uint64_t>(round) * 0x9E3779B97F4A7C15ull;
  std::cerr << "\n- " << description << " (round " << round << ")" << std::endl;
  rc::detail::TestMetadata metadata;
  metadata.id = description;
  metadata.description = description;
  const auto result = rc::detail::checkTestable(std::forward<Testable>(testable), metadata, params);
  rc::detail::printResultMessage(result, std::cerr);
  std::cerr << std::endl;
  return result.template is<rc::detail::SuccessResult>();
}

}  // namespace

// Stale completions, broken bridges and failed quiesces are the point here:
// their log lines are muted while the properties run.
class BridgeStateMachine : public ::testing::Test {
 protected:
  void SetUp() override {
    level_ = spdlog::get_level();
    spdlog::set_level(spdlog::level::off);
  }
  void TearDown() override { spdlog::set_level(level_); }

 private:
  spdlog::level::level_enum level_ = spdlog::level::info;
};

// Several rounds of rapidcheck's 100 sequences each (RC_PARAMS=max_success=N
// changes the round size): well under a second per backend in Release, a few
// seconds under the sanitizers.
#if defined(__SANITIZE_THREAD__)  // GCC
#define DEVBRIDGE_UNDER_TSAN 1
#elif defined(__has_feature)  // clang
#if __has_feature(thread_sanitizer)
#define DEVBRIDGE_UNDER_TSAN 1
#endif
#endif
#ifdef DEVBRIDGE_UNDER_TSAN
constexpr int kFakeRounds = 3;  // ThreadSanitizer is 10-20x slower
constexpr int kHostRounds = 1;
#else
constexpr int kFakeRounds = 8;
constexpr int kHostRounds = 3;
#endif

TEST_F(BridgeStateMachine, FakeBackendAgreesWithTheModel) {
  for (int round = 0; round < kFakeRounds; ++round)
    ASSERT_TRUE(check_round("bridge over the fake backend agrees with the model", round, [] { run(BackendKind::Fake); }));
}

TEST_F(BridgeStateMachine, HostBackendAgreesWithTheModel) {
  for (int round = 0; round < kHostRounds; ++round)
    ASSERT_TRUE(check_round("bridge over the host backend agrees with the model", round, [] { run(BackendKind::Host); }));
}

#endif  // DEVBRIDGE_HAVE_RAPIDCHECK
