// ferry tune: measures normal-mode dispatch and combine over candidate launch geometries, per token bucket, under
// several routings, picks per bucket the fewest blocks within --tolerance of the best under every routing
// (tuning/picker.hpp), and merges the picks into a tuning table (tuning/table.hpp) without touching its other
// entries. `--verify` re-measures a table's rows against the sweep's best instead of writing.
//
// Normal mode: candidates are applied through FERRY_{DISPATCH,COMBINE}_BLOCKS, which the plan functions read at every
// call (ahead of the table, behind an EpConfig pin, which tune never sets), so one EpBuffer serves every candidate.
// Low-latency mode: an EpBuffer's CTA count is fixed when it is created (its arrival counters count CTAs) and serves
// both legs, so each (bucket, candidate) gets its own EpBuffer with the geometry pinned, bucket = its
// max_tokens_per_rank, and one geometry is picked per bucket on the sum of the two legs and written as the entry's
// dispatch row (the only one a low-latency EpBuffer reads; its entry has no combine rows).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <memory>
#include <random>
#include <set>
#include <sstream>

#include "bench_memory.hpp"
#include "build_info.hpp"
#include "commands.hpp"
#include "ferry/env.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "options.hpp"
#include "ranks.hpp"
#include "tuning/picker.hpp"
#include "ep/tuning_key.hpp"
#include "tuning/table.hpp"
#include "core/util/result_file.hpp"
#include "workloads/routing.hpp"
#if FERRY_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#ifndef FERRY_SOURCE_DIR
#define FERRY_SOURCE_DIR ""
#endif

namespace ferry::cli {
namespace {

using bench::BenchMemory;
using tuning::Leg;

constexpr int kCpuDefaultRanks = 2;
// The cpu backend has no SMs and ignores the geometry: candidates are nominal, derived from this pretend SM count.
constexpr int kCpuNominalSms = 8;
constexpr Leg kLegs[] = {Leg::dispatch, Leg::combine};

Options make_options() {
  return Options(
      "tune",
      "Sweeps the CTA counts (blocks) of normal-mode dispatch and combine per token bucket under each routing,\n"
      "scores each by its median (CUDA events around graph replays; slowest rank), and per bucket picks the fewest\n"
      "blocks within --tolerance of the best under every routing (--mode ll: one grid for both legs, scored on their\n"
      "sum, written as the dispatch row).\n"
      "Merges the picks into --table (other entries untouched) and prints them. --verify re-measures the table's\n"
      "rows for this shape against the sweep's best and prints the ratio per bucket. On the cpu backend the geometry\n"
      "has no effect: a cpu run exercises the machinery only. See docs/tuning.md.",
      {
          {"tokens", "128,256,512,1024,2048,4096",
           "token buckets (inclusive upper bounds), each measured at its bound (--mode ll: the default stops at 1024)"},
          {"hidden", "7168", "elements per row"},
          {"topk", "8", "routed experts per token"},
          {"experts", "256", "global experts (divisible by the number of ranks)"},
          {"dispatch", "bf16", "dispatch wire format"},
          {"combine", "bf16", "combine wire format"},
          {"mode", "normal", "normal | ll (low-latency: a bucket is an EpBuffer's max_tokens_per_rank)"},
          {"routing", "random,grouped", "routings a pick must be near-best under (comma-separated)"},
          {"expert-groups", "8", "grouped routing: groups of experts"},
          {"topk-groups", "4", "grouped routing: groups a token may use"},
          {"blocks", "", "candidate CTA counts, comma-separated (unset: fractions 1/16..1 of the SM count)"},
          {"rounds", "3", "sweep rounds; each visits every candidate once (drift spreads over all of them)"},
          {"warmup", "3", "untimed replays per candidate and round"},
          {"iters", "10", "timed replays per candidate and round (score: median over all rounds)"},
          {"graph-calls", "10", "consecutive calls of a leg per graph replay (as ferry bench --graph-calls)"},
          {"tolerance", "0.03", "a pick may be this much slower than the best (fraction) under every routing"},
          {"graph", "auto", "time CUDA-graph replays: auto (on for cuda, off for cpu) | on | off"},
          {"table", "", "table file (unset: $FERRY_TUNING_DIR/<gpu>.json, else the source tree's src/tuning/tables/)"},
          {"verify", "", "re-measure the table's rows for this shape instead of tuning; exit 3 if one fails", true},
          {"verify-tolerance", "0.05", "--verify: a row passes within this fraction of the sweep's best"},
          {"dry-run", "", "print the picks and the merged entry without writing the table", true},
          {"backend", "auto", "auto (cuda when a GPU is visible, else cpu) | cuda | cpu"},
          {"nproc", "0", "ranks to start (0: one per GPU, or 2 on the cpu backend)"},
          {"seed", "0", "input seed (0: a fresh random seed, printed)"},
      });
}

Backend choose_backend(Options const& options) {
  std::string const name = options.str("backend");
  if (name == "auto") return cuda_available() ? Backend::cuda : Backend::cpu;
  Backend const backend = parse_backend(name);
  FERRY_CHECK_CONFIG(backend != Backend::cuda || cuda_available(), "--backend cuda but no GPU is visible (or the cuda ",
                     "backend is not built); use --backend cpu");
  return backend;
}

std::vector<std::string> split(std::string const& text) {
  std::vector<std::string> out;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

std::vector<RoutingKind> routing_kinds(Options const& options) {
  std::vector<RoutingKind> kinds;
  for (std::string const& name : split(options.str("routing"))) {
    RoutingKind const kind = parse_routing(name);
    FERRY_CHECK_CONFIG(std::find(kinds.begin(), kinds.end(), kind) == kinds.end(), "--routing lists ", name, " twice");
    kinds.push_back(kind);
  }
  FERRY_CHECK_CONFIG(!kinds.empty(), "--routing is empty; give at least one of random, ring, grouped, hot");
  return kinds;
}

// Sorted, distinct, positive.
std::vector<int> sorted_list(Options const& options, char const* name) {
  std::vector<int> values = options.int_list(name);
  std::sort(values.begin(), values.end());
  FERRY_CHECK_CONFIG(values.front() >= 1, "--", name, "=", options.str(name), " must list positive values");
  FERRY_CHECK_CONFIG(std::adjacent_find(values.begin(), values.end()) == values.end(), "--", name, "=",
                     options.str(name), " repeats a value");
  return values;
}

// The token buckets: --tokens, or, for --mode ll without it, the default buckets low-latency mode accepts (at most
// kMaxLowLatencyTokens per rank; the default list goes past it for normal mode).
std::vector<int> token_buckets(Options const& options) {
  std::vector<int> values = sorted_list(options, "tokens");
  if (!options.given("tokens") && parse_mode(options.str("mode")) == Mode::low_latency)
    std::erase_if(values, [](int tokens) { return tokens > kMaxLowLatencyTokens; });
  return values;
}

EpConfig make_config(Options const& options, int world, int max_tokens) {
  EpConfig config;
  config.hidden = options.integer("hidden");
  config.num_experts = options.integer("experts");
  config.topk = options.integer("topk");
  config.max_tokens_per_rank = max_tokens;
  config.mode = parse_mode(options.str("mode"));
  config.dispatch_format = parse_wire_format(options.str("dispatch"));
  config.combine_format = parse_wire_format(options.str("combine"));
  config.validate(world);
  return config;
}

RoutingOptions make_routing(Options const& options, RoutingKind kind, uint64_t seed) {
  RoutingOptions routing;
  routing.kind = kind;
  routing.expert_groups = options.integer("expert-groups");
  routing.topk_groups = options.integer("topk-groups");
  routing.seed = seed;
  return routing;
}

// Candidate CTA counts from the SM count: fractions 1/16 .. 1 rounded to even counts (at least 2), and the SM count.
std::vector<int> default_blocks(int sms) {
  std::set<int> blocks;
  for (double fraction : {1.0 / 16, 1.0 / 8, 1.0 / 6, 1.0 / 4, 1.0 / 3, 1.0 / 2, 2.0 / 3, 3.0 / 4})
    blocks.insert(std::clamp(static_cast<int>(std::lround(sms * fraction / 2)) * 2, 2, sms));
  blocks.insert(sms);
  return {blocks.begin(), blocks.end()};
}

double median(std::vector<double> samples) {
  FERRY_CHECK(!samples.empty(), "no timed replays (--iters must be at least 1)");
  std::sort(samples.begin(), samples.end());
  std::size_t const n = samples.size();
  return n % 2 ? samples[n / 2] : 0.5 * (samples[n / 2 - 1] + samples[n / 2]);
}

// Sets (or clears, for 0) the variables the plan functions read at every call.
void apply_candidate(Geometry geometry) {
  std::string const blocks = std::to_string(geometry.blocks);
  for (char const* name : {"FERRY_DISPATCH_BLOCKS", "FERRY_COMBINE_BLOCKS"})
    geometry.blocks > 0 ? setenv(name, blocks.c_str(), 1) : unsetenv(name);
}

std::string table_path(Options const& options, std::string const& gpu) {
  if (!options.str("table").empty()) return options.str("table");
  std::string const file = tuning::table_file_stem(gpu) + ".json";
  if (std::string const dir = env_string("FERRY_TUNING_DIR"); !dir.empty()) return dir + "/" + file;
  std::string const source_tables = std::string(FERRY_SOURCE_DIR) + "/src/tuning/tables";
  FERRY_CHECK_CONFIG(!std::string(FERRY_SOURCE_DIR).empty() && std::filesystem::is_directory(source_tables),
                     "no table to write: the source tree this ferry was built from (", source_tables,
                     ") is not here; give --table FILE or set FERRY_TUNING_DIR");
  return source_tables + "/" + file;
}

struct Sweep {
  std::vector<int> buckets;
  std::vector<RoutingKind> routings;
  std::vector<Geometry> candidates;
};

// What the run's options resolve to on this machine. read_settings checks every option that needs no communicator
// (the launching process calls it before any rank starts, so a bad option is one error line, not one per rank; each
// rank calls it again).
struct Settings {
  bool graph = false;
  int rounds = 0, warmup = 0, iters = 0, graph_calls = 0;
  double tolerance = 0;
  int sms = kCpuNominalSms;  // the GPU's (cuda), nominal on cpu
  std::vector<int> blocks;   // the candidates
};

Settings read_settings(Options const& options, Backend backend, int device) {
  Settings s;
  std::string const graph_option = options.str("graph");
  FERRY_CHECK_CONFIG(graph_option == "auto" || graph_option == "on" || graph_option == "off", "--graph=", graph_option,
                     " is unknown; use auto, on or off");
  s.graph = graph_option == "on" || (graph_option == "auto" && backend == Backend::cuda);
  FERRY_CHECK_CONFIG(!s.graph || backend == Backend::cuda, "--graph on needs the cuda backend");
  s.rounds = options.integer("rounds");
  s.warmup = options.integer("warmup");
  s.iters = options.integer("iters");
  s.graph_calls = options.integer("graph-calls");
  s.tolerance = options.number("tolerance");
  FERRY_CHECK_CONFIG(s.rounds >= 1 && s.iters >= 1 && s.warmup >= 0,
                     "--rounds and --iters must be at least 1, --warmup 0");
  FERRY_CHECK_CONFIG(s.graph_calls >= 1, "--graph-calls=", s.graph_calls, " must be at least 1");
  FERRY_CHECK_CONFIG(s.tolerance >= 0 && s.tolerance < 1, "--tolerance=", s.tolerance, " must be in [0, 1)");
  double const verify_tolerance = options.number("verify-tolerance");
  FERRY_CHECK_CONFIG(verify_tolerance >= 0, "--verify-tolerance=", verify_tolerance, " must be 0 or more");
#if FERRY_HAVE_CUDA
  if (backend == Backend::cuda) cudaDeviceGetAttribute(&s.sms, cudaDevAttrMultiProcessorCount, device);
#else
  (void)device;
#endif
  s.blocks = options.str("blocks").empty() ? default_blocks(s.sms) : sorted_list(options, "blocks");
  for (int b : s.blocks)
    FERRY_CHECK_CONFIG(backend == Backend::cpu || b <= s.sms, "--blocks lists ", b, ", more than the ", s.sms,
                       " SMs (the grids are persistent: at most one CTA per SM)");
  return s;
}

// The tuning run: what its steps share. start_tune sets it up (collective: every rank makes the communicator, reads
// the table under --verify and learns the seed).
struct TuneRun {
  Options const& options;
  Backend backend = Backend::cpu;
  std::shared_ptr<Communicator> comm;
  int world = 0, rank = 0;
  bool verify = false;
  bool ll = false;
  Settings settings;
  std::string device, gpu, path;  // the device's name, its canonical GPU name, the table file
  tuning::TuningKey key;
  Sweep sweep;
  std::optional<tuning::Entry> verified;  // --verify: the table's entry for this shape
  uint64_t seed = 0;
};

// --verify: the table's entry for the run's key; its buckets are the sweep's, and its rows are candidates too.
void plan_verify(TuneRun& run) {
  tuning::Table const table = tuning::read_table_file(run.path);
  for (tuning::Entry const& entry : table.entries)
    if (entry.key == run.key) run.verified = entry;
  FERRY_CHECK_CONFIG(run.verified.has_value(), "--verify: ", run.path, " has no entry for ", tuning::describe(run.key),
                     "; run ferry tune without --verify first");
  std::set<int> bounds;
  std::vector<Geometry>& candidates = run.sweep.candidates;
  for (Leg leg : kLegs)
    for (tuning::Bucket const& bucket : run.verified->buckets(leg)) {
      bounds.insert(bucket.max_tokens);
      if (std::find(candidates.begin(), candidates.end(), bucket.geometry) == candidates.end())
        candidates.push_back(bucket.geometry);
    }
  run.sweep.buckets.assign(bounds.begin(), bounds.end());
}

// 1. the device, its candidates, the table and the buckets; one seed for every rank (rank 0 draws it or takes
//    --seed and broadcasts it)
TuneRun start_tune(Options const& options) {
  TuneRun run{options};
  run.backend = choose_backend(options);
  run.comm = std::shared_ptr<Communicator>(
      Communicator::create(make_socket_bootstrap(socket_bootstrap_options_from_env()), {run.backend}));
  run.world = run.comm->world();
  run.rank = run.comm->rank();
  run.verify = options.flag("verify");
  run.settings = read_settings(options, run.backend, run.comm->device());
  run.device = bench::device_name(run.backend);
  run.gpu = run.backend == Backend::cuda ? tuning::canonical_gpu_name(run.device) : std::string("CPU");
  run.path = table_path(options, run.gpu);
  run.sweep.routings = routing_kinds(options);
  for (int b : run.settings.blocks) run.sweep.candidates.push_back({b});
  EpConfig const probe = make_config(options, run.world, 1);
  run.ll = probe.mode == Mode::low_latency;
  run.key = detail::tuning_key(run.gpu, run.world, probe);
  if (run.verify)
    plan_verify(run);
  else
    run.sweep.buckets = token_buckets(options);
  FERRY_CHECK_CONFIG(!run.sweep.buckets.empty(), "--verify: the entry for ", tuning::describe(run.key),
                     " has no buckets");
  run.seed = static_cast<uint64_t>(options.integer("seed"));
  if (run.seed == 0) run.seed = (static_cast<uint64_t>(std::random_device{}()) << 20) ^ std::random_device{}();
  run.comm->bootstrap().broadcast(&run.seed, sizeof(run.seed), 0);
  return run;
}

void print_tune_header(TuneRun const& run) {
  Settings const& s = run.settings;
  std::printf("ferry tune%s: %d ranks, backend %s (%s), seed %llu, %s\n", run.verify ? " --verify" : "", run.world,
              backend_name(run.backend), run.device.c_str(), static_cast<unsigned long long>(run.seed),
              tuning::describe(run.key).c_str());
  std::printf("table %s\n", run.path.c_str());
  std::printf("%zu candidates (blocks ", run.sweep.candidates.size());
  for (std::size_t i = 0; i < s.blocks.size(); ++i) std::printf("%s%d", i ? "," : "", s.blocks[i]);
  std::printf(")%s, %zu buckets, %zu routings, %d rounds x (%d warmup + %d timed)%s\n",
              run.sweep.candidates.size() > s.blocks.size() ? " + the table's rows" : "", run.sweep.buckets.size(),
              run.sweep.routings.size(), s.rounds, s.warmup, s.iters, s.graph ? ", graph replays" : "");
  if (run.backend == Backend::cpu)
    std::printf(
        "notice: cpu backend: the launch geometry has no effect on the cpu reference backend; this run "
        "exercises the tuning machinery only and its picks mean nothing for a GPU\n");
  std::fflush(stdout);
}

// 2. this rank's tensors: inputs per routing for the largest bucket (a token's routing does not depend on the tokens
//    after it, so a bucket uses a prefix), the combine input and y.
struct TuneTensors {
  TuneTensors(TuneRun const& run);
  TuneTensors(TuneTensors const&) = delete;
  TuneTensors& operator=(TuneTensors const&) = delete;

  struct Inputs {
    void* x;
    void* idx;
    void* weights;
  };
  EpConfig config;  // of the largest bucket
  BenchMemory memory;
  std::size_t row_bytes;
  std::vector<Inputs> inputs;  // per routing
  void* combine_in = nullptr;
  void* y = nullptr;
};

TuneTensors::TuneTensors(TuneRun const& run)
    : config(make_config(run.options, run.world, run.sweep.buckets.back())),
      memory(run.backend),
      row_bytes(static_cast<std::size_t>(config.hidden) * 2) {
  int const world = run.world;
  int const max_tokens = run.sweep.buckets.back();
  for (RoutingKind kind : run.sweep.routings) {
    RoutingOptions const routing = make_routing(run.options, kind, run.seed + static_cast<uint64_t>(kind));
    validate_routing(routing, config.num_experts, world, config.topk);
    std::vector<uint16_t> const x = generate_tokens(routing.seed, run.rank, max_tokens, config.hidden);
    std::vector<int64_t> idx(static_cast<std::size_t>(max_tokens) * config.topk);
    std::vector<float> weights(idx.size());
    generate_routing(routing, config.num_experts, world, run.rank, max_tokens, config.topk, idx, weights);
    Inputs in{memory.alloc(x.size() * 2), memory.alloc(idx.size() * 8), memory.alloc(weights.size() * 4)};
    memory.upload(in.x, x.data(), x.size() * 2);
    memory.upload(in.idx, idx.data(), idx.size() * 8);
    memory.upload(in.weights, weights.data(), weights.size() * 4);
    inputs.push_back(in);
  }
  // the combine input: the bf16 rows received (rank-major in normal mode, expert-major in ll), or, when the dispatch
  // delivers quantized rows, bf16 rows of that count (combine's time does not depend on the values)
  std::size_t const combine_rows = run.ll
                                       ? static_cast<std::size_t>(config.num_local_experts(world)) * world * max_tokens
                                       : static_cast<std::size_t>(config.recv_capacity(world));
  combine_in = memory.alloc(combine_rows * row_bytes);
  memory.fill(combine_in, 0x3c, combine_rows * row_bytes);
  y = memory.alloc(static_cast<std::size_t>(max_tokens) * row_bytes);
}

// Every timed sample of the sweep: samples[bucket][routing][candidate][leg], flattened.
struct Samples {
  Samples(Sweep const& sweep)
      : routings(sweep.routings.size()),
        candidates(sweep.candidates.size()),
        values(sweep.buckets.size() * routings * candidates * 2) {}
  std::size_t slot(std::size_t b, std::size_t r, std::size_t c, int leg) const {
    return ((b * routings + r) * candidates + c) * 2 + static_cast<std::size_t>(leg);
  }
  std::size_t routings, candidates;
  std::vector<std::vector<double>> values;
};

// One eager dispatch of bucket b's tokens of routing r on `buffer`, then every leg of candidate c timed.
void measure(TuneRun const& run, TuneTensors& t, Samples& samples, EpBuffer& buffer, std::size_t b, std::size_t r,
             std::size_t c) {
  Settings const& s = run.settings;
  DispatchArgs dargs;
  dargs.x = t.inputs[r].x;
  dargs.num_tokens = run.sweep.buckets[b];
  dargs.topk_idx = t.inputs[r].idx;
  dargs.topk_idx_type = IndexType::int64;
  dargs.topk_weights = static_cast<float const*>(t.inputs[r].weights);
  DispatchResult const result = buffer.dispatch(dargs, t.memory.stream());
  if (!buffer.config().delivers_quantized()) {
    std::size_t const rows =
        run.ll ? static_cast<std::size_t>(buffer.config().num_local_experts(run.world)) * buffer.config().expert_slots()
               : static_cast<std::size_t>(result.num_recv_host);
    t.memory.copy(t.combine_in, run.ll ? result.expert_x : result.recv_x, rows * t.row_bytes);
  }
  t.memory.synchronize();
  CombineArgs cargs;
  cargs.layout = run.ll ? CombineLayout::expert_major : CombineLayout::rank_major;
  cargs.x = t.combine_in;
  cargs.y = t.y;
  dargs.eager = false;
  cargs.eager = false;
  auto const time_leg = [&](std::function<void()> const& enqueue, std::vector<double>& out) {
    std::vector<double> const timed =
        bench::time_leg(t.memory, *run.comm, enqueue, s.graph, s.warmup, s.iters, s.graph_calls);
    out.insert(out.end(), timed.begin(), timed.end());
  };
  time_leg([&] { buffer.dispatch(dargs, t.memory.stream()); }, samples.values[samples.slot(b, r, c, 0)]);
  time_leg([&] { buffer.combine(cargs, t.memory.stream()); }, samples.values[samples.slot(b, r, c, 1)]);
}

// Rank 0's progress line after each step of the sweep.
class Progress {
 public:
  Progress(TuneRun const& run, std::size_t steps) : run_(run), steps_(steps) {}
  void step(int round, std::size_t b, std::string const& what) {
    ++step_;
    if (run_.rank != 0) return;
    double const elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    std::printf("  [%3zu/%zu] round %d/%d  %5d tokens  %s  %.1f s\n", step_, steps_, round + 1, run_.settings.rounds,
                run_.sweep.buckets[b], what.c_str(), elapsed);
    std::fflush(stdout);
  }

 private:
  TuneRun const& run_;
  std::size_t steps_;
  std::size_t step_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// 3. the sweep. Normal mode: rounds outermost, so slow drift (clocks, temperature) touches every candidate alike; one
//    EpBuffer, candidates through the variables. ll: an EpBuffer per (bucket, candidate), rounds inside it.
Samples run_sweep(TuneRun const& run, TuneTensors& t) {
  Sweep const& sweep = run.sweep;
  int const rounds = run.settings.rounds;
  std::size_t const num_candidates = sweep.candidates.size();
  std::size_t const num_routings = sweep.routings.size();
  Samples samples(sweep);
  Progress progress(run, static_cast<std::size_t>(rounds) * sweep.buckets.size() * (run.ll ? num_candidates : 1));
  if (!run.ll) {
    EpBuffer buffer(run.comm, t.config);
    for (int round = 0; round < rounds; ++round)
      for (std::size_t b = 0; b < sweep.buckets.size(); ++b) {
        for (std::size_t r = 0; r < num_routings; ++r)
          for (std::size_t c = 0; c < num_candidates; ++c) {
            apply_candidate(sweep.candidates[c]);
            measure(run, t, samples, buffer, b, r, c);
          }
        apply_candidate({});
        progress.step(round, b, detail::concat(num_candidates, " candidates x ", num_routings, " routings"));
      }
    return samples;
  }
  for (std::size_t b = 0; b < sweep.buckets.size(); ++b)
    for (std::size_t c = 0; c < num_candidates; ++c) {
      EpConfig pinned = make_config(run.options, run.world, sweep.buckets[b]);
      pinned.dispatch_geometry = sweep.candidates[c];
      EpBuffer buffer(run.comm, pinned);
      for (int round = 0; round < rounds; ++round) {
        for (std::size_t r = 0; r < num_routings; ++r) measure(run, t, samples, buffer, b, r, c);
        progress.step(round, b,
                      detail::concat("blocks ", sweep.candidates[c].blocks, " x ", num_routings, " routings"));
      }
    }
  return samples;
}

// 4. scores: each rank's median, then the slowest rank's (a collective leg is as slow as its slowest member)
std::vector<double> slowest_medians(TuneRun const& run, Samples const& samples) {
  std::vector<double> mine(samples.values.size());
  for (std::size_t i = 0; i < samples.values.size(); ++i) mine[i] = median(samples.values[i]);
  std::vector<double> all(mine.size() * run.world);
  run.comm->bootstrap().allgather(mine.data(), all.data(), mine.size() * sizeof(double));
  std::vector<double> slowest(mine.size(), 0.0);
  for (int q = 0; q < run.world; ++q)
    for (std::size_t i = 0; i < mine.size(); ++i)
      slowest[i] = std::max(slowest[i], all[static_cast<std::size_t>(q) * mine.size() + i]);
  return slowest;
}

// --verify: the table's row of bucket `tokens` (if it has one) against the sweep's best; prints PASS or FAIL and
// returns whether it failed.
bool verify_row(TuneRun const& run, Leg leg, char const* label, int tokens, tuning::Pick const& pick,
                std::vector<tuning::Measurement> const& measured) {
  std::vector<tuning::Bucket> const& rows = run.verified->buckets(leg);
  auto const row =
      std::find_if(rows.begin(), rows.end(), [&](tuning::Bucket const& bucket) { return bucket.max_tokens == tokens; });
  if (row == rows.end()) return false;
  auto const it = std::find_if(measured.begin(), measured.end(),
                               [&](tuning::Measurement const& m) { return m.geometry == row->geometry; });
  FERRY_CHECK(it != measured.end(), "--verify: row blocks ", row->geometry.blocks, " was not measured");
  double ratio = 0;
  for (std::size_t r = 0; r < run.sweep.routings.size(); ++r) ratio = std::max(ratio, it->us[r] / pick.best_us[r]);
  bool const pass = ratio <= 1.0 + run.options.number("verify-tolerance");
  std::printf("  verify %-8s <=%-6d row blocks %d: %.3f x the best  %s\n", label, tokens, row->geometry.blocks, ratio,
              pass ? "PASS" : "FAIL");
  return !pass;
}

// 5. per bucket and leg (ll: one geometry serves both legs, scored on their sum): every candidate's scores, the pick,
//    and under --verify the table's row against the best; else the pick goes into `entry`. Returns the failed rows.
int report_picks(TuneRun const& run, Samples const& samples, std::vector<double> const& slowest, tuning::Entry& entry) {
  Sweep const& sweep = run.sweep;
  double const tolerance = run.settings.tolerance;
  int failures = 0;
  for (std::size_t b = 0; b < sweep.buckets.size(); ++b) {
    int const tokens = sweep.buckets[b];
    std::printf("\nbucket <=%d tokens\n  %-9s %6s", tokens, "leg", "blocks");
    for (RoutingKind kind : sweep.routings) std::printf(" %11s_us", routing_name(kind));
    std::printf(" %7s\n", "worst");
    for (int leg = 0; leg < (run.ll ? 1 : 2); ++leg) {
      char const* const label = run.ll ? "both legs" : tuning::leg_name(kLegs[leg]);
      std::vector<tuning::Measurement> measured;
      for (std::size_t c = 0; c < sweep.candidates.size(); ++c) {
        tuning::Measurement m{sweep.candidates[c], {}};
        for (std::size_t r = 0; r < sweep.routings.size(); ++r)
          m.us.push_back(run.ll ? slowest[samples.slot(b, r, c, 0)] + slowest[samples.slot(b, r, c, 1)]
                                : slowest[samples.slot(b, r, c, leg)]);
        measured.push_back(m);
      }
      tuning::Pick const pick = tuning::pick_geometry(measured, tolerance);
      for (tuning::Measurement const& m : measured) {
        double worst = 0;
        for (std::size_t r = 0; r < sweep.routings.size(); ++r) worst = std::max(worst, m.us[r] / pick.best_us[r]);
        std::printf("  %-9s %6d", label, m.geometry.blocks);
        for (double us : m.us) std::printf(" %14.1f", us);
        std::printf(" %7.3f%s\n", worst, m.geometry == pick.geometry ? "  <- pick" : "");
      }
      if (!pick.within_tolerance)
        std::printf(
            "  %s: no candidate is within %.0f%% of the best under every routing; picked the smallest "
            "worst ratio (%.3f)\n",
            label, tolerance * 100, pick.worst_ratio);
      if (run.verified) {
        failures += verify_row(run, kLegs[leg], label, tokens, pick, measured);
      } else {
        double slower = 0;
        for (double us : pick.us) slower = std::max(slower, us);
        entry.buckets(kLegs[leg]).push_back({tokens, pick.geometry, std::round(slower * 100) / 100});
      }
    }
  }
  std::fflush(stdout);
  return failures;
}

// 6. merge into the table: other keys untouched, buckets with the same bound replaced
void write_table(TuneRun const& run, tuning::Entry entry) {
  entry.provenance = tuning::Provenance{std::string("ferry tune ") + FERRY_VERSION,
                                        git_commit(),
                                        util::utc_now_iso(),
                                        run.device,
                                        run.settings.rounds,
                                        run.settings.tolerance};
  tuning::Table table;
  table.source = run.path;
  if (std::filesystem::exists(run.path)) table = tuning::read_table_file(run.path);
  tuning::Table const merged = tuning::merge_entry(table, entry);
  bool const dry_run = run.options.flag("dry-run");
  std::printf("\n%s %s, entry %s:\n", dry_run ? "would write" : "wrote", run.path.c_str(),
              tuning::describe(run.key).c_str());
  for (Leg leg : kLegs)
    for (tuning::Bucket const& bucket : entry.buckets(leg))
      std::printf("  %-8s <=%-6d blocks %3d  (%.1f us, slower routing)\n", tuning::leg_name(leg), bucket.max_tokens,
                  bucket.geometry.blocks, bucket.us.value_or(0));
  if (!dry_run) {
    tuning::write_table_file(run.path, merged);
    std::printf(
        "other entries of the table untouched (%zu in all). The library reads it after a rebuild (it embeds "
        "src/tuning/tables/), or now with FERRY_TUNING_DIR=%s\n",
        merged.entries.size(), std::filesystem::path(run.path).parent_path().string().c_str());
  }
  if (run.backend == Backend::cpu)
    std::printf("cpu backend: these rows exercise the machinery only; never commit them to a GPU table\n");
}

int run_tune_rank(Options const& options) {
  TuneRun run = start_tune(options);
  if (run.rank == 0) print_tune_header(run);
  TuneTensors tensors(run);
  Samples const samples = run_sweep(run, tensors);
  std::vector<double> const slowest = slowest_medians(run, samples);
  if (run.rank != 0) return 0;
  tuning::Entry entry;
  entry.key = run.key;
  int const failures = report_picks(run, samples, slowest, entry);
  if (run.verified) {
    std::printf("\nverify: %s (tolerance %.0f%%)%s\n", failures ? "FAIL" : "PASS",
                options.number("verify-tolerance") * 100,
                run.backend == Backend::cpu ? "; cpu backend: the geometry has no effect there" : "");
    return failures ? 3 : 0;
  }
  write_table(run, entry);
  return 0;
}

}  // namespace

int tune_main(int argc, char** argv) {
  Options options = make_options();
  if (!options.parse(argc, argv)) return 0;
  if (is_rank_process()) return run_rank("tune", [&] { return run_tune_rank(options); });
  // Launching process: refuse what cannot run before starting anything.
  Backend const backend = choose_backend(options);
  int const nproc = choose_nproc(options.integer("nproc"), backend, kCpuDefaultRanks);
  FERRY_CHECK_CONFIG(nproc >= 1, "no ranks to run: --backend cuda found no GPU; use --backend cpu");
  FERRY_CHECK_CONFIG(backend == Backend::cuda || !options.str("table").empty(),
                     "the cpu backend needs --table FILE: its rows mean nothing for a GPU, so a cpu run never "
                     "writes into the shipped tables");
  read_settings(options, backend, 0);
  EpConfig const config = make_config(options, nproc, token_buckets(options).back());
  for (RoutingKind kind : routing_kinds(options))
    validate_routing(make_routing(options, kind, 1), config.num_experts, nproc, config.topk);
  if (backend == Backend::cpu && options.str("backend") == "auto")
    std::printf("notice: no GPU found (or the cuda backend is not built): running on the cpu backend with %d ranks\n",
                nproc);
  std::fflush(stdout);
  return launch_self("tune", argc, argv, nproc);
}

}  // namespace ferry::cli
