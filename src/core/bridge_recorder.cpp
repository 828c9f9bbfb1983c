// The bridge core's flight recorder: starting and stopping it, the recording
// sites the core calls (trace_sites.hpp), the dumps, and
// the out-of-memory message's holders (bridge_core.hpp, flight_recorder.hpp).
#include <filesystem>
#include <iterator>
#include <unordered_set>

#include <unistd.h>

#include "core/bridge_core.hpp"

namespace devbridge::detail {

void BridgeCore::record(const RecordOptions& options) {
  // The ring is allocated before the lock: a large one takes a while.
  auto recorder = std::make_unique<FlightRecorder>(FlightRecorder::check_options(options));
  std::unique_ptr<FlightRecorder> previous;
  {
    SpinLockHold lock(lock_);
    gate_.check_not_closed();
    previous = trace_.start(std::move(recorder));
    frees_off_common_path_ = true;
  }
  // The previous recording goes after the lock is dropped (freeing a large ring takes a while).
}

void BridgeCore::stop_recording() noexcept {
  std::lock_guard guard(lock_);
  trace_.stop();
  frees_off_common_path_ = pool_.has_value();
}

TraceDump BridgeCore::trace_dump() {
  TraceDump dump;
  dump.backend = backend_name_;
  dump.device = device_id_;
  dump.domain = domain_;
  // The copy's storage is made before the lock is taken, for as many
  // records as are kept now; only a ring that filled meanwhile grows it there.
  std::size_t kept = 0;
  {
    SpinLockHold lock(lock_);
    if (trace_.kept()) kept = trace_.kept()->size();
  }
  auto copy = FlightRecorder::ring_copy_for(kept);
  bool recorded = false;
  {
    SpinLockHold lock(lock_);
    if (trace_.kept()) {
      trace_.kept()->copy_to(copy);
      recorded = true;
    }
    dump.dump_ns = trace_now_ns();
  }
  if (recorded)
    FlightRecorder::fill_dump(copy, dump);
  else
    dump.start_ns = dump.dump_ns;
  return dump;
}

std::string BridgeCore::dump_for_oom() {
  std::string directory;
  std::uint64_t number;
  const auto now = std::chrono::steady_clock::now();
  {
    SpinLockHold lock(lock_);
    if (!trace_.kept()) return {};
    if (const auto recent = trace_.kept()->recent_oom_dump(now))
      return fmt::format("; the flight recorder's trace is in {} (written under {} s ago: one dump a second at most)",
                         *recent, FlightRecorder::kOomDumpInterval.count());
    directory = trace_.kept()->options().oom_dump_dir;
    number = trace_.next_oom_dump();
  }
  // The process in the name: domains are numbered from 1 in every process,
  // and processes often share one dump directory.
  const auto path = (std::filesystem::path(directory) /
                     fmt::format("devbridge-oom-{}-{}-{}.trace.json", ::getpid(), domain_, number))
                        .string();
  try {
    write_file_atomically(path, trace_json(trace_dump()));
  } catch (const std::exception& e) {
    return fmt::format("; the trace could not be dumped to {}: {}", path, e.what());
  }
  {
    SpinLockHold lock(lock_);
    if (trace_.kept()) trace_.kept()->note_oom_dump(path, now);
  }
  return fmt::format("; the flight recorder's trace is in {}", path);
}

std::string BridgeCore::top_holders_text(std::size_t count) {
  // A live allocation (its slot's index) or an orphan of an earlier
  // generation that a view or fence still keeps: both hold memory a retry
  // could not get back.
  struct Entry {
    std::uint64_t bytes;
    std::uint32_t index;
    const AllocationTable::OrphanKey* key;  // with `orphan`, for an orphan
    const Orphan* orphan;
  };
  std::vector<Entry> held;
  allocations_.for_each_in_use([&](std::uint32_t index, AllocationSlot& slot) {
    if (!slot.adopted_region) held.push_back({slot.device.bytes, index, nullptr, nullptr});
  });
  allocations_.for_each_orphan([&](const AllocationTable::OrphanKey& key, const Orphan& orphan) {
    if (!orphan.adopted_region) held.push_back({orphan.device.bytes, 0, &key, &orphan});
  });
  const auto shown = std::min(count, held.size());
  std::partial_sort(held.begin(), held.begin() + static_cast<std::ptrdiff_t>(shown), held.end(),
                    [](const Entry& a, const Entry& b) { return a.bytes > b.bytes; });
  std::string text;
  for (std::size_t i = 0; i < shown; ++i) {
    if (!text.empty()) text += "; ";
    if (const auto* orphan = held[i].orphan) {
      const auto& key = *held[i].key;
      fmt::format_to(std::back_inserter(text), "{} of {} bytes, from before a restart or close, kept by {}",
                     describe(DeviceHandle{domain_, key.first, key.second}), orphan->device.bytes,
                     orphan_holders_text(*orphan));
      continue;
    }
    const auto& slot = allocations_[held[i].index];
    const DeviceHandle h{domain_, generation_, make_id(held[i].index, slot.version)};
    fmt::format_to(std::back_inserter(text), "{} of {} bytes, {}", describe(h), slot.device.bytes,
                   slot.used() ? "held by " + uses(h, slot)
                               : std::string(slot.released ? "released, not yet freed" : "not freed by the caller"));
  }
  if (held.size() > shown) {
    // The rest are no larger than the last shown: often as large ("smaller" read wrong for equal sizes).
    std::uint64_t rest = 0;
    for (std::size_t i = shown; i < held.size(); ++i) rest += held[i].bytes;
    fmt::format_to(std::back_inserter(text), "; and {} more, none larger, {} bytes in all", held.size() - shown, rest);
  }
  return text;
}

std::string BridgeCore::orphan_holders_text(const Orphan& orphan) {
  // The restart forgot who each view was handed to: only how many remain.
  std::string text;
  if (orphan.views)
    text = fmt::format("{} live view{} (a numpy, jax, torch or tinygrad array, or the caller's own view; ending "
                       "{} frees it)",
                       orphan.views, orphan.views == 1 ? "" : "s", orphan.views == 1 ? "it" : "them");
  if (orphan.fences)
    text += fmt::format("{}{} use{} ending at a fence not yet passed", text.empty() ? "" : " and ", orphan.fences,
                        orphan.fences == 1 ? "" : "s");
  return text;
}

std::string BridgeCore::memory_snapshot_json() {
  SpinLockHold lock(lock_);
  std::string text;
  auto out = std::back_inserter(text);
  MemoryStats m;
  allocations_.fill(m, pool_ ? &*pool_ : nullptr);
  fmt::format_to(out,
                 "{{\"format\":\"devbridge-memory-snapshot\",\"version\":1,\"backend\":\"{}\",\"device\":\"{}\","
                 "\"domain\":{},\"generation\":{},",
                 json_escaped(backend_name_), json_escaped(device_id_), domain_, generation_);
  // Every MemoryStats field, under its name and in its order (TRACING.md).
  text += "\"stats\":{";
  const char* separator = "";
  for_each_field(m, [&](const char* name, auto value) {
    fmt::format_to(out, "{}\"{}\":{}", separator, name, value);
    separator = ",";
  });
  text += "},";
  fmt::format_to(out, "\"ring\":{{\"capacity\":{},\"used\":{},\"reservations\":{},\"releases_pending\":{}}},",
                 ring_.capacity(), ring_.used(), ring_.reservations(), release_after_.size());
  const bool recording = trace_.on();
  fmt::format_to(out, "\"recording\":{{\"on\":{},\"recorded_events\":{},\"dropped_events\":{}}},", recording,
                 trace_.kept() ? trace_.kept()->recorded() : 0, trace_.kept() ? trace_.kept()->dropped() : 0);

  // The recorded events of each live allocation, by id (only those are
  // shown: indexing every id the ring names held other callers for 180 ms
  // at 2^21 records).
  std::unordered_map<std::uint64_t, std::vector<std::uint64_t>> events;
  if (trace_.kept()) {
    allocations_.for_each_in_use(
        [&](std::uint32_t index, AllocationSlot& slot) { events.try_emplace(make_id(index, slot.version)); });
    if (!events.empty())
      for (std::size_t i = 0; i < trace_.kept()->size(); ++i) {
        const TraceSlot& r = trace_.kept()->slot(i);
        if (r.id == 0 || r.generation != generation_ || r.kind == TraceKind::Register) continue;
        if (auto it = events.find(r.id); it != events.end()) it->second.push_back(trace_.kept()->sequence(i));
      }
  }
  // The live allocations by address, so a pool block finds its owner.
  std::unordered_map<std::uint64_t, std::uint32_t> by_address;
  allocations_.for_each_in_use(
      [&](std::uint32_t index, AllocationSlot& slot) { by_address.emplace(slot.device.address, index); });

  auto write_block = [&](std::uint64_t offset, std::uint64_t bytes, const char* state, const std::uint32_t* index) {
    fmt::format_to(out, "{{\"offset\":{},\"bytes\":{},\"state\":\"{}\"", offset, bytes, state);
    if (index) {
      const auto& slot = allocations_[*index];
      const std::uint64_t id = make_id(*index, slot.version);
      const DeviceHandle h{domain_, generation_, id};
      const std::uint32_t fenced = drops_.uses_of(generation_, id);
      fmt::format_to(out,
                     ",\"handle\":\"{}:{}:{}\",\"requested\":{},\"released\":{},\"holders\":{{\"views\":{},"
                     "\"view_holders\":\"{}\",\"steps\":{},\"fences\":{},\"copies\":{},\"uploads\":{}}},\"events\":[",
                     domain_, generation_, id, slot.extent, slot.released, slot.views, json_escaped(views_text(h, slot)),
                     slot.steps - std::min(slot.steps, fenced), fenced, slot.copies, slot.uploads);
      if (auto it = events.find(id); it != events.end())
        for (std::size_t i = 0; i < it->second.size(); ++i) fmt::format_to(out, "{}{}", i ? "," : "", it->second[i]);
      fmt::format_to(out, "]");
    }
    fmt::format_to(out, "}}");
  };

  fmt::format_to(out, "\"segments\":[");
  bool first_segment = true;
  std::unordered_set<std::uint32_t> in_pool;  // live allocations the pool's segments hold
  std::unordered_set<std::uint64_t> orphans_in_pool;  // addresses of the pool's blocks no live handle names
  if (pool_) {
    // A split segment's spans come in offset order, one segment after another.
    std::uint64_t open_segment = ~0ull;
    pool_->for_each_block([&](const DeviceAllocation& segment, std::uint64_t offset, std::uint64_t bytes, bool free) {
      if (segment.address != open_segment || offset == 0) {
        if (open_segment != ~0ull) fmt::format_to(out, "]}}");
        fmt::format_to(out, "{}{{\"address\":{},\"bytes\":{},\"pool\":true,\"blocks\":[", first_segment ? "" : ",",
                       segment.address, segment.bytes);
        first_segment = false;
        open_segment = segment.address;
      } else {
        fmt::format_to(out, ",");
      }
      const auto owner = free ? by_address.end() : by_address.find(segment.address + offset);
      const bool whole = bytes == segment.bytes;
      if (owner != by_address.end()) in_pool.insert(owner->second);
      if (!free && owner == by_address.end()) orphans_in_pool.insert(segment.address + offset);
      write_block(offset, bytes,
                  free                         ? "cached"
                  : owner == by_address.end() ? "orphan"
                  : whole                      ? "allocated"
                                               : "split part",
                  owner == by_address.end() ? nullptr : &owner->second);
    });
    if (open_segment != ~0ull) fmt::format_to(out, "]}}");
  }
  // Allocations that are segments of their own: no pool, a pool of whole
  // blocks (which keeps no record of live ones), adopted host memory.
  allocations_.for_each_in_use([&](std::uint32_t index, AllocationSlot& slot) {
    if (in_pool.contains(index)) return;
    fmt::format_to(out, "{}{{\"address\":{},\"bytes\":{},\"pool\":false,\"blocks\":[", first_segment ? "" : ",",
                   slot.device.address, slot.device.bytes);
    first_segment = false;
    write_block(0, slot.device.bytes, slot.adopted_region ? "adopted" : "allocated", &index);
    fmt::format_to(out, "]}}");
  });
  // Orphans the pool's blocks did not show (no pool, or a whole block of a
  // whole-block pool, which keeps no record of live ones): each a segment of
  // its own, as the live allocation it was.
  allocations_.for_each_orphan([&](const AllocationTable::OrphanKey&, const Orphan& orphan) {
    if (orphans_in_pool.contains(orphan.device.address)) return;
    fmt::format_to(out, "{}{{\"address\":{},\"bytes\":{},\"pool\":false,\"blocks\":[", first_segment ? "" : ",",
                   orphan.device.address, orphan.device.bytes);
    first_segment = false;
    write_block(0, orphan.device.bytes, "orphan", nullptr);
    fmt::format_to(out, "]}}");
  });
  fmt::format_to(out, "]}}\n");
  return text;
}

}  // namespace devbridge::detail
