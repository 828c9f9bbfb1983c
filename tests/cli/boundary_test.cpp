// Every numeric option of `devbridge stream` at its edges: 0, 1, max - 1,
// max, 2^63, 2^64 - 1, 2^64, negative and garbage. Each value has one exact
// exit code: 2 for a command line that cannot work (one line naming the
// option and the value, nothing run), 1 for a run the bridge refuses (the
// error kind and the size), 0 for a run that verifies. A crash (exit >= 128,
// or death by a signal) is never an answer.
#include <algorithm>
#include <cstdint>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli_process.hpp"

namespace devbridge::cli::testing {
namespace {

using ::testing::HasSubstr;

constexpr const char* k2Pow63 = "9223372036854775808";
constexpr const char* k2Pow64Minus1 = "18446744073709551615";
constexpr const char* k2Pow64Minus2 = "18446744073709551614";
constexpr const char* k2Pow64 = "18446744073709551616";

// A small, fast stream on the fake backend; a case replaces one option of it
// (or adds one) and may replace others in `with`.
using Options = std::vector<std::pair<std::string, std::string>>;
const Options kBase{{"--backend", "fake"}, {"--bytes", "4096"},      {"--chunk", "1024"},
                    {"--inflight", "2"},   {"--ring-bytes", "8192"}, {"--stall-timeout", "5"}};

// Accepted values that would stream for years end at the first upload instead.
const std::pair<std::string, std::string> kFailFirstUpload{"--fake-inject", "copy_h2d:copy_failed_at_submit"};

struct BoundaryCase {
  std::string name;
  std::string option;
  std::string value;
  int exit_code;
  std::vector<std::string> mentions;  // on stderr, besides the option and value of a usage error
  Options with;
};

void PrintTo(const BoundaryCase& c, std::ostream* os) { *os << c.name; }

std::vector<std::string> command_line(const BoundaryCase& c) {
  Options options = kBase;
  auto set = [&](const std::string& option, const std::string& value) {
    for (auto& [name, v] : options) {
      if (name == option) {
        v = value;
        return;
      }
    }
    options.emplace_back(option, value);
  };
  for (const auto& [option, value] : c.with) set(option, value);
  set(c.option, c.value);
  std::vector<std::string> args{"stream"};
  for (const auto& [option, value] : options) {
    args.push_back(option);
    args.push_back(value);
  }
  return args;
}

class OptionBoundary : public ::testing::TestWithParam<BoundaryCase> {};

TEST_P(OptionBoundary, HasOneExactOutcomeAndNeverCrashes) {
  const BoundaryCase& c = GetParam();
  const CliRun run = run_cli(command_line(c));
  ASSERT_EQ(run.signal, 0) << describe(run);
  ASSERT_GE(run.exit_code, 0) << describe(run);
  ASSERT_LT(run.exit_code, 128) << describe(run);
  ASSERT_EQ(run.exit_code, c.exit_code) << describe(run);
  for (const std::string& mention : c.mentions) EXPECT_THAT(run.err, HasSubstr(mention)) << describe(run);
  switch (c.exit_code) {
    case 2:
      // One line, naming the option and the value as typed; nothing ran.
      EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << describe(run);
      EXPECT_THAT(run.err, ::testing::StartsWith("devbridge: " + c.option)) << describe(run);
      EXPECT_THAT(run.err, HasSubstr("'" + c.value + "'")) << describe(run);
      EXPECT_EQ(run.out, "") << describe(run);
      break;
    case 1:
      EXPECT_THAT(run.out, HasSubstr("devbridge stream: FAILED")) << describe(run);
      break;
    case 0:
      EXPECT_THAT(run.out, HasSubstr("devbridge stream: verified")) << describe(run);
      break;
  }
}

// The garbage every option must refuse, as a usage error naming it.
void add_garbage(std::vector<BoundaryCase>& cases, const std::string& prefix, const std::string& option,
                 const std::string& value_prefix) {
  const std::pair<const char*, const char*> values[] = {
      {"Negative", "-1"}, {"Letters", "abc"}, {"TrailingGarbage", "1.5x"}, {"Empty", ""}};
  for (const auto& [name, value] : values) cases.push_back({prefix + name, option, value_prefix + value, 2, {}, {}});
}

std::vector<BoundaryCase> all_cases() {
  const std::string inject = "copy_h2d:copy_failed_at_submit:";
  std::vector<BoundaryCase> cases = {
      // --bytes: a whole number of float32 elements, more than 0, below 2^64.
      {"Bytes_0", "--bytes", "0", 2, {"must be more than 0"}, {}},
      {"Bytes_1", "--bytes", "1", 2, {"not a multiple of 4"}, {}},
      {"Bytes_4", "--bytes", "4", 0, {}, {}},
      {"Bytes_MaxMinus1", "--bytes", k2Pow64Minus2, 2, {"not a multiple of 4"}, {}},
      {"Bytes_Max", "--bytes", k2Pow64Minus1, 2, {"not a multiple of 4"}, {}},
      // The largest multiple of 4: (bytes + chunk - 1) / chunk wrapped to 0
      // chunks, and an empty stream "verified".
      {"Bytes_LargestMultipleOf4", "--bytes", "18446744073709551612", 1, {"chunk 0", "DeviceCopyFailed"},
       {kFailFirstUpload}},
      {"Bytes_2Pow63", "--bytes", k2Pow63, 1, {"chunk 0", "DeviceCopyFailed"}, {kFailFirstUpload}},
      {"Bytes_2Pow64", "--bytes", k2Pow64, 2, {"too large"}, {}},

      // --chunk: a multiple of 4, more than 0; larger than --bytes is --bytes.
      {"Chunk_0", "--chunk", "0", 2, {"must be more than 0"}, {}},
      {"Chunk_1", "--chunk", "1", 2, {"not a multiple of 4"}, {}},
      {"Chunk_4", "--chunk", "4", 0, {}, {}},
      {"Chunk_MaxMinus1", "--chunk", k2Pow64Minus2, 2, {"not a multiple of 4"}, {}},
      {"Chunk_Max", "--chunk", k2Pow64Minus1, 2, {"not a multiple of 4"}, {}},
      {"Chunk_2Pow63", "--chunk", k2Pow63, 0, {}, {}},
      {"Chunk_2Pow63OfAsMuchData", "--chunk", k2Pow63, 2, {"too large"}, {{"--bytes", k2Pow63}}},
      {"Chunk_2Pow64", "--chunk", k2Pow64, 2, {"too large"}, {}},

      // --inflight: at least 1; deeper than the ring or the data costs nothing.
      {"Inflight_0", "--inflight", "0", 2, {"must be at least 1"}, {}},
      {"Inflight_1", "--inflight", "1", 0, {}, {}},
      {"Inflight_MaxMinus1", "--inflight", k2Pow64Minus2, 0, {}, {}},
      {"Inflight_Max", "--inflight", k2Pow64Minus1, 0, {}, {}},
      {"Inflight_2Pow63", "--inflight", k2Pow63, 0, {}, {}},
      {"Inflight_2Pow64", "--inflight", k2Pow64, 2, {"too large"}, {}},
      {"Inflight_Fraction", "--inflight", "1.5", 2, {"not a whole number"}, {}},

      // --ring-bytes: at least two 1024-byte chunks; a ring no memory holds
      // is the backend's AllocationFailed, naming the size.
      {"RingBytes_0", "--ring-bytes", "0", 2, {"must be more than 0"}, {}},
      {"RingBytes_1", "--ring-bytes", "1", 2, {"needs at least 2048 bytes"}, {}},
      {"RingBytes_ExactlyTwoChunks", "--ring-bytes", "2048", 0, {}, {}},
      {"RingBytes_MaxMinus1", "--ring-bytes", k2Pow64Minus2, 1, {"AllocationFailed", k2Pow64Minus2}, {}},
      {"RingBytes_Max", "--ring-bytes", k2Pow64Minus1, 1, {"AllocationFailed", k2Pow64Minus1}, {}},
      {"RingBytes_WithinAPageOfMax", "--ring-bytes", "18446744073709547521", 1,
       {"AllocationFailed", "18446744073709547521"}, {}},
      {"RingBytes_2Pow63", "--ring-bytes", k2Pow63, 1, {"AllocationFailed", k2Pow63}, {}},
      {"RingBytes_2Pow64", "--ring-bytes", k2Pow64, 2, {"too large"}, {}},

      // --stall-timeout: whole seconds in [1, 86400].
      {"StallTimeout_0", "--stall-timeout", "0", 2, {"between 1 and 86400"}, {}},
      {"StallTimeout_1", "--stall-timeout", "1", 0, {}, {}},
      {"StallTimeout_MaxMinus1", "--stall-timeout", "86399", 0, {}, {}},
      {"StallTimeout_Max", "--stall-timeout", "86400", 0, {}, {}},
      {"StallTimeout_MaxPlus1", "--stall-timeout", "86401", 2, {"between 1 and 86400"}, {}},
      {"StallTimeout_2Pow63", "--stall-timeout", k2Pow63, 2, {"between 1 and 86400"}, {}},
      {"StallTimeout_2Pow64Minus1", "--stall-timeout", k2Pow64Minus1, 2, {"between 1 and 86400"}, {}},
      {"StallTimeout_2Pow64", "--stall-timeout", k2Pow64, 2, {"too large"}, {}},

      // --corrupt-element: an element of the 4096-byte stream (0..1023); the
      // damaged element is found (exit 1).
      {"CorruptElement_0", "--corrupt-element", "0", 1, {"(global element 0)"}, {}},
      {"CorruptElement_1", "--corrupt-element", "1", 1, {"(global element 1)"}, {}},
      {"CorruptElement_MaxMinus1", "--corrupt-element", "1022", 1, {"(global element 1022)"}, {}},
      {"CorruptElement_Max", "--corrupt-element", "1023", 1, {"(global element 1023)"}, {}},
      {"CorruptElement_MaxPlus1", "--corrupt-element", "1024", 2, {"past the last element (1023)"}, {}},
      {"CorruptElement_2Pow63", "--corrupt-element", k2Pow63, 2, {"past the last element"}, {}},
      {"CorruptElement_2Pow64Minus1", "--corrupt-element", k2Pow64Minus1, 2, {"past the last element"}, {}},
      {"CorruptElement_2Pow64", "--corrupt-element", k2Pow64, 2, {"too large"}, {}},

      // --fake-inject's N: the Nth upload (of 4) in [1, 10^9].
      {"InjectN_0", "--fake-inject", inject + "0", 2, {"between 1 and 1000000000"}, {}},
      {"InjectN_1", "--fake-inject", inject + "1", 1, {"chunk 0", "DeviceCopyFailed"}, {}},
      {"InjectN_LastUpload", "--fake-inject", inject + "4", 1, {"chunk 3", "DeviceCopyFailed"}, {}},
      {"InjectN_NeverReached", "--fake-inject", inject + "5", 0, {}, {}},
      {"InjectN_MaxMinus1", "--fake-inject", inject + "999999999", 0, {}, {}},
      {"InjectN_Max", "--fake-inject", inject + "1000000000", 0, {}, {}},
      {"InjectN_MaxPlus1", "--fake-inject", inject + "1000000001", 2, {"between 1 and 1000000000"}, {}},
      {"InjectN_2Pow63", "--fake-inject", inject + k2Pow63, 2, {"between 1 and 1000000000"}, {}},
      {"InjectN_2Pow64Minus1", "--fake-inject", inject + k2Pow64Minus1, 2, {"between 1 and 1000000000"}, {}},
      {"InjectN_2Pow64", "--fake-inject", inject + k2Pow64, 2, {"between 1 and 1000000000"}, {}},
  };
  add_garbage(cases, "Bytes_", "--bytes", "");
  add_garbage(cases, "Chunk_", "--chunk", "");
  add_garbage(cases, "Inflight_", "--inflight", "");
  add_garbage(cases, "RingBytes_", "--ring-bytes", "");
  add_garbage(cases, "StallTimeout_", "--stall-timeout", "");
  add_garbage(cases, "CorruptElement_", "--corrupt-element", "");
  add_garbage(cases, "InjectN_", "--fake-inject", inject);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Stream, OptionBoundary, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<BoundaryCase>& info) { return info.param.name; });

// A ring larger than any memory, on every backend that can run here: the
// backend refuses it (AllocationFailed, naming the size), exit 1, and the
// report is still written. It used to crash the fake and OpenCL backends
// (exit 139): the page-rounded size wrapped around 2^64.
struct HugeRingCase {
  const char* name;
  std::string backend;
  std::string ring_bytes;
};

void PrintTo(const HugeRingCase& c, std::ostream* os) { *os << c.name; }

class HugeRing : public ::testing::TestWithParam<HugeRingCase> {};

TEST_P(HugeRing, IsRefusedAsAllocationFailedNamingTheSize) {
  const HugeRingCase& c = GetParam();
  if (const std::string why = backend_unavailable_reason(c.backend); !why.empty()) GTEST_SKIP() << why;
  const std::string path = scratch_dir() + "/huge-ring-" + c.name + ".json";
  const CliRun run =
      run_cli({"stream", "--backend", c.backend, "--bytes", "4096", "--ring-bytes", c.ring_bytes, "--json", path});
  ASSERT_EQ(run.signal, 0) << describe(run);
  EXPECT_EQ(run.exit_code, 1) << describe(run);
  EXPECT_THAT(run.err, HasSubstr("AllocationFailed")) << describe(run);
  EXPECT_THAT(run.err, HasSubstr(c.ring_bytes)) << describe(run);
  const nlohmann::json report = nlohmann::json::parse(read_file(path));
  EXPECT_EQ(report["verified"], false);
  EXPECT_EQ(report["chunks_verified"], 0);
  ASSERT_FALSE(report["errors"].empty());
  EXPECT_THAT(report["errors"][0].get<std::string>(), HasSubstr("AllocationFailed"));
}

INSTANTIATE_TEST_SUITE_P(
    Stream, HugeRing,
    ::testing::Values(HugeRingCase{"Fake_2Pow64Minus1", "fake", k2Pow64Minus1},
                      HugeRingCase{"Fake_WithinAPageOf2Pow64", "fake", "18446744073709547521"},
                      HugeRingCase{"Fake_2Pow63", "fake", k2Pow63},
                      HugeRingCase{"Host_2Pow64Minus1", "host", k2Pow64Minus1},
                      HugeRingCase{"Host_2Pow63", "host", k2Pow63},
                      HugeRingCase{"OpenCL_2Pow64Minus1", "opencl", k2Pow64Minus1},
                      HugeRingCase{"OpenCL_WithinAPageOf2Pow64", "opencl", "18446744073709547521"},
                      HugeRingCase{"OpenCL_2Pow63", "opencl", k2Pow63}),
    [](const ::testing::TestParamInfo<HugeRingCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace devbridge::cli::testing
