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

std::uint64_t round_up(std::uint64_t value, std::uint64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// ---- validation of the test hooks -------------------------------------------

constexpr int kFakeCallCount = fake::kCallCount;
constexpr int kFakeFailureCount = static_cast<int>(fake::Failure::Fatal) + 1;

std::string fake_call_names() {
  std::string names;
  for (int i = 0; i < kFakeCallCount; ++i) {
    if (i != 0) names += ", ";
    names += fake::call_name(static_cast<fake::Call>(i));
  }
  return names;
}

std::string fake_failure_names() {
  std::string names;
  for (int i = 0; i < kFakeFailureCount; ++i) {
    if (i != 0) names += ", ";
    names += fake::failure_name(static_cast<fake::Failure>(i));
  }
  return names;
}

// The calls on which `failure` can fire, as the fake backend defines it.
std::string calls_for(fake::Failure failure) {
  std::string names;
  for (int i = 0; i < kFakeCallCount; ++i) {
    const auto call = static_cast<fake::Call>(i);
    if (!fake::applies(call, failure)) continue;
    if (!names.empty()) names += ", ";
    names += fake::call_name(call);
  }
  return names;
}

StreamPlan::Injection parse_injection(std::string_view text) {
  const auto first = text.find(':');
  if (first == std::string_view::npos) {
    throw UsageError(fmt::format("--fake-inject: '{}' is not CALL:FAILURE[:N]", text));
  }
  const std::string_view call_text = text.substr(0, first);
  std::string_view rest = text.substr(first + 1);
  std::optional<std::string_view> nth_text;
  if (const auto second = rest.find(':'); second != std::string_view::npos) {
    nth_text = rest.substr(second + 1);
    rest = rest.substr(0, second);
  }
  StreamPlan::Injection injection;
  injection.call = -1;
  injection.failure = -1;
  for (int i = 0; i < kFakeCallCount; ++i) {
    if (fake::call_name(static_cast<fake::Call>(i)) == call_text) injection.call = i;
  }
  if (injection.call < 0) {
    throw UsageError(fmt::format("--fake-inject: '{}': unknown call '{}' (one of: {})", text, call_text,
                                 fake_call_names()));
  }
  for (int i = 0; i < kFakeFailureCount; ++i) {
    if (fake::failure_name(static_cast<fake::Failure>(i)) == rest) injection.failure = i;
  }
  if (injection.failure < 0) {
    throw UsageError(fmt::format("--fake-inject: '{}': unknown failure '{}' (one of: {})", text, rest,
                                 fake_failure_names()));
  }
  // A failure that cannot fire on that call would be refused by the backend
  // once the run had started; it is a command line that cannot work.
  const auto call = static_cast<fake::Call>(injection.call);
  const auto failure = static_cast<fake::Failure>(injection.failure);
  if (!fake::applies(call, failure)) {
    const std::string calls = calls_for(failure);
    throw UsageError(fmt::format("--fake-inject: '{}': failure {} cannot apply to call {} ({})", text,
                                 fake::failure_name(failure), fake::call_name(call),
                                 calls.empty() ? std::string("it applies to no call")
                                               : fmt::format("{} applies to: {}", fake::failure_name(failure), calls)));
  }
  if (nth_text) {
    constexpr std::uint64_t kMaxNth = 1'000'000'000;
    std::uint64_t nth = 0;
    try {
      nth = parse_count("--fake-inject N", *nth_text);
    } catch (const UsageError&) {
      throw UsageError(fmt::format("--fake-inject: '{}': N '{}' is not a whole number between 1 and {}", text,
                                   *nth_text, kMaxNth));
    }
    if (nth == 0 || nth > kMaxNth) {
      throw UsageError(fmt::format("--fake-inject: '{}': N must be between 1 and {}", text, kMaxNth));
    }
    injection.nth = static_cast<int>(nth);
  }
  return injection;
}

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

StreamPlan plan_stream(const StreamArgs& args) {
  StreamPlan plan;

  // The backend: a name this build knows, available on this machine.
  const std::vector<BackendAvailability> backends = list_backends();
  std::string known = "auto";
  for (const BackendAvailability& b : backends) {
    if (b.built) known += ", " + b.name;
  }
  if (args.backend != "auto") {
    const auto it = std::find_if(backends.begin(), backends.end(),
                                 [&](const BackendAvailability& b) { return b.name == args.backend; });
    if (it == backends.end()) {
      throw UsageError(fmt::format("--backend: unknown backend '{}' (this build has: {})", args.backend, known));
    }
    if (!it->available && !(it->built && args.device))  // an explicit device is the backend's to refuse
      throw UsageError(fmt::format("--backend: {} is {}", it->name, describe_availability(*it)));
  }
  plan.backend = args.backend;
  for (const std::string& option : args.backend_options) {
    const auto equals = option.find('=');
    if (equals == std::string::npos || equals == 0)
      throw UsageError(fmt::format("--backend-option: '{}' is not KEY=VALUE", option));
    const auto key = option.substr(0, equals);
    if (key == "device") throw UsageError("--backend-option: give the device with --device");
    // A CUcontext is an address in the process that made it: a command line has none to give, and any
    // number would be read as a pointer.
    if (key == "context")
      throw UsageError("--backend-option: context is a CUcontext of the calling process, which a command line "
                       "cannot give (the worker makes its own; pick the device with --device)");
    if (!plan.backend_options.emplace(key, option.substr(equals + 1)).second)
      throw UsageError(fmt::format("--backend-option: {} given twice", key));
  }
  if (args.device) {
    if (args.device->empty()) throw UsageError("--device: empty (see devbridge info for the devices)");
    plan.backend_options["device"] = *args.device;
  }
  // A device that is not there, or an option the backend does not take, is
  // a usage error found before anything runs: open it to ask, once (the
  // stream runs on this instance). "auto" is opened the way the stream
  // opens it (make_backend picks the backend and hands it the options), so
  // what it picks is checked the same way.
  if (!plan.backend_options.empty()) {
    try {
      plan.opened_backend = make_backend(plan.backend, plan.backend_options);
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::Unsupported || e.kind() == ErrorKind::Unavailable)
        throw UsageError(fmt::format("--device/--backend-option: {}", e.message()));
      throw;
    }
  }

  plan.bytes = parse_size("--bytes", args.bytes);
  const std::uint64_t chunk = parse_size("--chunk", args.chunk);
  plan.inflight = parse_count("--inflight", args.inflight);
  plan.ring_bytes = parse_size("--ring-bytes", args.ring_bytes);

  if (plan.bytes == 0) throw UsageError(fmt::format("--bytes: '{}': must be more than 0", args.bytes));
  if (plan.bytes % sizeof(float) != 0) {
    throw UsageError(fmt::format("--bytes: '{}' ({} bytes) is not a multiple of 4 (the stream moves float32 elements)",
                                 args.bytes, plan.bytes));
  }
  if (chunk == 0) throw UsageError(fmt::format("--chunk: '{}': must be more than 0", args.chunk));
  if (chunk % sizeof(float) != 0) {
    throw UsageError(fmt::format("--chunk: '{}' ({} bytes) is not a multiple of 4 (the stream moves float32 elements)",
                                 args.chunk, chunk));
  }
  if (plan.inflight == 0) throw UsageError(fmt::format("--inflight: '{}': must be at least 1", args.inflight));
  if (plan.ring_bytes == 0) throw UsageError(fmt::format("--ring-bytes: '{}': must be more than 0", args.ring_bytes));

  // A chunk larger than the whole stream is just the whole stream.
  plan.chunk_bytes = std::min(chunk, plan.bytes);
  // Far beyond any memory, and small enough that the ring arithmetic below
  // (twice the chunk, rounded up) cannot overflow.
  constexpr std::uint64_t kMaxChunk = 1ull << 60;
  if (plan.chunk_bytes > kMaxChunk) {
    throw UsageError(fmt::format("--chunk: '{}' ({} bytes) is too large (at most {} bytes)", args.chunk,
                                 plan.chunk_bytes, kMaxChunk));
  }
  // Not (bytes + chunk - 1) / chunk: that sum wraps for --bytes near 2^64.
  plan.chunks = plan.bytes / plan.chunk_bytes + (plan.bytes % plan.chunk_bytes != 0 ? 1 : 0);
  plan.slot_bytes = round_up(plan.chunk_bytes, kReservationAlignment);

  // Every chunk holds an input and an output reservation at once, each
  // aligned to 64 bytes. Reservations of one size laid end to end from the
  // ring's start always fit twice into twice their size, so that is enough.
  const std::uint64_t needed = 2 * plan.slot_bytes;
  if (plan.ring_bytes < needed) {
    const std::string rounded = plan.slot_bytes == plan.chunk_bytes
                                    ? std::string()
                                    : fmt::format(", each rounded up to {} bytes for 64-byte alignment", plan.slot_bytes);
    throw UsageError(fmt::format(
        "--ring-bytes: '{}' ({} bytes) cannot hold a chunk: each chunk holds an input and an output reservation of "
        "{} bytes at once{}, so the ring needs at least {} bytes ({})",
        args.ring_bytes, plan.ring_bytes, plan.chunk_bytes, rounded, needed, format_bytes(needed)));
  }

  // More chunks than the ring has room for can never be in flight (each
  // chunk's upload holds a ring range until its copy ends), so more device
  // buffers than that would only cost device memory.
  plan.slots = std::min({plan.inflight, plan.chunks, plan.ring_bytes / plan.slot_bytes});

  const double stall = [&] {
    const std::uint64_t seconds = parse_count("--stall-timeout", args.stall_timeout);
    if (seconds == 0 || seconds > 86'400) {
      throw UsageError(
          fmt::format("--stall-timeout: '{}': must be between 1 and 86400 seconds", args.stall_timeout));
    }
    return static_cast<double>(seconds);
  }();
  plan.stall_timeout_seconds = stall;

  if (args.fake_inject) {
    if (plan.backend != "fake") {
      throw UsageError(fmt::format("--fake-inject: '{}': only with --backend fake", *args.fake_inject));
    }
    plan.fake_injection = parse_injection(*args.fake_inject);
  }
  if (args.corrupt_element) {
    const std::uint64_t element = parse_count("--corrupt-element", *args.corrupt_element);
    if (element >= plan.bytes / sizeof(float)) {
      throw UsageError(fmt::format("--corrupt-element: '{}' is past the last element ({})", *args.corrupt_element,
                                   plan.bytes / sizeof(float) - 1));
    }
    plan.corrupt_element = element;
  }
  if (args.trace) {
    if (args.trace->empty()) throw UsageError("--trace: give the file to write the trace to");
    check_output_file("--trace", *args.trace);
    plan.trace_path = *args.trace;
  }
  return plan;
}

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
