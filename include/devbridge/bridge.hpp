// The bridge: the worker's one boundary between the host ring, device memory
// and tensor views. It owns every rule of ../shared/spec/CONTRACT.md —
// validation, lifetimes, safe-release points, generations, backpressure —
// and delegates only raw device work to a Backend (backend.hpp).
//
// Every public method is safe to call from many threads at once. Errors are
// thrown as devbridge::Error; a call that throws changes nothing.
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <variant>

#include "devbridge/backend.hpp"
#include "devbridge/recorder.hpp"
#include "devbridge/types.hpp"

namespace devbridge {

namespace detail {
class BridgeCore;
}

// What an upload (host_to_device) into an allocation that a live view still
// reads does. The view's consumer has already taken those bytes as its own:
// a jax array is immutable, a lazy tinygrad graph reads them when it runs.
enum class WritesUnderView : std::uint8_t {
  Refuse,  // AllocationStillInUse, naming the views and who holds them (the default)
  Wait,    // wait for the views to end (BridgeOptions::writes_under_view_timeout)
  Allow,   // copy anyway: the caller orders its consumers itself
};

// A consumer's queue: the stream a DLPack consumer or a tinygrad tensor
// computes on, in the backend's numbering (CUDA: a CUstream, 1 the legacy
// default stream, 2 the per-thread one; OpenCL: a cl_command_queue). Work
// that ends there ends at a fence recorded on it, not when the host says so.
struct ConsumerQueue {
  std::uintptr_t handle = 0;
};

// Whether freed device memory is cached for reuse (the caching pool, see
// MemoryStats) or goes back to the backend at once.
enum class CachingPool : std::uint8_t {
  BackendDefault,  // as the backend prefers (BackendCapabilities::caches_allocations: host, CUDA and OpenCL do)
  On,
  Off,
};

struct BridgeOptions {
  Generation generation = 1;
  std::uint64_t ring_bytes = 64ull << 20;
  // Bytes of asynchronous copies admitted at once; 0 means the ring size.
  std::uint64_t inflight_budget_bytes = 0;
  // How many failed copies the bridge remembers (error kind and message) so
  // their events read back as Failed; beyond it the oldest is forgotten
  // (stats().failed_records_evicted, a log line). See docs/DECISIONS.md.
  std::uint32_t failed_record_limit = 1024;
  WritesUnderView writes_under_view = WritesUnderView::Refuse;
  // How long WritesUnderView::Wait waits for the views to end before
  // refusing the copy; max (the default) waits until they end or close().
  // A view held by the waiting thread itself never ends: give a bound, or
  // end it first.
  std::chrono::nanoseconds writes_under_view_timeout = std::chrono::nanoseconds::max();
  // How long close() waits for fences on consumers' queues that still hold
  // memory (a view ended "after this stream"). Memory whose fence has not
  // passed by then is abandoned, never freed: the consumer may still read
  // it (stats().abandoned_fences, an error in the log).
  std::chrono::nanoseconds close_fence_timeout = std::chrono::seconds(10);
  CachingPool caching_pool = CachingPool::BackendDefault;
  // The most bytes the pool keeps in wholly free segments (idle memory
  // empty_cache() would give back); a segment freed beyond it goes back to
  // the backend. Free spans inside a segment that still holds a live
  // allocation cannot go back (the backend frees whole allocations only)
  // and are not bounded by it (MemoryStats::cached_bytes counts them,
  // free_segment_bytes does not). Unset: the backend's default
  // (BackendCapabilities::pool_cap_bytes: 512 MiB on host, unbounded elsewhere).
  // Cached blocks are released (and the allocation retried) when the backend
  // runs out of memory, whatever the cap.
  std::optional<std::uint64_t> pool_cap_bytes = std::nullopt;
};

// Device memory as the bridge sees it (PyTorch's memory_stats, RMM's
// statistics). "Allocated": bytes of live allocations (as asked of the
// backend: with the pool, a size class); "reserved": allocated plus what the
// pool caches, i.e. everything the backend holds for this bridge.
struct MemoryStats {
  bool pool_enabled = false;
  std::uint64_t pool_cap_bytes = 0;
  std::uint64_t allocated_bytes = 0, peak_allocated_bytes = 0, total_allocated_bytes = 0;
  std::uint64_t reserved_bytes = 0, peak_reserved_bytes = 0, total_reserved_bytes = 0;
  std::uint64_t allocations = 0, total_allocations = 0;  // live, and made since the bridge began
  std::uint64_t backend_allocations = 0, backend_frees = 0;  // calls into the backend
  // The pool's segments: the backend's allocations it holds (split into
  // parts where the backend can address them, BackendCapabilities::part_alignment),
  // those wholly free, and whether it splits.
  std::uint64_t segments = 0, free_segments = 0;
  bool pool_splits = false;
  // Free bytes in the pool, in how many free spans.
  std::uint64_t cached_bytes = 0, cached_blocks = 0;
  // Of cached_bytes, those in wholly free segments: what empty_cache() gives
  // back and pool_cap_bytes bounds. The rest is free space inside segments
  // that still hold a live allocation, reused but not given back.
  std::uint64_t free_segment_bytes = 0;
  std::uint64_t cache_hits = 0, cache_misses = 0;
  // Allocations that failed for want of memory and were retried after
  // draining completions, reaping fences and releasing the cache; and those
  // that failed again.
  std::uint64_t oom_retries = 0, oom_failures = 0;
  std::uint64_t largest_request_bytes = 0;  // tracked with the pool on
  // Cached bytes in blocks too small for the largest request so far: free
  // memory the pool holds that the biggest tensor could not use.
  std::uint64_t fragmentation_bytes = 0;
};

// Every MemoryStats field in the struct's order: visit(name, value), value a
// bool or a std::uint64_t, under the name the memory snapshot's "stats"
// (TRACING.md), Python's memory_stats() and the CLI's stream report give it.
// The one list of them: a field added to MemoryStats is added here (the
// build fails until it is, below) and to the C ABI's devbridge_memory_stats,
// whose size src/c_api/bridge_calls.cpp checks against kMemoryStatsFields.
template <class Visit>
constexpr void for_each_field(const MemoryStats& m, Visit&& visit) {
  visit("pool_enabled", m.pool_enabled);
  visit("pool_cap_bytes", m.pool_cap_bytes);
  visit("allocated_bytes", m.allocated_bytes);
  visit("peak_allocated_bytes", m.peak_allocated_bytes);
  visit("total_allocated_bytes", m.total_allocated_bytes);
  visit("reserved_bytes", m.reserved_bytes);
  visit("peak_reserved_bytes", m.peak_reserved_bytes);
  visit("total_reserved_bytes", m.total_reserved_bytes);
  visit("allocations", m.allocations);
  visit("total_allocations", m.total_allocations);
  visit("backend_allocations", m.backend_allocations);
  visit("backend_frees", m.backend_frees);
  visit("segments", m.segments);
  visit("free_segments", m.free_segments);
  visit("pool_splits", m.pool_splits);
  visit("cached_bytes", m.cached_bytes);
  visit("cached_blocks", m.cached_blocks);
  visit("free_segment_bytes", m.free_segment_bytes);
  visit("cache_hits", m.cache_hits);
  visit("cache_misses", m.cache_misses);
  visit("oom_retries", m.oom_retries);
  visit("oom_failures", m.oom_failures);
  visit("largest_request_bytes", m.largest_request_bytes);
  visit("fragmentation_bytes", m.fragmentation_bytes);
}

inline constexpr std::size_t kMemoryStatsFields = [] {
  std::size_t n = 0;
  for_each_field(MemoryStats{}, [&n](const char*, const auto&) { ++n; });
  return n;
}();

namespace detail {
// Converts to any field's type, so brace-initialising an aggregate with ever
// more of them counts its fields (as Boost.PFR does).
struct AnyField {
  template <class T>
  constexpr operator T() const noexcept {
    return T{};
  }
};
template <class T, class... Fields>
consteval std::size_t aggregate_field_count() {
  if constexpr (requires { T{Fields{}..., AnyField{}}; })
    return aggregate_field_count<T, Fields..., AnyField>();
  else
    return sizeof...(Fields);
}
}  // namespace detail

static_assert(detail::aggregate_field_count<MemoryStats>() == kMemoryStatsFields,
              "a MemoryStats field is missing from for_each_field(const MemoryStats&, ...)");

enum class CopyState : std::uint8_t { Pending, Completed, Failed };

struct CopyStatus {
  CopyState state = CopyState::Pending;
  // Set when state == Failed.
  std::optional<ErrorKind> error{};
  std::string message{};
};

// What Bridge::reserve aligns a range to unless asked otherwise: a cache line.
inline constexpr std::uint64_t kRingAlignment = 64;

// How long an async copy may wait for in-flight budget; zero fails fast with
// Backpressure, nanoseconds::max() (or anything too large to add to now)
// waits until there is room.
struct Admission {
  std::chrono::nanoseconds wait_for_room{0};
};

// Where a copy's host bytes are: a range of the ring, or of a registered
// region (Bridge::register_host).
using HostSide = std::variant<HostRange, RegionRange>;

// One copy between host memory and an allocation, as Bridge::copy takes it.
// `layout`, when given, makes it a pitched 2-D copy (types.hpp, CopyLayout):
// layout.rows rows of layout.row_bytes, one copy and one event. The layout's
// host span must lie in `host`, its device span in `device` (a range
// covering every row); the bytes between rows are never touched. Without a
// layout, `host` and `device` are one contiguous run each, of equal length.
struct HostCopy {
  CopyDirection direction = CopyDirection::HostToDevice;
  HostSide host;
  DeviceRange device;
  std::optional<CopyLayout> layout{};
  CopyMode mode = CopyMode::Sync;
  Admission admission{};
};

// The host side of the everyday copies: a ring range or a region range,
// nothing that merely converts to one (each is its own instantiation).
template <class H>
concept HostRangeType = std::same_as<H, HostRange> || std::same_as<H, RegionRange>;

// Who holds a view's lease, for messages that say how to end it (set by the
// layer that hands the view on: the Python bindings name DLPack consumers
// and tinygrad tensors).
enum class ViewHolder : std::uint8_t {
  Caller,          // whoever called view()
  DLPackConsumer,  // a numpy, jax, torch or cupy array over the view
  TinygradTensor,  // a tinygrad Tensor (a lazy graph or .grad may still read it)
};

enum class ViewWait : std::uint8_t {
  Refuse,  // refuse (AllocationStillInUse) while a copy into the allocation is in flight
  Wait,    // wait for those copies to complete first
};

struct BridgeStats {
  Generation generation = 0;
  std::uint64_t domain = 0;
  bool broken = false;
  bool closed = false;
  std::uint64_t live_allocations = 0;
  std::uint64_t allocated_bytes = 0;
  std::uint64_t copies_submitted = 0;
  std::uint64_t copies_completed = 0;
  std::uint64_t copies_failed = 0;
  std::uint64_t copies_in_flight = 0;
  std::uint64_t inflight_bytes = 0;
  std::uint64_t inflight_budget_bytes = 0;
  std::uint64_t copy_records = 0;  // live records: in flight plus failed, not yet observed
  std::uint64_t failed_records = 0;          // failures remembered (observed or not), at most failed_record_limit
  std::uint64_t failed_records_evicted = 0;  // failures forgotten before anyone observed them
  std::uint64_t stale_completions = 0;
  std::uint64_t live_views = 0;
  // Allocations of an older generation (or of a closed bridge) kept only
  // because views still lease them; each is freed when its last view ends.
  std::uint64_t orphaned_allocations = 0;
  // Fences in the drop queue: uses (launches, steps and views ended on a
  // consumer's queue) whose memory waits for them to pass.
  std::uint64_t pending_fences = 0;
  // Fences close() gave up on; their memory stays allocated for good.
  std::uint64_t abandoned_fences = 0;
  std::uint64_t active_steps = 0;
  std::uint64_t restarts = 0;
  // Registered host memory (Bridge::register_host) of this generation, and
  // regions of older ones kept for adopted allocations a view still reads.
  std::uint64_t host_regions = 0;
  std::uint64_t host_region_bytes = 0;
  // Allocations of this generation over host memory adopted in place
  // (Bridge::adopt_host), and their bytes: counted in live_allocations, not
  // in allocated_bytes (no device memory of the bridge's).
  std::uint64_t adopted_allocations = 0;
  std::uint64_t adopted_bytes = 0;
  std::uint64_t ring_capacity = 0;
  std::uint64_t ring_used = 0;
  std::uint64_t ring_reservations = 0;
  // Ranges handed to release_host_after still waiting for their copies.
  std::uint64_t ring_releases_pending = 0;
  // Reservations that went on at offset 0 because the rest of the ring's lap
  // could not hold them while it still held others (not a drained ring
  // starting over): how often the ring wrapped around under load.
  std::uint64_t ring_wraps = 0;
};

class Bridge;

// Keeps the bytes of one ring range valid for a consumer that outlives the
// call that handed them out (a numpy array over the ring): close() does not
// free the ring while a host lease lives; the last lease to end frees it.
// It does not pin the range: the range can still be released and reserved
// again, as with any ring bytes. Movable; ends on destruction or reset().
class HostLease {
 public:
  HostLease() = default;
  HostLease(HostLease&& other) noexcept;
  HostLease& operator=(HostLease&& other) noexcept;
  HostLease(const HostLease&) = delete;
  HostLease& operator=(const HostLease&) = delete;
  ~HostLease();

  std::span<std::byte> bytes() const noexcept { return bytes_; }
  explicit operator bool() const noexcept { return core_ != nullptr; }
  void reset() noexcept;

 private:
  friend class Bridge;
  detail::BridgeCore* core_ = nullptr;
  std::span<std::byte> bytes_;
};

// Holds a view's lease: the allocation is not freed while it lives. Movable;
// ends the lease on destruction or reset(). A lease from before a restart
// ends harmlessly.
class ViewLease {
 public:
  ViewLease() = default;
  ViewLease(ViewLease&& other) noexcept;
  ViewLease& operator=(ViewLease&& other) noexcept;
  ViewLease(const ViewLease&) = delete;
  ViewLease& operator=(const ViewLease&) = delete;
  ~ViewLease();

  const TensorView& view() const noexcept { return view_; }
  const TensorView* operator->() const noexcept { return &view_; }
  explicit operator bool() const noexcept { return core_ != nullptr || handed_on_core_ != nullptr; }
  void reset() noexcept;
  // Ends the lease once the work enqueued on `queue` so far has finished:
  // the allocation stays held until a fence recorded there now passes (the
  // consumer may still read the view on its queue; PyTorch's record_stream).
  // Throws Unsupported where the backend's consumers have no queues, and
  // then the lease stays live.
  void end_after(ConsumerQueue queue);
  // Names who holds the lease now, for the bridge's messages about it
  // (AllocationStillInUse). No effect on an ended lease.
  void set_holder(ViewHolder holder) noexcept;
  // Who holds it (or held it last, once ended).
  ViewHolder holder() const noexcept { return holder_; }
  // Another lease of the same view, held by the caller, taken while this one
  // lives: what a consumer handed the view gets (a DLPack capsule, a tinygrad
  // tensor). It holds the allocation however it has changed since this lease
  // was taken (released, orphaned by a restart), and waits first for uploads
  // into it in flight, as a new view does. An ended lease shares nothing:
  // the result is empty (false). Throws Closed where the bridge closes
  // during that wait.
  ViewLease share() const;

 private:
  friend class Bridge;
  // Bridge::view's, defined beside it (inline: it is that hot path's body).
  inline ViewLease(detail::BridgeCore* core, const DeviceHandle& handle, const ViewSpec& spec, ViewWait wait);
  // The core outlives its Bridge while leases remain (it counts them under its
  // own lock), so a lease never dangles and costs no atomic reference count.
  // A lease held by the caller keeps it in core_; one handed on (set_holder)
  // in handed_on_core_, so ending the usual lease tests nothing more than
  // before holders existed.
  detail::BridgeCore* core_ = nullptr;
  detail::BridgeCore* handed_on_core_ = nullptr;
  TensorView view_;
  ViewHolder holder_ = ViewHolder::Caller;
};

class Bridge {
 public:
  Bridge(std::unique_ptr<Backend> backend, BridgeOptions options = {});
  ~Bridge();  // close()
  Bridge(const Bridge&) = delete;
  Bridge& operator=(const Bridge&) = delete;

  std::uint64_t domain() const noexcept;
  Generation generation() const;
  // Describes the device; takes no bridge lock.
  BackendInfo backend_info() const;
  // What the backend can do (the part of backend_info() that never changes),
  // as read when the bridge opened: no call to the backend (describe() may
  // read /proc/meminfo), for the code that asks per transfer.
  const BackendCapabilities& capabilities() const noexcept;
  // UnsupportedDType unless the device computes in `dtype`
  // (BackendInfo::computed_dtypes): for a layer that hands a typed view to a
  // consumer that computes in it (to_tinygrad). `what` names that call.
  void require_compute(DType dtype, std::string_view what) const;
  BridgeStats stats() const;
  MemoryStats memory_stats() const;
  // Peaks start again from the current figures.
  void reset_peak_memory();
  // Gives every cached block back to the backend.
  void empty_cache();

  // ---- the flight recorder (docs/TRACING.md) ----
  // Starts recording into a new ring of options.max_events events (a
  // recording in progress is dropped): InvalidRange for 0 or more than
  // kMaxRecordedEvents. Off by default, and free when off.
  void record(const RecordOptions& options);
  // Stops recording; what was recorded stays for the dumps.
  void stop_recording();
  // Whether recording attaches stacks (RecordOptions::stacks): a binding
  // asks before it enters, to set a TraceStack only when it is used.
  bool records_stacks() const noexcept;
  // The recorded events as Chrome/Perfetto trace-event JSON ("Trace format").
  std::string trace_json() const;
  // The same, written to `path` atomically (a temporary file, renamed).
  void dump_trace(const std::filesystem::path& path) const;
  // Segments and blocks, their state and holders, the events that touched
  // them, the ring and the statistics ("Memory snapshot format").
  std::string memory_snapshot_json() const;

  // ---- allocation ----
  DeviceHandle alloc_device(const ObjectSpec& spec, std::uint64_t extent);
  // Refuses what alloc_device would refuse of `spec` and `extent` before it
  // asks for memory (InvalidAlignment, UnsupportedDType, InvalidExtent, the
  // same messages), allocating nothing: a plan checks a new allocation so.
  void check_allocation(const ObjectSpec& spec, std::uint64_t extent) const;
  // Frees now, or throws AllocationStillInUse (naming the copies, steps,
  // views and pending fences that use it) and changes nothing.
  void free_device(DeviceHandle handle);
  // Deferred free: the handle is unusable from now on; the memory goes back to
  // the backend when its last copy, step and view end and every fence
  // holding it (a launch, a consumer's queue) has passed, noticed by the next
  // call into the bridge of any kind: no one has to poll for it.
  void release(DeviceHandle handle);
  std::uint64_t extent(DeviceHandle handle) const;
  ObjectSpec spec(DeviceHandle handle) const;

  // ---- host ring ----
  // A range of `bytes`, aligned to `alignment` (a power of two, at most 4096),
  // never spanning the ring's end. Backpressure when there is no room after
  // `timeout` (0, the default: at once; nanoseconds::max() or anything too
  // large to add to now: until there is room). A release wakes the wait;
  // close() ends it with Closed. The ring frees in order (FIFO): room comes
  // back only when the oldest reservation is released.
  HostRange reserve(std::uint64_t bytes, std::uint64_t alignment = kRingAlignment,
                    std::chrono::nanoseconds timeout = std::chrono::nanoseconds::zero());
  // Ends a reservation (exactly as reserve returned it). Refused with
  // AllocationStillInUse while an async copy using it is in flight.
  void release_host(HostRange range);
  // Ends a reservation (exactly as reserve returned it) once `event` says
  // its host bytes may be released: an upload's safe_to_release_host, a
  // download's host_bytes_valid, or the copy failed. Nothing to poll: the
  // bridge checks whenever it applies completions (wait, poll,
  // copy_status, ...) and before reserve looks for room, so a reserve
  // waiting for room is woken by it. An event already settled releases at
  // once. The event's failure, if any, stays to be observed (wait,
  // copy_status). A range another copy still pins waits for that copy too.
  // Refused, changing nothing: ForeignDomain / OldGenerationHandle /
  // UnknownDeviceHandle for the event; InvalidRange for a range that is not
  // a live reservation, or one already waiting here. Allowed on a Broken
  // bridge. A restart releases every waiting range once the device is idle
  // (no copy touches them any more); close() drops them with the ring.
  // Releasing a waiting range by hand (release_host) is allowed; the wait
  // then forgets it.
  void release_host_after(HostRange range, CopyEvent event);
  // Waits until one of the ranges waiting in release_host_after goes back to
  // the ring (applying completions as wait() does): true. False at once when
  // none waits, or once `timeout` passed first (max: as long as it takes).
  // For a caller refused room (Backpressure) that should wait only while
  // room is on its way back, not for reservations others hold.
  bool wait_for_release_after(std::chrono::nanoseconds timeout = std::chrono::nanoseconds::max());
  // The bytes of a reserved range (validated). Valid until close(); a
  // consumer that may outlive the bridge takes a lease_host instead.
  std::span<std::byte> host_bytes(HostRange range) const;
  // The bytes of a reserved range, kept allocated past close() until the
  // lease ends (validated like host_bytes).
  HostLease lease_host(HostRange range);
  std::uint64_t ring_capacity() const noexcept;
  std::uint64_t ring_free_bytes() const;

  // ---- copies ----
  // Every copy between host memory (the ring or a registered region) and an
  // allocation. Refused with InvalidRange naming the range at fault when the
  // ranges differ in length (no layout), when the layout does not fit them,
  // its rows would overlap or split the allocation's elements, or it has no
  // rows (pass no layout for a plain copy). A download into a region
  // registered read-only is refused (InvalidRange). Into an allocation a live
  // view still reads: as options.writes_under_view says.
  CopyEvent copy(const HostCopy& request);
  // The everyday copies, of one contiguous run: copy() without a layout.
  // Kept apart from copy() because they are the hot path: no variant to
  // dispatch on, each host type its own function.
  template <HostRangeType H>
  CopyEvent host_to_device(H host, DeviceRange device, CopyMode mode, Admission admission = {});
  template <HostRangeType H>
  CopyEvent device_to_host(DeviceRange device, H host, CopyMode mode, Admission admission = {});

  // ---- registered host memory ----
  // Registers the caller's memory (a numpy array, an mmap) as a staging
  // source beside the ring: copies to and from it follow the ring's rules
  // (ranges validated, safe_to_release_host / host_bytes_valid say when its
  // bytes may be reused or read). The backend pins it where it can. The
  // caller keeps it alive and unmoved until unregister_host, restart or
  // close. Refused (InvalidRange) when it overlaps a region already
  // registered, (InvalidExtent) when empty.
  // `on_release`, when given, is called once the bridge has let go of the
  // memory for good (unregistered it with the backend: unregister_host, a
  // restart or close that succeeded, or the end of the last adopted
  // allocation that kept the region retained past them): from then on the
  // caller may free or move it (IREE's import_buffer release callback). It
  // runs on whichever thread makes the bridge let go, under the bridge's
  // lock: it must be quick, must not throw, and must not call into the
  // bridge (record the fact, act on it later). Never called when the
  // registration itself fails, nor after a failed quiesce.
  using RegionRelease = std::function<void()>;
  HostRegion register_host(std::span<std::byte> bytes, RegionRelease on_release = {});
  // For uploads only (an immutable buffer: Ray's object store, a read-only
  // mmap): a copy into it (device_to_host) is refused with InvalidRange.
  HostRegion register_host_read_only(std::span<const std::byte> bytes, RegionRelease on_release = {});
  // AllocationStillInUse while a copy uses the region; changes nothing then.
  // A copy that ended in the backend counts as ended whether or not anyone
  // polled it since (the completions waiting are applied first, as
  // release_host and free_device do).
  void unregister_host(HostRegion region);
  // For an owner letting go of a region allocations adopted from it still
  // use (they may be read through views for a while): unregistered now when
  // none does (true), else once the last of them ends (false; on_release
  // says when, and no copy or adoption may use the region meanwhile).
  // AllocationStillInUse while a copy uses it, as unregister_host.
  bool unregister_host_after_adoptions(HostRegion region);
  // The registered bytes (validated).
  std::span<std::byte> region_bytes(HostRegion region) const;
  // True while the bridge still holds the region's memory: registered in
  // this generation, or kept past a restart or close because an allocation
  // adopted from it is still read through a view. Whoever keeps the memory
  // alive for the bridge lets go once it is false (or, pushed instead of
  // polled, when register_host's on_release is called).
  bool region_retained(HostRegion region) const noexcept;
  // The bytes of a read-only region used in place as a device allocation,
  // with no copy, where the device addresses host memory (the host backend,
  // the fake; Unsupported elsewhere): an object-store buffer becomes a
  // tensor. The range must start at a multiple of spec.alignment and its
  // length be a valid extent of the spec (InvalidAlignment, InvalidExtent);
  // the region must be read-only (InvalidRange otherwise: a writable one
  // could be both a copy's source and its destination). The allocation is
  // read-only: uploads, launches and peer copies into it are refused
  // (InvalidRange), its views say read_only. It is freed or released like
  // any other (never cached); until then unregister_host of its region is
  // refused (AllocationStillInUse), and a restart or close that leaves it
  // under a live view keeps the region until the view ends.
  DeviceHandle adopt_host(RegionRange range, const ObjectSpec& spec);

  // Device to device into another bridge's allocation, where the two
  // backends have a direct path (Transfers::copy_to_peer: CUDA within a
  // context or between peers); returns false, changing nothing, where they
  // have none (stage through the host instead). Synchronous: both
  // allocations are held until the bytes have landed; a live view of the
  // destination is treated as for host_to_device (writes_under_view). Ranges
  // validated in both bridges; a failure is the destination's
  // DeviceCopyFailed.
  bool copy_to_peer(DeviceRange source, Bridge& destination, DeviceRange destination_range);

  // Where device memory is host memory (BackendCapabilities::host_addressable:
  // the host backend) or can be mapped for writing (maps_for_write: OpenCL on
  // a device that shares host memory, through Transfers::write_mapped), hands
  // `write` the bytes of each range, in order, to fill in place: one copy
  // instead of two through the ring (the transfer planner's WriteInPlace
  // route, e.g. a file read straight into tensors).
  // Synchronous: every range is validated and held as a copy into its
  // allocation is (free_device refuses and release defers until the call
  // ends, a live view is treated as for host_to_device: writes_under_view, a
  // read-only adoption is refused with InvalidRange), and a restart or close
  // waits for the call (made from inside `write` on its thread, one would
  // wait for itself: AllocationStillInUse, nothing changed; so is a
  // read_in_place there of what it writes). The bytes are valid only during `write`; what it
  // throws ends the call as it is (the ranges may hold part of the bytes).
  // Copies still in flight into the same bytes are not waited for (as two
  // overlapping uploads, the caller orders them; a mapped range is ordered
  // after what the backend's queue already holds). Unsupported elsewhere.
  void write_in_place(std::span<const DeviceRange> ranges,
                      const std::function<void(std::span<const std::span<std::byte>>)>& write);
  // Where device memory is host memory (BackendCapabilities::host_addressable:
  // the host backend), hands `read` the bytes of each range, in order, to
  // read in place: no copy into the ring first (the transfer planner's
  // ReadInPlace route, e.g. tensors written straight to a file).
  // Synchronous: first waits until no copy into the ranges' allocations is in
  // flight and, where a launch or step holds one of them, until everything
  // queued on the compute queue has run (what the ring's download is ordered
  // after); then every range is validated and held as a copy out of its
  // allocation is (free_device refuses and release defers until the call
  // ends; a restart or close waits for it, and is refused with
  // AllocationStillInUse when made from inside `read` on its thread). The
  // bytes are valid only during `read`, which must not write them; what it
  // throws ends the call.
  // Unsupported elsewhere.
  void read_in_place(std::span<const DeviceRange> ranges,
                     const std::function<void(std::span<const std::span<const std::byte>>)>& read);

  CopyStatus copy_status(CopyEvent event);
  // True once the host range of an H2D copy may be released (or reused).
  bool safe_to_release_host(CopyEvent event);
  // True once the host bytes of a D2H copy are valid.
  bool host_bytes_valid(CopyEvent event);
  // Blocks until the copy completes or fails, or the timeout passes (then
  // Pending). No timeout, or one too large to add to now, waits until done;
  // a negative one is InvalidRange. close() wakes it with Closed.
  // Observing a failure here (or in copy_status) retires the failed record.
  CopyStatus wait(CopyEvent event, std::optional<std::chrono::nanoseconds> timeout = std::nullopt);
  // Applies every completion the backend has; returns how many it applied.
  std::size_t poll();

  // ---- compute ----
  void begin_step(StepId step, std::span<const DeviceHandle> handles);
  void end_step(StepId step);
  // Ends the step once the work enqueued on `queue` so far has finished: its
  // allocations stay held (release() defers, free_device refuses) until a
  // fence recorded there now passes. Throws, ending nothing, where the
  // backend cannot record one (Unsupported: its consumers have no queues).
  void end_step(StepId step, ConsumerQueue after);
  // The built-in role y = a*x + b over float32 ranges of equal length, run by
  // the backend in order after copies into x and before later copies from y.
  // It may still run when the call returns: x and y stay held until its
  // fence passes (release() defers their free, free_device refuses). x and y
  // in one allocation are the same range or apart: shifted against each
  // other they are InvalidRange (the result would depend on the device's
  // order).
  void launch_axpy(DeviceRange x, DeviceRange y, float a, float b);

  // ---- views ----
  ViewLease view(DeviceHandle handle, const ViewSpec& spec, ViewWait wait = ViewWait::Refuse);

  // ---- lifetime ----
  // Quiesces the backend, frees every allocation of the old generation,
  // retires its copy events and steps, and moves to `generation`, which must
  // be greater than the current one. Clears Broken. If the quiesce fails,
  // nothing is freed or unpinned (the device may still touch it): restart
  // throws, the bridge is Broken at the old generation, and a later restart
  // retries the quiesce. Every old handle is
  // refused at once; the memory of an allocation that a live view still
  // leases is freed when that view ends (stats().orphaned_allocations).
  void restart(Generation generation);
  // Every call blocked in the bridge (wait, a waiting view, a wait for room)
  // and every later call fails with Closed at once; then quiesces and frees
  // everything (memory under live views and host leases when they end). If
  // the quiesce fails, memory stays allocated (never freed under the device)
  // and a later close() retries.
  void close();

  Backend& backend() noexcept;

 private:
  struct Detach {
    void operator()(detail::BridgeCore* core) const noexcept;
  };
  std::unique_ptr<detail::BridgeCore, Detach> core_;
};

}  // namespace devbridge
