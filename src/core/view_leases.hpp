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

#include <algorithm>
#include <array>
#include <climits>
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

// The rank an object's shape kind allows: scalar 0, vector 1, matrix 2,
// tensor any (the contract's "rank/shape kind"). The kinds below Tensor are
// numbered by their rank: one compare.
static_assert(static_cast<int>(ShapeKind::Scalar) == 0 && static_cast<int>(ShapeKind::Vector) == 1 &&
              static_cast<int>(ShapeKind::Matrix) == 2);
inline bool rank_fits(ShapeKind kind, int rank) noexcept {
  return kind == ShapeKind::Tensor || rank == static_cast<int>(kind);
}

// Checks a view of `h` as `spec` asks, in full: its rank fits the
// allocation's shape kind, its offset is aligned to its dtype, and its shape
// and strides reach only bytes inside the extent. Throws InvalidTensorView
// naming what is wrong; otherwise leaves the view's element strides (given
// or row-major) in `strides`. The dtype is the caller's to check first.
void check_view(const DeviceHandle& h, const ViewSpec& spec, const AllocationSlot& slot, Dims& strides);

// A view of `h` as `spec` asks, built in place in the caller's storage (the
// lease's: no copy on the hot path). A row-major view, the usual one, is
// checked here by one predicate; a strided one, or a refusal (for its
// message), goes through check_view.
[[gnu::always_inline]] inline TensorView shape_view(const DeviceHandle& h, const ViewSpec& spec,
                                                    const AllocationSlot& slot, const ViewPlacement& placement) {
  TensorView view{slot.device.address, placement.device, placement.dlpack_device_type, placement.device_ordinal,
                  spec.dtype, spec.shape, Dims{}, spec.byte_offset, h, slot.read_only()};
  if (__builtin_expect(spec.strides.has_value(), 0)) {
    check_view(h, spec, slot, view.strides);
    return view;
  }
  // Row-major: elements [0, count) from byte_offset, so only the end can
  // overflow. The byte offset is clamped as check_view clamps it.
  const std::int64_t count = view.strides.assign_contiguous_strides(spec.shape);
  const auto elem = static_cast<std::int64_t>(dtype_size(spec.dtype));
  const auto offset = static_cast<std::int64_t>(std::min<std::uint64_t>(spec.byte_offset, INT64_MAX / 2));
  const int rank = spec.shape.size();
  bool fits = rank_fits(slot.spec.shape, rank) && !(spec.byte_offset & static_cast<std::uint64_t>(elem - 1));
  for (int i = 0; i < rank; ++i) fits &= spec.shape[i] > 0;
  std::int64_t end_byte;
  fits &= !__builtin_mul_overflow(count, elem, &end_byte) && !__builtin_add_overflow(end_byte, offset, &end_byte) &&
          static_cast<std::uint64_t>(end_byte) <= slot.extent;
  if (__builtin_expect(!fits, 0)) check_view(h, spec, slot, view.strides);  // throws, saying why
  return view;
}

}  // namespace devbridge::detail
