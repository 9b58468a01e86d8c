// Low-latency mode on the cuda backend, compared bit for bit with the reference (src/ep/reference.hpp): expert-major
// dispatch, both combine layouts, the split API (return_recv_hook), consecutive calls and layers (several EpBuffers
// on one communicator), 1000 graph replays with fresh inputs, and a rank that skips a call (TimeoutError naming it).
// Each test starts one process per rank (2 GPUs); every child rebuilds every rank's inputs from the seed the parent
// passes (printed), so the children agree on the expected results without talking.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ep/reference.hpp"
#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "support/entry_tokens.hpp"
#include "support/gpu_case.hpp"
#include "support/ll_check.hpp"
#include "workloads/inputs.hpp"
#include "workloads/routing.hpp"

#if FERRY_HAVE_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#endif

namespace ferry::test {
namespace {

// Runs `name` on gpu_test_world() ranks (2 unless FERRY_TEST_WORLD says otherwise) with `args`; skips below that
// many GPUs.
void run_case(char const* name, std::vector<std::string> args,
              std::vector<std::pair<std::string, std::string>> env = {}) {
  run_gpu_case(gpu_test_world(), name, std::move(args), std::move(env));
}

#if FERRY_HAVE_CUDA

struct Spec : CaseShape {
  int max_tokens = 0;   // max_tokens= (0: the largest of tokens)
  int capacity = 0;     // capacity=: expert_capacity (0: ll's default, world * max_tokens)
  int check_every = 1;  // graph: check every n-th replay fully (and the last)
  int layers = 1;       // EpBuffers on one communicator, used in turn
  bool hook = false;
  bool int32_ids = false;
  int blocks = 0;  // blocks=: pins the LL grid (EpConfig::dispatch_geometry; 0: the default, one CTA per SM)
};

Spec parse_spec(std::vector<std::string> const& words) {
  CaseArgs const args(words);
  Spec s;
  s.read(args);
  s.max_tokens = args.integer("max_tokens", s.max_tokens);
  s.capacity = args.integer("capacity", s.capacity);
  s.check_every = args.integer("check_every", s.check_every);
  s.layers = args.integer("layers", s.layers);
  s.hook = args.flag("hook", s.hook);
  s.int32_ids = args.flag("int32", s.int32_ids);
  s.blocks = args.integer("blocks", s.blocks);
  return s;
}

// Device inputs at fixed addresses (a captured graph reads whatever is copied into them before a replay).
struct DeviceInputs {
  void* x = nullptr;
  void* idx = nullptr;
  void* w = nullptr;
  void* rows = nullptr;  // rank-major combine input
  void* eout = nullptr;  // expert-major combine input
  void* y_em = nullptr;
  void* y_rm = nullptr;
  std::size_t y_bytes = 0;
  DeviceInputs(std::size_t x_bytes, std::size_t idx_bytes, std::size_t w_bytes, std::size_t rows_bytes,
               std::size_t eout_bytes, std::size_t y_bytes_) {
    y_bytes = std::max<std::size_t>(y_bytes_, 16);
    CK(cudaMalloc(&x, std::max<std::size_t>(x_bytes, 16)));
    CK(cudaMalloc(&idx, std::max<std::size_t>(idx_bytes, 16)));
    CK(cudaMalloc(&w, std::max<std::size_t>(w_bytes, 16)));
    CK(cudaMalloc(&rows, std::max<std::size_t>(rows_bytes, 16)));
    CK(cudaMalloc(&eout, std::max<std::size_t>(eout_bytes, 16)));
    CK(cudaMalloc(&y_em, y_bytes + 4096));  // + a guard row area that must stay poisoned
    CK(cudaMalloc(&y_rm, y_bytes + 4096));
  }
  ~DeviceInputs() {
    for (void* p : {x, idx, w, rows, eout, y_em, y_rm}) cudaFree(p);
  }
};

// One call of every leg on one layer: dispatch (+ hook), expert-major combine (+ hook), rank-major combine.
void enqueue_layer(EpBuffer& buffer, DispatchArgs const& dargs, CombineArgs const& em, CombineArgs const& rm, bool hook,
                   cudaStream_t stream) {
  buffer.dispatch(dargs, stream);
  if (hook) buffer.complete_dispatch(stream);
  buffer.combine(em, stream);
  if (hook) buffer.complete_combine(stream);
  buffer.combine(rm, stream);
  if (hook) buffer.complete_combine(stream);
}

int ll_case() {
  Spec const spec = parse_spec(rank_case_args());
  auto comm = make_cuda_comm();
  int const rank = comm->rank();
  int const world = comm->world();
  std::vector<int> const tokens = per_rank(spec.tokens, world);  // the lists are written for 2 ranks
  CK(cudaSetDevice(comm->device()));

  EpConfig user = spec.config();
  user.mode = Mode::low_latency;
  if (spec.max_tokens > 0) user.max_tokens_per_rank = spec.max_tokens;
  // NOTE: large shapes pin a capacity well above the expected load: the reference needs every rank's full
  // [experts, slots, hidden] expert outputs on the host, which at the default (world x max_tokens slots) is gigabytes.
  if (spec.capacity > 0) user.expert_capacity = spec.capacity;
  if (spec.blocks > 0) user.dispatch_geometry = Geometry{spec.blocks};
  std::vector<std::unique_ptr<EpBuffer>> layers;
  for (int l = 0; l < spec.layers; ++l) layers.push_back(std::make_unique<EpBuffer>(comm, user));
  EpConfig const config = layers[0]->config();  // resolved
  int const hidden = spec.hidden;
  int const topk = spec.topk;
  int const num_local = config.num_local_experts(world);
  int const slots = config.expert_slots();
  int const my_tokens = tokens[rank];
  int const max_rows = world * config.max_tokens_per_rank;
  std::fprintf(stderr, "rank %d: seed %llu routing %s tokens %d hidden %d topk %d experts %d hook %d graph %d\n", rank,
               static_cast<unsigned long long>(spec.seed), spec.routing.c_str(), my_tokens, hidden, topk, spec.experts,
               spec.hook, spec.graph);

  std::size_t const row_bytes = static_cast<std::size_t>(hidden) * 2;
  std::size_t const idx_bytes = spec.int32_ids ? 4 : 8;
  DeviceInputs dev(my_tokens * row_bytes, static_cast<std::size_t>(my_tokens) * topk * idx_bytes,
                   static_cast<std::size_t>(my_tokens) * topk * 4, max_rows * row_bytes,
                   static_cast<std::size_t>(num_local) * slots * row_bytes, my_tokens * row_bytes);
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  DispatchArgs dargs;
  dargs.x = dev.x;
  dargs.num_tokens = my_tokens;
  dargs.topk_idx = dev.idx;
  dargs.topk_idx_type = spec.int32_ids ? IndexType::int32 : IndexType::int64;
  dargs.topk_weights = static_cast<float const*>(dev.w);
  dargs.eager = !spec.graph;
  dargs.return_recv_hook = spec.hook;
  CombineArgs em{CombineLayout::expert_major, dev.eout, dev.y_em, !spec.graph, spec.hook};
  CombineArgs rm{CombineLayout::rank_major, dev.rows, dev.y_rm, !spec.graph, spec.hook};

  cudaGraphExec_t graph = nullptr;
  std::vector<DispatchResult> results(spec.layers);
  bool eout_uploaded = false;

  for (int iter = 0; iter < spec.iters; ++iter) {
    bool const check = !spec.graph || iter % spec.check_every == 0 || iter == spec.iters - 1;
    RoutingOptions const routing = spec.routing_options(iter);
    auto const inputs = ref::generate_inputs(config, world, routing, tokens);
    auto const& in = inputs[rank];
    // upload this rank's dispatch inputs (fresh every iteration)
    // (on the stream: after the previous replay has read the old ones)
    CK(cudaMemcpyAsync(dev.x, in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice, stream));
    std::vector<int32_t> const idx32(in.topk_idx.begin(), in.topk_idx.end());
    if (spec.int32_ids)
      CK(cudaMemcpyAsync(dev.idx, idx32.data(), idx32.size() * 4, cudaMemcpyHostToDevice, stream));
    else
      CK(cudaMemcpyAsync(dev.idx, in.topk_idx.data(), in.topk_idx.size() * 8, cudaMemcpyHostToDevice, stream));
    CK(cudaMemcpyAsync(dev.w, in.topk_weights.data(), in.topk_weights.size() * 4, cudaMemcpyHostToDevice, stream));
    CK(cudaStreamSynchronize(stream));  // the host vectors die with this iteration

    std::vector<ref::RankDispatch> expected;
    std::vector<std::vector<uint16_t>> rows(world), eout(world);
    if (check) {
      for (int r = 0; r < world; ++r) expected.push_back(ref::dispatch(config, world, r, inputs));
      // combine inputs of every rank, deterministic in (seed, rank); fresh on checked iterations only (cost)
      for (int r = 0; r < world; ++r) {
        rows[r] = generate_tokens(routing.seed + 101, r, expected[r].num_recv, hidden);
        eout[r] = generate_tokens(routing.seed + 202, r, num_local * slots, hidden);
      }
      CK(cudaMemcpy(dev.rows, rows[rank].data(), rows[rank].size() * 2, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dev.eout, eout[rank].data(), eout[rank].size() * 2, cudaMemcpyHostToDevice));
      eout_uploaded = true;
      // poison what the calls write
      CK(cudaMemset(dev.y_em, 0xEE, dev.y_bytes + 4096));
      CK(cudaMemset(dev.y_rm, 0xEE, dev.y_bytes + 4096));
      for (auto const& result : results)
        if (result.expert_x) poison_ll_dispatch(config, world, result);
    } else if (!eout_uploaded) {
      CK(cudaMemset(dev.eout, 0, static_cast<std::size_t>(num_local) * slots * row_bytes));
      eout_uploaded = true;
    }
    CK(cudaDeviceSynchronize());

    if (!spec.graph) {
      for (int l = 0; l < spec.layers; ++l) {
        EpBuffer& buffer = *layers[l];
        DispatchResult result = buffer.dispatch(dargs, stream);
        if (spec.hook) {
          if (result.num_recv_host != -1) return fail("num_recv_host before the hook", rank, iter, 0);
          result = buffer.complete_dispatch(stream);
        }
        results[l] = result;
        if (result.num_recv_host != expected[rank].num_recv)
          return fail("num_recv_host", rank, iter, result.num_recv_host);
        if (result.recv_x != nullptr) return fail("recv_x not null", rank, iter, 0);
        buffer.combine(em, stream);
        if (spec.hook) buffer.complete_combine(stream);
        if (l + 1 == spec.layers) {  // rank-major on the last layer (its rows are checked below)
          buffer.combine(rm, stream);
          if (spec.hook) buffer.complete_combine(stream);
        }
      }
    } else {
      if (!graph) {
        // one eager round first (result pointers), then the capture of every layer's legs
        for (int l = 0; l < spec.layers; ++l) {
          DispatchArgs eager = dargs;
          eager.eager = true;
          eager.return_recv_hook = false;
          results[l] = layers[l]->dispatch(eager, stream);
          layers[l]->combine(CombineArgs{CombineLayout::expert_major, dev.eout, dev.y_em, true}, stream);
        }
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        for (int l = 0; l < spec.layers; ++l) enqueue_layer(*layers[l], dargs, em, rm, spec.hook, stream);
        CK(cudaStreamEndCapture(stream, &g));
        CK(cudaGraphInstantiate(&graph, g, 0));
        CK(cudaGraphDestroy(g));
        CK(cudaMemset(dev.y_em, 0xEE, dev.y_bytes + 4096));  // the eager round wrote y
        CK(cudaDeviceSynchronize());
      }
      CK(cudaGraphLaunch(graph, stream));
      if (!check) continue;  // unchecked replays queue back to back (a hang would end in TimeoutError below)
      CK(cudaStreamSynchronize(stream));
      comm->check_errors(stream);
    }
    if (!check) continue;

    // dispatch outputs of every layer (the same inputs)
    for (int l = 0; l < spec.layers; ++l)
      if (int const code = check_ll_dispatch(config, world, rank, iter, expected[rank], results[l])) return code;

    // combine outputs (the last layer's, written last)
    auto const y_ref_em = ref::combine_expert_major(config, world, rank, inputs, expected, eout);
    if (int const code = check_combined("y expert-major", dev.y_em, y_ref_em, 2048, rank, iter)) return code;
    auto const y_ref_rm = ref::combine_rank_major(config, world, rank, inputs, expected, rows);
    if (int const code = check_combined("y rank-major", dev.y_rm, y_ref_rm, 0, rank, iter)) return code;
  }
  CK(cudaStreamSynchronize(stream));
  comm->check_errors(stream);
  if (graph) cudaGraphExecDestroy(graph);
  cudaStreamDestroy(stream);
  std::fprintf(stderr, "rank %d: %d iterations exact\n", rank, spec.iters);
  return 0;
}

FERRY_RANK_CASE(ll) {
  return ll_case();
}

// Hook misuse is refused on the host (both ranks misuse it alike, so nobody waits); then rank 1 skips a dispatch:
// rank 0 must raise TimeoutError naming rank 1 within FERRY_TIMEOUT_S, not hang.
FERRY_RANK_CASE(ll_hook_misuse_and_timeout) {
  auto comm = make_cuda_comm();
  CK(cudaSetDevice(comm->device()));
  EpConfig config;
  config.mode = Mode::low_latency;
  config.hidden = 2048;
  config.num_experts = 64;
  config.max_tokens_per_rank = 32;
  EpBuffer buffer(comm, config);
  int code = 0;
  auto expect_input_error = [&](auto&& fn, char const* part) {
    try {
      fn();
      std::fprintf(stderr, "rank %d: no InputError (%s)\n", comm->rank(), part);
      code = 1;
    } catch (InputError const& error) {
      if (std::string(error.what()).find(part) == std::string::npos) {
        std::fprintf(stderr, "rank %d: '%s' not in %s\n", comm->rank(), part, error.what());
        code = 1;
      }
    }
  };
  expect_input_error([&] { buffer.complete_dispatch(); }, "none is pending");
  DispatchArgs hooked;  // zero tokens: takes part in the exchange
  hooked.return_recv_hook = true;
  buffer.dispatch(hooked);
  expect_input_error([&] { buffer.dispatch(hooked); }, "complete_dispatch first");
  buffer.complete_dispatch();
  expect_input_error([&] { buffer.complete_dispatch(); }, "none is pending");

  if (comm->rank() == 0) {
    DispatchArgs args;
    try {
      buffer.dispatch(args);
      std::fprintf(stderr, "rank 0: dispatch returned without rank 1\n");
      code = 1;
    } catch (TimeoutError const& error) {
      std::string const what = error.what();
      std::fprintf(stderr, "rank 0: TimeoutError as expected: %s\n", what.c_str());
      if (what.find('1') == std::string::npos) code = 1;
    }
  } else {
    std::this_thread::sleep_for(std::chrono::seconds(5));
  }
  std::fflush(stderr);
  std::_Exit(code);  // the communicator failed: skip the collective teardown
}

// Entry tokens (DispatchArgs::x_repeat, CombineArgs::group: ferry.deep_ep's low-latency mapping): T tokens of topk 8
// (ids masked at random) sent as 8 T tokens of topk 1 from x unexpanded, and combined back with weights given at
// combine (NaN where an entry went nowhere: it must add nothing). Every call: fresh inputs, poisoned outputs, the
// expert counts and every filled expert row against the reference of the expanded input, and every row of y against
// the grouped sum of the reference's entry rows (tests/support/entry_tokens.hpp), bit for bit; call 1 with the hook.
int ll_entry_tokens_case() {
  Spec const spec = parse_spec(rank_case_args());
  auto comm = make_cuda_comm();
  int const rank = comm->rank();
  int const world = comm->world();
  CK(cudaSetDevice(comm->device()));
  int const k = 8;
  int const max_t = 64;
  EpConfig user;
  user.mode = Mode::low_latency;
  user.hidden = spec.hidden;
  user.topk = 1;
  user.num_experts = spec.experts;
  user.max_tokens_per_rank = max_t * k;
  user.expert_capacity = world * max_t;  // well above a random load of 8 * T entries over the experts
  EpBuffer buffer(comm, user);
  EpConfig const& config = buffer.config();
  int const hidden = config.hidden;
  int const num_local = config.num_local_experts(world);
  int const slots = config.expert_slots();
  std::size_t const row_bytes = static_cast<std::size_t>(hidden) * 2;
  DeviceInputs dev(max_t * row_bytes, max_t * k * 8, max_t * k * 4, 16,
                   static_cast<std::size_t>(num_local) * slots * row_bytes, max_t * row_bytes);
  void* group_w = nullptr;
  CK(cudaMalloc(&group_w, max_t * k * 4));
  int code = 0;
  for (int call = 0; call < 3 && code == 0; ++call) {
    RoutingOptions routing;
    routing.mask_rate = 0.2;
    routing.seed = spec.seed + static_cast<uint64_t>(call) * 104729u;
    std::vector<int> tokens(static_cast<std::size_t>(world));
    for (int r = 0; r < world; ++r) tokens[static_cast<std::size_t>(r)] = std::max(1, max_t - 7 * (r + call));
    EntryTokens const ex = make_entry_tokens(config, world, k, tokens, routing);
    std::vector<ref::RankDispatch> want;
    for (int d = 0; d < world; ++d) want.push_back(ref::dispatch(config, world, d, ex.expanded));
    ref::RankInput const& in = ex.expanded[static_cast<std::size_t>(rank)];
    ref::RankDispatch const& mine = want[static_cast<std::size_t>(rank)];
    int const t_count = tokens[static_cast<std::size_t>(rank)];
    bool const hook = call == 1;
    bool const lazy = call == 2;  // allowed: no expert can get more than world * max_t entries (one per group)
    CK(cudaMemcpy(dev.x, ex.x[static_cast<std::size_t>(rank)].data(), t_count * row_bytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dev.idx, in.topk_idx.data(), in.topk_idx.size() * 8, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dev.w, in.topk_weights.data(), in.topk_weights.size() * 4, cudaMemcpyHostToDevice));
    std::vector<float> const& w = ex.weights[static_cast<std::size_t>(rank)];
    CK(cudaMemcpy(group_w, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
    std::vector<std::vector<uint16_t>> expert_out;
    for (int d = 0; d < world; ++d)
      expert_out.push_back(generate_tokens(routing.seed ^ 0xe0e0, d, num_local * slots, hidden));
    CK(cudaMemcpy(dev.eout, expert_out[static_cast<std::size_t>(rank)].data(),
                  expert_out[static_cast<std::size_t>(rank)].size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemset(dev.y_em, 0xEE, dev.y_bytes + 4096));
    poison_ll_dispatch(config, world, buffer.dispatch(DispatchArgs{}));  // the views (an empty call: no rows)
    CK(cudaDeviceSynchronize());

    DispatchArgs args;
    args.x = dev.x;
    args.x_repeat = k;
    args.num_tokens = in.num_tokens;
    args.topk_idx = dev.idx;
    args.topk_weights = static_cast<float const*>(dev.w);
    args.return_recv_hook = hook;
    args.eager = !lazy;
    DispatchResult got = buffer.dispatch(args);
    if (hook) got = buffer.complete_dispatch();
    CombineArgs combine{CombineLayout::expert_major, dev.eout, dev.y_em};
    combine.group = k;
    combine.group_weights = static_cast<float const*>(group_w);
    combine.return_recv_hook = hook;
    combine.eager = !lazy;
    buffer.combine(combine);
    if (hook) buffer.complete_combine();
    CK(cudaDeviceSynchronize());

    auto const counts = to_host<int32_t>(got.expert_counts, static_cast<std::size_t>(num_local));
    auto const expert_x = to_host<uint16_t>(got.expert_x, static_cast<std::size_t>(num_local) * slots * hidden);
    std::string const layout = expert_layout_problem(config, world, mine, counts.data(), expert_x.data(),
                                                     detail::concat("rank ", rank, " call ", call, ": "));
    if (!layout.empty()) {
      std::fprintf(stderr, "%s\n", layout.c_str());
      code = 1;
    }
    std::vector<uint16_t> const want_y = grouped_y(
        ref::combine_expert_major(config, world, rank, ex.expanded, want, expert_out), in.topk_idx, w, k, hidden);
    auto const y = to_host<uint16_t>(dev.y_em, (dev.y_bytes + 4096) / 2);
    for (int u = 0; u < t_count && code == 0; ++u)
      if (std::memcmp(y.data() + static_cast<std::size_t>(u) * hidden,
                      want_y.data() + static_cast<std::size_t>(u) * hidden, row_bytes) != 0) {
        std::fprintf(stderr, "rank %d call %d: y row %d of %d differs\n", rank, call, u, t_count);
        code = 1;
      }
    for (std::size_t i = static_cast<std::size_t>(t_count) * hidden; i < y.size() && code == 0; ++i)
      if (y[i] != 0xEEEE) {
        std::fprintf(stderr, "rank %d call %d: y written past its %d rows (element %zu)\n", rank, call, t_count, i);
        code = 1;
      }
    if (code == 0)
      std::printf("rank %d call %d%s: %d tokens, every row exact\n", rank, call,
                  hook   ? " (hook)"
                  : lazy ? " (lazy)"
                         : "",
                  t_count);
  }
  // Rank 0's token 0 names one expert in two of its entries (a repeat within an x_repeat group, as within a token's
  // topk): every rank's dispatch raises InputError, and the buffer stays usable (a call of distinct ids follows).
  for (int repeat = 1; repeat >= 0 && code == 0; --repeat) {
    std::vector<int64_t> ids(static_cast<std::size_t>(max_t) * k);
    for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>((i / k + i % k) % config.num_experts);
    if (repeat && rank == 0) ids[1] = ids[0];
    CK(cudaMemcpy(dev.idx, ids.data(), ids.size() * 8, cudaMemcpyHostToDevice));
    DispatchArgs args;
    args.x = dev.x;
    args.x_repeat = k;
    args.num_tokens = max_t * k;
    args.topk_idx = dev.idx;
    args.topk_weights = static_cast<float const*>(dev.w);
    bool raised = false;
    try {
      buffer.dispatch(args);
    } catch (InputError const& error) {
      raised = true;
      if (!repeat || std::string(error.what()).find(rank == 0 ? "repeated" : "rank 0") == std::string::npos) {
        std::fprintf(stderr, "rank %d: unexpected InputError: %s\n", rank, error.what());
        code = 1;
      }
    }
    if (repeat && !raised) {
      std::fprintf(stderr, "rank %d: a repeated id within an x_repeat group was not refused\n", rank);
      code = 1;
    }
  }
  if (code == 0) std::printf("rank %d: a repeat within a group refused on every rank, the next call taken\n", rank);
  // A lazy call that could send an expert more than its share of the slots (x_repeat 1: max_t + 1 entries, the share
  // world * max_t / world) is refused on every rank before anything runs, naming the capacity.
  if (code == 0) {
    void* x_long = nullptr;
    CK(cudaMalloc(&x_long, (max_t + 1) * row_bytes));
    DispatchArgs args;
    args.x = x_long;
    args.num_tokens = max_t + 1;
    args.topk_idx = dev.idx;
    args.topk_weights = static_cast<float const*>(dev.w);
    args.eager = false;
    try {
      buffer.dispatch(args);
      std::fprintf(stderr, "rank %d: a lazy call past its share of expert_capacity was taken\n", rank);
      code = 1;
    } catch (InputError const& error) {
      if (std::string(error.what()).find("expert_capacity=" + std::to_string(slots)) == std::string::npos) {
        std::fprintf(stderr, "rank %d: unexpected InputError: %s\n", rank, error.what());
        code = 1;
      }
    }
    CK(cudaDeviceSynchronize());
    cudaFree(x_long);
    if (code == 0) std::printf("rank %d: a lazy call past its share of the slots refused\n", rank);
  }
  cudaFree(group_w);
  return code;
}

FERRY_RANK_CASE(ll_entry_tokens) {
  return ll_entry_tokens_case();
}

std::string spec_seed() {
  uint64_t const seed = fresh_seed();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  return "seed=" + std::to_string(seed);
}

#endif  // FERRY_HAVE_CUDA

TEST(LowLatency, Matrix) {
#if FERRY_HAVE_CUDA
  struct Row {
    char const* routing;
    char const* tokens;
    int hidden, topk, experts;
    char const* extra;
  };
  Row const rows[] = {
      {"random", "128,128", 7168, 8, 256, "capacity=64"},
      {"random", "1,1", 7168, 8, 256, "mask=0"},
      {"random", "512,512", 7168, 8, 256, "capacity=128"},
      {"random", "0,37", 2048, 9, 64, "mask=0.5"},
      {"ring", "100,0", 4096, 1, 16, "int32=1"},
      {"grouped", "64,64", 2880, 6, 64, "mask=0"},
      {"hot", "77,128", 5120, 2, 8, "mask=0.2"},
      {"random", "0,0", 2048, 4, 64, "mask=0"},
      {"random", "1024,1", 2048, 8, 256, "capacity=128"},
      // small grids: a CTA's share of the hits spans several windows of 512 (one step of records, then more)
      {"random", "300,200", 2048, 8, 64, "blocks=1"},
      {"random", "700,640", 2048, 8, 64, "blocks=5 capacity=256"},
  };
  for (Row const& row : rows) {
    SCOPED_TRACE(std::string(row.routing) + " tokens=" + row.tokens + " hidden=" + std::to_string(row.hidden) +
                 " topk=" + std::to_string(row.topk) + " experts=" + std::to_string(row.experts) + " " + row.extra);
    std::vector<std::string> args{spec_seed(),
                                  std::string("routing=") + row.routing,
                                  std::string("tokens=") + row.tokens,
                                  "hidden=" + std::to_string(row.hidden),
                                  "topk=" + std::to_string(row.topk),
                                  "experts=" + std::to_string(row.experts),
                                  "iters=2"};
    std::istringstream extra(row.extra);  // its key=value words
    for (std::string word; extra >> word;) args.push_back(word);
    run_case("ll", args);
  }
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

// FERRY_LL_OWN_ROWS=direct: the send half copies a bf16 dispatch's own rows into their slots (not staged).
TEST(LowLatency, OwnRowsDirect) {
#if FERRY_HAVE_CUDA
  std::vector<std::pair<std::string, std::string>> const env{{"FERRY_LL_OWN_ROWS", "direct"}};
  run_case("ll", {spec_seed(), "tokens=128,128", "hidden=7168", "topk=8", "experts=256", "capacity=64", "iters=3"},
           env);
  run_case("ll", {spec_seed(), "tokens=37,0", "hidden=2048", "topk=9", "experts=64", "mask=0.3", "iters=3"}, env);
  run_case(
      "ll",
      {spec_seed(), "tokens=700,640", "hidden=2048", "topk=8", "experts=64", "blocks=5", "capacity=256", "iters=2"},
      env);
  run_case("ll",
           {spec_seed(), "tokens=32,32", "hidden=7168", "topk=8", "experts=256", "graph=1", "hook=1", "iters=50",
            "check_every=10"},
           env);
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

TEST(LowLatency, EntryTokensXRepeatAndGroupedCombine) {
#if FERRY_HAVE_CUDA
  run_case("ll_entry_tokens", {spec_seed(), "hidden=2880", "experts=64"});
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

TEST(LowLatency, HookSplitsEachLeg) {
#if FERRY_HAVE_CUDA
  run_case("ll",
           {spec_seed(), "tokens=128,96", "hidden=7168", "topk=8", "experts=256", "hook=1", "iters=4", "capacity=64"});
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

TEST(LowLatency, ConsecutiveCallsAndLayers) {
#if FERRY_HAVE_CUDA
  run_case("ll", {spec_seed(), "tokens=50,70", "hidden=2048", "topk=8", "experts=64", "layers=3", "iters=30"});
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

TEST(LowLatency, GraphReplays1000WithFreshInputs) {
#if FERRY_HAVE_CUDA
  run_case("ll", {spec_seed(), "tokens=64,48", "hidden=2048", "topk=8", "experts=64", "graph=1", "iters=1000",
                  "check_every=100", "layers=2"});
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

TEST(LowLatency, GraphReplaysOfTheHookPath) {
#if FERRY_HAVE_CUDA
  run_case("ll", {spec_seed(), "tokens=32,32", "hidden=7168", "topk=8", "experts=256", "graph=1", "hook=1", "iters=200",
                  "check_every=50"});
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

TEST(LowLatency, HookMisuseAndSkippedCallTimesOut) {
#if FERRY_HAVE_CUDA
  run_gpu_case(peer_case_world(), "ll_hook_misuse_and_timeout", {}, {{"FERRY_TIMEOUT_S", "2"}});
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

}  // namespace
}  // namespace ferry::test
