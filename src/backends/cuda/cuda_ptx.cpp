#include "backends/cuda/cuda_ptx.hpp"

#include <charconv>

namespace devbridge::cuda::detail {

// Defined in the generated cuda_axpy_ptx.cpp.
extern const PtxImage kAxpyPtxImages[];
extern const std::size_t kAxpyPtxImageCount;

std::span<const PtxImage> embedded_ptx() noexcept { return {kAxpyPtxImages, kAxpyPtxImageCount}; }

const PtxImage* select_ptx(int device_compute_capability) noexcept {
  const PtxImage* best = nullptr;
  for (const PtxImage& image : embedded_ptx()) {
    if (image.compute_capability <= device_compute_capability) best = &image;
  }
  return best;
}

int oldest_ptx_isa_for_target(int compute_capability) noexcept {
  // From the PTX ISA release notes: the version that introduced each target.
  struct Row {
    int target;
    int isa;
  };
  constexpr Row kRows[] = {{75, 63}, {80, 70}, {86, 71}, {87, 74}, {89, 78}, {90, 78}, {100, 86}, {120, 87}};
  int isa = 0;
  for (const Row& row : kRows) {
    if (row.target <= compute_capability) isa = row.isa;
  }
  return isa;
}

namespace {

// Where ".version X.Y" sits: the start of X and the end of Y.
struct VersionSpan {
  std::size_t begin = std::string_view::npos;
  std::size_t end = std::string_view::npos;
};

VersionSpan find_version(std::string_view ptx) noexcept {
  constexpr std::string_view kDirective = ".version";
  std::size_t at = 0;
  while ((at = ptx.find(kDirective, at)) != std::string_view::npos) {
    // Only a directive at the start of a line, not one inside a comment.
    if (at == 0 || ptx[at - 1] == '\n') break;
    at += kDirective.size();
  }
  if (at == std::string_view::npos) return {};
  std::size_t begin = at + kDirective.size();
  while (begin < ptx.size() && (ptx[begin] == ' ' || ptx[begin] == '\t')) ++begin;
  std::size_t end = begin;
  while (end < ptx.size() && ((ptx[end] >= '0' && ptx[end] <= '9') || ptx[end] == '.')) ++end;
  if (end == begin) return {};
  return {begin, end};
}

}  // namespace

int ptx_isa_version(std::string_view ptx) noexcept {
  VersionSpan span = find_version(ptx);
  if (span.begin == std::string_view::npos) return 0;
  std::string_view text = ptx.substr(span.begin, span.end - span.begin);
  std::size_t dot = text.find('.');
  if (dot == std::string_view::npos) return 0;
  int major = 0;
  int minor = 0;
  auto parsed_major = std::from_chars(text.data(), text.data() + dot, major);
  auto parsed_minor = std::from_chars(text.data() + dot + 1, text.data() + text.size(), minor);
  if (parsed_major.ec != std::errc{} || parsed_minor.ec != std::errc{}) return 0;
  return major * 10 + minor;
}

std::string with_ptx_isa_version(std::string_view ptx, int isa) {
  VersionSpan span = find_version(ptx);
  if (span.begin == std::string_view::npos) return std::string(ptx);
  std::string out;
  out.reserve(ptx.size());
  out.append(ptx.substr(0, span.begin));
  out.append(std::to_string(isa / 10)).append(".").append(std::to_string(isa % 10));
  out.append(ptx.substr(span.end));
  return out;
}

}  // namespace devbridge::cuda::detail
