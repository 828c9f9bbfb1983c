// View leases: who holds the views of each allocation, and the shape a view
// is given. The count of live leases stays in the allocation's slot (the
// hot path of every view and copy reads it); what is kept here is off that
// path: the views handed on (ViewLease::set_holder) to a DLPack consumer or
// a tinygrad tensor, so that a refusal can say who holds them and what ends
// each, and the checks that turn a ViewSpec into a TensorView.
//
// Not thread-safe: the bridge calls it under its lock. Only the current
// generation's holders are kept: an orphan's holder is never reported.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>

#include "core/allocation_table.hpp"
#include "devbridge/bridge.hpp"

namespace devbridge::detail {

class ViewHolders {
 public:
  // A live view of allocation `id` goes from `from` to `to` (from != to).
  // Without memory for the record only a message loses its detail: the
  // view is then counted as the caller's.
  void hand_over(std::uint64_t id, ViewHolder from, ViewHolder to) noexcept;
  // A view of `id` that `holder` held has ended.
  void hand_back(std::uint64_t id, ViewHolder holder) noexcept;
  // A new generation: no view of the old one is reported any more.
  void clear() noexcept { handed_on_.clear(); }

  // "1 live view held by a tinygrad tensor (...)", "3 live views: 1 held by
  // ..., 2 held by the caller (...)": who holds the `views` live views of
  // `id`, and what ends each.
  std::string views_text(std::uint64_t id, std::uint32_t views) const;

 private:
  static constexpr std::size_t holder_index(ViewHolder holder) { return holder == ViewHolder::DLPackConsumer ? 0 : 1; }

  // Counts of views handed on, by holder_index, by allocation id.
  std::unordered_map<std::uint64_t, std::array<std::uint32_t, 2>> handed_on_;
};

// Where the bridge's views point: the consumers' names for its device.
struct ViewPlacement {
  std::string_view device;  // the bridge's, alive as long as it is
  int dlpack_device_type = 0;
  int device_ordinal = 0;
};

// Fills `view` (the lease's own storage) with a view of `h` as `spec` asks,
// once its rank fits the allocation's shape kind and its shape and strides
// reach only bytes inside the extent (InvalidTensorView otherwise). The
// dtype is the caller's to check first.
void shape_view(const DeviceHandle& h, const ViewSpec& spec, const AllocationSlot& slot,
                const ViewPlacement& placement, TensorView& view);

}  // namespace devbridge::detail
