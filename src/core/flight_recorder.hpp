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

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
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
  // A slice that began and ended within one call (a sync or peer copy, a
  // launch without a fence), kept as one record: its begin's time rides
  // in the record (TraceRecord::begin_ns), so it needs no key to pair by.
  WholeSlice,
  WholeSliceFailed,
  // A whole slice on the copy-up track whose bytes were written straight
  // into host-addressable device memory (Bridge::write_in_place), no copy.
  InPlaceWrite,
  InPlaceWriteFailed,
};

// Tracks (the dump's thread ids).
enum class TraceTrack : std::uint8_t { Calls = 1, CopyUp = 2, CopyDown = 3, Compute = 4, Peer = 5, Views = 6 };

// Trivial (a record's are zeroed by TraceRecord): the ring of them is
// allocated without touching its pages.
struct TraceCounters {
  std::uint64_t allocated, reserved, cached, ring_used, in_flight;
};

// One event as the dump, the snapshot and the tests read it. The ring keeps
// it split (TraceSlot and, for events that change memory, TraceCounters).
struct TraceRecord {
  std::uint64_t ts_ns = 0;       // trace_now() ticks in the ring; steady-clock ns in a TraceDump
  std::uint64_t id = 0;          // the allocation's (or region's) id, 0 if none
  std::uint64_t slice = 0;       // pairs a slice's begin and end on its track (a copy's event id, a fence...)
  std::uint64_t offset = 0;      // the range's; for an allocate or free, the memory's address
  std::uint64_t bytes = 0;
  Generation generation = 0;     // of the handle, else the bridge's
  TraceCounters counters{};      // when has_counters
  std::uint64_t consumer = 0;    // a consumer's queue handle, for fences on one
  std::uint64_t begin_ns = 0;    // a whole slice's begin, in the same unit as ts_ns
  std::uint32_t stack = 0;       // interned stack text, 0 for none
  std::uint32_t thread = 0;      // trace_thread()
  TraceKind kind = TraceKind::Allocate;
  TraceTrack track = TraceTrack::Calls;
  std::uint8_t holder = 0;       // ViewHolder, for views
  std::uint8_t queue = 0;        // Queue, for fences
  bool has_counters = false;
};

// A record as the ring keeps it: one cache line, written field by field at
// the recording site (no zeroing first, no copy). A fence's consumer rides
// in `offset` and a whole slice's begin in `slice`, fields neither uses.
// The counters of an event that changes memory go in a ring of their own
// beside it, at the same index, so the events that change none (most
// copies, views, fences) write 64 bytes rather than 112.
struct TraceSlot {
  std::uint64_t ticks;
  std::uint64_t id;
  std::uint64_t slice;   // or a whole slice's begin ticks
  std::uint64_t offset;  // or a fence's consumer
  std::uint64_t bytes;
  Generation generation;
  std::uint32_t stack;
  std::uint32_t thread;
  TraceKind kind;
  TraceTrack track;
  std::uint8_t holder;
  std::uint8_t queue;
  bool has_counters;
};
static_assert(sizeof(TraceSlot) <= 64 && std::is_trivial_v<TraceSlot> && std::is_trivial_v<TraceCounters>);

// docs/TRACING.md gives the ring's size from these.
static_assert(sizeof(TraceSlot) + sizeof(TraceCounters) == 104);

// A record of `kind`; the caller sets what else applies.
inline TraceRecord trace_record(TraceKind kind, Generation generation, std::uint64_t id = 0) noexcept {
  TraceRecord record;
  record.kind = kind;
  record.generation = generation;
  record.id = id;
  return record;
}

// This thread's number (1, 2, ... in the order threads first record), drawn
// once and kept: never 0, and 32 bits wide, so no two threads share one
// until 2^32 - 1 threads have recorded (16 bits wrapped after 65,535, and a
// thread that drew 0 drew again on every record).
// Inline, constant-initialized: no guard and no call on every record.
inline thread_local std::uint32_t trace_thread_number = 0;
[[gnu::cold]] std::uint32_t first_trace_thread() noexcept;
inline std::uint32_t trace_thread() noexcept {
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
inline std::uint64_t trace_tsc() noexcept {
#if defined(__x86_64__)
  return __builtin_ia32_rdtsc();
#else
  return 0;  // never read: trace_ticks_are_tsc() is false
#endif
}
inline std::uint64_t trace_now() noexcept { return trace_ticks_are_tsc() ? trace_tsc() : trace_now_ns(); }

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
  // check_max_events, and an oom_dump_dir that is not a directory this
  // process can write in (Unavailable): said when recording starts, not at
  // the first out-of-memory. Returns the options to record with: a relative
  // oom_dump_dir made absolute (against the working directory now), so a
  // later chdir does not move where the dump goes.
  [[nodiscard]] static RecordOptions check_options(const RecordOptions& options);

  explicit FlightRecorder(const RecordOptions& options);

  const RecordOptions& options() const noexcept { return options_; }

  // The out-of-memory dump (oom_dump_dir) written less than
  // kOomDumpInterval before `now`, if any: a loop that runs out of memory
  // over and over is pointed at it instead of writing a file each time
  // (three threads retrying wrote 15,000 in 6 s).
  static constexpr std::chrono::seconds kOomDumpInterval{1};
  std::optional<std::string> recent_oom_dump(std::chrono::steady_clock::time_point now) const;
  void note_oom_dump(std::string path, std::chrono::steady_clock::time_point now);

  // Now, in the ticks records are stamped with (a whole slice's begin).
  std::uint64_t ticks() const noexcept { return ticks_are_tsc_ ? trace_tsc() : trace_now_ns(); }
  std::uint64_t recorded() const noexcept { return recorded_; }
  std::uint64_t dropped() const noexcept { return recorded_ - size(); }
  std::size_t size() const noexcept { return recorded_ < capacity_ ? recorded_ : capacity_; }

  // The next record, kept in the ring (overwriting the oldest when full):
  // stamped (time, thread, stack) and empty but for its kind, generation and
  // id, for the caller to fill in where it lies. Inline, and writing each
  // field once (the site's own stores to the same fields replace these): a
  // call, a zeroing of the record and a copy of it were most of what
  // recording cost. Never throws: the ring's memory is allocated up front,
  // and a stack that cannot be interned is left out.
  [[gnu::always_inline]] TraceSlot& append(TraceKind kind, Generation generation, std::uint64_t id = 0) noexcept {
    return append_at(next_slot(), kind, generation, id);
  }
  // The same, for an event that changes memory: with the counters after it.
  [[gnu::always_inline]] TraceSlot& append(TraceKind kind, Generation generation, std::uint64_t id,
                                           const TraceCounters& counters) noexcept {
    const std::size_t index = next_slot();
    counters_[index] = counters;
    TraceSlot& slot = append_at(index, kind, generation, id);
    slot.has_counters = true;
    return slot;
  }

  // Keeps a record built elsewhere, stamped as append does (its own time
  // when it has one).
  void record(const TraceRecord& record) noexcept;

  // The i-th kept record, oldest first, and its sequence number (counted
  // from the start of recording: what the snapshot names). Its time is in
  // ticks, as the ring keeps it.
  TraceRecord at(std::size_t i) const noexcept;
  std::uint64_t sequence(std::size_t i) const noexcept { return dropped() + i; }

  // What is kept, as the ring holds it: copied under the bridge's lock (a
  // memcpy or two; turning 2^21 records into TraceRecords there held every
  // other caller for 170 ms), made into a TraceDump after it is dropped.
  struct RingCopy {
    std::vector<TraceSlot> slots;         // oldest first; sized before the lock is taken
    std::vector<TraceCounters> counters;  // beside them
    std::size_t size = 0;                 // how many of them are copied
    std::uint64_t max_events = 0, recorded = 0, dropped = 0;
    std::vector<std::string> stacks;
    std::optional<TraceClock> clock;
  };
  // Storage for a copy of up to `records` records, its pages touched, to
  // make before the lock is taken.
  static RingCopy ring_copy_for(std::size_t records);
  // Under the lock: grows `copy` there only when the ring filled meanwhile.
  void copy_to(RingCopy& copy) const;
  // Without it.
  static void fill_dump(const RingCopy& copy, TraceDump& dump);
  // The three in one, where no lock is shared (tests).
  void copy_to(TraceDump& dump) const {
    auto copy = ring_copy_for(size());
    copy_to(copy);
    fill_dump(copy, dump);
  }

  // The id, generation and kind of the i-th kept record, oldest first,
  // without making the whole record.
  const TraceSlot& slot(std::size_t i) const noexcept { return slots_[ring_index(i)]; }

 private:
  // Where the i-th kept record, oldest first, lies in the ring.
  std::size_t ring_index(std::size_t i) const noexcept {
    std::size_t index = oldest() + i;
    if (index >= capacity_) index -= capacity_;
    return index;
  }
  std::size_t next_slot() noexcept {
    const std::size_t index = next_;
    next_ = index + 1 == capacity_ ? 0 : index + 1;
    ++recorded_;
    return index;
  }
  [[gnu::always_inline]] TraceSlot& append_at(std::size_t index, TraceKind kind, Generation generation,
                                              std::uint64_t id) noexcept {
    TraceSlot& slot = slots_[index];
    // The calls first: the fields after them are stored once, with what the
    // caller stores into the same fields next.
    if (plain_) [[likely]] {
      slot.ticks = trace_tsc();
      slot.stack = 0;
    } else {
      stamp_slowly(slot);
    }
    slot.thread = trace_thread();
    slot.id = id;
    slot.slice = 0;
    slot.offset = 0;
    slot.bytes = 0;
    slot.generation = generation;
    slot.kind = kind;
    slot.track = TraceTrack::Calls;
    slot.holder = 0;
    slot.queue = 0;
    slot.has_counters = false;
    return slot;
  }
  // The time by the steady clock, where the ticks are not the TSC; the stack.
  [[gnu::noinline]] void stamp_slowly(TraceSlot& slot) noexcept;
  // The oldest kept record's index in the ring.
  std::size_t oldest() const noexcept { return recorded_ > capacity_ ? next_ : 0; }
  std::uint32_t intern(const std::string& text) noexcept;
  // Drops the texts no kept record names and renumbers the rest.
  void forget_unreferenced_stacks() noexcept;

  RecordOptions options_;
  std::string last_oom_dump_;  // recent_oom_dump's
  std::chrono::steady_clock::time_point last_oom_dump_at_{};
  const bool ticks_are_tsc_;
  const bool plain_;  // ticks from the TSC and no stacks: a record stamps inline
  const std::size_t capacity_;
  // Allocated whole, untouched: a large ring's pages are touched only as it fills.
  std::unique_ptr<TraceSlot[]> slots_;
  std::unique_ptr<TraceCounters[]> counters_;
  std::size_t next_ = 0;  // where the next record goes: once the ring is full, the oldest
  std::uint64_t recorded_ = 0;
  TraceClock clock_;
  std::unordered_map<std::string, std::uint32_t> stack_ids_;
  std::vector<std::string> stacks_text_;
};

// The dump: Chrome/Perfetto trace-event JSON (docs/TRACING.md, "Trace
// format"). Slices are paired on their track; two open at once go on lanes
// of their own, so every lane nests.
std::string trace_json(const TraceDump& dump);

// `text` as the inside of a JSON string.
std::string json_escaped(std::string_view text);

// Writes `text` to `path` through a ReplacingFile (devbridge/replacing_file.hpp):
// whole or not at all, a device or a FIFO a process reads written in place, a
// link written through; a FIFO no process reads (the write would wait for one
// for good) or a socket refused, Unavailable.
void write_file_atomically(const std::string& path, std::string_view text);

}  // namespace devbridge::detail
