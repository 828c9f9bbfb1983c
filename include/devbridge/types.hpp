// Value types shared by the bridge, the backend seam and the bindings.
// Nothing here allocates on the heap: views and ranges are built on hot paths.
#pragma once

#include <array>
#include <compare>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "devbridge/error.hpp"

namespace devbridge {

// ---- dtypes ---------------------------------------------------------------

enum class DType : std::uint8_t {
  Bool,
  Int8,
  Int16,
  Int32,
  Int64,
  UInt8,
  UInt16,
  UInt32,
  UInt64,
  Float16,
  BFloat16,
  Float32,
  Float64,
  Fp8E4M3,
  Fp8E5M2,
};

inline constexpr int kDTypeCount = static_cast<int>(DType::Fp8E5M2) + 1;

// DLPack type codes (dlpack.h kDLInt/kDLUInt/kDLFloat/kDLBfloat/kDLBool, and
// the float8 codes of DLPack 1.1), kept here so no DLPack header is needed
// above the bindings.
enum class DLPackTypeCode : std::uint8_t {
  Int = 0,
  UInt = 1,
  Float = 2,
  BFloat = 4,
  Bool = 6,
  Float8E4M3FN = 10,
  Float8E5M2 = 12,
};

struct DTypeInfo {
  DType dtype;
  std::string_view name;           // numpy/tinygrad spelling: "float32", "bfloat16", ...
  std::string_view tinygrad_name;  // attribute of tinygrad.dtypes: "float32", "fp8e4m3", ...
  std::uint32_t size;              // bytes per element
  DLPackTypeCode dlpack_code;
  std::uint8_t dlpack_bits;
};

// A value that is no dtype gets an entry named "not a dtype", of size 0.
const DTypeInfo& dtype_info(DType dtype) noexcept;
constexpr std::uint32_t dtype_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::Bool:
    case DType::Int8:
    case DType::UInt8:
    case DType::Fp8E4M3:
    case DType::Fp8E5M2:
      return 1;
    case DType::Int16:
    case DType::UInt16:
    case DType::Float16:
    case DType::BFloat16:
      return 2;
    case DType::Int32:
    case DType::UInt32:
    case DType::Float32:
      return 4;
    case DType::Int64:
    case DType::UInt64:
    case DType::Float64:
      return 8;
  }
  return 0;
}
// Accepts the numpy/tinygrad names and common aliases ("half", "float", "fp8e4m3", ...).
std::optional<DType> dtype_from_name(std::string_view name) noexcept;
std::span<const DTypeInfo> all_dtypes() noexcept;

// std::has_single_bit compiles to a call into libgcc (__popcountdi2) unless
// the target has POPCNT; this is two instructions on every target, and it
// runs on every allocation.
constexpr bool is_power_of_two(std::uint64_t value) noexcept { return value != 0 && (value & (value - 1)) == 0; }

// ---- identity ---------------------------------------------------------------

using Generation = std::uint64_t;
using StepId = std::uint64_t;

// {domain, generation, id}. Ids are unique inside a domain and generation;
// the domain is unique per Bridge instance in the process.
struct DeviceHandle {
  std::uint64_t domain = 0;
  Generation generation = 0;
  std::uint64_t id = 0;
  friend constexpr auto operator<=>(const DeviceHandle&, const DeviceHandle&) = default;
};
// A handle as every message spells it, the bridge's and the C ABI's alike
// ("handle {domain D, generation G, id 0x...}"), so a user can grep a log.
std::string to_string(const DeviceHandle& handle);

// Tagged exactly like a handle so a stale event never reads as a new copy.
struct CopyEvent {
  std::uint64_t domain = 0;
  Generation generation = 0;
  std::uint64_t id = 0;
  friend constexpr auto operator<=>(const CopyEvent&, const CopyEvent&) = default;
};

// ---- specs and ranges -------------------------------------------------------

enum class ShapeKind : std::uint8_t { Scalar, Vector, Matrix, Tensor };
// "scalar", "vector", "matrix", "tensor".
std::string_view shape_kind_name(ShapeKind kind) noexcept;

struct ObjectSpec {
  std::uint64_t max_extent = 0;
  std::uint64_t alignment = 0;
  // The dtype every view of the allocation has. None: untyped bytes ("bytes"
  // in Python): views of any dtype may share it at byte offsets aligned to
  // their dtype, so one allocation can hold a batch's images and its labels.
  std::optional<DType> dtype = DType::UInt8;
  ShapeKind shape = ShapeKind::Tensor;
};

// The name of a spec's dtype; "bytes" when it is untyped.
std::string_view spec_dtype_name(const ObjectSpec& spec) noexcept;
// The unit device ranges into the allocation are aligned to: the dtype's
// size, 1 when untyped.
constexpr std::uint32_t spec_element_size(const ObjectSpec& spec) noexcept {
  return spec.dtype ? dtype_size(*spec.dtype) : 1;
}

// Offsets are into the host ring's block.
struct HostRange {
  std::uint64_t offset = 0;
  std::uint64_t len = 0;
  friend constexpr bool operator==(const HostRange&, const HostRange&) = default;
};

struct DeviceRange {
  DeviceHandle handle;
  std::uint64_t offset = 0;
  std::uint64_t len = 0;
  friend constexpr bool operator==(const DeviceRange&, const DeviceRange&) = default;
};

// Host memory of the caller's (a numpy array, an mmap) registered with the
// bridge as a second staging source beside the ring (Bridge::register_host).
// Tagged like a handle: refused after a restart or unregister.
struct HostRegion {
  std::uint64_t domain = 0;
  Generation generation = 0;
  std::uint64_t id = 0;
  friend constexpr auto operator<=>(const HostRegion&, const HostRegion&) = default;
};

// Bytes [offset, offset + len) of a registered region.
struct RegionRange {
  HostRegion region;
  std::uint64_t offset = 0;
  std::uint64_t len = 0;
  friend constexpr bool operator==(const RegionRange&, const RegionRange&) = default;
};

// A pitched 2-D copy: `rows` rows of `row_bytes` each, row i at byte
// i * host_pitch of the host range and i * device_pitch of the device range.
// The bytes between rows (the padding) are never touched. rows == 0 is the
// plain copy of one contiguous run. Build one with pitched_layout (it checks
// what a caller gives); a hand-made one is checked by the copy.
struct CopyLayout {
  std::uint64_t rows = 0;
  std::uint64_t row_bytes = 0;
  std::uint64_t host_pitch = 0;
  std::uint64_t device_pitch = 0;
  bool pitched() const noexcept { return rows != 0; }
  friend constexpr bool operator==(const CopyLayout&, const CopyLayout&) = default;
};

// The layout of a copy between a strided host array and a device tensor,
// computed once from the array's shape, its byte strides and its element
// size. Leading dimensions that are contiguous over the rows fold into them;
// anything else is not pitched row-major and is InvalidRange naming the
// dimension and why (a negative or overlapping stride, elements not adjacent
// within a row). `device_pitch` 0 packs the rows on the device.
CopyLayout pitched_layout(std::span<const std::int64_t> shape, std::span<const std::int64_t> byte_strides,
                          std::uint64_t element_size, std::uint64_t device_pitch = 0);

// Bytes a layout reaches from its start on one side: (rows - 1) * pitch +
// row_bytes; InvalidRange when that does not fit in 64 bits or a pitch is
// shorter than a row (the rows would overlap). bytes_moved: rows * row_bytes.
std::uint64_t layout_host_span(const CopyLayout& layout);
std::uint64_t layout_device_span(const CopyLayout& layout);
std::uint64_t layout_bytes_moved(const CopyLayout& layout);

enum class CopyMode : std::uint8_t { Sync, Async };
enum class CopyDirection : std::uint8_t { HostToDevice, DeviceToHost };

// ---- devices ----------------------------------------------------------------

// What a backend's memory is, in the backend's own terms; with its ordinal
// (BackendInfo::device_ordinal), all a backend says about its device.
// Consumers name it their own way, and those names live in one adapter
// (consumer_names.hpp), so a consumer's spelling never reaches a backend.
enum class DeviceKind : std::uint8_t { Cpu, Cuda, OpenCL };

// ---- tensor shapes ----------------------------------------------------------

inline constexpr int kMaxRank = 8;

// A fixed-capacity list of dimensions (sizes or element strides). Views are
// built on hot paths, so construction leaves unused capacity unset (zero-
// filling it measurably slowed them) and copies are plain object copies (a
// few vector moves; a loop over size() became a call to memmove). Only the
// first size() values are ever read.
class Dims {
 public:
  constexpr Dims() noexcept {}
  constexpr Dims(std::initializer_list<std::int64_t> values) {
    for (auto v : values) push_back(v);
  }
  explicit Dims(std::span<const std::int64_t> values);

  constexpr int size() const noexcept { return rank_; }
  constexpr bool empty() const noexcept { return rank_ == 0; }
  constexpr std::int64_t operator[](int i) const noexcept { return values_[i]; }
  constexpr std::int64_t& operator[](int i) noexcept { return values_[i]; }
  constexpr const std::int64_t* data() const noexcept { return values_; }
  constexpr const std::int64_t* begin() const noexcept { return values_; }
  constexpr const std::int64_t* end() const noexcept { return values_ + rank_; }
  // Throws InvalidTensorView past kMaxRank.
  void push_back(std::int64_t v) {
    if (rank_ >= kMaxRank) throw_rank_exceeded();
    values_[rank_++] = v;
  }
  // Becomes the row-major element strides of `shape`, in place (built where
  // they are needed, they are read back without a store-forwarding stall),
  // and returns the number of elements. Saturates at INT64_MAX instead of
  // overflowing (UB) on absurd shapes; those then fail every extent check.
  constexpr std::int64_t assign_contiguous_strides(const Dims& shape) noexcept {
    std::int64_t stride = 1;
    for (int i = shape.size() - 1; i >= 0; --i) {
      values_[i] = stride;
      if (__builtin_mul_overflow(stride, shape[i], &stride)) stride = INT64_MAX;
    }
    rank_ = shape.size();
    return stride;
  }
  friend bool operator==(const Dims& a, const Dims& b) noexcept;

 private:
  [[noreturn]] static void throw_rank_exceeded();
  std::int64_t values_[kMaxRank];
  int rank_ = 0;
};

// Row-major element strides for a shape.
constexpr Dims contiguous_strides(const Dims& shape) noexcept {
  Dims strides;
  strides.assign_contiguous_strides(shape);
  return strides;
}

// What a caller asks a view to look like. Strides are in elements (as in
// DLPack); absent strides mean row-major contiguous.
struct ViewSpec {
  DType dtype = DType::UInt8;
  Dims shape;
  std::optional<Dims> strides{};
  std::uint64_t byte_offset = 0;
};

// A zero-copy view over a live allocation. `data` is the device address of the
// allocation (the view starts at data + byte_offset, as DLPack's data/byte_offset).
struct TensorView {
  std::uint64_t data = 0;
  // How consumers name the device (consumer_names.hpp): tinygrad's device
  // ("CPU", "CUDA:0", "CL", ...) and a DLPackDevice.
  std::string_view device;
  int dlpack_device_type = 0;
  int device_ordinal = 0;
  DType dtype = DType::UInt8;
  Dims shape;
  Dims strides;  // elements
  std::uint64_t byte_offset = 0;
  DeviceHandle handle;
  // The allocation is host memory adopted read-only (Bridge::adopt_host):
  // a consumer must not write through the view (DLPack's read-only flag).
  bool read_only = false;
  bool contiguous() const noexcept { return strides == contiguous_strides(shape); }
};

}  // namespace devbridge
