// pitched_layout: a copy layout from a strided array's shape and byte
// strides, leading dimensions folded into rows where they continue them
// evenly, anything not pitched row-major refused with InvalidRange naming
// why; the spans through checked arithmetic.
#include <gtest/gtest.h>

#include <vector>

#include "support.hpp"

namespace devbridge::testing {
namespace {

CopyLayout layout_of(std::vector<std::int64_t> shape, std::vector<std::int64_t> strides, std::uint64_t elem,
                     std::uint64_t device_pitch = 0) {
  return pitched_layout(shape, strides, elem, device_pitch);
}

TEST(CopyLayout, AWindowOfAMatrixIsItsRowsAtTheMatrixPitch) {
  // a[1:8, 1:6] of a float32 matrix with 9 columns: 7 rows of 5 elements, 36 bytes apart.
  EXPECT_EQ(layout_of({7, 5}, {36, 4}, 4), (CopyLayout{7, 20, 36, 20}));
  EXPECT_EQ(layout_of({7, 5}, {36, 4}, 4, 64), (CopyLayout{7, 20, 36, 64}));
  EXPECT_EQ(layout_host_span(CopyLayout{7, 20, 36, 20}), 6u * 36 + 20);
  EXPECT_EQ(layout_bytes_moved(CopyLayout{7, 20, 36, 20}), 140u);
}

TEST(CopyLayout, LeadingDimensionsFoldIntoRowsOnlyWhereTheyContinueThemEvenly) {
  // (2, 3, 4) float32 from a (2, 3, 5) array: 6 rows of 16 bytes, 20 apart.
  EXPECT_EQ(layout_of({2, 3, 4}, {60, 20, 4}, 4), (CopyLayout{6, 16, 20, 16}));
  // From a (2, 4, 5) array, [:, :3, :4]: the outer stride skips a row.
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, layout_of({2, 3, 4}, {80, 20, 4}, 4));
  // Dimensions of one element carry any stride (numpy leaves them as they were).
  EXPECT_EQ(layout_of({1, 7, 1, 5}, {999, 36, -3, 4}, 4), (CopyLayout{7, 20, 36, 20}));
  EXPECT_EQ(layout_of({}, {}, 8), (CopyLayout{1, 8, 8, 8}));  // a scalar: one row of one element
  EXPECT_EQ(layout_of({5}, {4}, 4), (CopyLayout{1, 20, 20, 20}));
}

TEST(CopyLayout, AnythingNotPitchedRowMajorIsRefusedNamingWhy) {
  const auto message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, layout_of({5, 7}, {4, 20}, 4));  // transposed
  EXPECT_NE(message.find("not adjacent"), std::string::npos) << message;
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, layout_of({7, 5}, {-36, 4}, 4));  // rows backwards
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, layout_of({7, 5}, {12, 4}, 4));   // rows overlap
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, layout_of({7, 5}, {0, 4}, 4));    // a broadcast row
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, layout_of({7, 0}, {36, 4}, 4));   // nothing to copy
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, layout_of({7, 5}, {36}, 4));      // ranks differ
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, layout_of({7, 5}, {36, 4}, 0));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, layout_of({7, 5}, {36, 4}, 4, 16));  // device pitch < row
}

TEST(CopyLayout, SpansThatWouldWrapAreRefused) {
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, layout_of({1ll << 40, 2}, {1ll << 40, 4}, 4));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, layout_host_span(CopyLayout{1ull << 40, 8, 1ull << 40, 8}));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, layout_bytes_moved(CopyLayout{1ull << 40, 1ull << 40, 0, 0}));
  // One row may have any pitch: it is never used.
  EXPECT_EQ(layout_device_span(CopyLayout{1, 8, ~0ull, ~0ull}), 8u);
}

}  // namespace
}  // namespace devbridge::testing
