// A small reference model of the bridge contract (../shared/spec/CONTRACT.md,
// including Version 2's "Faults during restart and close" and "Bounded
// records, hostile input"), shared by the libFuzzer target (tests/fuzz/) and
// the rapidcheck state-machine test (tests/core/state_machine_test.cpp).
//
// The model is plain data: allocations (spec, extent, released, uses, bytes),
// the host ring (the same placement rule the contract's ring follows: aligned,
// never spanning the end, the tail advancing over the released prefix only),
// copy events (pending / completed / failed / forgotten), the bounded log of
// failed copies, registered host regions (live, or retained past a restart or
// close for an adopted allocation a view or fence still holds) over a small
// arena the harness owns, allocations adopted from them (read-only, their
// bytes the arena's), generations, Broken and Closed, the fake backend's injections
// and queues, the drop queue (uses that end at a fence: launches, steps and
// views ended after a consumer's queue; when each is reaped, what restart
// orphans and close abandons), and the statistics the bridge must report. It predicts the
// outcome of each call (one error kind, or a small set where the contract does
// not order two checks); harness.hpp runs the same call on a real Bridge and
// compares. Byte contents are tracked per byte; kUnknown marks a byte whose
// value the contract does not fix (fresh host-backend memory).
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "devbridge/backends/fake.hpp"
#include "devbridge/bridge.hpp"

namespace devbridge::model {

using Byte = std::int16_t;
inline constexpr Byte kUnknown = -1;
inline constexpr Byte kFakeFresh = 0xA5;  // the fake fills fresh memory with it

enum class BackendKind : std::uint8_t { Fake, Host };

struct Config {
  BackendKind backend = BackendKind::Fake;
  std::uint64_t ring_bytes = 4096;
  std::uint64_t inflight_budget_bytes = 0;  // 0: the ring size
  std::uint32_t failed_record_limit = 1024;
  // Refuse, Allow, or Wait with a zero timeout (refuses like Refuse, through
  // the waiting path): a single-threaded harness never ends a view meanwhile.
  WritesUnderView writes_under_view = WritesUnderView::Allow;
  std::uint64_t fake_memory = 4ull << 20;   // the fake's device memory
  // The contract: a view's rank must match the object's shape kind
  // (scalar 0, vector 1, matrix 2, tensor any), else InvalidTensorView.
  bool check_rank = true;
  // Views with a stride of INT64_MAX (their reach then ends exactly at
  // INT64_MAX elements); false uses INT64_MAX / 2, to look past a known finding.
  bool max_strides = true;
  // End views between a close whose quiesce failed and its retry; false
  // skips that, to look past a known finding.
  bool end_views_while_close_pending = true;

  // DEVBRIDGE_MODEL_RELAX (environment, comma-separated) lets a run look past
  // known findings: `rank`, `ring` (no ring sizes near 2^64), `stride`,
  // `closeview`, `guess` turn off the checks and inputs above.
  bool hostile_rings = true;
  // Forge events with small, guessable ids (the ids a failed copy used).
  bool guessed_ids = true;
  // Print the model's and the bridge's state after every operation (triage).
  bool trace = false;
  void relax(const char* list) {
    if (!list) return;
    const std::string s = list;
    if (s.find("rank") != std::string::npos) check_rank = false;
    if (s.find("ring") != std::string::npos) hostile_rings = false;
    if (s.find("stride") != std::string::npos) max_strides = false;
    if (s.find("closeview") != std::string::npos) end_views_while_close_pending = false;
    if (s.find("guess") != std::string::npos) guessed_ids = false;
  }
};

// ---- the host ring --------------------------------------------------------

struct RingModel {
  struct Res {
    std::uint64_t begin = 0;  // logical position
    std::uint64_t offset = 0;
    std::uint64_t len = 0;
    std::uint64_t key = 0;  // the model's own name for it
    std::uint32_t pins = 0;
    bool released = false;
  };
  std::uint64_t cap = 0;
  std::deque<Res> res;
  std::uint64_t head = 0, tail = 0, tail_offset = 0, next_key = 1;
  std::size_t live = 0;

  std::uint64_t used() const { return head - tail; }

  static bool pow2(std::uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

  std::optional<ErrorKind> reserve(std::uint64_t n, std::uint64_t alignment, HostRange& out) {
    if (!pow2(alignment) || alignment > 4096) return ErrorKind::InvalidAlignment;
    if (n == 0 || n > cap) return ErrorKind::InvalidRange;
    if (res.empty()) {
      head = tail = (head + cap - 1) / cap * cap;
      tail_offset = 0;
    }
    const std::uint64_t head_offset = head % cap;
    std::uint64_t offset = (head_offset + alignment - 1) & ~(alignment - 1);
    if (offset + n > cap) offset = 0;
    const std::uint64_t begin = offset >= head_offset ? head + (offset - head_offset) : head + (cap - head_offset);
    if (begin + n - tail > cap) return ErrorKind::Backpressure;
    res.push_back(Res{begin, offset, n, next_key++, 0, false});
    ++live;
    head = begin + n;
    out = HostRange{offset, n};
    return std::nullopt;
  }

  // The live reservation that holds all of `r`, or nullptr.
  Res* locate(HostRange r) {
    if (cap == 0 || r.len == 0 || r.offset >= cap || r.len > cap - r.offset) return nullptr;
    for (auto& x : res)
      if (!x.released && x.offset <= r.offset && r.offset + r.len <= x.offset + x.len) return &x;
    return nullptr;
  }
  Res* by_key(std::uint64_t key) {
    for (auto& x : res)
      if (x.key == key) return &x;
    return nullptr;
  }

  std::optional<ErrorKind> release(HostRange r) {
    Res* x = locate(r);
    if (!x || x->offset != r.offset || x->len != r.len) return ErrorKind::InvalidRange;
    if (x->pins > 0) return ErrorKind::AllocationStillInUse;
    x->released = true;
    --live;
    while (!res.empty() && res.front().released) res.pop_front();
    if (res.empty()) {
      tail = head;
      tail_offset = cap ? head % cap : 0;
    } else {
      tail = res.front().begin;
      tail_offset = res.front().offset;
    }
    return std::nullopt;
  }
  void unpin(std::uint64_t key) {
    if (Res* x = by_key(key); x && x->pins > 0) --x->pins;
  }
  void unpin_all() {
    for (auto& x : res) x.pins = 0;
  }
};

// ---- allocations, events --------------------------------------------------

// The harness's host memory for registrations: a few pages, 4096-aligned.
inline constexpr std::uint64_t kArenaPages = 4;
inline constexpr std::uint64_t kArenaBytes = kArenaPages * 4096;

// A registered host region (Bridge::register_host), by the arena bytes it covers.
struct Region {
  HostRegion handle;
  std::uint64_t begin = 0, len = 0;  // in the arena
  bool read_only = false;
  bool live = true;          // registered in its generation, usable (until unregister, restart or close)
  std::uint32_t copies = 0;  // async copies in flight that pin it
};

struct Alloc {
  DeviceHandle handle;
  ObjectSpec spec;
  std::uint64_t extent = 0;
  bool in_slot = true;     // in the bridge's table (live_allocations counts it), handle of the current generation
  bool released = false;   // deferred free asked: the handle is refused from now on
  bool in_backend = true;  // the backend still holds its memory
  bool orphan = false;     // kept past restart/close only for live views and pending fences
  bool abandoned = false;  // close gave up on a fence holding it: never freed
  std::uint32_t copies = 0, uploads = 0, steps = 0, views = 0;
  std::uint32_t fences = 0;  // uses waiting in the drop queue (one per id an entry holds)
  std::uint64_t address = 0;
  std::vector<Byte> bytes;  // kept after the free: a copy the fake still runs reads them
  // Adopted (Bridge::adopt_host) from this region: read-only, its bytes the
  // arena's from arena_offset (`bytes` stays empty); in_backend then means
  // the backend still holds the adoption, which keeps the region registered.
  std::optional<std::size_t> region;
  std::uint64_t arena_offset = 0;
  bool adopted() const { return region.has_value(); }
  bool used() const { return copies || steps || views || fences; }
};

// One entry of the bridge's drop queue: a fence and the uses it holds.
struct FenceEntry {
  std::uintptr_t token = 0;  // the fake's token (learned when recorded); 0 on the host backend
  bool consumer = false;     // a consumer's queue; else the compute queue (a launch)
  std::uintptr_t queue = 0;  // the consumer's queue
  bool passed = false;       // the backend says it passed (the bridge notices at its next reap)
  std::vector<std::size_t> allocs;  // one per use (an allocation may repeat: axpy with x == y)
  bool same_queue(const FenceEntry& o) const { return consumer == o.consumer && queue == o.queue; }
};

enum class EvState : std::uint8_t { Pending, Completed, Failed, Forgotten, Retired };

struct Event {
  CopyEvent event;
  bool sync = false;
  CopyDirection dir = CopyDirection::HostToDevice;
  std::size_t alloc = 0;
  std::uint64_t dev_offset = 0;
  HostRange host;          // in the ring, or in the arena for a region's copy
  std::optional<std::size_t> region;  // the registered region it copies to or from
  CopyLayout layout;       // pitched when rows != 0
  std::uint64_t bytes = 0;  // moved: host.len, or rows * row_bytes
  std::uint64_t ring_key = 0;  // the ring reservation it pins (none for a region's copy)
  EvState state = EvState::Completed;
  bool observed = false;
  ErrorKind error = ErrorKind::DeviceCopyFailed;
};

struct Injection {
  fake::Call call;
  fake::Failure failure;
  int remaining;
};

struct Fired {
  bool allocation_failed = false, submit_failed = false, fail_at_completion = false, invalid_view = false,
       lost = false, duplicated = false, late = false, fatal = false;
};

// A copy the backend still holds (fake: until the test completes it; host:
// until the harness lets the held engine run).
struct BackendCopy {
  std::size_t event = 0;
  bool fail_at_completion = false, lost = false, duplicated = false, late = false;
};

struct ReadyCompletion {
  CopyEvent event;
  bool ok = true;
};

// The model's expectation of one call: success, or an error of one of `kinds`.
struct Expect {
  bool ok = true;
  std::vector<ErrorKind> kinds;
  static Expect success() { return {}; }
  static Expect error(ErrorKind k) { return {false, {k}}; }
  static Expect either(std::initializer_list<ErrorKind> ks) { return {false, ks}; }
  bool accepts(ErrorKind k) const { return std::find(kinds.begin(), kinds.end(), k) != kinds.end(); }
};

struct Model {
  Config config;
  std::uint64_t domain = 0;
  Generation gen = 1;
  bool broken = false;
  bool closed = false;
  bool close_pending = false;  // closed, but the quiesce failed: memory still held
  bool ring_freed = false;
  std::uint32_t host_leases = 0;

  RingModel ring;
  std::vector<Byte> ring_bytes;  // the ring's contents (outside RingModel: that one is copied per call)
  std::vector<Byte> arena_bytes;  // the harness's host memory (registered regions, adopted allocations)
  std::vector<Region> regions;    // every region ever registered, in order
  std::vector<Alloc> allocs;  // every allocation ever made, in order
  std::vector<Event> events;  // every event ever issued
  std::set<std::pair<Generation, std::uint64_t>> handle_ids, event_ids;  // issued, per generation
  std::set<std::uint64_t> region_ids;  // issued (region ids are never reused within a domain)
  std::map<StepId, std::vector<std::size_t>> steps;
  std::deque<std::size_t> failure_log;  // failed events remembered, oldest first
  bool evicted_in_generation = false;   // a completed event may then read UnknownDeviceHandle

  // Backend side.
  std::vector<Injection> injections;
  std::deque<BackendCopy> backend_pending;
  std::vector<ReadyCompletion> ready;
  std::vector<ReadyCompletion> late_after_quiesce;
  bool late_released = false;
  std::uint64_t fake_used = 0;

  // The drop queue, oldest first, and what passes its fences (fake: held
  // launches, blocked consumer queues).
  std::vector<FenceEntry> drops;
  bool launches_held = false;
  std::set<std::uintptr_t> blocked_queues;
  std::uint64_t abandoned_fences = 0;

  // Statistics.
  std::uint64_t inflight_bytes = 0;
  std::uint64_t submitted = 0, completed = 0, failed = 0, stale = 0, restarts = 0;
  std::uint64_t evicted_lo = 0, evicted_hi = 0;  // forgotten unobserved failures: log overflow (lo), + restart (hi)
  bool counters_exact = true;  // false once a restart/close retired completions the bridge may or may not have applied

  bool fake() const { return config.backend == BackendKind::Fake; }
  std::uint64_t budget() const { return config.inflight_budget_bytes ? config.inflight_budget_bytes : ring.cap; }

  // ---- checks every entry makes ----
  std::optional<ErrorKind> entry() const {
    if (closed) return ErrorKind::Closed;
    if (broken) return ErrorKind::Broken;
    return std::nullopt;
  }
  template <class Tagged>
  std::optional<ErrorKind> tag_error(const Tagged& t) const {
    if (t.domain != domain) return ErrorKind::ForeignDomain;
    if (t.generation < gen) return ErrorKind::OldGenerationHandle;
    if (t.generation > gen) return ErrorKind::UnknownDeviceHandle;
    return std::nullopt;
  }
  // The live, usable allocation `h` names, or an error.
  std::optional<ErrorKind> handle_error(const DeviceHandle& h, std::size_t* index = nullptr) const {
    if (auto e = tag_error(h)) return e;
    for (std::size_t i = allocs.size(); i-- > 0;) {
      const Alloc& a = allocs[i];
      if (a.handle == h && a.in_slot && !a.released) {
        if (index) *index = i;
        return std::nullopt;
      }
    }
    return ErrorKind::UnknownDeviceHandle;
  }
  // The live region of this generation `r` names, or an error.
  std::optional<ErrorKind> region_error(const HostRegion& r, std::size_t* index = nullptr) const {
    if (auto e = tag_error(r)) return e;
    for (std::size_t i = regions.size(); i-- > 0;)
      if (regions[i].handle == r && regions[i].live) {
        if (index) *index = i;
        return std::nullopt;
      }
    return ErrorKind::UnknownDeviceHandle;
  }
  // Allocations adopted from region i that the backend still holds: they
  // keep it registered (unregister_host refuses; past a restart or close it
  // is retained until the last goes).
  std::uint32_t adoptions(std::size_t i) const {
    std::uint32_t n = 0;
    for (const auto& a : allocs) n += a.region == i && a.in_backend;
    return n;
  }
  // The backend still has region i registered.
  bool held(std::size_t i) const { return regions[i].live || adoptions(i) > 0; }
  // Any region the backend holds covers some of arena bytes [begin, begin + len).
  bool arena_held(std::uint64_t begin, std::uint64_t len) const {
    for (std::size_t i = 0; i < regions.size(); ++i)
      if (held(i) && begin < regions[i].begin + regions[i].len && regions[i].begin < begin + len) return true;
    return false;
  }
  // Bridge::region_retained: the bridge still holds the region's memory
  // (live, including after a close whose quiesce failed, or retained for an
  // adoption). A handle never issued names none.
  bool region_retained(const HostRegion& r) const {
    if (r.domain != domain || r.generation > gen) return false;
    for (std::size_t i = 0; i < regions.size(); ++i)
      if (regions[i].handle == r) return held(i);
    return false;
  }

  // An allocation's device bytes: its own, or the arena's when adopted.
  Byte* device_bytes(Alloc& a) { return a.region ? &arena_bytes[a.arena_offset] : a.bytes.data(); }
  const Byte* device_bytes(const Alloc& a) const { return a.region ? &arena_bytes[a.arena_offset] : a.bytes.data(); }
  Byte* host_bytes(const Event& ev) { return (ev.region ? arena_bytes : ring_bytes).data() + ev.host.offset; }

  // The event `e` names in the current generation, or nullopt (never issued here).
  std::optional<std::size_t> find_event(const CopyEvent& e) const {
    if (e.domain != domain || e.generation != gen) return std::nullopt;
    for (std::size_t i = events.size(); i-- > 0;)
      if (events[i].event == e) return i;
    return std::nullopt;
  }

  // ---- the fake's injections ----
  Fired fire(fake::Call call) {
    Fired f;
    for (auto it = injections.begin(); it != injections.end();) {
      if (it->call != call || --it->remaining > 0) {
        ++it;
        continue;
      }
      switch (it->failure) {
        case fake::Failure::AllocationFailed: f.allocation_failed = true; break;
        case fake::Failure::CopyFailedAtSubmit: f.submit_failed = true; break;
        case fake::Failure::CopyFailedAtCompletion: f.fail_at_completion = true; break;
        case fake::Failure::InvalidView: f.invalid_view = true; break;
        case fake::Failure::LostCompletion: f.lost = true; break;
        case fake::Failure::DuplicatedCompletion: f.duplicated = true; break;
        case fake::Failure::LateCompletion: f.late = true; break;
        case fake::Failure::Fatal: f.fatal = true; break;
      }
      it = injections.erase(it);
    }
    return f;
  }

  // ---- uses ----
  // For an adopted allocation: the adoption ends (its region goes too if
  // it was retained only for it).
  void free_in_backend(Alloc& a) {
    if (!a.in_backend) return;
    a.in_backend = false;
    if (fake() && !a.adopted()) fake_used -= a.extent;
  }
  void maybe_finish_release(std::size_t i) {
    Alloc& a = allocs[i];
    if (a.released && a.in_slot && !a.used()) {
      a.in_slot = false;
      free_in_backend(a);
    }
  }
  // An orphan goes back to the backend with its last view and fence, unless
  // close abandoned it.
  void maybe_free_orphan(std::size_t i) {
    Alloc& a = allocs[i];
    if (a.orphan && a.views == 0 && a.fences == 0 && !a.abandoned) free_in_backend(a);
  }

  // ---- the drop queue ----
  std::uint64_t fences_recorded = 0;  // entries ever added (coverage)
  std::uint64_t regions_retained = 0;  // regions a restart or close retained for an adoption (coverage)
  void add_fence(FenceEntry entry) {
    ++fences_recorded;
    for (auto i : entry.allocs) ++allocs[i].fences;
    drops.push_back(std::move(entry));
  }
  void end_fenced_uses(const FenceEntry& entry) {
    for (auto i : entry.allocs) {
      Alloc& a = allocs[i];
      if (a.fences) --a.fences;
      if (a.in_slot)
        maybe_finish_release(i);
      else
        maybe_free_orphan(i);
    }
  }
  // The bridge's reap: oldest first; once a queue has a fence not passed (or
  // one behind it), its later fences wait, even if they passed (a queue runs
  // in order, so the bridge does not ask).
  void reap() {
    std::vector<FenceEntry> kept, blocked;
    for (auto& entry : drops) {
      const bool queue_blocked =
          std::any_of(blocked.begin(), blocked.end(), [&](const FenceEntry& b) { return b.same_queue(entry); });
      if (!queue_blocked && entry.passed) {
        end_fenced_uses(entry);
        continue;
      }
      if (!queue_blocked) blocked.push_back(entry);
      kept.push_back(std::move(entry));
    }
    drops = std::move(kept);
  }
  // Every call that enters the bridge (enter_slow) and stats() reap while
  // the bridge is not closed.
  void enter() {
    if (!closed) reap();
  }
  // stats() reaps after a close that finished too: a lease ended on a
  // consumer's queue after close holds its memory by a fence no other call
  // looks at again (not after a close whose quiesce failed: close_pending).
  void enter_stats() {
    if (!closed || !close_pending) reap();
  }
  // close, and the core's end after its last lease: every fence still in the
  // queue is waited for (close_fence_timeout); those that did not pass are
  // abandoned, and the memory they hold is never freed.
  void settle_fences() {
    reap();
    for (const auto& entry : drops) {
      if (entry.passed) {
        end_fenced_uses(entry);
        continue;
      }
      ++abandoned_fences;
      for (auto i : entry.allocs) {
        Alloc& a = allocs[i];
        if (!a.orphan) continue;  // the bridge looks only among orphans
        a.abandoned = true;
        if (a.fences) --a.fences;
      }
    }
    drops.clear();
  }
  void pass_fences(bool consumer, std::uintptr_t queue) {
    for (auto& entry : drops)
      if (entry.consumer == consumer && (!consumer || entry.queue == queue)) entry.passed = true;
  }
  std::uint64_t pending_fence_count() const {
    std::uint64_t n = 0;
    for (const auto& entry : drops) n += !entry.passed;
    return n;
  }
  void pin(Event& ev) {
    Alloc& a = allocs[ev.alloc];
    ++a.copies;
    if (ev.dir == CopyDirection::HostToDevice) ++a.uploads;
    if (ev.region) ++regions[*ev.region].copies;
    else if (auto* r = ring.by_key(ev.ring_key)) ++r->pins;
  }
  void unpin(Event& ev) {
    Alloc& a = allocs[ev.alloc];
    if (a.copies) --a.copies;
    if (ev.dir == CopyDirection::HostToDevice && a.uploads) --a.uploads;
    if (ev.region) {
      if (regions[*ev.region].copies) --regions[*ev.region].copies;
    } else {
      ring.unpin(ev.ring_key);
    }
    maybe_finish_release(ev.alloc);
  }

  // The bytes of a copy move (in the backend, whatever the bridge thinks).
  void move_bytes(const Event& ev) {
    Byte* const host_base = host_bytes(ev);
    Byte* const dev_base = device_bytes(allocs[ev.alloc]) + ev.dev_offset;
    const CopyLayout whole{1, ev.host.len, ev.host.len, ev.host.len};
    const CopyLayout& layout = ev.layout.pitched() ? ev.layout : whole;
    for (std::uint64_t row = 0; row < layout.rows; ++row)
      for (std::uint64_t i = 0; i < layout.row_bytes; ++i) {
        Byte& host = host_base[row * layout.host_pitch + i];
        Byte& dev = dev_base[row * layout.device_pitch + i];
        if (ev.dir == CopyDirection::HostToDevice)
          dev = host;
        else
          host = dev;
      }
  }

  // ---- failed-record log ----
  void forget(std::size_t i) {
    Event& ev = events[i];
    ev.state = EvState::Forgotten;
    evicted_in_generation = true;
    if (!ev.observed) ++evicted_lo, ++evicted_hi;
  }
  void remember_failure(std::size_t i) {
    if (config.failed_record_limit == 0) return forget(i);
    if (failure_log.size() >= config.failed_record_limit) {
      forget(failure_log.front());
      failure_log.pop_front();
    }
    failure_log.push_back(i);
  }

  // ---- completions ----
  // The backend finishes a copy (fake: complete(); host: the engine runs it).
  void backend_finish(const BackendCopy& c, bool ok, std::vector<ReadyCompletion>& queue) {
    const bool succeeded = ok && !c.fail_at_completion;
    if (succeeded) move_bytes(events[c.event]);
    if (c.lost) return;
    queue.push_back({events[c.event].event, succeeded});
    if (c.duplicated) queue.push_back({events[c.event].event, succeeded});
  }

  // The bridge applies one completion.
  void apply(const ReadyCompletion& c) {
    std::optional<std::size_t> i;
    if (!(c.event.id & (1ull << 63))) i = find_event(c.event);
    if (!i || events[*i].sync || events[*i].state != EvState::Pending) {
      ++stale;
      return;
    }
    Event& ev = events[*i];
    inflight_bytes -= ev.bytes;
    unpin(ev);
    if (c.ok) {
      ++completed;
      ev.state = EvState::Completed;
      return;
    }
    ++failed;
    ev.state = EvState::Failed;
    ev.error = ev.dir == CopyDirection::HostToDevice ? ErrorKind::DeviceCopyFailed : ErrorKind::OutputCopyFailed;
    remember_failure(*i);
  }

  // drain_completions: everything ready, and late completions once released.
  std::size_t drain() {
    std::vector<ReadyCompletion> batch = std::move(ready);
    ready.clear();
    if (late_released) {
      for (auto& c : late_after_quiesce) batch.push_back(c);
      late_after_quiesce.clear();
      late_released = false;
    }
    for (const auto& c : batch) apply(c);
    return batch.size();
  }

  // A copy reaches the backend's submit hook.
  void submit_reached() {
    if (!late_after_quiesce.empty()) late_released = true;
  }

  // ---- statistics the bridge must report ----
  std::uint64_t live_allocations() const {
    std::uint64_t n = 0;
    for (const auto& a : allocs) n += a.in_slot;
    return n;
  }
  // Adopted memory is not the bridge's: counted in live_allocations only.
  std::uint64_t allocated_bytes() const {
    std::uint64_t n = 0;
    for (const auto& a : allocs)
      if (a.in_slot && !a.adopted()) n += a.extent;
    return n;
  }
  std::uint64_t adopted_allocations() const {
    std::uint64_t n = 0;
    for (const auto& a : allocs) n += a.in_slot && a.adopted();
    return n;
  }
  std::uint64_t adopted_bytes() const {
    std::uint64_t n = 0;
    for (const auto& a : allocs)
      if (a.in_slot && a.adopted()) n += a.extent;
    return n;
  }
  std::uint64_t backend_allocations() const {
    std::uint64_t n = 0;
    for (const auto& a : allocs) n += a.in_backend && !a.adopted();
    return n;
  }
  std::uint64_t backend_adoptions() const {
    std::uint64_t n = 0;
    for (const auto& a : allocs) n += a.in_backend && a.adopted();
    return n;
  }
  // Regions the backend holds registered, and their bytes (stats().host_regions, host_region_bytes).
  std::uint64_t held_regions() const {
    std::uint64_t n = 0;
    for (std::size_t i = 0; i < regions.size(); ++i) n += held(i);
    return n;
  }
  std::uint64_t held_region_bytes() const {
    std::uint64_t n = 0;
    for (std::size_t i = 0; i < regions.size(); ++i)
      if (held(i)) n += regions[i].len;
    return n;
  }
  std::uint64_t copies_in_flight() const {
    std::uint64_t n = 0;
    for (const auto& e : events) n += e.state == EvState::Pending;
    return n;
  }
  std::uint64_t unobserved_failures() const {
    std::uint64_t n = 0;
    for (auto i : failure_log) n += !events[i].observed;
    return n;
  }
  std::uint64_t live_views() const {
    std::uint64_t n = 0;
    for (const auto& a : allocs) n += a.views;
    return n;
  }
  std::uint64_t orphans() const {
    std::uint64_t n = 0;
    for (const auto& a : allocs) n += a.orphan && (a.views || a.fences);
    return n;
  }
  // Memory close abandoned: the backend keeps it for good (an adoption
  // keeps its region registered too).
  std::uint64_t abandoned_allocations() const {
    std::uint64_t n = 0;
    for (const auto& a : allocs) n += a.abandoned && a.in_backend && !a.adopted();
    return n;
  }
  std::uint64_t abandoned_adoptions() const {
    std::uint64_t n = 0;
    for (const auto& a : allocs) n += a.abandoned && a.in_backend && a.adopted();
    return n;
  }

  // ---- restart and close: what a successful quiesce leaves ----
  void quiesce_succeeded() {
    if (fake()) {
      // The fake drops pending copies; late ones finish now and report after
      // the next submit.
      for (const auto& c : backend_pending)
        if (c.late) backend_finish(c, true, late_after_quiesce);
      late_released = false;
    } else {
      // The host engine finishes every copy it holds.
      for (const auto& c : backend_pending) backend_finish(c, true, ready);
    }
    backend_pending.clear();
    // The backend's own queues are idle: their fences passed (the fake lifts
    // its hold on launches). Consumers' queues are not the backend's.
    launches_held = false;
    pass_fences(false, 0);
  }

  // Retires the generation: records, steps, pins; frees or orphans allocations.
  void retire_generation() {
    // The bridge may or may not apply completions still queued (reported
    // while it was Broken or closed) before retiring their records: the
    // counters stop being exact if any would apply.
    for (const auto& c : ready)
      if (auto i = find_event(c.event); i && events[*i].state == EvState::Pending) counters_exact = false;
    if (!broken) drain();
    reap();
    for (auto& ev : events)
      if (ev.event.generation == gen && (ev.state == EvState::Pending || ev.state == EvState::Failed)) {
        if (ev.state == EvState::Failed && !ev.observed) ++evicted_hi;
        ev.state = EvState::Retired;
      }
    failure_log.clear();
    for (auto& a : allocs) {
      if (!a.in_slot) continue;
      a.in_slot = false;
      a.copies = a.uploads = a.steps = 0;
      if (a.views == 0 && a.fences == 0)
        free_in_backend(a);
      else
        a.orphan = true;  // a live view, or a consumer's fence, still holds it
    }
    steps.clear();
    ring.unpin_all();
    // Every region is unregistered, but one an orphaned adoption lies in
    // (held() keeps it until the adoption ends).
    for (std::size_t i = 0; i < regions.size(); ++i) {
      if (regions[i].live && adoptions(i) > 0) ++regions_retained;
      regions[i].live = false;
      regions[i].copies = 0;
    }
    inflight_bytes = 0;
  }
};

// ---- allocation specs -------------------------------------------------------

// What alloc_device (and adopt_host, of its range's length) refuses in a spec
// and extent before looking at any state.
inline std::optional<ErrorKind> allocation_error(const ObjectSpec& spec, std::uint64_t extent) {
  if (!RingModel::pow2(spec.alignment)) return ErrorKind::InvalidAlignment;
  const std::uint64_t elem = spec.dtype ? dtype_size(*spec.dtype) : 1;
  if (extent == 0 || extent > spec.max_extent || extent % spec.alignment || extent % elem)
    return ErrorKind::InvalidExtent;
  return std::nullopt;
}

// ---- views: the contract's shape rules, computed exactly -------------------

inline bool rank_fits(ShapeKind kind, int rank) {
  switch (kind) {
    case ShapeKind::Scalar: return rank == 0;
    case ShapeKind::Vector: return rank == 1;
    case ShapeKind::Matrix: return rank == 2;
    case ShapeKind::Tensor: return true;
  }
  return true;
}

// True when `spec` describes bytes inside an extent of `extent` bytes.
inline bool view_fits(const ViewSpec& spec, std::uint64_t extent) {
  using I = __int128;
  const I elem = dtype_size(spec.dtype);  // the view's dtype
  if (spec.byte_offset % static_cast<std::uint64_t>(elem)) return false;
  if (spec.strides && spec.strides->size() != spec.shape.size()) return false;
  const I cap = I{1} << 100;
  I lowest = 0, highest = 0, count = 1;
  for (int i = 0; i < spec.shape.size(); ++i) {
    const I n = spec.shape[i];
    if (n <= 0) return false;
    if (spec.strides) {
      const I reach = (n - 1) * I{(*spec.strides)[i]};
      if (reach > 0) highest = std::min(cap, highest + reach);
      else lowest = std::max(-cap, lowest + reach);
    } else {
      count = std::min(cap, count * n);
    }
  }
  if (!spec.strides) highest = count - 1;
  const I offset = spec.byte_offset;
  const I first = lowest * elem + offset;
  const I end = (highest + 1) * elem + offset;
  return first >= 0 && end <= I{extent};
}

}  // namespace devbridge::model
