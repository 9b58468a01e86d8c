// Hidden timing case for normal mode (run with --gtest_also_run_disabled_tests): graph-mode medians of dispatch and
// both combine layouts at the issue's shapes, next to the NCCL all-to-all baseline on the same inputs. No speed
// assertions: `ferry bench` is the tool of record; this is the quick look the kernel work needs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "ep/reference.hpp"
#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "support/rank_case.hpp"
#include "workloads/inputs.hpp"
#include "workloads/routing.hpp"
// NOTE: the baseline lives with the bench (bench/); compiled into this binary too so the timing case can run it.
#include "../../bench/nccl_baseline.cu"

namespace ferry::test {
namespace test_normal_mode_perf {  // named, not anonymous: FERRY_CI_BUILD compiles several files as one

#define PK(expr)                                                                                   \
  do {                                                                                             \
    cudaError_t const e_ = (expr);                                                                 \
    if (e_ != cudaSuccess) FERRY_THROW(Error, "test", #expr, " failed: ", cudaGetErrorString(e_)); \
  } while (0)

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int perf_case() {
  auto const& args = rank_case_args();
  int const tokens = std::stoi(args.at(0));
  std::string const routing_name = args.at(1);
  int const iters = 30;
  auto comm = std::shared_ptr<Communicator>(Communicator::create(
      make_socket_bootstrap(socket_bootstrap_options_from_env()), CommunicatorOptions{Backend::cuda, -1}));
  int const rank = comm->rank();
  int const world = comm->world();
  int const peer = 1 - rank;
  PK(cudaSetDevice(comm->device()));
  EpConfig config;
  config.hidden = 7168;
  config.topk = 8;
  config.num_experts = 256;
  config.max_tokens_per_rank = tokens;
  RoutingOptions routing;
  routing.kind = parse_routing(routing_name);
  routing.seed = 12345;
  std::vector<int> const counts(world, tokens);
  auto const inputs = ref::generate_inputs(config, world, routing, counts);
  std::vector<ref::RankDispatch> expected;
  int max_expert = 1;
  for (int r = 0; r < world; ++r) {
    expected.push_back(ref::dispatch(config, world, r, inputs));
    for (int c : expected.back().expert_counts) max_expert = std::max(max_expert, c);
  }
  config.expert_capacity = max_expert;
  EpBuffer buffer(comm, config);
  int const H = config.hidden, K = config.topk;
  int const num_local = config.num_local_experts(world);
  auto const& in = inputs[rank];
  void *x, *idx, *w, *rows, *eout, *y;
  PK(cudaMalloc(&x, std::max<size_t>(16, in.x.size() * 2)));
  PK(cudaMalloc(&idx, std::max<size_t>(16, in.topk_idx.size() * 8)));
  PK(cudaMalloc(&w, std::max<size_t>(16, in.topk_weights.size() * 4)));
  PK(cudaMalloc(&rows, static_cast<size_t>(config.recv_capacity(world)) * H * 2));
  PK(cudaMalloc(&eout, static_cast<size_t>(num_local) * max_expert * H * 2));
  PK(cudaMalloc(&y, std::max<size_t>(16, static_cast<size_t>(tokens) * H * 2)));
  PK(cudaMemcpy(x, in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice));
  PK(cudaMemcpy(idx, in.topk_idx.data(), in.topk_idx.size() * 8, cudaMemcpyHostToDevice));
  PK(cudaMemcpy(w, in.topk_weights.data(), in.topk_weights.size() * 4, cudaMemcpyHostToDevice));
  auto const row_data = generate_tokens(99, rank, expected[rank].num_recv, H);
  PK(cudaMemcpy(rows, row_data.data(), row_data.size() * 2, cudaMemcpyHostToDevice));
  PK(cudaMemset(eout, 0x3c, static_cast<size_t>(num_local) * max_expert * H * 2));
  cudaStream_t stream;
  PK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  DispatchArgs d;
  d.x = x;
  d.num_tokens = tokens;
  d.topk_idx = idx;
  d.topk_idx_type = IndexType::int64;
  d.topk_weights = static_cast<float const*>(w);
  CombineArgs crm{CombineLayout::rank_major, rows, y, true};
  CombineArgs cem{CombineLayout::expert_major, eout, y, true};
  buffer.dispatch(d, stream);
  buffer.combine(crm, stream);
  // graphs: dispatch, combine rank-major, dispatch+expand, combine expert-major (captured after the expanding dispatch:
  // an expert-major combine needs its slots; every replayed dispatch has the same inputs, so they stay valid)
  auto capture = [&](auto&& body) {
    cudaGraph_t g;
    cudaGraphExec_t exec;
    PK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    body();
    PK(cudaStreamEndCapture(stream, &g));
    PK(cudaGraphInstantiate(&exec, g, 0));
    PK(cudaGraphDestroy(g));
    return exec;
  };
  d.eager = crm.eager = cem.eager = false;
  DispatchArgs dx = d;
  dx.expand = true;
  cudaGraphExec_t g_disp = capture([&] { buffer.dispatch(d, stream); });
  cudaGraphExec_t g_crm = capture([&] { buffer.combine(crm, stream); });
  cudaGraphExec_t g_disp_x = capture([&] { buffer.dispatch(dx, stream); });
  cudaGraphExec_t g_cem = capture([&] { buffer.combine(cem, stream); });
  std::string const why = buffer.explain();

  cudaEvent_t e0, e1;
  PK(cudaEventCreate(&e0));
  PK(cudaEventCreate(&e1));
  auto time_it = [&](auto&& launch) {
    std::vector<float> ms;
    for (int i = 0; i < iters + 5; ++i) {
      comm->barrier(stream);
      PK(cudaEventRecord(e0, stream));
      launch();
      PK(cudaEventRecord(e1, stream));
      PK(cudaEventSynchronize(e1));
      float t;
      PK(cudaEventElapsedTime(&t, e0, e1));
      if (i >= 5) ms.push_back(t * 1000.0f);
    }
    comm->check_errors(stream);
    return median(ms);
  };
  double const t_disp_x = time_it([&] { PK(cudaGraphLaunch(g_disp_x, stream)); });
  double const t_disp = time_it([&] { PK(cudaGraphLaunch(g_disp, stream)); });
  double const t_crm = time_it([&] { PK(cudaGraphLaunch(g_crm, stream)); });
  double const t_cem = time_it([&] { PK(cudaGraphLaunch(g_cem, stream)); });
  // correctness of the timed state: rank-major combine of the last dispatch
  PK(cudaGraphLaunch(g_disp, stream));
  PK(cudaGraphLaunch(g_crm, stream));
  PK(cudaStreamSynchronize(stream));
  comm->check_errors(stream);
  std::vector<std::vector<uint16_t>> all_rows(world);
  for (int r = 0; r < world; ++r) all_rows[r] = generate_tokens(99, r, expected[r].num_recv, H);
  auto const y_ref = ref::combine_rank_major(config, world, rank, inputs, expected, all_rows);
  std::vector<uint16_t> y_host(y_ref.size());
  PK(cudaMemcpy(y_host.data(), y, y_host.size() * 2, cudaMemcpyDeviceToHost));
  bool const ferry_ok = y_host == y_ref;

  // baseline
  NcclBaseline nccl(*comm, config);
  DispatchArgs de = d;
  de.eager = true;
  double const t_nd = time_it([&] { nccl.dispatch(de, stream); });
  double const t_nc = time_it([&] { nccl.combine(rows, y, stream); });
  DispatchResult const br = nccl.dispatch(de, stream);
  nccl.combine(rows, y, stream);
  PK(cudaStreamSynchronize(stream));
  PK(cudaMemcpy(y_host.data(), y, y_host.size() * 2, cudaMemcpyDeviceToHost));
  bool const base_ok = y_host == y_ref && br.num_recv_host == expected[rank].num_recv;

  // bytes this rank sent to the other rank (rows + metadata on dispatch, rows on combine)
  long sent_rows = 0;
  for (int i = 0; i < expected[peer].num_recv; ++i) sent_rows += expected[peer].recv_src[2 * i] == rank;
  double const disp_bytes = static_cast<double>(sent_rows) * (H * 2 + K * 8 + 8);
  double const comb_bytes = static_cast<double>(sent_rows) * H * 2;
  std::printf(
      "PERF rank %d tokens %d %s: dispatch %.1f us (%.0f GB/s nvlink) | dispatch+expand %.1f us | combine rank-major "
      "%.1f us (%.0f GB/s) | combine expert-major %.1f us (%.0f GB/s) | nccl dispatch %.1f us (x%.2f) combine %.1f "
      "us (x%.2f vs rank-major) | check ferry %s nccl %s\n",
      rank, tokens, routing_name.c_str(), t_disp, disp_bytes / t_disp / 1e3, t_disp_x, t_crm, comb_bytes / t_crm / 1e3,
      t_cem, comb_bytes / t_cem / 1e3, t_nd, t_nd / t_disp, t_nc, t_nc / t_crm, ferry_ok ? "ok" : "FAIL",
      base_ok ? "ok" : "FAIL");
  if (rank == 0) std::printf("EXPLAIN %s\n", why.c_str());
  std::fflush(stdout);
  return ferry_ok && base_ok ? 0 : 1;
}

FERRY_RANK_CASE(normal_mode_perf) {
  return perf_case();
}

TEST(NormalModePerf, DISABLED_Timing) {
  int const gpus = ferry::cuda_device_count();
  if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  for (auto const& shape :
       std::vector<std::vector<std::string>>{{"4096", "random"}, {"4096", "grouped"}, {"128", "random"}}) {
    RankCaseOptions options;
    options.args = shape;
    options.timeout = std::chrono::seconds(240);
    LaunchResult const result = run_rank_case("normal_mode_perf", 2, options);
    EXPECT_TRUE(result.ok()) << result.describe();
  }
}

}  // namespace test_normal_mode_perf
}  // namespace ferry::test
