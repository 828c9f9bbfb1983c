// The checked-in PTX embedded at build time: present, for the documented targets, with
// the kernel the backend looks up, and without fused multiply-adds (results
// must equal the host backend's bit for bit).
#include <gtest/gtest.h>

#include <string>

#include "backends/cuda/cuda_ptx.hpp"

namespace devbridge::cuda::detail {
namespace {

TEST(CudaPtx, ImagesAreEmbeddedInAscendingOrder) {
  const auto images = embedded_ptx();
  ASSERT_FALSE(images.empty());
  int previous = 0;
  for (const PtxImage& image : images) {
    EXPECT_GT(image.compute_capability, previous);
    previous = image.compute_capability;
  }
}

TEST(CudaPtx, EveryImageHoldsTheKernelForItsTarget) {
  for (const PtxImage& image : embedded_ptx()) {
    const std::string text(image.text);
    EXPECT_NE(text.find(".entry " + std::string(kAxpyKernelName)), std::string::npos) << image.compute_capability;
    EXPECT_NE(text.find(".target sm_" + std::to_string(image.compute_capability)), std::string::npos)
        << image.compute_capability;
    EXPECT_NE(text.find("mul.rn.f32"), std::string::npos);
    EXPECT_NE(text.find("add.rn.f32"), std::string::npos);
    EXPECT_EQ(text.find("fma."), std::string::npos) << "the kernel must not fuse multiply and add";
    EXPECT_GE(ptx_isa_version(text), 63);
  }
}

TEST(CudaPtx, HopperImageIsEmbedded) {
  bool found = false;
  for (const PtxImage& image : embedded_ptx()) found = found || image.compute_capability == 90;
  EXPECT_TRUE(found) << "no compute_90 PTX (scripts/regenerate-ptx.sh's architectures changed?)";
}

TEST(CudaPtx, SelectionPicksTheNewestImageTheDeviceRuns) {
  const auto images = embedded_ptx();
  const int oldest = images.front().compute_capability;
  EXPECT_EQ(select_ptx(oldest - 1), nullptr);
  ASSERT_NE(select_ptx(oldest), nullptr);
  EXPECT_EQ(select_ptx(oldest)->compute_capability, oldest);
  ASSERT_NE(select_ptx(90), nullptr);
  EXPECT_EQ(select_ptx(90)->compute_capability, 90);    // H100/H200
  ASSERT_NE(select_ptx(89), nullptr);
  EXPECT_LT(select_ptx(89)->compute_capability, 90);    // Ada cannot run compute_90 PTX
  ASSERT_NE(select_ptx(120), nullptr);
  EXPECT_EQ(select_ptx(120)->compute_capability, images.back().compute_capability);  // newer GPUs JIT the newest
}

TEST(CudaPtx, IsaVersionIsReadAndRewritten) {
  const std::string ptx = "//\n// .version 1.0 in a comment\n//\n\n.version 9.0\n.target sm_90\n.address_size 64\n";
  EXPECT_EQ(ptx_isa_version(ptx), 90);
  const std::string lowered = with_ptx_isa_version(ptx, 84);
  EXPECT_EQ(ptx_isa_version(lowered), 84);
  EXPECT_EQ(lowered, "//\n// .version 1.0 in a comment\n//\n\n.version 8.4\n.target sm_90\n.address_size 64\n");
  EXPECT_EQ(ptx_isa_version("no directive here"), 0);
  EXPECT_EQ(with_ptx_isa_version("no directive here", 84), "no directive here");
}

TEST(CudaPtx, EmbeddedImagesSurviveAnIsaRewrite) {
  for (const PtxImage& image : embedded_ptx()) {
    const std::string lowered = with_ptx_isa_version(image.text, 78);
    EXPECT_EQ(ptx_isa_version(lowered), 78);
    EXPECT_NE(lowered.find(".entry " + std::string(kAxpyKernelName)), std::string::npos);
  }
}

}  // namespace
}  // namespace devbridge::cuda::detail
