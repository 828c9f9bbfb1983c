#include "devbridge/types.hpp"

#include <algorithm>
#include <array>

#include <fmt/format.h>

#include "core/fail.hpp"

namespace devbridge {

namespace {
using enum DLPackTypeCode;
constexpr std::array<DTypeInfo, kDTypeCount> kDTypes = {{
    {DType::Bool, "bool", "bool", 1, Bool, 8},
    {DType::Int8, "int8", "int8", 1, Int, 8},
    {DType::Int16, "int16", "int16", 2, Int, 16},
    {DType::Int32, "int32", "int32", 4, Int, 32},
    {DType::Int64, "int64", "int64", 8, Int, 64},
    {DType::UInt8, "uint8", "uint8", 1, UInt, 8},
    {DType::UInt16, "uint16", "uint16", 2, UInt, 16},
    {DType::UInt32, "uint32", "uint32", 4, UInt, 32},
    {DType::UInt64, "uint64", "uint64", 8, UInt, 64},
    {DType::Float16, "float16", "float16", 2, Float, 16},
    {DType::BFloat16, "bfloat16", "bfloat16", 2, BFloat, 16},
    {DType::Float32, "float32", "float32", 4, Float, 32},
    {DType::Float64, "float64", "float64", 8, Float, 64},
    {DType::Fp8E4M3, "float8_e4m3fn", "fp8e4m3", 1, Float8E4M3FN, 8},
    {DType::Fp8E5M2, "float8_e5m2", "fp8e5m2", 1, Float8E5M2, 8},
}};

// C and tinygrad spellings. Not "float8_e4m3": ml_dtypes (0.5 on) names so
// an IEEE-style format with infinities, not the e4m3fn held here.
struct Alias {
  std::string_view name;
  DType dtype;
};
constexpr std::array<Alias, 11> kAliases = {{
    {"half", DType::Float16},     {"float", DType::Float32},      {"double", DType::Float64},
    {"int", DType::Int32},        {"long", DType::Int64},         {"char", DType::Int8},
    {"uchar", DType::UInt8},      {"short", DType::Int16},        {"fp8e4m3", DType::Fp8E4M3},
    {"fp8e5m2", DType::Fp8E5M2},  {"bool_", DType::Bool},
}};

// Every size above must agree with the constexpr dtype_size() the hot paths use.
constexpr bool sizes_agree() {
  for (const auto& info : kDTypes)
    if (info.size != dtype_size(info.dtype)) return false;
  return true;
}
static_assert(sizes_agree());
}  // namespace

const DTypeInfo& dtype_info(DType dtype) noexcept {
  // A value that is no dtype (a cast in C++, a hostile value through the C
  // ABI) must still be nameable in the refusal that says so.
  static constexpr DTypeInfo kNotADType{static_cast<DType>(0xFF), "not a dtype", "not a dtype", 0, DLPackTypeCode{}, 0};
  const auto index = static_cast<std::size_t>(dtype);
  return index < kDTypes.size() ? kDTypes[index] : kNotADType;
}

std::span<const DTypeInfo> all_dtypes() noexcept { return kDTypes; }

std::optional<DType> dtype_from_name(std::string_view name) noexcept {
  if (name.starts_with("dtypes.")) name.remove_prefix(7);
  for (const auto& info : kDTypes)
    if (info.name == name || info.tinygrad_name == name) return info.dtype;
  for (const auto& alias : kAliases)
    if (alias.name == name) return alias.dtype;
  return std::nullopt;
}

std::string_view shape_kind_name(ShapeKind kind) noexcept {
  switch (kind) {
    case ShapeKind::Scalar: return "scalar";
    case ShapeKind::Vector: return "vector";
    case ShapeKind::Matrix: return "matrix";
    case ShapeKind::Tensor: return "tensor";
  }
  return "tensor";
}

std::string_view spec_dtype_name(const ObjectSpec& spec) noexcept {
  return spec.dtype ? dtype_info(*spec.dtype).name : "bytes";
}

std::string to_string(const DeviceHandle& handle) {
  return fmt::format("handle {{domain {}, generation {}, id {:#x}}}", handle.domain, handle.generation, handle.id);
}

Dims::Dims(std::span<const std::int64_t> values) {
  for (auto v : values) push_back(v);
}

void Dims::throw_rank_exceeded() {
  detail::fail(ErrorKind::InvalidTensorView, "rank exceeds the maximum of {} dimensions", kMaxRank);
}

bool operator==(const Dims& a, const Dims& b) noexcept {
  return a.rank_ == b.rank_ && std::equal(a.begin(), a.end(), b.begin());
}

}  // namespace devbridge
