// Low-latency mode with several ranks on ONE GPU ("virtual ranks", tests/support/virtual_ranks.hpp). An LL rank's
// kernels address their peers only through Buffers::sym (every rank's symmetric region) and their DeviceView, so W
// ranks fit on one device: a VirtualWorld's regions, error blocks and streams, and each rank's local buffers
// (allocate_buffers; across emulated nodes ll_nodes.hpp). The grids are launched non-cooperatively
// (Buffers::cooperative = false) with SMs / W CTAs each, so all W of them are co-resident (an LL CTA takes a whole SM).
//
// Each case draws fresh inputs every iteration (seed printed), poisons every output first, runs dispatch, the
// expert-major combine and the rank-major combine back to back on every rank, checks every rank's error block and
// compares every rank's outputs with the reference bit for bit (tests/support/ll_check.hpp): bf16 at worlds 2, 4 and
// 8 over a table of shapes, fp8, nvfp4 and mxfp4 with quantized delivery, the hook path (every send half, then every
// receive half), and, with one rank absent from a dispatch or a combine, that every other rank's wait ends in a
// timeout naming it. Needs one GPU; skips without one, and skips a world the GPU cannot hold one CTA per rank of.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "ep/cuda/buffers.hpp"
#include "ep/ep_impl.hpp"
#include "ep/reference.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "ferry/wire_format.hpp"
#include "support/gpu_case.hpp"
#include "support/ll_check.hpp"
#include "support/ll_nodes.hpp"
#include "support/virtual_ranks.hpp"
#include "workloads/routing.hpp"

namespace ferry::test {
namespace test_ll_virtual {  // named, not anonymous: FERRY_CI_BUILD compiles several files as one

using cuda_ep::Buffers;
using cuda_ep::Half;

struct Spec : VirtualSpec {
  int capacity = 0;  // capacity=: expert_capacity (0: ll's default, world * max_tokens)
  WireFormat dispatch_format = WireFormat::bf16;
  WireFormat combine_format = WireFormat::bf16;
  ScaleLayout layout = ScaleLayout::row_major;
  bool hook = false;        // hook=1: each leg as its send half, then its receive half
  bool own_direct = false;  // own=direct: bf16 own rows copied by the send half (FERRY_LL_OWN_ROWS=direct)
  // topology=NxM: N emulated nodes of M ranks (world N * M): the ranks of other nodes only through the emulated
  // network (seeded delays of up to delay_ns= per delivery, reordered), their NVLink windows taken away
  Topology topology{1, 0};
  uint32_t delay_ns = 20000;
  // route=forward|direct across nodes (forward: once per node to its rail, which places it and reduces the combine)
  InternodeRoute route = InternodeRoute::direct;
};

Spec parse_spec(std::vector<std::string> words) {
  // topology=NxM sets the world (before read_virtual checks absent= against it)
  for (std::string const& word : words)
    if (word.rfind("topology=", 0) == 0)
      words.push_back("world=" + std::to_string(parse_topology(word.substr(9)).world()));
  CaseArgs const args(words);
  Spec s;
  s.read_virtual(args);
  s.capacity = args.integer("capacity", s.capacity);
  s.dispatch_format = parse_wire_format(args.text("dispatch", "bf16"));
  s.combine_format = parse_wire_format(args.text("combine", "bf16"));
  s.layout = parse_scale_layout(args.text("layout", "row_major"));
  s.hook = args.flag("hook", s.hook);
  s.own_direct = args.text("own", "landing") == "direct";
  if (std::string const topology = args.text("topology", ""); !topology.empty()) {
    s.topology = parse_topology(topology);
  }
  s.delay_ns = static_cast<uint32_t>(args.integer("delay_ns", static_cast<int>(s.delay_ns)));
  s.route = parse_internode_route(args.text("route", "direct"));
  return s;
}

// `world` ranks of one LL EpBuffer on the current GPU: what CudaEp sets up per rank.
using VirtualLlRanks = VirtualRanks<Buffers, cuda_ep::allocate_buffers, cuda_ep::free_buffers>;

// Launches one leg on every rank (each on its own stream, side by side): whole, or every send half then every
// receive half.
template <typename Launch>
void launch_leg(VirtualLlRanks const& ranks, bool hook, Launch const& launch) {
  for (int r = 0; r < ranks.world(); ++r) launch(r, hook ? Half::send : Half::both);
  if (hook)
    for (int r = 0; r < ranks.world(); ++r) launch(r, Half::recv);
}

// The config a user would pass for `spec` (backend_config validates and resolves it).
EpConfig user_config(Spec const& spec) {
  EpConfig user = spec.config();
  user.mode = Mode::low_latency;
  user.dispatch_format = spec.dispatch_format;
  user.combine_format = spec.combine_format;
  user.recv_scale_layout = spec.layout;
  user.internode_route = spec.route;
  if (spec.capacity > 0) user.expert_capacity = spec.capacity;
  return user;
}

// Runs `spec` on spec.world virtual ranks of num_ctas CTAs each; fails the calling test at the first mismatch.
void run_virtual(Spec const& spec, int num_ctas) {
  int const world = spec.world;
  std::vector<int> const tokens = per_rank(spec.tokens, world);  // the lists repeat over the ranks
  EpConfig const config = backend_config(user_config(spec), world);
  int const hidden = config.hidden;
  int const slots = config.expert_slots();
  int const nodes = spec.topology.nodes;
  std::printf(
      "world %d (%s%s) x %d CTAs: seed %llu routing %s hidden %d topk %d (shared %d) experts %d slots %d dispatch %s "
      "combine %s layout %s hook %d graph %d\n",
      world, nodes > 1 ? topology_name(spec.topology).c_str() : "one node",
      nodes > 1 ? (std::string(", route ") + internode_route_name(config.route())).c_str() : "", num_ctas,
      static_cast<unsigned long long>(spec.seed), spec.routing.c_str(), hidden, config.topk, spec.shared,
      config.num_experts, slots, wire_format_name(config.dispatch_format), wire_format_name(config.combine_format),
      scale_layout_name(config.recv_scale_layout), spec.hook, spec.graph);
  std::fflush(stdout);

  cuda_ep::SymLayout const layout = cuda_ep::make_sym_layout(config, world, cuda_ep::Protocol::ll, nodes);
  VirtualLlRanks ranks(
      world, layout.total,
      [&](Buffers& b, int r, VirtualWorld const& vw) {
        cuda_ep::configure_buffers(b, config, world, r, cuda_ep::Protocol::ll, num_ctas);
        b.num_ctas = num_ctas;
        b.own_direct = spec.own_direct;
        b.layout = layout;
        set_emulated_nodes(b, spec.topology, spec.seed, r, spec.delay_ns, vw, layout.total);
      },
      spec.timeout_s());
  std::vector<VirtualRankIo> io;
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
    detail::validate_combine_args(config, em[r], true, true, tokens[r]);
    detail::validate_combine_args(config, rm[r], true, true, tokens[r]);
  }

  // graph=1: each rank's three legs captured once on its stream after iteration 0 has run them directly (a kernel's
  // first launch may load it, which a capture must not do), then replayed with fresh inputs in the same buffers
  RankGraphs graphs(world);
  auto const enqueue_legs = [&](int r) {
    for (Half half : spec.hook ? std::vector<Half>{Half::send, Half::recv} : std::vector<Half>{Half::both})
      cuda_ep::launch_ll_dispatch(ranks[r], dargs[r], half, ranks.stream(r));
    for (std::vector<CombineArgs> const* leg : {&em, &rm})
      for (Half half : spec.hook ? std::vector<Half>{Half::send, Half::recv} : std::vector<Half>{Half::both})
        cuda_ep::launch_ll_combine(ranks[r], (*leg)[r], tokens[r], half, ranks.stream(r));
  };

  for (int iter = 0; iter < spec.iters; ++iter) {
    // 1. every rank's inputs (fresh), the reference, and the combine inputs (deterministic in (seed, rank)); y poisoned
    VirtualIteration const it(config, world, spec.routing_options(iter), tokens, io);
    std::vector<int> dropped(world);  // entries past expert_capacity: each rank's error block must count exactly these
    for (int r = 0; r < world; ++r) {
      dropped[r] = it.expected[r].dropped_slots;
      // 2. poison what the dispatch writes
      poison_ll_dispatch(config, world, cuda_ep::dispatch_result(ranks[r], true), ranks[r].recv_slot);
    }
    CK(cudaDeviceSynchronize());
    if (spec.absent >= 0) {
      // rank `absent` skips the dispatch or the expert-major combine: every other rank's leg must time out naming it
      run_absent_rank(
          ranks, spec, dropped,
          [&](int skip) {
            launch_leg(ranks, spec.hook, [&](int r, Half half) {
              if (r != skip) cuda_ep::launch_ll_dispatch(ranks[r], dargs[r], half, ranks.stream(r));
            });
          },
          [&](int skip) {
            launch_leg(ranks, spec.hook, [&](int r, Half half) {
              if (r != skip) cuda_ep::launch_ll_combine(ranks[r], em[r], tokens[r], half, ranks.stream(r));
            });
          });
      return;
    }

    // 3. dispatch, expert-major combine, rank-major combine: each leg on every rank side by side, the legs back to
    //    back on each rank's stream (as a captured graph runs them); or every rank's graph of the three
    if (spec.graph && iter > 0) {
      if (!graphs.captured()) graphs.capture(ranks, enqueue_legs);
      graphs.launch(ranks);
    } else {
      launch_leg(ranks, spec.hook,
                 [&](int r, Half half) { cuda_ep::launch_ll_dispatch(ranks[r], dargs[r], half, ranks.stream(r)); });
      for (std::vector<CombineArgs> const* leg : {&em, &rm})
        launch_leg(ranks, spec.hook, [&](int r, Half half) {
          cuda_ep::launch_ll_combine(ranks[r], (*leg)[r], tokens[r], half, ranks.stream(r));
        });
    }
    std::string const failure = ranks.synchronize(dropped);
    ASSERT_TRUE(failure.empty()) << "iter " << iter << ":\n" << failure;

    // 4. every rank's outputs against the reference
    for (int r = 0; r < world; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r) + " iter " + std::to_string(iter));
      ASSERT_EQ(check_ll_dispatch(config, world, r, iter, it.expected[r], cuda_ep::dispatch_result(ranks[r], true),
                                  ranks[r].recv_slot),
                0);
      if (nodes > 1 && config.route() == InternodeRoute::forward)
        ASSERT_EQ(it.check_combines(config, spec.topology, r, iter, io[r]), 0);
      else
        ASSERT_EQ(it.check_combines(config, world, r, iter, io[r]), 0);
    }
  }
  std::printf("world %d%s: %d iterations exact on every rank\n", world,
              nodes > 1 ? (" (" + topology_name(spec.topology) + ")").c_str() : "", spec.iters);
}

// Runs each row (key=value words: CaseShape's, and world=, capacity=, dispatch=, combine=, layout=, hook=1) with a
// fresh seed (run_virtual_rows).
void run_rows(std::vector<std::vector<std::string>> const& table) {
  run_virtual_rows(table, cuda_ep::kMaxLlCtas, parse_spec, user_config, run_virtual);
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

// A rank that skips a call (stuck, crashed, or a caller's bug): every other rank's dispatch or combine (whole, or its
// receive half on the hook path) ends within its bound (1 s here) in a timeout naming that rank, at worlds 2, 4, 8.
TEST(LowLatencyVirtualRanks, AbsentRankIsNamedByEveryOther) {
  std::vector<std::vector<std::string>> table;
  for (int world : {2, 4, 8}) {
    std::string const w = "world=" + std::to_string(world);
    std::string const last = "absent=" + std::to_string(world - 1), middle = "absent=" + std::to_string(world / 2);
    table.push_back({w, last, "tokens=128", "hidden=7168", "topk=8", "experts=256", "capacity=80", "iters=1"});
    table.push_back({w, middle, "hook=1", "tokens=64,0", "hidden=2048", "topk=8", "experts=64", "iters=1"});
    table.push_back({w, middle, "absent_leg=combine", "dispatch=fp8", "combine=fp8", "tokens=96,5", "hidden=2048",
                     "topk=6", "experts=64", "iters=1"});
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

// Low-latency mode across nodes (the direct route: each row put straight into its rank, over NVLink on its node and
// through the emulated network to the others, delayed and reordered; ll_dispatch_send_network): every row of every
// rank against the one-node reference of N x M ranks, bit for bit. Topologies 2x1, 2x2, 2x4 and 4x2; 1, 4, 16, 128
// and 512 tokens; hidden 6144 and 7168; topk 8, and 9 with a shared expert pinned to the own rank.
TEST(LowLatencyAcrossNodes, Bf16Topologies) {
  std::vector<std::vector<std::string>> table;
  for (char const* topology : {"topology=2x1", "topology=2x2", "topology=2x4", "topology=4x2"}) {
    table.push_back({topology, "tokens=128", "hidden=7168", "topk=8", "experts=256", "capacity=80", "iters=2"});
    table.push_back({topology, "tokens=1,4,16,0", "hidden=6144", "topk=9", "shared=1", "experts=128", "iters=2"});
    table.push_back(
        {topology, "routing=grouped", "tokens=16,4", "hidden=7168", "topk=8", "experts=64", "iters=2", "own=direct"});
  }
  table.push_back({"topology=2x2", "tokens=512,300", "hidden=7168", "topk=9", "shared=1", "experts=256", "iters=1"});
  table.push_back({"topology=4x2", "tokens=512", "hidden=6144", "topk=8", "experts=64", "mask=0.2", "iters=1"});
  run_rows(table);
}

// Every wire format across nodes: fp8 (both scale kinds), nvfp4 and mxfp4 dispatch rows delivered quantized or
// dequantized, fp8 / nvfp4 / mxfp4 combine rows (the network leg puts a quantized row whole).
TEST(LowLatencyAcrossNodes, QuantizedTopologies) {
  std::vector<std::vector<std::string>> table;
  for (char const* topology : {"topology=2x2", "topology=4x2"}) {
    table.push_back({topology, "dispatch=fp8", "combine=fp8", "layout=mn_major_tma", "tokens=128,16", "hidden=7168",
                     "topk=8", "experts=256", "capacity=80", "iters=2"});
    table.push_back({topology, "dispatch=nvfp4", "combine=nvfp4", "layout=blocked_128x4", "tokens=64,1", "hidden=6144",
                     "topk=9", "shared=1", "experts=128", "iters=2"});
    table.push_back({topology, "dispatch=mxfp4", "combine=mxfp4", "layout=mn_major_tma_packed_ue8m0", "tokens=37,4",
                     "hidden=2080", "topk=6", "experts=64", "iters=2"});
  }
  table.push_back({"topology=2x4", "dispatch=fp8_ue8m0", "combine=bf16", "tokens=16,128", "hidden=7168", "topk=8",
                   "experts=256", "iters=2"});
  table.push_back({"topology=2x1", "dispatch=nvfp4", "combine=fp8", "tokens=512", "hidden=7168", "topk=8", "experts=64",
                   "iters=1"});
  run_rows(table);
}

// The hook across nodes (every rank's send half, then every receive half), and CUDA-graph replay of both ways.
TEST(LowLatencyAcrossNodes, HookAndGraphReplay) {
  std::vector<std::vector<std::string>> table;
  for (char const* topology : {"topology=2x1", "topology=2x4", "topology=4x2"}) {
    table.push_back({topology, "hook=1", "tokens=128,4", "hidden=7168", "topk=8", "experts=256", "iters=2"});
    table.push_back(
        {topology, "graph=1", "tokens=16,128", "hidden=6144", "topk=9", "shared=1", "experts=128", "iters=3"});
  }
  table.push_back({"topology=2x2", "hook=1", "graph=1", "dispatch=fp8", "combine=nvfp4", "tokens=64,1", "hidden=7168",
                   "topk=8", "experts=64", "iters=3"});
  run_rows(table);
}

// The forward route (a row once per node to its rail, which places it over NVLink; the combine reduced per node at
// the rail): the dispatch equals the one-node reference, the combines the reference of the topology.
TEST(LowLatencyAcrossNodes, ForwardRoute) {
  std::vector<std::vector<std::string>> table;
  for (char const* topology : {"topology=2x1", "topology=2x2", "topology=2x4", "topology=4x2"}) {
    table.push_back(
        {topology, "route=forward", "tokens=128", "hidden=7168", "topk=8", "experts=256", "capacity=80", "iters=2"});
    table.push_back({topology, "route=forward", "tokens=1,4,16,0", "hidden=6144", "topk=9", "shared=1", "experts=128",
                     "iters=2", "own=direct"});
  }
  for (char const* topology : {"topology=2x2", "topology=4x2"}) {
    table.push_back({topology, "route=forward", "dispatch=fp8", "combine=fp8", "layout=mn_major_tma", "tokens=128,16",
                     "hidden=7168", "topk=8", "experts=256", "iters=2"});
    table.push_back({topology, "route=forward", "dispatch=nvfp4", "combine=nvfp4", "layout=blocked_128x4",
                     "tokens=64,1", "hidden=6144", "topk=9", "shared=1", "experts=128", "iters=2"});
    table.push_back({topology, "route=forward", "dispatch=mxfp4", "combine=mxfp4", "tokens=37,4", "hidden=2080",
                     "topk=6", "experts=64", "iters=2"});
  }
  table.push_back(
      {"topology=2x4", "route=forward", "tokens=512,300", "hidden=7168", "topk=8", "experts=256", "iters=1"});
  table.push_back(
      {"topology=2x4", "route=forward", "hook=1", "tokens=128,4", "hidden=7168", "topk=8", "experts=256", "iters=2"});
  table.push_back({"topology=4x2", "route=forward", "graph=1", "hook=1", "dispatch=fp8", "combine=bf16",
                   "tokens=16,128", "hidden=6144", "topk=8", "experts=64", "iters=3"});
  run_rows(table);
}

// A rank that skips a call: every other rank, on its node and on the others (through the network's wait), ends in a
// timeout naming it.
TEST(LowLatencyAcrossNodes, AbsentRankIsNamedAcrossNodes) {
  run_rows({{"topology=2x2", "absent=3", "tokens=64", "hidden=2048", "topk=8", "experts=64", "iters=1"},
            {"topology=4x2", "absent=0", "hook=1", "absent_leg=combine", "tokens=16,4", "hidden=2048", "topk=8",
             "experts=64", "iters=1"}});
}

// Worlds past 32 ranks: low-latency mode across nodes addresses up to kMaxWorld (a token's destinations in
// ceil(world / 32) words, a thread per source in the waits, the node's windows by local index; ll/params.cuh "Wider
// worlds"). 8x8 and 16x4 (64 ranks, 2 CTAs each on 132 SMs), 3x12 (36: a node's ranks straddle two words of a
// destination mask), 64x2 (128 ranks, one CTA each); both routes, bf16 and quantized rows, the hook with graph
// replay; every row of every rank against the reference, bit for bit.
TEST(LowLatencyAcrossNodes, WorldsPast32) {
  std::vector<std::vector<std::string>> table;
  for (char const* route : {"route=direct", "route=forward"}) {
    table.push_back({"topology=8x8", route, "tokens=64,16,1,0", "hidden=2048", "topk=8", "experts=256", "iters=2"});
    // (9 experts a rank: random routing may put all 8 routed columns on the own rank, and the shared one needs a 9th)
    table.push_back({"topology=3x12", route, "tokens=32,5", "hidden=2048", "topk=9", "shared=1", "experts=324",
                     "iters=2", "own=direct"});
    table.push_back({"topology=64x2", route, "tokens=8,1,0", "hidden=1024", "topk=8", "experts=256", "iters=2"});
    // 128 ranks (16 nodes of 8, wide EP's decode shapes): one SM a virtual rank
    table.push_back({"topology=16x8", route, "tokens=8,1,0", "hidden=1024", "topk=8", "experts=256", "iters=2"});
  }
  table.push_back({"topology=16x8", "dispatch=fp8", "combine=bf16", "tokens=8", "hidden=1024", "topk=8",
                   "experts=256", "iters=2"});
  table.push_back({"topology=3x12", "routing=grouped", "tokens=24", "hidden=2048", "topk=8", "experts=144",
                   "capacity=24", "iters=2"});
  table.push_back({"topology=16x4", "dispatch=fp8", "combine=fp8", "layout=mn_major_tma", "tokens=32,8", "hidden=2048",
                   "topk=8", "experts=128", "iters=2"});
  table.push_back({"topology=16x4", "route=forward", "dispatch=nvfp4", "combine=nvfp4", "layout=blocked_128x4",
                   "tokens=16,3", "hidden=2048", "topk=8", "experts=128", "iters=2"});
  table.push_back(
      {"topology=8x8", "hook=1", "graph=1", "tokens=16,64", "hidden=2048", "topk=8", "experts=64", "iters=3"});
  run_rows(table);
}

// A rank past 32 that skips a call is named by every other rank (the error block keeps a bit per rank of kMaxWorld).
TEST(LowLatencyAcrossNodes, AbsentRankPast32IsNamed) {
  run_rows({{"topology=8x8", "absent=37", "tokens=16", "hidden=2048", "topk=8", "experts=64", "iters=1"},
            {"topology=8x8", "absent=63", "hook=1", "absent_leg=combine", "tokens=16,4", "hidden=2048", "topk=8",
             "experts=64", "iters=1"},
            {"topology=16x8", "absent=100", "tokens=8", "hidden=1024", "topk=8", "experts=256", "iters=1"}});
}

}  // namespace test_ll_virtual
}  // namespace ferry::test
