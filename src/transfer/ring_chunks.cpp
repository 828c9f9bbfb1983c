// The ring-chunk pipeline (ring_chunks.hpp), over the Bridge's public API only.
#include "transfer/ring_chunks.hpp"

#include <algorithm>
#include <deque>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "core/describe.hpp"
#include "core/fail.hpp"
#include "core/log.hpp"
#include "devbridge/checked.hpp"
#include "transfer/lent_chunk.hpp"
#include "transfer/transfer_room.hpp"

namespace devbridge::detail {

namespace {

// Default chunks are whole pages: every dtype's size divides them, so a
// chunk boundary never splits an element.
constexpr std::uint64_t kChunkAlignment = 4096;

}  // namespace

// A quarter of the ring (so several chunks are in flight while the next is
// filled) and at most half the in-flight budget (so one chunk's copy never
// waits for the whole budget), in pages; never more than either can hold.
std::uint64_t default_chunk_bytes(std::uint64_t ring_capacity, std::uint64_t inflight_budget) {
  std::uint64_t chunk = std::min(ring_capacity / 4, inflight_budget / 2);
  chunk = std::max(chunk - chunk % kChunkAlignment, kChunkAlignment);
  return std::min({chunk, ring_capacity, inflight_budget});
}

// Refuses (InvalidRange) `bytes` at `device_offset` unless they lie inside
// `extent` and are whole elements of `element_size`, before any copy starts.
// `end` says which end of the transfer the range is ("from" or "into").
void check_device_range(std::string_view verb, std::string_view end, std::string_view target,
                        std::uint64_t device_offset, std::uint64_t bytes, std::uint64_t extent,
                        std::uint32_t element_size) {
  const auto last = checked::add(device_offset, bytes);
  if (!last)
    fail(ErrorKind::InvalidRange, "{} of {} bytes at device offset {} {} {}: the end does not fit in 64 bits", verb,
         bytes, device_offset, end, target);
  if (*last > extent)
    fail(ErrorKind::InvalidRange, "{} of {} bytes at device offset {} {} {} ends at {}, past its extent of {} bytes",
         verb, bytes, device_offset, end, target, *last, extent);
  if (device_offset % element_size != 0 || bytes % element_size != 0)
    fail(ErrorKind::InvalidRange,
         "{} of {} bytes at device offset {} {} {}: offset and size must be multiples of its element size {}", verb,
         bytes, device_offset, end, target, element_size);
}

// Gives `range` back to the ring; false while it must stay ours: a copy may
// still use it (AllocationStillInUse), or the bridge is Broken (its copies
// may still run; a restart unpins them). Any other refusal means the ring no
// longer holds the range (closed, or released already): nothing to keep.
bool try_release(Bridge& bridge, HostRange range) noexcept {
  try {
    bridge.release_host(range);
    return true;
  } catch (const Error& e) {
    return e.kind() != ErrorKind::AllocationStillInUse && e.kind() != ErrorKind::Broken;
  } catch (...) {
    return false;
  }
}

namespace {

struct Chunk {
  std::uint64_t index = 0;
  std::uint64_t offset = 0;  // into the caller's bytes
  std::uint64_t len = 0;
  std::uint64_t end = 0;  // offset + len
};

// A job, as the pipeline reads it.
struct Transfer : RingChunkJob {
  bool upload() const noexcept { return direction == CopyDirection::HostToDevice; }
  std::string_view verb() const noexcept { return upload() ? "upload" : "download"; }
  std::uint64_t device_offset_of(const Chunk& chunk) const {
    return checked::add_or_throw(device_offset, chunk.offset, ErrorKind::InvalidRange, "device offset of a chunk");
  }
};

// The same error, its message naming the chunk at fault.
[[noreturn]] void rethrow_for_chunk(const Error& error, const Transfer& transfer, const Chunk& chunk) {
  throw Error(error.kind(),
              fmt::format("{} chunk {} (bytes {}..{} of {}, device offset {} of {}): {}", transfer.verb(), chunk.index,
                          chunk.offset, chunk.end, transfer.total, transfer.device_offset_of(chunk),
                          describe(transfer.handle), error.message()),
              error.fatal());
}

// Waits for `event`'s copy until `deadline` (max(): as long as it takes);
// whatever the bridge answers (failed, closed, broken), the caller goes on.
void wait_until(Bridge& bridge, CopyEvent event, checked::Clock::time_point deadline) noexcept {
  try {
    std::optional<std::chrono::nanoseconds> left;
    if (deadline != checked::Clock::time_point::max()) left = checked::time_left(deadline);
    bridge.wait(event, left);
  } catch (...) {
  }
}

struct InFlightChunk {
  Chunk chunk;
  HostRange range;
  CopyEvent event;
  std::uint64_t counted = 0;  // its bytes counted as a TransferRoom
};

// This call's chunks whose copies were submitted and are not finished yet,
// oldest first. When the call ends early, the destructor waits (up to the
// cleanup timeout) for their copies, then releases each range the bridge
// no longer pins and hands the rest to the bridge (release_host_after),
// which releases each once its copy is done: a range whose copy may still
// run is never released, since the ring would hand it out again under the
// device.
class ChunkWindow {
 public:
  ChunkWindow(Bridge& bridge, std::chrono::nanoseconds cleanup_timeout) noexcept
      : bridge_(bridge), cleanup_timeout_(cleanup_timeout) {}
  ChunkWindow(const ChunkWindow&) = delete;
  ChunkWindow& operator=(const ChunkWindow&) = delete;
  ~ChunkWindow() {
    if (!chunks_.empty()) clean_up();
  }

  bool empty() const noexcept { return chunks_.empty(); }
  std::size_t size() const noexcept { return chunks_.size(); }
  // The caller gave up waiting (its while_waiting threw): cleanup hands
  // ranges still in use on at once instead of waiting for their copies.
  void stop_waiting() noexcept {
    cleanup_timeout_ = std::chrono::nanoseconds::zero();
    stopped_waiting_ = true;
  }
  bool stopped_waiting() const noexcept { return stopped_waiting_; }
  const InFlightChunk& oldest() const noexcept { return chunks_.front(); }
  // After its range went back to the ring.
  void pop_oldest() noexcept {
    TransferRoom::give_back(bridge_, chunks_.front().counted);
    chunks_.pop_front();
  }
  // Takes over `range` (and its TransferRoom count) once its copy is submitted.
  void push(const Chunk& chunk, ReservedRange& range, CopyEvent event, TransferRoom& counted) {
    chunks_.push_back({chunk, range.get(), event, counted.bytes()});
    range.keep();
    counted.keep();
  }

 private:
  void clean_up() noexcept {
    for (const auto& in_flight : chunks_) TransferRoom::give_back(bridge_, in_flight.counted);
    // Closed, Broken, restarted: try_release below asks the bridge whether the range is still pinned.
    const auto deadline = checked::deadline_after(cleanup_timeout_);
    for (const auto& in_flight : chunks_) wait_until(bridge_, in_flight.event, deadline);
    std::size_t handed_on = 0, left_behind = 0;
    for (const auto& in_flight : chunks_) {
      if (try_release(bridge_, in_flight.range)) continue;
      try {
        bridge_.release_host_after(in_flight.range, in_flight.event);
        ++handed_on;
      } catch (...) {
        ++left_behind;  // the bridge is gone or restarted since: its ring no longer holds the range
      }
    }
    if (handed_on != 0)
      detail::log().warn(
          "transfer: {} ring range(s) still used by copies that had not ended {} (or the bridge is broken) after a "
          "failed transfer: the bridge releases each once its copy ends",
          handed_on,
          stopped_waiting_ ? std::string("when the caller stopped waiting (interrupted, or its stall limit passed)")
                           : fmt::format("within the cleanup timeout of {} ns", cleanup_timeout_.count()));
    if (left_behind != 0)
      detail::log().warn("transfer: {} ring range(s) left reserved after a failed transfer (the bridge refused them)",
                         left_behind);
  }

  Bridge& bridge_;
  std::chrono::nanoseconds cleanup_timeout_;
  bool stopped_waiting_ = false;
  std::deque<InFlightChunk> chunks_;
};

// Runs one transfer: fills the window chunk by chunk, finishing chunks as
// their copies complete, and (through the window's destructor) cleans up if
// anything throws.
class Pipeline {
 public:
  Pipeline(Bridge& bridge, const RingChunkSettings& options, const Transfer& transfer)
      : bridge_(bridge), running_(bridge), options_(options), transfer_(transfer),
        window_(bridge, options.cleanup_timeout) {}

  void run() {
    if (options_.submitted == nullptr) return run_chunks();
    try {
      run_chunks();
    } catch (...) {
      wait_for_submitted();
      throw;
    }
  }

 private:
  void run_chunks() {
    Chunk chunk;
    for (std::uint64_t offset = 0; offset < transfer_.total; ++chunk.index) {
      chunk.offset = offset;
      chunk.len = std::min(transfer_.chunk_bytes, transfer_.total - offset);
      chunk.end = checked::add_or_throw(offset, chunk.len, ErrorKind::InvalidRange, "end of a chunk");
      submit(chunk);
      while (!window_.empty() && finish_oldest(false)) {
      }
      if (window_.size() >= options_.max_chunks_in_flight) finish_oldest(true);
      offset = chunk.end;
    }
    while (!window_.empty()) finish_oldest(true);
    if (options_.submitted != nullptr && options_.progress != nullptr && *options_.progress)
      (*options_.progress)(transfer_.total, transfer_.total);
  }

  // submit() after a failure: the copies it submitted end (or the cleanup
  // timeout passes) before the caller frees the allocation they write.
  void wait_for_submitted() noexcept {
    // Failed, closed, broken: the bridge releases the range regardless.
    const auto deadline = checked::deadline_after(window_.stopped_waiting() ? std::chrono::nanoseconds::zero()
                                                                    : options_.cleanup_timeout);
    for (const PendingCopy& copy : *options_.submitted) wait_until(bridge_, copy.event, deadline);
  }

  // A chunk's ring bytes, leased while they are written or read: another
  // thread (or a fill's or sink's own code) may close the bridge meanwhile,
  // which must not free the ring under the copy (host_bytes would be valid
  // only until then: a close beside a download crashed the process).
  HostLease lent(HostRange range) { return bridge_.lease_host(range); }
  // Runs `call` (a fill or sink handed `range`'s bytes) with the range's ring
  // keepable past it (keep_lent_chunk_memory).
  template <class Call>
  void lending(HostRange range, const Call& call) {
    const LendingChunk::Keep keep = [&] { return std::make_shared<HostLease>(bridge_.lease_host(range)); };
    const LendingChunk marked(keep);
    call(lent(range).bytes());
  }

  void submit(const Chunk& chunk) {
    // Counted before it is reserved: a neighbour short of room between the
    // two would otherwise see none held and fail.
    TransferRoom counted(bridge_, chunk.len);
    ReservedRange range(bridge_, with_room(chunk, counted, true, [&](std::chrono::nanoseconds wait) {
                          return bridge_.reserve(chunk.len, kRingAlignment, wait);
                        }));
    const DeviceRange device{transfer_.handle, transfer_.device_offset_of(chunk), chunk.len};
    try {
      if (transfer_.upload()) {
        if (transfer_.fill != nullptr)
          lending(range.get(), [&](std::span<std::byte> bytes) { (*transfer_.fill)(chunk.offset, bytes); });
        else
          std::ranges::copy(transfer_.source.subspan(chunk.offset, chunk.len), lent(range.get()).bytes().begin());
      }
    } catch (const Error& e) {
      rethrow_for_chunk(e, transfer_, chunk);
    }
    const CopyEvent event = with_room(chunk, counted, false, [&](std::chrono::nanoseconds wait) {
      return transfer_.upload() ? bridge_.host_to_device(range.get(), device, CopyMode::Async, Admission{wait})
                                : bridge_.device_to_host(device, range.get(), CopyMode::Async, Admission{wait});
    });
    if (options_.submitted == nullptr) {
      window_.push(chunk, range, event, counted);
      return;
    }
    try {
      bridge_.release_host_after(range.get(), event);
    } catch (const Error& e) {
      rethrow_for_chunk(e, transfer_, chunk);
    }
    range.keep();
    options_.submitted->push_back({event, chunk.index, chunk.offset, chunk.len});
  }

  // Runs `attempt` (a reserve or a copy, given how long it may wait for
  // room). On Backpressure (the ring or the in-flight budget is full) it
  // makes room from this call's own chunks, oldest first, and tries again
  // (ranges of earlier failed calls go back inside reserve,
  // release_host_after). With none of its own, the room is held by others:
  // while other transfers run, it waits as long as they hold room or give
  // some back (wait_while_others_busy); alone, the attempt is made once more
  // waiting up to wait_for_room (the bridge wakes it as room comes back),
  // and then Backpressure stands.
  template <class Attempt>
  std::invoke_result_t<Attempt&, std::chrono::nanoseconds> with_room(const Chunk& chunk, TransferRoom& counted,
                                                                      bool reserving, Attempt attempt) {
    auto wait = std::chrono::nanoseconds::zero();
    bool tried_again = false;
    bool waited_for_room = false;  // wait_for_room is waited once in all (it was twice: 120 s for 60)
    for (;;) {
      try {
        return attempt_waiting(attempt, wait);
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::Backpressure) rethrow_for_chunk(e, transfer_, chunk);
        // Room held by ranges the bridge releases as their copies end (this
        // submit()'s, an earlier one's): wait for one.
        if (window_.empty() && !wait_for_release_after()) {
          if (options_.wait_for_other_transfers && RoomWatch(bridge_, counted.bytes()).others_running()) {
            try {
              return wait_while_others_busy(attempt, counted, reserving);
            } catch (const Error& busy) {
              rethrow_for_chunk(busy, transfer_, chunk);
            }
          }
          if (waited_for_room || options_.wait_for_room == std::chrono::nanoseconds::zero()) {
            // Once more at once: room may have come back between the attempt and the look.
            if (std::exchange(tried_again, true)) rethrow_for_chunk(e, transfer_, chunk);
            wait = std::chrono::nanoseconds::zero();
            continue;
          }
          waited_for_room = true;
          wait = options_.wait_for_room;
          continue;
        }
      }
      if (!window_.empty()) finish_oldest(true);
    }
  }

  // Room other transfers hold comes back as their copies end: `attempt` is
  // made again as the bridge wakes it, for at least kWaitForOtherTransfers
  // whatever wait_for_room says, until the neighbours have been quiet
  // (RoomWatch) past wait_for_room: then the room is held elsewhere and
  // Backpressure stands.
  template <class Attempt>
  std::invoke_result_t<Attempt&, std::chrono::nanoseconds> wait_while_others_busy(Attempt& attempt,
                                                                                   TransferRoom& counted,
                                                                                   bool reserving) {
    // A chunk waiting to reserve holds no room yet; one waiting for budget holds its range.
    std::optional<TransferRoom::StandAside> aside;
    if (reserving) aside.emplace(counted);
    RoomWatch neighbours(bridge_, reserving ? 0 : counted.bytes());
    const auto started = checked::Clock::now();
    const auto deadline = checked::deadline_after(std::max(options_.wait_for_room, kWaitForOtherTransfers));
    for (;;) {
      const auto left = std::chrono::nanoseconds(checked::time_left(deadline));
      try {
        return attempt(std::min<std::chrono::nanoseconds>(left, kWaitSlice));
      } catch (const Error& e) {
        const auto now = checked::Clock::now();
        if (e.kind() != ErrorKind::Backpressure || now >= deadline) throw;
        if (now - started >= options_.wait_for_room && neighbours.others_quiet(now)) throw;
      }
      if (interruptible()) while_waiting();
    }
  }


  // ---- waits the caller's while_waiting may interrupt (between slices) ----
  static constexpr auto kWaitSlice = std::chrono::milliseconds(20);

  bool interruptible() const noexcept { return options_.while_waiting != nullptr && *options_.while_waiting; }

  // The caller's hook; once it throws, whoever pressed Ctrl-C (or a stall
  // limit) is not kept waiting through the cleanup too.
  void while_waiting() {
    try {
      (*options_.while_waiting)();
    } catch (...) {
      window_.stop_waiting();
      throw;
    }
  }

  // A bridge call that may wait: what the thread's WaitCheck throws through
  // it (Python's Ctrl-C: anything but the bridge's own Error) stops the
  // waiting as while_waiting's does, so the cleanup does not wait either.
  template <class Call>
  auto bridge_wait(const Call& call) {
    try {
      return call();
    } catch (const Error&) {
      throw;
    } catch (...) {
      window_.stop_waiting();
      throw;
    }
  }

  CopyStatus wait_for_copy(const CopyEvent& event) {
    if (!interruptible()) return bridge_wait([&] { return bridge_.wait(event); });
    for (;;) {
      const CopyStatus status = bridge_wait([&] { return bridge_.wait(event, kWaitSlice); });
      if (status.state != CopyState::Pending) return status;
      while_waiting();
    }
  }

  // Bridge::wait_for_release_after: true once a waiting range went back,
  // false when none waits.
  bool wait_for_release_after() {
    if (!interruptible()) return bridge_wait([&] { return bridge_.wait_for_release_after(); });
    for (;;) {
      if (bridge_wait([&] { return bridge_.wait_for_release_after(kWaitSlice); })) return true;
      if (bridge_.stats().ring_releases_pending == 0) return false;
      while_waiting();
    }
  }

  // `attempt` given up to `wait` for room, in slices between which the
  // caller may interrupt.
  template <class Attempt>
  std::invoke_result_t<Attempt&, std::chrono::nanoseconds> attempt_waiting(Attempt& attempt,
                                                                            std::chrono::nanoseconds wait) {
    if (!interruptible() || wait <= kWaitSlice) return bridge_wait([&] { return attempt(wait); });
    const auto deadline = checked::deadline_after(wait);
    for (;;) {
      const auto left = std::chrono::nanoseconds(checked::time_left(deadline));
      try {
        return bridge_wait([&] { return attempt(std::min<std::chrono::nanoseconds>(left, kWaitSlice)); });
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::Backpressure || checked::Clock::now() >= deadline) throw;
      }
      while_waiting();
    }
  }

  // Finishes the oldest chunk: waits for its copy (without `block`, returns
  // false if it has not completed yet), copies a download's bytes out of the
  // ring, releases the range and reports progress.
  bool finish_oldest(bool block) {
    const InFlightChunk oldest = window_.oldest();
    try {
      if (block) {
        const CopyStatus status = wait_for_copy(oldest.event);
        if (status.state == CopyState::Failed)
          throw Error(status.error.value_or(transfer_.upload() ? ErrorKind::DeviceCopyFailed
                                                               : ErrorKind::OutputCopyFailed),
                      status.message);
      } else if (!(transfer_.upload() ? bridge_.safe_to_release_host(oldest.event)
                                      : bridge_.host_bytes_valid(oldest.event))) {
        return false;
      }
      if (!transfer_.upload()) {
        if (transfer_.sink != nullptr)
          lending(oldest.range, [&](std::span<std::byte> bytes) { (*transfer_.sink)(oldest.chunk.offset, bytes); });
        else
          std::ranges::copy(lent(oldest.range).bytes(), transfer_.destination.subspan(oldest.chunk.offset).begin());
      }
      bridge_.release_host(oldest.range);
    } catch (const Error& e) {
      rethrow_for_chunk(e, transfer_, oldest.chunk);
    }
    window_.pop_oldest();
    done_ = checked::add_or_throw(done_, oldest.chunk.len, ErrorKind::InvalidRange, "bytes staged");
    if (options_.progress != nullptr && *options_.progress) (*options_.progress)(done_, transfer_.total);
    return true;
  }

  Bridge& bridge_;
  RunningTransfer running_;  // from the first chunk to the last cleanup: neighbours short of room wait for it
  const RingChunkSettings& options_;
  const Transfer& transfer_;
  ChunkWindow window_;
  std::uint64_t done_ = 0;
};

}  // namespace

void run_ring_chunks(Bridge& bridge, const RingChunkSettings& settings, const RingChunkJob& job) {
  const Transfer transfer{job};
  Pipeline(bridge, settings, transfer).run();
}

}  // namespace devbridge::detail
