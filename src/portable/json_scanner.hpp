// The strict JSON scanner under the checkpoint header parser
// (checkpoint_header.cpp): kept apart because it knows JSON, not
// safetensors. Internal to the library.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

namespace devbridge::checkpoint {

// Thrown by the scanner; becomes "<file> is not a safetensors file: its header is not JSON (...)".
struct Malformed {
  std::string what;
};

// An array of non-negative integers that fit in 64 bits, as the header held it.
struct Integers {
  std::string_view raw;  // the JSON text (empty: the key was absent)
  std::optional<std::string> string;  // the value, when it was a string
  std::vector<std::uint64_t> values;
  bool ok = false;  // an array, every element such an integer
};

// A strict JSON scanner over the header (RFC 8259, as serde_json reads it
// for the safetensors package): UTF-8 checked byte by byte, escapes decoded,
// lone surrogates, NaN, leading zeros, control characters and trailing
// non-whitespace refused. One pass, no backtracking: linear in the input.
class Scanner {
 public:
  explicit Scanner(std::string_view text) : text_(text) {}

  std::size_t at() const { return at_; }
  bool done() const { return at_ == text_.size(); }
  std::string_view since(std::size_t start) const { return text_.substr(start, at_ - start); }

  void skip_space() {
    while (at_ < text_.size()) {
      const char c = text_[at_];
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
      ++at_;
    }
  }
  // The next non-space character (without consuming it), or '\0' at the end.
  char peek() {
    skip_space();
    return at_ < text_.size() ? text_[at_] : '\0';
  }
  void expect(char c) {
    if (peek() != c) fail(fmt::format("expected '{}'", c));
    ++at_;
  }
  // Consumes `c` if it is next.
  bool accept(char c) {
    if (peek() != c) return false;
    ++at_;
    return true;
  }

  [[noreturn]] void fail(std::string_view what) const {
    if (at_ >= text_.size()) throw Malformed{fmt::format("{} at its end, byte {}", what, at_)};
    const auto byte = static_cast<unsigned char>(text_[at_]);
    if (byte >= 0x20 && byte < 0x7f) throw Malformed{fmt::format("{} at byte {} ('{}')", what, at_, text_[at_])};
    throw Malformed{fmt::format("{} at byte {} (0x{:02x})", what, at_, byte)};
  }

  std::string string() {
    if (peek() != '"') fail("expected a string");
    ++at_;
    std::string out;
    for (;;) {
      if (at_ >= text_.size()) fail("unterminated string");
      const auto c = static_cast<unsigned char>(text_[at_]);
      if (c == '"') {
        ++at_;
        return out;
      }
      if (c < 0x20) fail("a control character in a string");
      if (c == '\\') {
        escape(out);
      } else if (c < 0x80) {
        // A run of plain ASCII appended at once (names are mostly that), not a character at a time.
        std::size_t end = at_ + 1;
        while (end < text_.size()) {
          const auto next = static_cast<unsigned char>(text_[end]);
          if (next == '"' || next == '\\' || next < 0x20 || next >= 0x80) break;
          ++end;
        }
        out.append(text_.substr(at_, end - at_));
        at_ = end;
      } else {
        const std::size_t n = utf8_sequence(text_.substr(at_));
        if (n == 0) fail("invalid UTF-8");
        out.append(text_.substr(at_, n));
        at_ += n;
      }
    }
  }

  // A JSON number; its value when it is a non-negative integer that fits in
  // 64 bits (no sign, fraction or exponent), else nothing.
  std::optional<std::uint64_t> number() {
    skip_space();
    bool integer = true;
    if (at_ < text_.size() && text_[at_] == '-') {
      integer = false;
      ++at_;
    }
    if (at_ >= text_.size() || !digit(text_[at_])) fail("expected a value");
    std::optional<std::uint64_t> value = 0;
    if (text_[at_] == '0') {
      value = 0;
      ++at_;
      if (at_ < text_.size() && digit(text_[at_])) fail("a number with a leading zero");
    } else {
      while (at_ < text_.size() && digit(text_[at_])) {
        if (value) value = checked::mul(*value, 10);
        if (value) value = checked::add(*value, static_cast<std::uint64_t>(text_[at_] - '0'));
        ++at_;
      }
    }
    if (at_ < text_.size() && text_[at_] == '.') {
      integer = false;
      ++at_;
      if (at_ >= text_.size() || !digit(text_[at_])) fail("a fraction without digits");
      while (at_ < text_.size() && digit(text_[at_])) ++at_;
    }
    if (at_ < text_.size() && (text_[at_] == 'e' || text_[at_] == 'E')) {
      integer = false;
      ++at_;
      if (at_ < text_.size() && (text_[at_] == '+' || text_[at_] == '-')) ++at_;
      if (at_ >= text_.size() || !digit(text_[at_])) fail("an exponent without digits");
      while (at_ < text_.size() && digit(text_[at_])) ++at_;
    }
    if (!integer) return std::nullopt;
    return value;
  }

  // Consumes any one value, checking it; `depth` counts the containers around it.
  void skip_value(int depth) {
    switch (peek()) {
      case '{':
        enter(depth);
        ++at_;
        if (accept('}')) return;
        do {
          string();
          expect(':');
          skip_value(depth + 1);
        } while (accept(','));
        expect('}');
        return;
      case '[':
        enter(depth);
        ++at_;
        if (accept(']')) return;
        do skip_value(depth + 1);
        while (accept(','));
        expect(']');
        return;
      case '"':
        string();
        return;
      case 't':
        literal("true");
        return;
      case 'f':
        literal("false");
        return;
      case 'n':
        literal("null");
        return;
      default:
        number();
    }
  }

  // A value that should be an array of non-negative 64-bit integers; any other value is consumed too.
  Integers integers(int depth) {
    Integers result;
    const std::size_t start = (skip_space(), at_);
    if (peek() == '"') {
      result.string = string();
    } else if (peek() != '[') {
      skip_value(depth);
    } else {
      enter(depth);
      ++at_;
      result.ok = true;
      if (!accept(']')) {
        do {
          const char c = peek();
          std::optional<std::uint64_t> value;
          if (c == '-' || digit(c)) {
            value = number();
          } else {
            skip_value(depth + 1);
          }
          if (value) {
            result.values.push_back(*value);
          } else {
            result.ok = false;
          }
        } while (accept(','));
        expect(']');
      }
    }
    result.raw = since(start);
    return result;
  }

  void literal(std::string_view word) {
    if (text_.substr(at_, word.size()) != word) fail("expected a value");
    at_ += word.size();
  }

 private:
  static bool digit(char c) { return c >= '0' && c <= '9'; }

  void enter(int depth) const {
    if (depth >= kMaxDepth) fail(fmt::format("nested deeper than {} levels", kMaxDepth));
  }

  unsigned hex4() {
    if (at_ + 4 > text_.size()) fail("a truncated \\u escape");
    unsigned value = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = text_[at_];
      value <<= 4;
      if (digit(c)) {
        value |= static_cast<unsigned>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        value |= static_cast<unsigned>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        value |= static_cast<unsigned>(c - 'A' + 10);
      } else {
        fail("a \\u escape that is not 4 hex digits");
      }
      ++at_;
    }
    return value;
  }

  void escape(std::string& out) {
    ++at_;  // the backslash
    if (at_ >= text_.size()) fail("unterminated string");
    const char c = text_[at_++];
    switch (c) {
      case '"': out += '"'; return;
      case '\\': out += '\\'; return;
      case '/': out += '/'; return;
      case 'b': out += '\b'; return;
      case 'f': out += '\f'; return;
      case 'n': out += '\n'; return;
      case 'r': out += '\r'; return;
      case 't': out += '\t'; return;
      case 'u': break;
      default: --at_; fail("an invalid escape");
    }
    unsigned code = hex4();
    if (code >= 0xDC00 && code <= 0xDFFF) fail("a lone low surrogate escape (not valid UTF-8)");
    if (code >= 0xD800 && code <= 0xDBFF) {
      if (text_.substr(at_, 2) != "\\u") fail("a lone high surrogate escape (not valid UTF-8)");
      at_ += 2;
      const unsigned low = hex4();
      if (low < 0xDC00 || low > 0xDFFF) fail("a lone high surrogate escape (not valid UTF-8)");
      code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
    }
    if (code < 0x80) {
      out += static_cast<char>(code);
    } else if (code < 0x800) {
      out += static_cast<char>(0xC0 | (code >> 6));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else if (code < 0x10000) {
      out += static_cast<char>(0xE0 | (code >> 12));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (code >> 18));
      out += static_cast<char>(0x80 | ((code >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    }
  }

 public:
  // The length of the valid UTF-8 sequence `s` starts with, or 0.
  static std::size_t utf8_sequence(std::string_view s) {
    const auto b0 = static_cast<unsigned char>(s[0]);
    if (b0 < 0x80) return 1;
    std::size_t n;
    unsigned char low = 0x80;
    unsigned char high = 0xBF;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
      n = 2;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      n = 3;
      if (b0 == 0xE0) low = 0xA0;   // overlong
      if (b0 == 0xED) high = 0x9F;  // a surrogate
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      n = 4;
      if (b0 == 0xF0) low = 0x90;   // overlong
      if (b0 == 0xF4) high = 0x8F;  // past U+10FFFF
    } else {
      return 0;
    }
    if (s.size() < n) return 0;
    const auto b1 = static_cast<unsigned char>(s[1]);
    if (b1 < low || b1 > high) return 0;
    for (std::size_t i = 2; i < n; ++i) {
      const auto b = static_cast<unsigned char>(s[i]);
      if (b < 0x80 || b > 0xBF) return 0;
    }
    return n;
  }

 private:
  std::string_view text_;
  std::size_t at_ = 0;
};

}  // namespace devbridge::checkpoint
