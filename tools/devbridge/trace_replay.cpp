#include "trace_replay.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "devbridge/backends.hpp"
#include "devbridge/bridge.hpp"
#include "devbridge/error.hpp"
#include "sizes.hpp"

namespace devbridge::cli {

namespace {

struct MemoryOp {
  std::size_t index;  // in traceEvents
  std::string event;  // as the report names it (event_label)
  bool allocate;
  std::string handle;
  std::uint64_t bytes;
};

// An event replay could not apply: its index in traceEvents, how it is
// named, and why.
struct SkippedEvent {
  std::size_t index;
  std::string event;
  std::string why;
};

// An event by where it lies in traceEvents and, where it has one, its
// args.seq (its number since record: what the trace page's tooltips and the
// memory snapshot's history show).
std::string event_label(const nlohmann::json& event, std::size_t index) {
  const auto args = event.find("args");
  if (args != event.end() && args->is_object()) {
    const auto seq = args->find("seq");
    if (seq != args->end() && seq->is_number_unsigned())
      return fmt::format("event {}, seq {}", index, seq->get<std::uint64_t>());
  }
  return fmt::format("event {}", index);
}

std::vector<MemoryOp> memory_ops(const nlohmann::json& trace, std::vector<SkippedEvent>& skipped) {
  std::vector<MemoryOp> ops;
  const auto& events = trace["traceEvents"];
  for (std::size_t i = 0; i < events.size(); ++i) {
    const auto& e = events[i];
    if (!e.is_object() || e.value("ph", "") != "i" || e.value("cat", "") != "memory") continue;
    const std::string name = e.value("name", "");
    if (name != "allocate" && name != "free") continue;
    const auto args = e.find("args");
    if (args == e.end() || !args->is_object() || !args->contains("handle") || !(*args)["handle"].is_string()) {
      skipped.push_back({i, event_label(e, i), fmt::format("{} without a handle", name)});
      continue;
    }
    MemoryOp op{i, event_label(e, i), name == "allocate", (*args)["handle"].get<std::string>(), 0};
    if (op.allocate) {
      const auto bytes = args->find("bytes");
      if (bytes == args->end() || !bytes->is_number_unsigned() || bytes->get<std::uint64_t>() == 0) {
        skipped.push_back({i, op.event, fmt::format("allocate of {} without a size in bytes", op.handle)});
        continue;
      }
      op.bytes = bytes->get<std::uint64_t>();
    }
    ops.push_back(std::move(op));
  }
  return ops;
}

struct Policy {
  std::string name;
  CachingPool pool;
  std::optional<std::uint64_t> cap;
};

ReplayResult replay_one(const std::vector<MemoryOp>& ops, const Policy& policy, std::uint64_t device_memory,
                        std::vector<SkippedEvent>* skipped) {
  BridgeOptions options;
  options.ring_bytes = kReplayRingBytes;
  options.caching_pool = policy.pool;
  options.pool_cap_bytes = policy.cap;
  // Bookkeeping only (backing "none"): an 80 GiB device's allocations are
  // address ranges, not host memory (a 16 GiB allocate took 16 GB of RSS).
  Bridge bridge(make_backend("fake", {{"memory_bytes", std::to_string(device_memory)}, {"backing", "none"}}), options);
  ReplayResult result;
  result.policy = policy.name;
  std::map<std::string, DeviceHandle, std::less<>> live;
  std::set<std::string, std::less<>> out_of_memory;  // their frees are not news
  for (const auto& op : ops) {
    if (op.allocate) {
      if (live.contains(op.handle)) {
        if (skipped) skipped->push_back({op.index, op.event, fmt::format("allocate of {}, which is live", op.handle)});
        continue;
      }
      try {
        // A trace does not record alignments: 256 (what restore and most
        // tensors use), or the largest power of two that divides a size 256
        // does not (an extent is a multiple of its alignment).
        const std::uint64_t alignment = std::min<std::uint64_t>(256, op.bytes & (~op.bytes + 1));
        const ObjectSpec spec{op.bytes, alignment, std::nullopt, ShapeKind::Vector};
        live.emplace(op.handle, bridge.alloc_device(spec, op.bytes));
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::AllocationFailed) {
          if (skipped)
            skipped->push_back({op.index, op.event,
                                fmt::format("allocate of {} ({} bytes) refused: {}", op.handle, op.bytes, e.what())});
          continue;
        }
        out_of_memory.insert(op.handle);
        if (result.out_of_memory++ == 0)
          result.first_out_of_memory = fmt::format("{} ({} of {})", op.event, format_bytes(op.bytes), op.handle);
      }
    } else {
      const auto found = live.find(op.handle);
      if (found == live.end()) {
        // Its allocate was dropped from the recorder's ring (or failed above).
        if (out_of_memory.erase(op.handle) != 0) continue;
        if (skipped)
          skipped->push_back({op.index, op.event, fmt::format("free of {}, not allocated in the replay", op.handle)});
        continue;
      }
      bridge.free_device(found->second);
      live.erase(found);
    }
  }
  const MemoryStats stats = bridge.memory_stats();
  result.peak_reserved = stats.peak_reserved_bytes;
  result.peak_allocated = stats.peak_allocated_bytes;
  result.backend_allocations = stats.backend_allocations;
  result.cache_hits = stats.cache_hits;
  return result;
}

}  // namespace

ReplayReport replay_trace(const nlohmann::json& trace, const std::string& path, std::uint64_t device_memory,
                          const std::vector<std::uint64_t>& pool_caps) {
  ReplayReport report;
  report.path = path;
  report.device_memory = device_memory;
  std::vector<SkippedEvent> skipped;
  const auto ops = memory_ops(trace, skipped);
  for (const auto& op : ops) ++(op.allocate ? report.allocations : report.frees);
  std::vector<Policy> policies = {
      {"no caching pool", CachingPool::Off, std::nullopt},
      {"caching pool", CachingPool::On, std::nullopt},
      {"caching pool, cap 0", CachingPool::On, 0},
  };
  for (const std::uint64_t cap : pool_caps)
    policies.push_back({"caching pool, cap " + format_bytes(cap), CachingPool::On, cap});
  // Every policy meets the same events, so the first one alone says which it skipped.
  for (const auto& policy : policies)
    report.results.push_back(
        replay_one(ops, policy, device_memory, &policy == &policies.front() ? &skipped : nullptr));
  // Those the reading skipped and those the replay skipped, in the trace's order.
  std::stable_sort(skipped.begin(), skipped.end(), [](const auto& a, const auto& b) { return a.index < b.index; });
  for (const auto& s : skipped) report.skipped.push_back(fmt::format("{}: {}", s.event, s.why));
  return report;
}

std::string format_replay(const ReplayReport& report) {
  std::string out = fmt::format("{}: {} allocations and {} frees, replayed on a fake device of {}\n", report.path,
                                report.allocations, report.frees, format_bytes(report.device_memory));
  std::size_t policy_width = 22;  // the policy column fits the longest name (a --pool-cap one)
  for (const auto& r : report.results) policy_width = std::max(policy_width, r.policy.size());
  // The last column is left-aligned: its text ("4, first event 35 (256.00 KiB of 1:1:7)") is wider than its header.
  out += fmt::format("{:<{}} {:>14} {:>15} {:>15} {:>11}  {}\n", "policy", policy_width, "peak reserved",
                     "peak allocated", "backend allocs", "cache hits", "out of memory");
  for (const auto& r : report.results)
    out += fmt::format("{:<{}} {:>14} {:>15} {:>15} {:>11}  {}\n", r.policy, policy_width,
                       format_bytes(r.peak_reserved),
                       format_bytes(r.peak_allocated), r.backend_allocations, r.cache_hits,
                       r.out_of_memory == 0 ? std::string("no")
                                            : fmt::format("{}, first {}", r.out_of_memory, r.first_out_of_memory));
  for (const auto& s : report.skipped) out += "skipped: " + s + "\n";
  return out;
}

nlohmann::json replay_report_json(const ReplayReport& report) {
  nlohmann::json policies = nlohmann::json::array();
  for (const auto& r : report.results)
    policies.push_back({{"policy", r.policy},
                        {"peak_reserved_bytes", r.peak_reserved},
                        {"peak_allocated_bytes", r.peak_allocated},
                        {"backend_allocations", r.backend_allocations},
                        {"cache_hits", r.cache_hits},
                        {"out_of_memory", r.out_of_memory},
                        {"first_out_of_memory", r.first_out_of_memory}});
  return {{"path", report.path},       {"allocations", report.allocations}, {"frees", report.frees},
          {"device_memory", report.device_memory}, {"skipped", report.skipped},       {"policies", policies}};
}

}  // namespace devbridge::cli
