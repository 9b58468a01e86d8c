// ferry bench: times normal-mode dispatch and combine on every rank, checks them against the cpu reference
// semantics, and (with --baseline nccl) runs the NCCL all-to-all dispatcher on the same inputs in the same run.
// Metrics are docs/design.md's: a leg's time is the slowest rank's median; NVLink GB/s counts the bytes a rank sends to
// other ranks; logical GB/s counts received rows including the rank's own.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <tuple>

#include "bench_memory.hpp"
#include "build_info.hpp"
#include "commands.hpp"
#include "ep/reference.hpp"
#include "ferry/env.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "options.hpp"
#include "wire/codec.hpp"
#include "ranks.hpp"
#include "trace/trace_file.hpp"
#include "core/util/result_file.hpp"
#include "workloads/cost_model.hpp"
#include "workloads/routing.hpp"
#if FERRY_HAVE_CUDA && __has_include("nccl_baseline.hpp")
#define FERRY_BENCH_NCCL 1
#include "nccl_baseline.hpp"
#else
#define FERRY_BENCH_NCCL 0
#endif

namespace ferry::cli {
namespace {

using bench::BenchMemory;
using bench::device_name;

constexpr int kCpuDefaultRanks = 4;

Options make_options() {
  return Options(
      "bench",
      "Times dispatch and combine (normal and low-latency modes) on every rank (one process per GPU, or 4 cpu ranks\n"
      "without a GPU),\n"
      "checks them against the reference semantics, and compares with the NCCL all-to-all baseline.\n"
      "Leg time = slowest rank's median. NVLink GB/s = bytes a rank sends to other ranks (rows + metadata) / time,\n"
      "averaged over ranks. Logical GB/s = rows received including the rank's own x row bytes / time.",
      {
          {"tokens", "128,512,4096", "tokens per rank, a comma-separated list (one table each)"},
          {"hidden", "7168", "elements per row"},
          {"topk", "8", "routed experts per token"},
          {"experts", "256", "global experts (divisible by the number of ranks)"},
          {"routing", "random", "random | ring | grouped | hot, or a comma-separated list"},
          {"expert-groups", "8", "grouped routing: groups of experts"},
          {"topk-groups", "4", "grouped routing: groups a token may use"},
          {"shared-experts", "0", "extra columns pinned to an expert on the token's own rank"},
          {"hot-fraction", "0.5", "hot routing: share of tokens sent to the hot expert"},
          {"mask-rate", "0", "probability that a routed entry is -1"},
          {"mode", "normal", "normal | ll (low-latency: expert-major, combine weighted) | both (side by side)"},
          {"dispatch", "bf16",
           "dispatch wire formats, comma-separated (bf16 | fp8 | fp8_ue8m0 | nvfp4 | mxfp4); lists of equal length "
           "pair up with --combine, a single value pairs with each entry of the other"},
          {"combine", "bf16", "combine wire formats, comma-separated (as --dispatch)"},
          {"layout", "rank", "combine input: rank (caller-reduced rows) | expert (expert-major, weighted by combine)"},
          {"expert-capacity", "0", "rows per local expert for --layout expert (0: the largest load of the routing)"},
          {"backend", "auto", "auto (cuda when a GPU is visible, else cpu) | cuda | cpu"},
          {"topology", "",
           "NxM: emulate N nodes of M ranks on this host (N x M ranks; normal mode runs hierarchical, mode ll the "
           "--route). Prints the bytes each rank sends over the network and over NVLink, counted by the protocol, "
           "beside ferry model's count from the same routing, and the network GB/s; the network is emulated (shared "
           "memory / NVLink), so these are not network figures"},
          {"route", "automatic",
           "low-latency mode across nodes (--topology of 2 nodes or more): how rows reach other nodes, automatic | "
           "forward | direct (EpConfig::internode_route), or a comma-separated list (a run each); normal mode always "
           "forwards"},
          {"nproc", "0", "ranks to start (0: one per GPU, or 4 on the cpu backend)"},
          {"warmup", "5", "untimed iterations per leg"},
          {"iters", "20", "timed iterations per leg (median, p10, p90 reported)"},
          {"seed", "0", "input seed (0: a fresh random seed, printed)"},
          {"graph", "", "capture each leg as a CUDA graph and time replays (cuda)", true},
          {"graph-calls", "10",
           "graph mode: consecutive calls of a leg in one graph; time per call = replay / calls (1: one call per "
           "replay, which adds the timer's floor, see --floor)"},
          {"scale-layout", "row_major",
           "quantized dispatch: scale tensor layout (row_major | mn_major_tma | mn_major_tma_packed_ue8m0 | "
           "blocked_128x4)"},
          {"dequantize", "", "quantized dispatch: deliver bf16 rows (dequantized by the receiver)", true},
          {"dispatch-blocks", "0", "pin the dispatch CTA count (EpConfig::dispatch_geometry; 0: tables / default)"},
          {"combine-blocks", "0",
           "pin the normal-mode combine CTA count (EpConfig::combine_geometry; 0: tables / default; mode ll runs "
           "both legs on the dispatch grid)"},
          {"check", "", "compare every output row with the reference (exact for bf16)", true},
          {"backward", "",
           "also time the training passes (normal mode, bf16): dispatch_backward (a combine of the gradients) and "
           "combine_backward (the cached dispatch of grad_y; --layout expert: with the weight gradients), each against "
           "the forward leg that moves the same bytes (combine, dispatch)",
           true},
          {"baseline", "", "nccl: also time the NCCL all-to-all dispatcher on the same inputs"},
          {"explain", "", "print which kernel path each leg took and why", true},
          {"floor", "",
           "first time what is not a leg, like a leg: empty kernels (1 CTA; 132 CTAs x 512 threads, plain and "
           "cooperative) and the cross-rank barrier: the timer's floor under every row (cuda)",
           true},
          {"host-time", "",
           "also time the host's side of each leg: microseconds to enqueue one lazy call (loops of 20 calls from an "
           "idle stream, the median of --iters loops; the slowest rank), printed per case and written as host_us",
           true},
          {"per-rank", "", "print every rank's medians", true},
          {"json", "", "write the records to this file (the result-file format of docs/design.md)"},
          {"trace", "",
           "after the timed legs, one traced call of each leg (normal and LL modes), dumped per rank into this "
           "folder for ferry trace --dir (builds with -DFERRY_TRACE=ON; FERRY_TRACE_EVENTS per warp)"},
      });
}

struct Shape {
  EpConfig config;
  RoutingOptions routing;
  int routed_topk = 0;
};

Backend choose_backend(Options const& options, bool print_notice) {
  std::string const name = options.str("backend");
  if (name == "auto") {
    if (cuda_available()) return Backend::cuda;
    if (print_notice)
      std::printf("notice: no GPU found (or the cuda backend is not built): running on the cpu backend with %d ranks\n",
                  options.integer("nproc") > 0 ? options.integer("nproc") : kCpuDefaultRanks);
    return Backend::cpu;
  }
  Backend const backend = parse_backend(name);
  FERRY_CHECK_CONFIG(backend != Backend::cuda || cuda_available(), "--backend cuda but no GPU is visible (or the cuda ",
                     "backend is not built); use --backend cpu");
  return backend;
}

// The routes --route names (low-latency runs across nodes: a run each).
std::vector<InternodeRoute> bench_routes(Options const& options) {
  std::vector<InternodeRoute> routes;
  std::stringstream stream(options.str("route"));
  std::string item;
  while (std::getline(stream, item, ',')) routes.push_back(parse_internode_route(item));
  FERRY_CHECK_CONFIG(!routes.empty(), "--route needs at least one of automatic, forward, direct");
  return routes;
}

// The options that depend on the backend or name a choice, checked by the launching process before any rank starts
// (one error line, not one per rank) and again by each rank. --trace records in-kernel traces: only builds with them
// compiled in, only the cuda kernels.
void check_run_options(Options const& options, Backend backend) {
  FERRY_CHECK_CONFIG(options.integer("iters") >= 1, "--iters=", options.integer("iters"), " must be at least 1");
  FERRY_CHECK_CONFIG(options.integer("warmup") >= 0, "--warmup=", options.integer("warmup"), " must be 0 or more");
  FERRY_CHECK_CONFIG(options.integer("graph-calls") >= 1, "--graph-calls=", options.integer("graph-calls"),
                     " must be at least 1");
  FERRY_CHECK_CONFIG(options.integer("expert-capacity") >= 0, "--expert-capacity=", options.integer("expert-capacity"),
                     " must be 0 (the largest load of the routing) or more");
  for (char const* name : {"dispatch-blocks", "combine-blocks"})
    FERRY_CHECK_CONFIG(options.integer(name) >= 0, "--", name, "=", options.integer(name),
                       " must be 0 (the tables' or the default grid) or more");
  FERRY_CHECK_CONFIG(options.integer("combine-blocks") == 0 || options.str("mode") != "ll",
                     "--combine-blocks=", options.integer("combine-blocks"),
                     " does nothing with --mode ll (both legs run on the dispatch grid); use --dispatch-blocks");
  FERRY_CHECK_CONFIG(!options.flag("graph") || backend == Backend::cuda, "--graph needs the cuda backend");
  std::string const baseline = options.str("baseline");
  FERRY_CHECK_CONFIG(baseline.empty() || baseline == "nccl", "--baseline=", baseline, " is unknown; use nccl");
  FERRY_CHECK_CONFIG(baseline.empty() || (backend == Backend::cuda && FERRY_BENCH_NCCL),
                     "--baseline nccl needs the cuda backend");
  FERRY_CHECK_CONFIG(options.str("layout") == "expert" || options.str("layout") == "rank",
                     "--layout=", options.str("layout"), " is unknown; use rank or expert");
  if (options.flag("backward")) {
    // NOTE: the backward passes keep a normal-mode dispatch's layout (DispatchHandle), which low-latency mode has not
    FERRY_CHECK_CONFIG(options.str("mode") == "normal", "--backward times the training passes, which only mode=normal ",
                       "has; use --mode normal (got --mode ", options.str("mode"), ")");
    FERRY_CHECK_CONFIG(options.str("dispatch") == "bf16" && options.str("combine") == "bf16",
                       "--backward times bf16 legs (combine_backward needs bf16 rows delivered); drop --dispatch=",
                       options.str("dispatch"), " --combine=", options.str("combine"));
  }
  // NOTE: low-latency mode across nodes is the library's to refuse (EpBuffer: e.g. a quantized combine past its
  // hidden limit there), each rank with the same ConfigError; --route itself only means something there
  std::vector<InternodeRoute> const routes = bench_routes(options);
  if (routes.size() > 1 || routes.front() != InternodeRoute::automatic) {
    FERRY_CHECK_CONFIG(options.str("mode") != "normal", "--route=", options.str("route"),
                       " chooses low-latency mode's route across nodes (normal mode always forwards); add --mode ll or "
                       "--mode both");
    FERRY_CHECK_CONFIG(!options.str("topology").empty() && parse_topology(options.str("topology")).nodes > 1,
                       "--route=", options.str("route"),
                       " chooses how rows reach other nodes; it needs a --topology of 2 nodes or more (got '",
                       options.str("topology"), "')");
  }
  if (!options.str("topology").empty()) {
    Topology const topology = parse_topology(options.str("topology"));
    FERRY_CHECK_CONFIG(options.integer("nproc") == 0 || options.integer("nproc") == topology.world(),
                       "--nproc=", options.integer("nproc"), " but --topology ", options.str("topology"), " has ",
                       topology.world(), " ranks; drop --nproc");
    FERRY_CHECK_CONFIG(options.str("baseline").empty() || topology.nodes == 1,
                       "--baseline nccl runs on one node; drop it with --topology ", options.str("topology"));
  }
  if (options.str("trace").empty()) return;
  FERRY_CHECK_CONFIG(trace_compiled_in(),
                     "--trace needs in-kernel tracing, which this build does not have; rebuild "
                     "with -DFERRY_TRACE=ON (cmake -S . -B build -DFERRY_TRACE=ON)");
  FERRY_CHECK_CONFIG(backend == Backend::cuda, "--trace records the cuda kernels; use --backend cuda");
}

std::vector<RoutingKind> routing_kinds(Options const& options) {
  std::vector<RoutingKind> kinds;
  std::stringstream stream(options.str("routing"));
  std::string item;
  while (std::getline(stream, item, ',')) kinds.push_back(parse_routing(item));
  return kinds;
}

// The modes --mode names: "both" runs normal then ll at every size.
std::vector<Mode> bench_modes(Options const& options) {
  if (options.str("mode") == "both") return {Mode::normal, Mode::low_latency};
  return {parse_mode(options.str("mode"))};
}

// (dispatch, combine) wire formats of each run: --dispatch and --combine pair up (see their help).
std::vector<std::pair<WireFormat, WireFormat>> format_pairs(Options const& options) {
  std::vector<WireFormat> dispatch, combine;
  std::string item;
  std::stringstream d_stream(options.str("dispatch"));
  while (std::getline(d_stream, item, ',')) dispatch.push_back(parse_wire_format(item));
  std::stringstream c_stream(options.str("combine"));
  while (std::getline(c_stream, item, ',')) combine.push_back(parse_wire_format(item));
  FERRY_CHECK_CONFIG(!dispatch.empty() && !combine.empty(), "--dispatch and --combine need at least one format");
  FERRY_CHECK_CONFIG(dispatch.size() == combine.size() || dispatch.size() == 1 || combine.size() == 1,
                     "--dispatch has ", dispatch.size(), " formats and --combine ", combine.size(),
                     "; give lists of equal length (they pair up) or a single value for one of them");
  std::vector<std::pair<WireFormat, WireFormat>> pairs;
  for (std::size_t i = 0; i < std::max(dispatch.size(), combine.size()); ++i)
    pairs.emplace_back(dispatch[dispatch.size() == 1 ? 0 : i], combine[combine.size() == 1 ? 0 : i]);
  return pairs;
}

Shape make_shape(Options const& options, int world, int tokens, RoutingKind kind, uint64_t seed, Mode mode,
                 std::pair<WireFormat, WireFormat> formats, InternodeRoute route) {
  Shape shape;
  shape.routed_topk = options.integer("topk");
  shape.routing.kind = kind;
  shape.routing.expert_groups = options.integer("expert-groups");
  shape.routing.topk_groups = options.integer("topk-groups");
  shape.routing.shared_experts = options.integer("shared-experts");
  shape.routing.hot_fraction = options.number("hot-fraction");
  shape.routing.mask_rate = options.number("mask-rate");
  shape.routing.seed = seed;
  shape.config.hidden = options.integer("hidden");
  shape.config.num_experts = options.integer("experts");
  shape.config.topk = routing_columns(shape.routing, shape.routed_topk);
  shape.config.max_tokens_per_rank = tokens;
  shape.config.mode = mode;
  shape.config.internode_route = route;
  if (options.integer("dispatch-blocks") > 0)
    shape.config.dispatch_geometry = Geometry{options.integer("dispatch-blocks")};
  // mode=ll runs both legs on the dispatch grid (EpConfig refuses a combine pin there): --combine-blocks pins the
  // normal-mode buffers of the run, --dispatch-blocks every buffer's grid
  if (options.integer("combine-blocks") > 0 && mode == Mode::normal)
    shape.config.combine_geometry = Geometry{options.integer("combine-blocks")};
  shape.config.dispatch_format = formats.first;
  shape.config.combine_format = formats.second;
  shape.config.dispatch_dequantize = options.flag("dequantize") && formats.first != WireFormat::bf16;
  if (formats.first != WireFormat::bf16)
    shape.config.recv_scale_layout = parse_scale_layout(options.str("scale-layout"));
  shape.config.validate(world);
  validate_routing(shape.routing, shape.config.num_experts, world, shape.routed_topk);
  return shape;
}

ref::RankInput make_input(Shape const& shape, int world, int rank, int tokens) {
  ref::RankInput input;
  input.num_tokens = tokens;
  int const columns = shape.config.topk;
  input.x = generate_tokens(shape.routing.seed, rank, tokens, shape.config.hidden);
  input.topk_idx.resize(static_cast<std::size_t>(tokens) * columns);
  input.topk_weights.resize(input.topk_idx.size());
  generate_routing(shape.routing, shape.config.num_experts, world, rank, tokens, shape.routed_topk, input.topk_idx,
                   input.topk_weights);
  return input;
}

// Destination ranks of a token, ascending (a token crosses once per destination rank).
std::vector<int> destinations(EpConfig const& config, int world, ref::RankInput const& input, int token) {
  int const per_rank = config.num_experts / world;
  std::vector<bool> hit(world, false);
  for (int k = 0; k < config.topk; ++k) {
    int64_t const expert = input.topk_idx[static_cast<std::size_t>(token) * config.topk + k];
    if (expert >= 0) hit[expert / per_rank] = true;
  }
  std::vector<int> out;
  for (int d = 0; d < world; ++d)
    if (hit[d]) out.push_back(d);
  return out;
}

// The y an identity expert layer must produce (expert outputs = the bf16 rows delivered: the token's row, or its
// dequantized wire row), by the canonical order of reference.hpp: each destination reduces its experts with fmaf over
// k ascending and rounds to bf16 (rank-major: the row itself); that partial travels in combine_format; the source
// sums the dequantized partials of the destination ranks ascending in fp32 and rounds once. Across nodes ("Across
// nodes" there) the partials of another node are first summed in fp32 and rounded to bf16, and that row travels in
// combine_format instead (pass one node of every rank for a route that sums the ranks as one node does: low-latency
// mode's direct route). Needs only this rank's input. Also measures the combine's error against the exact sum of
// the rows that travelled in combine_format, and its derived bound (wire::combine_error_bound): the largest |error| /
// bound, and the relative L2 error.
struct IdentityCombine {
  std::vector<uint16_t> y;
  double worst_bound_ratio = 0;  // max over elements of |y - exact| / bound (quantized combine formats)
  double rel_l2 = 0;             // ||y - exact|| / ||exact||
};

IdentityCombine expected_identity_combine(EpConfig const& config, Topology const& topology, int rank,
                                          ref::RankInput const& input, CombineLayout layout) {
  int const world = topology.world();
  int const hidden = config.hidden;
  int const per_rank = config.num_experts / world;
  WireFormat const dformat = config.dispatch_format;
  WireFormat const cformat = config.combine_format;
  IdentityCombine out;
  out.y.assign(static_cast<std::size_t>(input.num_tokens) * hidden, 0);
  std::vector<float> acc(hidden), delivered(hidden), combine_values;
  std::vector<uint8_t> wire(wire_row_bytes(dformat, hidden)), combine_wire;
  std::vector<std::vector<uint16_t>> partials;
  double err2 = 0, ref2 = 0;
  for (int t = 0; t < input.num_tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    uint16_t const* x = &input.x[static_cast<std::size_t>(t) * hidden];
    // the bf16 row every destination delivers (and an identity expert returns)
    if (dformat == WireFormat::bf16) {
      for (int h = 0; h < hidden; ++h) delivered[h] = ref::bf16_to_float(x[h]);
    } else {
      std::vector<uint16_t> row(hidden);
      wire::quantize_row(dformat, x, hidden, wire.data());
      wire::dequantize_row(dformat, wire.data(), hidden, row.data());
      for (int h = 0; h < hidden; ++h) delivered[h] = ref::bf16_to_float(row[h]);
    }
    partials.clear();
    std::vector<float> node_sum(static_cast<std::size_t>(hidden));
    int node = -1;  // the remote node whose partials node_sum holds
    auto const flush_node = [&] {
      if (node < 0) return;
      std::vector<uint16_t> row(static_cast<std::size_t>(hidden));
      ref::round_row(hidden, node_sum.data(), row.data());
      ref::accumulate_combined_row(cformat, hidden, row.data(), combine_wire, combine_values, acc.data());
      partials.push_back(std::move(row));
      node = -1;
    };
    for (int d : destinations(config, world, input, t)) {
      std::vector<uint16_t> partial(hidden);
      for (int h = 0; h < hidden; ++h) {
        float value = delivered[h];
        if (layout == CombineLayout::expert_major) {
          float sum = 0.0f;
          for (int k = 0; k < config.topk; ++k) {
            std::size_t const at = static_cast<std::size_t>(t) * config.topk + k;
            int64_t const expert = input.topk_idx[at];
            if (expert >= 0 && expert / per_rank == d) sum = std::fmaf(input.topk_weights[at], value, sum);
          }
          value = sum;
        }
        partial[h] = ref::float_to_bf16(value);
      }
      if (topology.node_of(d) != node) flush_node();
      if (!topology.same_node(d, rank)) {
        if (node < 0) std::fill(node_sum.begin(), node_sum.end(), 0.0f);
        node = topology.node_of(d);
        ref::accumulate_row(hidden, partial.data(), node_sum.data());
        continue;
      }
      ref::accumulate_combined_row(cformat, hidden, partial.data(), combine_wire, combine_values, acc.data());
      partials.push_back(std::move(partial));
    }
    flush_node();
    uint16_t* y = &out.y[static_cast<std::size_t>(t) * hidden];
    for (int h = 0; h < hidden; ++h) y[h] = ref::float_to_bf16(acc[h]);
    if (partials.empty()) continue;
    // error against the exact sum of the partials, and the bound for this element
    std::vector<uint16_t const*> rows;
    for (auto const& partial : partials) rows.push_back(partial.data());
    wire::CombineRowError const measured =
        wire::measure_combine_row(cformat, hidden, rows.data(), static_cast<int>(rows.size()), y);
    out.worst_bound_ratio = std::max(out.worst_bound_ratio, measured.worst_ratio);
    err2 += measured.error_sq;
    ref2 += measured.exact_sq;
  }
  out.rel_l2 = ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0;
  return out;
}

// A quantized delivery against the reference: payload bytes and scale entries of every received row (normal mode)
// and of every filled expert-major slot (low-latency mode, or expand). "" when they match.
std::string check_quantized_delivery(EpConfig const& config, int world, ref::RankDispatch const& want,
                                     DispatchResult const& got, BenchMemory& memory) {
  WireFormat const format = config.dispatch_format;
  ScaleLayout const layout = config.recv_scale_layout;
  int const hidden = config.hidden;
  WireRowLayout const row = wire_row_layout(format, hidden);
  // rows [0, num_rows) of a delivered (payload, scales, token scales) set of tensor_rows rows
  auto const compare = [&](ref::DeliveredRows const& expected, void const* payload, void const* scales,
                           float const* token_scales, int num_rows, int tensor_rows,
                           std::string const& what) -> std::string {
    std::vector<uint8_t> got_payload(static_cast<std::size_t>(num_rows) * row.payload_bytes);
    memory.download(got_payload.data(), payload, got_payload.size());
    if (got_payload != expected.payload) return what + " payload differs";
    std::vector<uint8_t> got_scales(scale_tensor_bytes(format, layout, tensor_rows, hidden));
    memory.download(got_scales.data(), scales, got_scales.size());
    std::vector<float> got_tokens(row.has_token_scale ? static_cast<std::size_t>(num_rows) : 0);
    if (!got_tokens.empty()) memory.download(got_tokens.data(), token_scales, got_tokens.size() * sizeof(float));
    std::string const problem =
        ref::compare_delivered_scales(config, expected, got_scales.data(), got_tokens.data(), num_rows, tensor_rows);
    return problem.empty() ? problem : what + " " + problem;
  };
  if (got.recv_x) {
    ref::DeliveredRows const expected =
        ref::deliver(config, want.recv_wire, want.num_recv, config.recv_capacity(world));
    std::string const problem = compare(expected, got.recv_x, got.recv_scales, got.recv_token_scales, want.num_recv,
                                        config.recv_capacity(world), "recv");
    if (!problem.empty()) return problem;
  }
  if (got.expert_x) {
    int const slots = config.expert_slots();
    std::vector<uint8_t> const wire = ref::expand_wire(config, world, want);
    std::size_t const tensor = scale_tensor_bytes(format, layout, slots, hidden);
    for (int e = 0; e < config.num_local_experts(world); ++e) {
      int const filled = std::min(want.expert_counts[static_cast<std::size_t>(e)], slots);
      std::span<uint8_t const> const rows(wire.data() + static_cast<std::size_t>(e) * slots * row.row_bytes,
                                          static_cast<std::size_t>(filled) * row.row_bytes);
      ref::DeliveredRows const expected = ref::deliver(config, rows, filled, slots);
      std::string const problem = compare(
          expected, static_cast<char const*>(got.expert_x) + static_cast<std::size_t>(e) * slots * row.payload_bytes,
          static_cast<char const*>(got.expert_scales) + e * tensor,
          got.expert_token_scales ? got.expert_token_scales + static_cast<std::size_t>(e) * slots : nullptr, filled,
          slots, detail::concat("expert ", e));
      if (!problem.empty()) return problem;
    }
  }
  return "";
}

// The first element where two arrays of 32-bit values differ bit for bit (NaN-safe), or -1.
template <typename T>
long first_bit_diff(std::vector<T> const& got, std::vector<T> const& want) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 2, "16- or 32-bit values");
  for (std::size_t i = 0; i < want.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) return static_cast<long>(i);
  return -1;
}

// --backward --check: the forward dispatch again (saving its layout into `handle`), then one eager call of each
// backward leg, outputs poisoned first, every row against the reference over every rank's inputs: grad_x against
// ref::dispatch_backward (the gradient of the delivered rows: the combine input, identity experts), combine_backward's
// rows (recv_x, or the filled slots of expert_x) against ref::combine_backward_rows and, expert layout, its weight
// gradients against ref::combine_backward_weights (grad_y: the tokens' rows; the forward expert outputs: the combine
// input). "" when everything matches.
std::string check_backward(EpConfig const& config, int world, int rank, std::vector<ref::RankInput> const& inputs,
                           CombineLayout layout, EpBuffer& buffer, DispatchArgs dargs, DispatchHandle& handle,
                           DispatchBackwardArgs bargs, CombineBackwardArgs cbargs,
                           std::function<void(DispatchResult const&)> const& fill_combine_input, void* y, void* grad_w,
                           BenchMemory& memory) {
  int const hidden = config.hidden;
  std::size_t const tokens = static_cast<std::size_t>(inputs[rank].num_tokens);
  bool const expert = layout == CombineLayout::expert_major;
  std::vector<ref::RankDispatch> received;
  std::vector<std::vector<uint16_t>> delivered, grad_y;
  for (int r = 0; r < world; ++r) {
    received.push_back(ref::dispatch(config, world, r, inputs));
    delivered.push_back(expert ? ref::expand(config, world, received.back()) : received.back().recv_x);
    grad_y.push_back(inputs[r].x);
  }
  ref::RankDispatch const& mine = received[rank];
  // 1. the layout, and the gradient of what it delivered
  dargs.save_handle = &handle;
  dargs.eager = true;
  fill_combine_input(buffer.dispatch(dargs, memory.stream()));
  // 2. dispatch_backward (bf16 grad_x)
  memory.fill(y, 0xff, tokens * hidden * 2);
  bargs.eager = true;
  buffer.dispatch_backward(bargs, memory.stream());
  std::vector<float> const want_x = ref::dispatch_backward(config, world, rank, inputs, received, delivered, layout);
  std::vector<uint16_t> want_bf16(want_x.size()), got_x(want_x.size());
  for (std::size_t i = 0; i < want_x.size(); ++i) want_bf16[i] = ref::float_to_bf16(want_x[i]);
  memory.download(got_x.data(), y, got_x.size() * 2);
  if (long const d = first_bit_diff(got_x, want_bf16); d >= 0)
    return detail::concat("dispatch_backward grad_x differs at element ", d);
  // 3. combine_backward: the gradient rows, and (expert layout) the weight gradients
  if (grad_w != nullptr) memory.fill(grad_w, 0xff, tokens * config.topk * sizeof(float));
  cbargs.eager = true;
  DispatchResult const result = buffer.combine_backward(cbargs, memory.stream());
  std::vector<uint16_t> const want_rows =
      ref::combine_backward_rows(config, world, rank, inputs, received, grad_y, layout);
  std::vector<uint16_t> got_rows(want_rows.size());
  if (!expert) {
    memory.download(got_rows.data(), result.recv_x, got_rows.size() * 2);
    if (long const d = first_bit_diff(got_rows, want_rows); d >= 0)
      return detail::concat("combine_backward recv_x differs at element ", d);
    return "";
  }
  memory.download(got_rows.data(), result.expert_x, got_rows.size() * 2);
  int const slots = config.expert_slots();
  for (int e = 0; e < config.num_local_experts(world); ++e) {
    std::size_t const first = static_cast<std::size_t>(e) * slots * hidden;
    std::size_t const filled = static_cast<std::size_t>(std::min(mine.expert_counts[e], slots)) * hidden;
    for (std::size_t i = first; i < first + filled; ++i)
      if (got_rows[i] != want_rows[i]) return detail::concat("combine_backward expert_x differs at element ", i);
  }
  if (cbargs.grad_topk_weights == nullptr) return "";
  std::vector<float> const want_w =
      ref::combine_backward_weights(config, world, rank, inputs, received, grad_y, delivered);
  std::vector<float> got_w(want_w.size());
  memory.download(got_w.data(), grad_w, got_w.size() * sizeof(float));
  if (long const d = first_bit_diff(got_w, want_w); d >= 0)
    return detail::concat("combine_backward grad_topk_weights differs at entry ", d);
  return "";
}

struct LegStats {
  double median_us = 0, p10_us = 0, p90_us = 0;
};

LegStats summarize(std::vector<double> samples) {
  FERRY_CHECK(!samples.empty(), "no timed iterations (--iters must be at least 1)");
  std::sort(samples.begin(), samples.end());
  auto const at = [&](double q) { return samples[static_cast<std::size_t>(q * (samples.size() - 1) + 0.5)]; };
  return {at(0.5), at(0.1), at(0.9)};
}

struct Record {
  std::string mode;
  std::string leg;
  int tokens;
  std::string routing;
  std::string format;  // the leg's wire format
  LegStats stats;
  double nvlink_gbps, logical_gbps;
  std::string check;
  double baseline_us = -1;
  double bound_ratio = -1;  // combine, quantized, --check: max |error| / derived bound
  double rel_l2 = -1;       // combine, quantized, --check: relative L2 error against the unquantized sum
  // the run's pair of formats and its combine input layout (rank | expert): format is one of the pair
  std::string dispatch_format, combine_format, layout;
  // --backward, the backward legs: median / the median of the forward leg of the same bytes
  double forward_ratio = -1;
  // --topology across nodes: bytes per rank (mean over ranks) by link, counted by the protocol (when it counts:
  // `counted`), and ferry model's count from the same routing; the route the leg took
  double network_bytes = -1, nvlink_bytes = -1, model_network_bytes = -1, network_gbps = -1;
  double model_nvlink_bytes = -1;
  bool counted = false;
  std::string route;
  // --host-time: host microseconds to enqueue one lazy call of the leg (median of the loops, the slowest rank)
  double host_us = -1;
};

void write_json(std::string const& path, Options const& options, Shape const& shape, std::string const& device,
                int world, bool graph, std::vector<Record> const& records) {
  std::vector<util::ResultRecord> out;
  for (Record const& r : records) {
    util::ResultRecord& rec = out.emplace_back();
    rec.add("mode", r.mode).add("leg", r.leg).add("tokens", r.tokens).add("hidden", shape.config.hidden);
    rec.add("topk", shape.config.topk).add("experts", shape.config.num_experts).add("routing", r.routing);
    rec.add("format", r.format).add("dispatch_format", r.dispatch_format).add("combine_format", r.combine_format);
    rec.add("layout", r.layout).add("graph", graph).add("graph_calls", graph ? options.integer("graph-calls") : 1);
    rec.add("median_us", r.stats.median_us).add("p10_us", r.stats.p10_us).add("p90_us", r.stats.p90_us);
    rec.add("nvlink_gbps", r.nvlink_gbps).add("logical_gbps", r.logical_gbps).add("check", r.check);
    if (r.baseline_us > 0)
      rec.add("baseline_us", r.baseline_us).add("speedup_vs_baseline", r.baseline_us / r.stats.median_us);
    if (r.bound_ratio >= 0) rec.add("error_over_bound", r.bound_ratio).add("rel_l2_error", r.rel_l2);
    if (r.forward_ratio >= 0) rec.add("backward_over_forward", r.forward_ratio);
    if (r.host_us >= 0) rec.add("host_us", r.host_us);
    if (!r.route.empty()) {
      rec.add("topology", options.str("topology")).add("network", "emulated").add("route", r.route);
      if (r.counted)
        rec.add("network_bytes", r.network_bytes)
            .add("nvlink_bytes", r.nvlink_bytes)
            .add("network_gbps", r.network_gbps);
      rec.add("model_network_bytes", r.model_network_bytes).add("model_nvlink_bytes", r.model_nvlink_bytes);
    }
  }
  util::write_result_file(path, {"ferry bench", git_commit(), device, world}, out);
}

// Slowest rank's figures: allgathers every rank's values and takes the max of each.
std::vector<double> max_over_ranks(Bootstrap& bootstrap, std::vector<double> const& mine, bool print_per_rank,
                                   char const* label) {
  std::vector<double> all(mine.size() * bootstrap.world());
  bootstrap.allgather(mine.data(), all.data(), mine.size() * sizeof(double));
  std::vector<double> out(mine.size(), 0.0);
  for (int r = 0; r < bootstrap.world(); ++r) {
    if (print_per_rank && bootstrap.rank() == 0) {
      std::printf("  %-10s rank %d:", label, r);
      for (std::size_t i = 0; i < mine.size(); ++i) std::printf(" %10.2f", all[r * mine.size() + i]);
      std::printf("\n");
    }
    for (std::size_t i = 0; i < mine.size(); ++i) out[i] = std::max(out[i], all[r * mine.size() + i]);
  }
  return out;
}

double sum_over_ranks(Bootstrap& bootstrap, double mine) {
  std::vector<double> all(bootstrap.world());
  bootstrap.allgather(&mine, all.data(), sizeof(double));
  double total = 0;
  for (double v : all) total += v;
  return total;
}

// --host-time and --floor: calls per timed host loop (short: the launch queue never fills)
constexpr int kHostTimeCalls = 20;

// --floor: what the timer reads for work that moves nothing, timed exactly like a leg (delay, barrier, event, replay).
void print_floor(Options const& options, Communicator& comm, Backend backend, bool graph) {
  FERRY_CHECK_CONFIG(backend == Backend::cuda, "--floor times cuda launches; use --backend cuda");
  BenchMemory memory(backend);
  int const warmup = options.integer("warmup");
  int const iters = options.integer("iters");
  struct Item {
    char const* what;
    std::function<void()> enqueue;
  };
  std::vector<Item> const items = {
      {"empty kernel, 1 CTA x 32", [&] { bench::enqueue_empty(memory, 1, 32, false); }},
      {"empty kernel, 132 CTAs x 512", [&] { bench::enqueue_empty(memory, 132, 512, false); }},
      {"empty kernel, 132 CTAs x 512, cooperative", [&] { bench::enqueue_empty(memory, 132, 512, true); }},
      {"132 x 512, Params-sized argument, <<<>>>",
       [&] { bench::enqueue_empty_params(memory, 132, 512, bench::LaunchApi::chevrons); }},
      {"132 x 512, Params-sized argument, LaunchKernelEx",
       [&] { bench::enqueue_empty_params(memory, 132, 512, bench::LaunchApi::launch_ex); }},
      {"132 x 512, Params-sized argument, cooperative",
       [&] { bench::enqueue_empty_params(memory, 132, 512, bench::LaunchApi::launch_ex_cooperative); }},
      {"cross-rank barrier (1 thread)", [&] { comm.barrier(memory.stream()); }},
  };
  if (comm.rank() == 0)
    std::printf("timer floor (%s):\n",
                graph ? detail::concat("graph replay of ", options.integer("graph-calls"), " calls, per call").c_str()
                      : "stream launch");
  for (auto const& item : items) {
    LegStats const stats =
        summarize(bench::time_leg(memory, comm, item.enqueue, graph, warmup, iters, options.integer("graph-calls")));
    // the host's side of the same launch: what it takes to enqueue it (lazy, from an idle stream)
    LegStats const host = summarize(bench::host_time(memory, comm, item.enqueue, warmup, iters, kHostTimeCalls));
    std::vector<double> const worst = max_over_ranks(
        comm.bootstrap(), {stats.median_us, stats.p10_us, stats.p90_us, host.median_us}, false, item.what);
    if (comm.rank() == 0)
      std::printf("  %-48s median %6.2f us  p10 %6.2f  p90 %6.2f  host %5.2f us/call\n", item.what, worst[0], worst[1],
                  worst[2], worst[3]);
  }
}

// The run: what every case shares. Set up by start_run (collective: every rank makes the communicator and learns the
// seed), added to by each case (its records), read at the end (the comparisons and --json).
struct BenchRun {
  Options const& options;
  Backend backend = Backend::cpu;
  std::shared_ptr<Communicator> comm;
  Topology topology;
  bool across_nodes = false;
  int world = 0, rank = 0;
  bool graph = false, check = false, backward = false;
  int warmup = 0, iters = 0, graph_calls = 0;
  CombineLayout user_layout = CombineLayout::rank_major;
  uint64_t seed = 0;
  std::string device;
  std::vector<Record> records;
  Shape last_shape;  // the last case's: --json's hidden, topk and experts
};

// The communicator, the options every case reads, and one seed for every rank (rank 0 draws it or takes --seed and
// broadcasts it); rank 0 prints the run's first line.
BenchRun start_run(Options const& options) {
  BenchRun run{options};
  run.backend = choose_backend(options, false);
  CommunicatorOptions comm_options;
  comm_options.backend = run.backend;
  comm_options.topology = options.str("topology");
  run.comm = std::shared_ptr<Communicator>(
      Communicator::create(make_socket_bootstrap(socket_bootstrap_options_from_env()), comm_options));
  run.topology = run.comm->topology();
  run.across_nodes = run.topology.nodes > 1;
  run.world = run.comm->world();
  run.rank = run.comm->rank();
  run.graph = options.flag("graph");
  run.check = options.flag("check");
  run.backward = options.flag("backward");
  check_run_options(options, run.backend);
  run.user_layout = options.str("layout") == "expert" ? CombineLayout::expert_major : CombineLayout::rank_major;
  run.warmup = options.integer("warmup");
  run.iters = options.integer("iters");
  run.graph_calls = options.integer("graph-calls");

  run.seed = static_cast<uint64_t>(options.integer("seed"));
  if (run.seed == 0) run.seed = (static_cast<uint64_t>(std::random_device{}()) << 20) ^ std::random_device{}();
  run.comm->bootstrap().broadcast(&run.seed, sizeof(run.seed), 0);
  run.device = device_name(run.backend);
  if (run.rank == 0)
    std::printf("ferry bench: %d ranks, backend %s (%s), seed %llu%s%s\n", run.world, backend_name(run.backend),
                run.device.c_str(), static_cast<unsigned long long>(run.seed), run.graph ? ", graph mode" : "",
                run.across_nodes ? detail::concat(", topology ", topology_name(run.topology),
                                                  " (emulated nodes on one host: the network figures are not network "
                                                  "measurements)")
                                       .c_str()
                                 : "");
  return run;
}

// One case of the run: a routing, a mode, a size, a pair of wire formats and a route.
struct CaseKey {
  RoutingKind kind;
  Mode mode;
  int tokens;
  std::pair<WireFormat, WireFormat> formats;
  InternodeRoute route;
};

// The cases of one routing: --mode both times both modes at each size, every format pair at each, and low-latency
// mode every --route (normal mode always forwards: its route stays automatic).
std::vector<CaseKey> routing_cases(BenchRun const& run, RoutingKind kind) {
  Options const& options = run.options;
  std::vector<CaseKey> cases;
  for (int tokens : options.int_list("tokens"))
    for (Mode mode : bench_modes(options)) {
      // --mode both: low-latency mode stops at kMaxLowLatencyTokens; larger sizes run in normal mode only
      if (mode == Mode::low_latency && tokens > kMaxLowLatencyTokens && bench_modes(options).size() > 1) {
        if (run.rank == 0 && kind == routing_kinds(options).front())
          std::printf("note: %d tokens/rank is past low-latency mode's %d: normal mode only at that size\n", tokens,
                      kMaxLowLatencyTokens);
        continue;
      }
      for (auto const& formats : format_pairs(options))
        for (InternodeRoute route :
             mode == Mode::low_latency ? bench_routes(options) : std::vector<InternodeRoute>{InternodeRoute::automatic})
          cases.push_back({kind, mode, tokens, formats, route});
    }
  return cases;
}

// Every rank's input of a case (a pure function of the seed: the reference needs them all).
std::vector<ref::RankInput> make_inputs(Shape const& shape, int world, int tokens) {
  std::vector<ref::RankInput> inputs;
  for (int r = 0; r < world; ++r) inputs.push_back(make_input(shape, world, r, tokens));
  return inputs;
}

// The config a case's EpBuffer is made with: normal mode's expert-major layout gets --expert-capacity, or (0) the
// largest load any local expert of any rank sees under this routing.
EpConfig with_expert_capacity(EpConfig config, Options const& options, CombineLayout layout, bool ll,
                              std::vector<ref::RankInput> const& inputs) {
  if (layout != CombineLayout::expert_major || ll) return config;
  int capacity = options.integer("expert-capacity");
  if (capacity == 0) {
    std::vector<int> load(config.num_experts, 0);
    for (auto const& in : inputs)
      for (int64_t e : in.topk_idx)
        if (e >= 0) ++load[e];
    capacity = std::max(1, *std::max_element(load.begin(), load.end()));
  }
  config.expert_capacity = capacity;
  return config;
}

// A case set up: its shape, every rank's inputs, the buffer, this rank's tensors and one eager dispatch (exact counts,
// and the combine input of identity experts: the bf16 rows that arrived; for a quantized delivery, their dequantized
// values, computed by the reference). Members are made in this order (the buffer before the bench's memory).
struct Case {
  Case(BenchRun const& run, CaseKey const& key);
  Case(Case const&) = delete;
  Case& operator=(Case const&) = delete;

  // Copies (or uploads) the combine input from a dispatch's result.
  void fill_combine_input(DispatchResult const& from);

  CaseKey key;
  bool ll;
  // NOTE: low-latency mode returns the expert-major layout (its slots default to the worst case), so its combine
  // takes expert outputs: identity experts = a copy of expert_x.
  CombineLayout layout;
  Shape shape;
  std::vector<ref::RankInput> inputs;
  EpBuffer buffer;
  EpConfig& config;  // shape.config: resolved by the buffer (ll: expert slots)
  ref::RankInput const& mine;
  // across nodes: the route the legs take (normal mode: forward, hierarchical); low-latency mode's direct route sums
  // the ranks' rows as one node of every rank does, so its combine reference is that node's
  InternodeRoute route = InternodeRoute::automatic;
  char const* route_label = "";
  Topology combine_topology;
  BenchMemory memory;
  int hidden = 0;
  std::size_t row_bytes = 0;
  void* x = nullptr;
  void* idx = nullptr;
  void* weights = nullptr;
  void* y = nullptr;
  DispatchArgs dargs;
  DispatchResult result;
  int64_t num_recv = 0;
  bool quantized_out = false;
  std::optional<ref::RankDispatch> want;  // every rank's inputs through the reference (quantized delivery, --check)
  std::size_t combine_rows = 0;
  void* combine_in = nullptr;
  CombineArgs cargs;
  // --backward: the handle of this dispatch's layout, and the backward legs' arguments
  DispatchHandle handle;
  DispatchBackwardArgs bargs;
  CombineBackwardArgs cbargs;
  void* grad_w = nullptr;
};

Case::Case(BenchRun const& run, CaseKey const& k)
    : key(k),
      ll(k.mode == Mode::low_latency),
      layout(ll ? CombineLayout::expert_major : run.user_layout),
      shape(make_shape(run.options, run.world, k.tokens, k.kind, run.seed + k.tokens, k.mode, k.formats, k.route)),
      inputs(make_inputs(shape, run.world, k.tokens)),
      buffer(run.comm, with_expert_capacity(shape.config, run.options, layout, ll, inputs)),
      config(shape.config),
      mine(inputs[run.rank]),
      memory(run.backend) {
  config = buffer.config();
  route = config.route();
  route_label = !run.across_nodes ? "" : ll ? internode_route_name(route) : "hierarchical";
  combine_topology = ll && route == InternodeRoute::direct ? Topology{1, run.topology.world()} : run.topology;
  hidden = config.hidden;
  row_bytes = static_cast<std::size_t>(hidden) * 2;
  int const tokens = key.tokens;
  x = memory.alloc(std::max<std::size_t>(1, tokens * row_bytes));
  idx = memory.alloc(std::max<std::size_t>(1, mine.topk_idx.size() * sizeof(int64_t)));
  weights = memory.alloc(std::max<std::size_t>(1, mine.topk_weights.size() * sizeof(float)));
  y = memory.alloc(std::max<std::size_t>(1, tokens * row_bytes));
  memory.upload(x, mine.x.data(), tokens * row_bytes);
  memory.upload(idx, mine.topk_idx.data(), mine.topk_idx.size() * sizeof(int64_t));
  memory.upload(weights, mine.topk_weights.data(), mine.topk_weights.size() * sizeof(float));

  dargs.x = x;
  dargs.num_tokens = tokens;
  dargs.topk_idx = idx;
  dargs.topk_idx_type = IndexType::int64;
  dargs.topk_weights = static_cast<float const*>(weights);
  dargs.expand = layout == CombineLayout::expert_major;

  // 1. one eager dispatch: exact counts, and the combine input
  result = buffer.dispatch(dargs, memory.stream());
  num_recv = result.num_recv_host;
  quantized_out = config.delivers_quantized();
  if (quantized_out || run.check) want = ref::dispatch(config, run.world, run.rank, inputs);
  combine_rows = layout == CombineLayout::expert_major
                     ? static_cast<std::size_t>(config.num_local_experts(run.world)) * config.expert_slots()
                     : static_cast<std::size_t>(std::max<int64_t>(num_recv, 1));
  combine_in = memory.alloc(combine_rows * row_bytes);
  fill_combine_input(result);
  memory.synchronize();
  cargs.layout = layout;
  cargs.x = combine_in;
  cargs.y = y;
}

void Case::fill_combine_input(DispatchResult const& from) {
  int const world = static_cast<int>(inputs.size());
  if (!quantized_out) {
    memory.copy(
        combine_in, layout == CombineLayout::expert_major ? from.expert_x : from.recv_x,
        (layout == CombineLayout::expert_major ? combine_rows : static_cast<std::size_t>(num_recv)) * row_bytes);
  } else if (layout == CombineLayout::expert_major) {
    std::vector<uint16_t> const rows = ref::expand(config, world, *want);
    memory.upload(combine_in, rows.data(), rows.size() * 2);
  } else {
    memory.upload(combine_in, want->recv_x.data(), want->recv_x.size() * 2);
  }
}

// The times of a case's legs, each rank's own (the slowest rank's are taken when the records are made).
struct CaseTimes {
  LegStats dispatch, combine;
  LegStats baseline_dispatch, baseline_combine;  // --baseline nccl
  LegStats dispatch_backward, combine_backward;  // --backward
  std::vector<double> host_us;                   // --host-time: dispatch, combine, pair (the slowest rank's)
};

LegStats time_case_leg(BenchRun const& run, Case& c, std::function<void()> const& enqueue, bool use_graph) {
  return summarize(bench::time_leg(c.memory, *run.comm, enqueue, use_graph, run.warmup, run.iters, run.graph_calls));
}

// 2. the timed legs (lazy calls); a barrier before each so the ranks start together
void time_forward_legs(BenchRun const& run, Case& c, CaseTimes& times) {
  c.dargs.eager = false;
  c.cargs.eager = false;
  times.dispatch = time_case_leg(
      run, c, [&] { c.buffer.dispatch(c.dargs, c.memory.stream()); }, run.graph);
  times.combine = time_case_leg(
      run, c, [&] { c.buffer.combine(c.cargs, c.memory.stream()); }, run.graph);
}

// 2a. --host-time: the host's side of the same lazy calls (each leg alone, then dispatch + combine pairs)
std::vector<double> time_host(BenchRun const& run, Case& c) {
  auto const host_leg = [&](std::function<void()> const& enqueue) {
    return summarize(bench::host_time(c.memory, *run.comm, enqueue, run.warmup, run.iters, kHostTimeCalls)).median_us;
  };
  double const d = host_leg([&] { c.buffer.dispatch(c.dargs, c.memory.stream()); });
  double const cb = host_leg([&] { c.buffer.combine(c.cargs, c.memory.stream()); });
  double const pair = host_leg([&] {
    c.buffer.dispatch(c.dargs, c.memory.stream());
    c.buffer.combine(c.cargs, c.memory.stream());
  });
  return max_over_ranks(run.comm->bootstrap(), {d, cb, pair}, run.options.flag("per-rank"), "host time");
}

// 2b. --trace: one more call of each leg with the in-kernel recorder on, dumped per rank (ferry trace reads it)
void trace_case(BenchRun const& run, Case& c) {
  std::string const& dir = run.options.str("trace");
  int64_t const events = env_optional_int("FERRY_TRACE_EVENTS").value_or(0);  // events per warp
  c.buffer.enable_trace(events > 0 ? static_cast<int>(events) : 1024);
  run.comm->barrier(c.memory.stream());
  c.buffer.dispatch(c.dargs, c.memory.stream());
  run.comm->barrier(c.memory.stream());
  c.buffer.combine(c.cargs, c.memory.stream());
  // one label per case: the wire formats too, or a later format pair would overwrite this one's files
  std::string const label =
      detail::concat(mode_name(c.key.mode), "-", routing_name(c.key.kind), "-", c.key.tokens, "-",
                     wire_format_name(c.key.formats.first), "-", wire_format_name(c.key.formats.second));
  for (TraceKernel kernel :
       {c.ll ? TraceKernel::ll_dispatch : TraceKernel::dispatch, c.ll ? TraceKernel::ll_combine : TraceKernel::combine})
    trace::write_trace_files(dir, label, c.buffer.read_trace(kernel, c.memory.stream()));
  c.buffer.enable_trace(0);
  if (run.rank == 0) std::printf("trace: %s written to %s\n", label.c_str(), dir.c_str());
}

// 2c. --baseline nccl. The NCCL dispatcher syncs the host on the counts, so it cannot be captured: its legs are timed
//     as plain launches. It has no expert-major layout; its combine takes its own rank-major rows (identity experts).
void time_baseline(BenchRun const& run, Case& c, CaseTimes& times) {
#if FERRY_BENCH_NCCL
  NcclBaseline nccl(*run.comm, c.config);
  DispatchArgs bargs = c.dargs;
  bargs.expand = false;
  DispatchResult const got = nccl.dispatch(bargs, c.memory.stream());
  void* rows = c.memory.alloc(std::max<int64_t>(got.num_recv_host, 1) * c.row_bytes);
  c.memory.copy(rows, got.recv_x, std::max<int64_t>(got.num_recv_host, 0) * c.row_bytes);
  c.memory.synchronize();
  times.baseline_dispatch = time_case_leg(
      run, c, [&] { nccl.dispatch(bargs, c.memory.stream()); }, false);
  times.baseline_combine = time_case_leg(
      run, c, [&] { nccl.combine(rows, c.y, c.memory.stream()); }, false);
#else
  (void)run, (void)c, (void)times;
#endif
}

// 2d. --backward: a handle of this dispatch's layout (one eager dispatch saves it), then the backward legs on it. The
//     gradients: of the delivered rows, the combine input (identity experts); grad_y, the tokens' own rows; the
//     forward combine's expert outputs (expert layout), the combine input.
void time_backward(BenchRun const& run, Case& c, CaseTimes& times) {
  c.handle = c.buffer.make_handle();
  DispatchArgs save = c.dargs;
  save.save_handle = &c.handle;
  save.eager = true;
  c.buffer.dispatch(save, c.memory.stream());
  c.grad_w = c.memory.alloc(std::max<std::size_t>(1, c.mine.topk_weights.size() * sizeof(float)));
  c.bargs.handle = &c.handle;
  c.bargs.layout = c.layout;
  c.bargs.grad = c.combine_in;
  c.bargs.grad_x = c.y;
  c.bargs.eager = false;
  c.cbargs.handle = &c.handle;
  c.cbargs.layout = c.layout;
  c.cbargs.grad_y = c.x;
  if (c.layout == CombineLayout::expert_major) {
    c.cbargs.x = c.combine_in;
    c.cbargs.grad_topk_weights = static_cast<float*>(c.grad_w);
  }
  c.cbargs.eager = false;
  times.dispatch_backward = time_case_leg(
      run, c, [&] { c.buffer.dispatch_backward(c.bargs, c.memory.stream()); }, run.graph);
  times.combine_backward = time_case_leg(
      run, c, [&] { c.buffer.combine_backward(c.cbargs, c.memory.stream()); }, run.graph);
}

// The check's outcome: "pass", "fail" or "skipped", and the worst rank's error figures of a quantized combine.
struct CheckOutcome {
  std::string result = "skipped";
  double bound_ratio = -1, rel_l2 = -1;
};

// Poisons every output of the last dispatch and y, so that a row the next calls do not write reads as wrong.
void poison_outputs(BenchRun const& run, Case& c) {
  std::size_t const out_row = c.config.recv_row_bytes();
  std::size_t const expert_rows =
      static_cast<std::size_t>(c.config.num_local_experts(run.world)) * c.config.expert_slots();
  if (c.result.recv_x)
    c.memory.fill(c.result.recv_x, 0xff, static_cast<std::size_t>(c.config.recv_capacity(run.world)) * out_row);
  if (c.result.expert_x) c.memory.fill(c.result.expert_x, 0xff, expert_rows * out_row);
  if (c.result.recv_scales)
    c.memory.fill(c.result.recv_scales, 0xff,
                  scale_tensor_bytes(c.config.dispatch_format, c.config.recv_scale_layout,
                                     c.config.recv_capacity(run.world), c.hidden));
  c.memory.fill(c.y, 0xff, c.key.tokens * c.row_bytes);
}

// The rows of a bf16 delivery against the reference: recv_x, or (ll) the filled slots of expert_x. "" when they match.
std::string check_delivered_rows(BenchRun const& run, Case& c, ref::RankDispatch const& want) {
  if (c.result.recv_x) {
    std::vector<uint16_t> got_x(static_cast<std::size_t>(want.num_recv) * c.hidden);
    c.memory.download(got_x.data(), c.result.recv_x, got_x.size() * 2);
    return got_x != want.recv_x ? "recv_x differs" : "";
  }
  std::vector<uint16_t> const want_ex = ref::expand(c.config, run.world, want);
  std::vector<uint16_t> got_ex(want_ex.size());
  c.memory.download(got_ex.data(), c.result.expert_x, got_ex.size() * 2);
  int const slots = c.config.expert_slots();
  for (int e = 0; e < c.config.num_local_experts(run.world); ++e) {
    std::size_t const first = static_cast<std::size_t>(e) * slots * c.hidden;
    std::size_t const filled = static_cast<std::size_t>(std::min(want.expert_counts[e], slots)) * c.hidden;
    if (!std::equal(got_ex.begin() + first, got_ex.begin() + first + filled, want_ex.begin() + first))
      return "expert_x differs";
  }
  return "";
}

// The received metadata against the reference: ids and sources, and (rows_ok: nothing found wrong before) the weights
// of every valid entry. "" when they match; else the last difference found.
std::string check_metadata(Case& c, ref::RankDispatch const& want, bool rows_ok) {
  std::vector<int32_t> got_idx(static_cast<std::size_t>(want.num_recv) * c.config.topk);
  std::vector<float> got_w(got_idx.size());
  std::vector<int32_t> got_src(static_cast<std::size_t>(want.num_recv) * 2);
  c.memory.download(got_idx.data(), c.result.recv_topk_idx, got_idx.size() * 4);
  c.memory.download(got_w.data(), c.result.recv_topk_weights, got_w.size() * 4);
  c.memory.download(got_src.data(), c.result.recv_src, got_src.size() * 4);
  std::string why;
  if (got_idx != want.recv_topk_idx) why = "recv_topk_idx differs";
  if (got_src != want.recv_src) why = "recv_src differs";
  if (!why.empty() || !rows_ok) return why;
  for (std::size_t i = 0; i < got_w.size(); ++i)
    if (want.recv_topk_idx[i] >= 0 && got_w[i] != want.recv_topk_weights[i]) return "recv_topk_weights differ";
  return "";
}

// 3. check: the last outputs against the reference (poisoned first, then one more eager call of each leg), and the
//    backward legs with --backward. Every rank must pass.
CheckOutcome check_case(BenchRun const& run, Case& c) {
  CheckOutcome out;
  bool ok = true;
  std::string why;
  poison_outputs(run, c);
  c.dargs.eager = true;
  c.cargs.eager = true;
  c.result = c.buffer.dispatch(c.dargs, c.memory.stream());
  ref::RankDispatch const& want = *c.want;
  bool const counted = c.result.num_recv_host == want.num_recv;
  if (!counted) {
    ok = false;
    why = detail::concat("num_recv ", c.result.num_recv_host, " != ", want.num_recv);
  } else if (c.quantized_out) {
    why = check_quantized_delivery(c.config, run.world, want, c.result, c.memory);
  } else {
    why = check_delivered_rows(run, c, want);
  }
  ok = ok && why.empty();
  if (counted) {
    std::string const problem = check_metadata(c, want, ok);
    if (!problem.empty()) ok = false, why = problem;
  }
  c.fill_combine_input(c.result);
  c.buffer.combine(c.cargs, c.memory.stream());
  std::vector<uint16_t> got_y(static_cast<std::size_t>(c.key.tokens) * c.hidden);
  c.memory.download(got_y.data(), c.y, got_y.size() * 2);
  IdentityCombine const expected = expected_identity_combine(c.config, c.combine_topology, run.rank, c.mine, c.layout);
  if (got_y != expected.y) ok = false, why += " combine y differs";
  if (expected.worst_bound_ratio > 1.0) ok = false, why += " combine error exceeds its derived bound";
  if (c.config.combine_format != WireFormat::bf16) {
    // the worst rank's error figures
    std::vector<double> const worst =
        max_over_ranks(run.comm->bootstrap(), {expected.worst_bound_ratio, expected.rel_l2}, false, "error");
    out.bound_ratio = worst[0];
    out.rel_l2 = worst[1];
  }
  if (run.backward) {
    std::string const problem = check_backward(
        c.config, run.world, run.rank, c.inputs, c.layout, c.buffer, c.dargs, c.handle, c.bargs, c.cbargs,
        [&](DispatchResult const& from) { c.fill_combine_input(from); }, c.y, c.grad_w, c.memory);
    if (!problem.empty()) ok = false, why += " " + problem;
  }
  int const failed = sum_over_ranks(run.comm->bootstrap(), ok ? 0.0 : 1.0) > 0;
  out.result = failed ? "fail" : "pass";
  if (!ok)
    std::fprintf(stderr, "ferry bench: rank %d check failed at %d tokens: %s\n", run.rank, c.key.tokens, why.c_str());
  return out;
}

// A case's records: the forward legs, and with --backward the backward legs (each beside its forward twin).
struct CaseRecords {
  Record dispatch, combine, dispatch_backward, combine_backward;
};

// 4. bytes and rates: the slowest rank's times, and the bytes each rank sent and received (means over the ranks).
//    Collective.
CaseRecords make_records(BenchRun const& run, Case const& c, CaseTimes const& t, CheckOutcome const& check) {
  EpConfig const& config = c.config;
  int const world = run.world;
  int const per_rank = config.num_experts / world;
  double rows_to_others = 0, rows_received = 0;
  for (int tok = 0; tok < c.key.tokens; ++tok)
    for (int d : destinations(config, world, c.mine, tok)) rows_to_others += d != run.rank;
  for (auto const& in : c.inputs)
    for (int tok = 0; tok < in.num_tokens; ++tok)
      for (int k = 0, hit = 0; k < config.topk && !hit; ++k) {
        int64_t const e = in.topk_idx[static_cast<std::size_t>(tok) * config.topk + k];
        if (e >= 0 && e / per_rank == run.rank) hit = 1, rows_received += 1;
      }
  double const meta_bytes = config.topk * (4.0 + 4.0) + 8.0;
  double const dispatch_bytes = rows_to_others * (wire_row_bytes(config.dispatch_format, c.hidden) + meta_bytes);
  double const combine_bytes = rows_to_others * wire_row_bytes(config.combine_format, c.hidden);
  Bootstrap& bootstrap = run.comm->bootstrap();
  std::vector<double> const slow =
      max_over_ranks(bootstrap,
                     {t.dispatch.median_us, t.dispatch.p10_us, t.dispatch.p90_us, t.combine.median_us, t.combine.p10_us,
                      t.combine.p90_us, t.baseline_dispatch.median_us, t.baseline_combine.median_us,
                      t.dispatch_backward.median_us, t.dispatch_backward.p10_us, t.dispatch_backward.p90_us,
                      t.combine_backward.median_us, t.combine_backward.p10_us, t.combine_backward.p90_us},
                     run.options.flag("per-rank"), "medians");
  double const mean_dispatch_bytes = sum_over_ranks(bootstrap, dispatch_bytes) / world;
  double const mean_combine_bytes = sum_over_ranks(bootstrap, combine_bytes) / world;
  double const mean_logical = sum_over_ranks(bootstrap, rows_received * c.row_bytes) / world;
  // a forward leg's record: its times (slow[first..first + 2]), rates over its bytes, and the baseline's time
  auto const forward_record = [&](char const* leg, WireFormat format, int first, double bytes, double baseline_us) {
    return Record{mode_name(c.key.mode),
                  leg,
                  c.key.tokens,
                  routing_name(c.key.kind),
                  wire_format_name(format),
                  {slow[first], slow[first + 1], slow[first + 2]},
                  bytes / slow[first] / 1e3,
                  mean_logical / slow[first] / 1e3,
                  check.result,
                  baseline_us};
  };
  CaseRecords r;
  r.dispatch = forward_record("dispatch", config.dispatch_format, 0, mean_dispatch_bytes, slow[6]);
  r.combine = forward_record("combine", config.combine_format, 3, mean_combine_bytes, slow[7]);
  r.combine.bound_ratio = check.bound_ratio;
  r.combine.rel_l2 = check.rel_l2;
  // --backward: dispatch_backward moves the forward combine's bytes, combine_backward the forward dispatch's; each
  // record is its forward twin's with the backward leg's times (slow[first..first + 2]) and their ratio
  auto const backward_record = [&](Record const& forward, char const* leg, int first, double bytes) {
    Record record = forward;
    record.leg = leg;
    record.stats = {slow[first], slow[first + 1], slow[first + 2]};
    record.nvlink_gbps = bytes / slow[first] / 1e3;
    record.logical_gbps = mean_logical / slow[first] / 1e3;
    record.baseline_us = -1;
    record.bound_ratio = -1;
    record.forward_ratio = slow[first] / forward.stats.median_us;
    return record;
  };
  r.dispatch_backward = backward_record(r.combine, "dispatch_backward", 8, mean_combine_bytes);
  r.combine_backward = backward_record(r.dispatch, "combine_backward", 11, mean_dispatch_bytes);
  return r;
}

// 5. across nodes: what the protocol sent (the last call of each leg: the same routing as every timed one), and the
//    model's count from the routing: they must be equal (no rows are dropped here). The model's protocol is the one
//    that ran: hierarchical (normal mode; the cpu backend's forward route moves the same rows) or direct (the cpu
//    backend's direct route); the cuda low-latency kernels have their own (records to every rank, rows without
//    metadata: the model's ll-cuda and ll-cuda-fwd counts) and count nothing on the device (EpBuffer::link_bytes is
//    zero there), so only the model's count is printed for them. Collective.
void count_link_bytes(BenchRun const& run, Case& c, CaseRecords& r) {
  bool const cuda_ll = c.ll && run.backend == Backend::cuda;
  CallLinkBytes const sent = c.buffer.link_bytes(c.memory.stream());
  model::Traffic const predicted = model::count_traffic(c.config, run.topology, c.shape.routing, c.key.tokens);
  bool const direct = c.ll && c.route == InternodeRoute::direct;
  model::LegTraffic const& model_dispatch = cuda_ll ? (direct ? predicted.ll_dispatch : predicted.ll_fwd_dispatch)
                                                    : (direct ? predicted.direct_dispatch : predicted.hier_dispatch);
  model::LegTraffic const& model_combine = cuda_ll ? (direct ? predicted.ll_combine : predicted.ll_fwd_combine)
                                                   : (direct ? predicted.direct_combine : predicted.hier_combine);
  auto const fill = [&](Record& record, LinkBytes const& link, model::LegTraffic const& model_leg) {
    record.counted = !cuda_ll;
    record.model_network_bytes = model_leg.network_bytes_mean;
    record.model_nvlink_bytes = model_leg.nvlink_bytes_mean;
    record.route = c.route_label;
    if (!record.counted) return;
    record.network_bytes = sum_over_ranks(run.comm->bootstrap(), static_cast<double>(link.network_bytes)) / run.world;
    record.nvlink_bytes = sum_over_ranks(run.comm->bootstrap(), static_cast<double>(link.nvlink_bytes)) / run.world;
    record.network_gbps = record.network_bytes / record.stats.median_us / 1e3;
    record.nvlink_gbps = record.nvlink_bytes / record.stats.median_us / 1e3;
  };
  fill(r.dispatch, sent.dispatch, model_dispatch);
  fill(r.combine, sent.combine, model_combine);
}

// The case's header line: its shape, layout, world, route, backend and formats.
void print_case_header(BenchRun const& run, Case const& c) {
  EpConfig const& config = c.config;
  std::printf(
      "\n%s  tokens %d/rank  hidden %d  topk %d  experts %d  routing %s  layout %s  world %d%s%s  %s%s  "
      "dispatch %s%s  combine %s\n",
      mode_name(c.key.mode), c.key.tokens, c.hidden, config.topk, config.num_experts, routing_name(c.key.kind),
      c.layout == CombineLayout::expert_major ? "expert" : "rank", run.world, run.across_nodes ? "  route " : "",
      c.route_label, backend_name(run.backend), run.graph ? detail::concat("  graph x", run.graph_calls).c_str() : "",
      wire_format_name(config.dispatch_format),
      config.dispatch_format == WireFormat::bf16
          ? ""
          : (config.dispatch_dequantize
                 ? " (dequantized)"
                 : detail::concat(" (", scale_layout_name(config.recv_scale_layout), ")").c_str()),
      wire_format_name(config.combine_format));
}

// The case's table (rank 0): a row per leg, then what the legs say besides their times.
void print_case(BenchRun const& run, Case& c, CaseRecords const& r, std::vector<Record const*> const& legs,
                std::vector<double> const& host_us) {
  print_case_header(run, c);
  int const leg_width = run.backward ? 17 : 9;
  std::printf("%-*s %10s %10s %10s %12s %13s %11s %8s %6s%s\n", leg_width, "leg", "median_us", "p10_us", "p90_us",
              "nvlink_GB/s", "logical_GB/s", "nccl_us", "speedup", "check", run.backward ? "  vs_forward" : "");
  for (Record const* leg : legs) {
    std::printf("%-*s %10.1f %10.1f %10.1f %12.1f %13.1f", leg_width, leg->leg.c_str(), leg->stats.median_us,
                leg->stats.p10_us, leg->stats.p90_us, leg->nvlink_gbps, leg->logical_gbps);
    if (leg->baseline_us > 0)
      std::printf(" %11.1f %7.2fx", leg->baseline_us, leg->baseline_us / leg->stats.median_us);
    else
      std::printf(" %11s %8s", "-", "-");
    std::printf(" %6s", leg->check == "pass" ? "PASS" : leg->check == "fail" ? "FAIL" : "-");
    if (leg->forward_ratio >= 0)
      std::printf("  %9.2fx", leg->forward_ratio);
    else if (run.backward)
      std::printf("  %10s", "-");
    std::printf("\n");
  }
  if (run.backward)
    std::printf(
        "backward / forward of the same bytes: dispatch_backward / combine %.2fx, combine_backward / dispatch %.2fx\n",
        r.dispatch_backward.forward_ratio, r.combine_backward.forward_ratio);
  if (r.combine.bound_ratio >= 0)
    std::printf("combine %s error: max |y - exact| / derived bound = %.3f (must be <= 1), relative L2 error %.3g\n",
                r.combine.format.c_str(), r.combine.bound_ratio, r.combine.rel_l2);
  if (run.across_nodes)
    for (Record const* leg : {&r.dispatch, &r.combine}) {
      if (leg->counted)
        std::printf(
            "%s across nodes: network %.0f B/rank (ferry model: %.0f, %s), NVLink %.0f B/rank, network %.1f GB/s "
            "(emulated)\n",
            leg->leg.c_str(), leg->network_bytes, leg->model_network_bytes,
            leg->network_bytes == leg->model_network_bytes ? "equal" : "DIFFERENT", leg->nvlink_bytes,
            leg->network_gbps);
      else
        std::printf(
            "%s across nodes: ferry model (%s): network %.0f B/rank, NVLink %.0f B/rank; not counted by the cuda "
            "low-latency kernels\n",
            leg->leg.c_str(), c.route == InternodeRoute::direct ? "ll-cuda" : "ll-cuda-fwd", leg->model_network_bytes,
            leg->model_nvlink_bytes);
    }
  if (!host_us.empty())
    std::printf("host time (%s): dispatch %.2f us/call, combine %.2f us/call, dispatch + combine %.2f us/pair\n",
                run.backend == Backend::cuda ? "lazy calls, enqueue only" : "the cpu backend runs the whole call",
                host_us[0], host_us[1], host_us[2]);
  if (run.options.flag("explain")) std::printf("explain: %s\n", c.buffer.explain().c_str());
}

// One case, start to end: set up, the timed legs and what the options add, the check, the records (collective: every
// rank runs every step in this order).
void run_case(BenchRun& run, CaseKey const& key) {
  Options const& options = run.options;
  Case c(run, key);
  CaseTimes times;
  time_forward_legs(run, c, times);
  if (options.flag("host-time")) times.host_us = time_host(run, c);
  if (!options.str("trace").empty()) trace_case(run, c);
  if (options.str("baseline") == "nccl") time_baseline(run, c, times);
  if (run.backward) time_backward(run, c, times);
  CheckOutcome const check = run.check ? check_case(run, c) : CheckOutcome{};
  CaseRecords r = make_records(run, c, times, check);
  if (run.across_nodes) count_link_bytes(run, c, r);
  std::vector<Record*> legs = {&r.dispatch, &r.combine};
  if (run.backward) legs.insert(legs.end(), {&r.dispatch_backward, &r.combine_backward});
  if (run.rank == 0) print_case(run, c, r, {legs.begin(), legs.end()}, times.host_us);
  if (!times.host_us.empty()) r.dispatch.host_us = times.host_us[0], r.combine.host_us = times.host_us[1];
  for (Record* leg : legs) {
    leg->dispatch_format = wire_format_name(c.config.dispatch_format);
    leg->combine_format = wire_format_name(c.config.combine_format);
    leg->layout = c.layout == CombineLayout::expert_major ? "expert" : "rank";
    run.records.push_back(*leg);
  }
  run.last_shape = c.shape;
}

// --mode both: normal and ll side by side at the same sizes (slowest rank's medians); across nodes a row per
// low-latency route.
void print_mode_comparison(std::vector<Record> const& records) {
  std::printf("\nnormal vs ll (median us, slowest rank)\n%-9s %-9s %-10s %8s %-9s %10s %10s %8s\n", "routing", "leg",
              "format", "tokens", "ll_route", "normal_us", "ll_us", "ll_gain");
  for (Record const& n : records) {
    if (n.mode != "normal") continue;
    for (Record const& l : records)
      if (l.mode == "ll" && l.leg == n.leg && l.tokens == n.tokens && l.routing == n.routing && l.format == n.format)
        std::printf("%-9s %-9s %-10s %8d %-9s %10.1f %10.1f %7.2fx\n", n.routing.c_str(), n.leg.c_str(),
                    n.format.c_str(), n.tokens, l.route.empty() ? "-" : l.route.c_str(), n.stats.median_us,
                    l.stats.median_us, n.stats.median_us / l.stats.median_us);
  }
}

// Several formats: each quantized leg against the bf16 leg of the same run (same mode, size and routing).
void print_format_comparison(std::vector<Record> const& records) {
  std::printf("\nwire formats vs bf16 (median us, slowest rank)\n%-6s %-9s %-9s %8s %-10s %10s %10s %7s\n", "mode",
              "routing", "leg", "tokens", "format", "bf16_us", "format_us", "ratio");
  for (Record const& q : records) {
    if (q.format == "bf16") continue;
    for (Record const& b : records)
      if (b.format == "bf16" && b.mode == q.mode && b.leg == q.leg && b.tokens == q.tokens && b.routing == q.routing &&
          b.route == q.route) {
        std::printf("%-6s %-9s %-9s %8d %-10s %10.1f %10.1f %6.2fx\n", q.mode.c_str(), q.routing.c_str(), q.leg.c_str(),
                    q.tokens, q.format.c_str(), b.stats.median_us, q.stats.median_us,
                    q.stats.median_us / b.stats.median_us);
        break;
      }
  }
}

int run_bench_rank(Options const& options) {
  BenchRun run = start_run(options);
  if (options.flag("floor")) print_floor(options, *run.comm, run.backend, run.graph);
  for (RoutingKind kind : routing_kinds(options))
    for (CaseKey const& key : routing_cases(run, kind)) run_case(run, key);
  if (run.rank == 0 && bench_modes(options).size() > 1) print_mode_comparison(run.records);
  if (run.rank == 0 && format_pairs(options).size() > 1) print_format_comparison(run.records);
  if (run.rank == 0 && !options.str("json").empty())
    write_json(options.str("json"), options, run.last_shape, run.device, run.world, run.graph, run.records);
  bool const any_fail =
      std::any_of(run.records.begin(), run.records.end(), [](Record const& r) { return r.check == "fail"; });
  return any_fail ? 3 : 0;
}

}  // namespace

int bench_main(int argc, char** argv) {
  Options options = make_options();
  if (!options.parse(argc, argv)) return 0;
  if (is_rank_process()) return run_rank("bench", [&] { return run_bench_rank(options); });
  // Launching process: refuse a shape that cannot run before starting anything (one line, exit 2 from main).
  Backend const backend = choose_backend(options, false);
  check_run_options(options, backend);
  util::check_result_path(options.str("json"), "--json");  // before any rank starts: records are written last
  int const nproc = options.str("topology").empty() ? choose_nproc(options.integer("nproc"), backend, kCpuDefaultRanks)
                                                    : parse_topology(options.str("topology")).world();
  FERRY_CHECK_CONFIG(nproc >= 1, "no ranks to run: --backend cuda found no GPU; use --backend cpu");
  for (RoutingKind kind : routing_kinds(options))
    for (int tokens : options.int_list("tokens"))
      for (Mode mode : bench_modes(options))
        for (auto const& formats : format_pairs(options))
          if (mode == Mode::normal || tokens <= kMaxLowLatencyTokens || bench_modes(options).size() == 1)
            for (InternodeRoute route : mode == Mode::low_latency
                                            ? bench_routes(options)
                                            : std::vector<InternodeRoute>{InternodeRoute::automatic})
              make_shape(options, nproc, tokens, kind, 1, mode, formats, route);
  choose_backend(options, true);  // the notice, once the shape is known to be valid
  return launch_self("bench", argc, argv, nproc);
}

}  // namespace ferry::cli
