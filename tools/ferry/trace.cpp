// ferry trace: decodes the in-kernel traces `ferry bench --trace DIR` wrote (one pair of files per case, rank and
// kernel), writes a Chrome / Perfetto trace per case and prints the per-phase table. --selftest times the decoder on
// a worst-case synthetic buffer instead.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include "commands.hpp"
#include "ferry/error.hpp"
#include "options.hpp"
#include "trace/decode.hpp"
#include "trace/synthetic.hpp"
#include "trace/trace_file.hpp"

namespace ferry::cli {
namespace {

Options make_options() {
  return Options(
      "trace",
      "Decodes the in-kernel traces written by `ferry bench --trace DIR` (builds with -DFERRY_TRACE=ON):\n"
      "writes DIR/trace.json (Chrome / Perfetto: pid = rank, tid = cta * warps + warp; one file per case,\n"
      "DIR/trace.CASE.json, when DIR holds several) and prints, per phase, the time a warp spends in it,\n"
      "its extent on the GPU and its share of the kernel's window, min / median / max over ranks.",
      {
          {"dir", "", "folder written by ferry bench --trace"},
          {"out", "", "Chrome trace file (default DIR/trace.json; with several cases DIR/trace.CASE.json)"},
          {"align", "first", "t = 0 of each rank: first (its first event) | slot (first end of --align-slot) | raw"},
          {"align-slot", "dispatch.wait_counts", "phase whose first end aligns the ranks (--align slot)"},
          {"per-cta", "",
           "a phase (e.g. combine.push): also print its spans per rank and CTA (count, median, first "
           "begin, last end)"},
          {"selftest", "", "time the decoder on a worst-case synthetic buffer (no input)", true},
          {"warps", "4096", "--selftest: warps of the synthetic buffer"},
          {"events", "16384", "--selftest: events per warp of the synthetic buffer"},
      });
}

trace::TraceSlot parse_slot(std::string const& option, std::string const& name) {
  std::vector<std::string> const names = trace::slot_names();
  std::string allowed;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return static_cast<trace::TraceSlot>(i);
    allowed += (i ? ", " : "") + names[i];
  }
  FERRY_THROW(ConfigError, "config", "--", option, " ", name, " is not a phase; use one of ", allowed);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int selftest(Options const& options) {
  int const warps = options.integer("warps");
  int const events = options.integer("events");
  constexpr int kWarpsPerCta = 16;
  FERRY_CHECK_CONFIG(warps >= kWarpsPerCta && warps % kWarpsPerCta == 0 && warps / kWarpsPerCta <= trace::kMaxCtas,
                     "--warps=", warps, " must be a multiple of ", kWarpsPerCta, " up to ",
                     trace::kMaxCtas * kWarpsPerCta);
  FERRY_CHECK_CONFIG(events >= 2 && events <= (1 << 24), "--events=", events, " is outside [2, 16777216]");
  std::printf("ferry trace --selftest: %d warps x %d events (%.1f MiB of events)\n", warps, events,
              static_cast<double>(warps) * events * sizeof(TraceEvent) / (1 << 20));
  std::vector<TraceBuffer> buffers;
  buffers.push_back(trace::synthetic_trace(0, TraceKernel::dispatch, warps / kWarpsPerCta, kWarpsPerCta, events, 0));
  auto start = std::chrono::steady_clock::now();
  std::clock_t const cpu_start = std::clock();
  trace::Decoded const decoded = trace::decode(buffers);
  double const decode_s = seconds_since(start);
  // NOTE: CPU time of every thread together, so a result on a shared machine can still be judged.
  double const decode_cpu_s = static_cast<double>(std::clock() - cpu_start) / CLOCKS_PER_SEC;
  start = std::chrono::steady_clock::now();
  trace::PhaseTable const table = trace::phase_table(decoded);
  double const table_s = seconds_since(start);
  std::fputs(trace::format_phase_table(table, decoded).c_str(), stdout);
  int64_t const expected_spans = static_cast<int64_t>(warps) * (events / 2);
  bool const ok = static_cast<int64_t>(decoded.spans.size()) == expected_spans && decoded.bad_events == 0 &&
                  decoded.orphan_ends == 0 && decoded.orphan_begins == static_cast<int64_t>(warps) * (events % 2);
  std::printf(
      "decode %.3f s wall, %.3f s cpu over %u hardware threads (%.1f M events/s), phase table %.3f s, %zu "
      "spans: %s\n",
      decode_s, decode_cpu_s, std::max(1u, std::thread::hardware_concurrency()),
      static_cast<double>(decoded.events) / decode_s / 1e6, table_s, decoded.spans.size(),
      ok ? "ok" : "WRONG (spans or counters differ from the synthetic content)");
  return ok ? 0 : 1;
}

int decode_dir(Options const& options) {
  std::string const dir = options.str("dir");
  FERRY_CHECK_CONFIG(!dir.empty(), "ferry trace needs --dir DIR (written by ferry bench --trace DIR) or --selftest");
  trace::DecodeOptions decode_options;
  decode_options.align = trace::parse_align(options.str("align"));
  decode_options.align_slot = parse_slot("align-slot", options.str("align-slot"));
  std::optional<trace::TraceSlot> per_cta;
  if (!options.str("per-cta").empty()) per_cta = parse_slot("per-cta", options.str("per-cta"));
  auto const cases = trace::read_trace_dir(dir);
  FERRY_CHECK_CONFIG(!cases.empty(), "no trace files (*.json with \"format\": \"ferry-trace\") in ", dir,
                     "; write them with ferry bench --trace ", dir, " (a build with -DFERRY_TRACE=ON)");
  FERRY_CHECK_CONFIG(options.str("out").empty() || cases.size() == 1, "--out names one file but ", dir, " holds ",
                     cases.size(), " cases; leave --out unset to write DIR/trace.CASE.json per case");
  for (auto const& [label, buffers] : cases) {
    trace::Decoded const decoded = trace::decode(buffers, decode_options);
    std::string out = options.str("out");
    if (out.empty())
      out = (std::filesystem::path(dir) / (cases.size() == 1 ? "trace.json" : "trace." + label + ".json")).string();
    std::ofstream file(out);
    FERRY_CHECK_CONFIG(file.good(), "--out ", out, " cannot be written");
    trace::write_chrome_json(file, decoded);
    file.close();
    FERRY_CHECK_CONFIG(file.good(), "--out ", out, " could not be written completely");
    std::printf("\n%s: %zu buffers, aligned on %s; wrote %s (%zu spans, %zu instants)\n", label.c_str(), buffers.size(),
                trace::align_name(decode_options.align), out.c_str(), decoded.spans.size(), decoded.instants.size());
    std::fputs(trace::format_phase_table(trace::phase_table(decoded), decoded).c_str(), stdout);
    if (per_cta) std::fputs(trace::format_cta_table(trace::cta_table(decoded, *per_cta), *per_cta).c_str(), stdout);
  }
  return 0;
}

}  // namespace

int trace_main(int argc, char** argv) {
  Options options = make_options();
  if (!options.parse(argc, argv)) return 0;
  if (options.flag("selftest")) return selftest(options);
  return decode_dir(options);
}

}  // namespace ferry::cli
