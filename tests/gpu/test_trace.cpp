// In-kernel tracing on the GPUs (builds with -DFERRY_TRACE=ON; skips otherwise and below 2 GPUs): a traced dispatch
// and combine on every rank yield every phase of both kernels, with no orphaned, dropped or malformed events, and the
// files `ferry bench --trace` writes decode across ranks into a Chrome trace that parses back.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "ferry/communicator.hpp"
#include "ferry/env.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "ferry/trace.hpp"
#include "support/gpu_case.hpp"
#include "trace/decode.hpp"
#include "trace/trace_file.hpp"
#include "core/util/json.hpp"
#include "workloads/routing.hpp"

#if FERRY_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace ferry::test {
namespace {

#if FERRY_HAVE_CUDA

// Normal-mode dispatch runs one of two protocols (the count exchange, or the landing zone of small batches: slots
// "dispatch.land_*"); `landing` says which one this EpBuffer runs, and the other's slots are not expected. The LL
// dispatch's "ll_dispatch.own" (the send half copying the own rows) runs only with FERRY_LL_OWN_ROWS=direct.
bool slot_expected(int slot, TraceKernel kernel, bool landing) {
  if (trace::kSlotKernel[slot] != kernel) return false;
  if (slot == static_cast<int>(trace::TraceSlot::ll_dispatch_own)) return env_string("FERRY_LL_OWN_ROWS") == "direct";
  if (kernel != TraceKernel::dispatch) return true;
  bool const land_slot = std::string(trace::kSlotNames[slot]).rfind("dispatch.land_", 0) == 0;
  return land_slot == landing;
}

// Every expected slot of `kernel` must have spans on every rank in `ranks`; prints what is missing.
int check_every_phase(trace::Decoded const& decoded, TraceKernel kernel, bool landing, std::vector<int> const& ranks,
                      char const* who) {
  int failures = 0;
  for (int slot = 0; slot < trace::kNumSlots; ++slot) {
    if (!slot_expected(slot, kernel, landing)) continue;
    for (int rank : ranks) {
      bool found = false;
      for (trace::Span const& s : decoded.spans)
        if (s.slot == slot && s.rank == rank && s.end_ns >= s.begin_ns) found = true;
      if (!found) {
        std::fprintf(stderr, "%s: no %s span on rank %d\n", who, trace::kSlotNames[slot], rank);
        ++failures;
      }
    }
  }
  if (decoded.orphan_begins + decoded.orphan_ends + decoded.dropped + decoded.bad_events != 0) {
    std::fprintf(stderr, "%s: orphan begins %lld, orphan ends %lld, dropped %lld, bad %lld\n", who,
                 static_cast<long long>(decoded.orphan_begins), static_cast<long long>(decoded.orphan_ends),
                 static_cast<long long>(decoded.dropped), static_cast<long long>(decoded.bad_events));
    ++failures;
  }
  return failures;
}

int traced_legs_case() {
  std::vector<std::string> const& args = rank_case_args();
  std::string const dir = args.at(0);
  int const tokens = std::stoi(args.at(1));
  bool const ll = args.size() > 2 && args.at(2) == "ll";  // low-latency mode: its kernel families and phases
  TraceKernel const dispatch_kernel = ll ? TraceKernel::ll_dispatch : TraceKernel::dispatch;
  TraceKernel const combine_kernel = ll ? TraceKernel::ll_combine : TraceKernel::combine;
  std::shared_ptr<Communicator> comm = make_cuda_comm();
  int const rank = comm->rank();
  int const world = comm->world();
  CK(cudaSetDevice(comm->device()));
  EpConfig config;
  if (ll) config.mode = Mode::low_latency;
  config.hidden = 2048;
  config.topk = 8;
  config.num_experts = 64;
  config.max_tokens_per_rank = tokens;
  EpBuffer buffer(comm, config);
  RoutingOptions routing;
  routing.seed = 7;
  bool landing = false;  // known after the first dispatch (explain())
  std::vector<uint16_t> const x = generate_tokens(routing.seed, rank, tokens, config.hidden);
  std::vector<int64_t> idx(static_cast<std::size_t>(tokens) * config.topk);
  std::vector<float> weights(idx.size());
  generate_routing(routing, config.num_experts, world, rank, tokens, config.topk, idx, weights);
  void *x_dev, *idx_dev, *w_dev, *rows_dev, *y_dev;
  std::size_t const row_bytes = static_cast<std::size_t>(config.hidden) * 2;
  CK(cudaMalloc(&x_dev, tokens * row_bytes));
  CK(cudaMalloc(&idx_dev, idx.size() * 8));
  CK(cudaMalloc(&w_dev, weights.size() * 4));
  CK(cudaMalloc(&rows_dev, static_cast<std::size_t>(config.recv_capacity(world)) * row_bytes));
  CK(cudaMalloc(&y_dev, tokens * row_bytes));
  CK(cudaMemcpy(x_dev, x.data(), tokens * row_bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(idx_dev, idx.data(), idx.size() * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(w_dev, weights.data(), weights.size() * 4, cudaMemcpyHostToDevice));

  DispatchArgs dargs;
  dargs.x = x_dev;
  dargs.num_tokens = tokens;
  dargs.topk_idx = idx_dev;
  dargs.topk_weights = static_cast<float const*>(w_dev);
  CombineArgs const cargs{CombineLayout::rank_major, rows_dev, y_dev, true};

  // untraced first: reading a trace before enabling it is refused
  buffer.dispatch(dargs);
  buffer.combine(cargs);
  landing = buffer.explain().find("nvlink-landing") != std::string::npos;
  bool refused = false;
  try {
    buffer.read_trace(dispatch_kernel);
  } catch (ConfigError const&) {
    refused = true;
  }
  if (!refused) {
    std::fprintf(stderr, "rank %d: read_trace without enable_trace did not throw ConfigError\n", rank);
    return 1;
  }

  buffer.enable_trace(256);
  DispatchResult const got = buffer.dispatch(dargs);
  if (got.recv_x != nullptr && got.num_recv_host > 0)  // the combine's input (its values do not matter here)
    CK(cudaMemcpy(rows_dev, got.recv_x, static_cast<std::size_t>(got.num_recv_host) * row_bytes,
                  cudaMemcpyDeviceToDevice));
  buffer.combine(cargs);
  std::vector<TraceBuffer> mine;
  for (TraceKernel kernel : {dispatch_kernel, combine_kernel}) {
    mine.push_back(buffer.read_trace(kernel));
    trace::write_trace_files(dir, "gpu", mine.back());
  }
  int failures = 0;
  trace::Decoded const decoded = trace::decode(mine);
  failures += check_every_phase(decoded, dispatch_kernel, landing, {rank}, "own dispatch");
  failures += check_every_phase(decoded, combine_kernel, landing, {rank}, "own combine");
  std::fprintf(stderr, "rank %d: %lld events, %zu spans\n%s", rank, static_cast<long long>(decoded.events),
               decoded.spans.size(), trace::format_phase_table(trace::phase_table(decoded), decoded).c_str());

  comm->bootstrap().barrier();  // every rank's files are written
  if (rank == 0) {
    auto const cases = trace::read_trace_dir(dir);
    std::vector<TraceBuffer> const& all = cases.at("gpu");
    if (static_cast<int>(all.size()) != 2 * world) {
      std::fprintf(stderr, "expected %d trace files, read %zu\n", 2 * world, all.size());
      return 1;
    }
    trace::DecodeOptions options;
    options.align = trace::Align::slot_end;
    if (ll) options.align_slot = trace::TraceSlot::ll_dispatch_wait_arrivals;
    if (landing) options.align_slot = trace::TraceSlot::dispatch_land_wait;
    trace::Decoded const together = trace::decode(all, options);
    std::vector<int> ranks;
    for (int r = 0; r < world; ++r) ranks.push_back(r);
    failures += check_every_phase(together, dispatch_kernel, landing, ranks, "all dispatch");
    failures += check_every_phase(together, combine_kernel, landing, ranks, "all combine");
    if (together.unaligned_ranks != 0) {
      std::fprintf(stderr, "%lld ranks without %s\n", static_cast<long long>(together.unaligned_ranks),
                   trace::kSlotNames[static_cast<int>(options.align_slot)]);
      ++failures;
    }
    std::ostringstream json;
    trace::write_chrome_json(json, together);
    util::json::parse(json.str(), "trace.json");  // throws on malformed output
    std::fprintf(stderr, "%s", trace::format_phase_table(trace::phase_table(together), together).c_str());
  }
  buffer.enable_trace(0);
  for (void* ptr : {x_dev, idx_dev, w_dev, rows_dev, y_dev}) cudaFree(ptr);
  return failures == 0 ? 0 : 1;
}

FERRY_RANK_CASE(traced_legs) {
  return traced_legs_case();
}

#endif

TEST(Trace, EveryPhaseOnEveryRank) {
  if (!trace_compiled_in()) GTEST_SKIP() << "in-kernel tracing is not compiled in (configure with -DFERRY_TRACE=ON)";
  int const gpus = cuda_device_count();
  int const world = gpu_test_world();
  if (gpus < world) GTEST_SKIP() << needs_gpus_message(world, gpus);
  std::filesystem::path const dir =
      std::filesystem::temp_directory_path() /
      ("ferry-trace-gpu-" + std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  // normal mode at a large and a tiny batch (the count exchange and the landing zone), low-latency mode at a decode
  // batch and a tiny one
  for (auto const& [tokens, mode] : {std::pair{"4096", "normal"}, {"3", "normal"}, {"128", "ll"}, {"3", "ll"}}) {
    std::filesystem::remove_all(dir);
    RankCaseOptions options;
    options.args = {dir.string(), tokens, mode};
    options.timeout = std::chrono::seconds(300);
    LaunchResult const result = run_rank_case("traced_legs", world, options);
    EXPECT_TRUE(result.ok()) << mode << " mode, " << tokens << " tokens: " << result.describe();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ferry::test
