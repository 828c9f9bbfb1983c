// View leases on their own: who holds the views handed on, the message
// that names them, and the checks that shape a view.
#include "core/view_leases.hpp"

#include <gtest/gtest.h>

#include "support.hpp"

namespace devbridge::detail {
namespace {

constexpr std::uint64_t kId = 0x100000002;

bool contains(const std::string& text, std::string_view part) { return text.find(part) != std::string::npos; }

TEST(ViewHolders, ViewsNobodyHandedOnAreTheCallers) {
  ViewHolders holders;
  EXPECT_EQ(holders.views_text(kId, 0), "0 live views");
  const auto text = holders.views_text(kId, 1);
  EXPECT_TRUE(contains(text, "1 live view held by the caller")) << text;
}

TEST(ViewHolders, HandedOnViewsAreNamedByHolderWithCounts) {
  ViewHolders holders;
  holders.hand_over(kId, ViewHolder::Caller, ViewHolder::DLPackConsumer);
  auto text = holders.views_text(kId, 1);
  EXPECT_TRUE(contains(text, "1 live view held by a DLPack consumer")) << text;
  holders.hand_over(kId, ViewHolder::Caller, ViewHolder::TinygradTensor);
  text = holders.views_text(kId, 3);
  EXPECT_TRUE(contains(text, "3 live views: 1 held by a tinygrad tensor")) << text;
  EXPECT_TRUE(contains(text, ", 1 held by a DLPack consumer")) << text;
  EXPECT_TRUE(contains(text, ", 1 held by the caller")) << text;
  EXPECT_FALSE(contains(holders.views_text(kId + 1, 1), "DLPack")) << "holders are per allocation";
}

TEST(ViewHolders, HandingBackOrOverMovesTheCountAndClearForgetsAll) {
  ViewHolders holders;
  holders.hand_over(kId, ViewHolder::Caller, ViewHolder::DLPackConsumer);
  holders.hand_over(kId, ViewHolder::DLPackConsumer, ViewHolder::TinygradTensor);
  auto text = holders.views_text(kId, 1);
  EXPECT_TRUE(contains(text, "tinygrad")) << text;
  EXPECT_FALSE(contains(text, "DLPack")) << text;
  holders.hand_back(kId, ViewHolder::TinygradTensor);
  holders.hand_back(kId, ViewHolder::TinygradTensor);  // never below zero
  EXPECT_TRUE(contains(holders.views_text(kId, 1), "held by the caller"));
  holders.hand_over(kId, ViewHolder::Caller, ViewHolder::DLPackConsumer);
  holders.clear();
  EXPECT_TRUE(contains(holders.views_text(kId, 1), "held by the caller"));
}

struct ShapeViewTest : ::testing::Test {
  AllocationSlot slot;
  const DeviceHandle h{1, 1, kId};
  const ViewPlacement placement{"CL:1", 4, 1};
  TensorView view;

  void SetUp() override {
    slot.start(ObjectSpec{64, 4, DType::Float32, ShapeKind::Matrix}, 4, DType::Float32, 64,
               DeviceAllocation{0x1000, 64, 0});
  }
  ViewSpec spec(Dims shape, std::uint64_t byte_offset = 0) const {
    ViewSpec s;
    s.dtype = DType::Float32;
    s.shape = shape;
    s.byte_offset = byte_offset;
    return s;
  }
};

TEST_F(ShapeViewTest, ContiguousViewPointsAtTheAllocationOnTheBridgesDevice) {
  view = shape_view(h, spec(Dims{4, 4}), slot, placement);
  EXPECT_EQ(view.data, 0x1000u);
  EXPECT_EQ(view.device, "CL:1");
  EXPECT_EQ(view.dlpack_device_type, 4);
  EXPECT_EQ(view.device_ordinal, 1);
  EXPECT_EQ(view.handle.id, h.id);
  EXPECT_TRUE(view.contiguous());
  EXPECT_FALSE(view.read_only);
}

TEST_F(ShapeViewTest, RankOutsideTheShapeKindIsRefused) {
  const auto message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidTensorView, shape_view(h, spec(Dims{16}), slot,
                                                                                     placement));
  EXPECT_TRUE(contains(message, "matrix, rank 2")) << message;
}

TEST_F(ShapeViewTest, BytesPastTheExtentOrMisalignedOffsetAreRefused) {
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidTensorView, shape_view(h, spec(Dims{4, 4}, 4), slot, placement));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidTensorView, shape_view(h, spec(Dims{2, 2}, 2), slot, placement));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidTensorView, shape_view(h, spec(Dims{0, 2}), slot, placement));
  auto strided = spec(Dims{4, 4});
  strided.strides = Dims{1, 5};
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidTensorView, shape_view(h, strided, slot, placement));
  strided.strides = Dims{1, 4};  // the transpose reaches the same 16 elements
  view = shape_view(h, strided, slot, placement);
  EXPECT_FALSE(view.contiguous());
}

// The row-major fast path decides with one predicate and asks check_view,
// the full check, only to word a refusal: over a grid of ranks, sizes
// (negative, zero, huge), offsets (misaligned, past the extent, near
// UINT64_MAX) and shape kinds, shape_view accepts exactly what check_view
// accepts, with the same strides.
TEST_F(ShapeViewTest, RowMajorFastPathAgreesWithTheFullCheckOnEveryInput) {
  const std::int64_t sizes[] = {-1, 0, 1, 2, 3, 4, 16, 17, INT64_MAX / 2, INT64_MAX};
  const std::uint64_t offsets[] = {0, 2, 4, 8, 60, 64, 68, 1ull << 62, UINT64_MAX - 3};
  const ShapeKind kinds[] = {ShapeKind::Scalar, ShapeKind::Vector, ShapeKind::Matrix, ShapeKind::Tensor};
  int accepted = 0, refused = 0;
  for (const ShapeKind kind : kinds) {
    slot.spec.shape = kind;
    for (int rank = 0; rank <= 3; ++rank) {
      const int combinations = rank == 0 ? 1 : rank == 1 ? 10 : rank == 2 ? 100 : 1000;
      for (int c = 0; c < combinations; ++c) {
        Dims shape;
        for (int i = 0, rest = c; i < rank; ++i, rest /= 10) shape.push_back(sizes[rest % 10]);
        for (const std::uint64_t offset : offsets) {
          const ViewSpec s = spec(shape, offset);
          Dims strides;
          bool full_accepts = true;
          try {
            check_view(h, s, slot, strides);
          } catch (const Error&) {
            full_accepts = false;
          }
          try {
            const TensorView fast = shape_view(h, s, slot, placement);
            EXPECT_TRUE(full_accepts) << "rank " << rank << " case " << c << " offset " << offset;
            EXPECT_EQ(fast.strides, strides);
            ++accepted;
          } catch (const Error& e) {
            EXPECT_FALSE(full_accepts) << "rank " << rank << " case " << c << " offset " << offset;
            EXPECT_EQ(e.kind(), ErrorKind::InvalidTensorView);
            ++refused;
          }
        }
      }
    }
  }
  EXPECT_GT(accepted, 50);
  EXPECT_GT(refused, 1000);
}

}  // namespace
}  // namespace devbridge::detail
