// Low-latency mode on the cuda backend with quantized wire formats, compared byte for byte with the reference
// (src/ep/reference.hpp, host codecs of src/wire/codec.hpp): expert-major payload rows, scale tensors (every entry of
// every filled slot, and the padding, which must stay zero) and nvfp4 token scales equal ref::deliver of
// ref::expand_wire per expert; pre-quantized input is forwarded as is; dispatch_dequantize equals the reference's
// expanded recv_x; both combine layouts with each combine format equal the reference bit for bit; the hook path and
// graph replays with fresh inputs. Each test starts one process per rank (2 GPUs) and every child rebuilds every
// rank's inputs from the seed the parent passes (printed).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "ep/reference.hpp"
#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "ferry/wire_format.hpp"
#include "support/gpu_case.hpp"
#include "support/ll_check.hpp"
#include "workloads/inputs.hpp"
#include "workloads/routing.hpp"

#if FERRY_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace ferry::test {
namespace {

#if FERRY_HAVE_CUDA

struct Spec : CaseShape {
  int capacity = 0;  // capacity=: expert_capacity (0: ll's default, world * max_tokens)
  WireFormat dispatch_format = WireFormat::bf16;
  WireFormat combine_format = WireFormat::bf16;
  ScaleLayout layout = ScaleLayout::row_major;
  bool dequantize = false;
  bool prequantized = false;  // pass x as payload + x_scales (+ x_token_scales)
  int check_every = 1;        // graph: check every n-th replay fully (and the last)
  bool hook = false;
};

Spec parse_spec(std::vector<std::string> const& words) {
  CaseArgs const args(words);
  Spec s;
  s.read(args);
  s.capacity = args.integer("capacity", s.capacity);
  s.dispatch_format = parse_wire_format(args.text("dispatch", "bf16"));
  s.combine_format = parse_wire_format(args.text("combine", "bf16"));
  s.layout = parse_scale_layout(args.text("layout", "row_major"));
  s.dequantize = args.flag("dequant", s.dequantize);
  s.prequantized = args.flag("prequant", s.prequantized);
  s.check_every = args.integer("check_every", s.check_every);
  s.hook = args.flag("hook", s.hook);
  return s;
}

// Every rank's pre-quantized input for this iteration: wire rows of other random bf16 rows (so a kernel that
// re-quantized x instead of forwarding could not match), with some payload bytes flipped to codes the quantizer
// would not produce from them.
void make_prequantized(EpConfig const& config, uint64_t seed, std::vector<ref::RankInput>& inputs) {
  std::size_t const payload = wire_payload_bytes(config.dispatch_format, config.hidden);
  std::size_t const row_bytes = wire_row_bytes(config.dispatch_format, config.hidden);
  for (std::size_t r = 0; r < inputs.size(); ++r) {
    ref::RankInput other = inputs[r];
    other.x = generate_tokens(seed + 303, static_cast<int>(r), other.num_tokens, config.hidden);
    inputs[r].x_wire = ref::source_wire_rows(config, other);
    for (int t = 0; t < other.num_tokens; ++t)
      for (std::size_t b = (t * 7) % 13; b < payload; b += 97)
        inputs[r].x_wire[t * row_bytes + b] ^= static_cast<uint8_t>(0x11 + t);
  }
}

int ll_quant_case() {
  Spec const spec = parse_spec(rank_case_args());
  auto comm = make_cuda_comm();
  int const rank = comm->rank();
  int const world = comm->world();
  std::vector<int> const tokens = per_rank(spec.tokens, world);  // the lists are written for 2 ranks
  CK(cudaSetDevice(comm->device()));

  EpConfig user = spec.config();
  user.mode = Mode::low_latency;
  user.dispatch_format = spec.dispatch_format;
  user.combine_format = spec.combine_format;
  user.dispatch_dequantize = spec.dequantize;
  user.recv_scale_layout = spec.layout;
  if (spec.capacity > 0) user.expert_capacity = spec.capacity;
  EpBuffer buffer(comm, user);
  EpConfig const config = buffer.config();  // resolved
  int const hidden = spec.hidden;
  int const topk = spec.topk;
  int const num_local = config.num_local_experts(world);
  int const slots = config.expert_slots();
  int const my_tokens = tokens[rank];
  int const max_rows = world * config.max_tokens_per_rank;
  std::fprintf(stderr,
               "rank %d: seed %llu routing %s tokens %d hidden %d topk %d experts %d dispatch %s%s%s combine %s "
               "layout %s hook %d graph %d\n",
               rank, static_cast<unsigned long long>(spec.seed), spec.routing.c_str(), my_tokens, hidden, topk,
               spec.experts, wire_format_name(spec.dispatch_format), spec.prequantized ? " (pre-quantized)" : "",
               spec.dequantize ? " (dequantized)" : "", wire_format_name(spec.combine_format),
               scale_layout_name(spec.layout), spec.hook, spec.graph);

  std::size_t const row_bytes = static_cast<std::size_t>(hidden) * 2;
  bool const quantized = spec.dispatch_format != WireFormat::bf16;
  std::size_t const scale_row = quantized ? static_cast<std::size_t>(hidden / wire_block_elems(spec.dispatch_format)) *
                                                scale_entry_bytes(spec.dispatch_format)
                                          : 0;
  DeviceBuffer x(my_tokens * row_bytes);  // bf16 rows, or the pre-quantized payload (smaller)
  DeviceBuffer x_scales(my_tokens * scale_row);
  DeviceBuffer x_token_scales(my_tokens * 4);
  DeviceBuffer idx(static_cast<std::size_t>(my_tokens) * topk * 8);
  DeviceBuffer w(static_cast<std::size_t>(my_tokens) * topk * 4);
  DeviceBuffer rows_in(max_rows * row_bytes);
  DeviceBuffer eout(static_cast<std::size_t>(num_local) * slots * row_bytes);
  std::size_t const y_bytes = my_tokens * row_bytes;
  DeviceBuffer y_em(y_bytes + 4096);  // + a guard area that must stay poisoned
  DeviceBuffer y_rm(y_bytes + 4096);
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  DispatchArgs dargs;
  dargs.x = x.ptr;
  if (spec.prequantized) {
    dargs.x_scales = x_scales.ptr;
    if (spec.dispatch_format == WireFormat::nvfp4) dargs.x_token_scales = static_cast<float const*>(x_token_scales.ptr);
  }
  dargs.num_tokens = my_tokens;
  dargs.topk_idx = idx.ptr;
  dargs.topk_idx_type = IndexType::int64;
  dargs.topk_weights = static_cast<float const*>(w.ptr);
  dargs.eager = !spec.graph;
  dargs.return_recv_hook = spec.hook;
  CombineArgs em{CombineLayout::expert_major, eout.ptr, y_em.ptr, !spec.graph, spec.hook};
  CombineArgs rm{CombineLayout::rank_major, rows_in.ptr, y_rm.ptr, !spec.graph, spec.hook};

  cudaGraphExec_t graph = nullptr;
  DispatchResult result;

  for (int iter = 0; iter < spec.iters; ++iter) {
    bool const check = !spec.graph || iter % spec.check_every == 0 || iter == spec.iters - 1;
    RoutingOptions const routing = spec.routing_options(iter);
    auto inputs = ref::generate_inputs(config, world, routing, tokens);
    if (spec.prequantized) make_prequantized(config, routing.seed, inputs);
    auto const& in = inputs[rank];
    // this rank's dispatch inputs, fresh every iteration (on the stream: after the previous replay read the old ones)
    std::vector<uint8_t> payload, scales;
    std::vector<float> token_scales;
    if (spec.prequantized) {
      ref::QuantizedInput q = ref::split_wire_rows(config, in.x_wire, in.num_tokens);
      payload = std::move(q.payload);
      scales = std::move(q.scales);
      token_scales = std::move(q.token_scales);
      CK(cudaMemcpyAsync(x.ptr, payload.data(), payload.size(), cudaMemcpyHostToDevice, stream));
      CK(cudaMemcpyAsync(x_scales.ptr, scales.data(), scales.size(), cudaMemcpyHostToDevice, stream));
      if (!token_scales.empty())
        CK(cudaMemcpyAsync(x_token_scales.ptr, token_scales.data(), token_scales.size() * 4, cudaMemcpyHostToDevice,
                           stream));
    } else {
      CK(cudaMemcpyAsync(x.ptr, in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice, stream));
    }
    CK(cudaMemcpyAsync(idx.ptr, in.topk_idx.data(), in.topk_idx.size() * 8, cudaMemcpyHostToDevice, stream));
    CK(cudaMemcpyAsync(w.ptr, in.topk_weights.data(), in.topk_weights.size() * 4, cudaMemcpyHostToDevice, stream));
    CK(cudaStreamSynchronize(stream));  // the host vectors die with this iteration

    std::vector<ref::RankDispatch> expected;
    std::vector<std::vector<uint16_t>> rows(world), outs(world);
    if (check) {
      for (int r = 0; r < world; ++r) expected.push_back(ref::dispatch(config, world, r, inputs));
      // combine inputs of every rank, deterministic in (seed, rank); fresh on checked iterations only (cost)
      for (int r = 0; r < world; ++r) {
        rows[r] = generate_tokens(routing.seed + 101, r, expected[r].num_recv, hidden);
        outs[r] = generate_tokens(routing.seed + 202, r, num_local * slots, hidden);
      }
      CK(cudaMemcpy(rows_in.ptr, rows[rank].data(), rows[rank].size() * 2, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(eout.ptr, outs[rank].data(), outs[rank].size() * 2, cudaMemcpyHostToDevice));
      CK(cudaMemset(y_em.ptr, 0xEE, y_em.bytes));
      CK(cudaMemset(y_rm.ptr, 0xEE, y_rm.bytes));
      if (result.expert_x) poison_ll_dispatch(config, world, result);
    } else if (iter == 0) {
      CK(cudaMemset(eout.ptr, 0, eout.bytes));
      CK(cudaMemset(rows_in.ptr, 0, rows_in.bytes));
    }
    CK(cudaDeviceSynchronize());

    if (!spec.graph) {
      result = buffer.dispatch(dargs, stream);
      if (spec.hook) {
        if (result.num_recv_host != -1) return fail("num_recv_host before the hook", rank, iter, 0);
        result = buffer.complete_dispatch(stream);
      }
      if (result.num_recv_host != expected[rank].num_recv)
        return fail("num_recv_host", rank, iter, result.num_recv_host);
      buffer.combine(em, stream);
      if (spec.hook) buffer.complete_combine(stream);
      buffer.combine(rm, stream);
      if (spec.hook) buffer.complete_combine(stream);
    } else {
      if (!graph) {
        // one eager round first (result pointers), then the capture of both legs
        DispatchArgs eager = dargs;
        eager.eager = true;
        eager.return_recv_hook = false;
        result = buffer.dispatch(eager, stream);
        buffer.combine(CombineArgs{CombineLayout::expert_major, eout.ptr, y_em.ptr, true}, stream);
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        buffer.dispatch(dargs, stream);
        if (spec.hook) buffer.complete_dispatch(stream);
        buffer.combine(em, stream);
        if (spec.hook) buffer.complete_combine(stream);
        buffer.combine(rm, stream);
        if (spec.hook) buffer.complete_combine(stream);
        CK(cudaStreamEndCapture(stream, &g));
        CK(cudaGraphInstantiate(&graph, g, 0));
        CK(cudaGraphDestroy(g));
        // the eager round wrote what this iteration checks
        CK(cudaMemset(y_em.ptr, 0xEE, y_em.bytes));
        poison_ll_dispatch(config, world, result);
        CK(cudaDeviceSynchronize());
      }
      CK(cudaGraphLaunch(graph, stream));
      if (!check) continue;  // unchecked replays queue back to back (a hang would end in TimeoutError below)
      CK(cudaStreamSynchronize(stream));
      comm->check_errors(stream);
    }
    if (!check) continue;

    if (result.recv_x != nullptr) return fail("recv_x not null", rank, iter, 0);
    if (result.recv_row_bytes != config.recv_row_bytes()) return fail("recv_row_bytes", rank, iter, 0);
    if (int const code = check_ll_dispatch(config, world, rank, iter, expected[rank], result)) return code;
    auto const y_ref_em = ref::combine_expert_major(config, world, rank, inputs, expected, outs);
    if (int const code =
            check_combined("y expert-major", y_em.ptr, y_ref_em, y_em.bytes / 2 - y_ref_em.size(), rank, iter))
      return code;
    auto const y_ref_rm = ref::combine_rank_major(config, world, rank, inputs, expected, rows);
    if (int const code =
            check_combined("y rank-major", y_rm.ptr, y_ref_rm, y_rm.bytes / 2 - y_ref_rm.size(), rank, iter))
      return code;
  }
  CK(cudaStreamSynchronize(stream));
  comm->check_errors(stream);
  if (graph) cudaGraphExecDestroy(graph);
  cudaStreamDestroy(stream);
  std::fprintf(stderr, "rank %d: %d iterations exact\n", rank, spec.iters);
  return 0;
}

FERRY_RANK_CASE(ll_quant) {
  return ll_quant_case();
}

std::string spec_seed() {
  uint64_t const seed = fresh_seed();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  return "seed=" + std::to_string(seed);
}

// One row of a test table: the case's key=value words (seed added).
void run_rows(std::vector<std::vector<std::string>> const& rows) {
  for (auto const& row : rows) {
    std::string label;
    for (auto const& word : row) label += word + " ";
    SCOPED_TRACE(label);
    std::vector<std::string> args = row;
    args.push_back(spec_seed());
    run_gpu_case(gpu_test_world(), "ll_quant", args);
  }
}

#endif  // FERRY_HAVE_CUDA

// Each dispatch format with a couple of its scale layouts (rows of hidden % 4 scale blocks != 0 pad the tiled
// layouts; nvfp4 at hidden % 32 == 16 has 8-byte payload rows), each with a combine format beside it.
TEST(LlQuant, DispatchFormatsAndScaleLayouts) {
#if FERRY_HAVE_CUDA
  run_rows({
      {"dispatch=fp8", "combine=fp8", "layout=row_major", "tokens=128,96", "hidden=7168", "experts=256", "capacity=64"},
      {"dispatch=fp8", "combine=bf16", "layout=mn_major_tma", "tokens=37,64", "hidden=2944", "topk=6", "mask=0.2"},
      {"dispatch=fp8_ue8m0", "combine=fp8_ue8m0", "layout=mn_major_tma_packed_ue8m0", "tokens=64,64", "hidden=7168",
       "experts=256", "capacity=64"},
      {"dispatch=fp8_ue8m0", "combine=mxfp4", "layout=row_major", "tokens=0,50", "hidden=2048"},
      {"dispatch=nvfp4", "combine=nvfp4", "layout=blocked_128x4", "tokens=128,128", "hidden=7168", "experts=256",
       "capacity=64"},
      {"dispatch=nvfp4", "combine=bf16", "layout=mn_major_tma", "tokens=50,70", "hidden=2064", "topk=4", "experts=16"},
      {"dispatch=mxfp4", "combine=mxfp4", "layout=blocked_128x4", "tokens=64,32", "hidden=2080", "mask=0.3"},
      {"dispatch=mxfp4", "combine=nvfp4", "layout=mn_major_tma_packed_ue8m0", "tokens=100,0", "hidden=4096",
       "routing=ring", "topk=1", "experts=16"},
  });
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

TEST(LlQuant, PreQuantizedInputIsForwardedAsIs) {
#if FERRY_HAVE_CUDA
  run_rows({
      {"dispatch=fp8", "prequant=1", "layout=row_major", "tokens=64,48", "hidden=2944"},
      {"dispatch=fp8_ue8m0", "prequant=1", "layout=mn_major_tma", "tokens=32,64", "hidden=2048", "combine=fp8"},
      {"dispatch=nvfp4", "prequant=1", "layout=blocked_128x4", "tokens=50,70", "hidden=2064"},
      {"dispatch=mxfp4", "prequant=1", "dequant=1", "tokens=64,64", "hidden=7168", "experts=256", "capacity=64"},
  });
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

TEST(LlQuant, DequantizedDelivery) {
#if FERRY_HAVE_CUDA
  run_rows({
      {"dispatch=fp8", "dequant=1", "tokens=128,128", "hidden=7168", "experts=256", "capacity=64"},
      {"dispatch=fp8_ue8m0", "dequant=1", "tokens=40,64", "hidden=2048", "combine=nvfp4"},
      {"dispatch=nvfp4", "dequant=1", "tokens=64,33", "hidden=2064", "mask=0.2"},
      {"dispatch=mxfp4", "dequant=1", "tokens=16,16", "hidden=4096", "combine=fp8_ue8m0"},
  });
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

// Combine formats with bf16 dispatch: the receiver quantizes its partial row, the source dequantizes and sums in fp32.
TEST(LlQuant, CombineFormats) {
#if FERRY_HAVE_CUDA
  run_rows({
      {"combine=fp8", "tokens=128,96", "hidden=7168", "experts=256", "capacity=64"},
      {"combine=fp8_ue8m0", "tokens=64,64", "hidden=2944", "mask=0.3"},
      {"combine=nvfp4", "tokens=128,128", "hidden=7168", "experts=256", "capacity=64"},
      {"combine=nvfp4", "tokens=77,1", "hidden=2064", "topk=9"},
      {"combine=mxfp4", "tokens=64,64", "hidden=2080", "routing=grouped"},
  });
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

TEST(LlQuant, HookWithQuantizedFormats) {
#if FERRY_HAVE_CUDA
  run_rows({
      {"dispatch=nvfp4", "combine=fp8", "layout=blocked_128x4", "hook=1", "iters=3", "tokens=96,64", "hidden=7168",
       "experts=256", "capacity=64"},
      {"dispatch=fp8", "dequant=1", "combine=nvfp4", "hook=1", "iters=3", "tokens=32,48", "hidden=2048"},
  });
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

TEST(LlQuant, GraphReplaysWithFreshInputs) {
#if FERRY_HAVE_CUDA
  run_rows({
      {"dispatch=fp8_ue8m0", "combine=nvfp4", "layout=mn_major_tma_packed_ue8m0", "graph=1", "iters=200",
       "check_every=50", "tokens=64,48", "hidden=2048"},
      {"dispatch=mxfp4", "prequant=1", "combine=mxfp4", "layout=blocked_128x4", "graph=1", "hook=1", "iters=100",
       "check_every=25", "tokens=32,32", "hidden=7168", "experts=256", "capacity=32"},
  });
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

}  // namespace
}  // namespace ferry::test
