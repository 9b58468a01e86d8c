// Low-latency mode on the cpu backend: expert-major dispatch and both combine layouts against ref:: bit for bit, with
// and without the split API (return_recv_hook + complete_dispatch / complete_combine), its misuse (InputError), and
// a rank that skips a call (TimeoutError naming it). Ranks are processes started through ferry's launcher.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ep/reference.hpp"
#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "support/cpu_ranks.hpp"
#include "support/entry_tokens.hpp"
#include "support/host_fixtures.hpp"
#include "support/rank_case.hpp"
#include "workloads/inputs.hpp"
#include "workloads/routing.hpp"

namespace ferry {
namespace {

using detail::concat;
using test::contains;
using test::expect_input_error;

std::size_t at(int64_t row, int64_t width) {
  return static_cast<std::size_t>(row * width);
}

struct SubCase {
  std::string name;
  int hidden = 64;
  int topk = 8;
  int experts = 32;
  int max_tokens = 16;
  double mask_rate = 0.0;
  RoutingKind routing = RoutingKind::random;
  bool hook = false;
  int zero_rank = -1;  // this rank passes 0 tokens
  int calls = 2;       // consecutive calls on one buffer, fresh inputs each
};

std::vector<SubCase> sub_cases(int world) {
  std::vector<SubCase> cases;
  cases.push_back({"random topk 8", 64, 8, 8 * world, 16});
  cases.push_back({"hook", 64, 8, 8 * world, 16, 0.0, RoutingKind::random, true});
  cases.push_back({"masked topk 9", 128, 9, 16 * world, 12, 0.4});
  cases.push_back({"topk 1 ring", 64, 1, 2 * world, 8, 0.0, RoutingKind::ring});
  cases.push_back({"zero-token rank, hook", 32, 4, 4 * world, 8, 0.1, RoutingKind::random, true, world - 1});
  cases.push_back({"hot expert, many calls", 32, 6, 8 * world, 24, 0.0, RoutingKind::hot, false, -1, 5});
  return cases;
}

std::vector<std::string> run_sub_case(std::shared_ptr<Communicator> const& comm, SubCase const& c, uint64_t seed) {
  int const rank = comm->rank();
  int const world = comm->world();
  std::vector<std::string> problems;
  auto note = [&](std::string const& problem) {
    if (!problem.empty()) problems.push_back(problem);
  };
  EpConfig user;
  user.mode = Mode::low_latency;
  user.hidden = c.hidden;
  user.topk = c.topk;
  user.num_experts = c.experts;
  user.max_tokens_per_rank = c.max_tokens;
  EpBuffer buffer(comm, user);
  EpConfig const& config = buffer.config();  // resolved: expert_capacity = world * max_tokens
  if (config.expert_slots() != world * c.max_tokens) note(concat("expert_slots ", config.expert_slots()));
  int const hidden = c.hidden;
  int const topk = c.topk;
  int const num_local = config.num_local_experts(world);
  int const slots = config.expert_slots();

  for (int call = 0; call < c.calls; ++call) {
    RoutingOptions routing;
    routing.kind = c.routing;
    routing.mask_rate = c.mask_rate;
    routing.seed = seed + static_cast<uint64_t>(call) * 7919u;
    std::vector<int> tokens(static_cast<std::size_t>(world));
    std::mt19937 sizes(static_cast<uint32_t>(routing.seed));
    for (int r = 0; r < world; ++r)
      tokens[static_cast<std::size_t>(r)] = r == c.zero_rank ? 0 : static_cast<int>(sizes() % (c.max_tokens + 1));
    std::vector<ref::RankInput> const inputs = ref::generate_inputs(config, world, routing, tokens);
    std::vector<ref::RankDispatch> want;
    for (int d = 0; d < world; ++d) want.push_back(ref::dispatch(config, world, d, inputs));
    ref::RankInput const& in = inputs[static_cast<std::size_t>(rank)];
    ref::RankDispatch const& mine = want[static_cast<std::size_t>(rank)];

    // 1. dispatch (send half + hook, or one call)
    DispatchArgs args = test::host_dispatch_args(in);
    args.return_recv_hook = c.hook;
    DispatchResult result = buffer.dispatch(args);
    if (c.hook) {
      if (std::string(buffer.pending_hook()) != "dispatch") note("no pending dispatch after a hooked send half");
      result = buffer.complete_dispatch();
    }
    std::string const where = concat("call ", call, ": ");
    if (result.recv_x != nullptr) note(where + "ll returned recv_x");
    if (result.num_recv_host != mine.num_recv)
      note(concat(where, "num_recv ", result.num_recv_host, " != ", mine.num_recv));
    if (result.expert_slots != slots) note(where + "expert_slots");
    if (!std::equal(mine.expert_src_row.begin(), mine.expert_src_row.end(), result.expert_src_row))
      note(where + "expert_src_row differs");
    if (!std::equal(mine.recv_topk_idx.begin(), mine.recv_topk_idx.end(), result.recv_topk_idx))
      note(where + "recv_topk_idx differs");
    if (!std::equal(mine.recv_src.begin(), mine.recv_src.end(), result.recv_src)) note(where + "recv_src differs");
    note(test::expert_layout_problem(config, world, mine, result.expert_counts,
                                     static_cast<uint16_t const*>(result.expert_x), where));

    // 2. expert-major combine of arbitrary expert outputs
    std::vector<std::vector<uint16_t>> expert_out;
    for (int d = 0; d < world; ++d)
      expert_out.push_back(generate_tokens(routing.seed ^ 0xe0e0, d, num_local * slots, hidden));
    std::vector<uint16_t> y(at(in.num_tokens + 1, hidden), 0xeeee);
    CombineArgs combine;
    combine.layout = CombineLayout::expert_major;
    combine.x = expert_out[static_cast<std::size_t>(rank)].data();
    combine.y = y.data();
    combine.return_recv_hook = c.hook;
    buffer.combine(combine);
    if (c.hook) buffer.complete_combine();
    std::vector<uint16_t> want_y = ref::combine_expert_major(config, world, rank, inputs, want, expert_out);
    if (!test::same_bytes(y.data(), want_y.data(), want_y.size() * 2)) note(where + "y (expert_major) differs");
    if (!std::all_of(y.begin() + static_cast<std::ptrdiff_t>(want_y.size()), y.end(),
                     [](uint16_t v) { return v == 0xeeee; }))
      note(where + "y written past num_tokens");

    // 3. rank-major combine of arbitrary rows
    std::vector<std::vector<uint16_t>> rows;
    for (int d = 0; d < world; ++d)
      rows.push_back(generate_tokens(routing.seed ^ 0x7070, d, want[static_cast<std::size_t>(d)].num_recv, hidden));
    std::vector<uint16_t> const dummy(8);
    combine.layout = CombineLayout::rank_major;
    combine.x =
        rows[static_cast<std::size_t>(rank)].empty() ? dummy.data() : rows[static_cast<std::size_t>(rank)].data();
    buffer.combine(combine);
    if (c.hook) buffer.complete_combine();
    want_y = ref::combine_rank_major(config, world, rank, inputs, want, rows);
    if (!test::same_bytes(y.data(), want_y.data(), want_y.size() * 2)) note(where + "y (rank_major) differs");
  }
  return problems;
}

FERRY_RANK_CASE(ll_cpu_matches_reference) {
  uint64_t const seed = test::seed_arg();
  std::shared_ptr<Communicator> const comm = test::connect_rank(Backend::cpu);
  int failures = 0;
  for (SubCase const& c : sub_cases(comm->world())) {
    for (std::string const& problem : run_sub_case(comm, c, seed)) {
      std::fprintf(stderr, "rank %d, world %d, sub-case '%s': %s\n", comm->rank(), comm->world(), c.name.c_str(),
                   problem.c_str());
      ++failures;
    }
  }
  return failures == 0 ? 0 : 1;
}

test::RankCaseOptions case_options(char const* timeout_s = "10") {
  test::RankCaseOptions options;
  options.args = {concat("--seed=", test::test_seed())};
  options.env = {{"FERRY_TIMEOUT_S", timeout_s}};
  options.timeout = std::chrono::seconds(120);
  return options;
}

class LowLatencyCpuWorld : public testing::TestWithParam<int> {};

TEST_P(LowLatencyCpuWorld, MatchesTheReferenceBitForBitWithAndWithoutTheHook) {
  LaunchResult const result = test::run_rank_case("ll_cpu_matches_reference", GetParam(), case_options());
  EXPECT_TRUE(result.ok()) << result.describe() << " (seed " << test::test_seed() << ")";
}

INSTANTIATE_TEST_SUITE_P(Worlds, LowLatencyCpuWorld, testing::Values(1, 2, 4, 8));

// Entry tokens (DispatchArgs::x_repeat, CombineArgs::group; what ferry.deep_ep sends): T tokens of topk 4 as 4 T
// tokens of topk 1, x unexpanded, combined back into T rows with weights given at combine (NaN for the entries that
// went nowhere: they must add nothing). Dispatch and combine against the reference of the expanded input, bit for
// bit, with and without the hook; then the arguments' misuse (InputError on every rank alike).
FERRY_RANK_CASE(ll_cpu_entry_tokens) {
  uint64_t const seed = test::seed_arg();
  std::shared_ptr<Communicator> const comm = test::connect_rank(Backend::cpu);
  int const rank = comm->rank();
  int const world = comm->world();
  int const k = 4;
  int const max_t = 6;
  std::vector<std::string> problems;
  auto note = [&](std::string const& problem) {
    if (!problem.empty()) problems.push_back(problem);
  };
  EpConfig user;
  user.mode = Mode::low_latency;
  user.hidden = 64;
  user.topk = 1;
  user.num_experts = 8 * world;
  user.max_tokens_per_rank = max_t * k;
  EpBuffer buffer(comm, user);
  EpConfig const& config = buffer.config();
  int const hidden = config.hidden;
  int const num_local = config.num_local_experts(world);
  int const slots = config.expert_slots();
  for (int call = 0; call < 3; ++call) {
    RoutingOptions routing;
    routing.mask_rate = 0.2;
    routing.seed = seed + static_cast<uint64_t>(call) * 104729u;
    std::vector<int> tokens(static_cast<std::size_t>(world));
    std::mt19937 sizes(static_cast<uint32_t>(routing.seed));
    for (int r = 0; r < world; ++r) tokens[static_cast<std::size_t>(r)] = static_cast<int>(sizes() % (max_t + 1));
    test::EntryTokens const ex = test::make_entry_tokens(config, world, k, tokens, routing);
    std::vector<ref::RankDispatch> want;
    for (int d = 0; d < world; ++d) want.push_back(ref::dispatch(config, world, d, ex.expanded));
    ref::RankInput const& in = ex.expanded[static_cast<std::size_t>(rank)];
    ref::RankDispatch const& mine = want[static_cast<std::size_t>(rank)];
    bool const hook = call == 1;
    std::string const where = concat("call ", call, hook ? " (hook)" : "", ": ");

    DispatchArgs args;
    args.x = ex.x[static_cast<std::size_t>(rank)].data();
    args.x_repeat = k;
    args.num_tokens = in.num_tokens;
    args.topk_idx = in.topk_idx.data();
    args.topk_weights = in.topk_weights.data();
    args.return_recv_hook = hook;
    DispatchResult result = buffer.dispatch(args);
    if (hook) result = buffer.complete_dispatch();
    if (result.num_recv_host != mine.num_recv) note(concat(where, "num_recv ", result.num_recv_host));
    note(test::expert_layout_problem(config, world, mine, result.expert_counts,
                                     static_cast<uint16_t const*>(result.expert_x), where));

    std::vector<std::vector<uint16_t>> expert_out;
    for (int d = 0; d < world; ++d)
      expert_out.push_back(generate_tokens(routing.seed ^ 0xe0e0, d, num_local * slots, hidden));
    int const t_count = tokens[static_cast<std::size_t>(rank)];
    std::vector<uint16_t> y(at(t_count + 1, hidden), 0xeeee);
    CombineArgs combine;
    combine.x = expert_out[static_cast<std::size_t>(rank)].data();
    combine.y = y.data();
    combine.group = k;
    combine.group_weights = ex.weights[static_cast<std::size_t>(rank)].data();
    combine.return_recv_hook = hook;
    buffer.combine(combine);
    if (hook) buffer.complete_combine();
    std::vector<uint16_t> const want_y =
        test::grouped_y(ref::combine_expert_major(config, world, rank, ex.expanded, want, expert_out), in.topk_idx,
                        ex.weights[static_cast<std::size_t>(rank)], k, hidden);
    for (int u = 0; u < t_count; ++u)
      if (std::memcmp(y.data() + at(u, hidden), want_y.data() + at(u, hidden), at(1, hidden) * 2) != 0)
        note(concat(where, "y row ", u, " of ", t_count, " differs"));
    if (!std::all_of(y.begin() + static_cast<std::ptrdiff_t>(at(t_count, hidden)), y.end(),
                     [](uint16_t v) { return v == 0xeeee; }))
      note(where + "y written past its T rows");
  }

  // misuse: the same on every rank (each refusal is collective)
  std::vector<uint16_t> x(at(max_t, hidden));
  std::vector<int64_t> ids(static_cast<std::size_t>(max_t * k));
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i % 2);  // distinct in groups of 2
  std::vector<float> ones(ids.size(), 1.0f);
  DispatchArgs args;
  args.x = x.data();
  args.num_tokens = 6;
  args.topk_idx = ids.data();
  args.topk_weights = ones.data();
  args.x_repeat = 4;
  note(expect_input_error([&] { buffer.dispatch(args); }, {"x_repeat=4", "divide num_tokens=6"}));
  args.x_repeat = 0;
  note(expect_input_error([&] { buffer.dispatch(args); }, {"x_repeat=0", "must be >= 1"}));
  args.x_repeat = 2;
  ids[3] = ids[2];  // token 1's two entries name one expert (a repeat within a group, as within a token's topk)
  note(expect_input_error([&] { buffer.dispatch(args); }, {"topk_idx[3]=0 repeats topk_idx[2]", "x_repeat=2 group"}));
  ids[3] = 1;
  buffer.dispatch(args);
  std::vector<uint16_t> out(at(static_cast<int64_t>(num_local) * slots, hidden));
  std::vector<uint16_t> y(at(6, hidden));
  CombineArgs combine{CombineLayout::expert_major, out.data(), y.data()};
  combine.group = 4;
  combine.group_weights = ones.data();
  note(expect_input_error([&] { buffer.combine(combine); }, {"group=4", "divide the 6 tokens"}));
  combine.group = 2;
  combine.group_weights = nullptr;
  note(expect_input_error([&] { buffer.combine(combine); }, {"group=2 needs group_weights"}));
  {
    EpConfig two = user;
    two.topk = 2;
    EpBuffer pairs(comm, two);
    std::vector<int64_t> const distinct = {0, 1, 0, 1, 0, 1};  // three tokens of topk 2
    DispatchArgs a2 = args;
    a2.topk_idx = distinct.data();
    a2.x_repeat = 1;
    a2.num_tokens = 3;
    pairs.dispatch(a2);
    combine.group_weights = ones.data();
    note(expect_input_error([&] { pairs.combine(combine); }, {"group=2", "low-latency mode with topk 1", "topk=2"}));
    EpConfig normal = two;
    normal.mode = Mode::normal;
    EpBuffer normal_buffer(comm, normal);
    a2.x_repeat = 3;
    note(expect_input_error([&] { normal_buffer.dispatch(a2); }, {"x_repeat=3", "low-latency mode"}));
  }
  for (auto const& problem : problems) std::fprintf(stderr, "rank %d, world %d: %s\n", rank, world, problem.c_str());
  return problems.empty() ? 0 : 1;
}

class LowLatencyCpuEntryTokens : public testing::TestWithParam<int> {};

TEST_P(LowLatencyCpuEntryTokens, XRepeatAndGroupedCombineMatchTheExpandedReference) {
  LaunchResult const result = test::run_rank_case("ll_cpu_entry_tokens", GetParam(), case_options());
  EXPECT_TRUE(result.ok()) << result.describe() << " (seed " << test::test_seed() << ")";
}

INSTANTIATE_TEST_SUITE_P(Worlds, LowLatencyCpuEntryTokens, testing::Values(1, 2, 4));

// Misuse of the hook is refused on the host before anything runs; every rank misuses it the same way, so no rank
// waits. Then rank 1 skips a dispatch: rank 0 times out naming it.
FERRY_RANK_CASE(ll_cpu_hook_misuse) {
  std::shared_ptr<Communicator> const comm = test::connect_rank(Backend::cpu);
  int const rank = comm->rank();
  int const world = comm->world();
  std::vector<std::string> problems;
  auto note = [&](std::string const& problem) {
    if (!problem.empty()) problems.push_back(problem);
  };
  EpConfig config;
  config.mode = Mode::low_latency;
  config.hidden = 32;
  config.num_experts = 4 * world;
  config.topk = 2;
  config.max_tokens_per_rank = 4;
  RoutingOptions routing;
  routing.seed = test::seed_arg();
  EpBuffer buffer(comm, config);
  std::vector<ref::RankInput> const inputs =
      ref::generate_inputs(buffer.config(), world, routing, std::vector<int>(static_cast<std::size_t>(world), 4));
  ref::RankInput const& in = inputs[static_cast<std::size_t>(rank)];
  DispatchArgs args;
  args.x = in.x.data();
  args.num_tokens = 4;
  args.topk_idx = in.topk_idx.data();
  args.topk_weights = in.topk_weights.data();
  std::vector<uint16_t> y(at(4, 32));
  std::vector<uint16_t> out(at(static_cast<int64_t>(4) * buffer.config().expert_slots(), 32));

  // 1. completions without a pending half, a second completion, calls while a half is pending
  note(expect_input_error([&] { buffer.complete_dispatch(); }, {"complete_dispatch", "none is pending"}));
  note(expect_input_error([&] { buffer.complete_combine(); }, {"complete_combine", "none is pending"}));
  args.return_recv_hook = true;
  buffer.dispatch(args);
  note(expect_input_error([&] { buffer.dispatch(args); }, {"dispatch called while", "complete_dispatch first"}));
  note(expect_input_error(
      [&] {
        buffer.combine({CombineLayout::expert_major, out.data(), y.data()});
      },
      {"combine called while", "dispatch"}));
  note(expect_input_error([&] { buffer.complete_combine(); }, {"pending hook is of dispatch"}));
  buffer.complete_dispatch();
  note(expect_input_error([&] { buffer.complete_dispatch(); }, {"none is pending"}));
  CombineArgs combine{CombineLayout::expert_major, out.data(), y.data()};
  combine.return_recv_hook = true;
  buffer.combine(combine);
  note(expect_input_error([&] { buffer.dispatch(args); }, {"dispatch called while", "combine"}));
  buffer.complete_combine();
  note(expect_input_error([&] { buffer.complete_combine(); }, {"none is pending"}));

  // 2. the hook is an LL feature
  {
    EpConfig normal = config;
    normal.mode = Mode::normal;
    EpBuffer normal_buffer(comm, normal);
    note(expect_input_error([&] { normal_buffer.dispatch(args); }, {"return_recv_hook=true needs mode=ll"}));
  }

  // 3. rank 1 skips a dispatch: rank 0 raises TimeoutError naming it
  args.return_recv_hook = false;
  if (world > 1) {
    if (rank == 0) {
      try {
        buffer.dispatch(args);
        note("dispatch passed without rank 1");
      } catch (TimeoutError const& error) {
        if (!contains(error.what(), "waiting for rank(s) 1")) note(concat("timeout message: ", error.what()));
      }
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(4));
    }
  }
  for (auto const& problem : problems) std::fprintf(stderr, "rank %d: %s\n", rank, problem.c_str());
  std::fflush(stderr);
  std::_Exit(problems.empty() ? 0 : 1);  // rank 0's communicator failed: skip the collective teardown
}

TEST(LowLatencyCpu, HookMisuseIsInputErrorAndASkippedCallTimesOut) {
  LaunchResult const result = test::run_rank_case("ll_cpu_hook_misuse", 2, case_options("2"));
  EXPECT_TRUE(result.ok()) << result.describe();
}

}  // namespace
}  // namespace ferry
