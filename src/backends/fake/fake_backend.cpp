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
#include "backends/fake/fake_backend_impl.hpp"

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

FakeBackend::FakeBackend(std::uint64_t memory_bytes, std::vector<DType> dtypes, Backing backing)
    : state_(std::make_unique<State>()) {
  state_->memory_bytes = memory_bytes;
  state_->backing = backing;
  if (dtypes.empty())
    for (const auto& d : all_dtypes()) dtypes.push_back(d.dtype);
  state_->dtypes = std::move(dtypes);
  state_->controls.emplace(*this);
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

TestControls* FakeBackend::test_controls() noexcept { return &*state_->controls; }

std::vector<RecordedCall> FakeBackend::calls() const {
  std::lock_guard lock(state_->mutex);
  return state_->calls;
}

std::uint64_t FakeBackend::dropped_calls() const {
  std::lock_guard lock(state_->mutex);
  return state_->dropped_calls;
}

void FakeBackend::clear_calls() {
  std::lock_guard lock(state_->mutex);
  state_->calls.clear();
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
    info.part_alignment = state_->parts ? kPartAlignment : 0;
  }
  info.dtypes = state_->dtypes;
  info.adopt = true;
  info.peer_copy = true;
  info.consumer_queues = true;
  info.notes = state_->backing == Backing::None
                   ? "scripted test device without memory (backing=none): allocations are bookkeeping only; "
                     "copies, views and launches are refused"
                   : "scripted test device: device memory is host memory, async copies complete when the test says";
  return info;
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
  // No address of memory that is not there is handed out.
  if (const State::Allocation* live = s.live(allocation); live && live->unbacked)
    State::refuse_unbacked("validate_view", allocation.address);
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
  Backing backing = Backing::HostMemory;
  if (const auto text = reader.text("backing", "what is behind device allocations: host (real host memory, the "
                                               "default) or none (bookkeeping only: copies, views and launches "
                                               "refused)")) {
    if (*text == "none")
      backing = Backing::None;
    else if (*text != "host")
      reader.refuse("backing", *text, "is neither 'host' nor 'none'");
  }
  reader.finish();
  return std::make_unique<FakeBackend>(memory_bytes.value_or(1ull << 34), std::move(dtypes), backing);
}

}  // namespace devbridge::fake
