// `devbridge trace view TRACE -o PAGE`: a trace as one self-contained HTML
// page (memory over time and the copy/compute timeline, no network).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace devbridge::cli {

// The page for `trace` (as load_trace returns it): the template
// (trace_page.html) with the trace embedded.
std::string trace_page(const nlohmann::json& trace);

}  // namespace devbridge::cli
