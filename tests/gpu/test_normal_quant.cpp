// Normal-mode dispatch / expand / combine with quantized wire formats on the cuda backend, compared bit for bit with
// the reference (src/ep/reference.hpp, host codecs of src/wire/codec.hpp):
//  - quantized delivery: every received row's payload bytes, block scales (at their offsets in recv_scale_layout) and
//    nvfp4 token scale equal ref::deliver of the reference's wire rows;
//  - pre-quantized input (DispatchArgs::x_scales): the caller's pieces arrive unchanged;
//  - dispatch_dequantize: the bf16 rows equal the reference's recv_x;
//  - expand: each expert's payload rows, scale tensor entries and token scales equal ref::deliver of expand_wire;
//  - combine in every combine_format, rank-major and expert-major: y equals the reference combine exactly.
// Outputs are poisoned before every call, so every checked entry was written by it. Each test starts one process per
// rank (2 GPUs; skipped below) and every child rebuilds every rank's inputs from the printed seed.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
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
#include "support/normal_check.hpp"
#include "workloads/inputs.hpp"
#include "workloads/routing.hpp"

#if FERRY_HAVE_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <limits>
#endif

namespace ferry::test {
namespace {

#if FERRY_HAVE_CUDA

struct Spec : CaseShape {
  WireFormat dispatch_format = WireFormat::fp8_e4m3;
  WireFormat combine_format = WireFormat::bf16;
  ScaleLayout layout = ScaleLayout::row_major;
  bool dequantize = false;
  bool prequantized = false;
  bool expand = false;
  int blocks = 0;  // blocks=: pins the dispatch grid (EpConfig::dispatch_geometry; 0: the default)
  // protocol=landing|counts|any: the dispatch protocol explain() must name (run_cases pins it with
  // FERRY_NORMAL_LANDING)
  std::string protocol = "any";
};

Spec parse_spec(std::vector<std::string> const& words) {
  CaseArgs const args(words);
  Spec s;
  s.read(args);
  s.dispatch_format = parse_wire_format(args.text("format", wire_format_name(s.dispatch_format)));
  s.combine_format = parse_wire_format(args.text("combine", wire_format_name(s.combine_format)));
  s.layout = parse_scale_layout(args.text("layout", scale_layout_name(s.layout)));
  s.dequantize = args.flag("dequantize", s.dequantize);
  s.prequantized = args.flag("prequant", s.prequantized);
  s.expand = args.flag("expand", s.expand);
  s.blocks = args.integer("blocks", s.blocks);
  s.protocol = args.text("protocol", s.protocol);
  return s;
}

// Rows with more than N(0,1) noise, so scales differ between blocks: zero blocks, blocks scaled by powers of two
// over many binades, bf16 denormals, and (dispatch input only) NaN / +-Inf elements.
void vary_rows(std::vector<uint16_t>& x, int rows, int hidden, uint64_t seed, bool non_finite) {
  for (int r = 0; r < rows; ++r) {
    uint16_t* row = x.data() + static_cast<std::size_t>(r) * hidden;
    uint64_t const h = (seed * 0x9E3779B97F4A7C15ull) ^ (static_cast<uint64_t>(r) * 0xBF58476D1CE4E5B9ull);
    int const kind = static_cast<int>(h % 8);
    int const block = static_cast<int>((h >> 8) % static_cast<uint64_t>(hidden / 32)) * 32;
    for (int i = block; i < block + 32; ++i) {
      float v = ref::bf16_to_float(row[i]);
      switch (kind) {
        case 1:
          v = 0.0f;
          break;
        case 2:
          v = std::ldexp(v, -20);
          break;
        case 3:
          v = std::ldexp(v, 24);
          break;
        case 4:
          v = std::ldexp(v, -130);  // bf16 denormals
          break;
        default:
          break;
      }
      row[i] = ref::float_to_bf16(v);
    }
    if (non_finite && kind == 5) {
      row[(h >> 20) % static_cast<uint64_t>(hidden)] = 0x7FC0;  // NaN
      row[(h >> 30) % static_cast<uint64_t>(hidden)] = 0xFF80;  // -Inf
    }
  }
}

template <typename T>
T* device_copy(std::vector<T> const& host, std::size_t min_count = 1) {
  void* ptr = nullptr;
  CK(cudaMalloc(&ptr, std::max(host.size(), min_count) * sizeof(T)));
  if (!host.empty()) CK(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return static_cast<T*>(ptr);
}

template <typename T>
void upload(void* dev, std::vector<T> const& host) {
  if (!host.empty()) CK(cudaMemcpy(dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
}

// Milliseconds since the rank process started its case (progress lines: where a slow or stuck case spends time).
double elapsed_ms() {
  static auto const start = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// One shape on an EpBuffer of its own over `comm`: dispatch (+ expand) and both combines, iters times.
int run_spec(std::shared_ptr<Communicator> const& comm, Spec const& spec) {
  int const rank = comm->rank();
  int const world = comm->world();
  std::vector<int> const tokens = per_rank(spec.tokens, world);  // the lists are written for 2 ranks

  EpConfig config = spec.config();
  config.dispatch_format = spec.dispatch_format;
  config.combine_format = spec.combine_format;
  config.dispatch_dequantize = spec.dequantize;
  config.recv_scale_layout = spec.layout;
  if (spec.expand) config.expert_capacity = config.recv_capacity(world);
  if (spec.blocks > 0) config.dispatch_geometry = Geometry{spec.blocks};
  EpBuffer buffer(comm, config);
  int const hidden = spec.hidden;
  int const topk = spec.topk;
  int const num_local = config.num_local_experts(world);
  int const slots = config.expert_slots();
  int const my_tokens = tokens[rank];
  int const cap = config.recv_capacity(world);
  bool const quantized = config.delivers_quantized();
  WireRowLayout const wire = wire_row_layout(config.dispatch_format, hidden);
  std::size_t const recv_row_bytes = config.recv_row_bytes();
  std::size_t const scale_row_bytes = static_cast<std::size_t>(wire.num_scales) * wire.scale_bytes;
  std::fprintf(
      stderr, "rank %d: seed %llu dispatch %s%s%s layout %s combine %s tokens %d hidden %d topk %d experts %d\n", rank,
      static_cast<unsigned long long>(spec.seed), wire_format_name(spec.dispatch_format),
      spec.dequantize ? " (dequantized)" : "", spec.prequantized ? " (pre-quantized)" : "",
      scale_layout_name(spec.layout), wire_format_name(spec.combine_format), my_tokens, hidden, topk, spec.experts);

  std::fprintf(stderr, "rank %d: %.0f ms: communicator and buffer ready\n", rank, elapsed_ms());
  // inputs at fixed device addresses (a captured graph reads new inputs copied into them)
  std::size_t const t_alloc = static_cast<std::size_t>(std::max(1, my_tokens));
  void* x_dev = device_copy(std::vector<uint8_t>{}, t_alloc * hidden * 2);
  void* x_scales_dev = device_copy(std::vector<uint8_t>{}, t_alloc * std::max<std::size_t>(scale_row_bytes, 4));
  float* x_token_dev = device_copy(std::vector<float>{}, t_alloc);
  void* idx_dev = device_copy(std::vector<int64_t>{}, t_alloc * topk);
  float* w_dev = device_copy(std::vector<float>{}, t_alloc * topk);
  void* rows_dev = device_copy(std::vector<uint16_t>{}, static_cast<std::size_t>(cap) * hidden);
  void* eout_dev =
      slots > 0 ? device_copy(std::vector<uint16_t>{}, static_cast<std::size_t>(num_local) * slots * hidden) : nullptr;
  void* y_rm = device_copy(std::vector<uint16_t>{}, t_alloc * hidden);
  void* y_em = device_copy(std::vector<uint16_t>{}, t_alloc * hidden);
  std::size_t const y_bytes = static_cast<std::size_t>(my_tokens) * hidden * 2;

  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DispatchArgs dargs;
  dargs.x = x_dev;
  dargs.num_tokens = my_tokens;
  dargs.topk_idx = idx_dev;
  dargs.topk_idx_type = IndexType::int64;
  dargs.topk_weights = w_dev;
  dargs.expand = spec.expand;
  dargs.eager = !spec.graph;
  if (spec.prequantized) {
    dargs.x_scales = x_scales_dev;
    if (wire.has_token_scale) dargs.x_token_scales = x_token_dev;
  }
  CombineArgs const cargs_rm{CombineLayout::rank_major, rows_dev, y_rm, !spec.graph};
  CombineArgs const cargs_em{CombineLayout::expert_major, eout_dev, y_em, !spec.graph};

  cudaGraphExec_t graph = nullptr;
  DispatchResult result{};
  for (int iter = 0; iter < spec.iters; ++iter) {
    RoutingOptions const routing = spec.routing_options(iter);
    auto inputs = ref::generate_inputs(config, world, routing, tokens);
    for (int r = 0; r < world; ++r) {
      ref::RankInput& in = inputs[r];
      vary_rows(in.x, in.num_tokens, hidden, routing.seed + 17 * r, /*non_finite=*/true);
      if (spec.prequantized) {
        // the caller's own quantization of other rows: what arrives must be these bytes, not a re-quantized x
        ref::RankInput other = in;
        other.x = generate_tokens(routing.seed + 999, r, in.num_tokens, hidden);
        vary_rows(other.x, in.num_tokens, hidden, routing.seed + 31 * r, true);
        in.x_wire = ref::source_wire_rows(config, other);
      }
    }
    std::vector<ref::RankDispatch> expected;
    for (int r = 0; r < world; ++r) expected.push_back(ref::dispatch(config, world, r, inputs));
    std::fprintf(stderr, "rank %d: %.0f ms: iter %d reference dispatch ready\n", rank, elapsed_ms(), iter);
    ref::RankDispatch const& mine = expected[rank];
    std::vector<std::vector<uint16_t>> rows(world), eout(world);
    for (int r = 0; r < world; ++r) {
      rows[r] = generate_tokens(routing.seed + 101, r, expected[r].num_recv, hidden);
      vary_rows(rows[r], expected[r].num_recv, hidden, routing.seed + 5 * r, false);
      if (slots > 0) {
        eout[r] = generate_tokens(routing.seed + 202, r, num_local * slots, hidden);
        vary_rows(eout[r], num_local * slots, hidden, routing.seed + 7 * r, false);
      }
    }

    // upload this rank's inputs
    ref::RankInput const& in = inputs[rank];
    if (spec.prequantized) {
      ref::QuantizedInput const q = ref::split_wire_rows(config, in.x_wire, in.num_tokens);
      upload(x_dev, q.payload);
      upload(x_scales_dev, q.scales);
      upload(x_token_dev, q.token_scales);
    } else {
      upload(x_dev, in.x);
    }
    upload(idx_dev, in.topk_idx);
    upload(w_dev, in.topk_weights);
    upload(rows_dev, rows[rank]);
    if (slots > 0) upload(eout_dev, eout[rank]);
    // poison what the calls write (the buffers are known after the first call)
    if (result.recv_x) poison_any_dispatch(config, world, result);
    CK(cudaMemset(y_rm, 0xEE, y_bytes));
    CK(cudaMemset(y_em, 0xEE, y_bytes));
    CK(cudaDeviceSynchronize());

    if (!spec.graph) {
      result = buffer.dispatch(dargs, stream);
      if (result.num_recv_host != mine.num_recv) return fail("num_recv_host", rank, iter, result.num_recv_host);
    } else {
      if (!graph) {
        // one eager call first (pointers of the results), then the capture of dispatch + both combines
        DispatchArgs eager = dargs;
        eager.eager = true;
        buffer.dispatch(eager, stream);
        buffer.combine(CombineArgs{CombineLayout::rank_major, rows_dev, y_rm, true}, stream);
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        result = buffer.dispatch(dargs, stream);
        buffer.combine(cargs_rm, stream);
        if (slots > 0) buffer.combine(cargs_em, stream);
        CK(cudaStreamEndCapture(stream, &g));
        CK(cudaGraphInstantiate(&graph, g, 0));
        CK(cudaGraphDestroy(g));
        CK(cudaMemset(y_rm, 0xEE, y_bytes));
        CK(cudaDeviceSynchronize());
      }
      CK(cudaGraphLaunch(graph, stream));
      CK(cudaStreamSynchronize(stream));
      comm->check_errors(stream);
    }

    std::fprintf(stderr, "rank %d: %.0f ms: iter %d dispatched\n", rank, elapsed_ms(), iter);
    if (iter == 0 && check_protocol(buffer, spec.protocol, rank) != 0) return 1;
    // 1. dispatch: metadata as in bf16 transport
    int32_t const num_recv = to_host<int32_t>(result.num_recv, 1)[0];
    if (num_recv != mine.num_recv) return fail("num_recv", rank, iter, num_recv);
    if (result.recv_row_bytes != recv_row_bytes) return fail("recv_row_bytes", rank, iter, result.recv_row_bytes);
    if (int const code = check_normal_metadata(config, world, rank, iter, mine, result, num_recv)) return code;
    long d;

    // 2. dispatch: the rows, and 3. expand (normal_check.hpp)
    if (quantized) {
      if (int const code = check_quantized_rows(config, world, rank, iter, mine, result, num_recv,
                                                /*poisoned=*/iter > 0, spec.expand))
        return code;
    } else {
      auto const rx = to_host<uint16_t>(result.recv_x, static_cast<std::size_t>(num_recv) * hidden);
      if ((d = first_diff(rx.data(), mine.recv_x.data(), rx.size())) >= 0) return fail("recv_x bf16", rank, iter, d);
      if (spec.expand) {
        auto const esr = to_host<int32_t>(result.expert_src_row, static_cast<std::size_t>(num_local) * slots);
        if ((d = first_diff(esr.data(), mine.expert_src_row.data(), esr.size())) >= 0)
          return fail("expert_src_row", rank, iter, d);
        if (int const code = check_expert_x_bf16("expert_x bf16", config, world, rank, iter, mine, result.expert_x))
          return code;
      }
    }

    std::fprintf(stderr, "rank %d: %.0f ms: iter %d dispatch checked\n", rank, elapsed_ms(), iter);
    // 4. combine in combine_format, both layouts
    if (!spec.graph) buffer.combine(cargs_rm, stream);
    auto const y_ref_rm = ref::combine_rank_major(config, world, rank, inputs, expected, rows);
    auto const y1 = to_host<uint16_t>(y_rm, y_ref_rm.size());
    if ((d = first_diff(y1.data(), y_ref_rm.data(), y1.size())) >= 0) return fail("y rank-major", rank, iter, d);
    if (slots > 0) {
      if (!spec.graph) buffer.combine(cargs_em, stream);
      auto const y_ref_em = ref::combine_expert_major(config, world, rank, inputs, expected, eout);
      auto const y2 = to_host<uint16_t>(y_em, y_ref_em.size());
      if ((d = first_diff(y2.data(), y_ref_em.data(), y2.size())) >= 0) return fail("y expert-major", rank, iter, d);
    }
  }
  std::fprintf(stderr, "rank %d: %.0f ms: combines checked\n", rank, elapsed_ms());
  std::string const why = buffer.explain();
  if (why.find(wire_format_name(spec.dispatch_format)) == std::string::npos ||
      why.find(wire_format_name(spec.combine_format)) == std::string::npos) {
    std::fprintf(stderr, "rank %d: explain() does not name the formats: %s\n", rank, why.c_str());
    return 1;
  }
  CK(cudaStreamSynchronize(stream));
  comm->check_errors(stream);
  if (graph) cudaGraphExecDestroy(graph);
  cudaStreamDestroy(stream);
  for (void* ptr : {x_dev, x_scales_dev, static_cast<void*>(x_token_dev), idx_dev, static_cast<void*>(w_dev), rows_dev,
                    eout_dev, y_rm, y_em})
    if (ptr) cudaFree(ptr);
  std::fprintf(stderr, "rank %d: %.0f ms: %d iterations exact\n", rank, elapsed_ms(), spec.iters);
  return 0;
}

// The shapes of one case, separated by the word "|" on the command line, run one after the other on one
// communicator (a process and a communicator per shape would cost more than most shapes).
int normal_quant_case() {
  elapsed_ms();
  std::vector<std::vector<std::string>> groups(1);
  for (auto const& word : rank_case_args()) {
    if (word == "|")
      groups.emplace_back();
    else
      groups.back().push_back(word);
  }
  auto comm = make_cuda_comm();
  CK(cudaSetDevice(comm->device()));
  for (auto const& words : groups)
    if (int const code = run_spec(comm, parse_spec(words)); code != 0) return code;
  return 0;
}

FERRY_RANK_CASE(normal_quant) {
  return normal_quant_case();
}

std::string seed_arg() {
  uint64_t const seed = fresh_seed();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  return "seed=" + std::to_string(seed);
}

// The dispatch protocol a case runs (FERRY_NORMAL_LANDING): the landing zone, the count exchange, or the automatic
// choice (the landing zone up to world * max_tokens_per_rank = 1024 landing slots, docs/design-notes.md).
enum class Protocol { landing, counts, automatic };

// Runs the shapes (each a list of key=value words; a fresh seed is added to each) in one rank case on gpu_test_world()
// ranks, over `protocol` (pinned: each shape checks that explain() names it).
void run_cases(std::vector<std::vector<std::string>> const& shapes, Protocol protocol = Protocol::automatic) {
  std::vector<std::string> args;
  for (auto const& shape : shapes) {
    if (!args.empty()) args.push_back("|");
    args.push_back(seed_arg());
    args.insert(args.end(), shape.begin(), shape.end());
    if (protocol != Protocol::automatic)
      args.push_back(protocol == Protocol::landing ? "protocol=landing" : "protocol=counts");
  }
  std::vector<std::pair<std::string, std::string>> env;
  if (protocol != Protocol::automatic)
    env.emplace_back("FERRY_NORMAL_LANDING", protocol == Protocol::landing ? "on" : "off");
  std::printf("dispatch protocol: %s\n", protocol == Protocol::landing  ? "landing zone (pinned)"
                                         : protocol == Protocol::counts ? "count exchange (pinned)"
                                                                        : "automatic");
  auto const start = std::chrono::steady_clock::now();
  // NOTE: a shape takes about a second; the bound turns a stuck case into a failure instead of eating the suite
  run_gpu_case(gpu_test_world(), "normal_quant", std::move(args), std::move(env),
               std::chrono::seconds(40 + 15 * shapes.size()));
  std::printf("%zu shapes took %.1f s\n", shapes.size(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  std::fflush(stdout);
}

#endif  // FERRY_HAVE_CUDA

// Each dispatch format delivered quantized, in two scale layouts each (row_major: the count exchange's senders write
// every scale in place; the others: its receiver pass; the landing zone's receiver writes both), with a different
// combine format each time, expand on; over both dispatch protocols.
TEST(NormalQuant, DeliverQuantizedEveryFormatAndLayout) {
#if FERRY_HAVE_CUDA
  struct Row {
    char const* format;
    char const* layout;
    char const* combine;
    char const* tokens;
    int hidden;
  };
  Row const rows[] = {
      {"fp8", "row_major", "fp8", "100,37", 2048},
      {"fp8", "mn_major_tma", "bf16", "160,129", 7168},
      {"fp8_ue8m0", "mn_major_tma_packed_ue8m0", "fp8_ue8m0", "300,200", 2048},
      {"fp8_ue8m0", "row_major", "mxfp4", "64,1", 2176},
      {"nvfp4", "blocked_128x4", "nvfp4", "200,150", 2048},
      {"nvfp4", "mn_major_tma", "bf16", "70,90", 4096},
      {"mxfp4", "mn_major_tma_packed_ue8m0", "fp8", "129,300", 2048},
      {"mxfp4", "blocked_128x4", "nvfp4", "0,50", 7168},
  };
  std::vector<std::vector<std::string>> shapes;
  for (Row const& row : rows)
    shapes.push_back({std::string("format=") + row.format, std::string("layout=") + row.layout,
                      std::string("combine=") + row.combine, std::string("tokens=") + row.tokens,
                      "hidden=" + std::to_string(row.hidden), "experts=64", "topk=8", "expand=1", "iters=2",
                      "mask=0.1"});
  run_cases(shapes, Protocol::landing);
  run_cases(shapes, Protocol::counts);
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

// Pre-quantized input (payload + scales + token scales) is forwarded byte for byte, over both dispatch protocols.
TEST(NormalQuant, PrequantizedInputForwarded) {
#if FERRY_HAVE_CUDA
  std::vector<std::vector<std::string>> shapes;
  for (char const* format : {"fp8", "fp8_ue8m0", "nvfp4", "mxfp4"})
    shapes.push_back({std::string("format=") + format, "prequant=1",
                      std::string("layout=") + (std::string(format) == "fp8" ? "mn_major_tma" : "row_major"),
                      "tokens=150,90", "hidden=2048", "expand=1", "iters=2"});
  run_cases(shapes, Protocol::landing);
  run_cases(shapes, Protocol::counts);
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

// dispatch_dequantize: wire rows land, the receiver dequantizes them to bf16; over both dispatch protocols.
TEST(NormalQuant, DequantizedDelivery) {
#if FERRY_HAVE_CUDA
  std::vector<std::vector<std::string>> shapes;
  for (char const* format : {"fp8", "fp8_ue8m0", "nvfp4", "mxfp4"})
    shapes.push_back({std::string("format=") + format, "dequantize=1", "combine=bf16", "tokens=180,120", "hidden=2048",
                      "expand=1", "iters=2", "mask=0.2"});
  shapes.push_back({"format=nvfp4", "dequantize=1", "prequant=1", "tokens=64,64", "hidden=2048", "iters=1"});
  run_cases(shapes, Protocol::landing);
  run_cases(shapes, Protocol::counts);
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

// Combine in every quantized format after a bf16 dispatch (both layouts), at the production hidden size; and two
// formats after an fp8 dispatch of more than 1024 tokens per rank.
TEST(NormalQuant, CombineEveryFormat) {
#if FERRY_HAVE_CUDA
  std::vector<std::vector<std::string>> shapes;
  for (char const* combine : {"fp8", "fp8_ue8m0", "nvfp4", "mxfp4"})
    shapes.push_back({"format=bf16", std::string("combine=") + combine, "tokens=160,96", "hidden=7168", "experts=64",
                      "topk=8", "expand=1", "iters=2", "mask=0.1"});
  // past 1024 tokens the last tokens of a source go in finer tiles (combine_tiles.hpp): both tile sizes, both sides
  for (char const* combine : {"fp8", "nvfp4"})
    shapes.push_back({"format=fp8", std::string("combine=") + combine, "tokens=2100,1300", "hidden=4096", "experts=64",
                      "topk=6", "iters=2", "mask=0.1"});
  run_cases(shapes);
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

// Captured graphs of a quantized dispatch + both combines, replayed with new inputs, over both dispatch protocols.
TEST(NormalQuant, GraphReplay) {
#if FERRY_HAVE_CUDA
  std::vector<std::vector<std::string>> const shapes{
      {"format=fp8", "layout=mn_major_tma", "combine=fp8", "tokens=128,128", "hidden=7168", "expand=1", "graph=1",
       "iters=8"},
      {"format=nvfp4", "layout=blocked_128x4", "combine=nvfp4", "prequant=1", "tokens=96,160", "hidden=2048",
       "expand=1", "graph=1", "iters=6"}};
  run_cases(shapes, Protocol::landing);
  run_cases(shapes, Protocol::counts);
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

// nvfp4 with hidden % 32 != 0: 16-element units (8-byte payload pieces, 8-byte row copies in expand and in the
// landing zone's delivery), both legs, over both dispatch protocols.
TEST(NormalQuant, Nvfp4HiddenNotMultipleOf32) {
#if FERRY_HAVE_CUDA
  std::vector<std::vector<std::string>> const shapes{
      {"format=nvfp4", "layout=row_major", "combine=nvfp4", "tokens=33,70", "hidden=2064", "expand=1", "iters=2"},
      {"format=nvfp4", "dequantize=1", "combine=nvfp4", "tokens=40,20", "hidden=2064", "iters=2"}};
  run_cases(shapes, Protocol::landing);
  run_cases(shapes, Protocol::counts);
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

// nvfp4 quantized here with many rows per warp. The count exchange (a pinned grid of a few CTAs): every row's token
// scale comes from the pass over the CTA's rows before the push, read back by the warp that pushes the row; rows that
// no rank takes (topk 1 with a high mask rate: every entry masked) among them; 32- and 16-element units, both delivery
// kinds. The landing zone (its grid is fixed, so more tokens than its warps, pinned past the automatic bound): every
// warp of a CTA meets its rows' amaxes step after step. (The bench's 4096-token --check was the only run with several
// rows per warp before.)
TEST(NormalQuant, Nvfp4ManyRowsPerWarp) {
#if FERRY_HAVE_CUDA
  run_cases({{"format=nvfp4", "layout=row_major", "combine=nvfp4", "tokens=600,450", "hidden=7168", "blocks=8",
              "expand=1", "iters=2", "mask=0.1"},
             {"format=nvfp4", "layout=mn_major_tma", "combine=bf16", "tokens=500,700", "hidden=2064", "blocks=5",
              "topk=1", "mask=0.4", "iters=2"},
             {"format=nvfp4", "dequantize=1", "combine=bf16", "tokens=400,300", "hidden=4096", "blocks=3", "topk=1",
              "mask=0.5", "iters=1"}},
            Protocol::counts);
  run_cases({{"format=nvfp4", "layout=row_major", "combine=nvfp4", "tokens=5000,3100", "hidden=2048", "expand=1",
              "iters=2", "mask=0.1"},
             {"format=nvfp4", "dequantize=1", "combine=bf16", "tokens=4400,4500", "hidden=2064", "topk=1", "mask=0.4",
              "iters=1"}},
            Protocol::landing);
#else
  GTEST_SKIP() << "built without the cuda backend";
#endif
}

}  // namespace
}  // namespace ferry::test
