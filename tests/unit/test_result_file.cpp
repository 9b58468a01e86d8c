// The one result-file writer (util/result_file.hpp): what it writes parses back with util::json, with the header
// fields of docs/design.md, records in order, text escaped (quotes, backslashes, control characters) and numbers
// JSON cannot hold written as null.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "support/host_fixtures.hpp"
#include "core/util/json.hpp"
#include "core/util/result_file.hpp"

namespace ferry::util {
namespace {

TEST(ResultFile, WritesTheHeaderAndRecordsAsJsonThatParsesBack) {
  std::vector<ResultRecord> records(2);
  records[0].add("mode", "normal").add("tokens", 4096).add("median_us", 179.5).add("graph", true);
  records[1].add("mode", "ll").add("tokens", int64_t{1} << 40).add("median_us", std::nan("")).add("graph", false);
  records[1].add("p90_us", std::numeric_limits<double>::infinity());
  ResultHeader const header{"ferry bench", "abc1234-dirty", "NVIDIA \"H200\"\\ \x01\t\n", 2};
  json::Value const doc = json::parse(result_file_text(header, records), "result.json");
  ASSERT_TRUE(doc.is(json::Value::Kind::object));
  std::vector<std::string> keys;
  for (auto const& member : doc.members) keys.push_back(member.first);
  EXPECT_EQ(keys, (std::vector<std::string>{"tool", "version", "commit", "date", "device", "world", "records"}));
  EXPECT_EQ(doc.find("tool")->text, "ferry bench");
  EXPECT_EQ(doc.find("device")->text, "NVIDIA \"H200\"\\ \x01\t\n") << "text must round-trip, control characters too";
  EXPECT_EQ(doc.find("world")->integer(), 2);
  EXPECT_EQ(doc.find("date")->text.size(), 20u) << doc.find("date")->text;
  json::Value const& recs = *doc.find("records");
  ASSERT_EQ(recs.items.size(), 2u);
  EXPECT_EQ(recs.items[0].members.front().first, "mode") << "keys keep the order they were added in";
  EXPECT_EQ(recs.items[0].find("median_us")->number, 179.5);
  EXPECT_TRUE(recs.items[0].find("graph")->boolean);
  EXPECT_EQ(recs.items[1].find("tokens")->integer(), int64_t{1} << 40);
  EXPECT_TRUE(recs.items[1].find("median_us")->is(json::Value::Kind::null));
  EXPECT_TRUE(recs.items[1].find("p90_us")->is(json::Value::Kind::null));
}

TEST(ResultFile, AnUnwritablePathIsAConfigErrorNamingIt) {
  test::TempDir dir;
  std::string const path = dir.file("missing-folder/result.json");
  try {
    write_result_file(path, {"ferry p2p", "c", "d", 1}, {});
    FAIL() << "no error";
  } catch (ConfigError const& error) {
    EXPECT_TRUE(test::contains(error.what(), path)) << error.what();
  }
  std::string const ok = dir.file("result.json");
  write_result_file(ok, {"ferry p2p", "c", "d", 1}, {});
  EXPECT_TRUE(json::parse(test::read_file(ok), ok).find("records")->items.empty());
}

}  // namespace
}  // namespace ferry::util
