// The fake backend: real host memory (or, with Backing::None, none) behind a
// fully scripted device, for tests.
// It records every call with its exact arguments, completes async copies only
// when the test says so, and injects failures per call kind, one-shot on the
// Nth next call of that kind. It counts live allocations so tests prove that
// nothing leaks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "devbridge/backend.hpp"

namespace devbridge::fake {

enum class Call : std::uint8_t {
  Allocate,
  Free,
  AllocateHost,
  FreeHost,
  CopyHostToDevice,
  CopyDeviceToHost,
  Launch,
  ValidateView,
  Quiesce,
  RegisterHost,    // HostMemory::import_host for staging: the caller's memory, made a staging source
  UnregisterHost,
};
inline constexpr int kCallCount = static_cast<int>(Call::UnregisterHost) + 1;

enum class Failure : std::uint8_t {
  AllocationFailed,        // Allocate/AllocateHost/RegisterHost throws AllocationFailed
  CopyFailedAtSubmit,      // Copy* throws DeviceCopyFailed / OutputCopyFailed
  CopyFailedAtCompletion,  // the copy completes with failure (its bytes are not moved)
  InvalidView,             // ValidateView throws InvalidTensorView
  LostCompletion,          // the copy's completion is never reported
  DuplicatedCompletion,    // the completion is reported twice
  LateCompletion,          // the completion survives quiesce and arrives after it
  Fatal,                   // the call throws a fatal error (device lost)
};

std::string_view call_name(Call call) noexcept;        // "allocate", "copy_h2d", ...
std::string_view failure_name(Failure failure) noexcept;  // "allocation_failed", ...
// Whether `failure` can fire on a call of kind `call` (FakeBackend::inject
// refuses the combinations for which it is false): AllocationFailed on
// allocate/allocate_host; the copy failures and completion faults on
// copy_h2d/copy_d2h; InvalidView on validate_view; Fatal on anything but the
// (noexcept) frees.
bool applies(Call call, Failure failure) noexcept;

// One recorded call. Fields that do not apply to the call are zero.
struct RecordedCall {
  Call call = Call::Allocate;
  std::uint64_t bytes = 0;        // Allocate/AllocateHost: bytes; copies: len
  std::uint64_t alignment = 0;    // Allocate
  std::uint64_t address = 0;      // the device address involved (Free, copies, Launch x)
  std::uint64_t host_offset = 0;  // copies: offset of the host pointer inside the host block
  std::uint64_t device_offset = 0;
  CopyLayout layout;              // copies: the pitched layout exactly as given (rows 0: contiguous)
  CopyMode mode = CopyMode::Sync;
  CopyEvent event;
};

// What is behind the fake's device allocations.
enum class Backing : std::uint8_t {
  // Real host memory, filled with a pattern when allocated: copies, views
  // and launches read and write it (the default; what tests need).
  HostMemory,
  // Nothing: bookkeeping only. An allocation is an address range (unique,
  // aligned as asked, never dereferenced; parts are ranges inside it) and
  // counts against memory_bytes as before, but no host memory is taken, so a
  // fake of 80 GiB replays a trace's allocations and frees in kilobytes
  // (`devbridge trace replay`). Anything that would touch the bytes is
  // refused with Unsupported: copies to or from such an allocation (async
  // ones at submit), a view of it (validate_view, so no address of it is
  // ever handed out), a launch over it, a peer copy from or to it. Host
  // blocks (the ring), registered and adopted host memory stay real memory.
  // Make it with FakeBackend(memory, {}, Backing::None), or through
  // make_backend("fake", {{"backing", "none"}, ...}).
  None,
};

class FakeBackend final : public Backend {
 public:
  // `dtypes`: what describe() says the device holds (every dtype when empty),
  // so tests can see a bridge refuse the others (UnsupportedDType).
  // `backing`: what is behind device allocations (Backing).
  explicit FakeBackend(std::uint64_t memory_bytes = 1ull << 34, std::vector<DType> dtypes = {},
                       Backing backing = Backing::HostMemory);
  ~FakeBackend() override;

  // ---- test controls; all thread-safe ----
  void inject(Call call, Failure failure, int nth = 1);
  // Deliver the outcome of a pending async copy (ok: its bytes move now).
  // Returns false when the event is not pending here.
  bool complete(CopyEvent event, bool ok = true);
  // Complete every pending copy, oldest first; returns how many.
  std::size_t complete_all(bool ok = true);
  std::vector<CopyEvent> pending() const;
  // Deliver a completion for an event the backend never saw (a forged or
  // stale completion).
  void report_completion(CopyEvent event, bool ok = true);
  // The calls made, oldest first: at least the last kKeptCalls, at most
  // twice that; older ones are dropped (dropped_calls() counts them), so a
  // fake that runs for hours (devbridge stream --backend fake) holds a
  // bounded log.
  static constexpr std::size_t kKeptCalls = std::size_t{1} << 16;
  std::vector<RecordedCall> calls() const;
  std::uint64_t dropped_calls() const;
  void clear_calls();
  std::uint64_t live_allocations() const;
  std::uint64_t live_host_blocks() const;
  // Host memory imported for staging and not yet released (a leak check).
  std::uint64_t live_registrations() const;
  // Parts of allocations (make_part) not yet released; live_allocations()
  // counts whole allocations only.
  std::uint64_t live_parts() const;
  // Host memory adopted (import_host, ImportUse::Adopt) and not yet released.
  std::uint64_t live_adoptions() const;
  // When true, async copies complete at submit (as if the device were instant).
  void set_auto_complete(bool on);
  // Whether the fake offers parts of allocations (describe().part_alignment;
  // on by default).
  void set_parts(bool on);

  // Fences. A launch moves its bytes at call time (the fake does not model
  // stream order) but, while launches are held, its fence stays pending
  // until the hold is lifted, the test signals it, or quiesce(): the kernel
  // is "still running". A consumer queue the test blocked gets pending
  // fences until it is unblocked; an unblocked one's have passed at once.
  void hold_launches(bool hold);  // lifting the hold passes the own queues' fences
  void block_consumer_queue(std::uintptr_t queue);
  void unblock_consumer_queue(std::uintptr_t queue);  // passes its fences
  bool signal_fence(Fence fence);  // false when the fence is not pending here
  std::vector<Fence> pending_fences() const;
  // Fences handed out and not yet released by the bridge (a leak check).
  std::uint64_t live_fences() const;

  // The same controls behind the seam's one accessor (test_controls()), for
  // code that holds a Backend: live_allocations, live_host_blocks,
  // live_registrations, live_fences, fake() (this backend), and hold_copies,
  // which here turns auto-completion off and holds launches while held, and
  // on release turns auto-completion on and completes every pending copy
  // (the conformance suite's auto-completing fake).
  TestControls* test_controls() noexcept override;

  // ---- Backend ----
  // Capabilities: parts (unless set_parts(false)), adopt, peer copies to
  // another fake, consumer queues fenced (not ordered); no pool by default.
  BackendInfo describe() override;

  // ---- device memory ----
  DeviceAllocation allocate(std::uint64_t bytes, std::uint64_t alignment) override;
  // O(log n) in the live allocations: the checks for a part still live or
  // a copy still in flight read counts kept per allocation (a teardown of n
  // allocations is not quadratic).
  void free(const DeviceAllocation& allocation) noexcept override;
  // Parts are real allocations of their own here (a use after release_part
  // is refused), 512-byte aligned like CUDA's; set_parts(false) makes the
  // fake a device without them (OpenCL's case: the pool keeps whole blocks).
  DeviceAllocation make_part(const DeviceAllocation& whole, std::uint64_t offset, std::uint64_t bytes) override;
  void release_part(const DeviceAllocation& part) noexcept override;
  void validate_view(const DeviceAllocation& allocation, const TensorView& view) override;

  // ---- host memory ----
  HostBlock allocate_host(std::uint64_t bytes) override;
  void free_host(const HostBlock& block) noexcept override;
  // A staging import (read-only or not: the fake makes no difference) is
  // recorded as Call::RegisterHost and its release as UnregisterHost.
  // Adopted host memory is a record aliasing the registered bytes: a use
  // after its release is caught like a use after free.
  HostImport import_host(const ImportRequest& request) override;
  void release_import(const HostImport& imported) noexcept override;

  // ---- transfers ----
  void submit_copy(const CopyRequest& request) override;
  void drain_completions(std::vector<Completion>& out) override;
  bool wait_for_completions(std::chrono::nanoseconds timeout) override;
  // Another fake is a peer (the bytes move at once); anything else is not.
  bool copy_to_peer(const DeviceAllocation& source, std::uint64_t source_offset, Backend& destination_backend,
                    const DeviceAllocation& destination, std::uint64_t destination_offset,
                    std::uint64_t len) override;

  // ---- timeline ----
  Fence record_fence(const QueueRef& where) override;
  bool fence_passed(Fence fence) override;
  bool wait_fence(Fence fence, std::chrono::nanoseconds timeout) override;
  void release_fence(Fence fence) noexcept override;
  void quiesce() override;

  // ---- compute ----
  Fence launch_axpy(const AxpyLaunch& launch) override;

 private:
  HostBlock register_host(std::byte* data, std::uint64_t bytes);
  void unregister_host(const HostBlock& block) noexcept;
  DeviceAllocation adopt_host(const HostBlock& region, std::uint64_t offset, std::uint64_t bytes);
  void release_adopted(const DeviceAllocation& adopted) noexcept;

  struct State;
  std::unique_ptr<State> state_;
};

// Options: device ("0", the one device), memory_bytes (what allocations may
// total; default 16 GiB), dtypes (comma-separated names the device holds;
// default all), backing ("host": real host memory behind allocations, the
// default; "none": bookkeeping only, Backing::None).
std::unique_ptr<Backend> make_fake_backend(const BackendOptions& options = {});

}  // namespace devbridge::fake
