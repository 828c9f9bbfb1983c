// The fake backend's private parts, shared by its source files: the helpers
// and FakeBackend::State, the scripted device behind the public class
// (include/devbridge/backends/fake.hpp). fake_backend.cpp holds the design
// notes and the names; fake_memory.cpp device memory and parts,
// fake_transfers.cpp copies and completions, fake_fences.cpp fences,
// fake_compute.cpp the compute role, fake_import.cpp registered and adopted
// host memory.
#pragma once

#include "devbridge/backends/fake.hpp"

#include "backends/cpu_copy.hpp"
#include "backends/system_memory.hpp"
#include "core/describe.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <limits>
#include <deque>
#include <map>
#include <set>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>

#include <fmt/format.h>
#include "backends/backend_options.hpp"
#include "devbridge/checked.hpp"
#include "devbridge/types.hpp"

namespace devbridge::fake {

namespace impl {

// Fresh memory is filled with this byte so a test can tell "never written"
// from data (tests write random data, never a constant).
inline constexpr std::byte kFreshMemoryPattern{0xA5};
inline constexpr std::uint64_t kMinDeviceAlignment = 64;
inline constexpr std::uint64_t kHostBlockAlignment = 4096;

using SharedBytes = std::shared_ptr<std::byte>;

// Parts (make_part) start at multiples of this, as the pool promises.
inline constexpr std::uint64_t kPartAlignment = 512;

// Where the address ranges of allocations without memory behind them
// (Backing::None) start: 1 TiB, below where Linux maps heaps and libraries,
// and well inside what a double holds exactly (a trace page reads addresses).
inline constexpr std::uint64_t kUnbackedBase = 1ull << 40;

// Fresh aligned memory of `bytes` (at least 1). The aligned operator new
// rounds the size up to a multiple of the alignment, so a size within
// `alignment - 1` of 2^64 would wrap into a tiny block that the fill then
// overruns: the rounded size is checked first, and refused with
// AllocationFailed naming the size and `call` ("fake allocate_host").
inline SharedBytes allocate_bytes(std::uint64_t bytes, std::uint64_t alignment, std::string_view call) {
  const auto rounded = checked::align_up(std::max<std::uint64_t>(bytes, 1), alignment);
  if (!rounded) checked::overflow(ErrorKind::AllocationFailed, call, bytes, alignment, '^');
  const std::uint64_t size = *rounded;
  static_assert(sizeof(std::size_t) == sizeof(std::uint64_t), "the fake assumes a 64-bit address space");
  // No object is larger than PTRDIFF_MAX: refuse it here, as a driver would,
  // rather than leave it to operator new (fatal under AddressSanitizer).
  if (size > static_cast<std::uint64_t>(std::numeric_limits<std::ptrdiff_t>::max()))
    throw Error(ErrorKind::AllocationFailed, std::string(call) + ": " + std::to_string(bytes) +
                                                 " bytes: larger than the address space");
  // The fill below touches every page: past the machine's memory the process would be killed there.
  detail::refuse_more_than_the_machine_has(size, call, bytes);
  const auto align = std::align_val_t{static_cast<std::size_t>(alignment)};
  auto* raw = static_cast<std::byte*>(::operator new(static_cast<std::size_t>(size), align));
  std::memset(raw, static_cast<int>(kFreshMemoryPattern), static_cast<std::size_t>(size));
  return SharedBytes(raw, [align](std::byte* p) { ::operator delete(p, align); });
}

inline ErrorKind copy_error_kind(CopyDirection direction) {
  return direction == CopyDirection::HostToDevice ? ErrorKind::DeviceCopyFailed : ErrorKind::OutputCopyFailed;
}

inline ErrorKind fatal_error_kind(Call call) {
  switch (call) {
    case Call::Allocate:
    case Call::AllocateHost: return ErrorKind::AllocationFailed;
    case Call::CopyHostToDevice: return ErrorKind::DeviceCopyFailed;
    case Call::CopyDeviceToHost: return ErrorKind::OutputCopyFailed;
    default: return ErrorKind::Unavailable;  // launch, validate_view, quiesce: the device is gone
  }
}

inline std::string hex_address(std::uint64_t address) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(address));
  return buf;
}

// As the bridge names it (core/describe.hpp), so a fake's failure and the
// bridge's message about the same copy can be matched by eye.
inline std::string event_text(const CopyEvent& e) { return detail::describe(e); }

// The failures that fire on one call.
struct Fired {
  bool allocation_failed = false;
  bool copy_failed_at_submit = false;
  bool copy_failed_at_completion = false;
  bool invalid_view = false;
  bool lost = false;
  bool duplicated = false;
  bool late = false;
  bool fatal = false;
};

}  // namespace impl

using impl::allocate_bytes;
using impl::copy_error_kind;
using impl::event_text;
using impl::fatal_error_kind;
using impl::Fired;
using impl::hex_address;
using impl::kFreshMemoryPattern;
using impl::kHostBlockAlignment;
using impl::kMinDeviceAlignment;
using impl::kPartAlignment;
using impl::kUnbackedBase;
using impl::SharedBytes;

// The fake's TestControls: its own controls, behind the seam's accessor.
class FakeControls final : public TestControls {
 public:
  explicit FakeControls(FakeBackend& fake) noexcept : fake_(fake) {}
  std::uint64_t live_allocations() const override { return fake_.live_allocations(); }
  std::optional<std::uint64_t> live_host_blocks() const override { return fake_.live_host_blocks(); }
  std::optional<std::uint64_t> live_registrations() const override { return fake_.live_registrations(); }
  std::optional<std::uint64_t> live_fences() const override { return fake_.live_fences(); }
  bool can_hold_copies() const noexcept override { return true; }
  void hold_copies(bool hold) override {
    fake_.set_auto_complete(!hold);
    fake_.hold_launches(hold);
    if (!hold) fake_.complete_all();
  }
  FakeBackend* fake() noexcept override { return &fake_; }

 private:
  FakeBackend& fake_;
};

struct FakeBackend::State {
  struct Allocation {
    SharedBytes memory;
    std::uint64_t bytes = 0;
    // A part of another allocation (make_part): its own token, so a use
    // after release_part is caught; not counted as an allocation.
    std::uintptr_t whole = 0;
    // Host memory adopted in place (adopt_host): the caller's bytes, aliased
    // without owning them; counted by live_adoptions, not as an allocation.
    bool adopted = false;
    // No memory behind it (Backing::None): `memory` holds the address only.
    bool unbacked = false;
    // What free() warns about, counted so that it looks only when there is
    // something to find: parts of this allocation still live, and pending
    // copies into or out of it.
    std::uint64_t live_parts = 0;
    std::uint64_t pending_copies = 0;
    std::uintptr_t region = 0;  // adopted: the registered host block's token
  };
  struct HostBlockRecord {
    SharedBytes memory;
    std::uint64_t bytes = 0;
    bool registered = false;  // the caller's memory (register_host), not the fake's own
    std::uint64_t adoptions = 0;  // adopted allocations inside it still live (what unregister_host warns about)
  };
  struct Injection {
    Call call;
    Failure failure;
    int remaining;  // calls of this kind still to pass; fires when it reaches zero
  };
  struct PendingCopy {
    CopyRequest request;
    SharedBytes device_memory;  // keeps the bytes alive even if freed under the copy
    SharedBytes host_memory;
    bool fail_at_completion = false;
    bool lost = false;
    bool duplicated = false;
    bool late = false;
  };

  std::vector<DType> dtypes;  // what describe() reports
  std::uint64_t memory_bytes = 0;
  std::uint64_t used_bytes = 0;
  Backing backing = Backing::HostMemory;
  std::uint64_t next_unbacked = kUnbackedBase;  // the next address range's lowest start (Backing::None)

  mutable std::mutex mutex;
  std::condition_variable completions_ready;
  std::map<std::uintptr_t, Allocation> allocations;  // by token
  std::map<std::uintptr_t, HostBlockRecord> host_blocks;
  std::uintptr_t next_token = 1;
  std::vector<Injection> injections;
  std::deque<PendingCopy> pending;
  std::vector<Completion> ready;          // reported, not yet drained
  std::vector<Completion> late_after_quiesce;  // held until the next submit after quiesce
  bool late_released = false;                   // a copy was submitted since: deliver them
  std::vector<RecordedCall> calls;
  std::uint64_t dropped_calls = 0;  // the oldest, let go by record()
  bool auto_complete = false;
  bool parts = true;  // describe() offers parts (part_alignment)
  std::optional<FakeControls> controls;  // test_controls(); set by the constructor

  struct FenceRecord {
    QueueRef where;
    bool passed = false;
  };
  std::map<std::uintptr_t, FenceRecord> fences;  // handed out, not yet released
  std::uintptr_t next_fence = 1;
  bool launches_held = false;
  std::set<std::uintptr_t> blocked_consumers;
  std::condition_variable fence_passed;

  Fence new_fence(const QueueRef& where, bool pending) {
    if (!pending) return Fence{};
    const auto token = next_fence++;
    fences.emplace(token, FenceRecord{where, false});
    return Fence{token};
  }
  // Passes every pending fence `which` selects; the caller notifies.
  template <class Which>
  void pass_fences(Which which) {
    for (auto& [token, fence] : fences)
      if (which(fence.where)) fence.passed = true;
  }
  FenceRecord& fence_record(Fence fence) {
    auto it = fences.find(fence.token);
    if (it == fences.end())
      throw Error(ErrorKind::UnknownDeviceHandle,
                  "fake: fence " + std::to_string(fence.token) + " is unknown (never handed out, or released)");
    return it->second;
  }

  // Appends a record of `call` with its bytes and address (other fields
  // zero); returns its index, valid until the mutex is let go. Caller holds
  // the mutex. The oldest half is dropped once the log holds twice
  // kKeptCalls (FakeBackend::calls()).
  std::size_t record(Call call, std::uint64_t bytes = 0, std::uintptr_t address = 0) {
    if (calls.size() >= 2 * kKeptCalls) [[unlikely]] {
      calls.erase(calls.begin(), calls.begin() + static_cast<std::ptrdiff_t>(kKeptCalls));
      dropped_calls += kKeptCalls;
    }
    calls.emplace_back();
    calls.back().call = call;
    calls.back().bytes = bytes;
    calls.back().address = address;
    return calls.size() - 1;
  }

  // Consumes the injections that fire on this call. Caller holds the mutex.
  Fired fire(Call call) {
    Fired fired;
    for (auto it = injections.begin(); it != injections.end();) {
      if (it->call != call || --it->remaining > 0) {
        ++it;
        continue;
      }
      switch (it->failure) {
        case Failure::AllocationFailed: fired.allocation_failed = true; break;
        case Failure::CopyFailedAtSubmit: fired.copy_failed_at_submit = true; break;
        case Failure::CopyFailedAtCompletion: fired.copy_failed_at_completion = true; break;
        case Failure::InvalidView: fired.invalid_view = true; break;
        case Failure::LostCompletion: fired.lost = true; break;
        case Failure::DuplicatedCompletion: fired.duplicated = true; break;
        case Failure::LateCompletion: fired.late = true; break;
        case Failure::Fatal: fired.fatal = true; break;
      }
      it = injections.erase(it);
    }
    return fired;
  }

  [[noreturn]] static void throw_fatal(Call call, std::string_view what) {
    throw Error(fatal_error_kind(call),
                "fake " + std::string(call_name(call)) + ": injected fatal device error (device lost) " +
                    std::string(what),
                /*fatal=*/true);
  }

  // An address range of `bytes` (at least 1) at `alignment` for an
  // allocation without memory behind it: after every earlier one, never
  // reused; nothing once the 64-bit space is used up.
  std::optional<std::uintptr_t> unbacked_range(std::uint64_t bytes, std::uint64_t alignment) {
    const auto start = checked::align_up(next_unbacked, alignment);
    const auto end = start ? checked::add(*start, std::max<std::uint64_t>(bytes, 1)) : std::nullopt;
    if (!end) return std::nullopt;
    next_unbacked = *end;
    return static_cast<std::uintptr_t>(*start);
  }

  // A pending copy joins `pending` or leaves it: its allocation's count
  // (free() warns about a copy in flight when it is not 0). An allocation
  // already freed has none to keep.
  void count_pending(const PendingCopy& copy, bool added) noexcept {
    const auto it = allocations.find(copy.request.device.token);
    if (it == allocations.end()) return;
    if (added)
      ++it->second.pending_copies;
    else
      --it->second.pending_copies;
  }

  // The Unsupported refusal of `what` touching memory without backing.
  [[noreturn]] static void refuse_unbacked(std::string_view what, std::uint64_t address) {
    throw Error(ErrorKind::Unsupported,
                fmt::format("fake {}: the allocation at {:#x} has no memory behind it (backing=none: bookkeeping "
                            "only, for replaying allocations and frees); copies, views and launches are refused",
                            what, address));
  }

  // The live allocation (or part) `a` names, or nullptr: its token is
  // known and still at a's address.
  Allocation* live(const DeviceAllocation& a) {
    const auto it = allocations.find(a.token);
    if (it == allocations.end() || reinterpret_cast<std::uintptr_t>(it->second.memory.get()) != a.address)
      return nullptr;
    return &it->second;
  }
  static bool is_whole(const std::pair<const std::uintptr_t, Allocation>& entry) {
    return entry.second.whole == 0 && !entry.second.adopted;
  }
  static bool is_adopted(const std::pair<const std::uintptr_t, Allocation>& entry) { return entry.second.adopted; }

  // The host block holding [host, host + len), or nullptr.
  const HostBlockRecord* find_host_block(const std::byte* host, std::uint64_t len) const {
    const auto address = reinterpret_cast<std::uintptr_t>(host);
    for (const auto& [token, block] : host_blocks) {
      const auto begin = reinterpret_cast<std::uintptr_t>(block.memory.get());
      if (address >= begin && checked::range_within(address - begin, len, block.bytes)) {
        return &block;
      }
    }
    return nullptr;
  }

  std::uint64_t host_offset_of(const std::byte* host) const {
    const auto address = reinterpret_cast<std::uintptr_t>(host);
    for (const auto& [token, block] : host_blocks) {
      const auto begin = reinterpret_cast<std::uintptr_t>(block.memory.get());
      if (address >= begin && address - begin <= block.bytes) return address - begin;
    }
    return address;  // not in any block: the raw pointer, so a test sees it
  }

  // Only after submit_copy checked both ranges (range_within): no sum wraps.
  static void move_bytes(const CopyRequest& r) {
    detail::move_request_bytes(r, reinterpret_cast<std::byte*>(r.device.address) + r.device_offset);
  }

  static Completion outcome(const PendingCopy& copy, bool ok) {
    Completion c;
    c.event = copy.request.event;
    c.ok = ok;
    c.error = copy_error_kind(copy.request.direction);
    if (!ok) {
      c.message = std::string("fake ") +
                  (copy.request.direction == CopyDirection::HostToDevice ? "copy_h2d" : "copy_d2h") +
                  ": copy failed at completion (" + event_text(copy.request.event) + ", " +
                  std::to_string(copy.request.len) + " bytes); no byte moved";
    }
    return c;
  }

  // Finishes a copy taken out of `pending`: moves its bytes when it succeeds
  // and queues its completion(s) per its injected behaviour. Caller holds the mutex.
  void finish(const PendingCopy& copy, bool ok, std::vector<Completion>& queue) {
    const bool succeeded = ok && !copy.fail_at_completion;
    if (succeeded) move_bytes(copy.request);
    if (copy.lost) return;
    queue.push_back(outcome(copy, succeeded));
    if (copy.duplicated) queue.push_back(outcome(copy, succeeded));
  }
};

}  // namespace devbridge::fake
