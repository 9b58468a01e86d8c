// Low-latency mode with several ranks on ONE GPU ("virtual ranks"). An LL rank's kernels address their peers only
// through LlBuffers::sym (every rank's symmetric region) and their DeviceView, so W ranks fit on one device: W
// symmetric regions from cudaMalloc (zeroed, as the communicator's are), each rank's local buffers
// (allocate_ll_buffers), its own DeviceView, error block (mapped pinned memory) and stream. Every rank's legs are
// launched side by side and the ranks' grids wait for each other inside the kernels as they do across GPUs. The
// grids are launched non-cooperatively (LlBuffers::cooperative = false) with SMs / W CTAs each, so all W of them are
// co-resident (an LL CTA takes a whole SM); every device wait is bounded (kTimeoutS), so a bug ends in a timeout
// recorded in a rank's error block, never a hang.
//
// Each case draws fresh inputs every iteration (seed printed), poisons every output first, runs dispatch, the
// expert-major combine and the rank-major combine back to back on every rank, checks every rank's error block and
// compares every rank's outputs with the reference bit for bit (tests/support/ll_check.hpp): bf16 at worlds 2, 4 and
// 8 over a table of shapes, fp8, nvfp4 and mxfp4 with quantized delivery, and the hook path (every send half, then
// every receive half). Needs one GPU; skips without one, and skips a world the GPU cannot hold one CTA per rank of.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "comm/comm_impl.hpp"
#include "ep/cuda/ll_buffers.hpp"
#include "ep/ep_impl.hpp"
#include "ep/reference.hpp"
#include "ep/routing.hpp"
#include "ferry/communicator.hpp"
#include "ferry/device_view.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "ferry/wire_format.hpp"
#include "support/gpu_case.hpp"
#include "support/ll_check.hpp"

namespace ferry::test {
namespace {

using cuda_ll::Half;
using cuda_ll::LlBuffers;

// Bound of every device wait.
constexpr double kTimeoutS = 10.0;
// Elements behind each y that must stay poisoned.
constexpr std::size_t kGuardElems = 2048;

struct Spec : CaseShape {
  int world = 2;     // world=: virtual ranks
  int capacity = 0;  // capacity=: expert_capacity (0: ll's default, world * max_tokens)
  WireFormat dispatch_format = WireFormat::bf16;
  WireFormat combine_format = WireFormat::bf16;
  ScaleLayout layout = ScaleLayout::row_major;
  bool hook = false;        // hook=1: each leg as its send half, then its receive half
  bool own_direct = false;  // own=direct: bf16 own rows copied by the send half (FERRY_LL_OWN_ROWS=direct)
};

Spec parse_spec(std::vector<std::string> const& words) {
  CaseArgs const args(words);
  Spec s;
  s.read(args);
  s.world = args.integer("world", s.world);
  s.capacity = args.integer("capacity", s.capacity);
  s.dispatch_format = parse_wire_format(args.text("dispatch", "bf16"));
  s.combine_format = parse_wire_format(args.text("combine", "bf16"));
  s.layout = parse_scale_layout(args.text("layout", "row_major"));
  s.hook = args.flag("hook", s.hook);
  s.own_direct = args.text("own", "landing") == "direct";
  return s;
}

// CTAs per rank such that the grids of `world` ranks are co-resident on the current GPU: an LL CTA (512 threads, up to
// 128 registers each) takes a whole SM. 0 when the GPU has fewer SMs than ranks.
int ctas_per_rank(int world) {
  int device = 0;
  int num_sms = 0;
  CK(cudaGetDevice(&device));
  CK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  return std::min(cuda_ll::kMaxCtas, num_sms / world);
}

// `world` ranks of one LL EpBuffer on the current GPU: what CudaLlEp sets up per rank, except that the symmetric
// regions are plain allocations every rank sees at the same addresses, and a grid of num_ctas launched side by side.
class VirtualRanks {
 public:
  // config: resolved (EpConfig::resolved).
  VirtualRanks(EpConfig const& config, int world, int num_ctas, bool own_direct)
      : ranks_(world), regions_(world, nullptr), errors_(world, nullptr), streams_(world, nullptr) {
    try {
      cuda_ll::LlLayout const layout = cuda_ll::make_ll_layout(config, world);
      for (int r = 0; r < world; ++r) {
        CK(cudaMalloc(&regions_[r], layout.total));
        // counters and sequence numbers start at 0, as in the communicator's zeroed region
        CK(cudaMemset(regions_[r], 0, layout.total));
        CK(cudaHostAlloc(reinterpret_cast<void**>(&errors_[r]), sizeof(DeviceErrorBlock), cudaHostAllocMapped));
        std::memset(errors_[r], 0, sizeof(DeviceErrorBlock));
        CK(cudaStreamCreateWithFlags(&streams_[r], cudaStreamNonBlocking));
      }
      for (int r = 0; r < world; ++r) {
        LlBuffers& b = ranks_[r];
        b.config = config;
        b.world = world;
        b.rank = r;
        b.num_local_experts = config.num_local_experts(world);
        b.expert_slots = config.expert_slots();
        b.num_ctas = num_ctas;
        b.cooperative = false;  // several grids side by side: co-resident by their size, not by the runtime's promise
        b.own_direct = own_direct;
        b.view.rank = r;
        b.view.world = world;
        b.view.timeout_ns = static_cast<uint64_t>(kTimeoutS * 1e9);
        CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&b.view.error), errors_[r], 0));
        b.layout = layout;
        for (int peer = 0; peer < world; ++peer) b.sym.ptr[peer] = static_cast<char*>(regions_[peer]);
        b.sym.bytes = layout.total;
        cuda_ll::allocate_ll_buffers(b);
      }
      CK(cudaDeviceSynchronize());  // every rank's buffers exist (and are zeroed) before any peer pushes into them
    } catch (...) {
      release();
      throw;
    }
  }
  ~VirtualRanks() { release(); }
  VirtualRanks(VirtualRanks const&) = delete;
  VirtualRanks& operator=(VirtualRanks const&) = delete;

  int world() const { return static_cast<int>(ranks_.size()); }
  LlBuffers const& operator[](int r) const { return ranks_[r]; }
  cudaStream_t stream(int r) const { return streams_[r]; }

  // Waits for every rank's stream, then reads and clears every rank's error block: "" when each rank recorded no
  // timeout, no bad id and exactly overflow[r] entries dropped past expert_capacity (the reference's dropped_slots),
  // else what each rank recorded (a timeout names the rank, the peer it waited for and the phase).
  std::string synchronize(std::vector<int> const& overflow) const {
    for (cudaStream_t stream : streams_) CK(cudaStreamSynchronize(stream));
    std::string out;
    for (int r = 0; r < world(); ++r) {
      DeviceErrorBlock block;
      std::memcpy(&block, errors_[r], sizeof(block));
      std::memset(errors_[r], 0, sizeof(DeviceErrorBlock));
      if (block.status != 0)
        out += "rank " + std::to_string(r) + ": status " + std::to_string(block.status) + ": " +
               detail::describe_device_error(block, kTimeoutS) + "\n";
      if (block.input_errors != 0 || block.overflow_rows != static_cast<uint32_t>(overflow[r]))
        out += "rank " + std::to_string(r) + ": input_errors " + std::to_string(block.input_errors) +
               " (first bad value " + std::to_string(block.first_bad_value) + "), overflow_rows " +
               std::to_string(block.overflow_rows) + " (the reference drops " + std::to_string(overflow[r]) + ")\n";
    }
    return out;
  }

 private:
  void release() noexcept {
    cudaDeviceSynchronize();  // NOTE: never throws; a failed teardown has no one to report to
    for (LlBuffers& b : ranks_) cuda_ll::free_ll_buffers(b);
    for (void* region : regions_)
      if (region) cudaFree(region);
    for (DeviceErrorBlock* block : errors_)
      if (block) cudaFreeHost(block);
    for (cudaStream_t stream : streams_)
      if (stream) cudaStreamDestroy(stream);
  }

  std::vector<LlBuffers> ranks_;
  std::vector<void*> regions_;
  std::vector<DeviceErrorBlock*> errors_;  // host addresses (the kernels get the mapped device addresses)
  std::vector<cudaStream_t> streams_;
};

// One rank's inputs and combine outputs in device memory, at fixed addresses.
struct RankIo {
  DeviceBuffer x, idx, w;   // dispatch inputs
  DeviceBuffer rows;        // rank-major combine input [world * max_tokens, hidden]
  DeviceBuffer eout;        // expert-major combine input [num_local_experts, expert_slots, hidden]
  DeviceBuffer y_em, y_rm;  // [num_tokens, hidden] + the guard
  RankIo(EpConfig const& config, int world, int num_tokens)
      : x(row_bytes(config) * num_tokens),
        idx(static_cast<std::size_t>(num_tokens) * config.topk * 8),
        w(static_cast<std::size_t>(num_tokens) * config.topk * 4),
        rows(row_bytes(config) * config.recv_capacity(world)),
        eout(row_bytes(config) * config.num_local_experts(world) * config.expert_slots()),
        y_em(row_bytes(config) * num_tokens + kGuardElems * 2),
        y_rm(row_bytes(config) * num_tokens + kGuardElems * 2) {}
  static std::size_t row_bytes(EpConfig const& config) { return static_cast<std::size_t>(config.hidden) * 2; }
};

template <typename T>
void upload(DeviceBuffer const& dst, std::vector<T> const& src) {
  if (!src.empty()) CK(cudaMemcpy(dst.ptr, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice));
}

// Launches one leg on every rank (each on its own stream, side by side): whole, or every send half then every
// receive half.
template <typename Launch>
void launch_leg(VirtualRanks const& ranks, bool hook, Launch const& launch) {
  for (int r = 0; r < ranks.world(); ++r) launch(r, hook ? Half::send : Half::both);
  if (hook)
    for (int r = 0; r < ranks.world(); ++r) launch(r, Half::recv);
}

// Runs `spec` on spec.world virtual ranks of num_ctas CTAs each; fails the calling test at the first mismatch.
void run_virtual(Spec const& spec, int num_ctas) {
  int const world = spec.world;
  std::vector<int> const tokens = per_rank(spec.tokens, world);  // the lists repeat over the ranks
  // the config a real EpBuffer would give its backend (ep_buffer.cpp): validated, then resolved for the world
  EpConfig user = spec.config();
  user.mode = Mode::low_latency;
  user.dispatch_format = spec.dispatch_format;
  user.combine_format = spec.combine_format;
  user.recv_scale_layout = spec.layout;
  if (spec.capacity > 0) user.expert_capacity = spec.capacity;
  user.validate(world);
  EpConfig const config = user.resolved(world);
  int const hidden = config.hidden;
  int const num_local = config.num_local_experts(world);
  int const slots = config.expert_slots();
  std::printf(
      "world %d x %d CTAs: seed %llu routing %s hidden %d topk %d experts %d slots %d dispatch %s combine %s "
      "layout %s hook %d\n",
      world, num_ctas, static_cast<unsigned long long>(spec.seed), spec.routing.c_str(), hidden, config.topk,
      config.num_experts, slots, wire_format_name(config.dispatch_format), wire_format_name(config.combine_format),
      scale_layout_name(config.recv_scale_layout), spec.hook);
  std::fflush(stdout);

  VirtualRanks ranks(config, world, num_ctas, spec.own_direct);
  std::vector<RankIo> io;
  io.reserve(world);
  for (int r = 0; r < world; ++r) io.emplace_back(config, world, tokens[r]);
  std::vector<DispatchArgs> dargs(world);
  std::vector<CombineArgs> em(world), rm(world);
  for (int r = 0; r < world; ++r) {
    dargs[r].x = io[r].x.ptr;
    dargs[r].num_tokens = tokens[r];
    dargs[r].topk_idx = io[r].idx.ptr;
    dargs[r].topk_idx_type = IndexType::int64;
    dargs[r].topk_weights = static_cast<float const*>(io[r].w.ptr);
    dargs[r].return_recv_hook = spec.hook;
    em[r] = CombineArgs{CombineLayout::expert_major, io[r].eout.ptr, io[r].y_em.ptr, true, spec.hook};
    rm[r] = CombineArgs{CombineLayout::rank_major, io[r].rows.ptr, io[r].y_rm.ptr, true, spec.hook};
    // the host checks an EpBuffer makes before its backend runs
    detail::validate_dispatch_args(config, dargs[r]);
    detail::validate_combine_args(config, em[r], true);
    detail::validate_combine_args(config, rm[r], true);
  }

  for (int iter = 0; iter < spec.iters; ++iter) {
    // 1. every rank's inputs (fresh), the reference, and the combine inputs (deterministic in (seed, rank))
    RoutingOptions const routing = spec.routing_options(iter);
    auto const inputs = ref::generate_inputs(config, world, routing, tokens);
    std::vector<ref::RankDispatch> expected;
    std::vector<int> dropped(world);  // entries past expert_capacity: each rank's error block must count exactly these
    std::vector<std::vector<uint16_t>> rows(world), eout(world);
    for (int r = 0; r < world; ++r) {
      expected.push_back(ref::dispatch(config, world, r, inputs));
      dropped[r] = expected[r].dropped_slots;
      rows[r] = generate_tokens(routing.seed + 101, r, expected[r].num_recv, hidden);
      eout[r] = generate_tokens(routing.seed + 202, r, num_local * slots, hidden);
      upload(io[r].x, inputs[r].x);
      upload(io[r].idx, inputs[r].topk_idx);
      upload(io[r].w, inputs[r].topk_weights);
      upload(io[r].rows, rows[r]);
      upload(io[r].eout, eout[r]);
      // 2. poison what the calls write
      poison_ll_dispatch(config, world, cuda_ll::ll_dispatch_result(ranks[r]), ranks[r].recv_slot);
      CK(cudaMemset(io[r].y_em.ptr, 0xEE, io[r].y_em.bytes));
      CK(cudaMemset(io[r].y_rm.ptr, 0xEE, io[r].y_rm.bytes));
    }
    CK(cudaDeviceSynchronize());

    // 3. dispatch, expert-major combine, rank-major combine: each leg on every rank side by side, the legs back to
    //    back on each rank's stream (as a captured graph runs them)
    launch_leg(ranks, spec.hook,
               [&](int r, Half half) { cuda_ll::launch_ll_dispatch(ranks[r], dargs[r], half, ranks.stream(r)); });
    for (std::vector<CombineArgs> const* leg : {&em, &rm})
      launch_leg(ranks, spec.hook, [&](int r, Half half) {
        cuda_ll::launch_ll_combine(ranks[r], (*leg)[r], tokens[r], half, ranks.stream(r));
      });
    std::string const failure = ranks.synchronize(dropped);
    ASSERT_TRUE(failure.empty()) << "iter " << iter << ":\n" << failure;

    // 4. every rank's outputs against the reference
    for (int r = 0; r < world; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r) + " iter " + std::to_string(iter));
      ASSERT_EQ(check_ll_dispatch(config, world, r, iter, expected[r], cuda_ll::ll_dispatch_result(ranks[r]),
                                  ranks[r].recv_slot),
                0);
      auto const y_em = ref::combine_expert_major(config, world, r, inputs, expected, eout);
      ASSERT_EQ(check_combined("y expert-major", io[r].y_em.ptr, y_em, kGuardElems, r, iter), 0);
      auto const y_rm = ref::combine_rank_major(config, world, r, inputs, expected, rows);
      ASSERT_EQ(check_combined("y rank-major", io[r].y_rm.ptr, y_rm, kGuardElems, r, iter), 0);
    }
  }
  std::printf("world %d: %d iterations exact on every rank\n", world, spec.iters);
}

// Runs each row (key=value words: CaseShape's, and world=, capacity=, dispatch=, combine=, layout=, hook=1) with a
// fresh seed. Skips without a GPU; a row whose world the GPU cannot hold is skipped with the reason (the test too,
// when no row ran).
void run_rows(std::vector<std::vector<std::string>> const& table) {
  int const gpus = cuda_device_count();
  if (gpus == 0) GTEST_SKIP() << "needs a GPU, found 0";
  int ran = 0;
  std::string skipped;
  for (auto const& row : table) {
    std::string label;
    for (auto const& word : row) label += word + " ";
    std::vector<std::string> words = row;
    uint64_t const seed = fresh_seed();
    words.push_back("seed=" + std::to_string(seed));
    Spec const spec = parse_spec(words);
    int const ctas = ctas_per_rank(spec.world);
    if (ctas < 1) {
      std::printf("skipped %s: fewer SMs than the %d ranks, which need one co-resident CTA each at least\n",
                  label.c_str(), spec.world);
      skipped += label + "\n";
      continue;
    }
    SCOPED_TRACE(label + "seed=" + std::to_string(seed));
    run_virtual(spec, ctas);
    if (::testing::Test::HasFatalFailure()) return;
    ++ran;
  }
  if (ran == 0) GTEST_SKIP() << "no row fits this GPU:\n" << skipped;
}

// The shapes of one world, bf16 on both legs: DeepSeek's decode shape, tokens that differ per rank (0 included) with
// topk 9 and masked entries, topk 1, group-limited routing at an odd hidden, no tokens at all, and a hot expert past
// its capacity; each with the own rows staged (the default) and copied directly (own=direct). The tokens lists repeat
// over the ranks.
std::vector<std::vector<std::string>> bf16_rows(int world) {
  std::string const w = "world=" + std::to_string(world);
  std::vector<std::vector<std::string>> const shapes = {
      {w, "tokens=128", "hidden=7168", "topk=8", "experts=256", "capacity=80", "iters=3"},
      {w, "tokens=0,37,128,5", "hidden=2048", "topk=9", "experts=64", "mask=0.3", "iters=3"},
      {w, "routing=ring", "tokens=100,0,1,64", "hidden=4096", "topk=1", "experts=16", "iters=3"},
      {w, "routing=grouped", "tokens=64,48", "hidden=2880", "topk=6", "experts=64", "capacity=128", "iters=2"},
      {w, "tokens=0", "hidden=2048", "topk=4", "experts=64", "iters=2"},
      // past expert_capacity: the hot expert takes half the tokens, 8 slots; the own rows fill them first
      {w, "routing=hot", "tokens=64,40", "hidden=2048", "topk=4", "experts=64", "capacity=8", "iters=2"},
  };
  std::vector<std::vector<std::string>> rows;
  for (char const* own : {"own=landing", "own=direct"})
    for (auto row : shapes) {
      row.push_back(own);
      rows.push_back(std::move(row));
    }
  return rows;
}

TEST(LowLatencyVirtualRanks, Bf16World2) {
  run_rows(bf16_rows(2));
}

TEST(LowLatencyVirtualRanks, Bf16World4) {
  run_rows(bf16_rows(4));
}

TEST(LowLatencyVirtualRanks, Bf16World8) {
  run_rows(bf16_rows(8));
}

// fp8 dispatch delivered quantized (payload + scale tensors, padding zero), with fp8 and bf16 combines.
TEST(LowLatencyVirtualRanks, Fp8QuantizedDelivery) {
  std::vector<std::vector<std::string>> table;
  for (int world : {2, 4, 8}) {
    std::string const w = "world=" + std::to_string(world);
    table.push_back({w, "dispatch=fp8", "combine=fp8", "layout=row_major", "tokens=128", "hidden=7168", "topk=8",
                     "experts=256", "capacity=80", "iters=2"});
    table.push_back({w, "dispatch=fp8", "combine=bf16", "layout=mn_major_tma", "tokens=37,64,0,5", "hidden=2944",
                     "topk=6", "experts=64", "mask=0.2", "iters=2"});
  }
  run_rows(table);
}

// nvfp4 and mxfp4 dispatch (the send quantizes a row in chunks; nvfp4's token scale is met over the chunks' warps of
// a CTA), delivered quantized: 8-byte nvfp4 payload units at hidden 2064, and at world 8 (16 CTAs a rank) more tokens
// than warps, so a CTA's warps take several steps of rows. nvfp4 combine (its token scale met the same way), with a
// CTA's steps of several rows and rows wider than a CTA's warps.
TEST(LowLatencyVirtualRanks, Fp4QuantizedDelivery) {
  std::vector<std::vector<std::string>> table;
  for (int world : {2, 8}) {
    std::string const w = "world=" + std::to_string(world);
    table.push_back({w, "dispatch=nvfp4", "combine=bf16", "layout=blocked_128x4", "tokens=128", "hidden=7168", "topk=8",
                     "experts=256", "capacity=80", "iters=2"});
    table.push_back({w, "dispatch=nvfp4", "combine=nvfp4", "layout=row_major", "tokens=300,17", "hidden=2064", "topk=4",
                     "experts=64", "iters=2"});
    table.push_back({w, "dispatch=mxfp4", "combine=bf16", "layout=mn_major_tma_packed_ue8m0", "tokens=300,0,64",
                     "hidden=2080", "topk=6", "experts=64", "mask=0.2", "iters=2"});
    // nvfp4 combine of rows wider than a CTA's warps have 1024-element chunks (17): a warp takes two chunks
    table.push_back({w, "combine=nvfp4", "tokens=40,24", "hidden=16512", "topk=4", "experts=64", "iters=2"});
  }
  run_rows(table);
}

// The hook path: every rank's send half of a leg, then every rank's receive half.
TEST(LowLatencyVirtualRanks, HookSplitsEachLeg) {
  std::vector<std::vector<std::string>> table;
  for (int world : {2, 4, 8})
    for (char const* own : {"own=landing", "own=direct"})
      table.push_back({"world=" + std::to_string(world), "hook=1", "tokens=128,96", "hidden=7168", "topk=8",
                       "experts=256", "capacity=80", "iters=3", own});
  run_rows(table);
}

}  // namespace
}  // namespace ferry::test
