// The bridge core's lifetime: construction, the owner's detach, breaking,
// restart and close, settling fences, and statistics (bridge_core.hpp).
#include "core/bridge_core.hpp"

namespace devbridge::detail {

namespace {

std::atomic<std::uint64_t> g_next_domain{1};

}  // namespace

BridgeCore::BridgeCore(std::unique_ptr<Backend> backend, const BridgeOptions& options)
    : backend_(std::move(backend)),
      domain_(g_next_domain.fetch_add(1)),
      generation_(options.generation),
      copies_(domain_, options.inflight_budget_bytes ? options.inflight_budget_bytes : options.ring_bytes,
              options.failed_record_limit),
      regions_(domain_) {
  if (!backend_) throw Error(ErrorKind::Unavailable, "bridge constructed without a backend");
  if (options.ring_bytes == 0) throw Error(ErrorKind::InvalidExtent, "ring_bytes must be non-zero");
  if (options.failed_record_limit == 0)
    throw Error(ErrorKind::InvalidExtent, "failed_record_limit must be at least 1");
  if (options.close_fence_timeout.count() < 0)
    throw Error(ErrorKind::InvalidRange,
                fmt::format("close_fence_timeout of {} ns is negative", options.close_fence_timeout.count()));
  if (options.writes_under_view_timeout.count() < 0)
    throw Error(ErrorKind::InvalidRange, fmt::format("writes_under_view_timeout of {} ns is negative",
                                                     options.writes_under_view_timeout.count()));
  const auto info = backend_->describe();
  backend_name_ = info.name;
  device_id_ = info.device_id;
  capabilities_ = info;
  dtypes_ = DeviceDtypes(info);
  device_string_ = tinygrad_device(info.device_kind, info.device_ordinal);
  placement_ = ViewPlacement{device_string_, static_cast<int>(dlpack_device(info.device_kind)), info.device_ordinal};
  writes_under_view_ = options.writes_under_view;
  writes_under_view_timeout_ = options.writes_under_view_timeout;
  close_fence_timeout_ = options.close_fence_timeout;
  if (options.caching_pool == CachingPool::On ||
      (options.caching_pool == CachingPool::BackendDefault && info.caches_allocations))
    pool_.emplace(options.pool_cap_bytes.value_or(info.pool_cap_bytes), info.part_alignment);
  frees_off_common_path_ = pool_.has_value();
  // Last: nothing after it may throw, or the ring would leak.
  ring_ = HostRing(backend_->allocate_host(options.ring_bytes));
}

BridgeCore::~BridgeCore() {
  SpinLockHold lock(lock_);
  settle_fences(lock, "the bridge's last lease ended");
  free_cache_now();
}

void BridgeCore::detach_owner() noexcept {
  try {
    close();
  } catch (const std::exception& e) {
    log().error("devbridge: closing the bridge failed: {}", e.what());
  }
  bool last;
  {
    std::lock_guard guard(lock_);
    // Closed even if close() failed half way: leases ending from now on
    // take end_orphaned_view, the one that may delete the core.
    gate_.set(BridgeGate::kClosed, true);
    owner_alive_ = false;
    last = outstanding_leases_ == 0;
  }
  if (last) delete this;
}

[[gnu::noinline]] void BridgeCore::enter_slow() {
  if (gate_.restarting() && !gate_.closed() && NoWaitForRestart::active())
    fail(ErrorKind::OldGenerationHandle,
         "bridge (domain {}) is restarting into a new generation, and this call may not wait for it (a finalizer): "
         "the restart frees what it would have let go",
         domain_);
  // A close refuses at once, even while it is still quiescing.
  gate_.block_while(lock_, [&] { return gate_.restarting() && !gate_.closed(); });
  if (gate_.fences_pending() && !gate_.restarting() && !gate_.closed()) reap_fences();
  gate_.check_usable();
}

void BridgeCore::mark_broken(const Error& error) {
  if (gate_.break_for(error.what()))
    log().error("devbridge: bridge (domain {}) is broken: {}", domain_, gate_.broken_reason());
}

template <class Lock>
void BridgeCore::settle_fences(Lock& lock, const char* when) noexcept {
  reap_fences();
  if (drops_.empty()) return;
  auto pending = drops_.take_all();
  gate_.set(BridgeGate::kFencesPending, false);
  const auto deadline = checked::deadline_after(close_fence_timeout_);
  lock.unlock();
  std::vector<bool> passed(pending.size(), false);
  for (std::size_t i = 0; i < pending.size(); ++i) {
    const auto now = checked::Clock::now();
    const auto left = deadline > now ? std::chrono::nanoseconds(deadline - now) : std::chrono::nanoseconds(0);
    try {
      passed[i] = backend_->wait_fence(pending[i].fence, left);
    } catch (const std::exception& e) {
      log().error("devbridge: waiting for a fence failed: {}", e.what());
    }
  }
  lock.lock();
  for (std::size_t i = 0; i < pending.size(); ++i) {
    if (passed[i]) {
      end_fenced_uses(pending[i]);
    } else {
      abandon(pending[i], when);
    }
    backend_->release_fence(pending[i].fence);
  }
}

void BridgeCore::abandon(const DropQueue::Entry& entry, const char* when) noexcept {
  ++abandoned_fences_;
  std::uint64_t bytes = 0;
  for (const auto id : entry.allocation_ids) {
    const AllocationTable::OrphanKey key{entry.generation, id};
    if (auto* orphan = allocations_.find_orphan(key)) {
      orphan->abandoned = true;
      bytes += orphan->device.bytes;
      --orphan->fences;
      maybe_free_orphan(key, *orphan);
    }
  }
  log().error("devbridge: {}, but a fence on {} had not passed after {} ns: the {} bytes it holds stay "
              "allocated for good (the device may still read them); {} fences abandoned so far",
              when, queue_text(entry.where), close_fence_timeout_.count(), bytes, abandoned_fences_);
}

std::string BridgeCore::queue_text(const QueueRef& where) {
  switch (where.queue) {
    case Queue::CopyUp: return "the upload queue";
    case Queue::CopyDown: return "the download queue";
    case Queue::Compute: return "the compute queue";
    case Queue::Consumer: break;
  }
  return fmt::format("consumer queue {:#x}", where.consumer);
}

void BridgeCore::refuse_inside_own_callback(const char* what) const {
  if (inside_own_in_place_callback())
    fail(ErrorKind::AllocationStillInUse,
         "{} called from inside a callback of this bridge's own write_in_place or read_in_place (a sink or fill "
         "handed the allocations' own bytes), which it would wait for: nothing was changed; {} after that "
         "callback returns",
         what, what);
}

void BridgeCore::quiesce_and_free_all(SpinLockHold& lock, const char* what) {
  gate_.set(BridgeGate::kRestarting, true);
  gate_.block_while(lock, [&] { return gate_.calls_running(); });
  lock.unlock();
  std::optional<Error> failure;
  try {
    backend_->quiesce();
  } catch (const Error& e) {
    failure.emplace(e);
  } catch (const std::exception& e) {
    failure.emplace(ErrorKind::Unavailable, e.what(), true);
  }
  lock.lock();
  if (failure) {
    const Error error(failure->kind(),
                      fmt::format("{} failed: the backend's quiesce failed ({}); nothing was freed or unpinned, since "
                                  "the device may still use it; {} again to retry",
                                  what, failure->what(), what),
                      true);
    mark_broken(error);
    gate_.set(BridgeGate::kRestarting, false);
    gate_.notify();
    throw error;
  }
  // The device is idle now: a failure to read its last completions loses
  // only their statistics, so it is logged and the old state freed anyway.
  if (!gate_.broken()) {
    try {
      drain_locked();
    } catch (const std::exception& e) {
      log().error("devbridge: draining completions during {} failed after a clean quiesce: {}", what, e.what());
    }
  }
  // The backend's own queues are idle now: their fences have passed.
  // Those on consumers' queues may not have; what they hold becomes an
  // orphan below, freed when they pass.
  reap_fences();
  // Copy ids start afresh in the new generation: an event is known only
  // if it was issued in the generation it names.
  copies_.restart();
  allocations_.for_each_in_use([&](std::uint32_t index, AllocationSlot& slot) {
    const auto id = make_id(index, slot.version);
    // Steps and launches are over (steps_ is cleared below, calls in
    // progress have ended): what steps still counts is fenced uses.
    const std::uint32_t fenced = slot.steps == 0 ? 0 : drops_.uses_of(generation_, id);
    if (slot.views == 0 && fenced == 0) return free_slot(index);
    // A live view may still be read (numpy, tinygrad), a consumer's queue
    // may still run over it: its memory stays until the last lease ends
    // and its fences pass, though the handle is refused from now on.
    allocations_.orphan(index, generation_, fenced);
  });
  steps_.clear();
  holders_.clear();
  ring_.unpin_all();
  // The device is idle: ranges waiting for their copies go back now.
  release_after_.release_all(ring_);
  // Registered regions belong to the old generation too: their handles
  // are refused from now on, and the backend unpins them.
  regions_.unregister_all([&](const HostBlock& block) { backend_->release_import(HostImport{.block = block}); });
  // The cache goes back too: a restart or close leaves the backend holding
  // only what views and fences still keep.
  give_back_cache(lock);
}

void BridgeCore::restart(Generation generation) {
  refuse_inside_own_callback("restart");
  SpinLockHold lock(lock_);
  gate_.block_while(lock, [&] { return gate_.restarting(); });
  gate_.check_not_closed();
  if (generation <= generation_)
    fail(ErrorKind::OldGenerationHandle, "restart to generation {} refused: it must be greater than the current {}",
         generation, generation_);
  quiesce_and_free_all(lock, "restart");
  generation_ = generation;
  gate_.mend();
  ++restarts_;
  if (trace_.on()) [[unlikely]]
    trace_.memory(TraceKind::Restart, generation_, 0, 0);
  gate_.set(BridgeGate::kRestarting, false);
  gate_.notify();
}

void BridgeCore::close() {
  refuse_inside_own_callback("close");
  SpinLockHold lock(lock_);
  gate_.block_while(lock, [&] { return gate_.restarting(); });
  if (gate_.closed() && released_at_close_) return;
  // Closed first: every call blocked in the bridge (a wait, a waiting view,
  // a wait for room) and every later one fails with Closed from now on.
  gate_.set(BridgeGate::kClosed, true);
  gate_.notify();
  quiesce_and_free_all(lock, "close");
  settle_fences(lock, "the bridge closed");
  // What the settled fences freed went to the pool: nothing allocates any more.
  give_back_cache(lock);
  backend_->stop_queues();
  if (host_leases_ == 0)
    backend_->free_host(ring_.block());
  else
    leased_ring_ = ring_.block();  // the last host lease frees it
  ring_ = HostRing();
  released_at_close_ = true;
  if (trace_.on()) [[unlikely]]
    trace_.memory(TraceKind::Close, generation_, 0, 0);
  gate_.set(BridgeGate::kRestarting, false);
  gate_.notify();
}

BridgeStats BridgeCore::stats() {
  std::lock_guard guard(lock_);
  // Not while a restart or close is under way (it settles the fences itself);
  // after a close that finished, a lease ended on a consumer's stream holds
  // its memory by a fence no other call would look at again: this one does.
  if (gate_.fences_pending() && !gate_.restarting() && (!gate_.closed() || released_at_close_)) reap_fences();
  BridgeStats s;
  s.pending_fences = drops_.size();
  s.abandoned_fences = abandoned_fences_;
  s.generation = generation_;
  s.domain = domain_;
  s.broken = gate_.broken();
  s.closed = gate_.closed();
  allocations_.fill(s);
  copies_.fill(s);
  s.active_steps = steps_.size();
  s.restarts = restarts_;
  regions_.fill(s);
  s.ring_capacity = ring_.capacity();
  s.ring_used = ring_.used();
  s.ring_reservations = ring_.reservations();
  s.ring_releases_pending = release_after_.size();
  s.ring_wraps = ring_.wraps();
  return s;
}

Generation BridgeCore::generation() {
  std::lock_guard guard(lock_);
  return generation_;
}

}  // namespace devbridge::detail
