#include "trace.hpp"

#include "memory_reserve.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <new>
#include <system_error>
#include <string_view>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sizes.hpp"

namespace devbridge::cli {

namespace {

constexpr std::string_view kFormat = "devbridge-trace";
constexpr std::uint64_t kNewestVersion = 1;
// A trace nests four levels (the file, traceEvents, an event, its args);
// the page writes the data back out by recursion, so a deeper file is refused.
constexpr int kMaxDepth = 64;

[[noreturn]] void refuse(const std::string& path, const std::string& why) {
  throw TraceFileError(fmt::format("{}: {}", path, why));
}

// Opened without blocking (a FIFO with no writer would wait for one forever)
// and refused unless it is a regular file, as checkpoint inspect does.
std::string read_whole(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) refuse(path, fmt::format("cannot be opened: {}", std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) refuse(path, fmt::format("cannot be opened: {}", std::strerror(errno)));
  if (S_ISDIR(st.st_mode)) refuse(path, "is a directory, not a trace file");
  if (!S_ISREG(st.st_mode))
    refuse(path, "is not a regular file (a FIFO, device or socket is refused, never waited on)");
  // A regular file never blocks; reads go on as usual.
  if (const int flags = ::fcntl(fd, F_GETFL); flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  // The whole text is held, then parsed into a tree several times its size:
  // a file past the limit (or a sparse one, `truncate -s 100G`) is refused
  // by its size rather than ending in an allocation failure.
  const auto refuse_size = [&](std::uint64_t bytes) {
    refuse(path, fmt::format("is {} bytes ({}), larger than the {} a trace may be", bytes, format_bytes(bytes),
                             format_bytes(kMaxTraceFileBytes)));
  };
  if (static_cast<std::uint64_t>(st.st_size) > kMaxTraceFileBytes) refuse_size(static_cast<std::uint64_t>(st.st_size));
  std::string text;
  text.reserve(static_cast<std::size_t>(st.st_size));
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n > 0) {
      // It may grow while it is read.
      if (text.size() + static_cast<std::size_t>(n) > kMaxTraceFileBytes) refuse_size(text.size() + static_cast<std::size_t>(n));
      text.append(buffer, static_cast<std::size_t>(n));
    } else if (n == 0) {
      break;
    } else if (errno != EINTR) {
      refuse(path, fmt::format("cannot be read: {}", std::strerror(errno)));
    }
  }
  return text;
}

// nlohmann's SAX interface, counting only how deep the text nests: it stops
// (false) at kMaxDepth. A malformed text is left to the parse after it.
struct DepthCheck {
  using json = nlohmann::json;
  int depth = 0;
  bool too_deep = false;
  bool enter() {
    too_deep = ++depth > kMaxDepth;
    return !too_deep;
  }
  bool leave() {
    --depth;
    return true;
  }
  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(json::number_integer_t) { return true; }
  bool number_unsigned(json::number_unsigned_t) { return true; }
  bool number_float(json::number_float_t, const json::string_t&) { return true; }
  bool string(json::string_t&) { return true; }
  bool binary(json::binary_t&) { return true; }
  bool start_object(std::size_t) { return enter(); }
  bool key(json::string_t&) { return true; }
  bool end_object() { return leave(); }
  bool start_array(std::size_t) { return enter(); }
  bool end_array() { return leave(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) { return false; }
};

// What the page and the replay read of an event, checked once here so that
// neither meets a value of the wrong type: "" when `e` is fine.
std::string event_problem(const nlohmann::json& e) {
  if (!e.is_object()) return "is not an object";
  const auto ph = e.find("ph");
  if (ph == e.end() || !ph->is_string()) return "has no \"ph\" string";
  // Every event has its name (the page labels each by it).
  if (const auto name = e.find("name"); name == e.end() || !name->is_string()) return "has no \"name\" string";
  if (const auto it = e.find("cat"); it != e.end() && !it->is_string()) return "has a \"cat\" that is not a string";
  for (const char* key : {"ts", "pid", "tid"})
    if (const auto it = e.find(key); it != e.end() && !it->is_number()) return fmt::format("has a \"{}\" that is not a number", key);
  const auto args = e.find("args");
  if (args != e.end() && !args->is_object()) return "has \"args\" that are not an object";
  const std::string& phase = ph->get_ref<const std::string&>();
  if (phase != "M" && e.find("ts") == e.end()) return "has no \"ts\"";
  if (phase == "M" && e.value("name", std::string()) == "thread_name" &&
      (args == e.end() || !args->contains("name") || !(*args)["name"].is_string()))
    return "is a thread_name without an args.name string";
  if (phase == "C" && args != e.end())
    for (const auto& [key, value] : args->items())
      if (!value.is_number()) return fmt::format("is a counter whose \"{}\" is not a number", key);
  return {};
}

}  // namespace

nlohmann::json load_trace(const std::string& path) {
  nlohmann::json trace;
  try {
    const std::string text = read_whole(path);
    // A tree destroyed after its parse ran out of memory takes a stack of 16 bytes a value of its largest
    // array (the events): room for that, in a text of at least 32 bytes an event.
    keep_memory_for_unwinding(std::max<std::size_t>(std::size_t{64} << 20, text.size() / 2));
    // The depth first, in a pass that builds nothing: a parse with a callback
    // (which could refuse as it goes) walks each parent's elements again at
    // every object's end, and took 297 s for 10^6 events.
    DepthCheck depth;
    if (!nlohmann::json::sax_parse(text, &depth) && depth.too_deep)
      refuse(path, fmt::format("nests deeper than {} levels; a devbridge trace nests 4", kMaxDepth));
    trace = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    refuse(path, fmt::format("is not JSON ({})", e.what()));
  } catch (const std::bad_alloc&) {
    // Below the size limit, but more than this machine's memory holds parsed.
    std::error_code error;
    const std::uint64_t bytes = std::filesystem::file_size(path, error);
    refuse(path, fmt::format("is {} bytes ({}): there is not the memory to load it", bytes, format_bytes(bytes)));
  }
  const auto other = trace.is_object() ? trace.find("otherData") : trace.end();
  if (!trace.is_object() || other == trace.end() || !other->is_object() || !other->contains("format") ||
      (*other)["format"] != kFormat)
    refuse(path, fmt::format("is not a devbridge trace (no otherData.format \"{}\"; devbridge stream --trace, "
                             "or Python's bridge.dump_trace, writes one)",
                             kFormat));
  // The parser stores every whole number from 0 up as unsigned (up to
  // 2^64 - 1), a negative one as signed.
  const auto version = other->find("version");
  if (version == other->end() || !version->is_number_unsigned() || version->get<std::uint64_t>() < 1)
    refuse(path, "has no valid otherData.version");
  if (const auto number = version->get<std::uint64_t>(); number > kNewestVersion)
    refuse(path, fmt::format("is a version {} trace; this devbridge reads version {} and older", number,
                             kNewestVersion));
  if (!trace.contains("traceEvents") || !trace["traceEvents"].is_array()) refuse(path, "has no traceEvents array");
  const auto& events = trace["traceEvents"];
  for (std::size_t i = 0; i < events.size(); ++i)
    if (const auto problem = event_problem(events[i]); !problem.empty())
      refuse(path, fmt::format("event {} {}", i, problem));
  return trace;
}

}  // namespace devbridge::cli
