// Tuning tables and `ferry tune`: the strict JSON reader (duplicate keys refused with their position), the table
// loader (duplicate entry keys, overlapping / unsorted buckets, unknown fields, a row's warps, an ll entry's combine
// buckets: errors naming file and entry), lookup and its fallback order, GPU name aliases, the precedence EpConfig pin
// > env > table > analytic default, merging, the picker's tie-breaking, the compiled-in copies, and smoke runs of
// `ferry tune` on the cpu backend.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "core/util/json.hpp"
#include "ep/tuning_key.hpp"
#include "ferry/error.hpp"
#include "support/host_fixtures.hpp"
#include "tuning/choose.hpp"
#include "tuning/embedded.hpp"
#include "tuning/picker.hpp"
#include "tuning/table.hpp"

namespace ferry::tuning {
namespace {

namespace json = util::json;
using test::CliRun;
using test::contains;
using test::read_file;
using test::run_ferry;
using test::ScopedEnv;
using test::TempDir;
using test::write_file;

namespace fs = std::filesystem;

// The ConfigError message of fn ("" if it did not throw).
std::string config_error(std::function<void()> const& fn) {
  try {
    fn();
  } catch (ConfigError const& error) {
    return error.what();
  }
  return "";
}

void expect_error(std::function<void()> const& fn, std::initializer_list<std::string> parts) {
  std::string const message = config_error(fn);
  ASSERT_FALSE(message.empty()) << "expected a ConfigError";
  for (std::string const& part : parts) EXPECT_TRUE(contains(message, part)) << "'" << part << "' not in: " << message;
}

std::string key_json(std::string const& gpu, int world = 8, int hidden = 7168) {
  return "{\"gpu\": \"" + gpu + "\", \"world\": " + std::to_string(world) + ", \"hidden\": " + std::to_string(hidden) +
         ", \"topk\": 8, \"dispatch_format\": \"bf16\", \"combine_format\": \"bf16\", \"mode\": \"normal\"}";
}

std::string table_json(std::vector<std::string> const& entries) {
  std::string out = "{\"version\": 1, \"entries\": [";
  for (std::size_t i = 0; i < entries.size(); ++i) out += (i ? ",\n" : "\n") + entries[i];
  return out + "\n]}\n";
}

std::string entry_json(std::string const& gpu, std::string const& dispatch = "", std::string const& combine = "") {
  return "{\"key\": " + key_json(gpu) + ", \"dispatch\": [" + dispatch + "], \"combine\": [" + combine + "]}";
}

TuningKey h200_key(int world = 8) {
  return {"H200", world, 7168, 8, "bf16", "bf16", "normal"};
}

Entry make_entry(TuningKey key, std::vector<Bucket> dispatch, std::vector<Bucket> combine) {
  Entry entry;
  entry.key = std::move(key);
  entry.dispatch = std::move(dispatch);
  entry.combine = std::move(combine);
  return entry;
}

// ---- JSON ----------------------------------------------------------------------------------------------------------

TEST(TuningJson, ParsesValidDocuments) {
  json::Value const v = json::parse(
      "{\n  \"a\": [1, -0.5e3, 0, true, false, null],\n  \"s\": \"q\\\"\\\\\\/\\b\\f\\n\\r\\t\\u00e9\\ud83d\\ude00\",\n"
      "  \"o\": {\"n\": {}}, \"e\": []\n}",
      "doc.json");
  ASSERT_TRUE(v.is(json::Value::Kind::object));
  ASSERT_EQ(v.members.size(), 4u);
  json::Value const& a = *v.find("a");
  ASSERT_EQ(a.items.size(), 6u);
  EXPECT_TRUE(a.items[0].is_integer());
  EXPECT_EQ(a.items[0].integer(), 1);
  EXPECT_FALSE(a.items[1].is_integer());
  EXPECT_DOUBLE_EQ(a.items[1].number, -500.0);
  EXPECT_TRUE(a.items[3].boolean);
  EXPECT_TRUE(a.items[5].is(json::Value::Kind::null));
  EXPECT_EQ(v.find("s")->text, "q\"\\/\b\f\n\r\t\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_TRUE(v.find("o")->find("n")->members.empty());
  EXPECT_EQ(v.find("missing"), nullptr);
  // positions are 1-based line / column of the value's first character
  EXPECT_EQ(a.at.line, 2);
  EXPECT_EQ(a.at.column, 8);
  EXPECT_EQ(a.items[1].at.column, 12);
  // quote() round-trips through the parser
  std::string const odd = "tab\there \"quoted\" back\\slash \x01";
  EXPECT_EQ(json::parse(json::quote(odd), "q").text, odd);
}

TEST(TuningJson, RejectsInvalidDocumentsWithPosition) {
  struct Case {
    char const* text;
    char const* where;
    char const* what;
  };
  Case const cases[] = {
      {"", "bad.json:1:1", "end of the text"},
      {"{\"a\": 1,}", "bad.json:1:9", "member name"},
      {"[1, 2,]", "bad.json:1:7", "unexpected ']'"},
      {"{\"a\" 1}", "bad.json:1:6", "expected ':'"},
      {"{\"a\": 01}", "bad.json:1:7", "leading zero"},
      {"{\"a\": 1.}", "bad.json:1:7", "after the decimal point"},
      {"{\"a\": -}", "bad.json:1:7", "no digits"},
      {"\"open", "bad.json:1:1", "not closed"},
      {"\"a\nb\"", "bad.json:1:3", "control character"},
      {"\"\\x\"", "bad.json:1:2", "unknown escape"},
      {"\"\\udc00\"", "bad.json:1:2", "lone low surrogate"},
      {"\"\\ud800x\"", "bad.json:1:2", "low surrogate"},
      {"{}\n  x", "bad.json:2:3", "after the end"},
      {"[1 2]", "bad.json:1:4", "',' in an array"},
      {"tru", "bad.json:1:1", "unexpected 't'"},
      {"{\"a\": 1e999}", "bad.json:1:7", "out of range"},
  };
  for (Case const& c : cases) {
    SCOPED_TRACE(c.text);
    expect_error([&] { json::parse(c.text, "bad.json"); }, {c.where, c.what, "tuning error"});
  }
  std::string const deep = std::string(65, '[') + std::string(65, ']');
  expect_error([&] { json::parse(deep, "deep.json"); }, {"deep.json:1:65", "nesting deeper than 64"});
  EXPECT_NO_THROW(json::parse(std::string(64, '[') + std::string(64, ']'), "ok.json"));
}

TEST(TuningJson, RejectsDuplicateKeysWithBothPositions) {
  expect_error([] { json::parse("{\"a\": 1,\n  \"b\": 2,\n  \"a\": 3}", "dup.json"); },
               {"dup.json:3:3", "duplicate key \"a\"", "first at line 1, column 2"});
  // in a nested object, and keys that differ only after an escape are the same key
  expect_error([] { json::parse("[{\"x\": {\"k\": 1, \"\\u006b\": 2}}]", "nested.json"); },
               {"nested.json:1:17", "duplicate key \"k\"", "first at line 1, column 9"});
  // the same key in two different objects is fine
  EXPECT_NO_THROW(json::parse("[{\"a\": 1}, {\"a\": 2}]", "ok.json"));
}

// ---- loading -------------------------------------------------------------------------------------------------------

TEST(TuningTable, LoadsAWellFormedTable) {
  Table const table = parse_table(table_json({entry_json("NVIDIA H200",
                                                         "{\"max_tokens\": 128, \"blocks\": 8, \"us\": 41.5},"
                                                         "{\"max_tokens\": 4096, \"blocks\": 64}",
                                                         "{\"max_tokens\": 512, \"blocks\": 24}"),
                                              entry_json("H100")}),
                                  "t.json");
  ASSERT_EQ(table.entries.size(), 2u);
  Entry const& e = table.entries[0];
  EXPECT_EQ(e.key, h200_key());  // the GPU name is stored canonically
  ASSERT_EQ(e.dispatch.size(), 2u);
  EXPECT_EQ(e.dispatch[0], (Bucket{128, {8}, 41.5}));
  EXPECT_EQ(e.dispatch[1], (Bucket{4096, {64}, std::nullopt}));
  EXPECT_EQ(e.combine[0].geometry, (Geometry{24}));
  EXPECT_TRUE(table.entries[1].dispatch.empty());
  EXPECT_EQ(table.source, "t.json");
}

TEST(TuningTable, RejectsDuplicateEntryKeysNamingFileAndEntry) {
  // the same key under two spellings of the GPU is a duplicate
  expect_error(
      [] {
        parse_table(table_json({entry_json("H200"), entry_json("H100"), entry_json("nvidia h200")}), "d.json");
      },
      {"d.json:", "entry 2 (H200 world 8 hidden 7168 topk 8 bf16/bf16 normal)", "duplicate key",
       "entry 0 has the same key"});
  // across the files of one directory: both named
  Table const a = parse_table(table_json({entry_json("H200")}), "a.json");
  Table const b = parse_table(table_json({entry_json("H100"), entry_json("h200")}), "b.json");
  expect_error(
      [&] {
        TableSet::from_tables("dir", {a, b});
      },
      {"duplicate key H200 world 8", "b.json entry 1", "a.json entry 0"});
}

TEST(TuningTable, RejectsOverlappingAndUnsortedBuckets) {
  expect_error(
      [] {
        parse_table(table_json({entry_json("H200",
                                           "{\"max_tokens\": 128, \"blocks\": 8},"
                                           "{\"max_tokens\": 128, \"blocks\": 16}")}),
                    "o.json");
      },
      {"o.json:", "entry 0 (H200 world 8", "dispatch bucket 1", "overlapping", "max_tokens=128"});
  expect_error(
      [] {
        parse_table(table_json({entry_json("H200", "",
                                           "{\"max_tokens\": 512, \"blocks\": 8},"
                                           "{\"max_tokens\": 256, \"blocks\": 16}")}),
                    "u.json");
      },
      {"u.json:", "entry 0 (H200", "combine bucket 1", "unsorted", "256"});
}

TEST(TuningTable, RejectsUnknownFieldsAndBadValues) {
  struct Case {
    std::string text;
    std::vector<std::string> parts;
  };
  std::string const bucket = "{\"max_tokens\": 128, \"blocks\": 8}";
  std::vector<Case> const cases = {
      {table_json({entry_json("H200", "{\"max_tokens\": 128, \"blcoks\": 8}")}),
       {"entry 0 (H200", "unknown field \"blcoks\"", "dispatch bucket 0"}},
      {table_json({"{\"key\": " + key_json("H200") + ", \"dispach\": []}"}),
       {"entry 0 (H200", "unknown field \"dispach\""}},
      {table_json({"{\"key\": {\"gpu\": \"H200\", \"wrld\": 8}}"}), {"entry 0", "unknown field \"wrld\" in key"}},
      {"{\"version\": 1, \"entries\": [], \"extra\": 1}", {"unknown field \"extra\" in the table"}},
      {"{\"version\": 2, \"entries\": []}", {"version must be 1"}},
      {"{\"entries\": []}", {"has no \"version\""}},
      {"[]", {"the table must be an object"}},
      {table_json({entry_json("H200", "{\"max_tokens\": 128, \"blocks\": 8.5}")}),
       {"entry 0 (H200", "blocks must be an integer, not 8.5"}},
      {table_json({entry_json("H200", "{\"max_tokens\": 128}")}), {"entry 0 (H200", "has no \"blocks\""}},
      {table_json({"{\"key\": " + key_json("H200", 0) + "}"}), {"entry 0", "key.world=0 is outside [1, 1024]"}},
      {table_json({"{\"key\": " + key_json("H200", 1025) + "}"}), {"entry 0", "key.world=1025 is outside [1, 1024]"}},
      {table_json({"{\"key\": {\"gpu\": \"H200\", \"world\": 8, \"hidden\": 7168, \"topk\": 8, \"dispatch_format\": "
                   "\"fp9\", \"combine_format\": \"bf16\", \"mode\": \"normal\"}}"}),
       {"entry 0", "key.dispatch_format=\"fp9\" is not a wire format"}},
      {table_json({"{\"key\": " + key_json("H200") + ", \"dispatch\": {}}"}), {"dispatch must be an array"}},
      {table_json({"{\"key\": " + key_json("H200") + ", \"provenance\": {\"who\": \"me\"}}"}),
       {"unknown field \"who\" in provenance"}},
  };
  for (Case const& c : cases) {
    SCOPED_TRACE(c.text);
    std::vector<std::string> parts = c.parts;
    parts.push_back("bad.json:");
    std::string const message = config_error([&] { parse_table(c.text, "bad.json"); });
    ASSERT_FALSE(message.empty());
    for (std::string const& part : parts) EXPECT_TRUE(contains(message, part)) << part << " not in: " << message;
  }
  (void)bucket;
}

// Warps per CTA are not a setting (every kernel runs 16): a row naming them is refused with that reason, at the
// field's position, rather than read as blocks alone or reported as a typo. Checked to fail: with the loader's "warps"
// check removed, the message was the generic "unknown field \"warps\"" and this test failed.
TEST(TuningTable, RefusesARowWithWarpsSayingWhy) {
  for (auto const& [dispatch, combine, where] :
       {std::tuple{"{\"max_tokens\": 128, \"blocks\": 8, \"warps\": 16}", "", "dispatch bucket 0"},
        std::tuple{"", "{\"max_tokens\": 128, \"blocks\": 8}, {\"max_tokens\": 512, \"warps\": 8, \"blocks\": 8}",
                   "combine bucket 1"}}) {
    std::string const text = table_json({entry_json("H200", dispatch, combine)});
    expect_error([&] { parse_table(text, "w.json"); },
                 {"w.json:", "entry 0 (H200 world 8", std::string(where) + " has \"warps\", which was removed",
                  "every kernel runs 16 warps per CTA", "delete the field"});
  }
}

// A low-latency EpBuffer runs one grid for both legs, chosen by its entry's dispatch buckets: combine buckets there
// would never be read, so they are refused. Checked to fail: without the loader's check, the ll entry below loaded.
TEST(TuningTable, RefusesCombineBucketsOfALowLatencyEntry) {
  std::string ll_key = key_json("H200");
  ll_key.replace(ll_key.find("\"normal\""), 8, "\"ll\"");
  std::string const row = "{\"max_tokens\": 128, \"blocks\": 66}";
  expect_error([&] { parse_table(table_json({"{\"key\": " + ll_key + ", \"combine\": [" + row + "]}"}), "l.json"); },
               {"l.json:", "entry 0 (H200 world 8 hidden 7168 topk 8 bf16/bf16 ll)",
                "combine buckets in a mode \"ll\" entry are never read", "chosen by the dispatch buckets"});
  Table const ll =
      parse_table(table_json({"{\"key\": " + ll_key + ", \"dispatch\": [" + row + "], \"combine\": []}"}), "l.json");
  EXPECT_EQ(ll.entries[0].dispatch.size(), 1u);
  EXPECT_NO_THROW(parse_table(table_json({entry_json("H200", row, row)}), "n.json"));  // normal mode keeps both
}

TEST(TuningTable, SerializeRoundTripsAndIsStable) {
  Table table;
  table.comment = "a \"comment\"";
  Entry entry = make_entry(h200_key(), {{128, {8}, 40.25}, {4096, {64}, std::nullopt}}, {});
  entry.provenance = Provenance{"ferry tune 0.1.0", "abc123", "2026-01-01T00:00:00Z", "NVIDIA H200", 3, 0.03};
  table.entries = {entry, make_entry(h200_key(2), {}, {{256, {16}, 9.5}})};
  std::string const text = serialize_table(table);
  Table const back = parse_table(text, "rt.json");
  EXPECT_EQ(back.entries, table.entries);
  EXPECT_EQ(back.comment, table.comment);
  EXPECT_EQ(serialize_table(back), text);
}

TEST(TuningTable, ShippedTablesLoadAndAreEmbeddedByteForByte) {
  fs::path const dir = fs::path(FERRY_SOURCE_DIR) / "src" / "tuning" / "tables";
  std::vector<std::string> names;
  for (fs::directory_entry const& file : fs::directory_iterator(dir))
    if (file.path().extension() == ".json") names.push_back(file.path().filename().string());
  std::sort(names.begin(), names.end());
  ASSERT_FALSE(names.empty()) << "no tables under " << dir;
  auto const embedded = embedded_tables();
  ASSERT_EQ(embedded.size(), names.size()) << "rebuild: the embedded copies are stale";
  for (std::size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(embedded[i].name, names[i]);
    std::string const text(reinterpret_cast<char const*>(embedded[i].data), embedded[i].size);
    EXPECT_EQ(text, read_file((dir / names[i]).string())) << names[i] << ": the embedded copy is stale; rebuild";
  }
  TableSet const builtin = TableSet::builtin();  // checks every shipped table, across files too
  EXPECT_EQ(builtin.tables.size(), names.size());
  EXPECT_EQ(builtin.tables[0].source.rfind("builtin:", 0), 0u);
  TableSet const from_dir = TableSet::from_directory(dir.string());
  EXPECT_EQ(from_dir.tables.size(), names.size());
}

TEST(TuningTable, TablesInForceFollowFerryTuningDir) {
  TempDir dir;
  write_file(dir.file("h200.json"), table_json({entry_json("H200", "{\"max_tokens\": 512, \"blocks\": 12}")}));
  write_file(dir.file("notes.txt"), "not a table");
  {
    ScopedEnv env("FERRY_TUNING_DIR", dir.path());
    auto const tables = active_tables();
    EXPECT_EQ(tables->origin, "FERRY_TUNING_DIR=" + dir.path());
    ASSERT_EQ(tables->tables.size(), 1u);
    auto const found = tables->find(h200_key());
    ASSERT_TRUE(found.has_value());
    EXPECT_EQ(found->where, dir.file("h200.json") + " entry 0");
    EXPECT_EQ(active_tables(), tables);  // loaded once per value
  }
  {
    ScopedEnv env("FERRY_TUNING_DIR", std::nullopt);
    EXPECT_EQ(active_tables()->origin, "the compiled-in tables");
  }
  {
    ScopedEnv env("FERRY_TUNING_DIR", dir.file("missing"));
    expect_error([] { active_tables(); }, {"FERRY_TUNING_DIR=", "is not a directory"});
  }
  write_file(dir.file("z.json"), "{\"version\": 1, \"entries\": [}");
  expect_error([&] { TableSet::from_directory(dir.path()); }, {dir.file("z.json") + ":1:28"});
}

// ---- lookup and fallback order -------------------------------------------------------------------------------------

TEST(TuningLookup, GpuNameAliases) {
  for (char const* name : {"NVIDIA H200", "H200", "h200", "  nvidia   H200 ", "Nvidia h200", "NVIDIA H200 141GB HBM3e"})
    EXPECT_EQ(canonical_gpu_name(name), "H200") << name;
  EXPECT_EQ(canonical_gpu_name("NVIDIA H100 80GB HBM3"), "H100");
  EXPECT_EQ(canonical_gpu_name("NVIDIA H200 NVL"), "H200 NVL");  // a different product keeps its name
  EXPECT_EQ(table_file_stem("NVIDIA H200"), "h200");
  EXPECT_EQ(table_file_stem("H200 NVL"), "h200-nvl");
  TableSet const set = TableSet::from_tables("test", {parse_table(table_json({entry_json("H200")}), "a.json")});
  for (char const* name : {"NVIDIA H200", "h200", "H200"}) {
    TuningKey key = h200_key();
    key.gpu = name;
    EXPECT_TRUE(set.find(key).has_value()) << name;
  }
  EXPECT_FALSE(set.find(h200_key(4)).has_value());
  EXPECT_EQ(detail::tuning_key("NVIDIA H200", 8, EpConfig{}), h200_key());
}

TEST(TuningLookup, BucketMatchIsInclusiveThenNearest) {
  std::vector<Bucket> const buckets = {{128, {8}, {}}, {512, {16}, {}}, {4096, {64}, {}}};
  EXPECT_EQ(match_bucket(buckets, 0).bucket, &buckets[0]);
  EXPECT_EQ(match_bucket(buckets, 128).bucket, &buckets[0]);
  EXPECT_EQ(match_bucket(buckets, 129).bucket, &buckets[1]);
  EXPECT_EQ(match_bucket(buckets, 512).bucket, &buckets[1]);
  EXPECT_EQ(match_bucket(buckets, 4096).bucket, &buckets[2]);
  EXPECT_FALSE(match_bucket(buckets, 4096).nearest);
  BucketMatch const past = match_bucket(buckets, 8192);
  EXPECT_EQ(past.bucket, &buckets[2]);
  EXPECT_TRUE(past.nearest);
  EXPECT_EQ(match_bucket({}, 10).bucket, nullptr);
}

class TuningChoose : public ::testing::Test {
 protected:
  TableSet tables_ =
      TableSet::from_tables("test", {parse_table(table_json({entry_json("H200",
                                                                        "{\"max_tokens\": 128, \"blocks\": 8},"
                                                                        "{\"max_tokens\": 1024, \"blocks\": 24}",
                                                                        "{\"max_tokens\": 512, \"blocks\": 40}")}),
                                                 "h200.json")});
  Geometry const analytic_{132};
};

TEST_F(TuningChoose, FallbackOrderTableRowThenNearestThenDefault) {
  LegTuning const dispatch = resolve_leg(Leg::dispatch, h200_key(), std::nullopt, tables_);
  ASSERT_EQ(dispatch.rows.size(), 2u);
  Choice c = choose(dispatch, {}, 100, analytic_, "grid = SMs");
  EXPECT_EQ(c.geometry, (Geometry{8}));
  EXPECT_TRUE(contains(c.source,
                       "table h200.json entry 0 (H200 world 8 hidden 7168 topk 8 bf16/bf16 normal) "
                       "bucket <=128 tokens"))
      << c.source;
  c = choose(dispatch, {}, 1000, analytic_, "grid = SMs");
  EXPECT_EQ(c.geometry, (Geometry{24}));
  c = choose(dispatch, {}, 5000, analytic_, "grid = SMs");  // past the largest bucket: the nearest one
  EXPECT_EQ(c.geometry, (Geometry{24}));
  EXPECT_TRUE(contains(c.source, "bucket <=1024 tokens (nearest: 5000 tokens is past the largest)")) << c.source;
  // no entry for the key: the analytic default, saying why
  LegTuning const other = resolve_leg(Leg::dispatch, h200_key(2), std::nullopt, tables_);
  EXPECT_TRUE(other.rows.empty());
  c = choose(other, {}, 100, analytic_, "grid = SMs");
  EXPECT_EQ(c.geometry, analytic_);
  EXPECT_EQ(c.source,
            "analytic default (grid = SMs; no table entry for H200 world 2 hidden 7168 topk 8 bf16/bf16 "
            "normal in test)");
  // an entry without buckets for this leg: the default too
  TableSet const sparse = TableSet::from_tables("t", {parse_table(table_json({entry_json("H200")}), "s.json")});
  c = choose(resolve_leg(Leg::combine, h200_key(), std::nullopt, sparse), {}, 64, analytic_, "grid = SMs");
  EXPECT_EQ(c.geometry, analytic_);
  EXPECT_TRUE(contains(c.source,
                       "s.json entry 0 (H200 world 8 hidden 7168 topk 8 bf16/bf16 normal) has no combine "
                       "buckets"))
      << c.source;
  // no tables at all (empty set) never crashes
  c = choose(resolve_leg(Leg::dispatch, h200_key(), std::nullopt, TableSet{}), {}, 1, analytic_, "why");
  EXPECT_EQ(c.geometry, analytic_);
}

TEST_F(TuningChoose, PrecedencePinThenEnvThenTableThenDefault) {
  LegTuning tuning = resolve_leg(Leg::dispatch, h200_key(), std::nullopt, tables_);
  // table
  EXPECT_EQ(choose(tuning, {}, 100, analytic_, "d").geometry.blocks, 8);
  // env beats the table
  Choice c = choose(tuning, EnvPin{20}, 100, analytic_, "d");
  EXPECT_EQ(c.geometry, (Geometry{20}));
  EXPECT_EQ(c.source, "FERRY_DISPATCH_BLOCKS=20");
  // the EpConfig pin beats env and table
  tuning.pin = Geometry{40};
  c = choose(tuning, EnvPin{20}, 100, analytic_, "d");
  EXPECT_EQ(c.geometry, (Geometry{40}));
  EXPECT_EQ(c.source, "EpConfig::dispatch_geometry");
  // a pin of 0 blocks chooses: env, then the table
  tuning.pin = Geometry{0};
  c = choose(tuning, EnvPin{20}, 100, analytic_, "d");
  EXPECT_EQ(c.geometry, (Geometry{20}));
  EXPECT_EQ(c.source, "FERRY_DISPATCH_BLOCKS=20");
  c = choose(tuning, {}, 100, analytic_, "d");
  EXPECT_EQ(c.geometry, (Geometry{8}));
  EXPECT_TRUE(contains(c.source, "table h200.json entry 0")) << c.source;
  // the default when nothing else speaks
  LegTuning const bare = resolve_leg(Leg::combine, h200_key(4), std::nullopt, tables_);
  EXPECT_EQ(choose(bare, {}, 100, analytic_, "d").geometry, analytic_);
  EXPECT_EQ(choose(bare, EnvPin{6}, 100, analytic_, "d").geometry, (Geometry{6}));
}

TEST_F(TuningChoose, EnvPinsAreReadFromTheEnvironment) {
  {
    ScopedEnv blocks("FERRY_COMBINE_BLOCKS", "24");
    EXPECT_EQ(read_env_pin(Leg::combine).blocks, 24);
    EXPECT_FALSE(read_env_pin(Leg::dispatch).blocks.has_value());
  }
  {
    ScopedEnv blocks("FERRY_DISPATCH_BLOCKS", "0");  // 0 = choose
    EXPECT_FALSE(read_env_pin(Leg::dispatch).blocks.has_value());
  }
  {
    ScopedEnv blocks("FERRY_DISPATCH_BLOCKS", "-3");
    expect_error([] { read_env_pin(Leg::dispatch); }, {"FERRY_DISPATCH_BLOCKS=-3 is outside"});
  }
}

// ---- merge ---------------------------------------------------------------------------------------------------------

TEST(TuningMerge, OtherKeysUntouchedAndIdempotent) {
  Table table;
  table.comment = "kept";
  Entry const h100 = make_entry({"H100", 8, 7168, 8, "bf16", "bf16", "normal"}, {{128, {8}, 1.0}}, {});
  Entry const h200 = make_entry(h200_key(), {{128, {8}, 2.0}, {1024, {32}, 3.0}}, {{512, {20}, 4.0}});
  table.entries = {h100, h200};
  std::string const before = serialize_table(table);

  // a new key is appended; the others are unchanged
  Entry const fresh = make_entry(h200_key(4), {{4096, {64}, 5.0}, {256, {16}, 6.0}}, {});
  Table const appended = merge_entry(table, fresh);
  ASSERT_EQ(appended.entries.size(), 3u);
  EXPECT_EQ(appended.entries[0], h100);
  EXPECT_EQ(appended.entries[1], h200);
  EXPECT_EQ(appended.entries[2].dispatch[0].max_tokens, 256);  // sorted
  EXPECT_EQ(appended.comment, "kept");

  // the same key: buckets with the same bound replaced, others kept, sorted; other entries untouched
  Entry update =
      make_entry({"nvidia h200", 8, 7168, 8, "bf16", "bf16", "normal"}, {{1024, {40}, 7.0}, {64, {4}, 8.0}}, {});
  update.provenance = Provenance{"ferry tune", "c", "d", "NVIDIA H200", 3, 0.03};
  Table const merged = merge_entry(table, update);
  ASSERT_EQ(merged.entries.size(), 2u);
  EXPECT_EQ(merged.entries[0], h100);
  std::vector<Bucket> const want = {{64, {4}, 8.0}, {128, {8}, 2.0}, {1024, {40}, 7.0}};
  EXPECT_EQ(merged.entries[1].dispatch, want);
  EXPECT_EQ(merged.entries[1].combine, h200.combine);
  EXPECT_EQ(merged.entries[1].provenance, update.provenance);
  EXPECT_EQ(merged.entries[1].key.gpu, "H200");

  // idempotent: merging the same entry again changes nothing, byte for byte
  EXPECT_EQ(serialize_table(merge_entry(merged, update)), serialize_table(merged));
  EXPECT_EQ(serialize_table(merge_entry(appended, fresh)), serialize_table(appended));
  // the text of an untouched entry is the same before and after
  std::string const h100_text = serialize_table(Table{"", "kept", {h100}});
  std::string const h100_block =
      h100_text.substr(h100_text.find("    {"), h100_text.find("\n    }") + 6 - h100_text.find("    {"));
  EXPECT_TRUE(contains(before, h100_block));
  EXPECT_TRUE(contains(serialize_table(merged), h100_block));

  // through a file
  TempDir dir;
  write_table_file(dir.file("t.json"), merged);
  Table const back = read_table_file(dir.file("t.json"));
  EXPECT_EQ(back.entries, merged.entries);
  EXPECT_FALSE(fs::exists(dir.file("t.json.tmp")));
}

// ---- the picker ----------------------------------------------------------------------------------------------------

TEST(TuningPicker, FewestBlocksWithinToleranceUnderEveryRouting) {
  // us = {random, grouped}
  std::vector<Measurement> const m = {
      {{8}, {130, 100}},   // random 30% off the best
      {{16}, {102, 140}},  // grouped 40% off
      {{24}, {102, 102}},  // within 3% of both bests (100, 100)
      {{32}, {100, 101}},  // the fastest, but more blocks
      {{48}, {101, 100}},
  };
  Pick const pick = pick_geometry(m, 0.03);
  EXPECT_EQ(pick.geometry, (Geometry{24}));
  EXPECT_TRUE(pick.within_tolerance);
  EXPECT_EQ(pick.best_us, (std::vector<double>{100, 100}));
  EXPECT_DOUBLE_EQ(pick.worst_ratio, 1.02);
  // a tighter tolerance moves the pick to more blocks
  EXPECT_EQ(pick_geometry(m, 0.01).geometry, (Geometry{32}));
  // exactly at the tolerance counts as within
  EXPECT_EQ(pick_geometry({{{8}, {103, 100}}, {{16}, {100, 100}}}, 0.03).geometry, (Geometry{8}));
}

TEST(TuningPicker, ThePickDoesNotDependOnTheCandidatesOrder) {
  std::vector<Measurement> m = {
      {{32}, {100, 100}}, {{16}, {100, 100}}, {{24}, {99, 99}}, {{8}, {150, 100}}, {{64}, {100, 100}},
  };
  std::mt19937 shuffle(7);
  for (int i = 0; i < 20; ++i) {
    std::shuffle(m.begin(), m.end(), shuffle);
    EXPECT_EQ(pick_geometry(m, 0.03).geometry, (Geometry{16}));
  }
}

TEST(TuningPicker, NoneWithinToleranceMinimisesTheWorstRatio) {
  // 8 blocks: worst 1.5; 16: worst 1.2; 24: worst 1.2 (tie: fewer blocks); 32: worst 1.3
  std::vector<Measurement> const m = {{{8}, {100, 150}}, {{24}, {120, 100}}, {{16}, {120, 100}}, {{32}, {130, 100}}};
  Pick const pick = pick_geometry(m, 0.03);
  EXPECT_FALSE(pick.within_tolerance);
  EXPECT_EQ(pick.geometry, (Geometry{16}));
  EXPECT_DOUBLE_EQ(pick.worst_ratio, 1.2);
}

TEST(TuningPicker, RefusesBadMeasurements) {
  EXPECT_THROW(pick_geometry({}, 0.03), Error);
  EXPECT_THROW(pick_geometry({{{8}, {1, 2}}, {{16}, {1}}}, 0.03), Error);
  EXPECT_THROW(pick_geometry({{{8}, {0.0}}}, 0.03), Error);
  EXPECT_THROW(pick_geometry({{{8}, {}}}, 0.03), Error);
}

// ---- ferry tune on the cpu backend ---------------------------------------------------------------------------------

TEST(TuneCli, SmokeOnTheCpuBackend) {
  ScopedEnv rank("RANK", std::nullopt);  // the launching process, not a rank
  TempDir dir;
  std::string const table = dir.file("cpu.json");
  // another key already in the file must survive the merge untouched
  Table seeded;
  seeded.entries = {make_entry(h200_key(), {{128, {8}, 1.5}}, {})};
  write_table_file(table, seeded);
  std::string const shape =
      " --backend cpu --nproc 2 --hidden 256 --topk 4 --experts 16 --expert-groups 4 --topk-groups 2 --blocks 2,4 "
      "--rounds 1 --warmup 1 --iters 2 --seed 11 --table " +
      table;

  CliRun const tuned = run_ferry("tune --tokens 8,16" + shape);
  ASSERT_EQ(tuned.code, 0) << tuned.output;
  for (char const* part : {"cpu backend: the launch geometry has no effect", "[  2/2] round 1/1", "bucket <=16 tokens",
                           "<- pick", "wrote ", "entry CPU world 2 hidden 256 topk 4 bf16/bf16 normal"})
    EXPECT_TRUE(contains(tuned.output, part)) << part << " not in:\n" << tuned.output;
  Table const written = read_table_file(table);
  ASSERT_EQ(written.entries.size(), 2u);
  EXPECT_EQ(written.entries[0], seeded.entries[0]);
  Entry const& entry = written.entries[1];
  EXPECT_EQ(entry.key, (TuningKey{"CPU", 2, 256, 4, "bf16", "bf16", "normal"}));
  ASSERT_EQ(entry.dispatch.size(), 2u);
  ASSERT_EQ(entry.combine.size(), 2u);
  EXPECT_EQ(entry.dispatch[1].max_tokens, 16);
  EXPECT_TRUE(entry.dispatch[0].geometry.blocks == 2 || entry.dispatch[0].geometry.blocks == 4);
  ASSERT_TRUE(entry.provenance.has_value());
  EXPECT_EQ(entry.provenance->rounds, 1);

  // --dry-run writes nothing
  std::string const text = read_file(table);
  CliRun const dry = run_ferry("tune --dry-run --tokens 32" + shape);
  ASSERT_EQ(dry.code, 0) << dry.output;
  EXPECT_TRUE(contains(dry.output, "would write")) << dry.output;
  EXPECT_EQ(read_file(table), text);

  // --verify measures the table's buckets and prints a ratio per bucket; on cpu timing noise decides pass or fail
  CliRun const verify = run_ferry("tune --verify" + shape);
  EXPECT_TRUE(verify.code == 0 || verify.code == 3) << verify.output;
  EXPECT_TRUE(contains(verify.output, "verify dispatch <=8")) << verify.output;
  EXPECT_TRUE(contains(verify.output, "x the best")) << verify.output;
  EXPECT_EQ(read_file(table), text);

  // the cpu backend refuses to write the default (shipped) table
  CliRun const refused = run_ferry("tune --backend cpu --nproc 2");
  EXPECT_EQ(refused.code, 2);
  EXPECT_TRUE(contains(refused.output, "needs --table FILE")) << refused.output;
}

// --mode ll picks one grid per bucket for both legs (scored on their sum) and writes it as the dispatch row only: a
// low-latency EpBuffer reads no combine rows, and the loader refuses them. Checked to fail: with tune writing the pick
// to both legs, as it did, the write was refused by the loader's check of what it is about to write.
TEST(TuneCli, LowLatencyWritesTheDispatchRowOnly) {
  ScopedEnv rank("RANK", std::nullopt);
  TempDir dir;
  std::string const table = dir.file("cpu.json");
  CliRun const tuned = run_ferry(
      "tune --mode ll --tokens 8,16 --backend cpu --nproc 2 --hidden 256 --topk 4 --experts 16 --expert-groups 4 "
      "--topk-groups 2 --blocks 2,4 --rounds 1 --warmup 1 --iters 2 --seed 11 --table " +
      table);
  ASSERT_EQ(tuned.code, 0) << tuned.output;
  EXPECT_TRUE(contains(tuned.output, "both legs")) << tuned.output;
  Table const written = read_table_file(table);
  ASSERT_EQ(written.entries.size(), 1u);
  EXPECT_EQ(written.entries[0].key.mode, "ll");
  ASSERT_EQ(written.entries[0].dispatch.size(), 2u);
  EXPECT_TRUE(written.entries[0].combine.empty());

  // --verify without --tokens: the buckets are the table's, and the default token list (up to 4096, past what
  // mode=ll accepts) must not refuse the run. Checked to fail before token_buckets: "max_tokens_per_rank=4096 is more
  // than mode=ll accepts".
  CliRun const verify = run_ferry(
      "tune --mode ll --verify --backend cpu --nproc 2 --hidden 256 --topk 4 --experts 16 --expert-groups 4 "
      "--topk-groups 2 --blocks 2,4 --rounds 1 --warmup 1 --iters 2 --seed 11 --table " +
      table);
  EXPECT_TRUE(verify.code == 0 || verify.code == 3) << verify.output;
  EXPECT_TRUE(contains(verify.output, "verify both legs <=16")) << verify.output;
}

}  // namespace
}  // namespace ferry::tuning
