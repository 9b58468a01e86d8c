// The result files of the tools that measure (`ferry bench`, `ferry p2p`): one JSON object {"tool", "version",
// "commit", "date", "device", "world", "records": [...]}, each record a flat object whose keys keep the order they
// were added in (docs/design.md, "Result files"). One writer, so every tool escapes text the same way (util/json.hpp's
// quote: control characters as \u00XX) and writes a number that JSON cannot hold (NaN, infinity) as null.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ferry::util {

// One flat record. Keys are not checked for repeats: each tool adds a fixed set.
class ResultRecord {
 public:
  ResultRecord& add(std::string_view key, std::string_view value);
  ResultRecord& add(std::string_view key, char const* value) { return add(key, std::string_view(value)); }
  ResultRecord& add(std::string_view key, double value);
  ResultRecord& add(std::string_view key, int64_t value);
  ResultRecord& add(std::string_view key, int value) { return add(key, static_cast<int64_t>(value)); }
  ResultRecord& add(std::string_view key, bool value);
  std::string json() const;  // {"key": value, ...}

 private:
  std::vector<std::pair<std::string, std::string>> fields_;  // key, value as JSON text
};

struct ResultHeader {
  std::string tool;  // "ferry bench"
  std::string commit;
  std::string device;
  int world = 0;
};

// The UTC time now, "2026-12-01T19:44:27Z".
std::string utc_now_iso();

// The whole file's text: the header (version is FERRY_VERSION, date is now) and the records, one per line.
std::string result_file_text(ResultHeader const& header, std::vector<ResultRecord> const& records);

// Writes result_file_text to path. Throws ConfigError naming the path when it cannot be written.
void write_result_file(std::string const& path, ResultHeader const& header, std::vector<ResultRecord> const& records);

// Checks, before any work that would write it starts, that a result file can be written at `path` (empty: no
// file asked for): a missing file is created and removed again, so a run that then fails leaves nothing behind; an
// existing one is opened for appending, which leaves it as it was. Throws ConfigError naming the option and the path.
void check_result_path(std::string const& path, std::string_view option);

}  // namespace ferry::util
