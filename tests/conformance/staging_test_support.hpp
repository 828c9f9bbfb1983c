// What the Stager's and the transfer planner's conformance tests share
// (stager_test.cpp, transfer_test.cpp): an error of a given kind whose
// message names what failed. Not for files that include
// conformance_support.hpp, whose EXPECT_KIND takes no text.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string_view>

#include "devbridge/error.hpp"

namespace devbridge::conformance {

// Runs `statement`, expects devbridge::Error of `kind` whose message contains `text`.
inline ::testing::AssertionResult throws_kind(ErrorKind kind, const std::function<void()>& statement,
                                              std::string_view text = {}) {
  try {
    statement();
  } catch (const Error& e) {
    if (e.kind() != kind)
      return ::testing::AssertionFailure() << "expected " << kind_name(kind) << ", got " << e.what();
    if (std::string_view(e.what()).find(text) == std::string_view::npos)
      return ::testing::AssertionFailure() << "the message does not contain \"" << text << "\": " << e.what();
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "expected " << kind_name(kind) << ", nothing was thrown";
}

}  // namespace devbridge::conformance

#define EXPECT_KIND(kind, statement, ...) EXPECT_TRUE(throws_kind((kind), [&] { statement; } __VA_OPT__(, ) __VA_ARGS__))
