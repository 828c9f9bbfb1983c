// `devbridge stream`'s pipeline and its run (stream.hpp); the command line is checked into a
// plan by stream_plan.cpp.
#include "stream.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <limits>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "devbridge/backends.hpp"
#include "devbridge/backends/fake.hpp"
#include "devbridge/bridge.hpp"
#include "devbridge/consumer_names.hpp"
#include "devbridge/error.hpp"
#include "devbridge/transfer.hpp"
#include "output_file.hpp"
#include "pattern.hpp"
#include "progress.hpp"
#include "sizes.hpp"

namespace devbridge::cli {
namespace {

using Clock = std::chrono::steady_clock;

// ---- a small closable queue between the pipeline's stages ------------------

template <typename T>
class StageQueue {
 public:
  void push(T item) {
    {
      std::lock_guard lock(mutex_);
      items_.push_back(std::move(item));
    }
    ready_.notify_one();
  }
  // No more items will come; pop drains what is queued, then returns nullopt.
  void close() {
    {
      std::lock_guard lock(mutex_);
      closed_ = true;
    }
    ready_.notify_all();
  }
  // Discards what is queued and wakes every consumer (the stream failed).
  void abandon() {
    {
      std::lock_guard lock(mutex_);
      closed_ = true;
      items_.clear();
    }
    ready_.notify_all();
  }
  std::optional<T> pop() {
    std::unique_lock lock(mutex_);
    ready_.wait(lock, [&] { return closed_ || !items_.empty(); });
    if (items_.empty()) return std::nullopt;
    T item = std::move(items_.front());
    items_.pop_front();
    return item;
  }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<T> items_;
  bool closed_ = false;
};

// Thrown inside a stage when another stage has already failed; not an error
// of its own.
struct StreamAborted {};

// Thrown inside the producer when a stop was asked for before the next chunk
// took anything: the stream ends with what is already in flight.
struct StreamStopped {};

// How often a waiting stage looks at the stop flag; how soon a planner call
// refused for room is tried again.
constexpr auto kStopPoll = std::chrono::milliseconds(50);

// One chunk, handed from the producer to the upload watcher and the downloader.
struct ChunkTicket {
  std::uint64_t index = 0;
  std::uint64_t first_element = 0;
  std::uint64_t len = 0;  // bytes
  std::uint64_t slot = 0;
  std::vector<PendingCopy> uploads;
  Clock::time_point submitted{};
};

// Time a direction of copies had work outstanding. Copies of one direction
// complete in submission order, so each copy's service time runs from the
// later of its submission and the previous completion to its own completion;
// the sum is the busy time, without double-counting queued copies.
class BusyClock {
 public:
  void completed(Clock::time_point submitted, Clock::time_point done) {
    const auto start = std::max(submitted, last_done_);
    if (done > start) busy_ += done - start;
    last_done_ = std::max(last_done_, done);
  }
  double seconds() const { return std::chrono::duration<double>(busy_).count(); }

 private:
  Clock::duration busy_{};
  Clock::time_point last_done_{};
};

// One planner chunk per stream chunk, so the report's one upload and one
// download copy per chunk still hold; the ring and the chunk were sized
// together by plan_stream.
// --stall-timeout (1..86400 s, checked by plan_stream) as a duration.
std::chrono::nanoseconds stall_timeout(const StreamPlan& plan) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(plan.stall_timeout_seconds));
}

TransferOptions planner_options(const StreamPlan& plan, std::function<void()> while_waiting) {
  TransferOptions options;
  options.while_waiting = std::move(while_waiting);
  options.chunk_bytes = plan.chunk_bytes;
  options.max_chunks_in_flight = 1;
  options.cleanup_timeout = stall_timeout(plan);
  // The two stages share the ring and the in-flight budget: one waits for
  // room the other holds, and gives up only when the other stalls.
  options.wait_for_room = stall_timeout(plan);
  // The stream is the worker's ring at work: its chunks go through the ring
  // on every backend (on one whose memory is host memory the planner would
  // write a stream straight into it, and the report would count no upload).
  options.route = Route::RingChunks;
  return options;
}

// The stream over the transfer planner. The producer (the calling thread)
// uploads each chunk with submit(), whose StreamSource writes the pattern
// straight into the ring range and which leaves the copy in flight, then
// runs the compute step on the device. A watcher waits for each upload; a
// downloader brings each result back with run() into a StreamDestination
// whose sink checks every element while the bytes are still in the ring.
// Up to `slots` chunks are in flight at once; their uploads overlap one
// another, the compute and the download of an earlier chunk.
class StreamPipeline {
 public:
  StreamPipeline(Bridge& bridge, const StreamPlan& plan, Progress& progress, const std::atomic<int>* stop)
      : bridge_(bridge),
        plan_(plan),
        progress_(progress),
        stop_(stop),
        uploader_(bridge, planner_options(plan, [this] { while_planner_waits(uploading_, "host_to_device", true); })),
        downloader_(bridge,
                    planner_options(plan, [this] { while_planner_waits(downloading_, "device_to_host", false); })) {}

  void allocate_slots() {
    const ObjectSpec spec{plan_.slot_bytes, kReservationAlignment, DType::Float32, ShapeKind::Vector};
    for (std::uint64_t s = 0; s < plan_.slots; ++s) {
      inputs_.push_back(bridge_.alloc_device(spec, plan_.slot_bytes));
      outputs_.push_back(bridge_.alloc_device(spec, plan_.slot_bytes));
    }
  }

  // Frees the device buffers; succeeds only when no copy, step or view holds
  // them any more, which is itself a check that the stream cleaned up.
  void free_slots() {
    for (const DeviceHandle& h : inputs_) bridge_.free_device(h);
    for (const DeviceHandle& h : outputs_) bridge_.free_device(h);
    inputs_.clear();
    outputs_.clear();
  }

  // Ranges of uploads whose completions the bridge has not applied yet.
  void release_stranded() { uploader_.release_stranded(); }

  void run(StreamReport& report) {
    progress_.start(plan_.bytes);
    const auto started = Clock::now();
    std::thread upload_stage([&] { guarded([&] { watch_uploads(); }); });
    std::thread download_stage([&] { guarded([&] { download_and_verify(); }); });
    guarded([&] {
      try {
        produce();
      } catch (const StreamStopped&) {
        stopped_by_ = stop_signal();
      }
    });
    // From here on nothing is submitted; the stages drain what is in flight.
    uploads_.close();
    downloads_.close();
    upload_stage.join();
    download_stage.join();
    const auto finished = Clock::now();
    progress_.finish();

    report.seconds = std::chrono::duration<double>(finished - started).count();
    report.ring_wraps = bridge_.stats().ring_wraps;  // the ring counts its laps itself
    report.upload_busy_seconds = upload_busy_.seconds();
    report.download_busy_seconds = download_busy_.seconds();
    if (stopped_by_ != 0) {
      report.interrupted = true;
      report.signal = stopped_by_;
    }
    std::lock_guard lock(mutex_);
    report.chunks_verified = retired_chunks_;
    report.bytes_verified = verified_bytes_;
    report.errors = errors_;
  }

 private:
  // Runs a stage body; the first failure anywhere stops every stage.
  template <typename Body>
  void guarded(Body&& body) {
    try {
      body();
    } catch (const StreamAborted&) {
    } catch (const std::exception& e) {
      fail(e.what());
    }
  }

  void fail(std::string message) {
    {
      std::lock_guard lock(mutex_);
      // Later failures are usually consequences of the first; keep a few.
      if (errors_.size() < 16) errors_.push_back(std::move(message));
      aborted_ = true;
    }
    changed_.notify_all();
    uploads_.abandon();
    downloads_.abandon();
  }

  bool aborted() {
    std::lock_guard lock(mutex_);
    return aborted_;
  }

  // ---- producer (the calling thread) ----

  // A stop is looked at only before a chunk takes anything (its slot, its
  // input range): a chunk once started is submitted whole, so the drain
  // leaves no step open and no range reserved.
  int stop_signal() const { return stop_ == nullptr ? 0 : stop_->load(std::memory_order_relaxed); }

  void produce() {
    for (std::uint64_t i = 0; i < plan_.chunks; ++i) {
      if (stop_signal() != 0) throw StreamStopped{};
      std::string_view stage = "host_to_device";
      try {
        produce_chunk(i, stage);
      } catch (const devbridge::Error& e) {
        throw std::runtime_error(fmt::format("chunk {}: {}: {}", i, stage, e.what()));
      }
    }
  }

  // `stage` names the step under way, for the error message.
  void produce_chunk(std::uint64_t i, std::string_view& stage) {
    wait_for_free_slot(i);
    ChunkTicket ticket;
    ticket.index = i;
    ticket.slot = i % plan_.slots;
    const std::uint64_t offset = i * plan_.chunk_bytes;
    ticket.len = std::min(plan_.chunk_bytes, plan_.bytes - offset);
    ticket.first_element = offset / sizeof(float);

    const StreamSource pattern{ticket.len, [&](std::uint64_t at, std::span<std::byte> chunk) {
                                 fill_pattern(as_floats(chunk), ticket.first_element + at / sizeof(float));
                               }};
    const DeviceSpan x{inputs_[ticket.slot], 0, ticket.len};
    ticket.submitted = Clock::now();
    uploading_ = {i, ticket.submitted};
    ticket.uploads = uploader_.submit(pattern, x).pending;
    uploads_.push(ticket);

    stage = "begin_step";
    const DeviceHandle step_handles[] = {inputs_[ticket.slot], outputs_[ticket.slot]};
    bridge_.begin_step(step_id(i), step_handles);
    stage = "launch_axpy";
    bridge_.launch_axpy(DeviceRange{inputs_[ticket.slot], 0, ticket.len},
                        DeviceRange{outputs_[ticket.slot], 0, ticket.len}, kAxpyA, kAxpyB);
    downloads_.push(std::move(ticket));
  }

  static StepId step_id(std::uint64_t chunk) { return chunk + 1; }

  static std::span<float> as_floats(std::span<std::byte> bytes) {
    return {reinterpret_cast<float*>(bytes.data()), bytes.size() / sizeof(float)};
  }
  static std::span<const float> as_floats(std::span<const std::byte> bytes) {
    return {reinterpret_cast<const float*>(bytes.data()), bytes.size() / sizeof(float)};
  }

  // Chunk i reuses slot i % slots, so it waits until chunk i - slots retired.
  void wait_for_free_slot(std::uint64_t chunk) {
    std::unique_lock lock(mutex_);
    while (!changed_.wait_for(lock, kStopPoll, [&] { return aborted_ || retired_chunks_ + plan_.slots > chunk; })) {
      if (stop_signal() != 0) throw StreamStopped{};
    }
    if (aborted_) throw StreamAborted{};
  }

  // A planner call (one chunk) under way on one stage's thread, for its waits.
  struct PlannerCall {
    std::uint64_t chunk = 0;
    Clock::time_point started{};
  };

  // A planner's wait for a copy or for ring room: ends when another stage
  // failed, when the call has waited the stall timeout (a lost completion
  // would otherwise hang the worker, in a download or in a full ring as in
  // the upload watcher) and, for the producer, on a stop signal.
  void while_planner_waits(const PlannerCall& call, std::string_view what, bool stoppable) {
    if (aborted()) throw StreamAborted{};
    if (stoppable && stop_signal() != 0) throw StreamStopped{};
    if (Clock::now() - call.started >= stall_timeout(plan_))
      throw std::runtime_error(fmt::format("chunk {}: {} still waiting for a copy or for ring room after {} s; a "
                                           "completion never arrived",
                                           call.chunk, what, plan_.stall_timeout_seconds));
  }

  // ---- the upload watcher ----

  // Blocks until the copy completes or fails. Gives up when another stage
  // failed, or when nothing completes for the stall timeout (a lost
  // completion would otherwise hang the worker forever).
  CopyStatus wait_for(const ChunkTicket& ticket, const PendingCopy& copy, std::string_view what) {
    const auto deadline = Clock::now() + stall_timeout(plan_);
    for (;;) {
      CopyStatus status = bridge_.wait(copy.event, std::chrono::milliseconds(20));
      if (status.state != CopyState::Pending) return status;
      if (aborted()) throw StreamAborted{};
      if (Clock::now() >= deadline) {
        throw std::runtime_error(fmt::format(
            "chunk {}: {} (event {}) still pending after {} s; its completion never arrived", ticket.index, what,
            copy.event.id, plan_.stall_timeout_seconds));
      }
    }
  }

  static std::string copy_failure(const ChunkTicket& ticket, std::string_view what, const CopyStatus& status) {
    const std::string_view kind = status.error ? kind_name(*status.error) : std::string_view("unknown error");
    return fmt::format("chunk {} ({}): {} failed: {}: {}", ticket.index, byte_span(ticket), what, kind,
                       status.message);
  }

  static std::string byte_span(const ChunkTicket& ticket) {
    const std::uint64_t first = ticket.first_element * sizeof(float);
    return fmt::format("bytes {}..{}", first, first + ticket.len - 1);
  }

  // The bridge releases each upload's range itself once its copy ends; this
  // only hears the verdict (and times the copies) so a failure is reported
  // as the upload's, not as a wrong result downstream.
  void watch_uploads() {
    while (std::optional<ChunkTicket> ticket = uploads_.pop()) {
      for (const PendingCopy& copy : ticket->uploads) {
        const CopyStatus status = wait_for(*ticket, copy, "host_to_device");
        if (status.state == CopyState::Failed)
          throw std::runtime_error(copy_failure(*ticket, "host_to_device", status));
      }
      upload_busy_.completed(ticket->submitted, Clock::now());
      {
        std::lock_guard lock(mutex_);
        ++uploads_confirmed_;
      }
      changed_.notify_all();
    }
  }

  // ---- the downloader ----

  void download_and_verify() {
    while (std::optional<ChunkTicket> ticket = downloads_.pop()) {
      Clock::time_point landed{};
      const StreamDestination check{ticket->len, [&](std::uint64_t at, std::span<const std::byte> chunk) {
                                      if (landed == Clock::time_point{}) landed = Clock::now();
                                      verify_chunk(*ticket, at, chunk);
                                    }};
      const DeviceSpan y{outputs_[ticket->slot], 0, ticket->len};
      const auto started = Clock::now();
      downloading_ = {ticket->index, started};
      try {
        downloader_.run(y, check);
      } catch (const devbridge::Error& e) {
        throw std::runtime_error(
            fmt::format("chunk {} ({}): device_to_host failed: {}", ticket->index, byte_span(*ticket), e.what()));
      }
      download_busy_.completed(started, landed);
      bridge_.end_step(step_id(ticket->index));
      std::uint64_t verified_bytes = 0;
      {
        std::lock_guard lock(mutex_);
        ++retired_chunks_;
        verified_bytes = verified_bytes_ += ticket->len;
      }
      changed_.notify_all();
      progress_.update(verified_bytes);
    }
  }

  // The sink of a chunk's download: `bytes` are bytes [at, at + size) of the
  // chunk, still in the ring.
  void verify_chunk(const ChunkTicket& ticket, std::uint64_t at, std::span<const std::byte> bytes) {
    // A result computed from a failed upload is garbage; wait for the
    // upload's verdict so a failure is reported as what it is.
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] { return aborted_ || uploads_confirmed_ > ticket.index; });
      if (aborted_) throw StreamAborted{};
    }
    const std::uint64_t first_element = ticket.first_element + at / sizeof(float);
    std::span<const float> results = as_floats(bytes);
    std::vector<float> corrupted;  // --corrupt-element damages a copy: the ring range is read-only here
    if (plan_.corrupt_element && *plan_.corrupt_element >= first_element &&
        *plan_.corrupt_element < first_element + results.size()) {
      corrupted.assign(results.begin(), results.end());
      corrupted[*plan_.corrupt_element - first_element] += 0.5f;
      results = corrupted;
    }
    if (const std::optional<Mismatch> wrong = verify_results(results, first_element)) {
      const std::uint64_t element = at / sizeof(float) + wrong->element;
      throw std::runtime_error(fmt::format(
          "chunk {}: element {} (global element {}): expected {} got {} ({} of {} elements in the chunk wrong)",
          ticket.index, element, ticket.first_element + element, wrong->expected, wrong->got, wrong->wrong_elements,
          ticket.len / sizeof(float)));
    }
  }

  Bridge& bridge_;
  const StreamPlan& plan_;
  Progress& progress_;
  const std::atomic<int>* stop_;
  // One planner per thread that moves bytes (a planner is not thread-safe).
  PlannerCall uploading_;    // producer only
  PlannerCall downloading_;  // downloader only
  TransferPlanner uploader_;    // producer only
  TransferPlanner downloader_;  // downloader only
  std::vector<DeviceHandle> inputs_;
  std::vector<DeviceHandle> outputs_;

  StageQueue<ChunkTicket> uploads_;
  StageQueue<ChunkTicket> downloads_;

  // Guards the counters below and the error list; `changed_` signals any change.
  std::mutex mutex_;
  std::condition_variable changed_;
  bool aborted_ = false;
  std::vector<std::string> errors_;
  std::uint64_t retired_chunks_ = 0;
  std::uint64_t verified_bytes_ = 0;
  std::uint64_t uploads_confirmed_ = 0;  // chunks whose upload completed, in order

  int stopped_by_ = 0;       // producer only: the signal that stopped it
  BusyClock upload_busy_;    // upload watcher only
  BusyClock download_busy_;  // downloader only
};

// The backend plan_stream opened, else a new one.
std::unique_ptr<Backend> open_backend(StreamPlan& plan) {
  std::unique_ptr<Backend> backend =
      plan.opened_backend ? std::move(plan.opened_backend) : make_backend(plan.backend, plan.backend_options);
  TestControls* controls = backend->test_controls();
  if (auto* fake_backend = controls != nullptr ? controls->fake() : nullptr) {
    // The fake device completes copies only when told; the stream has no one
    // to tell it, so it completes them as they are submitted.
    fake_backend->set_auto_complete(true);
    if (plan.fake_injection) {
      fake_backend->inject(static_cast<fake::Call>(plan.fake_injection->call),
                           static_cast<fake::Failure>(plan.fake_injection->failure), plan.fake_injection->nth);
    }
  }
  return backend;
}

// The stream on an open bridge; fills the report. Throws what ended it
// early (the pipeline's own failures land in the report). Every device
// buffer is freed, or left for the bridge's close, before it returns.
void stream_on(Bridge& bridge, StreamPlan& plan, Progress& progress, const std::atomic<int>* stop,
               StreamReport& report) {
  const BackendInfo info = bridge.backend_info();
  report.backend = info.name;
  report.device_id = info.device_id;
  report.device_name = info.device_name;
  report.device_string = tinygrad_device(info.device_kind, info.device_ordinal);

  StreamPipeline pipeline(bridge, plan, progress, stop);
  try {
    pipeline.allocate_slots();
  } catch (...) {
    report.memory = bridge.memory_stats();  // the report says what memory the bridge held when it ran out
    throw;
  }
  pipeline.run(report);
  pipeline.release_stranded();

  const BridgeStats stats = bridge.stats();
  report.copies_submitted = stats.copies_submitted;
  report.copies_failed = stats.copies_failed;
  report.stale_completions = stats.stale_completions;
  report.memory = bridge.memory_stats();
  if (report.errors.empty()) {
    // Everything came back: nothing may still hold the ring or a buffer.
    if (stats.ring_reservations != 0 || stats.copies_in_flight != 0 || stats.active_steps != 0) {
      report.errors.push_back(fmt::format(
          "after the last chunk the bridge still holds {} ring reservations, {} copies in flight, {} steps",
          stats.ring_reservations, stats.copies_in_flight, stats.active_steps));
    } else {
      pipeline.free_slots();
    }
  }
  // On failure the bridge's close quiesces the backend and frees whatever
  // the stream still held.
}

}  // namespace

StreamReport run_stream(StreamPlan& plan, Progress& progress, const std::atomic<int>* stop) {
  StreamReport report;
  report.backend = plan.backend;
  report.bytes = plan.bytes;
  report.chunk_bytes = plan.chunk_bytes;
  report.chunks = plan.chunks;
  report.inflight = plan.inflight;
  report.device_buffers = plan.slots;
  report.ring_bytes = plan.ring_bytes;

  try {
    BridgeOptions options;
    options.ring_bytes = plan.ring_bytes;
    Bridge bridge(open_backend(plan), options);
    // The stream itself: its failures end it and land in the report; the
    // bridge is closed below however it ended.
    try {
      if (plan.trace_path) {
        RecordOptions recording;
        recording.max_events = kStreamTraceEvents;
        bridge.record(recording);
      }
      stream_on(bridge, plan, progress, stop, report);
    } catch (const std::exception& e) {
      report.errors.push_back(e.what());
    }
    // Closed here, not left to the destructor (which can only log): a close
    // that fails (the device lost while quiescing) is a failure of the run.
    try {
      bridge.close();
    } catch (const std::exception& e) {
      report.errors.push_back(fmt::format("closing the bridge failed: {}", e.what()));
    }
    // Dumped after the close, so the trace ends with it (its frees, its close
    // event when it succeeded); also when it failed.
    if (plan.trace_path) {
      try {
        bridge.dump_trace(*plan.trace_path);
        report.trace_file = *plan.trace_path;
      } catch (const std::exception& e) {
        report.errors.push_back(fmt::format("--trace: {}", e.what()));
      }
    }
  } catch (const std::exception& e) {
    // The bridge could not be made (the backend, the ring).
    report.errors.push_back(e.what());
  }

  // A signal during setup, before the pipeline ran, still interrupts.
  if (!report.interrupted && stop != nullptr && stop->load() != 0 && report.chunks_verified < report.chunks) {
    report.interrupted = true;
    report.signal = stop->load();
  }
  // Rates count the bytes that made the whole trip (all of them on success).
  report.upload_gbps = gigabytes_per_second(report.bytes_verified, report.upload_busy_seconds);
  report.download_gbps = gigabytes_per_second(report.bytes_verified, report.download_busy_seconds);
  report.end_to_end_gbps = gigabytes_per_second(report.bytes_verified, report.seconds);
  report.verified = report.errors.empty() && !report.interrupted && report.chunks_verified == report.chunks;
  if (report.errors.empty() && !report.interrupted && !report.verified) {
    report.errors.push_back(
        fmt::format("only {} of {} chunks were verified", report.chunks_verified, report.chunks));
  }
  return report;
}

}  // namespace devbridge::cli
