// What the device holds and computes in, on its own: element sizes, the
// compute check, and refusals that name the device and what it does hold.
#include "core/device_dtypes.hpp"

#include <gtest/gtest.h>

#include "support.hpp"

namespace devbridge::detail {
namespace {

BackendInfo info_holding(std::vector<DType> held, std::vector<DType> computed) {
  BackendInfo info;
  info.name = "fake";
  info.device_id = "3";
  info.device_name = "scripted";
  info.dtypes = std::move(held);
  info.compute_dtypes = std::move(computed);
  return info;
}

bool contains(const std::string& text, std::string_view part) { return text.find(part) != std::string::npos; }

TEST(DeviceDtypes, HeldDtypesHaveTheirSizeOthersZero) {
  const DeviceDtypes dtypes(info_holding({DType::Float32, DType::UInt8}, {}));
  EXPECT_EQ(dtypes.element_size(DType::Float32), 4u);
  EXPECT_EQ(dtypes.element_size(DType::UInt8), 1u);
  EXPECT_EQ(dtypes.element_size(DType::Float64), 0u);
  EXPECT_EQ(dtypes.element_size(static_cast<DType>(250)), 0u) << "a value that is no dtype";
}

TEST(DeviceDtypes, WithoutComputeDtypesTheDeviceComputesInWhatItHolds) {
  const DeviceDtypes dtypes(info_holding({DType::Float32}, {}));
  EXPECT_TRUE(dtypes.computes(DType::Float32));
  dtypes.require_compute(DType::Float32, "axpy");
}

TEST(DeviceDtypes, HoldingIsNotComputingAndTheRefusalSaysWhatItComputesIn) {
  const DeviceDtypes dtypes(info_holding({DType::Float32, DType::Float64}, {DType::Float32}));
  EXPECT_FALSE(dtypes.computes(DType::Float64));
  const auto message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnsupportedDType,
                                              dtypes.require_compute(DType::Float64, "axpy"));
  EXPECT_TRUE(contains(message, "fake device 3 (scripted)")) << message;
  EXPECT_TRUE(contains(message, "it computes in: float32")) << message;
}

TEST(DeviceDtypes, NotHeldRefusalNamesWhatTheDeviceHolds) {
  const DeviceDtypes dtypes(info_holding({DType::Float32, DType::UInt8}, {}));
  const auto message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnsupportedDType,
                                              dtypes.fail_not_held(DType::Float64, "an allocation"));
  EXPECT_TRUE(contains(message, "an allocation of dtype float64")) << message;
  EXPECT_TRUE(contains(message, "it holds: ")) << message;
  EXPECT_TRUE(contains(message, "float32")) << message;
  EXPECT_TRUE(contains(message, "uint8")) << message;
  const DeviceDtypes none(info_holding({}, {}));
  EXPECT_TRUE(contains(EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnsupportedDType, none.fail_not_held(DType::UInt8, "a view")),
                       "it holds: none"));
}

TEST(DeviceDtypes, AnAllocationRequestIsCheckedBeforeAnythingIsAsked) {
  const DeviceDtypes dtypes(info_holding({DType::Float32, DType::UInt8}, {}));
  const ObjectSpec floats{1024, 16, DType::Float32};
  EXPECT_EQ(dtypes.checked_allocation(floats, 64), (std::pair<std::uint32_t, DType>{4, DType::Float32}));
  const ObjectSpec bytes{1024, 16, std::nullopt};
  EXPECT_EQ(dtypes.checked_allocation(bytes, 48), (std::pair<std::uint32_t, DType>{1, DType::UInt8}))
      << "untyped: byte elements, uint8 views";
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidAlignment, dtypes.checked_allocation(ObjectSpec{1024, 12, DType::Float32}, 48));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidAlignment, dtypes.checked_allocation(ObjectSpec{1024, 0, DType::Float32}, 48));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidExtent, dtypes.checked_allocation(floats, 0));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidExtent, dtypes.checked_allocation(floats, 1040));  // past max_extent
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidExtent, dtypes.checked_allocation(floats, 40));  // not a multiple of 16
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnsupportedDType,
                         dtypes.checked_allocation(ObjectSpec{1024, 16, DType::Float64}, 64));
  // Extents whose low 32 bits are zero are no multiple of a size of 0: a
  // dtype the device does not hold is refused at every extent.
  for (const std::uint64_t extent : {std::uint64_t{1} << 32, std::uint64_t{1} << 40, std::uint64_t{1} << 63})
    EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnsupportedDType,
                           dtypes.checked_allocation(ObjectSpec{UINT64_MAX, 16, DType::Float64}, extent));
  // A value that is no dtype is named as such (it was read past the dtype table).
  const auto message = EXPECT_DEVBRIDGE_ERROR(
      ErrorKind::InvalidExtent, dtypes.checked_allocation(ObjectSpec{UINT64_MAX, 16, static_cast<DType>(250)}, 64));
  EXPECT_TRUE(contains(message, "not a dtype size 0")) << message;
}

}  // namespace
}  // namespace devbridge::detail
