// Several EP ranks on ONE GPU ("virtual ranks"), for the tests of kernels that address their peers only through the
// symmetric regions and their DeviceView (normal mode: tests/gpu/test_normal_virtual.cu; low-latency mode:
// tests/gpu/test_ll_virtual.cu). VirtualWorld owns what a communicator would give each rank: a symmetric region
// (cudaMalloc, zeroed as the communicator's are, at the same address for every rank), an error block (mapped pinned
// memory) and a stream; each test adds its mode's per-rank buffers. The grids of the ranks run side by side and wait
// for each other inside the kernels as they do across GPUs: they are launched non-cooperatively with SMs / W CTAs
// each, so all W of them are co-resident, and every device wait is bounded (kVirtualTimeoutS), so a bug ends in a
// timeout recorded in a rank's error block, never a hang. Included by .cu tests only.
#pragma once

#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/comm_impl.hpp"
#include "ep/reference.hpp"
#include "ferry/device_view.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "support/gpu_case.hpp"
#include "support/ll_check.hpp"
#include "workloads/inputs.hpp"
#include "workloads/routing.hpp"

namespace ferry::test {

// Bound of every device wait of a virtual rank.
inline constexpr double kVirtualTimeoutS = 10.0;
// Elements behind each y that must stay poisoned.
inline constexpr std::size_t kVirtualGuardElems = 2048;

// Bound of every device wait in the absent-rank cases: short, so each case waits about this long.
inline constexpr double kAbsentTimeoutS = 1.0;

// What a virtual-rank case row holds besides its shape: world= (the virtual ranks), absent=k (rank k skips one call:
// the others must time out naming it) and absent_leg=dispatch|combine (the call it skips).
struct VirtualSpec : CaseShape {
  int world = 2;
  int absent = -1;
  std::string absent_leg = "dispatch";

  void read_virtual(CaseArgs const& args) {
    read(args);
    world = args.integer("world", world);
    absent = args.integer("absent", absent);
    absent_leg = args.text("absent_leg", absent_leg);
    FERRY_CHECK(absent < world, "absent=", absent, " is not a rank of world ", world);
    FERRY_CHECK(absent_leg == "dispatch" || absent_leg == "combine", "absent_leg=", absent_leg,
                ": use dispatch or combine");
  }
  // the bound of the ranks' device waits: short when one rank is meant to be absent
  double timeout_s() const { return absent >= 0 ? kAbsentTimeoutS : kVirtualTimeoutS; }
};

// CTAs per rank such that the grids of `world` ranks are co-resident on the current GPU (a persistent CTA takes a
// whole SM), at most max_ctas. 0 when the GPU has fewer SMs than ranks.
inline int virtual_ctas_per_rank(int world, int max_ctas) {
  int device = 0;
  int num_sms = 0;
  CK(cudaGetDevice(&device));
  CK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  return std::min(max_ctas, num_sms / world);
}

class VirtualWorld {
 public:
  // timeout_s: the bound of every device wait of these ranks (the kernels' DeviceView::timeout_ns)
  VirtualWorld(int world, std::size_t region_bytes, double timeout_s = kVirtualTimeoutS)
      : timeout_s_(timeout_s), regions_(world, nullptr), errors_(world, nullptr), streams_(world, nullptr) {
    try {
      for (int r = 0; r < world; ++r) {
        CK(cudaMalloc(&regions_[r], region_bytes));
        // counters and sequence numbers start at 0, as in the communicator's zeroed region
        CK(cudaMemset(regions_[r], 0, region_bytes));
        CK(cudaHostAlloc(reinterpret_cast<void**>(&errors_[r]), sizeof(DeviceErrorBlock), cudaHostAllocMapped));
        std::memset(errors_[r], 0, sizeof(DeviceErrorBlock));
        CK(cudaStreamCreateWithFlags(&streams_[r], cudaStreamNonBlocking));
      }
    } catch (...) {
      release();
      throw;
    }
  }
  ~VirtualWorld() { release(); }
  VirtualWorld(VirtualWorld const&) = delete;
  VirtualWorld& operator=(VirtualWorld const&) = delete;

  int world() const { return static_cast<int>(regions_.size()); }
  double timeout_s() const { return timeout_s_; }
  cudaStream_t stream(int r) const { return streams_[r]; }
  // The symmetric regions of the load/store team [first, first + size) (default: every rank, the team of one GPU), as
  // a communicator's SymmetricView gives them. A world past kMaxLsaTeam has teams of emulated nodes (ll_nodes.hpp).
  SymmetricView sym(std::size_t bytes, int first = 0, int size = -1) const {
    if (size < 0) size = world();
    FERRY_CHECK(first >= 0 && size >= 1 && size <= kMaxLsaTeam && first + size <= world(), "a team [", first, ", ",
                first + size, ") of world ", world(), " (at most ", kMaxLsaTeam, " ranks)");
    SymmetricView view{};
    for (int i = 0; i < size; ++i) view.ptr[i] = static_cast<char*>(regions_[first + i]);
    view.bytes = bytes;
    view.lsa_first = first;
    view.lsa_size = size;
    return view;
  }
  // Rank r's region (what an emulated network between nodes reaches, whatever the teams).
  char* region(int r) const { return static_cast<char*>(regions_[r]); }
  // Rank r's DeviceView: its rank, the world, the wait bound and its error block (the signal area is unused).
  DeviceView view(int r) const {
    DeviceView v{};
    v.rank = r;
    v.world = world();
    v.timeout_ns = static_cast<uint64_t>(timeout_s_ * 1e9);
    CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&v.error), errors_[r], 0));
    return v;
  }

  // Waits for every rank's stream, then reads and clears every rank's error block: "" when each rank recorded no
  // timeout, no bad id, no peer's refusal and exactly overflow[r] entries dropped past expert_capacity (low-latency
  // mode: the reference's dropped_slots of rank r, which only r records), else what each rank recorded (a timeout
  // names the rank, the peer it waited for and the phase). first_rank >= -1: every rank that records a drop also names
  // the rank whose capacity it exceeded, first_rank (normal mode: the call's drops, on every rank).
  std::string synchronize(std::vector<int> const& overflow, int first_rank = -2) const {
    std::vector<DeviceErrorBlock> const blocks = take_errors();
    std::string out;
    for (int r = 0; r < world(); ++r) {
      DeviceErrorBlock const& block = blocks[r];
      if (block.status != 0)
        out += "rank " + std::to_string(r) + ": status " + std::to_string(block.status) + ": " +
               detail::describe_device_error(block, timeout_s_) + "\n";
      if (block.input_errors != 0 || block.overflow_rows != static_cast<uint32_t>(overflow[r]))
        out += "rank " + std::to_string(r) + ": input_errors " + std::to_string(block.input_errors) +
               " (first bad value " + std::to_string(block.first_bad_value) + "), overflow_rows " +
               std::to_string(block.overflow_rows) + " (the reference drops " + std::to_string(overflow[r]) + ")\n";
      if (first_rank >= -1 && block.overflow_rows != 0 && block.overflow_rank != static_cast<uint32_t>(first_rank + 1))
        out += "rank " + std::to_string(r) + ": overflow_rank " + std::to_string(block.overflow_rank) +
               " (the reference's first rank that dropped, + 1: " + std::to_string(first_rank + 1) + ")\n";
      if (block.refusals != 0)
        out += "rank " + std::to_string(r) + ": " + std::to_string(block.refusals) + " refusal(s), the first by rank " +
               std::to_string(block.refusing_rank) + "\n";
    }
    return out;
  }

  // After normal-mode calls that may drop (recv_capacity, expert_capacity): every rank records the calls' drops, the
  // same rows and the same first rank on each (ref::call_drops; over several calls, their sum and the lowest rank).
  std::string synchronize(ref::CallDrops const& drops) const {
    return synchronize(std::vector<int>(static_cast<std::size_t>(world()), static_cast<int>(drops.rows)),
                       drops.first_rank);
  }

  // Waits for every rank's stream, then reads and clears every rank's error block.
  std::vector<DeviceErrorBlock> take_errors() const {
    for (cudaStream_t stream : streams_) CK(cudaStreamSynchronize(stream));
    std::vector<DeviceErrorBlock> blocks(world());
    for (int r = 0; r < world(); ++r) {
      std::memcpy(&blocks[r], errors_[r], sizeof(DeviceErrorBlock));
      std::memset(errors_[r], 0, sizeof(DeviceErrorBlock));
    }
    return blocks;
  }

 private:
  void release() noexcept {
    cudaDeviceSynchronize();  // NOTE: never throws; a failed teardown has no one to report to
    for (void* region : regions_)
      if (region) cudaFree(region);
    for (DeviceErrorBlock* block : errors_)
      if (block) cudaFreeHost(block);
    for (cudaStream_t stream : streams_)
      if (stream) cudaStreamDestroy(stream);
  }

  double timeout_s_;
  std::vector<void*> regions_;
  std::vector<DeviceErrorBlock*> errors_;  // host addresses (the kernels get the mapped device addresses)
  std::vector<cudaStream_t> streams_;
};

// `world` ranks of one EpBuffer on the current GPU: each rank's local buffers (Buffers: cuda_ep::Buffers, every
// protocol's, allocated by kAllocate, freed by kFree) on a VirtualWorld of region_bytes a rank. setup(b, r), or
// setup(b, r, virtual_world), sets rank r's own fields (config, shape, grid, layout); the rank's DeviceView and
// symmetric regions come from the VirtualWorld (device waits bounded by timeout_s; the team of every rank up to
// kMaxLsaTeam ranks, else the setup sets it), and its grids launch non-cooperatively (side by side: co-resident by
// their size, not by the runtime's promise).
template <typename Buffers, void (*kAllocate)(Buffers&), void (*kFree)(Buffers&) noexcept>
class VirtualRanks {
 public:
  template <typename Setup>
  VirtualRanks(int world, std::size_t region_bytes, Setup const& setup, double timeout_s = kVirtualTimeoutS)
      : world_(world, region_bytes, timeout_s), ranks_(world) {
    try {
      for (int r = 0; r < world; ++r) {
        Buffers& b = ranks_[r];
        b.view = world_.view(r);
        if (world <= kMaxLsaTeam) b.sym = world_.sym(region_bytes);
        if constexpr (std::is_invocable_v<Setup const&, Buffers&, int, VirtualWorld const&>)
          setup(b, r, world_);
        else
          setup(b, r);
        b.cooperative = false;
        kAllocate(b);
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

  int world() const { return world_.world(); }
  Buffers const& operator[](int r) const { return ranks_[r]; }
  cudaStream_t stream(int r) const { return world_.stream(r); }
  std::string synchronize(std::vector<int> const& overflow) const { return world_.synchronize(overflow); }
  std::string synchronize(ref::CallDrops const& drops) const { return world_.synchronize(drops); }
  std::vector<DeviceErrorBlock> take_errors() const { return world_.take_errors(); }
  double timeout_s() const { return world_.timeout_s(); }

 private:
  void release() noexcept {
    cudaDeviceSynchronize();  // NOTE: never throws; a failed teardown has no one to report to
    for (Buffers& b : ranks_) kFree(b);
  }

  VirtualWorld world_;
  std::vector<Buffers> ranks_;
};

// One CUDA graph per rank (graph=1 cases): capture(ranks, enqueue) records enqueue(r) on each rank's stream once
// (after the kernels have run directly: a kernel's first launch may load it, which a capture must not do), launch()
// replays every rank's graph on its stream; the graphs go with the object.
class RankGraphs {
 public:
  explicit RankGraphs(int world) : execs_(static_cast<std::size_t>(world), nullptr) {}
  ~RankGraphs() {
    for (cudaGraphExec_t exec : execs_)
      if (exec != nullptr) cudaGraphExecDestroy(exec);
  }
  RankGraphs(RankGraphs const&) = delete;
  RankGraphs& operator=(RankGraphs const&) = delete;

  bool captured() const { return execs_[0] != nullptr; }
  template <typename Ranks, typename Enqueue>
  void capture(Ranks const& ranks, Enqueue const& enqueue) {
    for (int r = 0; r < ranks.world(); ++r) {
      cudaGraph_t graph = nullptr;
      CK(cudaStreamBeginCapture(ranks.stream(r), cudaStreamCaptureModeThreadLocal));
      enqueue(r);
      CK(cudaStreamEndCapture(ranks.stream(r), &graph));
      CK(cudaGraphInstantiate(&execs_[static_cast<std::size_t>(r)], graph, 0));
      CK(cudaGraphDestroy(graph));
    }
  }
  template <typename Ranks>
  void launch(Ranks const& ranks) const {
    for (int r = 0; r < ranks.world(); ++r) CK(cudaGraphLaunch(execs_[static_cast<std::size_t>(r)], ranks.stream(r)));
  }

 private:
  std::vector<cudaGraphExec_t> execs_;
};

// One rank's inputs and combine outputs in device memory, at fixed addresses.
struct VirtualRankIo {
  DeviceBuffer x, idx, w;   // dispatch inputs
  DeviceBuffer rows;        // rank-major combine input [recv_capacity, hidden]
  DeviceBuffer eout;        // expert-major combine input [num_local_experts, expert_slots, hidden]
  DeviceBuffer y_em, y_rm;  // [num_tokens, hidden] + kVirtualGuardElems
  VirtualRankIo(EpConfig const& config, int world, int num_tokens)
      : x(row_bytes(config) * num_tokens),
        idx(static_cast<std::size_t>(num_tokens) * config.topk * 8),
        w(static_cast<std::size_t>(num_tokens) * config.topk * 4),
        rows(row_bytes(config) * config.recv_capacity(world)),
        eout(row_bytes(config) * config.num_local_experts(world) * config.expert_slots()),
        y_em(row_bytes(config) * num_tokens + kVirtualGuardElems * 2),
        y_rm(row_bytes(config) * num_tokens + kVirtualGuardElems * 2) {}
  static std::size_t row_bytes(EpConfig const& config) { return static_cast<std::size_t>(config.hidden) * 2; }
};

template <typename T>
void upload(DeviceBuffer const& dst, std::vector<T> const& src) {
  if (!src.empty()) CK(cudaMemcpy(dst.ptr, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice));
}

// The end of a leg that every rank but `absent` launched (`absent` stuck, crashed or skipped the call): waits for the
// ranks, then expects each of them to have recorded a timeout naming `absent` as the rank that did not arrive, within
// a few bounds (a wait that did not end, or a rank that named another, fails the calling test), and `absent` nothing.
template <typename Ranks>
void expect_absent_rank_named(Ranks const& ranks, int absent) {
  auto const start = std::chrono::steady_clock::now();
  std::vector<DeviceErrorBlock> const blocks = ranks.take_errors();
  double const waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(waited, 10 * ranks.timeout_s()) << "the waits of the other ranks did not end within their bound";
  for (int r = 0; r < ranks.world(); ++r) {
    DeviceErrorBlock const& block = blocks[r];
    std::string const said = detail::describe_device_error(block, ranks.timeout_s());
    if (r == absent) {
      EXPECT_EQ(block.status, 0u) << "rank " << r << " launched nothing, yet recorded: " << said;
      continue;
    }
    EXPECT_NE(block.status, 0u) << "rank " << r << " recorded no timeout without rank " << absent;
    EXPECT_EQ(block.rank, r) << said;
    EXPECT_EQ(block.peer, absent) << "rank " << r << " named another rank: " << said;
    EXPECT_NE(said.find("waiting for rank " + std::to_string(absent)), std::string::npos) << said;
  }
  int const first_other = absent == 0 ? 1 : 0;
  std::printf("rank %d absent: the %d others timed out naming it in %.2f s (bound %.1f s); rank %d said: %s\n", absent,
              ranks.world() - 1, waited, ranks.timeout_s(), first_other,
              detail::describe_device_error(blocks[first_other], ranks.timeout_s()).c_str());
}

// An absent-rank row (spec.absent >= 0): rank `absent` skips the dispatch, or (absent_leg=combine) every rank
// dispatches, which must end clean (each rank's error block counting exactly `overflow` dropped entries), and rank
// `absent` skips the combine; then every other rank must name it (expect_absent_rank_named). dispatch(skip) and
// combine(skip) launch their leg on every rank but `skip` (-1: none).
template <typename Ranks, typename Dispatch, typename Combine>
void run_absent_rank(Ranks const& ranks, VirtualSpec const& spec, std::vector<int> const& overflow,
                     Dispatch const& dispatch, Combine const& combine) {
  if (spec.absent_leg == "dispatch") {
    dispatch(spec.absent);
  } else {
    dispatch(-1);
    std::string const failure = ranks.synchronize(overflow);
    ASSERT_TRUE(failure.empty()) << "the dispatch before the skipped combine:\n" << failure;
    combine(spec.absent);
  }
  expect_absent_rank_named(ranks, spec.absent);
}

// fn(r) for every rank r of world, on up to one thread per core: the host side of an iteration, where each rank's
// reference and inputs depend on the shared inputs only, and generating every rank's expert-major combine inputs is
// most of a large row's host time. The first exception is rethrown here.
template <typename Fn>
void for_each_rank_parallel(int world, Fn&& fn) {
  int const threads = std::min(world, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  if (threads <= 1) {
    for (int r = 0; r < world; ++r) fn(r);
    return;
  }
  std::atomic<int> next{0};
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(threads));
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i)
    pool.emplace_back([&, i] {
      try {
        for (int r = next++; r < world; r = next++) fn(r);
      } catch (...) {
        errors[static_cast<std::size_t>(i)] = std::current_exception();
      }
    });
  for (std::thread& thread : pool) thread.join();
  for (std::exception_ptr const& error : errors)
    if (error) std::rethrow_exception(error);
}

// One iteration of a virtual-rank case: every rank's inputs (fresh, from `routing`), the reference dispatch of each,
// and the combine inputs (deterministic in (seed, rank)), uploaded into io; the y buffers poisoned.
struct VirtualIteration {
  std::vector<ref::RankInput> inputs;
  std::vector<ref::RankDispatch> expected;
  std::vector<std::vector<uint16_t>> rows, eout;  // rank-major and expert-major combine inputs

  VirtualIteration(EpConfig const& config, int world, RoutingOptions const& routing, std::vector<int> const& tokens,
                   std::vector<VirtualRankIo> const& io)
      : inputs(ref::generate_inputs(config, world, routing, tokens)), expected(world), rows(world), eout(world) {
    int const hidden = config.hidden;
    int const expert_rows = config.num_local_experts(world) * config.expert_slots();
    for_each_rank_parallel(world, [&](int r) {
      expected[r] = ref::dispatch(config, world, r, inputs);
      rows[r] = generate_tokens(routing.seed + 101, r, expected[r].num_recv, hidden);
      eout[r] = generate_tokens(routing.seed + 202, r, expert_rows, hidden);
    });
    for (int r = 0; r < world; ++r) {
      upload(io[r].x, inputs[r].x);
      upload(io[r].idx, inputs[r].topk_idx);
      upload(io[r].w, inputs[r].topk_weights);
      upload(io[r].rows, rows[r]);
      upload(io[r].eout, eout[r]);
      CK(cudaMemset(io[r].y_em.ptr, 0xEE, io[r].y_em.bytes));
      CK(cudaMemset(io[r].y_rm.ptr, 0xEE, io[r].y_rm.bytes));
    }
  }

  // Rank r's two combine outputs against the reference, the guards behind them still poisoned: 0, or fail()'s code.
  int check_combines(EpConfig const& config, int world, int r, int iter, VirtualRankIo const& io) const {
    auto const y_em = ref::combine_expert_major(config, world, r, inputs, expected, eout);
    if (int const code = check_combined("y expert-major", io.y_em.ptr, y_em, kVirtualGuardElems, r, iter)) return code;
    auto const y_rm = ref::combine_rank_major(config, world, r, inputs, expected, rows);
    return check_combined("y rank-major", io.y_rm.ptr, y_rm, kVirtualGuardElems, r, iter);
  }
  // ...against the reference of a topology of several nodes (each other node's rows reduced there first)
  int check_combines(EpConfig const& config, Topology const& topology, int r, int iter, VirtualRankIo const& io) const {
    auto const y_em = ref::combine_expert_major(config, topology, r, inputs, expected, eout);
    if (int const code = check_combined("y expert-major", io.y_em.ptr, y_em, kVirtualGuardElems, r, iter)) return code;
    auto const y_rm = ref::combine_rank_major(config, topology, r, inputs, expected, rows);
    return check_combined("y rank-major", io.y_rm.ptr, y_rm, kVirtualGuardElems, r, iter);
  }
};

// The config a real EpBuffer would give its backend (ep_buffer.cpp): `user` validated, then resolved for the world.
inline EpConfig backend_config(EpConfig user, int world) {
  user.validate(world);
  return user.resolved(world);
}

// What the host can tell of a row before a GPU runs it: its config passes EpBuffer's validation, and its routing is
// one the generator can draw for that config and world (what ref::generate_inputs checks). Throws ConfigError
// otherwise. run_virtual_rows makes this check on every row, also where there is no GPU (CI), so that a row which
// asks for the impossible fails there instead of on the first device run.
inline void check_row(EpConfig const& user, int world, CaseShape const& shape) {
  EpConfig const config = backend_config(user, world);
  int const routed_topk = config.topk - shape.shared;
  FERRY_CHECK(routed_topk >= 1, "topk=", config.topk, " leaves no routed column beside shared=", shape.shared);
  validate_routing(shape.routing_options(0), config.num_experts, world, routed_topk);
}

// Runs each row of `table` (key=value words) with a fresh seed: parse(words) gives the row's spec (its `world` the
// virtual ranks), user_config(spec) the config a user would pass for it (checked with check_row), run(spec, ctas) runs
// it on ctas CTAs per rank (at most max_ctas) and fails the calling test at its first mismatch. Every row is parsed and
// checked first, with or without a GPU; then the test skips without a GPU, and a row whose world the GPU cannot hold is
// skipped with the reason (the test too, when no row ran).
template <typename Parse, typename UserConfig, typename Run>
void run_virtual_rows(std::vector<std::vector<std::string>> const& table, int max_ctas, Parse const& parse,
                      UserConfig const& user_config, Run const& run) {
  // FERRY_TEST_ROWS="w1 w2 ...": only the rows holding every one of these words (a short device call reruns a few)
  std::vector<std::string> wanted;
  if (char const* text = std::getenv("FERRY_TEST_ROWS")) {
    std::istringstream words(text);
    for (std::string word; words >> word;) wanted.push_back(word);
  }
  using Spec = decltype(parse(std::vector<std::string>{}));
  std::vector<std::pair<std::string, Spec>> picked;  // (label, spec)
  bool bad_row = false;
  for (auto const& row : table) {
    std::string label;
    for (auto const& word : row) label += word + " ";
    if (!std::all_of(wanted.begin(), wanted.end(),
                     [&](std::string const& word) { return std::find(row.begin(), row.end(), word) != row.end(); })) {
      std::printf("not picked by FERRY_TEST_ROWS: %s\n", label.c_str());
      continue;
    }
    std::vector<std::string> words = row;
    uint64_t const seed = fresh_seed();
    words.push_back("seed=" + std::to_string(seed));
    try {
      Spec spec = parse(words);
      check_row(user_config(spec), spec.world, spec);
      picked.emplace_back(label + "seed=" + std::to_string(seed), std::move(spec));
    } catch (std::exception const& e) {
      ADD_FAILURE() << "row " << label << "is not one the host accepts: " << e.what();
      bad_row = true;
    }
  }
  if (bad_row) return;
  if (picked.empty()) GTEST_SKIP() << "no row holds every word of FERRY_TEST_ROWS";
  if (cuda_device_count() == 0)
    GTEST_SKIP() << "needs a GPU, found 0 (the " << picked.size() << " rows' configs and routing were checked here)";
  int ran = 0;
  std::string skipped;
  for (auto const& [label, spec] : picked) {
    int const ctas = virtual_ctas_per_rank(spec.world, max_ctas);
    if (ctas < 1) {
      std::printf("skipped %s: fewer SMs than the %d ranks, which need one co-resident CTA each at least\n",
                  label.c_str(), spec.world);
      skipped += label + "\n";
      continue;
    }
    SCOPED_TRACE(label);
    run(spec, ctas);
    if (::testing::Test::HasFatalFailure()) return;
    ++ran;
  }
  if (ran == 0) GTEST_SKIP() << "no row fits this GPU:\n" << skipped;
}

}  // namespace ferry::test
