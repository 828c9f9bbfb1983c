// The pieces of the worker that need no process: size parsing and the
// stream's data pattern.
#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "pattern.hpp"
#include "sizes.hpp"

namespace devbridge::cli {
namespace {

// gtest names allow only letters, digits and '_': "1.5GiB" -> "1p5GiB", "" -> "empty".
std::string test_name(const std::string& text, std::size_t index) {
  std::string name;
  for (char c : text) {
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
      name += c;
    } else if (c == '.') {
      name += 'p';
    } else {
      name += '_';
    }
  }
  return std::to_string(index) + "_" + (name.empty() ? "empty" : name);
}

struct GoodSize {
  std::string text;
  std::uint64_t bytes;
};

void PrintTo(const GoodSize& size, std::ostream* os) { *os << '"' << size.text << '"'; }

class ParseSizeAccepts : public ::testing::TestWithParam<GoodSize> {};

TEST_P(ParseSizeAccepts, ExactBytes) { EXPECT_EQ(parse_size("--bytes", GetParam().text), GetParam().bytes); }

INSTANTIATE_TEST_SUITE_P(
    Sizes, ParseSizeAccepts,
    ::testing::Values(GoodSize{"4096", 4096}, GoodSize{"0", 0}, GoodSize{"1GiB", 1ull << 30},
                      GoodSize{"512MiB", 512ull << 20}, GoodSize{"1.5GiB", 3ull << 29}, GoodSize{"64k", 64ull << 10},
                      GoodSize{"64K", 64ull << 10}, GoodSize{"4mib", 4ull << 20}, GoodSize{"4M", 4ull << 20},
                      GoodSize{"2GB", 2'000'000'000ull}, GoodSize{"1kb", 1000}, GoodSize{"3TB", 3'000'000'000'000ull},
                      GoodSize{"1TiB", 1ull << 40}, GoodSize{"7B", 7}, GoodSize{"1.25KiB", 1280},
                      GoodSize{".5KiB", 512}, GoodSize{"0.001GB", 1'000'000},
                      GoodSize{"18446744073709551615", 18446744073709551615ull}, GoodSize{"16777215TiB", 16777215ull << 40}),
    [](const ::testing::TestParamInfo<GoodSize>& info) { return test_name(info.param.text, info.index); });

class ParseSizeRejects : public ::testing::TestWithParam<std::string> {};

TEST_P(ParseSizeRejects, WithTheOptionAndTextInTheReason) {
  try {
    parse_size("--chunk", GetParam());
    FAIL() << "accepted '" << GetParam() << "'";
  } catch (const UsageError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("--chunk"), std::string::npos) << what;
    EXPECT_NE(what.find("'" + GetParam() + "'"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, ParseSizeRejects,
                         ::testing::Values("", "GiB", "-1", "+4", "1e3", "1 GiB", " 1GiB", "1GiB ", "1.", ".", "1..5",
                                           "1.5", "0.1B", "1.3KB.", "4XB", "4MiBs", "4iB", "0x10",
                                           "18446744073709551616", "16777216TiB", "99999999999999999999",
                                           "1000000000000000000000000000B",
                                           "1,024", "NaN", "inf"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return test_name(info.param, info.index); });

TEST(ParseCount, AcceptsPlainWholeNumbersOnly) {
  EXPECT_EQ(parse_count("--inflight", "0"), 0u);
  EXPECT_EQ(parse_count("--inflight", "8"), 8u);
  EXPECT_EQ(parse_count("--inflight", "18446744073709551615"), 18446744073709551615ull);
  for (const char* bad : {"", "-1", "+1", "1.0", "8x", "1e3", " 8", "18446744073709551616"}) {
    EXPECT_THROW(parse_count("--inflight", bad), UsageError) << bad;
  }
}

TEST(FormatBytes, PicksTheLargestBinaryUnit) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.00 KiB");
  EXPECT_EQ(format_bytes(4ull << 20), "4.00 MiB");
  EXPECT_EQ(format_bytes(3ull << 29), "1.50 GiB");
}

TEST(GigabytesPerSecond, IsDecimalAndZeroForNoTime) {
  EXPECT_DOUBLE_EQ(gigabytes_per_second(2'000'000'000, 2.0), 1.0);
  EXPECT_EQ(gigabytes_per_second(1, 0.0), 0.0);
}

TEST(Pattern, ValuesAreWholeAndResultsExactInFloat32) {
  std::mt19937_64 random(12345);
  for (int n = 0; n < 100000; ++n) {
    const std::uint64_t index = random();
    const float x = pattern_value(index);
    ASSERT_EQ(x, std::floor(x));
    ASSERT_GE(x, -4194304.0f);
    ASSERT_LT(x, 4194304.0f);
    // Double arithmetic is exact here; float must agree with it bit for bit.
    ASSERT_EQ(static_cast<double>(expected_result(index)), 2.0 * static_cast<double>(x) + 1.0);
  }
}

TEST(Pattern, NeighboursDiffer) {
  // A copy shifted by one element must not pass.
  for (std::uint64_t i = 0; i < 100000; ++i) ASSERT_NE(pattern_value(i), pattern_value(i + 1)) << i;
}

TEST(Pattern, FillMatchesTheScalarDefinitionAcrossThe32BitWrap) {
  const std::uint64_t first = (1ull << 32) - 1000;
  std::vector<float> values(5000);
  fill_pattern(values, first);
  for (std::size_t i = 0; i < values.size(); ++i) ASSERT_EQ(values[i], pattern_value(first + i)) << i;
}

TEST(Pattern, VerifyAcceptsTheResultAndFindsEveryWrongElement) {
  const std::uint64_t first = 987654321;
  std::vector<float> results(70000);
  for (std::size_t i = 0; i < results.size(); ++i) results[i] = expected_result(first + i);
  EXPECT_FALSE(verify_results(results, first).has_value());
  // Wrong offset: the inputs themselves, or the results of the next element.
  EXPECT_TRUE(verify_results(results, first + 1).has_value());

  std::mt19937_64 random(7);
  const std::size_t damaged = random() % results.size();
  const float original = results[damaged];
  results[damaged] = std::nextafter(original, 0.0f);
  results.back() = -results.back() - 1.0f;
  const auto mismatch = verify_results(results, first);
  ASSERT_TRUE(mismatch.has_value());
  EXPECT_EQ(mismatch->element, std::min(damaged, results.size() - 1));
  EXPECT_EQ(mismatch->expected, expected_result(first + mismatch->element));
  EXPECT_EQ(mismatch->wrong_elements, damaged == results.size() - 1 ? 1u : 2u);
  EXPECT_EQ(mismatch->got, results[mismatch->element]);

  results.assign(results.size(), std::nanf(""));
  const auto nans = verify_results(results, first);
  ASSERT_TRUE(nans.has_value());
  EXPECT_EQ(nans->wrong_elements, results.size());
}

}  // namespace
}  // namespace devbridge::cli
