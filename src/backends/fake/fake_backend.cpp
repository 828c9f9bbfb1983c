// The fake backend: a scripted device over real host memory.
//
// Design choices the header leaves open (tests rely on them):
//  - "Device" memory is ordinary aligned host memory, so views hand out real
//    addresses. describe() therefore reports a CPU device (tinygrad "CPU",
//    DLPack kDLCPU): tinygrad has no fake device, and anything that follows
//    the address must find host memory behind it.
//  - Every hook call is recorded (before its outcome is known), including calls
//    that then fail. drain_completions, wait_for_completions and describe are
//    not recorded: they carry no arguments worth asserting.
//  - Memory behind an allocation or host block is reference-counted by the
//    copies that use it, so a bridge that frees under a running copy makes the
//    fake print a warning instead of corrupting the heap.
//  - quiesce() cancels pending async copies by DROPPING them: their bytes are
//    not moved and no completion is ever reported, as after a device reset.
//    The bridge retires old events on restart itself and must not wait for
//    cancellation notices. Completions already reported (queued, not yet
//    drained) stay queued. Copies marked LateCompletion are the exception:
//    quiesce finishes them (bytes move, or not when they also carry
//    CopyFailedAtCompletion) and their completion is held back until the next
//    copy is submitted after the quiesce: the first drain_completions after
//    that submission reports it. So it lands after the bridge's own restart
//    drain, while the new generation's work is in flight — the worst moment,
//    the one the reference implementation got wrong.
//  - LostCompletion, DuplicatedCompletion, LateCompletion and
//    CopyFailedAtCompletion act on the completion of an async copy; on a sync
//    copy CopyFailedAtCompletion throws after the "transfer" without moving
//    bytes, and the other three have no effect (a sync copy reports nothing).
//  - A LateCompletion copy stays pending under auto-complete: it is late.
//  - launch_axpy runs at call time; the fake does not model stream order, so
//    tests complete copies into x before launching. Its fence, though, stays
//    pending while launches are held (hold_launches): for the bridge the
//    kernel is still running, which is what lifetime tests need.
//  - fence_passed/wait_fence on a fence the fake does not know (released, or
//    never handed out) throw: a bridge that asks twice is caught.
//  - inject() refuses (std::invalid_argument) a failure that cannot apply to
//    the call kind, e.g. InvalidView on Allocate or anything on Free (free
//    hooks are noexcept).
#include "devbridge/backends/fake.hpp"

#include "backends/cpu_copy.hpp"

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

std::string_view call_name(Call call) noexcept {
  switch (call) {
    case Call::Allocate: return "allocate";
    case Call::Free: return "free";
    case Call::AllocateHost: return "allocate_host";
    case Call::FreeHost: return "free_host";
    case Call::CopyHostToDevice: return "copy_h2d";
    case Call::CopyDeviceToHost: return "copy_d2h";
    case Call::Launch: return "launch";
    case Call::ValidateView: return "validate_view";
    case Call::Quiesce: return "quiesce";
    case Call::RegisterHost: return "register_host";
    case Call::UnregisterHost: return "unregister_host";
  }
  return "unknown";
}

std::string_view failure_name(Failure failure) noexcept {
  switch (failure) {
    case Failure::AllocationFailed: return "allocation_failed";
    case Failure::CopyFailedAtSubmit: return "copy_failed_at_submit";
    case Failure::CopyFailedAtCompletion: return "copy_failed_at_completion";
    case Failure::InvalidView: return "invalid_view";
    case Failure::LostCompletion: return "lost_completion";
    case Failure::DuplicatedCompletion: return "duplicated_completion";
    case Failure::LateCompletion: return "late_completion";
    case Failure::Fatal: return "fatal";
  }
  return "unknown";
}

bool applies(Call call, Failure failure) noexcept {
  switch (failure) {
    case Failure::AllocationFailed:
      return call == Call::Allocate || call == Call::AllocateHost || call == Call::RegisterHost;
    case Failure::CopyFailedAtSubmit:
    case Failure::CopyFailedAtCompletion:
    case Failure::LostCompletion:
    case Failure::DuplicatedCompletion:
    case Failure::LateCompletion:
      return call == Call::CopyHostToDevice || call == Call::CopyDeviceToHost;
    case Failure::InvalidView:
      return call == Call::ValidateView;
    case Failure::Fatal:
      return call != Call::Free && call != Call::FreeHost && call != Call::UnregisterHost;
  }
  return false;
}

namespace {

// Fresh memory is filled with this byte so a test can tell "never written"
// from data (tests write random data, never a constant).
constexpr std::byte kFreshMemoryPattern{0xA5};
constexpr std::uint64_t kMinDeviceAlignment = 64;
constexpr std::uint64_t kHostBlockAlignment = 4096;

using SharedBytes = std::shared_ptr<std::byte>;

// Parts (make_part) start at multiples of this, as the pool promises.
constexpr std::uint64_t kPartAlignment = 512;

// Fresh aligned memory of `bytes` (at least 1). The aligned operator new
// rounds the size up to a multiple of the alignment, so a size within
// `alignment - 1` of 2^64 would wrap into a tiny block that the fill then
// overruns: the rounded size is checked first, and refused with
// AllocationFailed naming the size and `call` ("fake allocate_host").
SharedBytes allocate_bytes(std::uint64_t bytes, std::uint64_t alignment, std::string_view call) {
  const auto rounded = checked::align_up(std::max<std::uint64_t>(bytes, 1), alignment);
  if (!rounded) checked::overflow(ErrorKind::AllocationFailed, call, bytes, alignment, '^');
  const std::uint64_t size = *rounded;
  static_assert(sizeof(std::size_t) == sizeof(std::uint64_t), "the fake assumes a 64-bit address space");
  // No object is larger than PTRDIFF_MAX: refuse it here, as a driver would,
  // rather than leave it to operator new (fatal under AddressSanitizer).
  if (size > static_cast<std::uint64_t>(std::numeric_limits<std::ptrdiff_t>::max()))
    throw Error(ErrorKind::AllocationFailed, std::string(call) + ": " + std::to_string(bytes) +
                                                 " bytes: larger than the address space");
  const auto align = std::align_val_t{static_cast<std::size_t>(alignment)};
  auto* raw = static_cast<std::byte*>(::operator new(static_cast<std::size_t>(size), align));
  std::memset(raw, static_cast<int>(kFreshMemoryPattern), static_cast<std::size_t>(size));
  return SharedBytes(raw, [align](std::byte* p) { ::operator delete(p, align); });
}

ErrorKind copy_error_kind(CopyDirection direction) {
  return direction == CopyDirection::HostToDevice ? ErrorKind::DeviceCopyFailed : ErrorKind::OutputCopyFailed;
}

ErrorKind fatal_error_kind(Call call) {
  switch (call) {
    case Call::Allocate:
    case Call::AllocateHost: return ErrorKind::AllocationFailed;
    case Call::CopyHostToDevice: return ErrorKind::DeviceCopyFailed;
    case Call::CopyDeviceToHost: return ErrorKind::OutputCopyFailed;
    default: return ErrorKind::Unavailable;  // launch, validate_view, quiesce: the device is gone
  }
}

std::string hex_address(std::uint64_t address) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(address));
  return buf;
}

std::string event_text(const CopyEvent& e) {
  return "event {domain " + std::to_string(e.domain) + ", generation " + std::to_string(e.generation) + ", id " +
         std::to_string(e.id) + "}";
}

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

}  // namespace

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
  };
  struct HostBlockRecord {
    SharedBytes memory;
    std::uint64_t bytes = 0;
    bool registered = false;  // the caller's memory (register_host), not the fake's own
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
  bool auto_complete = false;
  bool parts = true;  // part_alignment() offers parts

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

  // Appends a record of `call` (other fields zero); returns its index. Caller holds the mutex.
  std::size_t record(Call call) {
    calls.emplace_back();
    calls.back().call = call;
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

FakeBackend::FakeBackend(std::uint64_t memory_bytes, std::vector<DType> dtypes) : state_(std::make_unique<State>()) {
  state_->memory_bytes = memory_bytes;
  if (dtypes.empty())
    for (const auto& d : all_dtypes()) dtypes.push_back(d.dtype);
  state_->dtypes = std::move(dtypes);
}

FakeBackend::~FakeBackend() {
  std::lock_guard lock(state_->mutex);
  if (!state_->allocations.empty() || !state_->host_blocks.empty()) {
    std::fprintf(stderr, "FakeBackend: destroyed with %zu live allocation(s) and %zu live host block(s)\n",
                 state_->allocations.size(), state_->host_blocks.size());
  }
}

// ---- test controls ----------------------------------------------------------

void FakeBackend::inject(Call call, Failure failure, int nth) {
  if (nth < 1) throw std::invalid_argument("FakeBackend::inject: nth must be >= 1, got " + std::to_string(nth));
  if (!applies(call, failure)) {
    throw std::invalid_argument("FakeBackend::inject: " + std::string(failure_name(failure)) +
                                " cannot apply to " + std::string(call_name(call)));
  }
  std::lock_guard lock(state_->mutex);
  state_->injections.push_back({call, failure, nth});
}

bool FakeBackend::complete(CopyEvent event, bool ok) {
  {
    std::lock_guard lock(state_->mutex);
    auto it = std::find_if(state_->pending.begin(), state_->pending.end(),
                           [&](const State::PendingCopy& p) { return p.request.event == event; });
    if (it == state_->pending.end()) return false;
    State::PendingCopy copy = std::move(*it);
    state_->pending.erase(it);
    state_->finish(copy, ok, state_->ready);
  }
  state_->completions_ready.notify_all();
  return true;
}

std::size_t FakeBackend::complete_all(bool ok) {
  std::size_t count = 0;
  {
    std::lock_guard lock(state_->mutex);
    while (!state_->pending.empty()) {
      State::PendingCopy copy = std::move(state_->pending.front());
      state_->pending.pop_front();
      state_->finish(copy, ok, state_->ready);
      ++count;
    }
  }
  state_->completions_ready.notify_all();
  return count;
}

std::vector<CopyEvent> FakeBackend::pending() const {
  std::lock_guard lock(state_->mutex);
  std::vector<CopyEvent> events;
  events.reserve(state_->pending.size());
  for (const auto& p : state_->pending) events.push_back(p.request.event);
  return events;
}

void FakeBackend::report_completion(CopyEvent event, bool ok) {
  {
    std::lock_guard lock(state_->mutex);
    Completion c;
    c.event = event;
    c.ok = ok;
    if (!ok) c.message = "fake: forged failed completion for " + event_text(event);
    state_->ready.push_back(std::move(c));
  }
  state_->completions_ready.notify_all();
}

std::vector<RecordedCall> FakeBackend::calls() const {
  std::lock_guard lock(state_->mutex);
  return state_->calls;
}

void FakeBackend::clear_calls() {
  std::lock_guard lock(state_->mutex);
  state_->calls.clear();
}

std::uint64_t FakeBackend::live_allocations() const {
  std::lock_guard lock(state_->mutex);
  return static_cast<std::uint64_t>(
      std::count_if(state_->allocations.begin(), state_->allocations.end(), &State::is_whole));
}

std::uint64_t FakeBackend::part_alignment() const {
  std::lock_guard lock(state_->mutex);
  return state_->parts ? kPartAlignment : 0;
}

void FakeBackend::set_parts(bool on) {
  std::lock_guard lock(state_->mutex);
  state_->parts = on;
}

std::uint64_t FakeBackend::live_parts() const {
  std::lock_guard lock(state_->mutex);
  return static_cast<std::uint64_t>(std::count_if(state_->allocations.begin(), state_->allocations.end(),
                                                  [](const auto& entry) { return entry.second.whole != 0; }));
}

std::uint64_t FakeBackend::live_adoptions() const {
  std::lock_guard lock(state_->mutex);
  return static_cast<std::uint64_t>(
      std::count_if(state_->allocations.begin(), state_->allocations.end(), &State::is_adopted));
}

DeviceAllocation FakeBackend::adopt_host(const HostBlock& region, std::uint64_t offset, std::uint64_t bytes) {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  const auto block = s.host_blocks.find(region.token);
  if (block == s.host_blocks.end() || !block->second.registered || block->second.memory.get() != region.data ||
      !checked::range_within(offset, bytes, block->second.bytes))
    throw Error(ErrorKind::InvalidRange, fmt::format("fake adopt_host: [{}, +{}) is not inside memory registered "
                                                     "with the fake ({} bytes at {})",
                                                     offset, bytes, region.bytes, static_cast<void*>(region.data)));
  const std::uintptr_t token = s.next_token++;
  SharedBytes memory(SharedBytes(), region.data + offset);  // the caller's bytes, not owned
  const DeviceAllocation adopted{reinterpret_cast<std::uintptr_t>(memory.get()), bytes, token};
  s.allocations.emplace(token, State::Allocation{std::move(memory), bytes, 0, true});
  return adopted;
}

void FakeBackend::release_adopted(const DeviceAllocation& adopted) noexcept {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  const auto it = s.allocations.find(adopted.token);
  if (it == s.allocations.end() || !it->second.adopted) {
    std::fprintf(stderr, "FakeBackend: release_adopted of unknown or already released memory (address 0x%llx, "
                         "token %llu)\n",
                 static_cast<unsigned long long>(adopted.address), static_cast<unsigned long long>(adopted.token));
    return;
  }
  s.allocations.erase(it);
}

DeviceAllocation FakeBackend::make_part(const DeviceAllocation& whole, std::uint64_t offset, std::uint64_t bytes) {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  State::Allocation* const parent = s.live(whole);
  if (parent == nullptr || parent->whole != 0 || !checked::range_within(offset, bytes, parent->bytes) ||
      offset % kPartAlignment != 0)
    throw Error(ErrorKind::InvalidRange, fmt::format("fake make_part: [{}, +{}) is not a part of a live allocation "
                                                     "(address {:#x}, {} bytes) at a multiple of {} bytes",
                                                     offset, bytes, whole.address, whole.bytes, kPartAlignment));
  const std::uintptr_t token = s.next_token++;
  SharedBytes memory(parent->memory, parent->memory.get() + offset);  // shares the whole's bytes
  const DeviceAllocation part{reinterpret_cast<std::uintptr_t>(memory.get()), bytes, token};
  s.allocations.emplace(token, State::Allocation{std::move(memory), bytes, whole.token});
  return part;
}

void FakeBackend::release_part(const DeviceAllocation& part) noexcept {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  const auto it = s.allocations.find(part.token);
  if (it == s.allocations.end() || it->second.whole == 0) {
    std::fprintf(stderr, "FakeBackend: release_part of unknown or already released part (address 0x%llx, token %llu)\n",
                 static_cast<unsigned long long>(part.address), static_cast<unsigned long long>(part.token));
    return;
  }
  s.allocations.erase(it);
}

std::uint64_t FakeBackend::live_host_blocks() const {
  std::lock_guard lock(state_->mutex);
  return static_cast<std::uint64_t>(std::count_if(state_->host_blocks.begin(), state_->host_blocks.end(),
                                                  [](const auto& entry) { return !entry.second.registered; }));
}

void FakeBackend::set_auto_complete(bool on) {
  std::lock_guard lock(state_->mutex);
  state_->auto_complete = on;
}

// ---- Backend ----------------------------------------------------------------

BackendInfo FakeBackend::describe() {
  BackendInfo info;
  info.name = "fake";
  info.vendor = "fake";
  info.device_name = "fake device (host memory)";
  info.device_kind = DeviceKind::Cpu;  // the memory is host memory (and tinygrad has no fake device)
  info.device_ordinal = 0;
  info.device_id = "0";
  {
    std::lock_guard lock(state_->mutex);
    info.total_memory = state_->memory_bytes;
    info.free_memory = state_->memory_bytes - state_->used_bytes;
  }
  info.dtypes = state_->dtypes;
  info.host_memory_page_locked = false;
  info.notes = "scripted test device: device memory is host memory, async copies complete when the test says";
  return info;
}

DeviceAllocation FakeBackend::allocate(std::uint64_t bytes, std::uint64_t alignment) {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  const std::size_t record = s.record(Call::Allocate);
  s.calls[record].bytes = bytes;
  s.calls[record].alignment = alignment;
  const Fired fired = s.fire(Call::Allocate);
  const std::uint64_t free_bytes = s.memory_bytes - s.used_bytes;
  if (fired.fatal) State::throw_fatal(Call::Allocate, "allocating " + std::to_string(bytes) + " bytes");
  if (fired.allocation_failed) {
    throw Error(ErrorKind::AllocationFailed, "fake allocate: injected failure: " + std::to_string(bytes) +
                                                 " bytes asked, " + std::to_string(free_bytes) + " bytes free");
  }
  if (!is_power_of_two(alignment)) {
    throw Error(ErrorKind::InvalidAlignment,
                "fake allocate: alignment " + std::to_string(alignment) + " is not a power of two");
  }
  const auto out_of_memory = [&] {
    return Error(ErrorKind::AllocationFailed, "fake allocate: out of memory: " + std::to_string(bytes) +
                                                  " bytes asked, " + std::to_string(free_bytes) + " bytes free of " +
                                                  std::to_string(s.memory_bytes));
  };
  if (bytes > free_bytes) throw out_of_memory();
  State::Allocation allocation;
  try {
    allocation = {allocate_bytes(bytes, std::max(alignment, kMinDeviceAlignment), "fake allocate: bytes asked"), bytes};
  } catch (const std::bad_alloc&) {
    throw out_of_memory();
  }
  const std::uintptr_t token = s.next_token++;
  const DeviceAllocation result{reinterpret_cast<std::uintptr_t>(allocation.memory.get()), bytes, token};
  s.allocations.emplace(token, std::move(allocation));
  s.used_bytes += bytes;
  s.calls[record].address = result.address;
  return result;
}

void FakeBackend::free(const DeviceAllocation& allocation) noexcept {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  {
    RecordedCall& call = s.calls[s.record(Call::Free)];
    call.bytes = allocation.bytes;
    call.address = allocation.address;
  }
  auto it = s.allocations.find(allocation.token);
  if (it == s.allocations.end() || reinterpret_cast<std::uintptr_t>(it->second.memory.get()) != allocation.address) {
    std::fprintf(stderr, "FakeBackend: free of unknown or already freed allocation (address 0x%llx, token %llu)\n",
                 static_cast<unsigned long long>(allocation.address),
                 static_cast<unsigned long long>(allocation.token));
    return;
  }
  if (it->second.adopted) {
    std::fprintf(stderr, "FakeBackend: free of adopted host memory (address 0x%llx), which is released, never freed\n",
                 static_cast<unsigned long long>(allocation.address));
    return;
  }
  for (const auto& [token, other] : s.allocations) {
    if (other.whole == allocation.token) {
      std::fprintf(stderr, "FakeBackend: allocation 0x%llx freed while its part 0x%llx is live\n",
                   static_cast<unsigned long long>(allocation.address),
                   static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(other.memory.get())));
    }
  }
  for (const auto& p : s.pending) {
    if (p.request.device.token == allocation.token) {
      std::fprintf(stderr, "FakeBackend: allocation 0x%llx freed while copy %s is in flight\n",
                   static_cast<unsigned long long>(allocation.address), event_text(p.request.event).c_str());
    }
  }
  s.used_bytes -= it->second.bytes;
  s.allocations.erase(it);
}

HostBlock FakeBackend::allocate_host(std::uint64_t bytes) {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  const std::size_t record = s.record(Call::AllocateHost);
  s.calls[record].bytes = bytes;
  const Fired fired = s.fire(Call::AllocateHost);
  if (fired.fatal) State::throw_fatal(Call::AllocateHost, "allocating " + std::to_string(bytes) + " host bytes");
  if (fired.allocation_failed) {
    throw Error(ErrorKind::AllocationFailed,
                "fake allocate_host: injected failure: " + std::to_string(bytes) + " host bytes asked");
  }
  // The fake's memory bounds its host blocks too: a ring near 2^64 bytes is
  // refused as a driver would refuse it, not left to the allocator.
  if (bytes > s.memory_bytes)
    throw Error(ErrorKind::AllocationFailed, "fake allocate_host: " + std::to_string(bytes) +
                                                 " host bytes asked, more than the fake's memory of " +
                                                 std::to_string(s.memory_bytes));
  State::HostBlockRecord block;
  try {
    block = {allocate_bytes(bytes, kHostBlockAlignment, "fake allocate_host: host bytes asked"), bytes};
  } catch (const std::bad_alloc&) {
    throw Error(ErrorKind::AllocationFailed,
                "fake allocate_host: out of host memory: " + std::to_string(bytes) + " host bytes asked");
  }
  const std::uintptr_t token = s.next_token++;
  const HostBlock result{block.memory.get(), bytes, /*page_locked=*/false, token};
  s.host_blocks.emplace(token, std::move(block));
  s.calls[record].address = reinterpret_cast<std::uintptr_t>(result.data);
  return result;
}

void FakeBackend::free_host(const HostBlock& block) noexcept {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  {
    RecordedCall& call = s.calls[s.record(Call::FreeHost)];
    call.bytes = block.bytes;
    call.address = reinterpret_cast<std::uintptr_t>(block.data);
  }
  auto it = s.host_blocks.find(block.token);
  if (it == s.host_blocks.end() || it->second.memory.get() != block.data) {
    std::fprintf(stderr, "FakeBackend: free_host of unknown or already freed block (%p, token %llu)\n",
                 static_cast<void*>(block.data), static_cast<unsigned long long>(block.token));
    return;
  }
  s.host_blocks.erase(it);
}

HostBlock FakeBackend::register_host(std::byte* data, std::uint64_t bytes) {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  const std::size_t record = s.record(Call::RegisterHost);
  s.calls[record].bytes = bytes;
  s.calls[record].address = reinterpret_cast<std::uintptr_t>(data);
  const Fired fired = s.fire(Call::RegisterHost);
  const std::string what = std::to_string(bytes) + " bytes at " + std::to_string(reinterpret_cast<std::uintptr_t>(data));
  if (fired.fatal) State::throw_fatal(Call::RegisterHost, "registering " + what);
  if (fired.allocation_failed)
    throw Error(ErrorKind::AllocationFailed, "fake register_host: injected failure registering " + what);
  // A driver refuses to pin the same pages twice (cuMemHostRegister); the
  // bridge must never ask.
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  for (const auto& [token, block] : s.host_blocks) {
    const auto other = reinterpret_cast<std::uintptr_t>(block.memory.get());
    if (begin < other + block.bytes && other < begin + bytes)
      throw Error(ErrorKind::InvalidRange, "fake register_host: " + what + " overlaps a host block the fake holds");
  }
  const std::uintptr_t token = s.next_token++;
  // The caller owns the bytes: the record aliases them without owning them.
  s.host_blocks.emplace(token, State::HostBlockRecord{SharedBytes(SharedBytes(), data), bytes, true});
  return HostBlock{data, bytes, /*page_locked=*/false, token};
}

void FakeBackend::unregister_host(const HostBlock& block) noexcept {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  {
    RecordedCall& call = s.calls[s.record(Call::UnregisterHost)];
    call.bytes = block.bytes;
    call.address = reinterpret_cast<std::uintptr_t>(block.data);
  }
  auto it = s.host_blocks.find(block.token);
  if (it == s.host_blocks.end() || !it->second.registered || it->second.memory.get() != block.data) {
    std::fprintf(stderr, "FakeBackend: unregister_host of unknown or already unregistered memory (%p, token %llu)\n",
                 static_cast<void*>(block.data), static_cast<unsigned long long>(block.token));
    return;
  }
  for (const auto& [token, allocation] : s.allocations) {
    const auto* at = allocation.memory.get();
    if (allocation.adopted && at >= block.data && at < block.data + block.bytes)
      std::fprintf(stderr, "FakeBackend: unregister_host of memory (%p) an adopted allocation (%p) still uses\n",
                   static_cast<void*>(block.data), static_cast<const void*>(at));
  }
  s.host_blocks.erase(it);
}

std::uint64_t FakeBackend::live_registrations() const {
  std::lock_guard lock(state_->mutex);
  return static_cast<std::uint64_t>(std::count_if(state_->host_blocks.begin(), state_->host_blocks.end(),
                                                  [](const auto& entry) { return entry.second.registered; }));
}

bool FakeBackend::copy_to_peer(const DeviceAllocation& source, std::uint64_t source_offset,
                               Backend& destination_backend, const DeviceAllocation& destination,
                               std::uint64_t destination_offset, std::uint64_t len) {
  auto* peer = dynamic_cast<FakeBackend*>(&destination_backend);
  if (peer == nullptr) return false;
  // Each fake checks its own side under its own mutex, one at a time.
  const auto live = [](FakeBackend& fake, const DeviceAllocation& a, std::uint64_t offset, std::uint64_t bytes) {
    std::lock_guard lock(fake.state_->mutex);
    const State::Allocation* allocation = fake.state_->live(a);
    if (allocation == nullptr || !checked::range_within(offset, bytes, allocation->bytes))
      throw Error(ErrorKind::InvalidRange, fmt::format("fake copy_to_peer: [{}, +{}) of the allocation at {:#x} is "
                                                       "not live in its backend", offset, bytes, a.address));
    return allocation->memory;
  };
  const SharedBytes from = live(*this, source, source_offset, len);
  const SharedBytes to = live(*peer, destination, destination_offset, len);
  std::memmove(to.get() + destination_offset, from.get() + source_offset, len);
  return true;
}

void FakeBackend::submit_copy(const CopyRequest& request) {
  const Call call =
      request.direction == CopyDirection::HostToDevice ? Call::CopyHostToDevice : Call::CopyDeviceToHost;
  // Declared before the lock so that it notifies after unlocking, on every exit path.
  struct NotifyOnExit {
    std::condition_variable& cv;
    bool armed = false;
    ~NotifyOnExit() {
      if (armed) cv.notify_all();
    }
  } notify{state_->completions_ready};
  {
    std::lock_guard lock(state_->mutex);
    auto& s = *state_;
    {
      RecordedCall& recorded = s.calls[s.record(call)];
      recorded.bytes = request.len;
      recorded.address = request.device.address;
      recorded.host_offset = s.host_offset_of(request.host);
      recorded.device_offset = request.device_offset;
      recorded.layout = request.layout;
      recorded.mode = request.mode;
      recorded.event = request.event;
    }
    if (!s.late_after_quiesce.empty()) {
      s.late_released = true;
      notify.armed = true;
    }
    const Fired fired = s.fire(call);
    const std::string what = event_text(request.event) + ", " + std::to_string(request.len) + " bytes";
    if (fired.fatal) State::throw_fatal(call, "copying " + what);
    if (fired.copy_failed_at_submit) {
      throw Error(copy_error_kind(request.direction),
                  "fake " + std::string(call_name(call)) + ": injected failure at submit (" + what + "); no byte moved");
    }

    // The bridge validates every range; the fake re-checks so that a range
    // that slips through is caught here instead of corrupting memory.
    const State::Allocation* allocation = s.live(request.device);
    if (allocation == nullptr) {
      throw Error(ErrorKind::UnknownDeviceHandle, "fake " + std::string(call_name(call)) +
                                                      ": allocation not live in the backend (" + what + ")");
    }
    if (!checked::range_within(request.device_offset, request_device_span(request), allocation->bytes)) {
      throw Error(ErrorKind::InvalidRange, "fake " + std::string(call_name(call)) + ": device range [" +
                                               std::to_string(request.device_offset) + ", +" +
                                               std::to_string(request_device_span(request)) + ") outside allocation of " +
                                               std::to_string(allocation->bytes) + " bytes reached the backend");
    }
    const State::HostBlockRecord* host_block = s.find_host_block(request.host, request_host_span(request));
    if (host_block == nullptr) {
      throw Error(ErrorKind::InvalidRange, "fake " + std::string(call_name(call)) + ": host range (" + what +
                                               ") outside every host block reached the backend");
    }

    if (request.mode == CopyMode::Sync) {
      if (fired.copy_failed_at_completion) {
        throw Error(copy_error_kind(request.direction), "fake " + std::string(call_name(call)) +
                                                            ": injected failure at completion (" + what +
                                                            "); no byte moved");
      }
      State::move_bytes(request);
      return;
    }

    State::PendingCopy copy{request,
                            allocation->memory,
                            host_block->memory,
                            fired.copy_failed_at_completion,
                            fired.lost,
                            fired.duplicated,
                            fired.late};
    if (s.auto_complete && !copy.late) {
      s.finish(copy, /*ok=*/true, s.ready);
      notify.armed = true;
    } else {
      s.pending.push_back(std::move(copy));
    }
  }
}

void FakeBackend::drain_completions(std::vector<Completion>& out) {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  for (auto& c : s.ready) out.push_back(std::move(c));
  s.ready.clear();
  if (s.late_released) {
    for (auto& c : s.late_after_quiesce) out.push_back(std::move(c));
    s.late_after_quiesce.clear();
    s.late_released = false;
  }
}

bool FakeBackend::wait_for_completions(std::chrono::nanoseconds timeout) {
  // wait_for would add the timeout to now() and wrap for a huge one (then
  // return at once): the deadline saturates instead, and "never" waits.
  const auto deadline = checked::deadline_after(timeout);
  std::unique_lock lock(state_->mutex);
  auto& s = *state_;
  const auto ready = [&] { return !s.ready.empty() || (s.late_released && !s.late_after_quiesce.empty()); };
  if (deadline == checked::Clock::time_point::max()) {
    s.completions_ready.wait(lock, ready);
    return true;
  }
  return s.completions_ready.wait_until(lock, deadline, ready);
}

void FakeBackend::quiesce() {
  {
    std::lock_guard lock(state_->mutex);
    auto& s = *state_;
    s.record(Call::Quiesce);
    const Fired fired = s.fire(Call::Quiesce);
    if (fired.fatal) State::throw_fatal(Call::Quiesce, "while quiescing");
    // Late copies finish now (memory is still live), but report only at the
    // next drain; everything else is dropped unmoved.
    for (const auto& copy : s.pending) {
      if (copy.late) s.finish(copy, /*ok=*/true, s.late_after_quiesce);
    }
    s.pending.clear();
    s.late_released = false;
    // The own queues are idle now; consumers' queues are not the fake's.
    s.launches_held = false;
    s.pass_fences([](const QueueRef& where) { return where.queue != Queue::Consumer; });
  }
  state_->completions_ready.notify_all();
  state_->fence_passed.notify_all();
}

Fence FakeBackend::launch_axpy(const AxpyLaunch& launch) {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  // The byte count, or nothing when count * 4 does not fit (recorded as 2^64-1).
  const std::optional<std::uint64_t> bytes = checked::mul(launch.count, sizeof(float));
  {
    RecordedCall& call = s.calls[s.record(Call::Launch)];
    call.bytes = bytes.value_or(UINT64_MAX);
    call.address = launch.x.address;
    call.device_offset = launch.x_offset;
  }
  const Fired fired = s.fire(Call::Launch);
  if (fired.fatal) State::throw_fatal(Call::Launch, "launching axpy over " + std::to_string(launch.count) + " floats");
  auto inside = [&](const DeviceAllocation& a, std::uint64_t offset) {
    const State::Allocation* allocation = s.live(a);
    return allocation != nullptr && bytes && checked::range_within(offset, *bytes, allocation->bytes);
  };
  if (!inside(launch.x, launch.x_offset) || !inside(launch.y, launch.y_offset)) {
    throw Error(ErrorKind::InvalidRange, "fake launch: axpy over " + std::to_string(launch.count) +
                                             " floats outside its allocations reached the backend");
  }
  // Both ranges lie inside live allocations (inside() above): no sum wraps.
  const auto* x = reinterpret_cast<const std::byte*>(launch.x.address) + launch.x_offset;
  auto* y = reinterpret_cast<std::byte*>(launch.y.address) + launch.y_offset;
  for (std::uint64_t i = 0; i < launch.count; ++i) {
    float xi;
    std::memcpy(&xi, x + i * sizeof(float), sizeof(float));
    const float yi = launch.a * xi + launch.b;
    std::memcpy(y + i * sizeof(float), &yi, sizeof(float));
  }
  return s.new_fence(QueueRef{Queue::Compute}, s.launches_held);
}

Fence FakeBackend::record_fence(const QueueRef& where) {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  const bool pending = where.queue == Queue::Consumer ? s.blocked_consumers.contains(where.consumer)
                                                      : s.launches_held;
  return s.new_fence(where, pending);
}

bool FakeBackend::fence_passed(Fence fence) {
  std::lock_guard lock(state_->mutex);
  return state_->fence_record(fence).passed;
}

bool FakeBackend::wait_fence(Fence fence, std::chrono::nanoseconds timeout) {
  std::unique_lock lock(state_->mutex);
  auto& s = *state_;
  s.fence_record(fence);
  const auto passed = [&] {
    auto it = s.fences.find(fence.token);
    return it == s.fences.end() || it->second.passed;
  };
  const auto deadline = checked::deadline_after(timeout);
  if (deadline == checked::Clock::time_point::max()) {
    s.fence_passed.wait(lock, passed);
    return true;
  }
  return s.fence_passed.wait_until(lock, deadline, passed);
}

void FakeBackend::release_fence(Fence fence) noexcept {
  std::lock_guard lock(state_->mutex);
  state_->fences.erase(fence.token);
}

void FakeBackend::hold_launches(bool hold) {
  {
    std::lock_guard lock(state_->mutex);
    auto& s = *state_;
    s.launches_held = hold;
    if (!hold) s.pass_fences([](const QueueRef& where) { return where.queue != Queue::Consumer; });
  }
  state_->fence_passed.notify_all();
}

void FakeBackend::block_consumer_queue(std::uintptr_t queue) {
  std::lock_guard lock(state_->mutex);
  state_->blocked_consumers.insert(queue);
}

void FakeBackend::unblock_consumer_queue(std::uintptr_t queue) {
  {
    std::lock_guard lock(state_->mutex);
    auto& s = *state_;
    s.blocked_consumers.erase(queue);
    s.pass_fences([&](const QueueRef& where) { return where.queue == Queue::Consumer && where.consumer == queue; });
  }
  state_->fence_passed.notify_all();
}

bool FakeBackend::signal_fence(Fence fence) {
  {
    std::lock_guard lock(state_->mutex);
    auto it = state_->fences.find(fence.token);
    if (it == state_->fences.end() || it->second.passed) return false;
    it->second.passed = true;
  }
  state_->fence_passed.notify_all();
  return true;
}

std::vector<Fence> FakeBackend::pending_fences() const {
  std::lock_guard lock(state_->mutex);
  std::vector<Fence> out;
  for (const auto& [token, fence] : state_->fences)
    if (!fence.passed) out.push_back(Fence{token});
  return out;
}

std::uint64_t FakeBackend::live_fences() const {
  std::lock_guard lock(state_->mutex);
  return state_->fences.size();
}

void FakeBackend::validate_view(const DeviceAllocation& allocation, const TensorView& view) {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  {
    RecordedCall& call = s.calls[s.record(Call::ValidateView)];
    call.bytes = allocation.bytes;
    call.address = allocation.address;
    call.device_offset = view.byte_offset;
  }
  const Fired fired = s.fire(Call::ValidateView);
  if (fired.fatal) State::throw_fatal(Call::ValidateView, "validating a view");
  if (fired.invalid_view) {
    throw Error(ErrorKind::InvalidTensorView, "fake validate_view: injected refusal of a view at byte offset " +
                                                  std::to_string(view.byte_offset) + " of allocation " +
                                                  hex_address(allocation.address));
  }
}

std::unique_ptr<Backend> make_fake_backend(const BackendOptions& options) {
  devbridge::detail::OptionReader reader("fake", options);
  reader.single_device();
  const auto memory_bytes = reader.unsigned_integer("memory_bytes", "bytes allocations may total");
  std::vector<DType> dtypes;
  if (const auto names = reader.text("dtypes", "comma-separated dtypes the device holds")) {
    for (std::string_view rest = *names; !rest.empty();) {
      const auto comma = rest.find(',');
      const auto name = rest.substr(0, comma);
      const auto dtype = dtype_from_name(name);
      if (!dtype) reader.refuse("dtypes", *names, fmt::format("'{}' is not a dtype name", name));
      dtypes.push_back(*dtype);
      rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    }
    if (dtypes.empty()) reader.refuse("dtypes", *names, "names no dtype");
  }
  reader.finish();
  return std::make_unique<FakeBackend>(memory_bytes.value_or(1ull << 34), std::move(dtypes));
}

}  // namespace devbridge::fake
