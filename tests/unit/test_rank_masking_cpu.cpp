// Rank masking (EpConfig::rank_masking, docs/internode.md "Rank masking") and the wait statistics on the cpu backend,
// low-latency mode, ranks as threads. A rank (or a whole node) skips calls on purpose, or is asked out with
// mask_ranks: the others finish the call within FERRY_TIMEOUT_S, report it masked, and every row they return equals
// the reference of the world without it (ref::without_ranks), at one node (2, 4, 8 ranks) and across nodes (2x2, 2x4,
// 4x2; both routes; and 5x8, a world past 32 whose rank 39 is asked out). The entries counted as masked equal what the
// routing gives; the masked rank's own calls throw until clear_mask, after which a call with every rank equals the full
// reference again. Without masking a skipped call still fails naming the rank.
//
// Each check was seen to fail once, each mutation of src/ep/cpu/cpu_ep.cpp reverted after: offsets that count a
// masked source's stale count row (recv_topk_idx differs); no alternate rail for a masked one (rows differ);
// masked_entries or the combine's entries left 0 (the counts); waiting for every rank, masked ones too (call 3 took
// 2 s); clear_mask that keeps the mask (ranks still masked); no timeout without masking (the default check); a
// masked rank that does not learn it (its own call passes); the statistics timed at two syncs (6 waits for 3 calls);
// masked destinations summed (y differs); the combine's last step failing the call (TimeoutError); mask_ranks
// requests not applied (TimeoutError at the next step).
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/rank_set.hpp"
#include "ep/reference.hpp"
#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "support/cpu_ranks.hpp"
#include "support/host_fixtures.hpp"
#include "support/rank_case.hpp"
#include "workloads/inputs.hpp"
#include "workloads/routing.hpp"

namespace ferry {
namespace {

using detail::concat;
using detail::RankSet;
using test::contains;

std::size_t at(int64_t row, int64_t width) {
  return static_cast<std::size_t>(row * width);
}

// Short waits keep the cases fast: a rank that skips a call costs its peers this long, once. Not shorter: the ranks
// are threads of one process, and on a loaded 2-core machine (CI, with a compile beside it) a present rank missed
// 0.5 s and was masked too.
constexpr char const* kTimeoutS = "2";
constexpr double kTimeout = 2.0;

enum class Skip { rank, node, last };  // rank 1, the last node, the last rank (past 32 in a world past 32)
enum class How { timeout, asked };     // the rank does not come, or mask_ranks asks it out

struct Case {
  char const* topology;
  InternodeRoute route = InternodeRoute::direct;
  Skip skip = Skip::rank;
  How how = How::timeout;
  bool hook = false;
};

std::string case_name(testing::TestParamInfo<Case> const& info) {
  Case const& c = info.param;
  std::string name = c.topology;
  std::replace(name.begin(), name.end(), 'x', '_');
  return concat(name, "_", internode_route_name(c.route),
                c.skip == Skip::node   ? "_node"
                : c.skip == Skip::last ? "_last"
                                       : "_rank",
                c.how == How::asked ? "_asked" : "_timeout", c.hook ? "_hook" : "");
}

// The ranks a case leaves out: rank 1 (a rail of node 0 across nodes, so another rank relays for it), or every
// rank of the last node.
RankSet skipped_ranks(Case const& c, Topology const& t) {
  if (c.skip == Skip::rank) return RankSet::range(1, 1);
  if (c.skip == Skip::last) return RankSet::range(t.world() - 1, 1);
  return RankSet::range((t.nodes - 1) * t.local, t.local);
}

EpConfig case_config(Case const& c, int world) {
  EpConfig config;
  config.mode = Mode::low_latency;
  config.hidden = 128;
  config.num_experts = 4 * world;
  config.topk = 4;
  config.max_tokens_per_rank = 8;
  config.internode_route = c.route;
  config.rank_masking = true;
  return config.resolved(world);
}

std::vector<uint16_t> random_bf16(std::size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<uint16_t> out(n);
  for (auto& v : out) v = ref::float_to_bf16(dist(rng));
  return out;
}

// One call's world: every rank's inputs and expert outputs, and the reference of the ranks that take part.
struct CallWorld {
  std::vector<ref::RankInput> inputs;  // what every rank passes
  ref::MaskedWorld kept;               // ...without the masked ranks
  std::vector<ref::RankDispatch> received;
  std::vector<std::vector<uint16_t>> expert_out;
};

CallWorld make_call(EpConfig const& config, int world, uint64_t seed, RankSet const& masked) {
  std::mt19937_64 rng(seed);
  RoutingOptions routing;
  routing.seed = rng();
  routing.mask_rate = 0.1;
  std::vector<int> tokens;
  for (int r = 0; r < world; ++r)
    tokens.push_back(1 + static_cast<int>(rng() % static_cast<uint64_t>(config.max_tokens_per_rank)));
  CallWorld w;
  w.inputs = ref::generate_inputs(config, world, routing, tokens);
  w.kept = ref::without_ranks(config, world, w.inputs, masked);
  std::size_t const expert_elems =
      at(static_cast<int64_t>(config.num_local_experts(world)) * config.expert_slots(), config.hidden);
  for (int d = 0; d < world; ++d) {
    w.received.push_back(ref::dispatch(config, world, d, w.kept.inputs));
    w.expert_out.push_back(random_bf16(expert_elems, rng));
  }
  return w;
}

template <typename T>
std::string differs(char const* what, T const* got, T const* want, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    if (std::memcmp(got + i, want + i, sizeof(T)) != 0) return concat(what, " differs at element ", i, " of ", n);
  return "";
}

// What differs between a low-latency dispatch's result and the reference ("" when nothing): the metadata of every
// received row, the expert counts, every filled slot and its source row.
std::string dispatch_problem(EpConfig const& config, int world, DispatchResult const& got,
                             ref::RankDispatch const& want) {
  int const hidden = config.hidden;
  if (got.num_recv_host != want.num_recv) return concat("num_recv ", got.num_recv_host, ", want ", want.num_recv);
  int const n = want.num_recv;
  std::string problem = differs("recv_topk_idx", got.recv_topk_idx, want.recv_topk_idx.data(), at(n, config.topk));
  if (problem.empty())
    problem = differs("recv_topk_weights", got.recv_topk_weights, want.recv_topk_weights.data(), at(n, config.topk));
  if (problem.empty()) problem = differs("recv_src", got.recv_src, want.recv_src.data(), at(n, 2));
  if (problem.empty())
    problem = differs("expert_counts", got.expert_counts, want.expert_counts.data(), want.expert_counts.size());
  std::vector<uint16_t> const slots = ref::expand(config, world, want);
  for (std::size_t e = 0; e < want.expert_counts.size() && problem.empty(); ++e) {
    std::size_t const first = at(static_cast<int64_t>(e) * want.expert_slots, hidden);
    int const filled = std::min(want.expert_counts[e], want.expert_slots);
    problem = differs("expert_x", static_cast<uint16_t const*>(got.expert_x) + first, slots.data() + first,
                      at(filled, hidden));
    if (problem.empty())
      problem = differs("expert_src_row", got.expert_src_row + at(static_cast<int64_t>(e), want.expert_slots),
                        want.expert_src_row.data() + at(static_cast<int64_t>(e), want.expert_slots),
                        static_cast<std::size_t>(filled));
  }
  return problem;
}

// A dispatch and an expert-major combine on rank r, every row checked against the reference of the ranks that take
// part: the metadata of every received row, every filled slot, y (poisoned before, with a guard row past its end),
// and the masked entries both legs report. `order`: the reference's summation order (forward: per node).
void run_and_check(EpBuffer& buffer, CallWorld const& w, int r, Topology const& order, bool hook, char const* call,
                   std::chrono::milliseconds before_combine = std::chrono::milliseconds(0)) {
  EpConfig const& config = buffer.config();
  int const world = order.world();
  int const hidden = config.hidden;
  std::size_t const R = static_cast<std::size_t>(r);
  ref::RankInput const& in = w.inputs[R];
  ref::RankDispatch const& want = w.received[R];
  DispatchArgs args = test::host_dispatch_args(in);
  args.return_recv_hook = hook;
  DispatchResult got = buffer.dispatch(args);
  if (hook) got = buffer.complete_dispatch();
  auto const fail = [&](std::string const& what) { FERRY_CHECK(what.empty(), "rank ", r, ", ", call, ": ", what); };
  fail(dispatch_problem(config, world, got, want));
  int64_t const masked = w.kept.masked_entries[R];
  fail(got.masked_entries == masked ? ""
                                    : concat("masked_entries ", got.masked_entries, ", the routing gives ", masked));

  std::vector<uint16_t> y(at(in.num_tokens + 1, hidden), 0xeeee);
  CombineArgs ca;
  ca.layout = CombineLayout::expert_major;
  ca.x = w.expert_out[R].data();
  ca.y = y.data();
  ca.return_recv_hook = hook;
  std::this_thread::sleep_for(before_combine);
  buffer.combine(ca);
  if (hook) buffer.complete_combine();
  std::vector<uint16_t> const want_y =
      ref::combine_expert_major(config, order, r, w.kept.inputs, w.received, w.expert_out);
  // the masked rank's tokens are the caller's own: a rank that takes part keeps all of its rows
  fail(want_y.size() == at(in.num_tokens, hidden) ? "" : "the reference has another token count");
  fail(differs("y", y.data(), want_y.data(), want_y.size()));
  fail(std::all_of(y.begin() + static_cast<std::ptrdiff_t>(want_y.size()), y.end(),
                   [](uint16_t v) { return v == 0xeeee; })
           ? ""
           : "combine wrote past y");
  MaskStatus const status = buffer.mask_status();
  fail(status.last_combine_entries == masked
           ? ""
           : concat("combine's masked entries ", status.last_combine_entries, ", the routing gives ", masked));
}

class RankMaskingCpu : public testing::TestWithParam<Case> {};

// Call 1 with every rank; call 2 without the skipped ranks (they do not come: their peers wait FERRY_TIMEOUT_S once;
// or rank 0 asks them out and they learn it at the call's exchange); call 3 without them again, with no wait at all;
// then the skipped ranks' own call throws, every rank clears the mask, and call 4 with every rank equals the full
// reference.
TEST_P(RankMaskingCpu, SkippedRanksAreMaskedAndTheOthersMatchTheReference) {
  Case const c = GetParam();
  test::ScopedEnv const timeout("FERRY_TIMEOUT_S", std::string(kTimeoutS));
  Topology const topology = parse_topology(c.topology);
  int const world = topology.world();
  EpConfig const config = case_config(c, world);
  RankSet const skipped = skipped_ranks(c, topology);
  uint64_t const seed = test::test_seed();
  // forward reduces per node; direct (and one node) sums the ranks as one node does
  Topology const order =
      topology.nodes > 1 && config.route() == InternodeRoute::forward ? topology : Topology{1, world};
  std::vector<CallWorld> calls;
  for (int call = 0; call < 4; ++call)
    calls.push_back(make_call(config, world, seed + 1000003ULL * call, call == 1 || call == 2 ? skipped : RankSet()));
  std::atomic<int> finished{0};  // ranks that took part and finished call 3
  int const survivors = world - skipped.count();
  CommunicatorOptions options;
  options.topology = c.topology;
  std::vector<std::string> const failures = test::run_cpu_ranks(
      world,
      [&](int r, std::shared_ptr<Communicator> const& comm) {
        EpBuffer buffer(comm, config);
        bool const out = skipped.test(r);
        run_and_check(buffer, calls[0], r, order, c.hook, "call 1 (every rank)");
        FERRY_CHECK(buffer.masked_ranks().empty(), "rank ", r, ": masked ranks before any was skipped");
        if (out) {
          if (c.how == How::asked) {
            // it comes, and learns at the exchange that it is out
            DispatchArgs none;
            std::string const problem = test::expect_error<Error>([&] { buffer.dispatch(none); }, {"is masked"});
            FERRY_CHECK(problem.empty(), "rank ", r, ": its call after mask_ranks: ", problem);
          }
          // bounded: a survivor that failed still counts itself (Finished below)
          auto const deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
          while (finished.load() < survivors) {
            FERRY_CHECK(std::chrono::steady_clock::now() < deadline, "rank ", r, ": the other ranks never finished");
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
          }
          // its next call: refused, naming the reason, at once or after reading its peers' verdicts
          std::string const problem = test::expect_error<Error>(
              [&] {
                DispatchArgs none;
                buffer.dispatch(none);
              },
              {"rank " + std::to_string(r) + " is masked", "clear_mask"});
          FERRY_CHECK(problem.empty(), "rank ", r, ": its own call while masked: ", problem);
          MaskStatus const status = buffer.mask_status();
          FERRY_CHECK(status.self, "rank ", r, ": mask_status().self is false after its peers masked it");
          FERRY_CHECK(std::find(status.ranks.begin(), status.ranks.end(), r) != status.ranks.end(), "rank ", r,
                      ": masked_ranks() leaves itself out");
        } else {
          struct Finished {  // counts this rank as done however its calls end, so a skipped rank never waits forever
            std::atomic<int>& count;
            ~Finished() { count.fetch_add(1); }
          } const done{finished};
          if (c.how == How::asked && r == 0) buffer.mask_ranks(skipped.ranks());
          auto const start = std::chrono::steady_clock::now();
          run_and_check(buffer, calls[1], r, order, c.hook, "call 2 (the skipped ranks masked)");
          double const first = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          FERRY_CHECK(buffer.masked_ranks() == skipped.ranks(), "rank ", r, ": masked_ranks() after call 2 is not ",
                      "the skipped ranks");
          // the others finish within the timeout: one wait for the absent ranks (none when asked), then none
          FERRY_CHECK(first < 6 * kTimeout, "rank ", r, ": call 2 took ", first, " s");
          auto const again = std::chrono::steady_clock::now();
          run_and_check(buffer, calls[2], r, order, !c.hook, "call 3 (masked again, no wait)");
          double const second = std::chrono::duration<double>(std::chrono::steady_clock::now() - again).count();
          FERRY_CHECK(second < kTimeout, "rank ", r, ": call 3 took ", second,
                      " s: it waited for a masked rank (FERRY_TIMEOUT_S=", kTimeoutS, ")");
          MaskStatus const status = buffer.mask_status();
          FERRY_CHECK(status.dispatch_entries == calls[1].kept.masked_entries[static_cast<std::size_t>(r)] +
                                                     calls[2].kept.masked_entries[static_cast<std::size_t>(r)],
                      "rank ", r, ": cumulative masked dispatch entries ", status.dispatch_entries);
          FERRY_CHECK(!status.self, "rank ", r, ": masked itself");
        }
        // every rank, masked or not: the mask goes, the counters meet again, and a call of every rank is whole
        buffer.clear_mask();
        FERRY_CHECK(buffer.masked_ranks().empty() && !buffer.mask_status().self, "rank ", r,
                    ": ranks still masked after clear_mask");
        run_and_check(buffer, calls[3], r, order, c.hook, "call 4 (after clear_mask)");
        FERRY_CHECK(buffer.mask_status().dispatch_entries == 0, "rank ", r, ": entries counted after clear_mask");
      },
      options);
  for (std::size_t r = 0; r < failures.size(); ++r)
    EXPECT_EQ(failures[r], "") << "rank " << r << ", seed " << seed << ", topology " << c.topology;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (char const* topology : {"1x2", "1x4", "1x8"}) {
    out.push_back({topology});
    out.push_back({topology, InternodeRoute::direct, Skip::rank, How::asked, true});
  }
  for (char const* topology : {"2x2", "2x4", "4x2"})
    for (InternodeRoute route : {InternodeRoute::forward, InternodeRoute::direct}) {
      out.push_back({topology, route, Skip::rank, How::timeout, false});
      out.push_back({topology, route, Skip::node, How::timeout, true});
      out.push_back({topology, route, Skip::rank, How::asked, true});
    }
  out.push_back({"2x4", InternodeRoute::forward, Skip::node, How::asked, false});
  // a world past 32 (5 nodes of 8) with rank 39 asked out: a 32-bit mask holds it as rank 7 (bit 39 % 32). With the
  // host's rank sets made 32-bit this case failed at its first call (rank 0: num_recv 22, want 15).
  out.push_back({"5x8", InternodeRoute::direct, Skip::last, How::asked, false});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Topologies, RankMaskingCpu, testing::ValuesIn(cases()), case_name);

// A rank present at the dispatch that skips the combine: the combine's exchange masks it, and y equals the
// reference without its rows (its expert outputs zero: 0.0f adds nothing to a sum that starts at +0.0f; its area
// still holds the rows of a full call before, which must not be read); the combine counts every entry of this rank's
// tokens on it. One node and the direct route (the forward route loses the node's rows behind a rail masked between
// the legs: docs/internode.md).
TEST(RankMaskingCpuLegs, RankSkippingTheCombineIsMaskedThere) {
  test::ScopedEnv const timeout("FERRY_TIMEOUT_S", std::string(kTimeoutS));
  for (char const* topology_name : {"1x4", "2x2"}) {
    Topology const topology = parse_topology(topology_name);
    int const world = topology.world();
    Case const c{topology_name, InternodeRoute::direct};
    EpConfig const config = case_config(c, world);
    uint64_t const seed = test::test_seed();
    CallWorld const before = make_call(config, world, seed + 5, RankSet());
    CallWorld w = make_call(config, world, seed, RankSet());
    int const gone = 2;
    std::vector<std::vector<uint16_t>> without = w.expert_out;
    std::fill(without[gone].begin(), without[gone].end(), uint16_t{0});
    int const num_local = config.num_local_experts(world);
    CommunicatorOptions options;
    options.topology = topology_name;
    std::vector<std::string> const failures = test::run_cpu_ranks(
        world,
        [&](int r, std::shared_ptr<Communicator> const& comm) {
          EpBuffer buffer(comm, config);
          Topology const one_node{1, world};
          run_and_check(buffer, before, r, one_node, false, "the full call before");
          ref::RankInput const& in = w.inputs[static_cast<std::size_t>(r)];
          DispatchArgs args = test::host_dispatch_args(in);
          buffer.dispatch(args);
          if (r == gone) return;  // no combine
          std::vector<uint16_t> y(at(in.num_tokens, config.hidden), 0xeeee);
          CombineArgs ca{CombineLayout::expert_major, w.expert_out[static_cast<std::size_t>(r)].data(), y.data()};
          buffer.combine(ca);
          std::vector<uint16_t> const want =
              ref::combine_expert_major(config, Topology{1, world}, r, w.inputs, w.received, without);
          std::string const diff = differs("y", y.data(), want.data(), want.size());
          FERRY_CHECK(diff.empty(), "rank ", r, ": ", diff);
          int64_t on_gone = 0;
          for (int64_t id : in.topk_idx) on_gone += id >= 0 && id / num_local == gone;
          MaskStatus const status = buffer.mask_status();
          FERRY_CHECK(status.ranks == std::vector<int>{gone}, "rank ", r, ": masked ranks after the combine");
          FERRY_CHECK(status.last_combine_entries == on_gone && status.last_dispatch_entries == 0, "rank ", r,
                      ": combine entries ", status.last_combine_entries, ", the routing gives ", on_gone);
        },
        options);
    for (std::size_t r = 0; r < failures.size(); ++r)
      EXPECT_EQ(failures[r], "") << "rank " << r << ", seed " << seed << ", topology " << topology_name;
  }
}

// A rank that sends its combine rows (the hook's send half) and never completes: the others' sums are whole (its rows
// were there), and the combine's last step masks it without failing the call; the next call skips it.
TEST(RankMaskingCpuLegs, RankLostAfterItsRowsLeavesTheCombineWhole) {
  test::ScopedEnv const timeout("FERRY_TIMEOUT_S", std::string(kTimeoutS));
  int const world = 4;
  Case const c{"1x4"};
  EpConfig const config = case_config(c, world);
  uint64_t const seed = test::test_seed();
  CallWorld const full = make_call(config, world, seed, RankSet());
  CallWorld const next = make_call(config, world, seed + 17, RankSet::range(3, 1));
  std::vector<std::string> const failures =
      test::run_cpu_ranks(world, [&](int r, std::shared_ptr<Communicator> const& comm) {
        EpBuffer buffer(comm, config);
        ref::RankInput const& in = full.inputs[static_cast<std::size_t>(r)];
        DispatchArgs args = test::host_dispatch_args(in);
        buffer.dispatch(args);
        std::vector<uint16_t> y(at(in.num_tokens, config.hidden), 0xeeee);
        CombineArgs ca{CombineLayout::expert_major, full.expert_out[static_cast<std::size_t>(r)].data(), y.data()};
        ca.return_recv_hook = true;
        buffer.combine(ca);
        if (r == 3) return;  // its receive half never runs
        buffer.complete_combine();
        std::vector<uint16_t> const want =
            ref::combine_expert_major(config, Topology{1, world}, r, full.inputs, full.received, full.expert_out);
        std::string const diff = differs("y", y.data(), want.data(), want.size());
        FERRY_CHECK(diff.empty(), "rank ", r, ": ", diff);
        FERRY_CHECK(buffer.masked_ranks() == std::vector<int>{3}, "rank ", r, ": rank 3 not masked");
        run_and_check(buffer, next, r, Topology{1, world}, false, "the call after");
      });
  for (std::size_t r = 0; r < failures.size(); ++r) EXPECT_EQ(failures[r], "") << "rank " << r << ", seed " << seed;
}

// The default is unchanged: without rank_masking a skipped call fails naming the rank (TimeoutError, the
// communicator failed), through the communicator's barrier, and through this buffer's own when only the wait
// statistics are on.
TEST(RankMaskingCpuDefault, ASkippedCallStillFailsNamingTheRank) {
  test::ScopedEnv const timeout("FERRY_TIMEOUT_S", std::string(kTimeoutS));
  for (bool stats : {false, true}) {
    std::vector<std::string> const failures =
        test::run_cpu_ranks(4, [&](int r, std::shared_ptr<Communicator> const& comm) {
          EpConfig config = case_config(Case{"1x4"}, 4);
          config.rank_masking = false;
          config.wait_stats = stats;
          EpBuffer buffer(comm, config);
          if (r == 2) return;  // never arrives
          try {
            buffer.dispatch(DispatchArgs{});
            FERRY_THROW(Error, "test", "rank ", r, ": dispatch passed without rank 2");
          } catch (TimeoutError const& error) {
            std::string const what = error.what();
            FERRY_CHECK(contains(what, concat("rank ", r, " timed out")) &&
                            (contains(what, "waiting for rank 2 ") || contains(what, "waiting for rank(s) 2 ")),
                        "rank ", r, " (wait_stats=", stats, "): the timeout does not name rank 2: ", what);
          }
          FERRY_CHECK(comm->failed(), "rank ", r, ": the communicator is usable after the timeout");
          FERRY_CHECK(buffer.masked_ranks().empty(), "rank ", r, ": ranks masked without masking");
        });
    for (std::size_t r = 0; r < failures.size(); ++r) EXPECT_EQ(failures[r], "") << "rank " << r << ", stats " << stats;
  }
}

// The rules, refused with what to do.
TEST(RankMaskingCpuConfig, RefusalsNameTheRule) {
  EpConfig normal;
  normal.rank_masking = true;
  EXPECT_NE(test::expect_error<ConfigError>([&] { normal.validate(4); }, {"rank_masking=true needs mode=ll"}),
            "no error")
      << "normal mode accepted rank_masking";
  normal.rank_masking = false;
  normal.wait_stats = true;
  EXPECT_EQ(test::expect_error<ConfigError>([&] { normal.validate(4); }, {"wait_stats=true needs mode=ll"}), "");
  normal.wait_stats = false;
  normal.rank_masking = true;
  EXPECT_EQ(test::expect_error<ConfigError>([&] { normal.validate(4); }, {"rank_masking=true needs mode=ll"}), "");
  std::vector<std::string> const failures = test::run_cpu_ranks(2, [](int r,
                                                                      std::shared_ptr<Communicator> const& comm) {
    EpConfig off = case_config(Case{"1x2"}, 2);
    off.rank_masking = false;
    EpBuffer plain(comm, off);
    FERRY_CHECK(test::expect_error<ConfigError>([&] { plain.mask_ranks({1}); }, {"rank_masking=true"}).empty(),
                "mask_ranks with masking off");
    FERRY_CHECK(test::expect_error<ConfigError>([&] { plain.clear_mask(); }, {"rank masking is off"}).empty(),
                "clear_mask with masking off");
    FERRY_CHECK(test::expect_error<ConfigError>([&] { plain.wait_stats(); }, {"wait_stats=true"}).empty(),
                "wait_stats with statistics off");
    FERRY_CHECK(!plain.mask_status().enabled && plain.masked_ranks().empty(), "mask_status with masking off");
    EpBuffer masked(comm, case_config(Case{"1x2"}, 2));
    FERRY_CHECK(test::expect_input_error([&] { masked.mask_ranks({2}); }, {"rank 2 is outside [0, world=2)"}).empty(),
                "rank ", r, ": mask_ranks out of range");
  });
  for (std::size_t r = 0; r < failures.size(); ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

// The wait statistics count one wait per source per call of each leg (with and without the hook), find a late
// source (it comes 60 ms late to the combine of one call: its waits there are the longest on every other rank), go
// back to zero with reset_wait_stats, with masking on and off.
TEST(WaitStatsCpu, OneWaitPerSourceAndCallAndALateSourceShows) {
  test::ScopedEnv const timeout("FERRY_TIMEOUT_S", std::string("5"));
  int const world = 4;
  int const late = 2;
  auto const sleep = std::chrono::milliseconds(60);
  uint64_t const seed = test::test_seed();
  for (bool masking : {false, true}) {
    EpConfig config = case_config(Case{"1x4"}, world);
    config.rank_masking = masking;
    config.wait_stats = true;
    CallWorld const w = make_call(config, world, seed, RankSet());
    std::vector<std::string> const failures =
        test::run_cpu_ranks(world, [&](int r, std::shared_ptr<Communicator> const& comm) {
          EpBuffer buffer(comm, config);
          int const calls = 3;
          for (int call = 0; call < calls; ++call)
            run_and_check(buffer, w, r, Topology{1, world}, call == 2, "a timed call",
                          r == late && call == 1 ? sleep : std::chrono::milliseconds(0));
          WaitStats const stats = buffer.wait_stats();
          FERRY_CHECK(
              stats.dispatch.size() == static_cast<std::size_t>(world) && stats.combine.size() == stats.dispatch.size(),
              "rank ", r, ": stats of ", stats.dispatch.size(), " sources");
          for (int s = 0; s < world; ++s) {
            PeerWaitStats const& d = stats.dispatch[static_cast<std::size_t>(s)];
            PeerWaitStats const& k = stats.combine[static_cast<std::size_t>(s)];
            FERRY_CHECK(d.waits == calls && k.waits == calls, "rank ", r, ", source ", s, ": ", d.waits,
                        " dispatch and ", k.waits, " combine waits for ", calls, " calls");
            FERRY_CHECK(d.max_ns <= d.total_ns && k.max_ns <= k.total_ns, "rank ", r, ", source ", s, ": max > total");
            if (r == late || s == late) continue;
            uint64_t const late_max = stats.combine[late].max_ns;
            FERRY_CHECK(
                late_max >= static_cast<uint64_t>(std::chrono::nanoseconds(sleep).count()) / 2 && late_max > k.max_ns,
                "rank ", r, ": the late source's longest combine wait is ", late_max, " ns, source ", s, "'s ",
                k.max_ns, " ns");
          }
          buffer.reset_wait_stats();
          WaitStats const zero = buffer.wait_stats();
          for (auto const* leg : {&zero.dispatch, &zero.combine})
            for (PeerWaitStats const& s : *leg)
              FERRY_CHECK(s.waits == 0 && s.total_ns == 0 && s.max_ns == 0, "rank ", r, ": stats after reset");
        });
    for (std::size_t r = 0; r < failures.size(); ++r)
      EXPECT_EQ(failures[r], "") << "rank " << r << " masking " << masking;
  }
}

// ---- a rank killed at a random moment ---------------------------------------------------------------------------
//
// One rank of four (one node, or 2x2 on either route; hook on or off) SIGKILLs itself at a random moment of a loop of
// calls: inside a call's exchange, between its steps, or between calls. Every other rank must get, at each call, a
// result exact for the ranks of that call, or a TimeoutError after which the rank is masked, and then 10 more exact
// calls. Before, a rank that died inside the exchange's agreement (about half the kills) failed the communicator of
// every survivor, and every later call and clear_mask failed with it.
// CI runs a few kills (RankMaskingKills.SurvivorsGoOn); `make test-kills` runs FERRY_TEST_KILLS of them (200 there) and
// prints the seed, what each kill did and every failure with its seed and moment.
// Checked to fail: with the agreement cut back to one round of estimates (a rank whose estimate did not come failed the
// communicator, as before), 13 of 24 kills failed ("rank 2, call 2: dispatch TimeoutError without a rank masked:
// ... rank 2 timed out after 1 s in phase 'low-latency dispatch' waiting for rank 0"); restored, 0 of 24.

struct KillTrial {
  char const* topology;
  InternodeRoute route;
  bool hook;
  int victim;
  double moment;  // of the kill, in mean call times after the first call
};

// Trial k of a schedule: the configurations in turn (so a few kills cover them), the victim and moment drawn.
KillTrial kill_trial(uint64_t seed, int k) {
  struct Shape {
    char const* topology;
    InternodeRoute route;
    bool hook;
  };
  static constexpr Shape kShapes[] = {{"1x4", InternodeRoute::direct, false},  {"2x2", InternodeRoute::forward, true},
                                      {"2x2", InternodeRoute::direct, false},  {"1x4", InternodeRoute::direct, true},
                                      {"2x2", InternodeRoute::forward, false}, {"2x2", InternodeRoute::direct, true}};
  Shape const& shape = kShapes[k % 6];
  std::mt19937_64 rng(seed ^ (0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(k + 1)));
  return {shape.topology, shape.route, shape.hook, static_cast<int>(rng() % 4),
          std::uniform_real_distribution<double>(0.0, 4.0)(rng)};
}

// y of rank r when `lost` (ranks of the call masked at its combine) take nothing back: their expert outputs, and on
// the forward route every row of a node whose rail for r is lost, count as zero (0.0f adds nothing).
std::vector<uint16_t> combine_without(EpConfig const& config, Topology const& topology, Topology const& order, int r,
                                      CallWorld const& w, RankSet const& lost, RankSet const& live) {
  std::vector<std::vector<uint16_t>> out = w.expert_out;
  auto const zero = [&](int d) {
    std::fill(out[static_cast<std::size_t>(d)].begin(), out[static_cast<std::size_t>(d)].end(), 0);
  };
  for (int const d : lost) zero(d);
  if (order.nodes > 1)
    for (int n = 0; n < topology.nodes; ++n) {
      int rail = -1;  // as CpuEp::rail_of: the source's local index on node n, or the next live one
      for (int i = 0; i < topology.local && rail < 0; ++i) {
        int const c = n * topology.local + (topology.local_of(r) + i) % topology.local;
        if (live.test(c)) rail = c;
      }
      if (rail >= 0 && lost.test(rail))
        for (int l = 0; l < topology.local; ++l) zero(n * topology.local + l);
    }
  return ref::combine_expert_major(config, order, r, w.kept.inputs, w.received, out);
}

// One call of a survivor: "" when it was exact (or ended in a TimeoutError with the lost rank masked); `what` says
// how it ended.
std::string kill_call(EpBuffer& buffer, Topology const& topology, Topology const& order, int r, uint64_t seed,
                      bool hook, std::string& what) {
  EpConfig const& config = buffer.config();
  int const world = topology.world();
  auto const masked = [&] {
    RankSet set;
    for (int const d : buffer.masked_ranks()) set.set(d);
    return set;
  };
  RankSet const before = masked();
  CallWorld const full = make_call(config, world, seed, RankSet());
  DispatchResult got;
  try {
    DispatchArgs args = test::host_dispatch_args(full.inputs[static_cast<std::size_t>(r)]);
    args.return_recv_hook = hook;
    got = buffer.dispatch(args);
    if (hook) got = buffer.complete_dispatch();
  } catch (TimeoutError const& error) {
    what = "dispatch TimeoutError";
    return masked() != before ? "" : concat("dispatch TimeoutError without a rank masked: ", error.what());
  }
  RankSet const dispatched = masked();
  CallWorld const w = make_call(config, world, seed, dispatched);
  if (std::string const problem = dispatch_problem(config, world, got, w.received[static_cast<std::size_t>(r)]);
      !problem.empty())
    return concat("dispatch (ranks masked: ", dispatched.text(), "): ", problem);
  ref::RankInput const& in = w.inputs[static_cast<std::size_t>(r)];
  std::vector<uint16_t> y(at(in.num_tokens, config.hidden), 0xeeee);
  try {
    CombineArgs ca{CombineLayout::expert_major, w.expert_out[static_cast<std::size_t>(r)].data(), y.data()};
    ca.return_recv_hook = hook;
    buffer.combine(ca);
    if (hook) buffer.complete_combine();
  } catch (TimeoutError const& error) {
    what = "combine TimeoutError";
    return masked() != dispatched ? "" : concat("combine TimeoutError without a rank masked: ", error.what());
  }
  RankSet const after = masked();
  RankSet const lost = after - dispatched;
  std::vector<uint16_t> const whole =
      ref::combine_expert_major(config, order, r, w.kept.inputs, w.received, w.expert_out);
  bool const exact = differs("y", y.data(), whole.data(), whole.size()).empty();
  if (lost.empty()) {
    what = dispatched != before ? "masked at the dispatch" : "whole";
    return exact ? ""
                 : concat("y (ranks masked: ", after.text(), "): ", differs("y", y.data(), whole.data(), whole.size()));
  }
  // masked at the combine: at its last step every sum was done (y whole); at its first, y lacks what they held (the
  // two are the same for a rank none of whose entries went to the lost ranks)
  std::vector<uint16_t> const without =
      combine_without(config, topology, order, r, w, lost, RankSet::range(0, world) - dispatched);
  what = "masked at the combine";
  return exact || differs("y", y.data(), without.data(), without.size()).empty()
             ? ""
             : concat("y with rank(s) ", lost.text(),
                      " masked at the combine: ", differs("y", y.data(), without.data(), without.size()));
}

// A rank process of a kill trial. args: the schedule's seed, the trial's number, a folder for the survivors' reports.
FERRY_RANK_CASE(masking_kill) {
  auto const& args = test::rank_case_args();
  uint64_t const seed = std::stoull(args.at(0));
  int const k = std::stoi(args.at(1));
  KillTrial const t = kill_trial(seed, k);
  std::shared_ptr<Communicator> const comm = test::connect_rank(Backend::cpu);
  Topology const topology = comm->topology();
  int const world = topology.world();
  int const r = comm->rank();
  EpConfig const config = case_config(Case{t.topology, t.route}, world);
  EpBuffer buffer(comm, config);
  Topology const order =
      topology.nodes > 1 && config.route() == InternodeRoute::forward ? topology : Topology{1, world};
  std::string report;
  int calls = 0;
  int after_mask = -1;  // exact calls since the victim was masked
  auto const start = std::chrono::steady_clock::now();
  double mean = 0;
  for (int call = 0; after_mask < 10; ++call) {
    FERRY_CHECK(call < 500 && std::chrono::steady_clock::now() - start < std::chrono::seconds(120), "rank ", r,
                ": the victim was not masked after ", call, " calls");
    auto const begin = std::chrono::steady_clock::now();
    std::string what;
    std::string const problem = kill_call(buffer, topology, order, r, seed + 1000003ULL * (call + 1) + k, t.hook, what);
    FERRY_CHECK(problem.empty(), "rank ", r, ", call ", call, ": ", problem);
    double const seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    ++calls;
    if (call == 0) {
      mean = seconds;
      if (r == t.victim)  // the kill, at a random moment of the next calls
        std::thread([delay = t.moment * mean] {
          std::this_thread::sleep_for(std::chrono::duration<double>(delay));
          kill(getpid(), SIGKILL);
        }).detach();
    }
    if (what != "whole" || after_mask >= 0) {
      if (after_mask < 0) report = concat(what, " (call ", call, ")");
      std::vector<int> const masked = buffer.masked_ranks();
      FERRY_CHECK(masked == std::vector<int>{t.victim}, "rank ", r, ", call ", call, " (", what,
                  "): masked ranks are not the victim ", t.victim, " alone");
      ++after_mask;
    }
  }
  test::write_file(args.at(2) + "/rank" + std::to_string(r), report);
  return 0;
}

int kill_count() {
  char const* kills = std::getenv("FERRY_TEST_KILLS");
  return kills && *kills ? std::atoi(kills) : 3;
}

TEST(RankMaskingKills, SurvivorsGoOn) {
  uint64_t const seed = test::test_seed();
  int const kills = kill_count();
  char const* timeout = std::getenv("FERRY_TEST_KILLS_TIMEOUT_S");
  std::string const timeout_s = timeout && *timeout ? timeout : kTimeoutS;
  std::map<std::string, int> outcomes;
  std::vector<std::string> failures;
  for (int k = 0; k < kills; ++k) {
    KillTrial const t = kill_trial(seed, k);
    test::TempDir dir;
    test::RankCaseOptions options;
    options.args = {std::to_string(seed), std::to_string(k), dir.path()};
    options.env = {{"FERRY_TOPOLOGY", t.topology}, {"FERRY_TIMEOUT_S", timeout_s}, {"FERRY_LOG", "error"}};
    options.timeout = std::chrono::seconds(180);
    LaunchResult const result = test::run_rank_case("masking_kill", 4, options);
    std::string const trial = concat("kill ", k, " (seed ", seed, ", ", t.topology, " ", internode_route_name(t.route),
                                     t.hook ? " hook" : "", ", rank ", t.victim, " at ", t.moment, " calls)");
    bool ok = !result.timed_out && result.ranks.size() == 4;
    std::string outcome;
    for (int r = 0; ok && r < 4; ++r) {
      RankExit const& exit = result.ranks[static_cast<std::size_t>(r)];
      if (r == t.victim) {
        ok = exit.signal == SIGKILL;
        continue;
      }
      std::string const mine = test::read_file(dir.file("rank" + std::to_string(r)));
      ok = exit.exit_code == 0 && !mine.empty();
      // every survivor ends the same way: the calls are collective
      std::string const how = mine.substr(0, mine.find(" (call"));
      ok = ok && (outcome.empty() || outcome == how);
      outcome = how;
    }
    if (!ok) {
      std::string reports;
      for (int r = 0; r < 4; ++r)
        reports += concat("; rank ", r, " reported '", test::read_file(dir.file("rank" + std::to_string(r))), "'");
      failures.push_back(concat(trial, ": ", result.describe(), reports));
      outcome = "failed";
    }
    ++outcomes[outcome];
    std::printf("%s: %s\n", trial.c_str(), outcome.c_str());
  }
  std::string summary =
      concat("rank masking kills: seed ", seed, ", ", kills, " kills, FERRY_TIMEOUT_S=", timeout_s, ":");
  for (auto const& [what, count] : outcomes) summary += concat(" ", what, " ", count, ";");
  std::printf("%s failures: %zu\n", summary.c_str(), failures.size());
  for (std::string const& failure : failures) ADD_FAILURE() << failure;
}

}  // namespace
}  // namespace ferry
