// The stream's data: a float32 value for every global element index, and the
// check of what came back. Every value is a whole number in [-2^22, 2^22), so
// y = 2x + 1 stays a whole number below 2^23 in magnitude and float32
// arithmetic is exact: the consumer compares bit for bit, with no tolerance.
// A multiplicative hash of the index (rather than the index itself) makes
// neighbours differ, so a copy landing at the wrong offset cannot pass.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

namespace devbridge::cli {

inline constexpr float kAxpyA = 2.0f;
inline constexpr float kAxpyB = 1.0f;

inline float pattern_value(std::uint64_t global_index) noexcept {
  const std::uint32_t hashed = static_cast<std::uint32_t>(global_index) * 0x9E3779B1u;
  return static_cast<float>(static_cast<std::int32_t>(hashed >> 9) - (1 << 22));
}

inline float expected_result(std::uint64_t global_index) noexcept {
  return kAxpyA * pattern_value(global_index) + kAxpyB;
}

// Writes pattern_value(first_index + i) into out[i].
inline void fill_pattern(std::span<float> out, std::uint64_t first_index) noexcept {
  // Kept to 32-bit lanes so the compiler vectorizes it.
  const std::uint32_t base = static_cast<std::uint32_t>(first_index);
  float* data = out.data();
  const std::size_t n = out.size();
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t hashed = (base + static_cast<std::uint32_t>(i)) * 0x9E3779B1u;
    data[i] = static_cast<float>(static_cast<std::int32_t>(hashed >> 9) - (1 << 22));
  }
}

struct Mismatch {
  std::uint64_t element = 0;  // index inside the span
  float expected = 0.0f;
  float got = 0.0f;
  std::uint64_t wrong_elements = 0;  // how many differ in the whole span
};

// Compares got[i] with expected_result(first_index + i) for every element.
inline std::optional<Mismatch> verify_results(std::span<const float> got, std::uint64_t first_index) noexcept {
  const std::uint32_t base = static_cast<std::uint32_t>(first_index);
  const float* data = got.data();
  const std::size_t n = got.size();
  // A branch-free pass first (vectorizes); only a failing chunk pays for the
  // second pass that finds and counts the differences.
  std::uint32_t any_wrong = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t hashed = (base + static_cast<std::uint32_t>(i)) * 0x9E3779B1u;
    const float x = static_cast<float>(static_cast<std::int32_t>(hashed >> 9) - (1 << 22));
    any_wrong |= static_cast<std::uint32_t>(data[i] != kAxpyA * x + kAxpyB);
  }
  if (any_wrong == 0) return std::nullopt;
  Mismatch mismatch;
  bool found = false;
  for (std::size_t i = 0; i < n; ++i) {
    const float expected = expected_result(first_index + i);
    if (data[i] != expected) {
      if (!found) {
        mismatch.element = i;
        mismatch.expected = expected;
        mismatch.got = data[i];
        found = true;
      }
      ++mismatch.wrong_elements;
    }
  }
  return mismatch;
}

}  // namespace devbridge::cli
