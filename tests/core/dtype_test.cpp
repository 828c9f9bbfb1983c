// The dtype table: sizes, names and the DLPack codes consumers decode.
#include <gtest/gtest.h>

#include "devbridge/types.hpp"

namespace devbridge {
namespace {

// DLPack 1.1's DLDataTypeCode numbering (dlpack.h). Debian's dlpack.h is 0.6,
// which has no float8 codes, so they are pinned here: jax read float8_e5m2
// as float8_e4m3fnuz (11) until this was 12.
TEST(DTypeTable, DLPackCodesAreDLPack11s) {
  EXPECT_EQ(static_cast<int>(dtype_info(DType::Int32).dlpack_code), 0);
  EXPECT_EQ(static_cast<int>(dtype_info(DType::UInt8).dlpack_code), 1);
  EXPECT_EQ(static_cast<int>(dtype_info(DType::Float16).dlpack_code), 2);
  EXPECT_EQ(static_cast<int>(dtype_info(DType::BFloat16).dlpack_code), 4);
  EXPECT_EQ(static_cast<int>(dtype_info(DType::Bool).dlpack_code), 6);
  EXPECT_EQ(static_cast<int>(dtype_info(DType::Fp8E4M3).dlpack_code), 10);  // kDLFloat8_e4m3fn
  EXPECT_EQ(static_cast<int>(dtype_info(DType::Fp8E5M2).dlpack_code), 12);  // kDLFloat8_e5m2
}

TEST(DTypeTable, EveryDTypeRoundTripsByNameAndSize) {
  for (const DTypeInfo& info : all_dtypes()) {
    EXPECT_EQ(dtype_from_name(info.name), info.dtype) << info.name;
    EXPECT_EQ(dtype_from_name(info.tinygrad_name), info.dtype) << info.tinygrad_name;
    EXPECT_EQ(info.size * 8, info.dlpack_bits) << info.name;
  }
}

TEST(DTypeTable, UntypedSpecsAreBytesOfOneByteElements) {
  const ObjectSpec untyped{4096, 64, std::nullopt, ShapeKind::Tensor};
  EXPECT_EQ(spec_dtype_name(untyped), "bytes");
  EXPECT_EQ(spec_element_size(untyped), 1u);
  const ObjectSpec typed{4096, 64, DType::Float64, ShapeKind::Tensor};
  EXPECT_EQ(spec_dtype_name(typed), "float64");
  EXPECT_EQ(spec_element_size(typed), 8u);
  EXPECT_EQ(shape_kind_name(ShapeKind::Matrix), "matrix");
}

}  // namespace
}  // namespace devbridge
