// The flight recorder: a bounded ring of what the bridge did, for the trace
// dump (Chrome/Perfetto trace-event JSON, docs/TRACING.md), the memory
// snapshot's history and the out-of-memory dump.
//
// Each event is a fixed-size record (no heap per event): a steady-clock
// timestamp, a small thread number, the kind, the handle or event involved,
// the queue, and for events that change memory a sample of the counters.
// When the ring is full the oldest record is overwritten and counted as
// dropped. Stacks (attached by a binding, TraceStack) are interned: a
// record keeps the text's number.
//
// Off by default: the core keeps a null pointer and tests it before anything
// else, so a bridge that does not record pays one predictable branch.
//
// Not thread-safe: the bridge records under its lock. The dump formats a
// copy taken under the lock (TraceDump), without it.
#pragma once

#include <time.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "devbridge/recorder.hpp"
#include "devbridge/types.hpp"

namespace devbridge::detail {

enum class TraceKind : std::uint8_t {
  // instants, on the "calls" track
  Allocate,
  Free,  // the memory goes back (an immediate free, or the retire of a release)
  Release,
  PoolHit,
  PoolMiss,
  PoolSplit,
  PoolCoalesce,
  PoolGiveBack,  // whole free segments back to the backend
  Register,
  Adopt,
  Restart,
  Close,
  OomRetry,
  FenceRecorded,
  FencePassed,
  ViewHandedOn,
  // slices: a begin and its end share a track and a key
  CopyBegin,
  CopyCompleted,
  CopyFailed,
  LaunchBegin,
  LaunchEnd,
  ViewBegin,
  ViewEnd,
};

// Tracks (the dump's thread ids).
enum class TraceTrack : std::uint8_t { Calls = 1, CopyUp = 2, CopyDown = 3, Compute = 4, Peer = 5, Views = 6 };

struct TraceCounters {
  std::uint64_t allocated = 0, reserved = 0, cached = 0, ring_used = 0, in_flight = 0;
};

// One event. POD: the ring is a vector of these, overwritten in place.
struct TraceRecord {
  std::uint64_t ts_ns = 0;       // trace_now() ticks in the ring; steady-clock ns in a TraceDump
  std::uint64_t id = 0;          // the allocation's (or region's) id, 0 if none
  std::uint64_t slice = 0;       // pairs a slice's begin and end on its track (a copy's event id, a fence...)
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  Generation generation = 0;     // of the handle, else the bridge's
  TraceCounters counters;        // when has_counters
  std::uint64_t consumer = 0;    // a consumer's queue handle, for fences on one
  std::uint32_t stack = 0;       // interned stack text, 0 for none
  std::uint16_t thread = 0;
  TraceKind kind = TraceKind::Allocate;
  TraceTrack track = TraceTrack::Calls;
  std::uint8_t holder = 0;       // ViewHolder, for views
  std::uint8_t queue = 0;        // Queue, for fences
  bool has_counters = false;
};

// docs/TRACING.md gives the ring's size from this.
static_assert(sizeof(TraceRecord) == 112);

// A record of `kind`; the caller sets what else applies.
inline TraceRecord trace_record(TraceKind kind, Generation generation, std::uint64_t id = 0) noexcept {
  TraceRecord record;
  record.kind = kind;
  record.generation = generation;
  record.id = id;
  return record;
}

// This thread's small number (1, 2, ... in the order threads first record).
// Inline, constant-initialized: no guard and no call on every record.
inline thread_local std::uint16_t trace_thread_number = 0;
[[gnu::cold]] std::uint16_t first_trace_thread() noexcept;
inline std::uint16_t trace_thread() noexcept {
  const auto mine = trace_thread_number;
  return mine != 0 ? mine : first_trace_thread();
}
// The steady clock (CLOCK_MONOTONIC, as std::chrono::steady_clock), in ns.
inline std::uint64_t trace_now_ns() noexcept {
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<std::uint64_t>(now.tv_sec) * 1'000'000'000u + static_cast<std::uint64_t>(now.tv_nsec);
}

// What a record is stamped with: the CPU's time-stamp counter where it runs
// at a constant rate (x86-64 with an invariant TSC), else trace_now_ns().
// Reading the clock was most of what a record cost (about 25 ns a read in a
// VM, against a few for the counter); TraceClock turns ticks into
// nanoseconds when a dump is taken.
bool trace_ticks_are_tsc() noexcept;
inline std::uint64_t trace_now() noexcept {
#if defined(__x86_64__)
  if (trace_ticks_are_tsc()) [[likely]]
    return __builtin_ia32_rdtsc();
#endif
  return trace_now_ns();
}

// Ticks to steady-clock nanoseconds: a start pair (ticks, ns) and the rate,
// measured once per process (over about 2 ms) where the ticks are the TSC.
class TraceClock {
 public:
  TraceClock() noexcept;
  std::uint64_t to_ns(std::uint64_t ticks) const noexcept;
  // The steady clock when recording started.
  std::uint64_t start_ns() const noexcept { return start_ns_; }

 private:
  std::uint64_t start_ticks_, start_ns_;
  double ns_per_tick_;
};

// What a dump needs, copied under the bridge's lock.
struct TraceDump {
  std::string backend, device;
  std::uint64_t domain = 0;
  std::uint64_t max_events = 0, recorded = 0, dropped = 0;
  std::uint64_t start_ns = 0, dump_ns = 0;
  std::vector<TraceRecord> records;  // oldest first
  std::vector<std::string> stacks;   // by number - 1
};

class FlightRecorder {
 public:
  // Refuses 0 and sizes past kMaxRecordedEvents (InvalidRange).
  static void check_max_events(std::size_t max_events);

  explicit FlightRecorder(const RecordOptions& options);

  const RecordOptions& options() const noexcept { return options_; }

  // A key for a slice with no event id of its own to pair its begin and end
  // by (a sync or peer copy, a launch without a fence): the top bit set,
  // which no event id has. Unique in the process, not only in this ring: a
  // sync copy begun under one recording may end under the next.
  static std::uint64_t own_slice_key() noexcept;
  std::uint64_t recorded() const noexcept { return recorded_; }
  std::uint64_t dropped() const noexcept { return recorded_ - ring_.size(); }
  std::size_t size() const noexcept { return ring_.size(); }

  // The next record, kept in the ring (overwriting the oldest when full):
  // stamped (time, thread, stack) and empty but for its kind, generation and
  // id, for the caller to fill in where it lies. The recording sites write
  // their records this way, with no copy (a record built on the stack and
  // copied in twice was most of what recording cost). Never throws: the
  // ring's memory grows only up to max_events, and a stack that cannot be
  // interned is left out.
  TraceRecord& append(TraceKind kind, Generation generation, std::uint64_t id = 0) noexcept;

  // Keeps a record built elsewhere, stamped as append does (its own time
  // when it has one).
  void record(const TraceRecord& record) noexcept;

  // The i-th kept record, oldest first, and its sequence number (counted
  // from the start of recording: what the snapshot names).
  const TraceRecord& at(std::size_t i) const noexcept { return ring_[(head_ + i) % ring_.size()]; }
  std::uint64_t sequence(std::size_t i) const noexcept { return dropped() + i; }

  // A copy of what is kept, for a dump made after the lock is dropped.
  void copy_to(TraceDump& dump) const;

 private:
  std::uint32_t intern(const std::string& text) noexcept;

  RecordOptions options_;
  std::vector<TraceRecord> ring_;  // grows to max_events, then wraps at head_
  std::size_t head_ = 0;           // the oldest record once the ring is full
  std::uint64_t recorded_ = 0;
  TraceClock clock_;
  std::unordered_map<std::string, std::uint32_t> stack_ids_;
  std::vector<std::string> stacks_;
};

// The dump: Chrome/Perfetto trace-event JSON (docs/TRACING.md, "Trace
// format"). Slices are paired on their track; two open at once go on lanes
// of their own, so every lane nests.
std::string trace_json(const TraceDump& dump);

// `text` as the inside of a JSON string.
std::string json_escaped(std::string_view text);

// Writes `text` to `path` atomically: a temporary file beside it, renamed.
void write_file_atomically(const std::string& path, std::string_view text);

}  // namespace devbridge::detail
