#include "core/device_dtypes.hpp"

#include <fmt/format.h>

#include "core/fail.hpp"

namespace devbridge::detail {

namespace {

// The names of the dtypes `picked` selects, for messages ("none" for none).
template <class Picked>
std::string dtype_names(Picked picked) {
  std::string names;
  for (const auto& info : all_dtypes())
    if (picked(info.dtype)) names += fmt::format("{}{}", names.empty() ? "" : ", ", info.name);
  return names.empty() ? "none" : names;
}

}  // namespace

DeviceDtypes::DeviceDtypes(const BackendInfo& info)
    : device_text_(fmt::format("{} device {} ({})", info.name, info.device_id.empty() ? "0" : info.device_id,
                               info.device_name)) {
  for (DType dtype : info.dtypes) element_sizes_[static_cast<std::uint8_t>(dtype)] = dtype_size(dtype);
  for (DType dtype : info.computed_dtypes()) computed_.set(static_cast<std::uint8_t>(dtype));
}

void DeviceDtypes::fail_not_computed(DType dtype, std::string_view what) const {
  fail(ErrorKind::UnsupportedDType,
       "{} computes in {}: the bridge's {} holds {} but does not compute in it (it computes in: {})", what,
       dtype_info(dtype).name, device_text_, dtype_info(dtype).name,
       dtype_names([&](DType d) { return computes(d); }));
}

void DeviceDtypes::fail_allocation(const ObjectSpec& spec, std::uint64_t extent) const {
  if (!is_power_of_two(spec.alignment))
    fail(ErrorKind::InvalidAlignment, "alignment {} is not a non-zero power of two", spec.alignment);
  const std::uint32_t elem = element_of(spec).first;
  if (elem == 0 && dtype_size(*spec.dtype) != 0) fail_not_held(*spec.dtype, "an allocation");
  fail(ErrorKind::InvalidExtent,
       "extent {} must be non-zero, at most max_extent {}, and a multiple of the alignment {} and of the {} size {}",
       extent, spec.max_extent, spec.alignment, spec_dtype_name(spec), elem);
}

void DeviceDtypes::fail_not_held(DType dtype, std::string_view what) const {
  fail(ErrorKind::UnsupportedDType, "{} of dtype {}: the bridge's {} does not hold {} (it holds: {})", what,
       dtype_info(dtype).name, device_text_, dtype_info(dtype).name,
       dtype_names([&](DType d) { return element_size(d) != 0; }));
}

}  // namespace devbridge::detail
