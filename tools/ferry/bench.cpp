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

int run_bench_rank(Options const& options) {
  Backend const backend = choose_backend(options, false);
  CommunicatorOptions comm_options;
  comm_options.backend = backend;
  comm_options.topology = options.str("topology");
  auto comm = std::shared_ptr<Communicator>(
      Communicator::create(make_socket_bootstrap(socket_bootstrap_options_from_env()), comm_options));
  Topology const topology = comm->topology();
  bool const across_nodes = topology.nodes > 1;
  Bootstrap& bootstrap = comm->bootstrap();
  int const world = comm->world();
  int const rank = comm->rank();
  bool const graph = options.flag("graph");
  bool const check = options.flag("check");
  bool const backward = options.flag("backward");
  std::string const baseline = options.str("baseline");
  check_run_options(options, backend);
  CombineLayout const user_layout =
      options.str("layout") == "expert" ? CombineLayout::expert_major : CombineLayout::rank_major;

  // One seed for every rank: rank 0 draws it (or takes --seed) and broadcasts it.
  uint64_t seed = static_cast<uint64_t>(options.integer("seed"));
  if (seed == 0) seed = (static_cast<uint64_t>(std::random_device{}()) << 20) ^ std::random_device{}();
  bootstrap.broadcast(&seed, sizeof(seed), 0);
  std::string const device = device_name(backend);
  if (rank == 0)
    std::printf("ferry bench: %d ranks, backend %s (%s), seed %llu%s%s\n", world, backend_name(backend), device.c_str(),
                static_cast<unsigned long long>(seed), graph ? ", graph mode" : "",
                across_nodes ? detail::concat(", topology ", topology_name(topology),
                                              " (emulated nodes on one host: the network figures are not network "
                                              "measurements)")
                                   .c_str()
                             : "");

  if (options.flag("floor")) print_floor(options, *comm, backend, graph);

  std::vector<Record> records;
  Shape last_shape;
  int const warmup = options.integer("warmup");
  int const iters = options.integer("iters");
  int const graph_calls = options.integer("graph-calls");
  for (RoutingKind kind : routing_kinds(options)) {
    // (mode, tokens, formats, route): --mode both times both modes at each size, every format pair at each, and
    // low-latency mode every --route (normal mode always forwards: its route stays automatic)
    std::vector<std::tuple<Mode, int, std::pair<WireFormat, WireFormat>, InternodeRoute>> runs;
    for (int tokens : options.int_list("tokens"))
      for (Mode mode : bench_modes(options)) {
        // --mode both: low-latency mode stops at kMaxLowLatencyTokens; larger sizes run in normal mode only
        if (mode == Mode::low_latency && tokens > kMaxLowLatencyTokens && bench_modes(options).size() > 1) {
          if (rank == 0 && kind == routing_kinds(options).front())
            std::printf("note: %d tokens/rank is past low-latency mode's %d: normal mode only at that size\n", tokens,
                        kMaxLowLatencyTokens);
          continue;
        }
        for (auto const& formats : format_pairs(options))
          for (InternodeRoute route : mode == Mode::low_latency
                                          ? bench_routes(options)
                                          : std::vector<InternodeRoute>{InternodeRoute::automatic})
            runs.emplace_back(mode, tokens, formats, route);
      }
    for (auto const& [mode, tokens, formats, user_route] : runs) {
      Shape shape = make_shape(options, world, tokens, kind, seed + tokens, mode, formats, user_route);
      EpConfig& config = shape.config;
      bool const ll = mode == Mode::low_latency;
      // NOTE: low-latency mode returns the expert-major layout (its slots default to the worst case), so its combine
      // takes expert outputs: identity experts = a copy of expert_x.
      CombineLayout const layout = ll ? CombineLayout::expert_major : user_layout;
      // Every rank's input (a pure function of the seed): the reference needs them all.
      std::vector<ref::RankInput> inputs;
      for (int r = 0; r < world; ++r) inputs.push_back(make_input(shape, world, r, tokens));
      ref::RankInput const& mine = inputs[rank];
      if (layout == CombineLayout::expert_major && !ll) {
        int capacity = options.integer("expert-capacity");
        if (capacity == 0) {
          // The largest load any local expert of any rank sees under this routing.
          std::vector<int> load(config.num_experts, 0);
          for (auto const& in : inputs)
            for (int64_t e : in.topk_idx)
              if (e >= 0) ++load[e];
          capacity = std::max(1, *std::max_element(load.begin(), load.end()));
        }
        config.expert_capacity = capacity;
      }
      EpBuffer buffer(comm, config);
      config = buffer.config();  // resolved (ll: expert slots)
      // across nodes: the route the legs take (normal mode: forward, hierarchical); low-latency mode's direct route
      // sums the ranks' rows as one node of every rank does, so its combine reference is that node's
      InternodeRoute const route = config.route();
      char const* const route_label = !across_nodes ? "" : ll ? internode_route_name(route) : "hierarchical";
      Topology const combine_topology =
          ll && route == InternodeRoute::direct ? Topology{1, topology.world()} : topology;
      BenchMemory memory(backend);
      int const hidden = config.hidden;
      std::size_t const row_bytes = static_cast<std::size_t>(hidden) * 2;
      void* x = memory.alloc(std::max<std::size_t>(1, tokens * row_bytes));
      void* idx = memory.alloc(std::max<std::size_t>(1, mine.topk_idx.size() * sizeof(int64_t)));
      void* weights = memory.alloc(std::max<std::size_t>(1, mine.topk_weights.size() * sizeof(float)));
      void* y = memory.alloc(std::max<std::size_t>(1, tokens * row_bytes));
      memory.upload(x, mine.x.data(), tokens * row_bytes);
      memory.upload(idx, mine.topk_idx.data(), mine.topk_idx.size() * sizeof(int64_t));
      memory.upload(weights, mine.topk_weights.data(), mine.topk_weights.size() * sizeof(float));

      DispatchArgs dargs;
      dargs.x = x;
      dargs.num_tokens = tokens;
      dargs.topk_idx = idx;
      dargs.topk_idx_type = IndexType::int64;
      dargs.topk_weights = static_cast<float const*>(weights);
      dargs.expand = layout == CombineLayout::expert_major;

      // 1. one eager dispatch: exact counts, and the combine input (identity experts: the bf16 rows that arrived; for
      //    a quantized delivery, their dequantized values, computed by the reference)
      DispatchResult result = buffer.dispatch(dargs, memory.stream());
      int64_t const num_recv = result.num_recv_host;
      bool const quantized_out = config.delivers_quantized();
      std::optional<ref::RankDispatch> want;  // every rank's inputs through the reference (quantized delivery, --check)
      if (quantized_out || check) want = ref::dispatch(config, world, rank, inputs);
      std::size_t const combine_rows =
          layout == CombineLayout::expert_major
              ? static_cast<std::size_t>(config.num_local_experts(world)) * config.expert_slots()
              : static_cast<std::size_t>(std::max<int64_t>(num_recv, 1));
      void* combine_in = memory.alloc(combine_rows * row_bytes);
      auto const fill_combine_input = [&](DispatchResult const& from) {
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
      };
      fill_combine_input(result);
      memory.synchronize();
      CombineArgs cargs;
      cargs.layout = layout;
      cargs.x = combine_in;
      cargs.y = y;

      // 2. timed legs; a barrier before each so the ranks start together
      dargs.eager = false;
      cargs.eager = false;
      auto const time_leg = [&](std::function<void()> const& enqueue, bool use_graph) {
        return summarize(bench::time_leg(memory, *comm, enqueue, use_graph, warmup, iters, graph_calls));
      };
      LegStats const dispatch_stats = time_leg([&] { buffer.dispatch(dargs, memory.stream()); }, graph);
      LegStats const combine_stats = time_leg([&] { buffer.combine(cargs, memory.stream()); }, graph);
      // 2a. --host-time: the host's side of the same lazy calls (each leg alone, then dispatch + combine pairs)
      std::vector<double> host_us;  // dispatch, combine, pair
      if (options.flag("host-time")) {
        auto const host_leg = [&](std::function<void()> const& enqueue) {
          return summarize(bench::host_time(memory, *comm, enqueue, warmup, iters, kHostTimeCalls)).median_us;
        };
        double const d = host_leg([&] { buffer.dispatch(dargs, memory.stream()); });
        double const c = host_leg([&] { buffer.combine(cargs, memory.stream()); });
        double const pair = host_leg([&] {
          buffer.dispatch(dargs, memory.stream());
          buffer.combine(cargs, memory.stream());
        });
        host_us = max_over_ranks(bootstrap, {d, c, pair}, options.flag("per-rank"), "host time");
      }

      // 2b. --trace: one more call of each leg with the in-kernel recorder on, dumped per rank (ferry trace reads it)
      if (!options.str("trace").empty()) {
        int64_t const events = env_optional_int("FERRY_TRACE_EVENTS").value_or(0);  // events per warp
        buffer.enable_trace(events > 0 ? static_cast<int>(events) : 1024);
        comm->barrier(memory.stream());
        buffer.dispatch(dargs, memory.stream());
        comm->barrier(memory.stream());
        buffer.combine(cargs, memory.stream());
        // one label per case: the wire formats too, or a later format pair would overwrite this one's files
        std::string const label =
            detail::concat(mode_name(mode), "-", routing_name(kind), "-", tokens, "-", wire_format_name(formats.first),
                           "-", wire_format_name(formats.second));
        bool const ll = mode == Mode::low_latency;
        for (TraceKernel kernel : {ll ? TraceKernel::ll_dispatch : TraceKernel::dispatch,
                                   ll ? TraceKernel::ll_combine : TraceKernel::combine})
          trace::write_trace_files(options.str("trace"), label, buffer.read_trace(kernel, memory.stream()));
        buffer.enable_trace(0);
        if (rank == 0) std::printf("trace: %s written to %s\n", label.c_str(), options.str("trace").c_str());
      }

      LegStats baseline_dispatch, baseline_combine;
#if FERRY_BENCH_NCCL
      if (baseline == "nccl") {
        // The NCCL dispatcher syncs the host on the counts, so it cannot be captured: its legs are timed as plain
        // launches. It has no expert-major layout; its combine takes its own rank-major rows (identity experts).
        NcclBaseline nccl(*comm, config);
        DispatchArgs bargs = dargs;
        bargs.expand = false;
        DispatchResult const got = nccl.dispatch(bargs, memory.stream());
        void* rows = memory.alloc(std::max<int64_t>(got.num_recv_host, 1) * row_bytes);
        memory.copy(rows, got.recv_x, std::max<int64_t>(got.num_recv_host, 0) * row_bytes);
        memory.synchronize();
        baseline_dispatch = time_leg([&] { nccl.dispatch(bargs, memory.stream()); }, false);
        baseline_combine = time_leg([&] { nccl.combine(rows, y, memory.stream()); }, false);
      }
#endif

      // 2c. --backward: a handle of this dispatch's layout (one eager dispatch saves it), then the backward legs on it.
      //     The gradients: of the delivered rows, the combine input (identity experts); grad_y, the tokens' own rows;
      //     the forward combine's expert outputs (expert layout), the combine input.
      LegStats dispatch_backward_stats, combine_backward_stats;
      DispatchHandle handle;
      DispatchBackwardArgs bargs;
      CombineBackwardArgs cbargs;
      void* grad_w = nullptr;
      if (backward) {
        handle = buffer.make_handle();
        DispatchArgs save = dargs;
        save.save_handle = &handle;
        save.eager = true;
        buffer.dispatch(save, memory.stream());
        grad_w = memory.alloc(std::max<std::size_t>(1, mine.topk_weights.size() * sizeof(float)));
        bargs.handle = &handle;
        bargs.layout = layout;
        bargs.grad = combine_in;
        bargs.grad_x = y;
        bargs.eager = false;
        cbargs.handle = &handle;
        cbargs.layout = layout;
        cbargs.grad_y = x;
        if (layout == CombineLayout::expert_major) {
          cbargs.x = combine_in;
          cbargs.grad_topk_weights = static_cast<float*>(grad_w);
        }
        cbargs.eager = false;
        dispatch_backward_stats = time_leg([&] { buffer.dispatch_backward(bargs, memory.stream()); }, graph);
        combine_backward_stats = time_leg([&] { buffer.combine_backward(cbargs, memory.stream()); }, graph);
      }

      // 3. check: the last outputs against the reference (poisoned first, then one more eager call of each leg)
      std::string check_result = "skipped";
      double combine_bound_ratio = -1, combine_rel_l2 = -1;
      if (check) {
        bool ok = true;
        std::string why;
        std::size_t const out_row = config.recv_row_bytes();
        std::size_t const expert_rows =
            static_cast<std::size_t>(config.num_local_experts(world)) * config.expert_slots();
        if (result.recv_x)
          memory.fill(result.recv_x, 0xff, static_cast<std::size_t>(config.recv_capacity(world)) * out_row);
        if (result.expert_x) memory.fill(result.expert_x, 0xff, expert_rows * out_row);
        if (result.recv_scales)
          memory.fill(result.recv_scales, 0xff,
                      scale_tensor_bytes(config.dispatch_format, config.recv_scale_layout, config.recv_capacity(world),
                                         hidden));
        memory.fill(y, 0xff, tokens * row_bytes);
        dargs.eager = true;
        cargs.eager = true;
        result = buffer.dispatch(dargs, memory.stream());
        ref::RankDispatch const& ref_dispatch = *want;
        std::vector<uint16_t> got_x(static_cast<std::size_t>(ref_dispatch.num_recv) * hidden);
        std::vector<int32_t> got_idx(static_cast<std::size_t>(ref_dispatch.num_recv) * config.topk);
        std::vector<float> got_w(got_idx.size());
        std::vector<int32_t> got_src(static_cast<std::size_t>(ref_dispatch.num_recv) * 2);
        if (result.num_recv_host != ref_dispatch.num_recv) {
          ok = false;
          why = detail::concat("num_recv ", result.num_recv_host, " != ", ref_dispatch.num_recv);
        } else if (quantized_out) {
          std::string const problem = check_quantized_delivery(config, world, ref_dispatch, result, memory);
          if (!problem.empty()) ok = false, why = problem;
        } else {
          if (result.recv_x) memory.download(got_x.data(), result.recv_x, got_x.size() * 2);
          if (result.recv_x && got_x != ref_dispatch.recv_x) ok = false, why = "recv_x differs";
          if (!result.recv_x) {  // ll: the expert-major rows (filled slots) instead
            std::vector<uint16_t> const want_ex = ref::expand(config, world, ref_dispatch);
            std::vector<uint16_t> got_ex(want_ex.size());
            memory.download(got_ex.data(), result.expert_x, got_ex.size() * 2);
            int const slots = config.expert_slots();
            for (int e = 0; e < config.num_local_experts(world) && ok; ++e) {
              std::size_t const first = static_cast<std::size_t>(e) * slots * hidden;
              std::size_t const filled =
                  static_cast<std::size_t>(std::min(ref_dispatch.expert_counts[e], slots)) * hidden;
              if (!std::equal(got_ex.begin() + first, got_ex.begin() + first + filled, want_ex.begin() + first))
                ok = false, why = "expert_x differs";
            }
          }
        }
        if (result.num_recv_host == ref_dispatch.num_recv) {
          memory.download(got_idx.data(), result.recv_topk_idx, got_idx.size() * 4);
          memory.download(got_w.data(), result.recv_topk_weights, got_w.size() * 4);
          memory.download(got_src.data(), result.recv_src, got_src.size() * 4);
          if (got_idx != ref_dispatch.recv_topk_idx) ok = false, why = "recv_topk_idx differs";
          if (got_src != ref_dispatch.recv_src) ok = false, why = "recv_src differs";
          for (std::size_t i = 0; i < got_w.size() && ok; ++i)
            if (ref_dispatch.recv_topk_idx[i] >= 0 && got_w[i] != ref_dispatch.recv_topk_weights[i])
              ok = false, why = "recv_topk_weights differ";
        }
        fill_combine_input(result);
        buffer.combine(cargs, memory.stream());
        std::vector<uint16_t> got_y(static_cast<std::size_t>(tokens) * hidden);
        memory.download(got_y.data(), y, got_y.size() * 2);
        IdentityCombine const expected = expected_identity_combine(config, combine_topology, rank, mine, layout);
        if (got_y != expected.y) ok = false, why += " combine y differs";
        if (expected.worst_bound_ratio > 1.0) ok = false, why += " combine error exceeds its derived bound";
        if (config.combine_format != WireFormat::bf16) {
          // the worst rank's error figures
          std::vector<double> const worst =
              max_over_ranks(bootstrap, {expected.worst_bound_ratio, expected.rel_l2}, false, "error");
          combine_bound_ratio = worst[0];
          combine_rel_l2 = worst[1];
        }
        if (backward) {
          std::string const problem = check_backward(config, world, rank, inputs, layout, buffer, dargs, handle, bargs,
                                                     cbargs, fill_combine_input, y, grad_w, memory);
          if (!problem.empty()) ok = false, why += " " + problem;
        }
        // Every rank must pass.
        int const failed = sum_over_ranks(bootstrap, ok ? 0.0 : 1.0) > 0;
        check_result = failed ? "fail" : "pass";
        if (!ok)
          std::fprintf(stderr, "ferry bench: rank %d check failed at %d tokens: %s\n", rank, tokens, why.c_str());
      }

      // 4. bytes and rates
      int const per_rank = config.num_experts / world;
      double rows_to_others = 0, rows_received = 0;
      for (int t = 0; t < tokens; ++t)
        for (int d : destinations(config, world, mine, t)) rows_to_others += d != rank;
      for (auto const& in : inputs)
        for (int t = 0; t < in.num_tokens; ++t)
          for (int k = 0, hit = 0; k < config.topk && !hit; ++k) {
            int64_t const e = in.topk_idx[static_cast<std::size_t>(t) * config.topk + k];
            if (e >= 0 && e / per_rank == rank) hit = 1, rows_received += 1;
          }
      double const meta_bytes = config.topk * (4.0 + 4.0) + 8.0;
      double const dispatch_bytes = rows_to_others * (wire_row_bytes(config.dispatch_format, hidden) + meta_bytes);
      double const combine_bytes = rows_to_others * wire_row_bytes(config.combine_format, hidden);
      std::vector<double> const slow = max_over_ranks(
          bootstrap,
          {dispatch_stats.median_us, dispatch_stats.p10_us, dispatch_stats.p90_us, combine_stats.median_us,
           combine_stats.p10_us, combine_stats.p90_us, baseline_dispatch.median_us, baseline_combine.median_us,
           dispatch_backward_stats.median_us, dispatch_backward_stats.p10_us, dispatch_backward_stats.p90_us,
           combine_backward_stats.median_us, combine_backward_stats.p10_us, combine_backward_stats.p90_us},
          options.flag("per-rank"), "medians");
      double const mean_dispatch_bytes = sum_over_ranks(bootstrap, dispatch_bytes) / world;
      double const mean_combine_bytes = sum_over_ranks(bootstrap, combine_bytes) / world;
      double const mean_logical = sum_over_ranks(bootstrap, rows_received * row_bytes) / world;
      Record dispatch_record{mode_name(mode),
                             "dispatch",
                             tokens,
                             routing_name(kind),
                             wire_format_name(config.dispatch_format),
                             {slow[0], slow[1], slow[2]},
                             mean_dispatch_bytes / slow[0] / 1e3,
                             mean_logical / slow[0] / 1e3,
                             check_result,
                             slow[6]};
      Record combine_record{mode_name(mode),
                            "combine",
                            tokens,
                            routing_name(kind),
                            wire_format_name(config.combine_format),
                            {slow[3], slow[4], slow[5]},
                            mean_combine_bytes / slow[3] / 1e3,
                            mean_logical / slow[3] / 1e3,
                            check_result,
                            slow[7],
                            combine_bound_ratio,
                            combine_rel_l2};
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
      Record dispatch_backward_record = backward_record(combine_record, "dispatch_backward", 8, mean_combine_bytes);
      Record combine_backward_record = backward_record(dispatch_record, "combine_backward", 11, mean_dispatch_bytes);
      if (across_nodes) {
        // what the protocol sent (the last call of each leg: the same routing as every timed one), and the model's
        // count from the routing: they must be equal (no rows are dropped here). The model's protocol is the one
        // that ran: hierarchical (normal mode; the cpu backend's forward route moves the same rows) or direct (the
        // cpu backend's direct route); the cuda low-latency kernels have their own (records to every rank, rows
        // without metadata: the model's ll-cuda and ll-cuda-fwd counts) and count nothing on the device
        // (EpBuffer::link_bytes is zero there), so only the model's count is printed for them.
        bool const cuda_ll = ll && backend == Backend::cuda;
        CallLinkBytes const sent = buffer.link_bytes(memory.stream());
        model::Traffic const predicted = model::count_traffic(config, topology, shape.routing, tokens);
        bool const direct = ll && route == InternodeRoute::direct;
        model::LegTraffic const& model_dispatch = cuda_ll
                                                      ? (direct ? predicted.ll_dispatch : predicted.ll_fwd_dispatch)
                                                      : (direct ? predicted.direct_dispatch : predicted.hier_dispatch);
        model::LegTraffic const& model_combine = cuda_ll ? (direct ? predicted.ll_combine : predicted.ll_fwd_combine)
                                                         : (direct ? predicted.direct_combine : predicted.hier_combine);
        auto const fill = [&](Record& record, LinkBytes const& link, model::LegTraffic const& model_leg) {
          record.counted = !cuda_ll;
          record.model_network_bytes = model_leg.network_bytes_mean;
          record.model_nvlink_bytes = model_leg.nvlink_bytes_mean;
          record.route = route_label;
          if (!record.counted) return;
          record.network_bytes = sum_over_ranks(bootstrap, static_cast<double>(link.network_bytes)) / world;
          record.nvlink_bytes = sum_over_ranks(bootstrap, static_cast<double>(link.nvlink_bytes)) / world;
          record.network_gbps = record.network_bytes / record.stats.median_us / 1e3;
          record.nvlink_gbps = record.nvlink_bytes / record.stats.median_us / 1e3;
        };
        fill(dispatch_record, sent.dispatch, model_dispatch);
        fill(combine_record, sent.combine, model_combine);
      }
      std::vector<Record*> legs = {&dispatch_record, &combine_record};
      if (backward) legs.insert(legs.end(), {&dispatch_backward_record, &combine_backward_record});
      if (rank == 0) {
        std::printf(
            "\n%s  tokens %d/rank  hidden %d  topk %d  experts %d  routing %s  layout %s  world %d%s%s  %s%s  "
            "dispatch %s%s  combine %s\n",
            mode_name(mode), tokens, hidden, config.topk, config.num_experts, routing_name(kind),
            layout == CombineLayout::expert_major ? "expert" : "rank", world, across_nodes ? "  route " : "",
            route_label, backend_name(backend), graph ? detail::concat("  graph x", graph_calls).c_str() : "",
            wire_format_name(config.dispatch_format),
            config.dispatch_format == WireFormat::bf16
                ? ""
                : (config.dispatch_dequantize
                       ? " (dequantized)"
                       : detail::concat(" (", scale_layout_name(config.recv_scale_layout), ")").c_str()),
            wire_format_name(config.combine_format));
        int const leg_width = backward ? 17 : 9;
        std::printf("%-*s %10s %10s %10s %12s %13s %11s %8s %6s%s\n", leg_width, "leg", "median_us", "p10_us", "p90_us",
                    "nvlink_GB/s", "logical_GB/s", "nccl_us", "speedup", "check", backward ? "  vs_forward" : "");
        for (Record const* r : legs) {
          std::printf("%-*s %10.1f %10.1f %10.1f %12.1f %13.1f", leg_width, r->leg.c_str(), r->stats.median_us,
                      r->stats.p10_us, r->stats.p90_us, r->nvlink_gbps, r->logical_gbps);
          if (r->baseline_us > 0)
            std::printf(" %11.1f %7.2fx", r->baseline_us, r->baseline_us / r->stats.median_us);
          else
            std::printf(" %11s %8s", "-", "-");
          std::printf(" %6s", r->check == "pass" ? "PASS" : r->check == "fail" ? "FAIL" : "-");
          if (r->forward_ratio >= 0)
            std::printf("  %9.2fx", r->forward_ratio);
          else if (backward)
            std::printf("  %10s", "-");
          std::printf("\n");
        }
        if (backward)
          std::printf(
              "backward / forward of the same bytes: dispatch_backward / combine %.2fx, combine_backward / "
              "dispatch %.2fx\n",
              dispatch_backward_record.forward_ratio, combine_backward_record.forward_ratio);
        if (combine_record.bound_ratio >= 0)
          std::printf(
              "combine %s error: max |y - exact| / derived bound = %.3f (must be <= 1), relative L2 error %.3g\n",
              combine_record.format.c_str(), combine_record.bound_ratio, combine_record.rel_l2);
        if (across_nodes)
          for (Record const* r : {&dispatch_record, &combine_record}) {
            if (r->counted)
              std::printf(
                  "%s across nodes: network %.0f B/rank (ferry model: %.0f, %s), NVLink %.0f B/rank, network %.1f "
                  "GB/s (emulated)\n",
                  r->leg.c_str(), r->network_bytes, r->model_network_bytes,
                  r->network_bytes == r->model_network_bytes ? "equal" : "DIFFERENT", r->nvlink_bytes, r->network_gbps);
            else
              std::printf(
                  "%s across nodes: ferry model (%s): network %.0f B/rank, NVLink %.0f B/rank; not counted by the "
                  "cuda low-latency kernels\n",
                  r->leg.c_str(), route == InternodeRoute::direct ? "ll-cuda" : "ll-cuda-fwd", r->model_network_bytes,
                  r->model_nvlink_bytes);
          }
        if (!host_us.empty())
          std::printf("host time (%s): dispatch %.2f us/call, combine %.2f us/call, dispatch + combine %.2f us/pair\n",
                      backend == Backend::cuda ? "lazy calls, enqueue only" : "the cpu backend runs the whole call",
                      host_us[0], host_us[1], host_us[2]);
        if (options.flag("explain")) std::printf("explain: %s\n", buffer.explain().c_str());
      }
      if (!host_us.empty()) dispatch_record.host_us = host_us[0], combine_record.host_us = host_us[1];
      for (Record* r : legs) {
        r->dispatch_format = wire_format_name(config.dispatch_format);
        r->combine_format = wire_format_name(config.combine_format);
        r->layout = layout == CombineLayout::expert_major ? "expert" : "rank";
      }
      for (Record const* r : legs) records.push_back(*r);
      last_shape = shape;
    }
  }
  if (rank == 0 && bench_modes(options).size() > 1) {
    // --mode both: normal and ll side by side at the same sizes (slowest rank's medians); across nodes a row per
    // low-latency route
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
  if (rank == 0 && format_pairs(options).size() > 1) {
    // several formats: each quantized leg against the bf16 leg of the same run (same mode, size and routing)
    std::printf("\nwire formats vs bf16 (median us, slowest rank)\n%-6s %-9s %-9s %8s %-10s %10s %10s %7s\n", "mode",
                "routing", "leg", "tokens", "format", "bf16_us", "format_us", "ratio");
    for (Record const& q : records) {
      if (q.format == "bf16") continue;
      for (Record const& b : records)
        if (b.format == "bf16" && b.mode == q.mode && b.leg == q.leg && b.tokens == q.tokens &&
            b.routing == q.routing && b.route == q.route) {
          std::printf("%-6s %-9s %-9s %8d %-10s %10.1f %10.1f %6.2fx\n", q.mode.c_str(), q.routing.c_str(),
                      q.leg.c_str(), q.tokens, q.format.c_str(), b.stats.median_us, q.stats.median_us,
                      q.stats.median_us / b.stats.median_us);
          break;
        }
    }
  }
  if (rank == 0 && !options.str("json").empty())
    write_json(options.str("json"), options, last_shape, device, world, graph, records);
  bool const any_fail = std::any_of(records.begin(), records.end(), [](Record const& r) { return r.check == "fail"; });
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
