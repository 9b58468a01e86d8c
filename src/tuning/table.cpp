#include "tuning/table.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "ferry/env.hpp"
#include "ferry/error.hpp"
#include "tuning/embedded.hpp"
#include "core/util/json.hpp"

namespace ferry::tuning {
namespace {

namespace json = util::json;
using json::Value;
using Kind = json::Value::Kind;

constexpr int kTableVersion = 1;

// Marketing names of one model, after canonicalisation (upper case, no "NVIDIA", single spaces). Add a line when
// a driver reports a model under a longer name than its table uses.
constexpr std::array<std::pair<std::string_view, std::string_view>, 4> kGpuAliases = {{
    {"H100 80GB HBM3", "H100"},
    {"H100 SXM5 80GB", "H100"},
    {"H200 141GB HBM3E", "H200"},
    {"GH200 480GB", "GH200"},
}};

// Context of a check: "FILE:LINE:COLUMN: entry 2 (H200 world 8 ...): "
class Checker {
 public:
  explicit Checker(std::string const& source) : source_(source) {}

  void set_entry(int index, std::string description) {
    entry_ = index;
    entry_description_ = std::move(description);
  }

  template <typename... Args>
  [[noreturn]] void fail(Value const& at, Args const&... what) const {
    std::string context = detail::concat(source_, ":", at.at.line, ":", at.at.column, ": ");
    if (entry_ >= 0)
      context += detail::concat("entry ", entry_, entry_description_.empty() ? "" : " (", entry_description_,
                                entry_description_.empty() ? "" : ")", ": ");
    FERRY_THROW(ConfigError, "tuning", context, what...);
  }

  void expect_kind(Value const& value, Kind kind, std::string_view field) const {
    if (!value.is(kind)) fail(value, field, " must be ", json::kind_name(kind), ", not ", json::kind_name(value.kind));
  }

  // Refuses members not in `known` (a typo would otherwise be ignored silently).
  void only_fields(Value const& object, std::initializer_list<std::string_view> known, std::string_view what) const {
    for (auto const& [name, value] : object.members)
      if (std::find(known.begin(), known.end(), name) == known.end()) {
        std::string allowed;
        for (std::string_view k : known) allowed += (allowed.empty() ? "" : ", ") + std::string(k);
        fail(value, "unknown field \"", name, "\" in ", what, "; allowed: ", allowed);
      }
  }

  Value const& required(Value const& object, std::string_view field, std::string_view what) const {
    Value const* value = object.find(field);
    if (!value) fail(object, what, " has no \"", field, "\"");
    return *value;
  }

  int integer(Value const& value, std::string_view field, int64_t lo, int64_t hi) const {
    if (!value.is_integer())
      fail(value, field, " must be an integer, not ",
           value.is(Kind::number) ? value.text : json::kind_name(value.kind));
    int64_t const v = value.integer();
    if (v < lo || v > hi) fail(value, field, "=", v, " is outside [", lo, ", ", hi, "]");
    return static_cast<int>(v);
  }

  double number(Value const& value, std::string_view field) const {
    expect_kind(value, Kind::number, field);
    if (!std::isfinite(value.number) || value.number < 0)
      fail(value, field, "=", value.text, " must be a finite number >= 0");
    return value.number;
  }

  std::string string(Value const& value, std::string_view field) const {
    expect_kind(value, Kind::string, field);
    return value.text;
  }

 private:
  std::string const& source_;
  int entry_ = -1;
  std::string entry_description_;
};

TuningKey parse_key(Checker const& check, Value const& value) {
  check.expect_kind(value, Kind::object, "key");
  check.only_fields(value, {"gpu", "world", "hidden", "topk", "dispatch_format", "combine_format", "mode"}, "key");
  TuningKey key;
  Value const& gpu = check.required(value, "gpu", "key");
  key.gpu = canonical_gpu_name(check.string(gpu, "key.gpu"));
  if (key.gpu.empty()) check.fail(gpu, "key.gpu is empty");
  key.world = check.integer(check.required(value, "world", "key"), "key.world", 1, kMaxWorld);
  key.hidden = check.integer(check.required(value, "hidden", "key"), "key.hidden", 1, 1 << 20);
  key.topk = check.integer(check.required(value, "topk", "key"), "key.topk", 1, kMaxTopk);
  for (auto [field, out] :
       {std::pair{"dispatch_format", &key.dispatch_format}, std::pair{"combine_format", &key.combine_format}}) {
    Value const& format = check.required(value, field, "key");
    std::string const name = check.string(format, detail::concat("key.", field));
    try {
      *out = wire_format_name(parse_wire_format(name));
    } catch (ConfigError const&) {
      check.fail(format, "key.", field, "=\"", name,
                 "\" is not a wire format (bf16, fp8_e4m3, fp8_e4m3_ue8m0, nvfp4, mxfp4)");
    }
  }
  Value const& mode = check.required(value, "mode", "key");
  std::string const mode_text = check.string(mode, "key.mode");
  try {
    key.mode = mode_name(parse_mode(mode_text));
  } catch (ConfigError const&) {
    check.fail(mode, "key.mode=\"", mode_text, "\" is not a mode (normal, ll)");
  }
  return key;
}

std::vector<Bucket> parse_buckets(Checker const& check, Value const& value, Leg leg) {
  std::string const name = leg_name(leg);
  check.expect_kind(value, Kind::array, name);
  std::vector<Bucket> buckets;
  for (std::size_t i = 0; i < value.items.size(); ++i) {
    Value const& item = value.items[i];
    std::string const what = detail::concat(name, " bucket ", i);
    check.expect_kind(item, Kind::object, what);
    // NOTE: a row naming warps was written for a setting that does not exist: refused with the reason, not as a typo.
    if (Value const* warps = item.find("warps"))
      check.fail(*warps, what,
                 " has \"warps\", which was removed: every kernel runs 16 warps per CTA, so a row holds "
                 "blocks only; delete the field");
    check.only_fields(item, {"max_tokens", "blocks", "us"}, what);
    Bucket bucket;
    Value const& bound = check.required(item, "max_tokens", what);
    bucket.max_tokens = check.integer(bound, what + " max_tokens", 1, 1 << 30);
    bucket.geometry.blocks = check.integer(check.required(item, "blocks", what), what + " blocks", 1, 1 << 16);
    if (Value const* us = item.find("us")) bucket.us = check.number(*us, what + " us");
    // NOTE: buckets are half-open ranges (previous bound, bound]; a repeated or falling bound makes two rows claim
    // the same token counts, and only one of them could ever be used.
    if (!buckets.empty()) {
      int const previous = buckets.back().max_tokens;
      if (bucket.max_tokens == previous)
        check.fail(bound, what, " repeats max_tokens=", previous,
                   " of the bucket before it (overlapping buckets); "
                   "keep one row per bound");
      if (bucket.max_tokens < previous)
        check.fail(bound, what, " has max_tokens=", bucket.max_tokens, " below the previous bucket's ", previous,
                   " (unsorted buckets); sort the buckets by max_tokens, ascending");
    }
    buckets.push_back(bucket);
  }
  return buckets;
}

Provenance parse_provenance(Checker const& check, Value const& value) {
  check.expect_kind(value, Kind::object, "provenance");
  check.only_fields(value, {"tool", "commit", "date", "device", "rounds", "tolerance"}, "provenance");
  Provenance p;
  if (Value const* v = value.find("tool")) p.tool = check.string(*v, "provenance.tool");
  if (Value const* v = value.find("commit")) p.commit = check.string(*v, "provenance.commit");
  if (Value const* v = value.find("date")) p.date = check.string(*v, "provenance.date");
  if (Value const* v = value.find("device")) p.device = check.string(*v, "provenance.device");
  if (Value const* v = value.find("rounds")) p.rounds = check.integer(*v, "provenance.rounds", 0, 1 << 20);
  if (Value const* v = value.find("tolerance")) p.tolerance = check.number(*v, "provenance.tolerance");
  return p;
}

std::string format_number(double value) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", value);
  return buf;
}

void write_buckets(std::ostringstream& out, char const* name, std::vector<Bucket> const& buckets) {
  out << "      \"" << name << "\": [";
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    Bucket const& b = buckets[i];
    out << (i ? ",\n" : "\n") << "        {\"max_tokens\": " << b.max_tokens << ", \"blocks\": " << b.geometry.blocks;
    if (b.us) out << ", \"us\": " << format_number(*b.us);
    out << "}";
  }
  out << (buckets.empty() ? "]" : "\n      ]");
}

}  // namespace

char const* leg_name(Leg leg) {
  return leg == Leg::dispatch ? "dispatch" : "combine";
}

std::string canonical_gpu_name(std::string_view name) {
  std::string out;
  for (char c : name) {
    if (std::isspace(static_cast<unsigned char>(c))) {
      if (!out.empty() && out.back() != ' ') out += ' ';
    } else {
      out += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    }
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  if (out.rfind("NVIDIA ", 0) == 0) out = out.substr(7);
  for (auto const& [alias, model] : kGpuAliases)
    if (out == alias) return std::string(model);
  return out;
}

std::string table_file_stem(std::string_view gpu) {
  std::string out;
  for (char c : canonical_gpu_name(gpu)) {
    unsigned char const u = static_cast<unsigned char>(c);
    out += std::isalnum(u) ? static_cast<char>(std::tolower(u)) : '-';
  }
  return out.empty() ? std::string("unknown") : out;
}

std::string describe(TuningKey const& key) {
  return detail::concat(key.gpu, " world ", key.world, " hidden ", key.hidden, " topk ", key.topk, " ",
                        key.dispatch_format, "/", key.combine_format, " ", key.mode);
}

Table parse_table(std::string_view text, std::string const& source) {
  Value const root = json::parse(text, source);
  Checker check(source);
  check.expect_kind(root, Kind::object, "the table");
  check.only_fields(root, {"version", "comment", "entries"}, "the table");
  Value const& version = check.required(root, "version", "the table");
  if (!version.is_integer() || version.integer() != kTableVersion)
    check.fail(version, "version must be ", kTableVersion, " (this build reads tables of version ", kTableVersion, ")");
  Value const& entries = check.required(root, "entries", "the table");
  check.expect_kind(entries, Kind::array, "entries");

  Table table;
  table.source = source;
  if (Value const* comment = root.find("comment")) table.comment = check.string(*comment, "comment");
  std::map<std::string, int> seen;  // canonical key description -> entry index
  for (std::size_t i = 0; i < entries.items.size(); ++i) {
    Value const& item = entries.items[i];
    check.set_entry(static_cast<int>(i), "");
    check.expect_kind(item, Kind::object, "an entry");
    Entry entry;
    entry.key = parse_key(check, check.required(item, "key", "the entry"));
    check.set_entry(static_cast<int>(i), describe(entry.key));
    check.only_fields(item, {"key", "dispatch", "combine", "provenance"}, "an entry");
    // NOTE: the loader's half of the duplicate-key rule: two entries for one key (in any spelling of the GPU) would
    // leave one of them unused.
    if (auto const first = seen.find(describe(entry.key)); first != seen.end())
      check.fail(item.find("key") ? *item.find("key") : item, "duplicate key: entry ", first->second,
                 " has the same key; keep one entry per key");
    seen.emplace(describe(entry.key), static_cast<int>(i));
    if (Value const* v = item.find("dispatch")) entry.dispatch = parse_buckets(check, *v, Leg::dispatch);
    if (Value const* v = item.find("combine")) entry.combine = parse_buckets(check, *v, Leg::combine);
    // NOTE: a low-latency EpBuffer runs one grid for both legs, chosen by the dispatch buckets (cuda_ep.cu): combine
    // buckets there would never be read.
    if (entry.key.mode == mode_name(Mode::low_latency) && !entry.combine.empty())
      check.fail(*item.find("combine"),
                 "combine buckets in a mode \"ll\" entry are never read: a low-latency "
                 "EpBuffer runs one grid for both legs, chosen by the dispatch buckets; leave \"combine\" empty");
    if (Value const* v = item.find("provenance")) entry.provenance = parse_provenance(check, *v);
    table.entries.push_back(std::move(entry));
  }
  return table;
}

Table read_table_file(std::string const& path) {
  std::ifstream in(path, std::ios::binary);
  FERRY_CHECK_AS(ConfigError, "tuning", in.good(), "tuning table ", path, " cannot be read");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_table(text.str(), path);
}

std::string serialize_table(Table const& table) {
  std::ostringstream out;
  out << "{\n  \"version\": " << kTableVersion << ",\n";
  if (!table.comment.empty()) out << "  \"comment\": " << json::quote(table.comment) << ",\n";
  out << "  \"entries\": [";
  for (std::size_t i = 0; i < table.entries.size(); ++i) {
    Entry const& e = table.entries[i];
    TuningKey const& k = e.key;
    out << (i ? ",\n" : "\n") << "    {\n      \"key\": {\"gpu\": " << json::quote(k.gpu) << ", \"world\": " << k.world
        << ", \"hidden\": " << k.hidden << ", \"topk\": " << k.topk
        << ", \"dispatch_format\": " << json::quote(k.dispatch_format)
        << ", \"combine_format\": " << json::quote(k.combine_format) << ", \"mode\": " << json::quote(k.mode) << "},\n";
    write_buckets(out, "dispatch", e.dispatch);
    out << ",\n";
    write_buckets(out, "combine", e.combine);
    if (e.provenance) {
      Provenance const& p = *e.provenance;
      out << ",\n      \"provenance\": {\"tool\": " << json::quote(p.tool) << ", \"commit\": " << json::quote(p.commit)
          << ", \"date\": " << json::quote(p.date) << ", \"device\": " << json::quote(p.device)
          << ", \"rounds\": " << p.rounds << ", \"tolerance\": " << format_number(p.tolerance) << "}";
    }
    out << "\n    }";
  }
  out << (table.entries.empty() ? "]\n}\n" : "\n  ]\n}\n");
  return out.str();
}

void write_table_file(std::string const& path, Table const& table) {
  std::string const text = serialize_table(table);
  // NOTE: check what we are about to write with the same loader that will read it.
  parse_table(text, path);
  std::string const temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    FERRY_CHECK_AS(ConfigError, "tuning", out.good(), "tuning table ", temporary, " cannot be written");
    out << text;
    out.close();
    FERRY_CHECK_AS(ConfigError, "tuning", out.good(), "writing tuning table ", temporary, " failed");
  }
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  FERRY_CHECK_AS(ConfigError, "tuning", !error, "renaming ", temporary, " to ", path, " failed: ", error.message());
}

Table merge_entry(Table table, Entry const& entry) {
  TuningKey key = entry.key;
  key.gpu = canonical_gpu_name(key.gpu);
  for (Entry& existing : table.entries) {
    if (!(existing.key == key)) continue;
    for (Leg leg : {Leg::dispatch, Leg::combine}) {
      std::vector<Bucket>& rows = existing.buckets(leg);
      for (Bucket const& fresh : entry.buckets(leg)) {
        auto const same =
            std::find_if(rows.begin(), rows.end(), [&](Bucket const& b) { return b.max_tokens == fresh.max_tokens; });
        if (same != rows.end())
          *same = fresh;
        else
          rows.push_back(fresh);
      }
      std::sort(rows.begin(), rows.end(), [](Bucket const& a, Bucket const& b) { return a.max_tokens < b.max_tokens; });
    }
    if (entry.provenance) existing.provenance = entry.provenance;
    return table;
  }
  Entry added = entry;
  added.key = key;
  for (Leg leg : {Leg::dispatch, Leg::combine})
    std::sort(added.buckets(leg).begin(), added.buckets(leg).end(),
              [](Bucket const& a, Bucket const& b) { return a.max_tokens < b.max_tokens; });
  table.entries.push_back(std::move(added));
  return table;
}

BucketMatch match_bucket(std::vector<Bucket> const& buckets, int num_tokens) {
  if (buckets.empty()) return {};
  for (Bucket const& bucket : buckets)
    if (num_tokens <= bucket.max_tokens) return {&bucket, false};
  return {&buckets.back(), true};
}

std::optional<TableSet::Found> TableSet::find(TuningKey const& key) const {
  TuningKey wanted = key;
  wanted.gpu = canonical_gpu_name(key.gpu);
  for (Table const& table : tables)
    for (std::size_t i = 0; i < table.entries.size(); ++i)
      if (table.entries[i].key == wanted) return Found{&table.entries[i], detail::concat(table.source, " entry ", i)};
  return std::nullopt;
}

TableSet TableSet::from_tables(std::string origin, std::vector<Table> tables) {
  std::map<std::string, std::string> seen;  // key -> "file entry i"
  for (Table const& table : tables)
    for (std::size_t i = 0; i < table.entries.size(); ++i) {
      std::string const key = describe(table.entries[i].key);
      std::string const here = detail::concat(table.source, " entry ", i);
      auto const [first, fresh] = seen.emplace(key, here);
      FERRY_CHECK_AS(ConfigError, "tuning", fresh, "duplicate key ", key, ": ", here, " and ", first->second, " (",
                     origin, "); keep one entry per key");
    }
  return TableSet{std::move(origin), std::move(tables)};
}

TableSet TableSet::from_directory(std::string const& dir) {
  namespace fs = std::filesystem;
  std::error_code error;
  FERRY_CHECK_AS(ConfigError, "tuning", fs::is_directory(dir, error), "FERRY_TUNING_DIR=", dir,
                 " is not a directory; point it at a folder of tuning tables (*.json) or unset it");
  std::vector<std::string> paths;
  for (fs::directory_entry const& file : fs::directory_iterator(dir, error))
    if (file.path().extension() == ".json" && file.is_regular_file()) paths.push_back(file.path().string());
  FERRY_CHECK_AS(ConfigError, "tuning", !error, "FERRY_TUNING_DIR=", dir, " cannot be listed: ", error.message());
  std::sort(paths.begin(), paths.end());
  std::vector<Table> tables;
  for (std::string const& path : paths) tables.push_back(read_table_file(path));
  return from_tables("FERRY_TUNING_DIR=" + dir, std::move(tables));
}

TableSet TableSet::builtin() {
  std::vector<Table> tables;
  for (EmbeddedFile const& file : embedded_tables())
    tables.push_back(parse_table(std::string_view(reinterpret_cast<char const*>(file.data), file.size),
                                 std::string("builtin:") + file.name));
  return from_tables("the compiled-in tables", std::move(tables));
}

std::shared_ptr<TableSet const> active_tables() {
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<TableSet const>> loaded;
  std::string const dir = env_string("FERRY_TUNING_DIR");
  std::lock_guard<std::mutex> lock(mutex);
  if (auto const it = loaded.find(dir); it != loaded.end()) return it->second;
  auto set = std::make_shared<TableSet const>(dir.empty() ? TableSet::builtin() : TableSet::from_directory(dir));
  loaded.emplace(dir, set);
  return set;
}

}  // namespace ferry::tuning
