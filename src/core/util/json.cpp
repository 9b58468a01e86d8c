#include "core/util/json.hpp"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "ferry/error.hpp"

namespace ferry::util::json {
namespace {

constexpr int kMaxDepth = 64;

class Parser {
 public:
  Parser(std::string_view text, std::string const& source) : text_(text), source_(source) {}

  Value document() {
    skip_space();
    Value value = parse_value(0);
    skip_space();
    if (pos_ < text_.size()) fail(here(), "unexpected '", text_[pos_], "' after the end of the document");
    return value;
  }

 private:
  template <typename... Args>
  [[noreturn]] void fail(Position at, Args const&... what) {
    FERRY_THROW(ConfigError, "tuning", source_, ":", at.line, ":", at.column, ": ", what...);
  }

  Position here() const { return {line_, static_cast<int>(pos_ - line_start_) + 1}; }
  bool done() const { return pos_ >= text_.size(); }
  char peek() const { return text_[pos_]; }

  void advance() {
    if (text_[pos_] == '\n') {
      ++line_;
      line_start_ = pos_ + 1;
    }
    ++pos_;
  }

  void skip_space() {
    while (!done() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) advance();
  }

  void expect(char c, char const* context) {
    if (done()) fail(here(), "expected '", c, "' ", context, ", found the end of the text");
    if (peek() != c) fail(here(), "expected '", c, "' ", context, ", found '", peek(), "'");
    advance();
  }

  Value parse_value(int depth) {
    if (done()) fail(here(), "expected a value, found the end of the text");
    Position const at = here();
    char const c = peek();
    Value value;
    value.at = at;
    if (c == '{' || c == '[') {
      if (depth >= kMaxDepth) fail(at, "nesting deeper than ", kMaxDepth, " levels");
      if (c == '{')
        parse_object(value, depth + 1);
      else
        parse_array(value, depth + 1);
    } else if (c == '"') {
      value.kind = Value::Kind::string;
      value.text = parse_string();
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      parse_number(value);
    } else if (literal("true")) {
      value.kind = Value::Kind::boolean;
      value.boolean = true;
    } else if (literal("false")) {
      value.kind = Value::Kind::boolean;
    } else if (literal("null")) {
      value.kind = Value::Kind::null;
    } else {
      fail(at, "unexpected '", c, "'; expected an object, array, string, number, true, false or null");
    }
    return value;
  }

  bool literal(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    for (std::size_t i = 0; i < word.size(); ++i) advance();
    return true;
  }

  void parse_object(Value& value, int depth) {
    value.kind = Value::Kind::object;
    advance();  // '{'
    std::map<std::string, Position, std::less<>> seen;
    skip_space();
    if (!done() && peek() == '}') {
      advance();
      return;
    }
    while (true) {
      skip_space();
      Position const key_at = here();
      if (done() || peek() != '"')
        fail(key_at, "expected a member name in double quotes",
             done() ? std::string(", found the end of the text") : std::string(", found '") + peek() + "'");
      std::string key = parse_string();
      // NOTE: the reason this reader exists: a repeated key would silently replace the first one's value.
      if (auto const first = seen.find(key); first != seen.end())
        fail(key_at, "duplicate key \"", key, "\" in one object (first at line ", first->second.line, ", column ",
             first->second.column, "); remove one of them");
      seen.emplace(key, key_at);
      skip_space();
      expect(':', "after a member name");
      skip_space();
      Value member = parse_value(depth);
      value.members.emplace_back(std::move(key), std::move(member));
      skip_space();
      if (!done() && peek() == ',') {
        advance();
        continue;
      }
      expect('}', "or ',' in an object");
      return;
    }
  }

  void parse_array(Value& value, int depth) {
    value.kind = Value::Kind::array;
    advance();  // '['
    skip_space();
    if (!done() && peek() == ']') {
      advance();
      return;
    }
    while (true) {
      skip_space();
      value.items.push_back(parse_value(depth));
      skip_space();
      if (!done() && peek() == ',') {
        advance();
        continue;
      }
      expect(']', "or ',' in an array");
      return;
    }
  }

  unsigned hex4() {
    unsigned code = 0;
    for (int i = 0; i < 4; ++i) {
      if (done()) fail(here(), "\\u escape needs four hex digits, found the end of the text");
      char const h = peek();
      unsigned digit = 0;
      if (h >= '0' && h <= '9')
        digit = static_cast<unsigned>(h - '0');
      else if (h >= 'a' && h <= 'f')
        digit = static_cast<unsigned>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F')
        digit = static_cast<unsigned>(h - 'A' + 10);
      else
        fail(here(), "\\u escape needs four hex digits, found '", h, "'");
      code = code * 16 + digit;
      advance();
    }
    return code;
  }

  static void append_utf8(std::string& out, unsigned code) {
    if (code < 0x80) {
      out += static_cast<char>(code);
    } else if (code < 0x800) {
      out += static_cast<char>(0xc0 | (code >> 6));
      out += static_cast<char>(0x80 | (code & 0x3f));
    } else if (code < 0x10000) {
      out += static_cast<char>(0xe0 | (code >> 12));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (code & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (code >> 18));
      out += static_cast<char>(0x80 | ((code >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (code & 0x3f));
    }
  }

  std::string parse_string() {
    Position const start = here();
    advance();  // '"'
    std::string out;
    while (true) {
      if (done()) fail(start, "string is not closed");
      char const c = peek();
      if (c == '"') {
        advance();
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) fail(here(), "control character in a string; escape it");
      if (c != '\\') {
        out += c;
        advance();
        continue;
      }
      Position const escape_at = here();
      advance();
      if (done()) fail(escape_at, "string is not closed");
      char const e = peek();
      advance();
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out += e;
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          unsigned code = hex4();
          if (code >= 0xd800 && code <= 0xdbff) {
            if (!literal("\\u")) fail(escape_at, "high surrogate is not followed by a low surrogate");
            unsigned const low = hex4();
            if (low < 0xdc00 || low > 0xdfff) fail(escape_at, "high surrogate is not followed by a low surrogate");
            code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00);
          } else if (code >= 0xdc00 && code <= 0xdfff) {
            fail(escape_at, "lone low surrogate in a \\u escape");
          }
          append_utf8(out, code);
          break;
        }
        default:
          fail(escape_at, "unknown escape '\\", e, "'");
      }
    }
  }

  void parse_number(Value& value) {
    Position const at = here();
    std::size_t const start = pos_;
    auto digits = [&] {
      std::size_t const first = pos_;
      while (!done() && peek() >= '0' && peek() <= '9') advance();
      return pos_ - first;
    };
    if (peek() == '-') advance();
    if (done()) fail(at, "number has no digits");
    if (peek() == '0') {
      advance();
      if (!done() && peek() >= '0' && peek() <= '9') fail(at, "number has a leading zero");
    } else if (digits() == 0) {
      fail(at, "number has no digits");
    }
    if (!done() && peek() == '.') {
      advance();
      if (digits() == 0) fail(at, "number needs digits after the decimal point");
    }
    if (!done() && (peek() == 'e' || peek() == 'E')) {
      advance();
      if (!done() && (peek() == '+' || peek() == '-')) advance();
      if (digits() == 0) fail(at, "number needs digits in its exponent");
    }
    value.kind = Value::Kind::number;
    value.text = std::string(text_.substr(start, pos_ - start));
    errno = 0;
    value.number = std::strtod(value.text.c_str(), nullptr);
    if (errno == ERANGE && (value.number > 1 || value.number < -1)) fail(at, "number ", value.text, " is out of range");
  }

  std::string_view text_;
  std::string const& source_;
  std::size_t pos_ = 0;
  std::size_t line_start_ = 0;
  int line_ = 1;
};

}  // namespace

Value const* Value::find(std::string_view key) const {
  for (auto const& member : members)
    if (member.first == key) return &member.second;
  return nullptr;
}

bool Value::is_integer() const {
  if (kind != Kind::number || text.find_first_of(".eE") != std::string::npos) return false;
  errno = 0;
  char* end = nullptr;
  std::strtoll(text.c_str(), &end, 10);
  return errno == 0 && end && *end == '\0';
}

int64_t Value::integer() const {
  return std::strtoll(text.c_str(), nullptr, 10);
}

char const* kind_name(Value::Kind kind) {
  switch (kind) {
    case Value::Kind::null:
      return "null";
    case Value::Kind::boolean:
      return "a boolean";
    case Value::Kind::number:
      return "a number";
    case Value::Kind::string:
      return "a string";
    case Value::Kind::array:
      return "an array";
    case Value::Kind::object:
      return "an object";
  }
  return "?";
}

Value parse(std::string_view text, std::string const& source) {
  return Parser(text, source).document();
}

std::string quote(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

}  // namespace ferry::util::json
