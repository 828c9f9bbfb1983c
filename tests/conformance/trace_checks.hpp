// Checks every flight-recorder trace must pass (docs/TRACING.md, "Trace
// format"), shared by the recorder's unit tests and its conformance tests.
#pragma once

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "trace_validity.hpp"

namespace devbridge::testing {

// Every begin has its end on the same tid, nested per tid; no end without a
// begin; timestamps never go back; counters are never negative.
inline void expect_valid_trace(const nlohmann::json& trace) { EXPECT_EQ(trace_problem(trace), ""); }

// The trace's events whose names are in `wanted`, in order, as "name" for
// instants and "name B" / "name E" for slices.
inline std::vector<std::string> event_names(const nlohmann::json& trace, const std::set<std::string>& wanted) {
  std::vector<std::string> names;
  for (const auto& event : trace.at("traceEvents")) {
    const auto ph = event.at("ph").get<std::string>();
    if (ph == "M" || ph == "C") continue;
    const auto name = event.at("name").get<std::string>();
    if (!wanted.contains(name)) continue;
    names.push_back(ph == "i" ? name : name + " " + ph);
  }
  return names;
}

}  // namespace devbridge::testing
