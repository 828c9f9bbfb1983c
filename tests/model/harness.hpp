// Drives a real Bridge and the reference model (bridge_model.hpp) with the
// same operations and compares every outcome: the error kind of each refusal,
// returned ranges and events, byte contents (ring and device), pins, the
// statistics, and the backend's live allocation and host block counts.
//
// An operation is 9 bytes (a kind and eight parameters) so that the fuzzer
// decodes them straight from its input and rapidcheck generates them as
// plain values; the harness interprets the parameters against the current
// state (which allocation, which range, which size from a table of hostile
// values), so almost every operation means something.
//
// Single-threaded and never blocking for long: on the fake backend nothing
// completes unless an operation completes it, so the harness never waits
// without a timeout for a pending copy. On the host backend the copy engine is
// held (the host backend's test controls, hold_copies) so pending copies stay pending until the harness
// settles them (lifts the hold and waits, bounded, for each); faults are only
// injected on the fake.
//
// Fences (docs/ARCHITECTURE.md, "Lifetimes on the device"): on the fake a
// launch's fence stays pending while launches are held (HoldLaunches), and a
// view or step ended after a blocked consumer queue holds its memory until
// the queue is unblocked or the fence signalled; the model predicts when the
// bridge notices (the next call that enters it, stats(), an orphan's lease
// ending), so the backend's counts are compared before stats() reaps too.
// On the host backend every launch is held with the copies (its fence pending
// until the harness settles, which also waits until the drop queue is empty);
// consumers there have no queues (Unsupported). Close waits 1 ms for fences.
//
// Registered host memory: the harness owns a small arena (kArenaPages pages,
// 4096-aligned) and registers pages and half pages of it, writable or
// read-only, copies to and from them, and adopts ranges of read-only ones as
// allocations (Bridge::adopt_host). The model knows the arena's bytes, so a
// download from an adopted allocation is checked to read them in place.
//
// A disagreement throws Mismatch with the operation trace.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <span>
#include <thread>
#include <variant>
#include <vector>

#include "forwarding_backend.hpp"
#include "bridge_model.hpp"
#include "trace_validity.hpp"
#include "devbridge/backends/fake.hpp"
#include "devbridge/backends/host.hpp"
#include "devbridge/bridge.hpp"
#include "devbridge/checked.hpp"

namespace devbridge::model {

struct Mismatch : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Forwards to the fake and keeps each allocation, adoption and registration
// it made, so that the memory close abandoned (never freed, by design; an
// abandoned adoption keeps its region registered) can be given back to the
// fake once finish() has checked it.
class RecordingFake final : public testing::ForwardingBackend {
 public:
  struct Made {
    std::map<std::uint64_t, DeviceAllocation> allocations;     // by address
    std::multimap<std::uint64_t, DeviceAllocation> adoptions;  // by address: two adoptions of one range share it
    std::map<const std::byte*, HostBlock> registrations;       // by data (registered memory never overlaps)
  };
  RecordingFake(std::shared_ptr<fake::FakeBackend> fake, std::shared_ptr<Made> made)
      : ForwardingBackend(std::move(fake)), made_(std::move(made)) {}
  DeviceAllocation allocate(std::uint64_t bytes, std::uint64_t alignment) override {
    const DeviceAllocation a = ForwardingBackend::allocate(bytes, alignment);
    made_->allocations[a.address] = a;
    return a;
  }
  void free(const DeviceAllocation& allocation) noexcept override {
    made_->allocations.erase(allocation.address);
    ForwardingBackend::free(allocation);
  }
  HostImport import_host(const ImportRequest& request) override {
    const HostImport imported = ForwardingBackend::import_host(request);
    if (imported.adopted)
      made_->adoptions.emplace(imported.device.address, imported.device);
    else
      made_->registrations[imported.block.data] = imported.block;
    return imported;
  }
  void release_import(const HostImport& imported) noexcept override {
    if (imported.adopted) {
      const auto [first, last] = made_->adoptions.equal_range(imported.device.address);
      for (auto it = first; it != last; ++it)
        if (it->second.token == imported.device.token) {
          made_->adoptions.erase(it);
          break;
        }
    } else {
      made_->registrations.erase(imported.block.data);
    }
    ForwardingBackend::release_import(imported);
  }

 private:
  std::shared_ptr<Made> made_;
};

enum class OpKind : std::uint8_t {
  Alloc,
  Free,
  Release,
  Extent,
  Reserve,
  ReleaseHost,
  WriteRing,
  ReadRing,
  HostToDevice,
  DeviceToHost,
  Complete,     // fake: complete one pending copy (ok or failed), then poll; host: settle
  CompleteAll,  // fake: complete_all, then poll; host: settle
  Poll,
  CopyStatus,
  Wait,
  SafeToRelease,  // safe_to_release_host / host_bytes_valid
  BeginStep,
  EndStep,
  Axpy,
  View,
  EndView,
  Inject,
  Restart,
  Close,
  ReadDevice,
  ReportCompletion,  // fake: a forged completion, then poll
  LeaseHost,
  EndHostLease,
  // Fences. Queues are consumer queues 1-3; after hold, block and signal,
  // p2 & 1 asks stats() (which reaps), else the next call must notice.
  HoldLaunches,   // fake: hold_launches(p0 & 1), lifting passes the launches' fences; holding with p1 & 1
                  // then launches over a float32 allocation (host: that launch; lifting settles)
  EndViewAfter,   // ViewLease::end_after(a consumer queue) (host: Unsupported, the lease stays)
  EndStepAfter,   // end_step(step, a consumer queue) (host: Unsupported, the step stays)
  BlockQueue,     // fake: block (p0 & 1) or unblock (passing its fences) a consumer queue
  SignalFence,    // fake: signal one pending fence, out of its queue's order (or one not pending: false)
  PitchedCopy,    // a pitched 2-D copy either way: rows, row bytes and pitches from p3-p6, some hostile
  // Registered host memory and adoption (appended: the corpus's kind bytes keep their meaning).
  RegisterHost,       // a span of the arena (or a hostile one), writable or read-only (p1 & 1)
  UnregisterHost,
  RegionCopy,         // as HostToDevice / DeviceToHost (p4 & 2: download) with a region's range
  RegionPitchedCopy,  // as PitchedCopy with a region's range
  AdoptHost,          // adopt_host of a region's range, mostly a live read-only one's
  RegionBytes,        // region_bytes: write (p2 & 1, writable regions only) or compare; then region_retained
  // The flight recorder (appended): start it with a ring of 1-64 events (so it
  // wraps), stop it, or dump the trace and the memory snapshot and check them.
  Record,
  Count
};

// y[i] = a * x[i] + b over `count` float32 elements of the model's bytes,
// element by element in order (as both backends run it); a byte the model
// does not know makes its element unknown. Out of line and left without
// coverage hooks by the fuzz presets (tests/fuzz/coverage-ignorelist.txt):
// a launch over megabytes ran millions of instrumented compares, over 30 s
// for one input on a busy machine.
[[gnu::noinline]] inline void axpy_elements(const Byte* x, Byte* y, std::uint64_t count, float a, float b) {
  for (std::uint64_t k = 0; k < count; ++k) {
    const Byte* src = x + 4 * k;
    Byte* dst = y + 4 * k;
    bool known = true;
    std::uint8_t raw[4];
    for (int j = 0; j < 4; ++j) {
      known = known && src[j] != kUnknown;
      raw[j] = static_cast<std::uint8_t>(src[j]);
    }
    float v;
    std::memcpy(&v, raw, 4);
    v = a * v + b;
    std::memcpy(raw, &v, 4);
    for (int j = 0; j < 4; ++j) dst[j] = known && v == v ? Byte{raw[j]} : kUnknown;
  }
}

inline const char* op_name(OpKind k) {
  static const char* names[] = {"alloc",        "free",          "release",   "extent",     "reserve",
                                "release_host", "write_ring",    "read_ring", "h2d",        "d2h",
                                "complete",     "complete_all",  "poll",      "copy_status", "wait",
                                "safe_to_release", "begin_step", "end_step",  "axpy",       "view",
                                "end_view",     "inject",        "restart",   "close",      "read_device",
                                "report_completion", "lease_host", "end_host_lease", "hold_launches",
                                "end_view_after", "end_step_after", "block_queue", "signal_fence",
                                "pitched_copy", "register_host", "unregister_host", "region_copy",
                                "region_pitched_copy", "adopt_host", "region_bytes", "record"};
  static_assert(std::size(names) == static_cast<std::size_t>(OpKind::Count));
  const auto i = static_cast<unsigned>(k);
  return i < static_cast<unsigned>(OpKind::Count) ? names[i] : "?";
}

struct Op {
  OpKind kind = OpKind::Poll;
  std::uint8_t p[8] = {};
};
inline constexpr std::size_t kOpBytes = 9;

inline Op decode_op(const std::uint8_t* data) {
  Op op;
  op.kind = static_cast<OpKind>(data[0] % static_cast<unsigned>(OpKind::Count));
  std::memcpy(op.p, data + 1, 8);
  return op;
}

inline std::string kind_text(ErrorKind k) { return std::string(kind_name(k)); }

// Values a hostile caller gives.
inline std::uint64_t hostile(std::uint8_t p) {
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  static const std::uint64_t table[] = {0, 1, kMax - 1, 1ull << 63, kMax, (1ull << 63) - 1, 1ull << 32, kMax - 4095};
  return table[p % 8];
}

class Harness {
 public:
  // Builds the bridge. Throws Mismatch when construction disagrees with the
  // model; sets constructed() false when the bridge (rightly) refused.
  explicit Harness(const Config& config) {
    m.config = config;
    // The pattern is made once: a fuzzer builds a harness per input, and a
    // byte loop under coverage instrumentation cost a tenth of each run.
    static const std::vector<std::uint8_t> pattern = [] {
      std::vector<std::uint8_t> bytes(kArenaBytes);
      for (std::uint64_t i = 0; i < kArenaBytes; ++i) bytes[i] = static_cast<std::uint8_t>(i * 7 + i / 251);
      return bytes;
    }();
    static const std::vector<Byte> modelled(pattern.begin(), pattern.end());
    m.arena_bytes = modelled;
    std::memcpy(arena(), pattern.data(), kArenaBytes);
    if (config.backend == BackendKind::Fake) {
      fake_ = std::make_shared<fake::FakeBackend>(config.fake_memory);
    } else {
      host_ = host::make_host_backend();
    }
    BridgeOptions options;
    options.generation = 1;
    options.ring_bytes = config.ring_bytes;
    options.inflight_budget_bytes = config.inflight_budget_bytes;
    options.failed_record_limit = config.failed_record_limit;
    options.writes_under_view = config.writes_under_view;
    options.writes_under_view_timeout = std::chrono::nanoseconds(0);
    // Short, so a close with fences that never pass (a blocked consumer
    // queue) abandons their memory at once.
    options.close_fence_timeout = std::chrono::milliseconds(1);
    // Freed memory goes back to the backend at once: its counts are the model's.
    options.caching_pool = CachingPool::Off;
    // Construction refuses a zero ring, and a ring the backend cannot hold.
    const bool hostile_ring = config.ring_bytes > (1ull << 40);
    std::optional<Error> error;
    try {
      bridge_ = std::make_unique<Bridge>(make_backend(), options);
    } catch (const Error& e) {
      error = e;
    }
    if (config.ring_bytes == 0 || config.failed_record_limit == 0) {
      // A bridge that could remember no failure could never report one.
      expect_kind("construct(ring_bytes " + std::to_string(config.ring_bytes) + ", failed_record_limit " +
                      std::to_string(config.failed_record_limit) + ")",
                  Expect::error(ErrorKind::InvalidExtent), error);
      bridge_.reset();
      return;
    }
    if (hostile_ring) {
      expect_kind("construct(ring_bytes " + std::to_string(config.ring_bytes) + ")",
                  Expect::error(ErrorKind::AllocationFailed), error);
      bridge_.reset();
      return;
    }
    expect_kind("construct", Expect::success(), error);
    m.domain = bridge_->domain();
    m.gen = 1;
    m.ring.cap = bridge_->ring_capacity();
    if (m.ring.cap != config.ring_bytes) fail("ring_capacity " + std::to_string(m.ring.cap) + " != ring_bytes");
    m.ring_bytes.assign(m.ring.cap, m.fake() ? kFakeFresh : kUnknown);
    if (m.fake()) {
      for (const auto& c : fake_->calls())
        if (c.call == fake::Call::AllocateHost) ring_block_ = reinterpret_cast<std::byte*>(c.address);
      fake_->clear_calls();
    } else {
      host_raw_->test_controls()->hold_copies(true);
    }
    check_stats();
  }

  bool constructed() const { return bridge_ != nullptr; }
  const Model& model() const { return m; }
  const std::vector<Op>& trace() const { return trace_; }

  ~Harness() {
    // Never throw from here; finish() is where the end is checked.
    leases_.clear();
    host_leases_.clear();
    bridge_.reset();
  }

  void step(const Op& op) {
    if (!bridge_) return;
    trace_.push_back(op);
    run_op(op);
    if (m.config.trace) print_state();
  }

  // One line per operation: what the model and the bridge each hold.
  void print_state() {
    BridgeStats s;
    const bool have_stats = !attempt([&] { s = bridge_->stats(); });
    m.enter_stats();  // stats() reaps
    std::fprintf(stderr,
                 "  #%zu %-17s model: gen %llu%s%s failed-log %zu evicted [%llu,%llu] in-flight %llu ready %zu "
                 "late %zu%s",
                 trace_.size() - 1, op_name(trace_.back().kind), static_cast<unsigned long long>(m.gen),
                 m.broken ? " broken" : "", m.closed ? (m.close_pending ? " close-pending" : " closed") : "",
                 m.failure_log.size(), static_cast<unsigned long long>(m.evicted_lo),
                 static_cast<unsigned long long>(m.evicted_hi), static_cast<unsigned long long>(m.copies_in_flight()),
                 m.ready.size(), m.late_after_quiesce.size(), m.late_released ? " released" : "");
    std::fprintf(stderr, " fences %zu (%llu pending)%s regions %llu adoptions %llu", m.drops.size(),
                 static_cast<unsigned long long>(m.pending_fence_count()), m.launches_held ? " held" : "",
                 static_cast<unsigned long long>(m.held_regions()), static_cast<unsigned long long>(m.backend_adoptions()));
    if (have_stats)
      std::fprintf(stderr, " | bridge: gen %llu%s%s failed %llu evicted %llu in-flight %llu fences %llu abandoned %llu\n",
                   static_cast<unsigned long long>(s.generation), s.broken ? " broken" : "", s.closed ? " closed" : "",
                   static_cast<unsigned long long>(s.failed_records),
                   static_cast<unsigned long long>(s.failed_records_evicted),
                   static_cast<unsigned long long>(s.copies_in_flight),
                   static_cast<unsigned long long>(s.pending_fences),
                   static_cast<unsigned long long>(s.abandoned_fences));
    else
      std::fprintf(stderr, " | bridge: stats() threw\n");
  }

  void run_op(const Op& op) {
    switch (op.kind) {
      case OpKind::Alloc: return do_alloc(op);
      case OpKind::Free: return do_free(op, false);
      case OpKind::Release: return do_free(op, true);
      case OpKind::Extent: return do_extent(op);
      case OpKind::Reserve: return do_reserve(op);
      case OpKind::ReleaseHost: return do_release_host(op);
      case OpKind::WriteRing: return do_ring_bytes(op, true);
      case OpKind::ReadRing: return do_ring_bytes(op, false);
      case OpKind::HostToDevice: return do_copy(op, CopyDirection::HostToDevice);
      case OpKind::DeviceToHost: return do_copy(op, CopyDirection::DeviceToHost);
      case OpKind::PitchedCopy: return do_pitched_copy(op);
      case OpKind::Complete: return do_complete(op, false);
      case OpKind::CompleteAll: return do_complete(op, true);
      case OpKind::Poll: return do_poll();
      case OpKind::CopyStatus: return do_status(op, false);
      case OpKind::Wait: return do_status(op, true);
      case OpKind::SafeToRelease: return do_safe(op);
      case OpKind::BeginStep: return do_begin_step(op);
      case OpKind::EndStep: return do_end_step(op);
      case OpKind::Axpy: return do_axpy(op);
      case OpKind::View: return do_view(op);
      case OpKind::EndView: return do_end_view(op);
      case OpKind::Inject: return do_inject(op);
      case OpKind::Restart: return do_restart(op);
      case OpKind::Close: return do_close();
      case OpKind::ReadDevice: return do_read_device(op);
      case OpKind::ReportCompletion: return do_report(op);
      case OpKind::LeaseHost: return do_lease_host(op);
      case OpKind::EndHostLease: return do_end_host_lease(op);
      case OpKind::HoldLaunches: return do_hold_launches(op);
      case OpKind::EndViewAfter: return do_end_view_after(op);
      case OpKind::EndStepAfter: return do_end_step_after(op);
      case OpKind::BlockQueue: return do_block_queue(op);
      case OpKind::SignalFence: return do_signal_fence(op);
      case OpKind::RegisterHost: return do_register(op);
      case OpKind::UnregisterHost: return do_unregister(op);
      case OpKind::RegionCopy:
        return do_copy(op, op.p[4] & 2 ? CopyDirection::DeviceToHost : CopyDirection::HostToDevice, true);
      case OpKind::RegionPitchedCopy: return do_pitched_copy(op, true);
      case OpKind::AdoptHost: return do_adopt(op);
      case OpKind::RegionBytes: return do_region_bytes(op);
      case OpKind::Record: return do_record(op);
      case OpKind::Count: return;
    }
  }

  // Ends every lease (before or after the bridge goes), closes until the
  // close succeeds, destroys the bridge and checks the backend holds nothing
  // but what close abandoned (memory under a consumer's fence that never
  // passed; on the fake, an abandoned adoption and its region's
  // registration), and on the fake that every fence, adoption and
  // registration was given back. Bit k % 5 of
  // `end_after_queue` ends view lease k after a consumer queue instead
  // (fake): past close, and past the bridge when leases outlive it, so the
  // core's own end settles (and abandons) those fences.
  void finish(bool leases_outlive_bridge, std::uint8_t end_after_queue = 0) {
    if (!bridge_) return;
    trace_.push_back(Op{OpKind::Count, {}});
    end_after_bits_ = end_after_queue;
    if (!leases_outlive_bridge && (m.config.end_views_while_close_pending || !m.close_pending)) end_all_leases();
    // Each failing close consumes one injected quiesce failure; they are few.
    for (int attempt = 0; attempt < 64; ++attempt) {
      const std::size_t before = trace_.size();
      do_close();
      (void)before;
      if (m.closed && !m.close_pending) break;
    }
    if (m.close_pending) fail("close never succeeded");
    if (!leases_outlive_bridge) end_all_leases();
    bridge_.reset();
    maybe_core_ends();
    if (leases_outlive_bridge) end_all_leases();
    if (!core_gone_) fail("the bridge's core outlived its owner and every lease (the model's count)");
    const std::uint64_t allocations = backend_live_allocations();
    const std::uint64_t blocks = backend_live_host_blocks();
    const std::uint64_t abandoned = m.abandoned_allocations();
    if (m.backend_allocations() != abandoned)
      fail("the model still holds " + std::to_string(m.backend_allocations() - abandoned) + " allocation(s) it did not abandon");
    if (allocations != abandoned)
      fail("after close and every lease ended, the backend holds " + std::to_string(allocations) +
           " allocation(s); close abandoned " + std::to_string(abandoned));
    if (blocks != 0) fail("after close and every lease ended, the backend holds " + std::to_string(blocks) + " host block(s)");
    if (fake_ && fake_->live_fences() != 0)
      fail("after the bridge and every lease are gone, the fake holds " + std::to_string(fake_->live_fences()) +
           " fence(s) the bridge never gave back");
    // Adoptions and registrations: none left but an abandoned adoption and
    // the region it keeps registered (held() says which).
    const std::uint64_t abandoned_adoptions = m.abandoned_adoptions();
    if (m.backend_adoptions() != abandoned_adoptions)
      fail("the model still holds " + std::to_string(m.backend_adoptions() - abandoned_adoptions) +
           " adoption(s) it did not abandon");
    if (fake_ && fake_->live_adoptions() != abandoned_adoptions)
      fail("after close and every lease ended, the fake holds " + std::to_string(fake_->live_adoptions()) +
           " adoption(s); close abandoned " + std::to_string(abandoned_adoptions));
    if (fake_ && fake_->live_registrations() != m.held_regions())
      fail("after close and every lease ended, the fake holds " + std::to_string(fake_->live_registrations()) +
           " registration(s); the model " + std::to_string(m.held_regions()) + " (regions of abandoned adoptions)");
    // Checked: now the test gives the abandoned memory back itself
    // (adoptions before the regions they lie in).
    if (fake_) {
      for (const auto& a : m.allocs) {
        if (!a.abandoned || !a.in_backend) continue;
        if (a.adopted()) {
          if (auto it = fake_made_->adoptions.find(a.address); it != fake_made_->adoptions.end()) {
            fake_->release_import(HostImport{.device = it->second, .adopted = true});
            fake_made_->adoptions.erase(it);
          }
        } else if (auto it = fake_made_->allocations.find(a.address); it != fake_made_->allocations.end()) {
          fake_->free(it->second);
        }
      }
      for (std::size_t i = 0; i < m.regions.size(); ++i)
        if (m.held(i))
          if (auto it = fake_made_->registrations.find(arena() + m.regions[i].begin); it != fake_made_->registrations.end())
            fake_->release_import(HostImport{.block = it->second});
    }
  }

  std::string describe_trace() const {
    std::string out;
    for (std::size_t i = 0; i < trace_.size(); ++i) {
      out += "  #";
      out += std::to_string(i);
      out += ' ';
      out += trace_[i].kind == OpKind::Count ? "finish" : op_name(trace_[i].kind);
      for (auto b : trace_[i].p) {
        out += ' ';
        out += std::to_string(b);
      }
      out += '\n';
    }
    return out;
  }

 private:
  // ---- plumbing ----
  std::unique_ptr<Backend> make_backend() {
    if (fake_) return std::make_unique<RecordingFake>(fake_, fake_made_);
    host_shared_ = std::shared_ptr<Backend>(std::move(host_));
    host_raw_ = host_shared_.get();
    return std::make_unique<testing::ForwardingBackend>(host_shared_);
  }

  std::uint64_t backend_live_allocations() const {
    return fake_ ? fake_->live_allocations() : host_raw_->test_controls()->live_allocations();
  }
  std::uint64_t backend_live_host_blocks() const {
    return fake_ ? fake_->live_host_blocks() : *host_raw_->test_controls()->live_host_blocks();
  }

  [[noreturn]] void fail(const std::string& what) const {
    std::string where = trace_.empty() ? std::string("construction")
                                        : "op #" + std::to_string(trace_.size() - 1) + " (" +
                                              (trace_.back().kind == OpKind::Count ? "finish" : op_name(trace_.back().kind)) + ")";
    throw Mismatch(where + ": " + what + "\n" + std::string(m.fake() ? "fake" : "host") + " backend, ring " +
                   std::to_string(m.config.ring_bytes) + ", budget " + std::to_string(m.config.inflight_budget_bytes) +
                   ", failed_record_limit " + std::to_string(m.config.failed_record_limit) + "; trace:\n" +
                   describe_trace());
  }

  template <class F>
  static std::optional<Error> attempt(F&& f) {
    try {
      f();
    } catch (const Error& e) {
      return e;
    }
    return std::nullopt;
  }

  // True when the call succeeded as expected; throws Mismatch otherwise.
  template <class Describe>
  bool expect_kind(const Describe& describe_call, const Expect& x, const std::optional<Error>& got) const {
    if (m.config.trace)
      std::fprintf(stderr, "    %s -> %s\n", describe(describe_call).c_str(), got ? kind_text(got->kind()).c_str() : "ok");
    if (x.ok && !got) return true;
    if (!x.ok && got && x.accepts(got->kind())) return false;
    const std::string call = describe(describe_call);
    if (x.ok) fail(call + ": expected success, got " + kind_text(got->kind()) + " (" + got->what() + ")");
    std::string kinds;
    for (auto k : x.kinds) kinds += (kinds.empty() ? "" : " or ") + kind_text(k);
    if (!got) fail(call + ": expected " + kinds + ", the call succeeded");
    fail(call + ": expected " + kinds + ", got " + kind_text(got->kind()) + " (" + got->what() + ")");
  }

  static std::string describe(const std::string& s) { return s; }
  static std::string describe(const char* s) { return s; }
  template <class F>
  static std::string describe(const F& f) {
    return f();
  }

  static std::string h_text(const DeviceHandle& h) {
    return "{" + std::to_string(h.domain) + "," + std::to_string(h.generation) + "," + std::to_string(h.id) + "}";
  }
  static std::string e_text(const CopyEvent& e) {
    return "{" + std::to_string(e.domain) + "," + std::to_string(e.generation) + "," + std::to_string(e.id) + "}";
  }
  static std::string r_text(const HostRange& r) {
    return "[" + std::to_string(r.offset) + ",+" + std::to_string(r.len) + ")";
  }
  static std::string g_text(const HostRegion& r) {
    return "region {" + std::to_string(r.domain) + "," + std::to_string(r.generation) + "," + std::to_string(r.id) + "}";
  }
  static std::string rr_text(const RegionRange& r) {
    return g_text(r.region) + " [" + std::to_string(r.offset) + ",+" + std::to_string(r.len) + ")";
  }

  static std::string host_text(const HostSide& host) {
    return std::visit([](const auto& r) {
      if constexpr (std::is_same_v<std::decay_t<decltype(r)>, HostRange>) return r_text(r);
      else return rr_text(r);
    }, host);
  }

  // ---- the harness's host memory ----
  struct alignas(4096) Page {
    std::byte bytes[4096];
  };
  std::byte* arena() const { return arena_[0].bytes; }

  // Spans of the arena to register: pages, pairs and halves of them
  // (overlapping one another), and one aligned to 32 bytes only.
  struct ArenaSpan {
    std::uint64_t begin, len;
  };
  static constexpr ArenaSpan kSpans[] = {
      {0, 4096},    {4096, 4096}, {8192, 4096}, {12288, 4096},  // pages
      {0, 8192},    {8192, 8192},                               // pairs
      {0, 2048},    {4096, 2048}, {8192, 2048}, {12288, 2048},  // first halves
      {2048, 2048}, {6144, 2048},                               // second halves
      {12288 + 96, 1000},
  };
  static constexpr std::size_t kSpanCount = std::size(kSpans);
  static_assert(kSpans[kSpanCount - 1].begin + kSpans[kSpanCount - 1].len <= kArenaBytes);

  // What register_host is given: a span of the arena (p % 16 below
  // kSpanCount); else one inside the ring (14, while the harness knows where
  // it is), one past the end of the address space (15), or an empty one;
  // `arena` is false for the first two.
  struct RegisterSpan {
    std::byte* data;
    std::uint64_t len;
    bool arena;
    std::uint64_t begin;  // in the arena
  };
  RegisterSpan pick_register_span(std::uint8_t p) const {
    const unsigned k = p % 16;
    if (k < kSpanCount) return {arena() + kSpans[k].begin, kSpans[k].len, true, kSpans[k].begin};
    const std::uint64_t page = 4096 * (p / 16 % kArenaPages);
    // Inside the ring: only while the ring's memory exists (the span is
    // never read, but a pointer into freed memory is not one to hand out).
    if (k == 14 && ring_block_ && !m.ring_freed) return {ring_block_ + m.ring.cap / 2 / 64 * 64, 64, false, 0};
    if (k == 15) return {arena() + 64, std::numeric_limits<std::uint64_t>::max() - 63, false, 0};
    return {arena() + page, 0, true, page};
  }

  // The caller's bytes, fresh (the same stream write_ring writes).
  static void fill_pattern(std::byte* out, Byte* model, std::uint64_t len, std::uint8_t seed) {
    std::uint32_t state = seed * 2654435761u + 12345u;
    for (std::uint64_t i = 0; i < len; ++i) {
      state = state * 1664525u + 1013904223u;
      const auto v = static_cast<std::uint8_t>(state >> 24);
      out[i] = static_cast<std::byte>(v);
      model[i] = v;
    }
  }

  // ---- picking arguments ----
  // A handle or region of the bridge's tag shape ({domain, generation, id})
  // that names nothing live: another domain, a generation off by one, a
  // known id retagged, ids no slot has. `ids` are the model's own, to retag.
  template <class Tagged, class Records>
  Tagged forged(const Records& ids, std::uint8_t kind, std::uint8_t p) const {
    const std::uint64_t some_id = ids.empty() ? 1 : ids[p % ids.size()].handle.id;
    switch (kind % 8) {
      case 0: return {m.domain + 7777, m.gen, some_id};
      case 1: return {m.domain, m.gen - 1, some_id};
      case 2: return {m.domain, m.gen + 1, some_id};
      case 3: return {m.domain, m.gen, some_id};  // an id of any generation, retagged
      case 4: return {m.domain, m.gen, 0};
      case 5: return {m.domain, m.gen, std::numeric_limits<std::uint64_t>::max()};
      case 6: return {m.domain, m.gen, (std::uint64_t{p % 4u + 1u} << 32) | (p / 4u % 4u)};
      default: return {0, 0, 0};
    }
  }
  DeviceHandle forged_handle(std::uint8_t kind, std::uint8_t p) const {
    return forged<DeviceHandle>(m.allocs, kind, p);
  }
  // Returns the handle and, when it names a model allocation, its index.
  // Mostly a live allocation's handle; sometimes any handle ever issued
  // (freed, released, of an older generation), sometimes a forgery.
  DeviceHandle pick_handle(std::uint8_t a, std::uint8_t b) const {
    if (m.allocs.empty() || a % 16 == 15) return forged_handle(a / 16, b);
    const std::size_t n = m.allocs.size();
    if (a % 16 < 12) {
      std::size_t live = 0;
      for (const auto& al : m.allocs) live += al.in_slot && !al.released;
      if (live > 0) {
        std::size_t k = b % live;
        for (auto it = m.allocs.rbegin(); it != m.allocs.rend(); ++it)
          if (it->in_slot && !it->released && k-- == 0) return it->handle;
      }
    }
    return m.allocs[n - 1 - b % std::min<std::size_t>(n, 12)].handle;
  }
  const Alloc* alloc_of(const DeviceHandle& h) const {
    for (std::size_t i = m.allocs.size(); i-- > 0;)
      if (m.allocs[i].handle == h) return &m.allocs[i];
    return nullptr;
  }

  // Regions, as handles are picked: mostly a live one (of the kind a call
  // wants where there is one), sometimes any ever registered (unregistered,
  // of an older generation, retained), sometimes a forgery.
  enum class Want : std::uint8_t { Any, Writable, ReadOnly };
  HostRegion forged_region(std::uint8_t kind, std::uint8_t p) const {
    return forged<HostRegion>(m.regions, kind, p);
  }
  static bool wanted(const Region& r, Want want) {
    return want == Want::Any || r.read_only == (want == Want::ReadOnly);
  }
  HostRegion pick_region(std::uint8_t a, std::uint8_t b, Want want) const {
    if (m.regions.empty() || a % 16 == 15) return forged_region(a / 16, b);
    const std::size_t n = m.regions.size();
    if (a % 16 < 12) {
      std::vector<std::size_t> live;
      for (const Want w : {want, Want::Any}) {
        for (std::size_t i = n; i-- > 0;)
          if (m.regions[i].live && wanted(m.regions[i], w)) live.push_back(i);
        if (!live.empty()) return m.regions[live[b % live.size()]].handle;
      }
    }
    return m.regions[n - 1 - b % std::min<std::size_t>(n, 8)].handle;
  }
  const Region* region_of(const HostRegion& h) const {
    for (const auto& r : m.regions)
      if (r.handle == h) return &r;
    return nullptr;
  }
  // Mostly `want_len` bytes inside the region; sometimes all of it, one byte
  // past its end, or at a hostile offset.
  RegionRange pick_region_range(std::uint8_t a, std::uint8_t b, std::uint64_t want_len, Want want) const {
    const HostRegion h = pick_region(a, b, want);
    const Region* r = region_of(h);
    const std::uint64_t len = r ? r->len : 4096;
    const std::uint64_t slack = len >= want_len ? len - want_len : 0;
    switch (a / 16 % 8) {
      case 5: return {h, 0, len};
      case 6: return {h, slack + 1, want_len};
      case 7: return {h, hostile(b / 8), want_len};
      default: return {h, a & 0x80 ? slack : slack / 2 / 64 * 64, want_len};
    }
  }
  // A call meant to be valid registers host memory first (a fresh span of
  // the arena) when no live region of the kind it wants holds `want_len`
  // bytes: a random sequence rarely has one ready.
  void ensure_region(std::uint64_t want_len, Want want, bool read_only_if_any) {
    if (m.closed || m.broken || want_len == 0 || want_len > kArenaBytes) return;
    for (const auto& r : m.regions)
      if (r.live && r.len >= want_len && wanted(r, want)) return;
    const bool read_only = want == Want::ReadOnly || (want == Want::Any && read_only_if_any);
    for (std::uint8_t k = 0; k < kSpanCount; ++k)
      if (kSpans[k].len >= want_len && !m.arena_held(kSpans[k].begin, kSpans[k].len))
        return do_register(Op{OpKind::RegisterHost, {k, static_cast<std::uint8_t>(read_only ? 3 : 2), 0, k}});
  }

  CopyEvent forged_event(std::uint8_t kind, std::uint8_t p) const {
    const std::uint64_t some_id = m.events.empty() ? 1 : m.events[p % m.events.size()].event.id;
    if (!m.config.guessed_ids && (kind % 8 == 5 || kind % 8 == 6)) kind = 7;
    switch (kind % 8) {
      case 0: return {m.domain + 7777, m.gen, some_id};
      case 1: return {m.domain, m.gen - 1, some_id};
      case 2: return {m.domain, m.gen + 1, some_id};
      case 3: return {m.domain, m.gen, some_id};  // an id of any generation, retagged
      case 4: return {m.domain, m.gen, 0};
      case 5: return {m.domain, m.gen, (1ull << 63) | (p + 1ull)};  // a sync id
      case 6: return {m.domain, m.gen, (std::uint64_t{p % 4u + 1u} << 32) | (p / 4u % 4u)};
      default: return {m.domain, m.gen, std::numeric_limits<std::uint64_t>::max()};
    }
  }
  CopyEvent pick_event(std::uint8_t a, std::uint8_t b) const {
    if (m.events.empty() || a % 8 == 7) return forged_event(a / 8, b);
    const std::size_t n = m.events.size();
    return m.events[n - 1 - b % std::min<std::size_t>(n, 12)].event;
  }

  // Mostly a range that is valid for `want_len` bytes (inside a live
  // reservation), sometimes an exact reservation, an off-by-one or a forgery.
  HostRange pick_range(std::uint8_t a, std::uint8_t b, std::uint64_t want_len) const {
    if (ranges_.empty() || a % 16 == 15) {
      switch (b % 6) {
        case 0: return {hostile(b / 8), want_len};
        case 1: return {m.ring.cap, want_len};
        case 2: return {0, hostile(b / 8)};
        case 3: return {m.ring.cap - 1, 2};
        case 4: return {hostile(b / 8), hostile(b / 64)};
        default: return {b, want_len};
      }
    }
    const HostRange r = ranges_[ranges_.size() - 1 - b % std::min<std::size_t>(ranges_.size(), 8)];
    switch (a % 16) {
      case 11: return r;  // exactly as reserved (perhaps released since)
      case 12: return {r.offset + 1, r.len - 1};
      case 13: return {r.offset, r.len + 1};
      case 14: return {r.offset + r.len - std::min(r.len, want_len), want_len};
      default: break;
    }
    if (auto fit = live_range_for(want_len, a, b)) return *fit;
    return {r.offset, want_len};
  }

  // A range inside a live reservation that holds `want_len` bytes, newest first.
  std::optional<HostRange> live_range_for(std::uint64_t want_len, std::uint8_t a, std::uint8_t b) const {
    std::size_t seen = 0;
    for (auto it = m.ring.res.rbegin(); it != m.ring.res.rend(); ++it) {
      if (it->released || it->len < want_len) continue;
      if (seen++ < b % 3u) continue;
      const std::uint64_t slack = it->len - want_len;
      return HostRange{it->offset + (a & 1 ? slack : slack / 2 / 64 * 64), want_len};
    }
    return std::nullopt;
  }

  // A device range of `h`'s allocation (or of a plausible one when forged).
  DeviceRange pick_device_range(const DeviceHandle& h, std::uint8_t a, std::uint8_t b) const {
    const Alloc* al = alloc_of(h);
    const std::uint64_t elem = al ? spec_element_size(al->spec) : 1;
    const std::uint64_t extent = al ? al->extent : 64;
    // Mostly valid (whole elements inside the extent); 1 in 4 lengths and
    // offsets hostile or off by one.
    std::uint64_t len;
    switch (a % 16) {
      case 0: case 1: case 2: len = elem * (1 + b % 8); break;
      case 3: case 4: case 5: len = extent; break;
      case 6: case 7: len = std::max<std::uint64_t>(elem, extent / 2 / elem * elem); break;
      case 8: len = 0; break;
      case 9: len = 1; break;
      case 10: len = hostile(b); break;
      case 11: len = elem * (b + 1); break;
      default: len = std::min<std::uint64_t>(extent, elem * 4); break;
    }
    std::uint64_t off;
    switch (a / 16 % 16) {
      case 0: case 1: case 2: case 3: case 4: off = 0; break;
      case 5: case 6: off = extent >= len ? extent - len : 0; break;
      case 7: case 8: off = extent >= len ? (extent - len) / 2 / elem * elem : 0; break;
      case 9: off = extent; break;
      case 10: off = hostile(b / 8); break;
      case 11: off = 1; break;
      case 12: off = elem * (b / 16); break;
      default: off = elem; break;
    }
    return {h, off, len};
  }

  // ---- statistics and backend counts, checked after every operation ----
  void check_stats() {
    // First what the backend holds before stats() reaps: a fence that passed
    // since the last call into the bridge has freed nothing yet.
    check_backend_counts();
    m.enter_stats();  // stats() reaps like any call that enters the bridge, and after a finished close
    BridgeStats s;
    if (auto e = attempt([&] { s = bridge_->stats(); })) {
      if (m.closed && e->kind() == ErrorKind::Closed) return check_backend_counts();
      fail("stats() threw " + kind_text(e->kind()));
    }
    auto eq = [&](const char* name, std::uint64_t got, std::uint64_t want) {
      if (got != want) fail(std::string("stats().") + name + " = " + std::to_string(got) + ", model says " + std::to_string(want));
    };
    eq("generation", s.generation, m.gen);
    eq("domain", s.domain, m.domain);
    eq("closed", s.closed, m.closed);
    if (!m.closed) {
      eq("broken", s.broken, m.broken);
      eq("live_allocations", s.live_allocations, m.live_allocations());
      eq("allocated_bytes", s.allocated_bytes, m.allocated_bytes());
      eq("copies_in_flight", s.copies_in_flight, m.copies_in_flight());
      eq("inflight_bytes", s.inflight_bytes, m.inflight_bytes);
      eq("copy_records", s.copy_records, m.copies_in_flight() + m.unobserved_failures());
      eq("failed_records", s.failed_records, m.failure_log.size());
      eq("active_steps", s.active_steps, m.steps.size());
      eq("ring_used", s.ring_used, m.ring.used());
      eq("ring_reservations", s.ring_reservations, m.ring.live);
      eq("ring_capacity", s.ring_capacity, m.ring.cap);
      eq("adopted_allocations", s.adopted_allocations, m.adopted_allocations());
      eq("adopted_bytes", s.adopted_bytes, m.adopted_bytes());
      eq("memory_stats().allocated_bytes", bridge_->memory_stats().allocated_bytes, m.allocated_bytes());
    }
    // Retained regions outlive their generation and the close.
    eq("host_regions", s.host_regions, m.held_regions());
    eq("host_region_bytes", s.host_region_bytes, m.held_region_bytes());
    for (std::size_t i = m.regions.size() > 16 ? m.regions.size() - 16 : 0; i < m.regions.size(); ++i)
      check_retained(m.regions[i].handle);
    if (s.failed_records_evicted < m.evicted_lo || s.failed_records_evicted > m.evicted_hi)
      fail("stats().failed_records_evicted = " + std::to_string(s.failed_records_evicted) + ", model says between " +
           std::to_string(m.evicted_lo) + " and " + std::to_string(m.evicted_hi));
    eq("inflight_budget_bytes", s.inflight_budget_bytes, m.budget());
    eq("live_views", s.live_views, m.live_views());
    eq("orphaned_allocations", s.orphaned_allocations, m.orphans());
    eq("restarts", s.restarts, m.restarts);
    eq("pending_fences", s.pending_fences, m.drops.size());
    eq("abandoned_fences", s.abandoned_fences, m.abandoned_fences);
    if (m.counters_exact) {
      eq("copies_submitted", s.copies_submitted, m.submitted);
      eq("copies_completed", s.copies_completed, m.completed);
      eq("copies_failed", s.copies_failed, m.failed);
    }
    check_backend_counts();
  }
  void check_backend_counts() {
    const std::uint64_t allocations = backend_live_allocations();
    if (allocations != m.backend_allocations())
      fail("the backend holds " + std::to_string(allocations) + " allocation(s), the model " +
           std::to_string(m.backend_allocations()));
    const std::uint64_t blocks = backend_live_host_blocks();
    if (blocks != (m.ring_freed ? 0u : 1u))
      fail("the backend holds " + std::to_string(blocks) + " host block(s), the model " + (m.ring_freed ? "0" : "1"));
    if (fake_) {
      // Every fence in the drop queue is live in the fake (none is released
      // before its reap); pending ones are those nothing passed yet.
      if (fake_->live_fences() != m.drops.size())
        fail("the fake holds " + std::to_string(fake_->live_fences()) + " fence(s) not given back, the model's drop queue " +
             std::to_string(m.drops.size()));
      if (fake_->pending_fences().size() != m.pending_fence_count())
        fail("the fake has " + std::to_string(fake_->pending_fences().size()) + " pending fence(s), the model " +
             std::to_string(m.pending_fence_count()));
      if (fake_->live_adoptions() != m.backend_adoptions())
        fail("the fake holds " + std::to_string(fake_->live_adoptions()) + " adoption(s), the model " +
             std::to_string(m.backend_adoptions()));
      if (fake_->live_registrations() != m.held_regions())
        fail("the fake holds " + std::to_string(fake_->live_registrations()) + " registration(s), the model " +
             std::to_string(m.held_regions()));
    }
  }
  void check_retained(const HostRegion& r) const {
    const bool got = bridge_->region_retained(r), want = m.region_retained(r);
    if (got != want)
      fail("region_retained(" + g_text(r) + ") = " + (got ? "true" : "false") + ", the model says " + (want ? "true" : "false"));
  }
  // After poll() every completion the backend had is applied: exact.
  void check_stale() {
    if (!m.counters_exact || m.closed) return;
    const auto s = bridge_->stats();
    if (s.stale_completions != m.stale)
      fail("stats().stale_completions = " + std::to_string(s.stale_completions) + ", model says " + std::to_string(m.stale));
  }

  // ---- host backend: pending copies stay held until settled ----
  // On the host every fence in the drop queue is a held launch's.
  bool host_pending() const { return !m.fake() && (!m.backend_pending.empty() || !m.drops.empty()); }

  // What a piece of work reads or writes: bytes of the ring, of the arena
  // (registered regions, and the allocations adopted from them), or of one
  // allocation of the backend's.
  struct Span {
    enum class Space : std::uint8_t { Ring, Arena, Alloc } space = Space::Ring;
    std::size_t alloc = 0;
    std::uint64_t offset = 0, len = 0;
    bool overlaps(const Span& o) const {
      if (space != o.space || (space == Space::Alloc && alloc != o.alloc) || len == 0 || o.len == 0) return false;
      return offset < o.offset + o.len && o.offset < offset + len;
    }
  };
  struct Access {
    Span reads, writes;
    bool conflicts_with(const Access& o) const {
      return writes.overlaps(o.reads) || reads.overlaps(o.writes) || writes.overlaps(o.writes);
    }
  };
  Span device_span(std::size_t alloc, std::uint64_t offset, std::uint64_t len) const {
    const Alloc& a = m.allocs[alloc];
    if (a.adopted()) return {Span::Space::Arena, 0, a.arena_offset + offset, len};
    return {Span::Space::Alloc, alloc, offset, len};
  }
  // A pitched copy reaches its whole span on each side (the host engine
  // orders it after anything there, padding included).
  Access event_access(const Event& ev) const {
    const bool pitched = ev.layout.pitched();
    const Span host{ev.region ? Span::Space::Arena : Span::Space::Ring, 0, ev.host.offset,
                    pitched ? layout_host_span(ev.layout) : ev.host.len};
    const Span dev = device_span(ev.alloc, ev.dev_offset, pitched ? layout_device_span(ev.layout) : ev.host.len);
    return ev.dir == CopyDirection::HostToDevice ? Access{host, dev} : Access{dev, host};
  }
  // A launch reads x and writes y.
  Access launch_access(std::size_t xi, const DeviceRange& xr, std::size_t yi, const DeviceRange& yr) const {
    return {device_span(xi, xr.offset, xr.len), device_span(yi, yr.offset, yr.len)};
  }
  // The host engine makes work wait for held copies it conflicts with (bytes
  // one writes and the other reads or writes): those must be settled first,
  // or a single-threaded caller would wait forever.
  // `launches`: held launches count too (a sync copy waits for them).
  bool conflicts_with_held(const Access& access, bool launches = false) const {
    if (m.fake()) return false;
    if (launches)
      for (const auto& launch : host_launches_)
        if (access.conflicts_with(launch)) return true;
    for (const auto& c : m.backend_pending) {
      const Event& ev = m.events[c.event];
      if (access.conflicts_with(event_access(ev))) return true;
    }
    return false;
  }
  // Lifts the hold, waits (bounded) for every pending copy, holds again.
  // `also`: copies already let go (their completions applied in the model)
  // that the bridge may not have drained yet.
  // Then waits (bounded) until every held launch's fence passed and the
  // bridge reaped it (stats() reaps), so the drop queue is empty again.
  void settle(std::vector<std::size_t> also = {}) {
    if (m.fake() || (m.backend_pending.empty() && also.empty() && m.drops.empty())) return;
    if (m.closed || m.broken) return;
    host_raw_->test_controls()->hold_copies(false);
    std::vector<std::size_t> pending = std::move(also);
    for (const auto& c : m.backend_pending) pending.push_back(c.event);
    for (const auto& c : m.backend_pending) m.backend_finish(c, true, m.ready);
    m.backend_pending.clear();
    bool first = true;
    for (auto i : pending) {
      const CopyEvent e = m.events[i].event;
      CopyStatus status;
      // The first wait is unbounded (nanoseconds::max(): until done), the rest bounded.
      const auto timeout = first ? std::chrono::nanoseconds::max() : std::chrono::nanoseconds(std::chrono::seconds(20));
      first = false;
      if (auto err = attempt([&] { status = bridge_->wait(e, timeout); }))
        fail("settle: wait(" + e_text(e) + ") threw " + kind_text(err->kind()) + " (" + err->what() + ")");
      if (status.state != CopyState::Completed)
        fail("settle: wait(" + e_text(e) + ") on the host backend returned " + std::to_string(int(status.state)) +
             ", not Completed");
      m.drain();  // the bridge drained everything ready
    }
    if (!m.drops.empty()) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      for (;;) {
        const std::uint64_t left = bridge_->stats().pending_fences;
        if (left == 0) break;
        if (std::chrono::steady_clock::now() > deadline)
          fail("settle: " + std::to_string(left) + " launch fence(s) still pending 20 s after the hold was lifted");
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      for (auto& entry : m.drops) entry.passed = true;
      m.reap();
    }
    host_launches_.clear();
    host_raw_->test_controls()->hold_copies(true);
  }

  // ---- operations ----
  // An allocation's spec, as alloc_device and adopt_host are given it. One
  // in eight is untyped (`untyped` % 8 == 7): views of any dtype share it.
  static std::optional<DType> pick_dtype(std::uint8_t p, std::uint8_t untyped) {
    return untyped % 8 == 7 ? std::nullopt : std::optional<DType>(static_cast<DType>(p % kDTypeCount));
  }
  static std::uint64_t pick_alignment(std::uint8_t p) {
    static const std::uint64_t aligns[] = {1, 2, 4, 8, 16, 64, 256, 4096, 64, 64, 8, 1, 0, 3, 6, 1ull << 63};
    return aligns[p % 16];
  }
  // What extents are counted in: the element, or the alignment when it is
  // a plausible one and larger.
  static std::uint64_t extent_unit(const std::optional<DType>& dtype, std::uint64_t align) {
    const std::uint64_t elem = dtype ? dtype_size(*dtype) : 1;
    return std::max<std::uint64_t>(elem, RingModel::pow2(align) && align <= 4096 ? align : 1);
  }
  static std::uint64_t pick_max_extent(std::uint8_t p, std::uint64_t extent) {
    switch (p % 8) {
      case 1: return extent ? extent - 1 : 0;
      case 2: return std::numeric_limits<std::uint64_t>::max();
      case 3: return 1 << 20;
      default: return extent;
    }
  }

  void do_alloc(const Op& op) {
    const std::optional<DType> dtype = pick_dtype(op.p[0], op.p[7]);
    const std::uint64_t elem = dtype ? dtype_size(*dtype) : 1;
    const std::uint64_t align = pick_alignment(op.p[1]);
    const std::uint64_t unit = extent_unit(dtype, align);
    std::uint64_t extent;
    if (op.p[2] < 200) {
      extent = unit * (1 + op.p[2] % 16) * (op.p[3] & 0x80 ? 16 : 1);
    } else {
      switch (op.p[2] % 6) {
        case 0: extent = unit + 1; break;
        case 1: extent = hostile(op.p[3]); break;
        case 2: extent = unit * 3 / 2; break;
        default: extent = hostile(op.p[2]); break;
      }
    }
    const std::uint64_t max_extent = pick_max_extent(op.p[4], extent);
    const ShapeKind shape = static_cast<ShapeKind>(op.p[5] % 4);
    const ObjectSpec spec{max_extent, align, dtype, shape};
    const auto call = [&] { return std::string("alloc_device(align " + std::to_string(align) + ", extent " + std::to_string(extent) +
                             ", max " + std::to_string(max_extent) + ", " + std::string(spec_dtype_name(spec)) + ")"); };

    const std::optional<ErrorKind> invalid = allocation_error(spec, extent);
    // The host backend would really try to allocate a huge valid extent.
    if (!m.fake() && !invalid && extent > (1u << 20)) return;

    // Arguments wrong whatever the state are refused before the call enters
    // the bridge. A closed or broken bridge is refused (entering it) before
    // the backend is asked; otherwise the backend allocates first, and the
    // bridge enters (reaping fences) only once it has the memory. Out of
    // memory, it enters, drains completions, reaps fences and asks once more.
    Expect x;
    Fired fired;
    bool allocated = false;
    const auto fake_room = [&] { return extent <= m.config.fake_memory - m.fake_used; };
    // Arguments invalid whatever the state may be refused before the state is looked at.
    if (auto e = m.entry()) {
      x = invalid ? Expect::either({*invalid, *e}) : Expect::error(*e);
      if (!invalid) m.enter();
    } else if (invalid) {
      x = Expect::error(*invalid);
    } else if (m.fake()) {
      fired = m.fire(fake::Call::Allocate);
      if (!fired.fatal && (fired.allocation_failed || !fake_room())) {
        m.enter();
        m.drain();
        fired = m.fire(fake::Call::Allocate);
      }
      allocated = !fired.fatal && !fired.allocation_failed && fake_room();
      if (!allocated) x = Expect::error(ErrorKind::AllocationFailed);
      if (fired.fatal) m.broken = true;
    } else {
      allocated = true;
    }
    if (allocated) m.enter();
    DeviceHandle h;
    if (!expect_kind(call, x, attempt([&] { h = bridge_->alloc_device(spec, extent); }))) return check_stats();
    if (h.domain != m.domain || h.generation != m.gen) fail(call() + " returned " + h_text(h) + " tagged wrongly");
    if (!m.handle_ids.insert({h.generation, h.id}).second) fail(call() + " returned an id already issued in this generation: " + h_text(h));
    Alloc a;
    a.handle = h;
    a.spec = spec;
    a.extent = extent;
    a.bytes.assign(extent, m.fake() ? kFakeFresh : kUnknown);
    if (m.fake()) {
      m.fake_used += extent;
      const auto calls = fake_->calls();
      for (auto it = calls.rbegin(); it != calls.rend(); ++it)
        if (it->call == fake::Call::Allocate) {
          a.address = it->address;
          break;
        }
      fake_->clear_calls();
    } else {
      ViewSpec vs{dtype.value_or(DType::UInt8), {}, std::nullopt, 0};
      const std::int64_t n = static_cast<std::int64_t>(extent / elem);
      if (shape == ShapeKind::Vector || shape == ShapeKind::Tensor) vs.shape = Dims{n};
      if (shape == ShapeKind::Matrix) vs.shape = Dims{1, n};
      ViewLease lease = bridge_->view(h, vs);
      a.address = lease->data;
    }
    m.allocs.push_back(std::move(a));
    check_stats();
  }

  void do_free(const Op& op, bool deferred) {
    const DeviceHandle h = pick_handle(op.p[0], op.p[1]);
    const auto call = [&] { return std::string(std::string(deferred ? "release(" : "free_device(") + h_text(h) + ")"); };
    m.enter();  // a fence that passed since the last call ends its uses first
    Expect x;
    std::size_t i = 0;
    if (auto e = m.entry()) x = Expect::error(*e);
    else if (auto e2 = m.handle_error(h, &i)) x = Expect::error(*e2);
    else if (!deferred && m.allocs[i].used()) {
      // Refused, the bridge first applies the completions the backend holds
      // (a copy that ended unpolled holds nothing), then looks again.
      if (m.allocs[i].copies != 0 && !m.broken) m.drain();
      if (m.allocs[i].used()) x = Expect::error(ErrorKind::AllocationStillInUse);
    }
    const bool ok = expect_kind(call, x, attempt([&] {
      if (deferred) bridge_->release(h);
      else bridge_->free_device(h);
    }));
    if (ok) {
      Alloc& a = m.allocs[i];
      if (deferred) {
        a.released = true;
        m.maybe_finish_release(i);
      } else {
        a.in_slot = false;
        m.free_in_backend(a);
      }
    }
    check_stats();
  }

  void do_extent(const Op& op) {
    const DeviceHandle h = pick_handle(op.p[0], op.p[1]);
    m.enter();
    Expect x;
    std::size_t i = 0;
    if (auto e = m.entry()) x = Expect::error(*e);
    else if (auto e2 = m.handle_error(h, &i)) x = Expect::error(*e2);
    std::uint64_t extent = 0;
    ObjectSpec spec;
    if (expect_kind([&] { return "extent(" + h_text(h) + ")"; }, x, attempt([&] { extent = bridge_->extent(h); }))) {
      if (extent != m.allocs[i].extent) fail("extent() = " + std::to_string(extent));
      spec = bridge_->spec(h);
      const ObjectSpec& want = m.allocs[i].spec;
      if (spec.max_extent != want.max_extent || spec.alignment != want.alignment || spec.dtype != want.dtype ||
          spec.shape != want.shape)
        fail("spec() differs from the spec allocated");
    }
  }

  void do_reserve(const Op& op) {
    static const std::uint64_t aligns[] = {1, 8, 64, 64, 256, 4096, 0, 3, 8192, 1ull << 63, 2, 16};
    std::uint64_t bytes;
    switch (op.p[0] % 16) {
      case 0: bytes = hostile(op.p[1]); break;
      case 1: bytes = m.ring.cap; break;
      case 2: bytes = m.ring.cap + 1; break;
      case 3: case 4: case 5: bytes = 4 * (1 + op.p[1] % 64); break;
      default: bytes = 64 * (1 + op.p[1] % 16); break;
    }
    const std::uint64_t align = op.p[2] & 0x80 ? 64 : aligns[op.p[2] % 12];
    const auto call = [&] { return std::string("reserve(" + std::to_string(bytes) + ", align " + std::to_string(align) + ")"); };
    m.enter();
    Expect x;
    HostRange want;
    RingModel after = m.ring;
    if (auto e = m.entry()) x = Expect::error(*e);
    else if (auto e2 = after.reserve(bytes, align, want)) x = Expect::error(*e2);
    HostRange got;
    if (expect_kind(call, x, attempt([&] { got = bridge_->reserve(bytes, align); }))) {
      if (got != want) fail(call() + " returned " + r_text(got) + ", the ring rule gives " + r_text(want));
      m.ring = std::move(after);
      ranges_.push_back(got);
    }
    check_stats();
  }

  void do_release_host(const Op& op) {
    const HostRange r = pick_range(op.p[0], op.p[1], 64);
    Expect x;
    RingModel after = m.ring;
    if (m.closed) {
      x = Expect::error(ErrorKind::Closed);
    } else if (auto e = after.release(r)) {
      // Pinned, the bridge first applies the completions the backend holds
      // (a copy that ended unpolled pins nothing), then tries again.
      if (*e == ErrorKind::AllocationStillInUse && !m.broken && m.drain() != 0) {
        after = m.ring;
        e = after.release(r);
      }
      if (e) x = Expect::error(*e);
    }
    if (expect_kind([&] { return "release_host(" + r_text(r) + ")"; }, x, attempt([&] { bridge_->release_host(r); })))
      m.ring = std::move(after);
    check_stats();
  }

  void do_ring_bytes(const Op& op, bool write) {
    const HostRange r = pick_range(op.p[0], op.p[1], 4 * (1 + op.p[2] % 32));
    Expect x;
    if (m.closed) x = Expect::error(ErrorKind::Closed);
    else if (!m.ring.locate(r)) x = Expect::error(ErrorKind::InvalidRange);
    std::byte* data = nullptr;
    std::size_t size = 0;
    if (!expect_kind([&] { return std::string(write ? "write" : "read") + " host_bytes(" + r_text(r) + ")"; }, x,
                     attempt([&] {
                       const auto span = bridge_->host_bytes(r);
                       data = span.data();
                       size = span.size();
                     })))
      return;
    const std::span<std::byte> span(data, size);
    if (!ring_block_) ring_block_ = span.data() - r.offset;
    if (span.size() != r.len || span.data() != ring_block_ + r.offset)
      fail("host_bytes(" + r_text(r) + ") is not the ring's bytes at that offset");
    if (write) {
      fill_pattern(span.data(), &m.ring_bytes[r.offset], r.len, op.p[3]);
    } else {
      compare_bytes([&] { return "ring bytes " + r_text(r); }, span.data(), &m.ring_bytes[r.offset], r.len);
    }
  }

  template <class Describe>
  void compare_bytes(const Describe& describe_what, const std::byte* got, const Byte* want, std::uint64_t len) const {
    for (std::uint64_t i = 0; i < len; ++i) {
      if (want[i] == kUnknown) continue;
      if (static_cast<Byte>(got[i]) != want[i])
        fail(describe(describe_what) + ": byte " + std::to_string(i) + " is " + std::to_string(int(got[i])) + ", the model says " +
             std::to_string(want[i]));
    }
  }

  // `region`: the host side is a registered region's range, not the ring's.
  void do_copy(const Op& op, CopyDirection dir, bool region = false) {
    const bool async = op.p[4] & 1;
    const DeviceHandle h = pick_handle(op.p[0], op.p[1]);
    const DeviceRange d = pick_device_range(h, op.p[2], op.p[3]);
    if (region) {
      const Want want = dir == CopyDirection::DeviceToHost ? Want::Writable : Want::Any;
      if (op.p[5] % 16 < 11) ensure_region(d.len, want, op.p[4] & 4);
      return copy_checked(dir, async, h, d, pick_region_range(op.p[5], op.p[6], d.len, want), room_of(op.p[7]),
                          std::nullopt);
    }
    // A copy meant to be valid reserves its ring bytes first when no live
    // reservation holds them (a random sequence rarely has one ready).
    if (op.p[5] % 16 < 11 && !m.closed && !m.broken && d.len > 0 && d.len <= 4096 && !live_range_for(d.len, 0, 0)) {
      Op reserve{OpKind::Reserve, {6, static_cast<std::uint8_t>((d.len + 63) / 64 - 1), 0x80}};
      if (d.len <= 1024) do_reserve(reserve);
    }
    const HostRange r = pick_range(op.p[5], op.p[6], d.len);
    copy_checked(dir, async, h, d, r, room_of(op.p[7]), std::nullopt);
  }

  static std::chrono::nanoseconds room_of(std::uint8_t p) {
    static const std::int64_t admissions[] = {0, 0, 0, 0, 1000, 100000, std::numeric_limits<std::int64_t>::max(), -1};
    return std::chrono::nanoseconds{admissions[p % 8 == 7 ? 7 - (p / 8 % 2) : p % 8]};
  }

  // A pitched copy: rows of row_bytes at a pitch on each side, mostly fitting
  // a live reservation (or, `region`, a live region) and the allocation,
  // sometimes hostile.
  void do_pitched_copy(const Op& op, bool region = false) {
    const CopyDirection dir = op.p[2] & 1 ? CopyDirection::DeviceToHost : CopyDirection::HostToDevice;
    const bool async = op.p[2] & 2;
    const DeviceHandle h = pick_handle(op.p[0], op.p[1]);
    const Alloc* al = alloc_of(h);
    const std::uint64_t elem = al ? spec_element_size(al->spec) : 1;
    CopyLayout layout;
    layout.rows = op.p[3] % 8 == 7 ? hostile(op.p[3] / 8) : op.p[3] % 8;  // 0 rows: refused
    layout.row_bytes = op.p[4] % 16 == 15 ? hostile(op.p[4] / 16) : elem * (op.p[4] % 16) + (op.p[4] / 16 % 4 == 3);
    layout.host_pitch = op.p[5] % 16 == 15 ? hostile(op.p[5] / 16) : layout.row_bytes + op.p[5] % 16 - (op.p[5] / 16 % 8 == 7);
    layout.device_pitch =
        op.p[6] % 16 == 15 ? hostile(op.p[6] / 16) : layout.row_bytes + elem * (op.p[6] % 8) - (op.p[6] / 16 % 8 == 7);
    std::uint64_t host_span = 0, device_span = 0;
    try {
      host_span = layout_host_span(layout);
      device_span = layout_device_span(layout);
    } catch (const Error&) {
      host_span = device_span = 64;  // refused anyway: any ranges will do
    }
    // The device range covers the rows (or not, 1 in 8), from an offset inside the extent.
    const std::uint64_t extent = al ? al->extent : 64;
    DeviceRange d{h, 0, device_span + (op.p[7] % 8 == 7 ? elem : 0)};
    if (op.p[7] / 8 % 4 == 3 && extent > d.len) d.offset = (extent - d.len) / elem * elem;
    if (op.p[7] / 32 % 8 == 7) d.offset = hostile(op.p[7]);
    if (region) {
      const Want want = dir == CopyDirection::DeviceToHost ? Want::Writable : Want::Any;
      if (op.p[5] % 16 < 12) ensure_region(host_span, want, op.p[5] & 0x80);
      return copy_checked(dir, async, h, d, pick_region_range(op.p[6] % 16 == 14 ? 15 : 0, op.p[1], host_span, want),
                          room_of(op.p[7] / 64), layout);
    }
    if (op.p[5] % 16 < 12 && !m.closed && !m.broken && host_span > 0 && host_span <= 1024 &&
        !live_range_for(host_span, 0, 0)) {
      Op reserve{OpKind::Reserve, {6, static_cast<std::uint8_t>((host_span + 63) / 64 - 1), 0x80}};
      do_reserve(reserve);
    }
    const HostRange r = pick_range(op.p[6] % 16 == 14 ? 15 : 0, op.p[1], host_span);
    copy_checked(dir, async, h, d, r, room_of(op.p[7] / 64), layout);
  }

  // What the bridge's pitched-copy checks refuse (all InvalidRange), given a
  // valid device range: bytes moved when it is accepted.
  static std::optional<std::uint64_t> pitched_bytes(const CopyLayout& layout, std::uint64_t host_len,
                                                    const DeviceRange& d, std::uint64_t elem) {
    if (!layout.pitched() || layout.row_bytes == 0) return std::nullopt;
    if (layout.rows > 1 && (layout.host_pitch < layout.row_bytes || layout.device_pitch < layout.row_bytes))
      return std::nullopt;
    const auto span = [&](std::uint64_t pitch) -> std::optional<std::uint64_t> {
      const auto before = checked::mul(layout.rows - 1, pitch);
      return before ? checked::add(*before, layout.row_bytes) : std::nullopt;
    };
    const auto host_span = span(layout.host_pitch), device_span = span(layout.device_pitch);
    if (!host_span || !device_span || *host_span > host_len || *device_span > d.len) return std::nullopt;
    if ((layout.row_bytes | layout.device_pitch) & (elem - 1)) return std::nullopt;
    return checked::mul(layout.rows, layout.row_bytes);
  }

  // What the bridge refuses in a copy's host side once the rest is valid
  // (the ring's range, or the region's handle and range); `region` gets the
  // region's index.
  std::optional<ErrorKind> host_error(const HostSide& host, CopyDirection dir, std::optional<std::size_t>& region) {
    if (const auto* r = std::get_if<HostRange>(&host))
      return m.ring.locate(*r) ? std::nullopt : std::optional<ErrorKind>(ErrorKind::InvalidRange);
    const RegionRange& rr = std::get<RegionRange>(host);
    std::size_t i = 0;
    if (auto e = m.region_error(rr.region, &i)) return e;
    const Region& reg = m.regions[i];
    // A download into a region registered read-only is refused.
    if (rr.len == 0 || rr.offset > reg.len || rr.len > reg.len - rr.offset ||
        (reg.read_only && dir == CopyDirection::DeviceToHost))
      return ErrorKind::InvalidRange;
    region = i;
    return std::nullopt;
  }

  void copy_checked(CopyDirection dir, bool async, const DeviceHandle& h, const DeviceRange& d, const HostSide& host,
                    std::chrono::nanoseconds room, const std::optional<CopyLayout>& layout) {
    const CopyMode mode = async ? CopyMode::Async : CopyMode::Sync;
    const std::uint64_t host_len = std::visit([](const auto& r) { return r.len; }, host);
    const auto call = [&] {
      std::string text = std::string(dir == CopyDirection::HostToDevice ? "host_to_device(" : "device_to_host(") +
                         host_text(host) + ", " + h_text(h) + " [" + std::to_string(d.offset) + ",+" +
                         std::to_string(d.len) + "), " + (async ? "async" : "sync") + ", room " +
                         std::to_string(room.count());
      if (layout)
        text += ", rows " + std::to_string(layout->rows) + " of " + std::to_string(layout->row_bytes) + " at pitches " +
                std::to_string(layout->host_pitch) + "/" + std::to_string(layout->device_pitch);
      return text + ")";
    };
    std::uint64_t bytes = host_len;
    Expect x;
    std::size_t ai = 0;
    std::optional<std::size_t> region;
    std::optional<ErrorKind> invalid;
    bool room_from_host = false;
    // A negative wait for room is refused whatever the state or mode (a usage error).
    const bool negative = room.count() < 0;
    if (!negative) m.enter();  // the negative one is refused before the call enters the bridge
    if (auto e = m.entry()) x = negative ? Expect::either({*e, ErrorKind::InvalidRange}) : Expect::error(*e);
    else if (auto e2 = m.handle_error(h, &ai)) x = negative ? Expect::either({*e2, ErrorKind::InvalidRange}) : Expect::error(*e2);
    else {
      const Alloc& a = m.allocs[ai];
      const std::uint64_t elem = spec_element_size(a.spec);
      if (d.len == 0 || d.offset > a.extent || d.len > a.extent - d.offset || (d.offset | d.len) % elem) {
        invalid = ErrorKind::InvalidRange;
      } else if (layout) {
        const auto moved = pitched_bytes(*layout, host_len, d, elem);
        if (!moved) invalid = ErrorKind::InvalidRange;
        else bytes = *moved;
      } else if (host_len != d.len) {
        invalid = ErrorKind::InvalidRange;
      }
      if (!invalid) invalid = host_error(host, dir, region);
      // Adopted memory is read-only.
      if (!invalid && dir == CopyDirection::HostToDevice && a.adopted()) invalid = ErrorKind::InvalidRange;
      if (negative) {
        x = invalid ? Expect::either({*invalid, ErrorKind::InvalidRange}) : Expect::error(ErrorKind::InvalidRange);
      } else if (invalid) {
        x = Expect::error(*invalid);
      } else if (dir == CopyDirection::HostToDevice && a.views &&
                 m.config.writes_under_view != WritesUnderView::Allow) {
        // Wait (with a zero timeout here) drains once before it gives up.
        if (m.config.writes_under_view == WritesUnderView::Wait) m.drain();
        x = Expect::error(ErrorKind::AllocationStillInUse);
      } else if (async && m.inflight_bytes + bytes > m.budget()) {
        if (room == std::chrono::nanoseconds::max() && bytes <= m.budget()) {
          // Waiting until there is room: on the fake nothing would ever make
          // room; on the host, the held copies are let go and the call must
          // wait for them (the copy is then admitted).
          if (m.fake()) return;
          room_from_host = true;
        } else {
          if (room.count() > 0 && bytes <= m.budget()) m.drain();
          x = Expect::error(ErrorKind::Backpressure);
        }
      }
    }
    auto run_copy = [&](CopyEvent& got) {
      return attempt([&] {
        // Pitched through the one entry point, plain through the everyday
        // wrappers callers use (the conformance tests hold the two equal).
        if (layout) {
          got = bridge_->copy(HostCopy{dir, host, d, layout, mode, {room}});
          return;
        }
        std::visit([&](const auto& r) {
          got = dir == CopyDirection::HostToDevice ? bridge_->host_to_device(r, d, mode, {room})
                                                   : bridge_->device_to_host(d, r, mode, {room});
        }, host);
      });
    };
    CopyEvent got;
    if (!x.ok) {
      expect_kind(call, x, run_copy(got));
      return check_stats();
    }
    // Valid: it reaches the backend.
    std::vector<std::size_t> let_go;
    if (room_from_host) {
      for (const auto& c : m.backend_pending) {
        let_go.push_back(c.event);
        m.backend_finish(c, true, m.ready);
      }
      m.backend_pending.clear();
      m.drain();
      host_raw_->test_controls()->hold_copies(false);
    }
    // A sync copy on the host backend waits for the held copies it conflicts with.
    Event ev;
    ev.sync = !async;
    ev.dir = dir;
    ev.alloc = ai;
    ev.dev_offset = d.offset;
    ev.region = region;
    if (const auto* r = std::get_if<HostRange>(&host)) {
      ev.host = *r;
      ev.ring_key = m.ring.locate(*r)->key;
    } else {
      const RegionRange& rr = std::get<RegionRange>(host);
      ev.host = HostRange{m.regions[*region].begin + rr.offset, rr.len};  // in the arena
    }
    ev.layout = layout.value_or(CopyLayout{});
    ev.bytes = bytes;
    if (!async && conflicts_with_held(event_access(ev), true)) settle();
    Fired fired;
    std::optional<ErrorKind> backend_error;
    if (m.fake()) {
      m.submit_reached();
      fired = m.fire(dir == CopyDirection::HostToDevice ? fake::Call::CopyHostToDevice : fake::Call::CopyDeviceToHost);
      if (fired.fatal || fired.submit_failed || (!async && fired.fail_at_completion))
        backend_error = dir == CopyDirection::HostToDevice ? ErrorKind::DeviceCopyFailed : ErrorKind::OutputCopyFailed;
    }
    const auto error = run_copy(got);
    if (backend_error) {
      expect_kind(call, Expect::error(*backend_error), error);
      ++m.failed;
      if (fired.fatal) m.broken = true;
      return check_stats();
    }
    expect_kind(call, Expect::success(), error);
    if (got.domain != m.domain || got.generation != m.gen) fail(call() + " returned event " + e_text(got) + " tagged wrongly");
    if (!m.event_ids.insert({got.generation, got.id}).second)
      fail(call() + " returned an event id already issued in this generation: " + e_text(got));
    ev.event = got;
    ++m.submitted;
    if (!async) {
      m.move_bytes(ev);
      ev.state = EvState::Completed;
      ++m.completed;
      m.events.push_back(ev);
    } else {
      ev.state = EvState::Pending;
      m.pin(ev);
      m.inflight_bytes += bytes;
      m.events.push_back(ev);
      m.backend_pending.push_back(
          BackendCopy{m.events.size() - 1, fired.fail_at_completion, fired.lost, fired.duplicated, fired.late});
      if (room_from_host) settle(std::move(let_go));  // the hold is back on, all completed
    }
    check_stats();
  }

  void do_poll() {
    m.enter();
    Expect x;
    if (auto e = m.entry()) x = Expect::error(*e);
    std::size_t got = 0;
    if (expect_kind("poll()", x, attempt([&] { got = bridge_->poll(); }))) {
      const std::size_t want = m.drain();
      if (got != want) fail("poll() applied " + std::to_string(got) + " completions, the model " + std::to_string(want));
      check_stale();
    }
    check_stats();
  }

  void do_complete(const Op& op, bool all) {
    if (!m.fake()) {
      // Settling lets every held copy go; one time in three, so copies also pile up.
      if (all || op.p[0] % 3 == 0) settle();
      return check_stats();
    }
    const bool ok = op.p[1] % 4 != 0;
    if (all) {
      const std::size_t n = fake_->complete_all(ok);
      if (n != m.backend_pending.size())
        fail("fake complete_all completed " + std::to_string(n) + ", the model holds " + std::to_string(m.backend_pending.size()));
      for (const auto& c : m.backend_pending) m.backend_finish(c, ok, m.ready);
      m.backend_pending.clear();
    } else if (m.backend_pending.empty()) {
      if (fake_->complete(pick_event(op.p[2], op.p[3]), ok)) fail("fake complete() of a copy it does not hold returned true");
    } else {
      const std::size_t k = op.p[0] % m.backend_pending.size();
      const BackendCopy c = m.backend_pending[k];
      if (!fake_->complete(m.events[c.event].event, ok)) fail("fake complete() of a pending copy returned false");
      m.backend_pending.erase(m.backend_pending.begin() + static_cast<std::ptrdiff_t>(k));
      m.backend_finish(c, ok, m.ready);
    }
    do_poll();
  }

  void do_report(const Op& op) {
    if (!m.fake()) return;
    const CopyEvent e = pick_event(op.p[0], op.p[1]);
    // Forged only for an event the fake does not hold, as report_completion
    // says: one for a copy still in flight there is a lying driver, which
    // ends the copy while the device still moves its bytes (the bridge frees
    // its allocation on release, and cannot tell).
    for (const auto& c : m.backend_pending)
      if (m.events[c.event].event == e) return check_stats();
    const bool ok = op.p[2] & 1;
    fake_->report_completion(e, ok);
    m.ready.push_back({e, ok});
    do_poll();
  }

  // The state an event reads as, or the error raised for it. `leniency`
  // returns true when UnknownDeviceHandle is also acceptable.
  std::optional<ErrorKind> event_state(const CopyEvent& e, std::size_t* index, bool* may_be_unknown) const {
    *may_be_unknown = false;
    if (auto t = m.tag_error(e)) return t;
    auto i = m.find_event(e);
    if (!i) return ErrorKind::UnknownDeviceHandle;
    const Event& ev = m.events[*i];
    if (ev.state == EvState::Forgotten || ev.state == EvState::Retired) return ErrorKind::UnknownDeviceHandle;
    if (ev.state == EvState::Completed && m.evicted_in_generation && !ev.sync) *may_be_unknown = true;
    *index = *i;
    return std::nullopt;
  }

  void do_status(const Op& op, bool wait) {
    const CopyEvent e = pick_event(op.p[0], op.p[1]);
    using std::chrono::nanoseconds;
    std::optional<nanoseconds> timeout;
    switch (op.p[2] % 8) {
      case 2: timeout = nanoseconds(1000); break;
      case 3: timeout = nanoseconds(-1); break;
      case 4: timeout = nanoseconds::max(); break;
      case 5: break;  // none: until done
      case 6: timeout = nanoseconds(50000); break;
      case 7: timeout = nanoseconds(-1000000); break;
      default: timeout = nanoseconds(0); break;
    }
    const bool unbounded = wait && (!timeout || *timeout == nanoseconds::max());
    const auto call = [&] { return std::string(std::string(wait ? "wait(" : "copy_status(") + e_text(e) +
                             (wait ? (timeout ? ", " + std::to_string(timeout->count()) + "ns" : ", none") : "") + ")"); };
    Expect x;
    std::size_t i = 0;
    bool may_be_unknown = false;
    const bool negative = wait && timeout && timeout->count() < 0;
    if (auto en = m.entry()) {
      x = negative ? Expect::either({*en, ErrorKind::InvalidRange}) : Expect::error(*en);
    } else {
      const auto st = event_state(e, &i, &may_be_unknown);
      if (unbounded && !st && m.events[i].state == EvState::Pending) {
        // Only the host backend will ever complete it (once the hold is lifted).
        if (m.fake()) return;
        settle();
      }
      if (negative)
        x = st ? Expect::either({*st, ErrorKind::InvalidRange}) : Expect::error(ErrorKind::InvalidRange);
      else if (st)
        x = Expect::error(*st);
      // A negative timeout is refused before the bridge looks at anything.
      if (!negative) m.drain();
    }
    if (!negative) m.enter();
    CopyStatus status;
    const auto error = attempt([&] { status = wait ? bridge_->wait(e, timeout) : bridge_->copy_status(e); });
    if (error && x.ok && may_be_unknown && error->kind() == ErrorKind::UnknownDeviceHandle) return check_stats();
    if (!expect_kind(call, x, error)) return check_stats();
    Event& ev = m.events[i];
    CopyState want = CopyState::Completed;
    if (ev.state == EvState::Pending) want = CopyState::Pending;
    if (ev.state == EvState::Failed) want = CopyState::Failed;
    if (status.state != want)
      fail(call() + " returned state " + std::to_string(int(status.state)) + ", the model " + std::to_string(int(want)));
    if (want == CopyState::Failed) {
      if (status.error != ev.error) fail(call() + " returned the wrong failure kind");
      if (status.message.empty()) fail(call() + " returned a failure without a message");
      ev.observed = true;
    } else if (status.error) {
      fail(call() + " returned an error kind for a copy that did not fail");
    }
    check_stats();
  }

  void do_safe(const Op& op) {
    const CopyEvent e = pick_event(op.p[0], op.p[1]);
    const bool valid_query = op.p[2] & 1;
    const auto call = [&] { return std::string(std::string(valid_query ? "host_bytes_valid(" : "safe_to_release_host(") + e_text(e) + ")"); };
    Expect x;
    std::size_t i = 0;
    bool may_be_unknown = false;
    if (auto en = m.entry()) x = Expect::error(*en);
    else if (auto st = event_state(e, &i, &may_be_unknown)) x = Expect::error(*st);
    // The bridge drains for an event that is not complete yet; one that
    // already reads Completed is answered without draining.
    if (x.ok && m.events[i].state != EvState::Completed) m.drain();
    m.enter();
    bool got = false;
    const auto error = attempt([&] { got = valid_query ? bridge_->host_bytes_valid(e) : bridge_->safe_to_release_host(e); });
    if (error && x.ok && may_be_unknown && error->kind() == ErrorKind::UnknownDeviceHandle) return check_stats();
    if (!expect_kind(call, x, error)) return check_stats();
    const bool want = m.events[i].state == EvState::Completed;
    if (got != want) fail(call() + " = " + (got ? "true" : "false") + ", the model says " + (want ? "true" : "false"));
    check_stats();
  }

  static StepId step_id(std::uint8_t p) {
    static const StepId ids[] = {0, 1, 2, std::numeric_limits<StepId>::max()};
    return ids[p % 4];
  }

  void do_begin_step(const Op& op) {
    const StepId step = step_id(op.p[0]);
    const std::size_t n = op.p[1] % 4;
    std::vector<DeviceHandle> handles;
    for (std::size_t k = 0; k < n; ++k) handles.push_back(pick_handle(op.p[2 + 2 * k], op.p[3 + 2 * k]));
    m.enter();
    Expect x;
    std::vector<std::size_t> indices;
    if (auto e = m.entry()) x = Expect::error(*e);
    else if (m.steps.count(step)) x = Expect::error(ErrorKind::Unsupported);
    else
      for (const auto& h : handles) {
        std::size_t i = 0;
        if (auto e2 = m.handle_error(h, &i)) {
          x = Expect::error(*e2);
          break;
        }
        indices.push_back(i);
      }
    if (expect_kind([&] { return "begin_step(" + std::to_string(step) + ", " + std::to_string(n) + " handles)"; }, x,
                    attempt([&] { bridge_->begin_step(step, handles); }))) {
      for (auto i : indices) ++m.allocs[i].steps;
      m.steps[step] = indices;
    }
    check_stats();
  }

  void do_end_step(const Op& op) {
    const StepId step = step_id(op.p[0]);
    m.enter();
    Expect x;
    if (auto e = m.entry()) x = Expect::error(*e);
    else if (!m.steps.count(step)) x = Expect::error(ErrorKind::UnknownDeviceHandle);
    if (expect_kind([&] { return "end_step(" + std::to_string(step) + ")"; }, x, attempt([&] { bridge_->end_step(step); }))) {
      for (auto i : m.steps[step]) {
        --m.allocs[i].steps;
        m.maybe_finish_release(i);
      }
      m.steps.erase(step);
    }
    check_stats();
  }

  void do_axpy(const Op& op) {
    static const float as[] = {1.0f, 2.0f, 0.5f, -1.0f};
    static const float bs[] = {0.0f, 1.0f, -0.5f, 0.0f};
    const DeviceHandle xh = pick_handle(op.p[0], op.p[1]);
    const DeviceHandle yh = op.p[6] & 1 ? xh : pick_handle(op.p[2], op.p[3]);
    const DeviceRange xr = pick_device_range(xh, op.p[4], op.p[5]);
    DeviceRange yr = pick_device_range(yh, op.p[7] & 1 ? op.p[4] : op.p[6], op.p[7]);
    const float a = as[op.p[7] / 2 % 4], b = bs[op.p[7] / 8 % 4];
    const auto call = [&] { return std::string("launch_axpy(" + h_text(xh) + " [" + std::to_string(xr.offset) + ",+" + std::to_string(xr.len) +
                             "), " + h_text(yh) + " [" + std::to_string(yr.offset) + ",+" + std::to_string(yr.len) + "))"); };
    m.enter();
    Expect x;
    std::size_t xi = 0, yi = 0;
    Fired fired;
    auto range_bad = [&](const DeviceRange& r, const Alloc& al) {
      // Untyped operands are read as float32.
      const std::uint64_t elem = al.spec.dtype ? dtype_size(*al.spec.dtype) : 4;
      return r.len == 0 || r.offset > al.extent || r.len > al.extent - r.offset || (r.offset | r.len) % elem;
    };
    // Copies into y that ended unpolled are applied before y's copies can
    // refuse the launch (as free_device); that may end either operand.
    if (!m.entry() && !m.handle_error(xh, &xi) && !m.handle_error(yh, &yi) && m.allocs[yi].copies != 0 && !m.broken)
      m.drain();
    if (auto e = m.entry()) x = Expect::error(*e);
    else if (auto e1 = m.handle_error(xh, &xi)) x = Expect::error(*e1);
    else if (auto e2 = m.handle_error(yh, &yi)) x = Expect::error(*e2);
    else if (m.allocs[xi].spec.dtype.value_or(DType::Float32) != DType::Float32 ||
             m.allocs[yi].spec.dtype.value_or(DType::Float32) != DType::Float32)
      x = Expect::error(ErrorKind::InvalidViewDType);
    else if (range_bad(xr, m.allocs[xi]) || range_bad(yr, m.allocs[yi]) || xr.len != yr.len ||
             m.allocs[yi].adopted() ||  // adopted memory is read-only
             (xi == yi && xr.offset != yr.offset &&  // shifted in one allocation: the order would decide
              (xr.offset < yr.offset ? yr.offset - xr.offset : xr.offset - yr.offset) < xr.len))
      x = Expect::error(ErrorKind::InvalidRange);
    else if (m.allocs[yi].copies)
      x = Expect::error(ErrorKind::AllocationStillInUse);
    else if (!m.fake()) {
      // The host engine runs it after held copies it conflicts with (writes into x).
      if (conflicts_with_held(launch_access(xi, xr, yi, yr))) settle();
    } else {
      fired = m.fire(fake::Call::Launch);
      if (fired.fatal) {
        x = Expect::error(ErrorKind::Unavailable);
        m.broken = true;
      }
    }
    if (expect_kind(call, x, attempt([&] { bridge_->launch_axpy(xr, yr, a, b); }))) {
      // Its use of x and y ends at its fence: pending while the fake holds
      // launches, and always on the held host engine (the launch is queued).
      if (!m.fake() || m.launches_held) {
        FenceEntry entry;
        entry.allocs = {xi, yi};
        if (m.fake()) entry.token = learn_fence(call());
        else host_launches_.push_back(launch_access(xi, xr, yi, yr));
        m.add_fence(std::move(entry));
      }
      axpy_elements(m.device_bytes(m.allocs[xi]) + xr.offset, m.device_bytes(m.allocs[yi]) + yr.offset, xr.len / 4,
                    a, b);
    }
    check_stats();
  }

  ViewSpec pick_view_spec(const Op& op, const Alloc* al) const {
    const DType dtype = al && al->spec.dtype && op.p[2] % 8 != 0 ? *al->spec.dtype
                                                                  : static_cast<DType>(op.p[3] % kDTypeCount);
    const std::int64_t elem = dtype_size(dtype);
    const std::int64_t n = al ? static_cast<std::int64_t>(al->extent / static_cast<std::uint64_t>(elem)) : 16;
    ViewSpec spec;
    spec.dtype = dtype;
    const std::int64_t big = std::numeric_limits<std::int64_t>::max();
    switch (op.p[4] % 12) {
      case 0: case 1: spec.shape = Dims{n}; break;
      case 2: spec.shape = Dims{std::max<std::int64_t>(1, n / 2)}; break;
      case 3: spec.shape = Dims{}; break;
      case 4: spec.shape = Dims{1, n}; break;
      case 5: spec.shape = Dims{2, std::max<std::int64_t>(1, n / 2)}; break;
      case 6: spec.shape = Dims{0}; break;
      case 7: spec.shape = Dims{-1}; break;
      case 8: spec.shape = Dims{big}; break;
      case 9: spec.shape = Dims{1ll << 62, 4}; break;
      case 10: spec.shape = Dims{n + 1}; break;
      default: spec.shape = Dims{1, 1, 1, 1, 1, 1, 1, std::max<std::int64_t>(1, n)}; break;
    }
    switch (op.p[5] % 8) {
      case 1: {
        Dims s;
        for (int i = 0; i < spec.shape.size(); ++i) s.push_back(op.p[6] % 2 ? 1 : -1);
        spec.strides = s;
        break;
      }
      case 2: {
        Dims s;
        for (int i = 0; i < spec.shape.size(); ++i) s.push_back(op.p[6] % 3 == 0 ? (m.config.max_strides ? big : big / 2) : 0);
        spec.strides = s;
        break;
      }
      case 3: spec.strides = Dims{1, 1}; break;
      default: break;
    }
    static const std::uint64_t offsets[] = {0, 0, 0, 1, std::numeric_limits<std::uint64_t>::max(), 1ull << 63};
    const std::uint64_t o = op.p[7] % 8;
    spec.byte_offset = o < 6 ? offsets[o] : static_cast<std::uint64_t>(elem) * (o == 6 ? 1 : std::max<std::int64_t>(n - 1, 0));
    return spec;
  }

  void do_view(const Op& op) {
    const DeviceHandle h = pick_handle(op.p[0], op.p[1]);
    const Alloc* al = alloc_of(h);
    const ViewSpec spec = pick_view_spec(op, al);
    const ViewWait wait = op.p[6] & 0x80 ? ViewWait::Wait : ViewWait::Refuse;
    if (wait == ViewWait::Wait && host_pending()) settle();
    const auto call = [&] { return std::string("view(" + h_text(h) + ", " + std::string(dtype_info(spec.dtype).name) + ", rank " +
                       std::to_string(spec.shape.size()) + (spec.strides ? ", strided" : "") + ", offset " +
                       std::to_string(spec.byte_offset) + (wait == ViewWait::Wait ? ", wait)" : ")")); };
    Expect x;
    std::size_t i = 0;
    Fired fired;
    if (auto e = m.entry()) x = Expect::error(*e);
    else if (auto e2 = m.handle_error(h, &i)) x = Expect::error(*e2);
    else if (m.allocs[i].spec.dtype && spec.dtype != *m.allocs[i].spec.dtype) x = Expect::error(ErrorKind::InvalidViewDType);
    else if (!view_fits(spec, m.allocs[i].extent) ||
             (m.config.check_rank && !rank_fits(m.allocs[i].spec.shape, spec.shape.size())))
      x = Expect::error(ErrorKind::InvalidTensorView);
    else if (m.allocs[i].uploads) {
      // Waiting for an upload nothing will complete would block.
      if (wait == ViewWait::Wait) return;
      x = Expect::error(ErrorKind::AllocationStillInUse);
    } else if (m.fake()) {
      fired = m.fire(fake::Call::ValidateView);
      if (fired.fatal) {
        x = Expect::error(ErrorKind::Unavailable);
        m.broken = true;
      } else if (fired.invalid_view) {
        x = Expect::error(ErrorKind::InvalidTensorView);
      }
    }
    m.enter();
    ViewLease lease;
    if (expect_kind(call, x, attempt([&] { lease = bridge_->view(h, spec, wait); }))) {
      const Alloc& a = m.allocs[i];
      const TensorView& v = lease.view();
      if (v.data != a.address || v.handle != h || v.dtype != spec.dtype || !(v.shape == spec.shape) ||
          v.byte_offset != spec.byte_offset || v.device != "CPU" || v.read_only != a.adopted())
        fail(call() + " returned a view that does not describe the allocation");
      if (!(v.strides == (spec.strides ? *spec.strides : contiguous_strides(spec.shape))))
        fail(call() + " returned the wrong strides");
      ++m.allocs[i].views;
      leases_.push_back({std::move(lease), i});
    }
    check_stats();
  }

  void end_view(std::size_t k) {
    const std::size_t i = leases_[k].alloc;
    leases_[k].lease.reset();  // a no-op after end_after, which ended it already
    leases_.erase(leases_.begin() + static_cast<std::ptrdiff_t>(k));
    Alloc& a = m.allocs[i];
    // A lease of an older generation, or of a closed bridge, ends on the
    // bridge's cold path, which reaps the drop queue first (even when closed).
    if (a.orphan || m.closed) m.reap();
    --a.views;
    if (a.orphan) {
      m.maybe_free_orphan(i);
    } else if (!m.close_pending) {
      // After a close whose quiesce failed nothing is freed (the device may
      // still touch it) until a close succeeds.
      m.maybe_finish_release(i);
    }
    maybe_core_ends();
  }

  // The core goes when its Bridge and its last lease (view or host) are gone:
  // it settles the fences still queued (waits close_fence_timeout, abandons).
  void maybe_core_ends() {
    if (bridge_ || core_gone_ || !leases_.empty() || !host_leases_.empty()) return;
    core_gone_ = true;
    m.settle_fences();
  }

  // The fake's token of the one fence the last call recorded.
  std::uintptr_t learn_fence(const std::string& call) {
    std::vector<std::uintptr_t> fresh;
    for (const Fence f : fake_->pending_fences()) {
      const bool known = std::any_of(m.drops.begin(), m.drops.end(), [&](const FenceEntry& e) { return e.token == f.token; });
      if (!known) fresh.push_back(f.token);
    }
    if (fresh.size() != 1)
      fail(call + ": the model expects one new pending fence in the fake, it has " + std::to_string(fresh.size()));
    return fresh.front();
  }

  static std::uintptr_t queue_of(std::uint8_t p) { return 1 + p % 3u; }
  // Mostly a queue the fake blocks (when it blocks one), so fences pend.
  std::uintptr_t pick_queue(std::uint8_t p) const {
    if (m.blocked_queues.empty() || p % 4 == 0) return queue_of(p / 4);
    return *std::next(m.blocked_queues.begin(), static_cast<std::ptrdiff_t>(p / 4 % m.blocked_queues.size()));
  }

  void do_end_view(const Op& op) {
    if (leases_.empty()) return;
    if (m.close_pending && !m.config.end_views_while_close_pending) return;
    end_view(op.p[0] % leases_.size());
    if (bridge_) check_stats();
  }

  // At finish: view lease k ends after consumer queue 1 + k % 3 when bit
  // k % 5 of end_after_bits_ is set (fake), else at once.
  void end_all_leases() {
    while (!leases_.empty()) {
      const std::size_t k = leases_.size() - 1;
      if (m.fake() && (end_after_bits_ >> (k % 5) & 1u))
        end_view_after(k, queue_of(static_cast<std::uint8_t>(k)));
      else
        end_view(k);
    }
    while (!host_leases_.empty()) end_host_lease(host_leases_.size() - 1);
  }

  // ViewLease::end_after: no entry into the bridge (no reap, no state check):
  // a fence on the consumer's queue, pending while the fake blocks it, then
  // the lease ends. The host backend's consumers have no queues: Unsupported,
  // and the lease stays.
  void end_view_after(std::size_t k, std::uintptr_t queue) {
    const std::size_t i = leases_[k].alloc;
    const auto call = [&] { return "end_after(view of " + h_text(m.allocs[i].handle) + ", queue " + std::to_string(queue) + ")"; };
    const Expect x = m.fake() ? Expect::success() : Expect::error(ErrorKind::Unsupported);
    if (!expect_kind(call, x, attempt([&] { leases_[k].lease.end_after(ConsumerQueue{queue}); }))) {
      if (!leases_[k].lease) fail(call() + " threw, but ended the lease");
      return;
    }
    if (leases_[k].lease) fail(call() + " left the lease live");
    if (m.blocked_queues.count(queue)) {
      FenceEntry entry;
      entry.consumer = true;
      entry.queue = queue;
      entry.allocs = {i};
      // The last lease of a bridge already gone: the core ended inside the
      // call, settling (and giving back) the fence just recorded.
      const bool core_ended = !bridge_ && leases_.size() == 1 && host_leases_.empty();
      if (!core_ended) entry.token = learn_fence(call());
      m.add_fence(std::move(entry));
    }
    end_view(k);
  }

  void do_end_view_after(const Op& op) {
    // Meant to end a view: without one, it first takes a whole view of the
    // newest live allocation (a random sequence rarely has one live).
    if (leases_.empty() && op.p[2] % 4 != 0) {
      for (auto it = m.allocs.rbegin(); it != m.allocs.rend(); ++it) {
        if (!it->in_slot || it->released) continue;
        static const std::uint8_t shapes[] = {3, 0, 4, 0};  // scalar {}, vector {n}, matrix {1, n}, tensor {n}
        do_view(Op{OpKind::View, {0, 0, 1, 0, shapes[static_cast<int>(it->spec.shape) % 4], 0, 0, 0}});
        break;
      }
    }
    if (leases_.empty()) return;
    if (m.close_pending && !m.config.end_views_while_close_pending) return;
    end_view_after(op.p[0] % leases_.size(), pick_queue(op.p[1]));
    if (bridge_) check_stats();
  }

  void do_end_step_after(const Op& op) {
    const StepId step = step_id(op.p[0]);
    const std::uintptr_t queue = pick_queue(op.p[1]);
    m.enter();
    Expect x;
    if (auto e = m.entry()) x = Expect::error(*e);
    else if (!m.steps.count(step)) x = Expect::error(ErrorKind::UnknownDeviceHandle);
    else if (!m.fake()) x = Expect::error(ErrorKind::Unsupported);  // the step stays active
    const auto call = [&] { return "end_step(" + std::to_string(step) + ", queue " + std::to_string(queue) + ")"; };
    if (expect_kind(call, x, attempt([&] { bridge_->end_step(step, ConsumerQueue{queue}); }))) {
      const std::vector<std::size_t> held = m.steps[step];
      if (m.blocked_queues.count(queue)) {
        FenceEntry entry;
        entry.consumer = true;
        entry.queue = queue;
        entry.allocs = held;
        entry.token = learn_fence(call());
        m.add_fence(std::move(entry));
      }
      for (auto i : held) {
        --m.allocs[i].steps;
        m.maybe_finish_release(i);
      }
      m.steps.erase(step);
    }
    check_stats();
  }

  // After an operation that passes fences, the bridge notices only at its
  // next call: one time in two stats() is not asked (it would reap), so the
  // next operation's call must.
  void after_fences_passed(std::uint8_t p) {
    if (p & 1) check_stats();
    else check_backend_counts();
  }

  // Holding, with p1 & 1, then launches y = x over a live float32
  // allocation (a random sequence rarely launches one that is valid).
  void do_hold_launches(const Op& op) {
    const bool hold = op.p[0] & 1;
    if (!m.fake()) {
      // The host engine stays held; lifting it is a settle (launches run,
      // their fences pass, the bridge reaps them).
      if (!hold) settle();
      else if (op.p[1] & 1) launch_over_float32(op.p[3]);
      return check_stats();
    }
    fake_->hold_launches(hold);
    m.launches_held = hold;
    if (!hold) m.pass_fences(false, 0);
    if (hold && (op.p[1] & 1)) return launch_over_float32(op.p[3]);
    after_fences_passed(op.p[2]);
  }

  void launch_over_float32(std::uint8_t which) {
    // pick_handle(0, k) is the k-th live allocation, newest first.
    std::vector<std::uint8_t> candidates;
    std::size_t k = 0;
    for (auto it = m.allocs.rbegin(); it != m.allocs.rend() && k < 256; ++it) {
      if (!it->in_slot || it->released) continue;
      if (it->spec.dtype == DType::Float32) candidates.push_back(static_cast<std::uint8_t>(k));
      ++k;
    }
    if (candidates.empty()) return check_stats();
    const std::uint8_t b = candidates[which % candidates.size()];
    // x == y (p6 & 1), whole extent (p4 = 3), a = 2 and b = 1 or a = 1 and b = 0 (p7).
    do_axpy(Op{OpKind::Axpy, {0, b, 0, b, 3, 0, 1, static_cast<std::uint8_t>(which & 0x80 ? 11 : 1)}});
  }

  void do_block_queue(const Op& op) {
    if (!m.fake()) return;
    const std::uintptr_t queue = queue_of(op.p[1]);
    if (op.p[0] & 1) {
      fake_->block_consumer_queue(queue);
      m.blocked_queues.insert(queue);
    } else {
      fake_->unblock_consumer_queue(queue);
      m.blocked_queues.erase(queue);
      m.pass_fences(true, queue);
    }
    after_fences_passed(op.p[2]);
  }

  // One fence passes out of its queue's order: the bridge asks a queue only
  // about its oldest fence, so one behind a pending fence stays queued.
  void do_signal_fence(const Op& op) {
    if (!m.fake()) return;
    std::vector<std::size_t> pending;
    for (std::size_t k = 0; k < m.drops.size(); ++k)
      if (!m.drops[k].passed) pending.push_back(k);
    if (pending.empty() || op.p[0] % 8 == 7) {
      // One the fake does not hold pending: never issued, or passed already.
      std::uintptr_t token = op.p[1] & 1 ? std::numeric_limits<std::uintptr_t>::max() : 0;
      for (const auto& e : m.drops)
        if (e.passed && (op.p[1] & 2)) token = e.token;
      if (fake_->signal_fence(Fence{token})) fail("fake signal_fence(" + std::to_string(token) + ") of a fence not pending returned true");
      return check_backend_counts();
    }
    FenceEntry& entry = m.drops[pending[op.p[1] % pending.size()]];
    if (!fake_->signal_fence(Fence{entry.token}))
      fail("fake signal_fence(" + std::to_string(entry.token) + ") of a pending fence returned false");
    entry.passed = true;
    after_fences_passed(op.p[2]);
  }

  void do_inject(const Op& op) {
    if (!m.fake()) return;
    using fake::Call;
    using fake::Failure;
    // Faults that break the bridge (fatal) are 1 in 8, so sequences get deep.
    static const std::pair<Call, Failure> combos[] = {
        {Call::Allocate, Failure::AllocationFailed},
        {Call::CopyHostToDevice, Failure::CopyFailedAtSubmit},
        {Call::CopyHostToDevice, Failure::CopyFailedAtCompletion},
        {Call::CopyHostToDevice, Failure::LostCompletion},
        {Call::CopyHostToDevice, Failure::DuplicatedCompletion},
        {Call::CopyHostToDevice, Failure::LateCompletion},
        {Call::CopyDeviceToHost, Failure::CopyFailedAtSubmit},
        {Call::CopyDeviceToHost, Failure::CopyFailedAtCompletion},
        {Call::CopyDeviceToHost, Failure::LostCompletion},
        {Call::CopyDeviceToHost, Failure::DuplicatedCompletion},
        {Call::CopyDeviceToHost, Failure::LateCompletion},
        {Call::ValidateView, Failure::InvalidView},
        {Call::Quiesce, Failure::Fatal},  // restart and close fail, retried later
        {Call::CopyHostToDevice, Failure::CopyFailedAtCompletion},
        {Call::Allocate, Failure::Fatal},
        {Call::CopyHostToDevice, Failure::Fatal},
        {Call::CopyDeviceToHost, Failure::Fatal},
        {Call::Launch, Failure::Fatal},
        {Call::ValidateView, Failure::Fatal},
    };
    const unsigned pick = op.p[0] % 40;
    const auto& [call, failure] = combos[pick < 35 ? pick % 14 : 14 + pick - 35];
    const int nth = 1 + op.p[1] % 3;
    fake_->inject(call, failure, nth);
    m.injections.push_back({call, failure, nth});
  }

  void do_restart(const Op& op) {
    const Generation g = [&]() -> Generation {
      switch (op.p[0] % 8) {
        case 0: case 1: case 2: return m.gen + 1;
        case 3: return m.gen + (1ull << 32);
        case 4: return m.gen;
        case 5: return m.gen - 1;
        case 6: return 0;
        default: return std::numeric_limits<Generation>::max();
      }
    }();
    const auto call = [&] { return std::string("restart(" + std::to_string(g) + ")"); };
    Expect x;
    bool quiesce_fails = false;
    if (m.closed) x = Expect::error(ErrorKind::Closed);
    else if (g <= m.gen) x = Expect::error(ErrorKind::OldGenerationHandle);
    else if (m.fake() && m.fire(fake::Call::Quiesce).fatal) {
      quiesce_fails = true;
      x = Expect::either({ErrorKind::Unavailable, ErrorKind::Broken});
    }
    const auto error = attempt([&] { bridge_->restart(g); });
    if (!expect_kind(call, x, error)) {
      if (quiesce_fails) m.broken = true;  // nothing freed, unpinned or retired; old generation
      return check_stats();
    }
    m.quiesce_succeeded();
    m.retire_generation();
    m.gen = g;
    m.broken = false;
    m.evicted_in_generation = false;
    ++m.restarts;
    host_launches_.clear();
    if (!m.fake()) host_raw_->test_controls()->hold_copies(true);
    check_stats();
  }

  void do_record(const Op& op) {
    switch (op.p[0] % 3) {
      case 0: {
        RecordOptions options;
        options.max_events = 1 + op.p[1] % 64;
        const Expect x = m.closed ? Expect::error(ErrorKind::Closed) : Expect::success();
        expect_kind([&] { return "record(" + std::to_string(options.max_events) + ")"; }, x,
                    attempt([&] { bridge_->record(options); }));
        return;
      }
      case 1:
        bridge_->stop_recording();
        return;
      default: {
        std::string trace, snapshot;
        if (const auto error = attempt([&] {
              trace = bridge_->trace_json();
              snapshot = bridge_->memory_snapshot_json();
            }))
          return fail("a dump threw " + kind_text(error->kind()));
        const auto parsed = nlohmann::json::parse(trace, nullptr, false);
        if (parsed.is_discarded()) return fail("trace_json() is not JSON");
        if (const auto problem = testing::trace_problem(parsed); !problem.empty()) return fail("trace: " + problem);
        if (nlohmann::json::parse(snapshot, nullptr, false).is_discarded()) fail("memory_snapshot_json() is not JSON");
        return;
      }
    }
  }

  void do_close() {
    Expect x;
    const bool already = m.closed && !m.close_pending;
    if (already) x = Expect{true, {ErrorKind::Closed}};  // a second close: harmless
    else if (m.fake() && m.fire(fake::Call::Quiesce).fatal) {
      x = Expect::either({ErrorKind::Unavailable, ErrorKind::Broken, ErrorKind::Closed});
    }
    const auto error = attempt([&] { bridge_->close(); });
    if (already) {
      if (error && error->kind() != ErrorKind::Closed) fail("a second close() threw " + kind_text(error->kind()));
      return check_stats();
    }
    if (!expect_kind("close()", x, error)) {
      // As for restart: Broken too, so the retried close's successful
      // quiesce does not drain completions the lost device reported.
      m.closed = true;
      m.close_pending = true;
      m.broken = true;
      return check_stats();
    }
    m.quiesce_succeeded();
    m.retire_generation();
    m.settle_fences();  // consumers' fences: waited for (1 ms), then abandoned
    host_launches_.clear();
    m.closed = true;
    m.close_pending = false;
    if (m.host_leases == 0) m.ring_freed = true;
    check_stats();
  }

  void do_read_device(const Op& op) {
    if (m.allocs.empty()) return;
    const std::size_t n = m.allocs.size();
    Alloc& a = m.allocs[n - 1 - op.p[0] % std::min<std::size_t>(n, 12)];
    if (!a.in_backend) return;
    if (host_pending()) {
      settle();
      if (host_pending()) return;  // broken or closed: the engine may still run them
      if (!a.in_backend) return;   // a deferred free finished as the copies did
    }
    const auto* base = reinterpret_cast<const std::byte*>(a.address);
    compare_bytes([&] { return "device bytes of " + h_text(a.handle); }, base, m.device_bytes(a), a.extent);
  }

  // ---- registered host memory and adoption ----
  void do_register(const Op& op) {
    const RegisterSpan span = pick_register_span(op.p[0]);
    const bool read_only = op.p[1] & 1;
    // The caller's bytes change only while no region holds them.
    if ((op.p[1] & 2) && span.arena && !m.arena_held(span.begin, span.len))
      fill_pattern(span.data, &m.arena_bytes[span.begin], span.len, op.p[3]);
    if (m.fake() && op.p[2] % 32 >= 30) {
      const auto failure = op.p[2] % 32 == 31 ? fake::Failure::AllocationFailed : fake::Failure::Fatal;
      fake_->inject(fake::Call::RegisterHost, failure, 1);
      m.injections.push_back({fake::Call::RegisterHost, failure, 1});
    }
    const auto call = [&] {
      return std::string(read_only ? "register_host_read_only(" : "register_host(") +
             std::to_string(reinterpret_cast<std::uintptr_t>(span.data)) + ", " + std::to_string(span.len) + ")";
    };
    // An empty span, or one past the address space, is refused before the
    // call enters the bridge.
    Expect x;
    if (span.len == 0) {
      x = Expect::error(ErrorKind::InvalidExtent);
    } else if (!checked::add(std::uint64_t{reinterpret_cast<std::uintptr_t>(span.data)}, span.len)) {
      x = Expect::error(ErrorKind::InvalidRange);
    } else {
      m.enter();
      if (auto e = m.entry()) {
        x = Expect::error(*e);
      } else if (!span.arena || m.arena_held(span.begin, span.len)) {
        x = Expect::error(ErrorKind::InvalidRange);  // the ring's bytes, or a held region's
      } else if (m.fake()) {
        const Fired fired = m.fire(fake::Call::RegisterHost);
        if (fired.fatal) {
          x = Expect::error(ErrorKind::Unavailable);
          m.broken = true;
        } else if (fired.allocation_failed) {
          x = Expect::error(ErrorKind::AllocationFailed);
        }
      }
    }
    HostRegion h;
    const auto error = attempt([&] {
      h = read_only ? bridge_->register_host_read_only(std::span<const std::byte>(span.data, span.len))
                    : bridge_->register_host(std::span<std::byte>(span.data, span.len));
    });
    if (expect_kind(call, x, error)) {
      if (h.domain != m.domain || h.generation != m.gen) fail(call() + " returned " + g_text(h) + " tagged wrongly");
      if (!m.region_ids.insert(h.id).second) fail(call() + " returned an id already issued: " + g_text(h));
      m.regions.push_back(Region{h, span.begin, span.len, read_only, true, 0});
    }
    check_stats();
  }

  void do_unregister(const Op& op) {
    const HostRegion h = pick_region(op.p[0], op.p[1], Want::Any);
    m.enter();
    Expect x;
    std::size_t i = 0;
    if (auto e = m.entry()) x = Expect::error(*e);
    else if (auto e2 = m.region_error(h, &i)) x = Expect::error(*e2);
    else {
      // The bridge first applies the completions the backend holds (a copy
      // that ended unpolled keeps nothing registered), then looks.
      if (m.regions[i].copies != 0 && !m.broken) m.drain();
      if (m.regions[i].copies || m.adoptions(i)) x = Expect::error(ErrorKind::AllocationStillInUse);
    }
    if (expect_kind([&] { return "unregister_host(" + g_text(h) + ")"; }, x, attempt([&] { bridge_->unregister_host(h); })))
      m.regions[i].live = false;
    check_stats();
  }

  // adopt_host: mostly of a live read-only region, a range at offsets and of
  // lengths in whole units of the spec (the dtype, or the alignment), some
  // unaligned, past the region's end or hostile; the spec as alloc_device's.
  void do_adopt(const Op& op) {
    if (op.p[7] / 8 % 4 != 0) ensure_region(1, Want::ReadOnly, true);
    const HostRegion h = pick_region(op.p[0], op.p[1], Want::ReadOnly);
    const Region* reg = region_of(h);
    const std::uint64_t region_len = reg ? reg->len : 4096;
    const std::optional<DType> dtype = pick_dtype(op.p[2], op.p[7]);
    const std::uint64_t align = pick_alignment(op.p[3]);
    const std::uint64_t unit = extent_unit(dtype, align);
    std::uint64_t offset;
    switch (op.p[4] % 8) {
      case 0: case 1: case 2: offset = 0; break;
      case 3: case 4: offset = unit * (op.p[4] / 8 % 8); break;
      case 5: offset = 4 * (op.p[4] / 8 % 32); break;
      case 6: offset = hostile(op.p[4] / 8); break;
      default: offset = region_len; break;
    }
    const std::uint64_t rest = region_len > offset ? region_len - offset : 0;
    std::uint64_t len;
    switch (op.p[5] % 8) {
      case 0: case 1: case 2: len = rest / unit * unit; break;  // all it holds
      case 3: case 4: len = unit * (1 + op.p[5] / 8 % 16); break;
      case 5: len = rest + unit; break;
      case 6: len = op.p[5] & 0x80 ? 0 : hostile(op.p[5] / 8); break;
      default: len = unit * (1 + op.p[5] / 8 % 4) + 1; break;
    }
    const ObjectSpec spec{pick_max_extent(op.p[6], len), align, dtype, static_cast<ShapeKind>(op.p[6] / 8 % 4)};
    const RegionRange range{h, offset, len};
    const auto call = [&] {
      return "adopt_host(" + rr_text(range) + ", align " + std::to_string(align) + ", max " +
             std::to_string(spec.max_extent) + ", " + std::string(spec_dtype_name(spec)) + ")";
    };
    // The spec and length are refused before the call enters the bridge.
    Expect x;
    std::size_t ri = 0;
    if (auto e = allocation_error(spec, len)) {
      x = Expect::error(*e);
    } else {
      m.enter();
      if (auto e1 = m.entry()) x = Expect::error(*e1);
      else if (auto e2 = m.region_error(h, &ri)) x = Expect::error(*e2);
      else if (offset > m.regions[ri].len || len > m.regions[ri].len - offset || !m.regions[ri].read_only)
        x = Expect::error(ErrorKind::InvalidRange);
      else if ((reinterpret_cast<std::uintptr_t>(arena()) + m.regions[ri].begin + offset) % align)
        x = Expect::error(ErrorKind::InvalidAlignment);  // the first byte's address
    }
    DeviceHandle got;
    if (expect_kind(call, x, attempt([&] { got = bridge_->adopt_host(range, spec); }))) {
      if (got.domain != m.domain || got.generation != m.gen) fail(call() + " returned " + h_text(got) + " tagged wrongly");
      if (!m.handle_ids.insert({got.generation, got.id}).second)
        fail(call() + " returned an id already issued in this generation: " + h_text(got));
      Alloc a;
      a.handle = got;
      a.spec = spec;
      a.extent = len;
      a.region = ri;
      a.arena_offset = m.regions[ri].begin + offset;
      a.address = reinterpret_cast<std::uintptr_t>(arena()) + a.arena_offset;  // in place: views say so
      m.allocs.push_back(std::move(a));
    }
    check_stats();
  }

  // region_bytes: the registered bytes, which the caller writes (p2 & 1,
  // only where it registered them writable: adopted memory never changes)
  // or reads back; then region_retained of the same, perhaps forged, handle.
  void do_region_bytes(const Op& op) {
    const bool write = op.p[2] & 1;
    const HostRegion h = pick_region(op.p[0], op.p[1], write ? Want::Writable : Want::Any);
    m.enter();
    Expect x;
    std::size_t i = 0;
    if (auto e = m.entry()) x = Expect::error(*e);
    else if (auto e2 = m.region_error(h, &i)) x = Expect::error(*e2);
    std::span<std::byte> got;
    const auto call = [&] { return "region_bytes(" + g_text(h) + ")"; };
    if (expect_kind(call, x, attempt([&] { got = bridge_->region_bytes(h); }))) {
      const Region& r = m.regions[i];
      if (got.data() != arena() + r.begin || got.size() != r.len) fail(call() + " is not the bytes registered");
      if (write && !r.read_only) fill_pattern(got.data(), &m.arena_bytes[r.begin], r.len, op.p[3]);
      else compare_bytes(call, got.data(), &m.arena_bytes[r.begin], r.len);
    }
    check_retained(h);
    check_stats();
  }

  // Host leases keep the ring's memory past close() until they end.
  void do_lease_host(const Op& op) {
    const HostRange r = pick_range(op.p[0], op.p[1], 64);
    Expect x;
    if (m.closed) x = Expect::error(ErrorKind::Closed);
    else if (!m.ring.locate(r)) x = Expect::error(ErrorKind::InvalidRange);
    HostLease lease;
    if (expect_kind([&] { return "lease_host(" + r_text(r) + ")"; }, x, attempt([&] { lease = bridge_->lease_host(r); }))) {
      if (lease.bytes().size() != r.len || (ring_block_ && lease.bytes().data() != ring_block_ + r.offset))
        fail("lease_host(" + r_text(r) + ") is not the ring's bytes at that offset");
      ++m.host_leases;
      host_leases_.push_back({std::move(lease), r});
    }
    check_stats();
  }
  void do_end_host_lease(const Op& op) {
    if (host_leases_.empty()) return;
    const std::size_t k = op.p[0] % host_leases_.size();
    // The bytes stay readable (and hold what the model says) until it ends.
    const HostLeaseRec& rec = host_leases_[k];
    compare_bytes([&] { return "host lease " + r_text(rec.range); }, rec.lease.bytes().data(), &m.ring_bytes[rec.range.offset], rec.range.len);
    end_host_lease(k);
    if (bridge_) check_stats();
  }
  void end_host_lease(std::size_t k) {
    host_leases_.erase(host_leases_.begin() + static_cast<std::ptrdiff_t>(k));
    --m.host_leases;
    if (m.closed && !m.close_pending && m.host_leases == 0) m.ring_freed = true;
    maybe_core_ends();
  }

  Model m;
  // The memory it registers; declared before the bridge, so it outlives it.
  std::unique_ptr<Page[]> arena_ = std::make_unique<Page[]>(kArenaPages);
  std::shared_ptr<fake::FakeBackend> fake_;
  std::shared_ptr<RecordingFake::Made> fake_made_ = std::make_shared<RecordingFake::Made>();
  std::unique_ptr<Backend> host_;
  std::shared_ptr<Backend> host_shared_;
  Backend* host_raw_ = nullptr;
  std::unique_ptr<Bridge> bridge_;
  std::byte* ring_block_ = nullptr;
  struct LeaseRecord {
    ViewLease lease;
    std::size_t alloc;
  };
  std::vector<LeaseRecord> leases_;
  struct HostLeaseRec {
    HostLease lease;
    HostRange range;
  };
  std::vector<HostLeaseRec> host_leases_;
  std::vector<HostRange> ranges_;
  std::vector<Op> trace_;
  // Host backend: what the held launches read and write (a sync copy over
  // those bytes waits for them: settle first). Cleared when they ran.
  std::vector<Access> host_launches_;
  std::uint8_t end_after_bits_ = 0;
  bool core_gone_ = false;
};

}  // namespace devbridge::model
