// Ring ranges handed to Bridge::release_host_after: each goes back to the
// ring once its copy event has settled (completed or failed) and no copy
// pins the range any more. The one release-after-completion mechanism of the
// core: the bridge runs it whenever a drain applies completions (a
// reservation drains before it looks for room); only a completion settles an
// event or unpins a range, so a drain that applied none skips the scan.
//
// Each entry keeps the reservation's key (HostRing::Key, never reused), so a
// range released by hand meanwhile, and perhaps reserved again, is dropped
// rather than released a second time.
//
// Not thread-safe: the bridge calls it under its lock.
#pragma once

#include <cstddef>
#include <vector>

#include "core/host_ring.hpp"
#include "devbridge/types.hpp"

namespace devbridge::detail {

class ReleaseAfter {
 public:
  struct Entry {
    HostRange range;
    HostRing::Key key;
    CopyEvent event;
  };

  bool empty() const noexcept { return entries_.empty(); }
  std::size_t size() const noexcept { return entries_.size(); }
  bool holds(HostRing::Key key) const noexcept {
    for (const auto& e : entries_)
      if (e.key == key) return true;
    return false;
  }
  void add(const Entry& entry) { entries_.push_back(entry); }

  // Releases every range whose event `settled(event)` says is done and that
  // no copy pins; drops those released already by someone else. Returns how
  // many went back to the ring.
  template <class Settled>
  std::size_t release_settled(HostRing& ring, Settled&& settled) noexcept {
    std::size_t released = 0;
    std::erase_if(entries_, [&](const Entry& e) {
      if (!settled(e.event)) return false;
      switch (ring.release(e.key, e.range)) {
        case HostRing::KeyRelease::Released: ++released; return true;
        case HostRing::KeyRelease::Gone: return true;
        case HostRing::KeyRelease::Pinned: return false;  // another copy still uses it
      }
      return false;
    });
    return released;
  }

  // Restart, with the device idle and the ring unpinned: every range goes
  // back (its copy is over, whatever its event says).
  std::size_t release_all(HostRing& ring) noexcept {
    return release_settled(ring, [](const CopyEvent&) { return true; });
  }

  // Close: the ring itself goes; nothing to release.
  void clear() noexcept { entries_.clear(); }

 private:
  std::vector<Entry> entries_;
};

}  // namespace devbridge::detail
