#include "core/util/result_file.hpp"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "ferry/error.hpp"
#include "core/util/json.hpp"

namespace ferry::util {

ResultRecord& ResultRecord::add(std::string_view key, std::string_view value) {
  fields_.emplace_back(std::string(key), json::quote(value));
  return *this;
}

ResultRecord& ResultRecord::add(std::string_view key, double value) {
  std::ostringstream text;
  if (std::isfinite(value))
    text << value;
  else
    text << "null";
  fields_.emplace_back(std::string(key), text.str());
  return *this;
}

ResultRecord& ResultRecord::add(std::string_view key, int64_t value) {
  fields_.emplace_back(std::string(key), std::to_string(value));
  return *this;
}

ResultRecord& ResultRecord::add(std::string_view key, bool value) {
  fields_.emplace_back(std::string(key), value ? "true" : "false");
  return *this;
}

std::string ResultRecord::json() const {
  std::string out = "{";
  for (std::size_t i = 0; i < fields_.size(); ++i) {
    if (i) out += ", ";
    out += json::quote(fields_[i].first);
    out += ": ";
    out += fields_[i].second;
  }
  return out + "}";
}

std::string utc_now_iso() {
  std::time_t const now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &utc);
  return buf;
}

std::string result_file_text(ResultHeader const& header, std::vector<ResultRecord> const& records) {
  std::string out = "{\"tool\": " + json::quote(header.tool) + ", \"version\": " + json::quote(FERRY_VERSION) +
                    ", \"commit\": " + json::quote(header.commit) + ", \"date\": " + json::quote(utc_now_iso()) +
                    ", \"device\": " + json::quote(header.device) + ", \"world\": " + std::to_string(header.world) +
                    ", \"records\": [";
  for (std::size_t i = 0; i < records.size(); ++i) out += (i ? ",\n  " : "\n  ") + records[i].json();
  return out + "\n]}\n";
}

void write_result_file(std::string const& path, ResultHeader const& header, std::vector<ResultRecord> const& records) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  FERRY_CHECK_CONFIG(out.good(), "result file ", path, " cannot be written: ", std::strerror(errno));
  out << result_file_text(header, records);
  out.flush();
  FERRY_CHECK_CONFIG(out.good(), "result file ", path, " could not be written completely: ", std::strerror(errno));
}

void check_result_path(std::string const& path, std::string_view option) {
  if (path.empty()) return;
  std::error_code ignored;
  bool const existed = std::filesystem::exists(path, ignored);
  std::FILE* const file = std::fopen(path.c_str(), "a");
  int const error = errno;
  FERRY_CHECK_CONFIG(file != nullptr, option, " ", path, " cannot be written (", std::strerror(error),
                     "); give a file in a folder that exists and is writable");
  std::fclose(file);
  if (!existed) std::filesystem::remove(path, ignored);
}

}  // namespace ferry::util
