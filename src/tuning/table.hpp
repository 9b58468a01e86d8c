// Tuning tables: launch geometries measured by `ferry tune`, stored as JSON data (src/tuning/tables/*.json, format in
// docs/tuning.md). Host-only; compiled everywhere.
//
// A table holds entries keyed by (GPU model, world, hidden, topk, dispatch format, combine format, mode); an entry
// holds, per leg, token buckets sorted by their inclusive upper bound, each with a CTA count (a mode "ll" entry has
// dispatch buckets only: its grid serves both legs). The loader refuses anything ambiguous, unknown or unread: a key
// repeated in one JSON object (json.hpp), an entry key repeated in one table or across the tables of one directory,
// buckets unsorted or repeated, unknown fields (a bucket's "warps" with the reason it is not a setting), combine
// buckets in a mode "ll" entry, wrong types, out-of-range values.
// Every error names the file, the entry and (for JSON errors) the line and column.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/limits.hpp"
#include "ferry/mode.hpp"
#include "ferry/tuning.hpp"
#include "ferry/wire_format.hpp"

namespace ferry::tuning {

enum class Leg { dispatch, combine };
char const* leg_name(Leg leg);

// Canonical spelling of a GPU model: "NVIDIA H200", "H200", "h200" and " nvidia  h200 " all give "H200". Drops a
// leading "NVIDIA", upper-cases, collapses runs of spaces, then applies the alias list of table.cpp (marketing names
// of one model, e.g. "H100 80GB HBM3" -> "H100").
std::string canonical_gpu_name(std::string_view name);
// File name stem for a GPU's table: "H200" -> "h200".
std::string table_file_stem(std::string_view gpu);

struct TuningKey {
  std::string gpu;  // canonical_gpu_name()
  int world = 0;
  int hidden = 0;
  int topk = 0;
  std::string dispatch_format;  // wire_format_name()
  std::string combine_format;
  std::string mode;  // mode_name(): "normal" | "ll"
  bool operator==(TuningKey const&) const = default;
};
// The key of an EpBuffer's config: detail::tuning_key (src/ep/tuning_key.hpp; the ep layer knows EpConfig).
// "H200 world 8 hidden 7168 topk 8 bf16/bf16 normal"
std::string describe(TuningKey const& key);

struct Bucket {
  int max_tokens = 0;        // upper bound of the bucket, inclusive; the bucket starts past the previous one's bound
  Geometry geometry;         // blocks >= 1
  std::optional<double> us;  // median of the chosen geometry when tuned (the slower routing); informational
  bool operator==(Bucket const&) const = default;
};

// Where an entry's numbers came from (written by `ferry tune`, informational).
struct Provenance {
  std::string tool;      // "ferry tune 0.1.0"
  std::string commit;    // git commit of the build that measured
  std::string date;      // ISO 8601, UTC
  std::string device;    // the device name as the driver reports it
  int rounds = 0;        // sweep rounds
  double tolerance = 0;  // the picker's tolerance
  bool operator==(Provenance const&) const = default;
};

struct Entry {
  TuningKey key;
  std::vector<Bucket> dispatch;
  std::vector<Bucket> combine;
  std::optional<Provenance> provenance;
  std::vector<Bucket> const& buckets(Leg leg) const { return leg == Leg::dispatch ? dispatch : combine; }
  std::vector<Bucket>& buckets(Leg leg) { return leg == Leg::dispatch ? dispatch : combine; }
  bool operator==(Entry const&) const = default;
};

struct Table {
  std::string source;   // the file it came from: a path, or "builtin:h200.json" for a compiled-in copy
  std::string comment;  // the optional top-level "comment" (kept by merges)
  std::vector<Entry> entries;
};

// Parses and checks one table. Throws ConfigError naming `source`, the entry (index and key) and what is wrong.
Table parse_table(std::string_view text, std::string const& source);
// Reads and parses a file. Throws ConfigError when it cannot be read or does not check.
Table read_table_file(std::string const& path);
// The canonical text of a table (what `ferry tune` writes): two-space indent, entries in table order, fields in a
// fixed order. parse_table(serialize_table(t)) == t, and serializing twice gives the same bytes.
std::string serialize_table(Table const& table);
// Writes serialize_table() to path through a temporary file and a rename, so a reader never sees half a table.
void write_table_file(std::string const& path, Table const& table);

// Merges a freshly tuned entry into a table: an entry with the same key gets the new buckets (a bucket with the same
// bound is replaced, others are kept; sorted by bound) and the new provenance; otherwise the entry is appended.
// Other entries are not touched. Merging the same entry twice gives the same table.
Table merge_entry(Table table, Entry const& entry);

// The bucket for num_tokens: the first whose bound is >= num_tokens, else (past the largest bound) the last one,
// flagged nearest. nullptr for an empty list.
struct BucketMatch {
  Bucket const* bucket = nullptr;
  bool nearest = false;
};
BucketMatch match_bucket(std::vector<Bucket> const& buckets, int num_tokens);

// The tables of one origin (a directory, or the compiled-in copies), checked together: an entry key in two files is
// refused, naming both.
struct TableSet {
  std::string origin;  // "FERRY_TUNING_DIR=/path" or "the compiled-in tables"
  std::vector<Table> tables;

  struct Found {
    Entry const* entry = nullptr;
    std::string where;  // "builtin:h200.json entry 3"
  };
  std::optional<Found> find(TuningKey const& key) const;

  // Throws ConfigError for a key present in two of the tables.
  static TableSet from_tables(std::string origin, std::vector<Table> tables);
  // Every *.json file of dir, in name order. Throws ConfigError if dir is not a readable directory.
  static TableSet from_directory(std::string const& dir);
  // The copies of src/tuning/tables/*.json embedded at build time.
  static TableSet builtin();
};

// The tables in force: FERRY_TUNING_DIR's when it is set, else the compiled-in copies. Loaded (and checked) once per
// value of FERRY_TUNING_DIR; thread-safe. Throws ConfigError for a table that does not check.
std::shared_ptr<TableSet const> active_tables();

}  // namespace ferry::tuning
