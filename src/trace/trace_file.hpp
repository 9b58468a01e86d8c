// Trace files: what `ferry bench --trace DIR` writes and `ferry trace --dir DIR` reads. One pair of files per
// (case, rank, kernel): LABEL.rankR.KERNEL.bin holds the raw buffers (the counts as little-endian uint32, then the
// events as 16-byte records: time_ns, meta, both little-endian uint64), LABEL.rankR.KERNEL.json a small header:
//   {"format": "ferry-trace", "version": 1, "label": "...", "rank": R, "kernel": "dispatch", "ctas": C,
//    "warps_per_cta": W, "capacity": N, "data": "LABEL.rankR.KERNEL.bin", "slots": ["dispatch.layout", ...]}
// The slot names travel with the data so a decoder built from another slot table refuses the file instead of
// mislabelling it.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "ferry/trace.hpp"

namespace ferry::trace {

// Writes buffer's two files into dir (created if missing). label names the case ("normal-random-4096"); letters,
// digits, '-', '_' and '.' only. Throws ConfigError when a file cannot be written.
void write_trace_files(std::string const& dir, std::string const& label, TraceBuffer const& buffer);

// Every trace in dir, grouped by label (each group ordered by rank, then kernel). Throws ConfigError for a header
// that does not parse, a slot table that differs from this build's, or a data file of the wrong size.
std::map<std::string, std::vector<TraceBuffer>> read_trace_dir(std::string const& dir);

}  // namespace ferry::trace
