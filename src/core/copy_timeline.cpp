#include "core/copy_timeline.hpp"

#include <algorithm>
#include <bit>

#include "core/describe.hpp"
#include "core/fail.hpp"
#include "core/log.hpp"

namespace devbridge::detail {

void CopyTimeline::record_failure(std::uint64_t id, Generation generation, ErrorKind kind, std::string message) {
  inflight_bytes_ -= records_[id_slot(id)].bytes;
  records_.retire(id_slot(id));
  ++failed_;
  // The failure log is bounded: memory does not grow with the number of
  // copies that ever failed. The oldest failure is forgotten first; its
  // slot's watermark keeps its event from ever reading as Completed.
  while (failures_.size() >= failure_limit_) forget_oldest_failure(generation);
  failure_order_.push_back(id);
  failures_.emplace(id, FailedCopy{kind, false, std::move(message)});
  ++unobserved_failures_;
}

void CopyTimeline::forget_oldest_failure(Generation generation) {
  const auto id = failure_order_.front();
  failure_order_.pop_front();
  auto it = failures_.find(id);
  if (!it->second.observed) {
    --unobserved_failures_;
    ++failures_evicted_;
  }
  // Logged at the 1st, 2nd, 4th, 8th... eviction: a storm of failures
  // must not become a storm of log lines.
  if (!it->second.observed && std::has_single_bit(failures_evicted_)) {
    log().warn("devbridge: forgot the unobserved failure of {} ({}: {}): more than {} failed copies are "
               "remembered; {} forgotten unobserved so far",
               describe(CopyEvent{domain_, generation, id}), kind_name(it->second.kind), it->second.message,
               failure_limit_, failures_evicted_);
  }
  auto& slot = records_[id_slot(id)];
  slot.forgotten_failure_version = std::max(slot.forgotten_failure_version, id_version(id));
  failures_.erase(it);
}

CopyStatus CopyTimeline::observe(const CopyEvent& e) {
  FailedCopy* failure = nullptr;
  const auto copy_state = state(e, &failure);
  if (copy_state != CopyState::Failed) return CopyStatus{copy_state, std::nullopt, {}};
  if (!failure->observed) {
    failure->observed = true;
    --unobserved_failures_;
  }
  return CopyStatus{copy_state, failure->kind, failure->message};
}

void CopyTimeline::restart() noexcept {
  records_ = SlotTable<CopySlot>();
  failures_.clear();
  failure_order_.clear();
  unobserved_failures_ = 0;
  sync_issued_ = 0;
  inflight_bytes_ = 0;
}

void CopyTimeline::fill(BridgeStats& s) const noexcept {
  s.copies_submitted = submitted_;
  s.copies_completed = completed_;
  s.copies_failed = failed_;
  s.copies_in_flight = records_.live();
  s.copy_records = records_.live() + unobserved_failures_;
  s.failed_records = failures_.size();
  s.failed_records_evicted = failures_evicted_;
  s.inflight_bytes = inflight_bytes_;
  s.inflight_budget_bytes = inflight_budget_;
  s.stale_completions = stale_;
}

void CopyTimeline::fail_never_issued(const CopyEvent& e) const {
  detail::fail(ErrorKind::UnknownDeviceHandle, "{} was never issued by this bridge in generation {}", describe(e),
                  e.generation);
}

void CopyTimeline::fail_forgotten(const CopyEvent& e) const {
  detail::fail(ErrorKind::UnknownDeviceHandle,
                  "the outcome of {} is no longer known: a failure of a copy in its slot was forgotten (more than {} "
                  "failed copies were remembered), so it may have failed",
                  describe(e), failure_limit_);
}

void CopyTimeline::ignore_stale(const Completion& c, std::uint64_t domain, Generation generation) {
  ++stale_;
  const std::string why =
      c.event.domain != domain           ? fmt::format("another bridge's (this is domain {})", domain)
      : c.event.generation != generation ? fmt::format("of generation {}, not this one", c.event.generation)
      : (c.event.id & kSyncEventBit)     ? std::string("a synchronous copy's, which has no completion")
                                         : std::string("no copy in flight has it (completed already, or never issued)");
  log().warn("devbridge: ignored a completion for {} ({}): {}; {} stale completions so far", describe(c.event),
             c.ok ? "ok" : "failed", why, stale_);
}

}  // namespace devbridge::detail
