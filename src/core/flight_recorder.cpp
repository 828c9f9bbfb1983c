// The flight recorder's ring and its trace dump (flight_recorder.hpp).
#include "core/flight_recorder.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#if defined(__x86_64__)
#include <cpuid.h>
#endif
#include <iterator>
#include <map>
#include <type_traits>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include "core/fail.hpp"
#include "devbridge/bridge.hpp"
#include "devbridge/replacing_file.hpp"

namespace devbridge {

namespace {
thread_local const std::string* t_trace_stack = nullptr;
}  // namespace

std::string max_events_refusal(std::size_t max_events) {
  if (max_events != 0 && max_events <= kMaxRecordedEvents) return {};
  return max_events_refusal(std::to_string(max_events));
}

std::string max_events_refusal(std::string_view max_events_text) {
  return fmt::format("max_events of {} is outside [1, {}] (the ring holds that many events)", max_events_text,
                     kMaxRecordedEvents);
}

TraceStack::TraceStack(std::string text) : text_(std::move(text)), previous_(t_trace_stack) {
  t_trace_stack = &text_;
}
TraceStack::~TraceStack() { t_trace_stack = previous_; }
const std::string* TraceStack::current() noexcept { return t_trace_stack; }

}  // namespace devbridge

namespace devbridge::detail {

std::uint32_t first_trace_thread() noexcept {
  static std::atomic<std::uint32_t> next{1};
  std::uint32_t number = next.fetch_add(1, std::memory_order_relaxed);
  if (number == 0) number = next.fetch_add(1, std::memory_order_relaxed);  // wrapped: 0 means "not drawn yet"
  trace_thread_number = number;
  return number;
}

bool trace_ticks_are_tsc() noexcept {
#if defined(__x86_64__)
  // CPUID 0x80000007, EDX bit 8: the TSC runs at a constant rate in every
  // power state (Linux's constant_tsc + nonstop_tsc).
  static const bool invariant = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(0x80000000u, &eax, &ebx, &ecx, &edx) || eax < 0x80000007u) return false;
    __get_cpuid(0x80000007u, &eax, &ebx, &ecx, &edx);
    return (edx & (1u << 8)) != 0;
  }();
  return invariant;
#else
  return false;
#endif
}

namespace {

double measured_ns_per_tick() noexcept {
  if (!trace_ticks_are_tsc()) return 1.0;
  static const double rate = [] {
    const std::uint64_t ns0 = trace_now_ns(), ticks0 = trace_now();
    std::uint64_t ns1 = ns0, ticks1 = ticks0;
    while (ns1 - ns0 < 2'000'000) {
      ns1 = trace_now_ns();
      ticks1 = trace_now();
    }
    return ticks1 > ticks0 ? static_cast<double>(ns1 - ns0) / static_cast<double>(ticks1 - ticks0) : 1.0;
  }();
  return rate;
}

}  // namespace

TraceClock::TraceClock() noexcept
    : start_ticks_(trace_now()), start_ns_(trace_now_ns()), ns_per_tick_(measured_ns_per_tick()) {}

std::uint64_t TraceClock::to_ns(std::uint64_t ticks) const noexcept {
  if (!trace_ticks_are_tsc()) return ticks;
  const double since = static_cast<double>(static_cast<std::int64_t>(ticks - start_ticks_)) * ns_per_tick_;
  return since <= -static_cast<double>(start_ns_) ? 0 : start_ns_ + static_cast<std::int64_t>(since);
}

void FlightRecorder::check_max_events(std::size_t max_events) {
  if (auto refusal = max_events_refusal(max_events); !refusal.empty())
    fail(ErrorKind::InvalidRange, "record: {}", refusal);
}

std::optional<std::string> FlightRecorder::recent_oom_dump(std::chrono::steady_clock::time_point now) const {
  if (last_oom_dump_.empty() || now - last_oom_dump_at_ >= kOomDumpInterval) return std::nullopt;
  return last_oom_dump_;
}

void FlightRecorder::note_oom_dump(std::string path, std::chrono::steady_clock::time_point now) {
  last_oom_dump_ = std::move(path);
  last_oom_dump_at_ = now;
}

RecordOptions FlightRecorder::check_options(const RecordOptions& given) {
  check_max_events(given.max_events);
  RecordOptions options = given;
  if (options.oom_dump_dir.empty()) return options;
  std::error_code absolute_error;
  auto absolute = std::filesystem::absolute(given.oom_dump_dir, absolute_error);
  if (absolute_error)
    fail(ErrorKind::Unavailable, "record: oom_dump_dir {}: cannot make it absolute: {}", given.oom_dump_dir,
         absolute_error.message());
  options.oom_dump_dir = absolute.string();
  const std::string& directory = options.oom_dump_dir;
  struct stat st {};
  if (::stat(directory.c_str(), &st) != 0) {
    const int error = errno;
    fail(ErrorKind::Unavailable, "record: oom_dump_dir {}: {}", directory, std::strerror(error));
  }
  if (!S_ISDIR(st.st_mode)) fail(ErrorKind::Unavailable, "record: oom_dump_dir {} is not a directory", directory);
  if (const int error = ReplacingFile::error_making_a_file_in(directory); error != 0)
    fail(ErrorKind::Unavailable, "record: oom_dump_dir {}: cannot write in it: {}", directory, std::strerror(error));
  return options;
}

FlightRecorder::FlightRecorder(const RecordOptions& options)
    : options_(options),
      ticks_are_tsc_(trace_ticks_are_tsc()),
      plain_(ticks_are_tsc_ && !options.stacks),
      capacity_((check_max_events(options.max_events), options.max_events)),
      slots_(std::make_unique_for_overwrite<TraceSlot[]>(capacity_)),
      counters_(std::make_unique_for_overwrite<TraceCounters[]>(capacity_)) {}

std::uint32_t FlightRecorder::intern(const std::string& text) noexcept {
  try {
    // Every kept record names at most one stack: past twice the ring (and a
    // floor), most texts are of records long dropped, and call sites without
    // end (generated code, notebooks) would grow the table for good.
    if (stacks_text_.size() >= std::max<std::size_t>(1024, 2 * capacity_) && !stack_ids_.contains(text))
      forget_unreferenced_stacks();
    const auto [it, added] = stack_ids_.try_emplace(text, static_cast<std::uint32_t>(stacks_text_.size() + 1));
    if (added) {
      try {
        stacks_text_.push_back(text);
      } catch (...) {
        stack_ids_.erase(it);
        return 0;
      }
    }
    return it->second;
  } catch (...) {
    return 0;  // only the stack is lost
  }
}

void FlightRecorder::forget_unreferenced_stacks() noexcept {
  std::vector<std::uint32_t> renumbered;
  std::vector<std::string> kept;
  try {
    renumbered.assign(stacks_text_.size() + 1, 0);
    kept.reserve(std::min(stacks_text_.size(), capacity_));
  } catch (...) {
    return;  // the table stays as it is
  }
  for (std::size_t i = 0; i < size(); ++i) {
    TraceSlot& slot = slots_[ring_index(i)];
    if (slot.stack == 0 || slot.stack > stacks_text_.size()) continue;
    std::uint32_t& number = renumbered[slot.stack];
    if (number == 0) {
      kept.push_back(std::move(stacks_text_[slot.stack - 1]));
      number = static_cast<std::uint32_t>(kept.size());
    }
    slot.stack = number;
  }
  stacks_text_ = std::move(kept);
  stack_ids_.clear();
  try {
    for (std::size_t i = 0; i < stacks_text_.size(); ++i)
      stack_ids_.emplace(stacks_text_[i], static_cast<std::uint32_t>(i + 1));
  } catch (...) {
    stack_ids_.clear();  // a text recorded again gets a second number: only sharing is lost
  }
}

void FlightRecorder::stamp_slowly(TraceSlot& slot) noexcept {
  slot.ticks = trace_now();
  const auto* text = options_.stacks ? TraceStack::current() : nullptr;
  slot.stack = text ? intern(*text) : 0;
}

namespace {
bool is_fence(TraceKind kind) { return kind == TraceKind::FenceRecorded || kind == TraceKind::FencePassed; }
bool is_in_place(TraceKind kind) { return kind == TraceKind::InPlaceWrite || kind == TraceKind::InPlaceWriteFailed; }
bool is_whole(TraceKind kind) {
  return kind == TraceKind::WholeSlice || kind == TraceKind::WholeSliceFailed || is_in_place(kind);
}
}  // namespace

void FlightRecorder::record(const TraceRecord& record) noexcept {
  TraceSlot& slot = record.has_counters ? append(record.kind, record.generation, record.id, record.counters)
                                        : append(record.kind, record.generation, record.id);
  if (record.ts_ns != 0) slot.ticks = record.ts_ns;
  slot.slice = !is_whole(record.kind) ? record.slice : record.begin_ns != 0 ? record.begin_ns : slot.ticks;
  slot.offset = is_fence(record.kind) ? record.consumer : record.offset;
  slot.bytes = record.bytes;
  slot.track = record.track;
  slot.holder = record.holder;
  slot.queue = record.queue;
}

namespace {
TraceRecord record_of(const TraceSlot& slot, const TraceCounters& counters) noexcept {
  TraceRecord record;
  record.ts_ns = slot.ticks;
  record.id = slot.id;
  (is_whole(slot.kind) ? record.begin_ns : record.slice) = slot.slice;
  (is_fence(slot.kind) ? record.consumer : record.offset) = slot.offset;
  record.bytes = slot.bytes;
  record.generation = slot.generation;
  if (slot.has_counters) record.counters = counters;
  record.stack = slot.stack;
  record.thread = slot.thread;
  record.kind = slot.kind;
  record.track = slot.track;
  record.holder = slot.holder;
  record.queue = slot.queue;
  record.has_counters = slot.has_counters;
  return record;
}
}  // namespace

TraceRecord FlightRecorder::at(std::size_t i) const noexcept {
  const std::size_t index = ring_index(i);
  return record_of(slots_[index], counters_[index]);
}

FlightRecorder::RingCopy FlightRecorder::ring_copy_for(std::size_t records) {
  RingCopy copy;
  copy.slots.resize(records);  // zeroed: the pages are touched here, not under the lock
  copy.counters.resize(records);
  return copy;
}

void FlightRecorder::copy_to(RingCopy& copy) const {
  copy.size = size();
  if (copy.slots.size() < copy.size) {
    copy.slots.resize(copy.size);
    copy.counters.resize(copy.size);
  }
  // Oldest first: from the oldest to the ring's end, then from its start.
  // (Nothing kept: an empty vector's data() may be null, which memcpy may not take even for 0 bytes.)
  if (copy.size != 0) {
    const std::size_t first = oldest();
    const std::size_t head = std::min(copy.size, capacity_ - first);
    std::memcpy(copy.slots.data(), &slots_[first], head * sizeof(TraceSlot));
    std::memcpy(copy.counters.data(), &counters_[first], head * sizeof(TraceCounters));
    std::memcpy(copy.slots.data() + head, &slots_[0], (copy.size - head) * sizeof(TraceSlot));
    std::memcpy(copy.counters.data() + head, &counters_[0], (copy.size - head) * sizeof(TraceCounters));
  }
  copy.max_events = options_.max_events;
  copy.recorded = recorded_;
  copy.dropped = dropped();
  copy.stacks = stacks_text_;
  copy.clock = clock_;
}

void FlightRecorder::fill_dump(const RingCopy& copy, TraceDump& dump) {
  dump.max_events = copy.max_events;
  dump.recorded = copy.recorded;
  dump.dropped = copy.dropped;
  dump.start_ns = copy.clock->start_ns();
  dump.records.resize(copy.size);
  for (std::size_t i = 0; i < copy.size; ++i) {
    auto& record = dump.records[i] = record_of(copy.slots[i], copy.counters[i]);
    record.ts_ns = copy.clock->to_ns(record.ts_ns);
    if (record.begin_ns != 0) record.begin_ns = copy.clock->to_ns(record.begin_ns);
  }
  dump.stacks = copy.stacks;
}

// ---- the dump ----

namespace {

using Out = std::back_insert_iterator<std::string>;

struct KindInfo {
  const char* name;
  const char* category;
};

// Instants' names and categories, by TraceKind (the slices' are their tracks').
constexpr std::array<KindInfo, 16> kInstants{{
    {"allocate", "memory"},
    {"free", "memory"},
    {"release", "memory"},
    {"pool hit", "memory"},
    {"pool miss", "memory"},
    {"pool split", "memory"},
    {"pool coalesce", "memory"},
    {"pool give back", "memory"},
    {"register", "lifecycle"},
    {"adopt", "lifecycle"},
    {"restart", "lifecycle"},
    {"close", "lifecycle"},
    {"oom retry", "memory"},
    {"fence recorded", "fence"},  // a fence is written as a slice ("fence"): these two are not instants
    {"fence passed", "fence"},
    {"view handed on", "lifecycle"},
}};
static_assert(static_cast<std::size_t>(TraceKind::CopyBegin) == kInstants.size());

constexpr std::array<const char*, 7> kTrackNames{"", "calls", "copy up", "copy down", "compute", "peer", "views"};

const char* holder_name(std::uint8_t holder) {
  switch (static_cast<ViewHolder>(holder)) {
    case ViewHolder::DLPackConsumer: return "a DLPack consumer";
    case ViewHolder::TinygradTensor: return "a tinygrad tensor";
    case ViewHolder::Caller: break;
  }
  return "the caller";
}

// A slice's name and category: a fence's wherever it runs; otherwise each
// track holds one kind (copies on the copy and peer tracks, launches on
// compute, leases on views).
const char* slice_name(std::uint64_t track, bool fence) {
  if (fence) return "fence";
  switch (static_cast<TraceTrack>(track)) {
    case TraceTrack::Compute: return "axpy";
    case TraceTrack::Views: return "view";
    default: return kTrackNames[track];
  }
}
const char* slice_category(std::uint64_t track, bool fence) {
  if (fence) return "fence";
  switch (static_cast<TraceTrack>(track)) {
    case TraceTrack::Compute: return "compute";
    case TraceTrack::Views: return "view";
    default: return "copy";
  }
}

bool is_begin(TraceKind k) {
  return k == TraceKind::CopyBegin || k == TraceKind::LaunchBegin || k == TraceKind::ViewBegin ||
         k == TraceKind::FenceRecorded;
}
bool is_end(TraceKind k) {
  return k == TraceKind::CopyCompleted || k == TraceKind::CopyFailed || k == TraceKind::LaunchEnd ||
         k == TraceKind::ViewEnd || k == TraceKind::FencePassed;
}

constexpr const char* kQueueNames[] = {"copy up", "copy down", "compute", "consumer"};
const char* queue_name(std::uint8_t queue) { return kQueueNames[std::min<std::uint8_t>(queue, 3)]; }

// The length of the well-formed UTF-8 sequence `text` starts with (RFC 3629:
// no overlong forms, no surrogates, nothing past U+10FFFF), or 0.
std::size_t utf8_sequence(std::string_view text) noexcept {
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = byte(0);
  std::size_t length;
  unsigned char low = 0x80, high = 0xbf;  // the second byte's range
  if (lead >= 0xc2 && lead <= 0xdf) {
    length = 2;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    length = 3;
    if (lead == 0xe0) low = 0xa0;
    if (lead == 0xed) high = 0x9f;
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    length = 4;
    if (lead == 0xf0) low = 0x90;
    if (lead == 0xf4) high = 0x8f;
  } else {
    return 0;
  }
  if (text.size() < length || byte(1) < low || byte(1) > high) return 0;
  for (std::size_t i = 2; i < length; ++i)
    if (byte(i) < 0x80 || byte(i) > 0xbf) return 0;
  return length;
}

// `text` inside a JSON string. JSON holds only Unicode text: a byte that is
// not part of well-formed UTF-8 (a stack from a file name that is not UTF-8)
// is written as the four characters \xHH, as Python's backslashreplace does.
void write_escaped(Out out, std::string_view text) {
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    switch (c) {
      case '"': fmt::format_to(out, "\\\""); break;
      case '\\': fmt::format_to(out, "\\\\"); break;
      case '\n': fmt::format_to(out, "\\n"); break;
      case '\t': fmt::format_to(out, "\\t"); break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          fmt::format_to(out, "\\u{:04x}", static_cast<unsigned>(c));
        } else if (static_cast<unsigned char>(c) < 0x80) {
          *out++ = c;
        } else if (const std::size_t length = utf8_sequence(text.substr(i)); length != 0) {
          for (std::size_t k = 0; k < length; ++k) *out++ = text[i + k];
          i += length - 1;
        } else {
          fmt::format_to(out, "\\\\x{:02x}", static_cast<unsigned char>(c));
        }
    }
  }
}

// Microseconds since recording started, as the trace-event format wants.
double micros(const TraceDump& dump, std::uint64_t ns) {
  return ns <= dump.start_ns ? 0.0 : static_cast<double>(ns - dump.start_ns) / 1000.0;
}

// Slices open at the same time on one track each get a lane: lane 0 is the
// track's own tid, each further lane a tid of its own, "<track> #<k+1>".
// A fence runs on its queue's track: the copy and compute queues' own, and
// a track per consumer queue. Consumer queues and further lanes take tids
// from one count, from kFirstSharedTid up, in the order first seen: no two
// ever share one, however many there are.
constexpr std::uint64_t kFirstSharedTid = 10000;
struct Lanes {
  struct Track {
    std::vector<bool> busy;           // by lane
    std::vector<std::uint64_t> tids;  // by lane
  };
  std::map<std::uint64_t, Track> tracks;
  std::uint64_t& next_tid;
  struct Key {
    std::uint64_t track;
    bool fence;  // a fence and a launch on the compute track may share a key (the launch ends at its fence)
    Generation generation;
    std::uint64_t slice;
    friend auto operator<=>(const Key&, const Key&) = default;
  };
  std::map<Key, std::vector<std::size_t>> open;  // a key may be open more than once (views of one allocation)
  // A whole slice pairs by its sequence number, with the top bit no event id or fence token has.
  static constexpr std::uint64_t kWholeSlice = std::uint64_t{1} << 63;

  // The tid of the lane a slice `key` begins on.
  std::uint64_t begin(const Key& key) {
    auto& track = tracks[key.track];
    auto free = std::find(track.busy.begin(), track.busy.end(), false);
    const auto lane = static_cast<std::size_t>(free - track.busy.begin());
    if (free == track.busy.end()) {
      track.busy.push_back(true);
      track.tids.push_back(lane == 0 ? key.track : next_tid++);
    } else {
      *free = true;
    }
    open[key].push_back(lane);
    return track.tids[lane];
  }
  // The tid of the lane the slice `key` ends on, or nothing when its begin was dropped.
  std::optional<std::uint64_t> end(const Key& key) {
    auto it = open.find(key);
    if (it == open.end()) return std::nullopt;
    const auto lane = it->second.back();
    it->second.pop_back();
    if (it->second.empty()) open.erase(it);
    auto& track = tracks[key.track];
    track.busy[lane] = false;
    return track.tids[lane];
  }
  // Ends the open slices `which` picks, which no record ends:
  // `end(key, tid)` for each.
  template <typename Which, typename End>
  void end_unrecorded(Which which, End end) {
    for (auto it = open.begin(); it != open.end();) {
      if (!which(it->first)) {
        ++it;
        continue;
      }
      auto& track = tracks[it->first.track];
      for (const auto lane : it->second) {
        track.busy[lane] = false;
        end(it->first, track.tids[lane]);
      }
      it = open.erase(it);
    }
  }
};

void write_common_args(Out out, const TraceDump& dump, const TraceRecord& r) {
  fmt::format_to(out, ",\"thread\":{}", r.thread);
  if (r.stack != 0 && r.stack <= dump.stacks.size()) {
    fmt::format_to(out, ",\"stack\":\"");
    write_escaped(out, dump.stacks[r.stack - 1]);
    *out++ = '"';
  }
}

}  // namespace

std::string trace_json(const TraceDump& dump) {
  std::string text;
  // About 260 bytes an event (the bench's mix): past the reservation, the whole text is copied once more.
  text.reserve(512 + dump.records.size() * 320);
  Out out(text);

  // What is written, in time order: each record at its time, and a whole
  // slice's begin also at its own. Timestamps must be monotone; records are
  // taken under one lock, so they almost are (a launch's begin is stamped
  // before its call, kept after).
  struct Item {
    std::uint64_t ts_ns;
    std::uint32_t index;
    bool whole_begin;
  };
  std::vector<Item> order;
  order.reserve(dump.records.size() + dump.records.size() / 4);
  for (std::uint32_t i = 0; i < dump.records.size(); ++i) {
    const auto& r = dump.records[i];
    if (is_whole(r.kind)) order.push_back(Item{std::min(r.begin_ns, r.ts_ns), i, true});
    order.push_back(Item{r.ts_ns, i, false});
  }
  const auto earlier = [](const Item& a, const Item& b) { return a.ts_ns < b.ts_ns; };
  if (!std::is_sorted(order.begin(), order.end(), earlier)) std::stable_sort(order.begin(), order.end(), earlier);

  fmt::format_to(out, "{{\"displayTimeUnit\":\"ns\",\"otherData\":{{\"format\":\"devbridge-trace\",\"version\":1,"
                      "\"backend\":\"");
  write_escaped(out, dump.backend);
  fmt::format_to(out, "\",\"device\":\"");
  write_escaped(out, dump.device);
  fmt::format_to(out, "\",\"domain\":{},\"max_events\":{},\"recorded_events\":{},\"dropped_events\":{}}},", dump.domain,
                 dump.max_events, dump.recorded, dump.dropped);
  fmt::format_to(out, "\"traceEvents\":[\n{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":1,\"args\":{{\"name\":\"devbridge ");
  write_escaped(out, dump.backend);
  *out++ = ' ';
  write_escaped(out, dump.device);
  fmt::format_to(out, "\"}}}}");
  for (std::size_t track = 1; track < kTrackNames.size(); ++track)
    fmt::format_to(out, ",\n{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":1,\"tid\":{},\"args\":{{\"name\":\"{}\"}}}}",
                   track, kTrackNames[track]);

  std::uint64_t next_tid = kFirstSharedTid;
  Lanes lanes{{}, next_tid, {}};
  std::map<std::uint64_t, std::uint64_t> consumers;  // a consumer queue's track, by its handle
  // A fence's track: its queue's (a consumer queue's named when first seen).
  auto fence_track = [&](const TraceRecord& r) -> std::uint64_t {
    switch (static_cast<Queue>(r.queue)) {
      case Queue::CopyUp: return static_cast<std::uint64_t>(TraceTrack::CopyUp);
      case Queue::CopyDown: return static_cast<std::uint64_t>(TraceTrack::CopyDown);
      case Queue::Compute: return static_cast<std::uint64_t>(TraceTrack::Compute);
      case Queue::Consumer: break;
    }
    const auto [it, added] = consumers.try_emplace(r.consumer, next_tid);
    if (added) {
      ++next_tid;
      fmt::format_to(out,
                     ",\n{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":1,\"tid\":{},\"args\":{{\"name\":"
                     "\"consumer {}\"}}}}",
                     it->second, r.consumer);
    }
    return it->second;
  };
  auto track_name = [&](std::uint64_t track) -> std::string {
    if (track < kTrackNames.size()) return kTrackNames[track];
    for (const auto& [consumer, consumer_track] : consumers)
      if (consumer_track == track) return fmt::format("consumer {}", consumer);
    return "?";
  };
  // The end of a slice no record ends (it has no seq of its own).
  auto write_unrecorded_end = [&](const Lanes::Key& key, std::uint64_t tid, double ts, const char* status) {
    fmt::format_to(out,
                   ",\n{{\"ph\":\"E\",\"name\":\"{}\",\"cat\":\"{}\",\"pid\":1,\"tid\":{},\"ts\":{:.3f},"
                   "\"args\":{{\"status\":\"{}\"}}}}",
                   slice_name(key.track, key.fence), slice_category(key.track, key.fence), tid, ts, status);
  };
  const std::uint64_t first_sequence = dump.recorded - dump.records.size();
  double last_ts = 0;
  for (const auto [item_ns, index, whole_begin] : order) {
    const auto& r = dump.records[index];
    const double ts = micros(dump, item_ns);
    last_ts = std::max(last_ts, ts);
    const bool fence = is_fence(r.kind);
    const bool whole = is_whole(r.kind);
    const std::uint64_t track = fence ? fence_track(r) : static_cast<std::uint64_t>(r.track);
    const Lanes::Key key{track, fence, r.generation, whole ? Lanes::kWholeSlice | (first_sequence + index) : r.slice};
    if (whole_begin || is_begin(r.kind)) {
      const auto tid = lanes.begin(key);
      // As few format calls as there can be: they are most of a dump's time.
      fmt::format_to(out, ",\n{{\"ph\":\"B\",\"name\":\"{}\",\"cat\":\"{}\",\"pid\":1,\"tid\":{},\"ts\":{:.3f},\"args\":{{",
                     slice_name(track, fence), slice_category(track, fence), tid, ts);
      if (r.kind == TraceKind::CopyBegin)
        fmt::format_to(out, "\"event\":\"{}:{}:{}\",", dump.domain, r.generation, r.slice);
      else if (whole && r.track != TraceTrack::Compute)  // no copy event: a sync copy, or a side of a peer copy
        text.append(r.track == TraceTrack::Peer ? "\"event\":\"peer\","
                    : is_in_place(r.kind)        ? "\"event\":\"in_place\","
                                                 : "\"event\":\"sync\",");
      fmt::format_to(out, "\"handle\":\"{}:{}:{}\",\"bytes\":{},\"offset\":{},\"generation\":{},\"seq\":{}",
                     dump.domain, r.generation, r.id, r.bytes, r.offset, r.generation, first_sequence + index);
      if (r.kind == TraceKind::ViewBegin) fmt::format_to(out, ",\"holder\":\"{}\"", holder_name(r.holder));
      if (fence) {
        fmt::format_to(out, ",\"queue\":\"{}\"", queue_name(r.queue));
        if (r.consumer != 0) fmt::format_to(out, ",\"consumer\":{}", r.consumer);
      }
      write_common_args(out, dump, r);
      text.append("}}");
      if (whole_begin) continue;  // the record's own item ends it
    } else if (whole || is_end(r.kind)) {
      // An end whose begin was overwritten in the ring is left out, but not
      // its memory sample (an async copy's end changes in_flight).
      const auto tid = lanes.end(key);
      if (tid) {
        const char* status = r.kind == TraceKind::CopyFailed || r.kind == TraceKind::WholeSliceFailed ||
                                     r.kind == TraceKind::InPlaceWriteFailed
                                 ? "failed"
                             : r.kind == TraceKind::ViewEnd   ? "ended"
                             : fence                          ? "passed"
                                                              : "completed";
        fmt::format_to(out,
                       ",\n{{\"ph\":\"E\",\"name\":\"{}\",\"cat\":\"{}\",\"pid\":1,\"tid\":{},\"ts\":{:.3f},\"args\":{{"
                       "\"status\":\"{}\",\"seq\":{}}}}}",
                       slice_name(track, fence), slice_category(track, fence), *tid, ts, status,
                       first_sequence + index);
      }
    } else {
      // The copies a restart or close dropped never complete: their slices
      // end here, so they neither stay open to the dump nor push later
      // copies onto lanes of their own. Traced here rather than where the
      // core drops them, which would cost the copy paths a record each.
      if (r.kind == TraceKind::Restart || r.kind == TraceKind::Close)
        lanes.end_unrecorded(
            [](const Lanes::Key& open_key) {
              const bool copy_track = open_key.track == static_cast<std::uint64_t>(TraceTrack::CopyUp) ||
                                      open_key.track == static_cast<std::uint64_t>(TraceTrack::CopyDown);
              return copy_track && !open_key.fence && (open_key.slice & Lanes::kWholeSlice) == 0;  // in flight
            },
            [&](const Lanes::Key& open_key, std::uint64_t tid) { write_unrecorded_end(open_key, tid, ts, "dropped"); });
      const auto& info = kInstants[static_cast<std::size_t>(r.kind)];
      if (r.id != 0)
        fmt::format_to(out,
                       ",\n{{\"ph\":\"i\",\"s\":\"t\",\"name\":\"{}\",\"cat\":\"{}\",\"pid\":1,\"tid\":1,\"ts\":{:.3f},"
                       "\"args\":{{\"handle\":\"{}:{}:{}\",\"bytes\":{},\"generation\":{},\"seq\":{}",
                       info.name, info.category, ts, dump.domain, r.generation, r.id, r.bytes, r.generation,
                       first_sequence + index);
      else
        fmt::format_to(out,
                       ",\n{{\"ph\":\"i\",\"s\":\"t\",\"name\":\"{}\",\"cat\":\"{}\",\"pid\":1,\"tid\":1,\"ts\":{:.3f},"
                       "\"args\":{{\"bytes\":{},\"generation\":{},\"seq\":{}",
                       info.name, info.category, ts, r.bytes, r.generation, first_sequence + index);
      if (r.kind == TraceKind::Free && r.slice != 0) text.append(",\"deferred\":true");
      if ((r.kind == TraceKind::Allocate || r.kind == TraceKind::Free) && r.offset != 0)
        fmt::format_to(out, ",\"address\":{}", r.offset);
      if (r.kind == TraceKind::ViewHandedOn) fmt::format_to(out, ",\"holder\":\"{}\"", holder_name(r.holder));
      write_common_args(out, dump, r);
      text.append("}}");
    }
    if (r.has_counters)
      fmt::format_to(out,
                     ",\n{{\"ph\":\"C\",\"name\":\"memory\",\"pid\":1,\"ts\":{:.3f},\"args\":{{\"allocated\":{},"
                     "\"reserved\":{},\"cached\":{},\"ring_used\":{},\"in_flight\":{}}}}}",
                     ts, r.counters.allocated, r.counters.reserved, r.counters.cached, r.counters.ring_used,
                     r.counters.in_flight);
  }

  // Slices still open end now, marked so; then the extra lanes get names.
  const double end_ts = std::max(last_ts, micros(dump, dump.dump_ns));
  lanes.end_unrecorded([](const Lanes::Key&) { return true; },
                       [&](const Lanes::Key& key, std::uint64_t tid) { write_unrecorded_end(key, tid, end_ts, "open"); });
  for (const auto& [track, lanes_of_track] : lanes.tracks)
    for (std::size_t lane = 1; lane < lanes_of_track.tids.size(); ++lane)
      fmt::format_to(out,
                     ",\n{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":1,\"tid\":{},\"args\":{{\"name\":\"{} #{}\"}}}}",
                     lanes_of_track.tids[lane], track_name(track), lane + 1);
  fmt::format_to(out, "\n]}}\n");
  return text;
}

std::string json_escaped(std::string_view text) {
  std::string escaped;
  write_escaped(std::back_inserter(escaped), text);
  return escaped;
}

void write_file_atomically(const std::string& path, std::string_view text) {
  // A FIFO is written in place when a process reads it (`gzip < fifo`);
  // with none, the open would wait for one for good (the caller, GIL
  // released, past Ctrl-C), so it is refused at once, as a socket (which
  // cannot be opened) is. A character device (/dev/null) is written in place.
  struct stat existing {};
  const bool exists = ::stat(path.c_str(), &existing) == 0;
  if (exists && S_ISSOCK(existing.st_mode))
    fail(ErrorKind::Unavailable, "cannot write '{}': it is a socket (a trace is written to a regular file, a device "
         "or a FIFO a process reads)", path);
  if (exists && S_ISFIFO(existing.st_mode)) {
    // Written through the descriptor that found the reader: a second open
    // (ReplacingFile's) would come after this one's close had ended the
    // reader's input, and wait for a reader that is gone.
    const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
      fail(ErrorKind::Unavailable, "cannot write '{}': {}", path,
           errno == ENXIO ? std::string("it is a FIFO no process reads (the write would wait for one for good)")
                          : std::string(std::strerror(errno)));
    struct Closer {
      int fd;
      ~Closer() { ::close(fd); }
    } closer{fd};
    if (const int flags = ::fcntl(fd, F_GETFL); flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    for (std::size_t done = 0; done < text.size();) {
      const ssize_t wrote = ::write(fd, text.data() + done, text.size() - done);
      if (wrote < 0 && errno == EINTR) continue;
      if (wrote <= 0)
        fail(ErrorKind::Unavailable, "cannot write '{}': {} after {} of {} bytes", path,
             std::strerror(wrote < 0 ? errno : EIO), done, text.size());
      done += static_cast<std::size_t>(wrote);
    }
    return;
  }
  ReplacingFile file(path, ReplacingFile::NotRegular::WriteInPlace);
  file.write(text);
  file.commit(ReplacingFile::Durability::Renamed);
}

}  // namespace devbridge::detail
