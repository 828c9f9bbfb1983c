#include "core/view_leases.hpp"

#include <algorithm>
#include <new>
#include <utility>

#include <fmt/format.h>

namespace devbridge::detail {

void ViewHolders::hand_over(std::uint64_t id, ViewHolder from, ViewHolder to) noexcept {
  if (from != ViewHolder::Caller) hand_back(id, from);
  if (to == ViewHolder::Caller) return;
  try {
    ++handed_on_[id][holder_index(to)];
  } catch (const std::bad_alloc&) {
    // Only a message loses its detail: the view is then counted as the caller's.
  }
}

void ViewHolders::hand_back(std::uint64_t id, ViewHolder holder) noexcept {
  auto it = handed_on_.find(id);
  if (it == handed_on_.end()) return;
  auto& count = it->second[holder_index(holder)];
  if (count) --count;
  if (it->second[0] == 0 && it->second[1] == 0) handed_on_.erase(it);
}

std::string ViewHolders::views_text(std::uint64_t id, std::uint32_t views) const {
  std::string text = fmt::format("{} live view{}", views, views == 1 ? "" : "s");
  if (views == 0) return text;
  const auto handed = handed_on_.find(id);
  const std::uint32_t dlpack = handed == handed_on_.end() ? 0 : handed->second[0];
  const std::uint32_t tinygrad = handed == handed_on_.end() ? 0 : handed->second[1];
  const std::uint32_t caller = views - std::min(views, dlpack + tinygrad);
  const std::pair<std::uint32_t, std::string_view> holders[] = {
      {tinygrad, "held by a tinygrad tensor (a lazy graph or .grad may still read it; opt.zero_grad() or del "
                 "releases it)"},
      {dlpack, "held by a DLPack consumer (a numpy, jax, torch or cupy array; del releases it)"},
      {caller, "held by the caller (ending the view releases it: close() or a with-block's end in Python, "
               "the lease's destructor in C++, devbridge_view_end in C)"},
  };
  const auto kinds = std::ranges::count_if(holders, [](const auto& holder) { return holder.first != 0; });
  for (const auto& [n, who] : holders) {
    if (n == 0) continue;
    if (kinds == 1) text += fmt::format(" {}", who);
    else text += fmt::format("{}{} {}", text.find(':') == std::string::npos ? ": " : ", ", n, who);
  }
  return text;
}

namespace {

// "tensor, any rank", "matrix, rank 2": a kind with the ranks it allows.
std::string shape_kind_text(ShapeKind kind) {
  if (kind == ShapeKind::Tensor) return "tensor, any rank";
  return fmt::format("{}, rank {}", shape_kind_name(kind), static_cast<int>(kind));
}

template <class... Args>
[[noreturn, gnu::cold, gnu::noinline]] void fail_view(const DeviceHandle& h, const AllocationSlot& slot,
                                                      fmt::format_string<Args...> why, Args&&... args) {
  fail(ErrorKind::InvalidTensorView, "view of {} ({} bytes): {}", describe(h), slot.extent,
       fmt::format(why, std::forward<Args>(args)...));
}


// The bytes a refused view reaches, from what the caller gave (the checks
// work on an offset clamped to keep their arithmetic in 64 bits, and on an
// element count that saturates: neither may reach the message).
[[noreturn, gnu::cold, gnu::noinline]] void fail_reach(const DeviceHandle& h, const AllocationSlot& slot,
                                                       const ViewSpec& spec, std::int64_t lowest,
                                                       std::int64_t highest) {
  using Wide = __int128;
  constexpr Wide kPast = Wide{1} << 100;  // past any 64-bit extent: stop multiplying
  const Wide elem = dtype_size(spec.dtype);
  Wide first = Wide{lowest} * elem, end = (Wide{highest} + 1) * elem;
  if (!spec.strides) {
    Wide count = 1;
    for (int i = 0; i < spec.shape.size(); ++i) count = std::min(count * spec.shape[i], kPast);
    first = 0;
    end = count * elem;
  }
  first += spec.byte_offset;
  end += spec.byte_offset;
  const auto text = [](Wide bytes) {
    return bytes >= (Wide{1} << 64) ? std::string("past 2^64") : fmt::format("{}", static_cast<std::uint64_t>(bytes));
  };
  if (first < 0)
    fail_view(h, slot, "shape and strides reach {} bytes before the allocation's start (byte offset {})",
              text(-first), spec.byte_offset);
  fail_view(h, slot, "shape and strides reach bytes [{}, {}) outside the extent (byte offset {})", text(first),
            text(end), spec.byte_offset);
}

}  // namespace

void check_view(const DeviceHandle& h, const ViewSpec& spec, const AllocationSlot& slot, Dims& strides) {
  if (__builtin_expect(!rank_fits(slot.spec.shape, spec.shape.size()), 0))
    fail_view(h, slot, "rank {} does not fit the object's shape kind ({})", spec.shape.size(),
              shape_kind_text(slot.spec.shape));
  const std::int64_t elem = dtype_size(spec.dtype);
  if (spec.byte_offset & (elem - 1))
    fail_view(h, slot, "byte offset {} is not a multiple of {}", spec.byte_offset, elem);
  const auto offset = static_cast<std::int64_t>(std::min<std::uint64_t>(spec.byte_offset, INT64_MAX / 2));
  // Lowest and highest element reached, relative to byte_offset, without overflow.
  std::int64_t lowest = 0, highest = 0;
  if (!spec.strides) {
    // Row-major (the usual view): it reaches elements [0, count), so bytes
    // [offset, offset + count * elem), and only the end can overflow (the
    // general checks below, specialized: the view path's most arithmetic).
    const std::int64_t count = strides.assign_contiguous_strides(spec.shape);
    for (int i = 0; i < spec.shape.size(); ++i)
      if (spec.shape[i] <= 0) fail_view(h, slot, "dimension {} has size {}", i, spec.shape[i]);
    std::int64_t end_byte;
    if (__builtin_mul_overflow(count, elem, &end_byte) || __builtin_add_overflow(end_byte, offset, &end_byte))
      fail_view(h, slot, "extent overflow");
    if (static_cast<std::uint64_t>(end_byte) > slot.extent) fail_reach(h, slot, spec, 0, 0);
    return;
  } else {
    strides = *spec.strides;
    if (strides.size() != spec.shape.size())
      fail_view(h, slot, "{} strides for {} dimensions", strides.size(), spec.shape.size());
    for (int i = 0; i < spec.shape.size(); ++i) {
      const auto n = spec.shape[i];
      if (n <= 0) fail_view(h, slot, "dimension {} has size {}", i, n);
      std::int64_t reach;
      if (__builtin_mul_overflow(n - 1, strides[i], &reach)) fail_view(h, slot, "strides overflow");
      if ((reach > 0 ? __builtin_add_overflow(highest, reach, &highest)
                     : __builtin_add_overflow(lowest, reach, &lowest)))
        fail_view(h, slot, "strides overflow");
    }
  }
  std::int64_t first_byte, end_element, end_byte;
  if (__builtin_mul_overflow(lowest, elem, &first_byte) || __builtin_add_overflow(first_byte, offset, &first_byte) ||
      __builtin_add_overflow(highest, 1, &end_element) || __builtin_mul_overflow(end_element, elem, &end_byte) ||
      __builtin_add_overflow(end_byte, offset, &end_byte))
    fail_view(h, slot, "extent overflow");
  if (first_byte < 0 || static_cast<std::uint64_t>(end_byte) > slot.extent) fail_reach(h, slot, spec, lowest, highest);
}

}  // namespace devbridge::detail
