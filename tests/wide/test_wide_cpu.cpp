// Wide EP on the cpu backend (the reference backend, docs/internode.md "How large a world can be"): emulated nodes of
// 8 ranks, ranks as threads, at 64 (8x8), 128 (16x8) and 256 (32x8) ranks, and 1024 (128x8) on request. Every row of
// dispatch (rank-major and expert-major) and of both combine layouts is compared bit for bit with ref:: in normal mode
// (hierarchical) and low-latency mode (both routes), in bf16 and every quantized format, and low-latency mode with
// ranks past 32 masked. With the rank sets of one 32-bit word these fail at the first rank past 31.
//
// Not part of `make test` (a world of 256 threads takes minutes on 2 cores): `make test-wide` runs them
// (build/tests/ferry_wide_tests). FERRY_WIDE_TOPOLOGIES picks the worlds (default "8x8,16x8,32x8"; the 1024-rank run
// of docs/internode.md is FERRY_WIDE_TOPOLOGIES=128x8). Every run prints its seed (FERRY_TEST_SEED replays one).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/rank_set.hpp"
#include "ep/reference.hpp"
#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "ferry/wire_format.hpp"
#include "support/cpu_ranks.hpp"
#include "support/host_fixtures.hpp"
#include "support/rank_case.hpp"
#include "workloads/inputs.hpp"
#include "workloads/routing.hpp"

namespace ferry {
namespace {

std::size_t at(int64_t row, int64_t width) {
  return static_cast<std::size_t>(row * width);
}

std::vector<std::string> topologies() {
  char const* env = std::getenv("FERRY_WIDE_TOPOLOGIES");
  std::stringstream list(env != nullptr && *env != '\0' ? env : "8x8,16x8,32x8");
  std::vector<std::string> out;
  for (std::string item; std::getline(list, item, ',');) out.push_back(item);
  return out;
}

// A leg's shape: small rows (every wire format's block divides 128), 4 tokens a rank, topk 4 of 2 experts a rank.
EpConfig wide_config(int world, Mode mode, WireFormat dispatch, WireFormat combine) {
  EpConfig config;
  config.mode = mode;
  config.hidden = 128;
  config.num_experts = 2 * world;
  config.topk = 4;
  config.max_tokens_per_rank = 4;
  config.dispatch_format = dispatch;
  config.combine_format = combine;
  config.dispatch_dequantize = dispatch != WireFormat::bf16;  // bf16 rows out, compared bit for bit with ref::
  if (mode == Mode::normal) config.expert_capacity = world * config.max_tokens_per_rank;
  return config.resolved(world);
}

std::vector<uint16_t> random_bf16(std::size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<uint16_t> out(n);
  for (auto& v : out) v = ref::float_to_bf16(dist(rng));
  return out;
}

template <typename T>
void require_same(int rank, char const* what, T const* got, T const* want, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    FERRY_CHECK(std::memcmp(got + i, want + i, sizeof(T)) == 0, "rank ", rank, ": ", what, " differs at element ", i,
                " of ", n);
}

// Every rank's inputs (random routing, a tenth of the entries -1), what ref:: delivers each rank, and the expert
// outputs combine takes. `masked`: ranks left out (ref::without_ranks gives what the others must return).
struct World {
  Topology topology;
  EpConfig config;
  std::vector<ref::RankInput> inputs;
  std::vector<ref::RankInput> effective;  // the inputs the ranks still in the calls see (masked ids -1)
  std::vector<ref::RankDispatch> received;
  std::vector<std::vector<uint16_t>> expert_out;
  std::vector<std::vector<uint16_t>> rank_rows;
};

World make_world(std::string const& topology, EpConfig const& config, uint64_t seed, std::vector<int> const& masked) {
  World w;
  w.topology = parse_topology(topology);
  w.config = config;
  int const world = w.topology.world();
  std::mt19937_64 rng(seed);
  RoutingOptions routing;
  routing.kind = RoutingKind::random;
  routing.seed = rng();
  routing.mask_rate = 0.1;
  std::vector<int> tokens(static_cast<std::size_t>(world), config.max_tokens_per_rank);
  tokens[static_cast<std::size_t>(rng() % static_cast<uint64_t>(world))] = 0;  // a rank without tokens
  w.inputs = ref::generate_inputs(config, world, routing, tokens);
  detail::RankSet left_out;
  for (int r : masked) left_out.set(r);
  w.effective = masked.empty() ? w.inputs : ref::without_ranks(config, world, w.inputs, left_out).inputs;
  std::size_t const expert_elems =
      at(static_cast<int64_t>(config.num_local_experts(world)) * config.expert_slots(), config.hidden);
  for (int d = 0; d < world; ++d) {
    w.received.push_back(ref::dispatch(config, world, d, w.effective));
    w.expert_out.push_back(random_bf16(expert_elems, rng));
    w.rank_rows.push_back(random_bf16(at(w.received.back().num_recv, config.hidden), rng));
  }
  return w;
}

// One rank's dispatch and combines against ref::. Low-latency mode: expert-major only (no recv_x); its combine is
// expert-major, weighted.
void check_rank(World const& w, EpBuffer& buffer, int r) {
  EpConfig const& config = w.config;
  int const hidden = config.hidden;
  std::size_t const R = static_cast<std::size_t>(r);
  bool const ll = config.mode == Mode::low_latency;
  ref::RankDispatch const& want = w.received[R];
  DispatchResult const got = buffer.dispatch(test::host_dispatch_args(w.inputs[R], true));
  FERRY_CHECK(got.num_recv_host == want.num_recv, "rank ", r, ": num_recv ", got.num_recv_host, ", want ",
              want.num_recv);
  int const n = want.num_recv;
  if (!ll) require_same(r, "recv_x", static_cast<uint16_t const*>(got.recv_x), want.recv_x.data(), at(n, hidden));
  require_same(r, "recv_topk_idx", got.recv_topk_idx, want.recv_topk_idx.data(), at(n, config.topk));
  require_same(r, "recv_topk_weights", got.recv_topk_weights, want.recv_topk_weights.data(), at(n, config.topk));
  require_same(r, "recv_src", got.recv_src, want.recv_src.data(), at(n, 2));
  require_same(r, "expert_counts", got.expert_counts, want.expert_counts.data(), want.expert_counts.size());
  std::vector<uint16_t> const slots = ref::expand(config, w.topology.world(), want);
  for (std::size_t e = 0; e < want.expert_counts.size(); ++e) {
    int const filled = std::min(want.expert_counts[e], want.expert_slots);
    std::size_t const first = at(static_cast<int64_t>(e) * want.expert_slots, hidden);
    require_same(r, "expert_x", static_cast<uint16_t const*>(got.expert_x) + first, slots.data() + first,
                 at(filled, hidden));
  }

  std::size_t const tokens = at(w.inputs[R].num_tokens, hidden);
  std::vector<uint16_t> y(tokens + 64, 0xffff);  // poisoned, with a guard past the end
  CombineArgs ca;
  ca.layout = CombineLayout::expert_major;
  ca.x = w.expert_out[R].data();
  ca.y = y.data();
  buffer.combine(ca);
  // the order of the sums: per node first (normal mode, and the low-latency forward route), else ranks ascending
  Topology const order = ll && config.route() == InternodeRoute::direct ? Topology{1, w.topology.world()} : w.topology;
  std::vector<uint16_t> const want_em =
      ref::combine_expert_major(config, order, r, w.effective, w.received, w.expert_out);
  require_same(r, "y (expert-major)", y.data(), want_em.data(), tokens);
  FERRY_CHECK(
      std::all_of(y.begin() + static_cast<std::ptrdiff_t>(tokens), y.end(), [](uint16_t v) { return v == 0xffff; }),
      "rank ", r, ": combine wrote past y");
  if (ll) return;
  // normal mode takes rank-major rows too (a dispatch first: combine refers to the last one)
  buffer.dispatch(test::host_dispatch_args(w.inputs[R], false));
  std::fill(y.begin(), y.end(), 0xffff);
  ca.layout = CombineLayout::rank_major;
  ca.x = w.rank_rows[R].data();
  buffer.combine(ca);
  std::vector<uint16_t> const want_rm =
      ref::combine_rank_major(config, w.topology, r, w.effective, w.received, w.rank_rows);
  require_same(r, "y (rank-major)", y.data(), want_rm.data(), tokens);
}

struct WideCase {
  Mode mode;
  WireFormat dispatch;
  WireFormat combine;
  InternodeRoute route = InternodeRoute::automatic;
};

// Runs fn(rank, communicator) on every rank of `topology` (threads, cpu backend) and expects no rank to fail.
void run_ranks(std::string const& topology, int world, uint64_t seed,
               std::function<void(int, std::shared_ptr<Communicator> const&)> const& fn) {
  CommunicatorOptions options;
  options.backend = Backend::cpu;
  options.topology = topology;
  std::vector<std::string> const failures = test::run_cpu_ranks(world, fn, options);
  for (std::size_t r = 0; r < failures.size(); ++r)
    EXPECT_EQ(failures[r], "") << "rank " << r << ", seed " << seed << ", topology " << topology;
}

void run_case(std::string const& topology, WideCase const& c) {
  uint64_t const seed = test::test_seed();
  Topology const topo = parse_topology(topology);
  int const world = topo.world();
  EpConfig config = wide_config(world, c.mode, c.dispatch, c.combine);
  config.internode_route = c.route;
  World const w = make_world(topology, config, seed, {});
  run_ranks(topology, world, seed, [&](int r, std::shared_ptr<Communicator> const& comm) {
    EpBuffer buffer(comm, config);
    check_rank(w, buffer, r);
  });
}

TEST(WideCpu, NormalModeEveryFormat) {
  for (std::string const& topology : topologies())
    for (WireFormat format : {WireFormat::bf16, WireFormat::fp8_e4m3, WireFormat::nvfp4, WireFormat::mxfp4}) {
      SCOPED_TRACE(topology + " " + wire_format_name(format));
      run_case(topology, {Mode::normal, format, format});
    }
}

TEST(WideCpu, LowLatencyBothRoutes) {
  for (std::string const& topology : topologies())
    for (InternodeRoute route : {InternodeRoute::forward, InternodeRoute::direct})
      for (WireFormat format : {WireFormat::bf16, WireFormat::fp8_e4m3_ue8m0}) {
        SCOPED_TRACE(topology + " " + internode_route_name(route) + " " + wire_format_name(format));
        run_case(topology, {Mode::low_latency, format, format, route});
      }
}

// Rank masking past 32 ranks: ranks 33 and world - 1 ask to be left out (mask_ranks); every other rank returns what
// ref:: gives without them, and both masked ranks learn that they are masked.
TEST(WideCpu, MaskingPastRank32) {
  for (std::string const& topology : topologies()) {
    SCOPED_TRACE(topology);
    uint64_t const seed = test::test_seed();
    Topology const topo = parse_topology(topology);
    int const world = topo.world();
    std::vector<int> const masked = {33, world - 1};
    EpConfig config = wide_config(world, Mode::low_latency, WireFormat::bf16, WireFormat::bf16);
    config.rank_masking = true;
    World const w = make_world(topology, config, seed, masked);
    run_ranks(topology, world, seed, [&](int r, std::shared_ptr<Communicator> const& comm) {
      EpBuffer buffer(comm, config);
      bool const out = std::find(masked.begin(), masked.end(), r) != masked.end();
      if (out) {
        buffer.mask_ranks({r});
        bool threw = false;
        try {
          buffer.dispatch(test::host_dispatch_args(w.inputs[static_cast<std::size_t>(r)], true));
        } catch (Error const&) {
          threw = true;
        }
        FERRY_CHECK(threw && buffer.mask_status().self, "rank ", r, " asked out but its dispatch went on");
        return;
      }
      check_rank(w, buffer, r);
      std::vector<int> const got = buffer.masked_ranks();
      FERRY_CHECK(got == masked, "rank ", r, ": masked ranks ", got.size(), ", want 33 and ", world - 1);
    });
  }
}

}  // namespace
}  // namespace ferry
