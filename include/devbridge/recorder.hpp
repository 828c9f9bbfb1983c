// The flight recorder's options and the stack annotation a binding attaches
// to the events a call records (Bridge::record, docs/TRACING.md).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace devbridge {

struct RecordOptions {
  // The ring's size: the newest max_events events are kept, older ones
  // overwritten (and counted as dropped). At least 1, at most
  // kMaxRecordedEvents.
  std::size_t max_events = 100000;
  // Attach the caller's stack (set by a binding through TraceStack) to each
  // event, interned: the dump prints it as args.stack.
  bool stacks = false;
  // Where an allocation that fails for good dumps the trace (empty: no dump).
  std::string oom_dump_dir{};
};

// 2^24 events of 104 bytes (a record and its counters): 1.6 GiB, past any
// ring a user means to keep.
inline constexpr std::size_t kMaxRecordedEvents = std::size_t{1} << 24;

// Why `max_events` cannot be a ring's size (outside [1, kMaxRecordedEvents]),
// or empty when it can: the one wording for Bridge::record's InvalidRange and
// the Python module's ValueError.
std::string max_events_refusal(std::size_t max_events);
// The refusal of a value no std::size_t holds (a binding's -1 or 2^64), as
// its caller spells it.
std::string max_events_refusal(std::string_view max_events_text);

// The stack text of the call a binding is about to make on this thread
// ("file:line function" lines), attached to the events the bridge records
// on this thread while the scope lives, when recording with stacks. A
// binding sets it while it still holds its interpreter lock, before it
// enters the bridge: the core never calls back into the interpreter under
// its lock.
class TraceStack {
 public:
  explicit TraceStack(std::string text);
  ~TraceStack();
  TraceStack(const TraceStack&) = delete;
  TraceStack& operator=(const TraceStack&) = delete;

  // The text in effect on this thread, or null.
  static const std::string* current() noexcept;

 private:
  std::string text_;
  const std::string* previous_;
};

}  // namespace devbridge
