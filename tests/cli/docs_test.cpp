// docs/CLI.md against the binary: what the command line accepts and writes
// is what the page lists.
#include <cstddef>
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli_process.hpp"

namespace devbridge::cli::testing {
namespace {

using ::testing::HasSubstr;

std::string cli_md() {
  const std::string text = read_file(std::string(DEVBRIDGE_DOCS_DIR) + "/CLI.md");
  if (text.empty()) ADD_FAILURE() << "cannot read " << DEVBRIDGE_DOCS_DIR << "/CLI.md";
  return text;
}

// The text of CLI.md from the line starting with `heading` to the next heading.
std::string section(const std::string& text, const std::string& heading) {
  const auto at = text.find("\n" + heading);
  if (at == std::string::npos) {
    ADD_FAILURE() << "CLI.md has no heading " << heading;
    return {};
  }
  const auto end = text.find("\n#", at + 1);
  return text.substr(at, end == std::string::npos ? std::string::npos : end - at);
}

// Every `name` between backquotes in `text`.
std::set<std::string> quoted(const std::string& text) {
  std::set<std::string> names;
  for (std::size_t at = text.find('`'); at != std::string::npos; at = text.find('`', at)) {
    const auto end = text.find('`', at + 1);
    if (end == std::string::npos) break;
    names.insert(text.substr(at + 1, end - at - 1));
    at = end + 1;
  }
  return names;
}

// "... (one of: a, b, c)" -> {a, b, c}
std::vector<std::string> one_of(const std::string& message) {
  std::vector<std::string> names;
  const auto at = message.find("(one of: ");
  if (at == std::string::npos) return names;
  const auto end = message.find(')', at);
  std::string list = message.substr(at + 9, end - at - 9);
  for (std::size_t start = 0; start <= list.size();) {
    const auto comma = list.find(", ", start);
    names.push_back(list.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 2;
  }
  return names;
}

// Every top-level key of the stream's report is a row of the field table
// (the `trace` key was missing).
TEST(CliDocs, TheStreamReportTableListsEveryKeyTheReportHas) {
  const std::string trace = scratch_dir() + "/docs.trace.json";
  const CliRun run =
      run_cli({"stream", "--backend", "fake", "--bytes", "64KiB", "--chunk", "16KiB", "--trace", trace, "--json", "-"});
  ASSERT_EQ(run.exit_code, 0) << describe(run);
  const nlohmann::json report = nlohmann::json::parse(run.out);
  std::set<std::string> rows;
  const std::string table = section(cli_md(), "### JSON report");
  for (std::size_t at = table.find("\n| `"); at != std::string::npos; at = table.find("\n| `", at + 1)) {
    const auto cell_end = table.find(" |", at + 3);
    for (const std::string& name : quoted(table.substr(at, cell_end - at))) rows.insert(name);
  }
  ASSERT_FALSE(rows.empty());
  for (const auto& [key, value] : report.items()) EXPECT_TRUE(rows.contains(key)) << "CLI.md's table lacks `" << key << "`";
}

// The calls and failures --fake-inject names are those it accepts
// (register_host and unregister_host were missing).
TEST(CliDocs, TheFakeInjectListsNameEveryCallAndFailureTheCommandLineTakes) {
  const CliRun calls = run_cli({"stream", "--backend", "fake", "--fake-inject", "teleport:fatal"});
  ASSERT_EQ(calls.exit_code, 2) << describe(calls);
  const CliRun failures = run_cli({"stream", "--backend", "fake", "--fake-inject", "copy_h2d:melt"});
  ASSERT_EQ(failures.exit_code, 2) << describe(failures);
  const std::vector<std::string> call_names = one_of(calls.err);
  const std::vector<std::string> failure_names = one_of(failures.err);
  ASSERT_GE(call_names.size(), 9u) << calls.err;
  ASSERT_GE(failure_names.size(), 8u) << failures.err;

  const std::string hooks = section(cli_md(), "### Test hooks");
  const auto item = hooks.find("- `--fake-inject");
  ASSERT_NE(item, std::string::npos);
  const std::string text = hooks.substr(item, hooks.find("\n- ", item + 1) - item);
  const auto failures_at = text.find("failures `");
  ASSERT_NE(failures_at, std::string::npos) << text;
  const std::set<std::string> listed_calls = quoted(text.substr(0, failures_at));
  const auto failures_end = text.find(". ", failures_at);
  const std::set<std::string> listed_failures = quoted(text.substr(failures_at, failures_end - failures_at));
  for (const std::string& name : call_names)
    EXPECT_TRUE(listed_calls.contains(name)) << "CLI.md's --fake-inject calls lack `" << name << "`";
  for (const std::string& name : failure_names)
    EXPECT_TRUE(listed_failures.contains(name)) << "CLI.md's --fake-inject failures lack `" << name << "`";
}

}  // namespace
}  // namespace devbridge::cli::testing
