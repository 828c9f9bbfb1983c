#include "trace_view.hpp"

#include <string_view>

#include "trace_page_html.hpp"  // generated from trace_page.html (CMakeLists.txt)

namespace devbridge::cli {

namespace {

constexpr std::string_view kDataPlaceholder = "__DEVBRIDGE_TRACE_DATA__";

}  // namespace

std::string trace_page(const nlohmann::json& trace) {
  // Inside a <script> element "</script" ends it early, and "<!--" followed
  // by "<script" makes a later "</script" not end it. In JSON a '<' appears
  // only inside a string, where "\u003c" means the same, so every one is
  // written that way and the data cannot change where the element ends.
  const std::string data = trace.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::string safe;
  safe.reserve(data.size());
  for (const char c : data) {
    if (c == '<')
      safe += "\\u003c";
    else
      safe += c;
  }
  std::string page(kTracePageTemplate);
  const auto at = page.find(kDataPlaceholder);
  page.replace(at, kDataPlaceholder.size(), safe);
  return page;
}

}  // namespace devbridge::cli
