// Collective consistency on the cpu backend (docs/errors.md): a call one rank refuses on input is refused on every
// rank, calls out of step fail on every rank, configs are compared at construction, and buffers and communicators
// give their memory back. Ranks are threads (LocalBootstrap), each with its own cpu communicator; every returned
// result is compared bit for bit with ref::.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm_impl.hpp"
#include "ep/reference.hpp"
#include "ferry/bootstrap.hpp"
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
using test::contains;
using test::ScopedEnv;
using test::test_seed;

std::size_t at(int64_t row, int64_t width) {
  return static_cast<std::size_t>(row * width);
}

using RankFn = std::function<void(int, std::shared_ptr<Communicator> const&)>;

std::vector<std::string> run_ranks(int world, RankFn const& fn) {
  return test::run_cpu_ranks(world, fn);
}

void expect_all_passed(std::vector<std::string> const& failures) {
  for (std::size_t r = 0; r < failures.size(); ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

// bf16 values that sum exactly in fp32 (small integers over a power of two), so combine results are exact too.
uint16_t exact_bf16(std::mt19937_64& rng) {
  return ref::float_to_bf16(static_cast<float>(static_cast<int>(rng() % 17) - 8) / 16.0f);
}

std::vector<uint16_t> exact_rows(uint64_t seed, std::size_t count) {
  std::mt19937_64 rng(seed);
  std::vector<uint16_t> out(count);
  for (auto& v : out) v = exact_bf16(rng);
  return out;
}

// One call of a schedule on one rank, and what every rank must see of it.
enum class Outcome { ok, refused };

// What one rank's dispatch returned, compared with the reference. "" when equal.
std::string compare_dispatch(EpConfig const& config, int world, DispatchResult const& got,
                             ref::RankDispatch const& want, bool expert_major) {
  int const hidden = config.hidden;
  int const topk = config.topk;
  if (got.num_recv_host != want.num_recv) return concat("num_recv ", got.num_recv_host, " != ", want.num_recv);
  int const n = want.num_recv;
  if (got.recv_x != nullptr && !test::same_bytes(got.recv_x, want.recv_x.data(), at(n, hidden) * sizeof(uint16_t)))
    return "recv_x differs";
  if (!test::same_bytes(got.recv_topk_idx, want.recv_topk_idx.data(), at(n, topk) * sizeof(int32_t)))
    return "recv_topk_idx differs";
  if (!test::same_bytes(got.recv_topk_weights, want.recv_topk_weights.data(), at(n, topk) * sizeof(float)))
    return "recv_topk_weights differs";
  if (!test::same_bytes(got.recv_src, want.recv_src.data(), at(n, 2) * sizeof(int32_t))) return "recv_src differs";
  int const num_local = config.num_local_experts(world);
  if (!test::same_bytes(got.expert_counts, want.expert_counts.data(), at(num_local, 1) * sizeof(int32_t)))
    return "expert_counts differ";
  if (expert_major) {
    std::vector<uint16_t> const expanded = ref::expand(config, world, want);
    for (int e = 0; e < num_local; ++e) {
      int const filled = std::min(want.expert_counts[static_cast<std::size_t>(e)], want.expert_slots);
      std::size_t const first = at(static_cast<int64_t>(e) * want.expert_slots, hidden);
      if (!test::same_bytes(static_cast<uint16_t const*>(got.expert_x) + first, expanded.data() + first,
                            at(filled, hidden) * sizeof(uint16_t)))
        return concat("expert_x of local expert ", e, " differs");
    }
  }
  return "";
}

// --- the repro of issue 32 item 2: one rank's bad id in the middle of a loop --------------------------------------

// 2 ranks, 12 iterations of dispatch(expand) + combine(expert_major), every result checked bit for bit. In iteration
// 5 rank 1's topk_idx[0, 0] is 1234; on its InputError it calls combine with zeros and goes on, as a catch-and-continue
// engine would. Before collective refusals, rank 0's dispatch paired with rank 1's next call: 6 of 12 checked results
// on each rank were wrong with no error, and the run ended in a TimeoutError. Now iteration 5 is refused on both
// ranks (rank 1's own error, rank 0's naming rank 1), its combine too (no successful dispatch), and every other
// iteration is exact.
TEST(CollectiveErrors, OneRankBadIdIsRefusedOnEveryRankAndTheLoopStaysExact) {
  ScopedEnv const timeout("FERRY_TIMEOUT_S", "5");
  uint64_t const seed = test_seed();
  int const world = 2;
  EpConfig config;
  config.hidden = 64;
  config.num_experts = 8;
  config.topk = 3;
  config.max_tokens_per_rank = 16;
  config.expert_capacity = 2 * 16;
  std::vector<std::vector<std::string>> log(world);
  expect_all_passed(run_ranks(world, [&](int rank, std::shared_ptr<Communicator> const& comm) {
    EpBuffer buffer(comm, config);
    int const num_local = config.num_local_experts(world);
    for (int it = 0; it < 12; ++it) {
      RoutingOptions routing;
      routing.seed = seed + static_cast<uint64_t>(it);
      std::vector<ref::RankInput> inputs = ref::generate_inputs(config, world, routing, std::vector<int>{16, 11});
      for (auto& in : inputs)
        in.x = exact_rows(routing.seed * 7 + static_cast<uint64_t>(&in - inputs.data()), in.x.size());
      ref::RankInput const& in = inputs[static_cast<std::size_t>(rank)];
      std::vector<int64_t> ids = in.topk_idx;
      bool const bad = it == 5 && rank == 1;
      if (bad) ids[0] = 1234;
      DispatchArgs args;
      args.x = in.x.data();
      args.num_tokens = in.num_tokens;
      args.topk_idx = ids.data();
      args.topk_weights = in.topk_weights.data();
      args.expand = true;
      std::vector<uint16_t> zeros(at(static_cast<int64_t>(num_local) * *config.expert_capacity, config.hidden));
      std::vector<uint16_t> y(at(in.num_tokens, config.hidden), 0xffff);
      try {
        DispatchResult const got = buffer.dispatch(args);
        std::vector<ref::RankDispatch> received;
        for (int r = 0; r < world; ++r) received.push_back(ref::dispatch(buffer.config(), world, r, inputs));
        std::string const problem =
            compare_dispatch(buffer.config(), world, got, received[static_cast<std::size_t>(rank)], true);
        if (!problem.empty()) log[rank].push_back(concat("iteration ", it, " dispatch: ", problem));
        std::vector<std::vector<uint16_t>> expert_out;
        for (int r = 0; r < world; ++r)
          expert_out.push_back(exact_rows(routing.seed * 13 + static_cast<uint64_t>(r), zeros.size()));
        buffer.combine({CombineLayout::expert_major, expert_out[static_cast<std::size_t>(rank)].data(), y.data()});
        std::vector<uint16_t> const want =
            ref::combine_expert_major(buffer.config(), world, rank, inputs, received, expert_out);
        if (want != y) log[rank].push_back(concat("iteration ", it, " combine: y differs"));
      } catch (InputError const& error) {
        std::string const what = error.what();
        if (it != 5) log[rank].push_back(concat("iteration ", it, ": unexpected ", what));
        if (rank == 0 && !contains(what, "rank 1 refused this call"))
          log[rank].push_back(concat("rank 0's error does not name rank 1: ", what));
        if (!contains(what, "topk_idx[0, 0]=1234")) log[rank].push_back(concat("reason missing: ", what));
        // catch and continue: a combine with zeros, refused everywhere (the dispatch it refers to was refused)
        try {
          buffer.combine({CombineLayout::expert_major, zeros.data(), y.data()});
          log[rank].push_back("a combine after a refused dispatch returned");
        } catch (InputError const& again) {
          if (!contains(again.what(), "without a successful dispatch"))
            log[rank].push_back(concat("combine after refusal: ", again.what()));
        }
      }
    }
  }));
  for (int r = 0; r < world; ++r)
    for (auto const& line : log[static_cast<std::size_t>(r)]) ADD_FAILURE() << "rank " << r << ": " << line;
}

// --- randomized fault schedules ------------------------------------------------------------------------------------

enum class Fault {
  none,
  bad_id,           // an id outside [-1, num_experts)
  duplicate_id,     // a token names one expert twice
  too_many_tokens,  // num_tokens > max_tokens_per_rank
  null_x,           // dispatch x null with tokens
  binding_refusal,  // the binding's own check (EpBuffer::refuse_dispatch / refuse_combine)
  bad_index_type,   // topk_idx_type neither int32 nor int64
  combine_null_x,
  combine_misaligned_y,
  kCount,
};

struct Leg {
  int dispatch_fault_rank = -1;         // -1: none
  int second_dispatch_fault_rank = -1;  // another rank refusing the same dispatch (-1: none)
  Fault dispatch_fault = Fault::none;
  int combine_fault_rank = -1;
  Fault combine_fault = Fault::none;
  bool expand = false;
  bool expert_major = false;  // combine layout (normal: needs expand; a non-expanded one is a fault on every rank)
  bool hook = false;          // low-latency only
  std::vector<int> tokens;
};

struct Schedule {
  std::vector<Leg> legs;
};

Schedule make_schedule(uint64_t seed, int world, bool low_latency, int max_tokens) {
  std::mt19937_64 rng(seed);
  Schedule s;
  int const num_legs = 3;
  for (int l = 0; l < num_legs; ++l) {
    Leg leg;
    leg.expand = low_latency || rng() % 2 == 0;
    leg.expert_major = low_latency ? rng() % 2 == 0 : (leg.expand ? rng() % 2 == 0 : rng() % 8 == 0);
    leg.hook = low_latency && rng() % 2 == 0;
    for (int r = 0; r < world; ++r) leg.tokens.push_back(static_cast<int>(rng() % (max_tokens + 1)));
    if (rng() % 3 == 0) {
      leg.dispatch_fault_rank = static_cast<int>(rng() % world);
      leg.dispatch_fault = static_cast<Fault>(1 + rng() % 6);  // bad_id .. bad_index_type
      // the id and x faults need a token to be wrong in
      int& tokens = leg.tokens[static_cast<std::size_t>(leg.dispatch_fault_rank)];
      tokens = std::max(tokens, 1);
      // sometimes a second rank refuses the same call (with the same fault): each refusing rank raises its own error,
      // the others name the lowest refusing rank
      if (rng() % 4 == 0) {
        leg.second_dispatch_fault_rank =
            (leg.dispatch_fault_rank + 1 + static_cast<int>(rng() % static_cast<uint64_t>(world - 1))) % world;
        int& second = leg.tokens[static_cast<std::size_t>(leg.second_dispatch_fault_rank)];
        second = std::max(second, 1);
      }
    }
    if (rng() % 4 == 0) {
      leg.combine_fault_rank = static_cast<int>(rng() % world);
      Fault const combine_faults[] = {Fault::binding_refusal, Fault::combine_null_x, Fault::combine_misaligned_y};
      leg.combine_fault = combine_faults[rng() % 3];
    }
    s.legs.push_back(leg);
  }
  return s;
}

// Every rank's record of one schedule: per call, refused or not, and by which rank the peers' error says.
struct CallRecord {
  Outcome outcome = Outcome::ok;
  std::string what;
};

// Calls whose results were compared, and calls refused, over every rank (so the test cannot pass on nothing).
struct Tally {
  std::atomic<int> compared{0};
  std::atomic<int> refused{0};
};

void run_schedules(int world, bool low_latency, uint64_t first_seed, int count, std::vector<std::string>& problems,
                   Tally& tally) {
  EpConfig config;
  config.hidden = 32;
  config.num_experts = 4 * world;
  config.topk = 3;
  config.max_tokens_per_rank = 6;
  config.expert_capacity = world * 6;
  if (low_latency) config.mode = Mode::low_latency;
  // calls[seed index][call][rank]
  std::vector<std::vector<std::vector<CallRecord>>> calls(
      static_cast<std::size_t>(count), std::vector<std::vector<CallRecord>>(2 * 3, std::vector<CallRecord>(world)));
  std::vector<std::vector<std::string>> rank_problems(static_cast<std::size_t>(world));
  std::vector<std::string> const failures = run_ranks(world, [&](int rank, std::shared_ptr<Communicator> const& comm) {
    EpBuffer buffer(comm, config);
    EpConfig const& resolved = buffer.config();
    int const num_local = resolved.num_local_experts(world);
    std::size_t const expert_elems = at(static_cast<int64_t>(num_local) * resolved.expert_slots(), resolved.hidden);
    auto note = [&](std::string const& what) { rank_problems[static_cast<std::size_t>(rank)].push_back(what); };
    for (int i = 0; i < count; ++i) {
      uint64_t const seed = first_seed + static_cast<uint64_t>(i);
      Schedule const schedule = make_schedule(seed, world, low_latency, config.max_tokens_per_rank);
      auto& record = calls[static_cast<std::size_t>(i)];
      for (std::size_t l = 0; l < schedule.legs.size(); ++l) {
        Leg const& leg = schedule.legs[l];
        RoutingOptions routing;
        routing.seed = seed * 31 + l;
        std::vector<ref::RankInput> inputs = ref::generate_inputs(resolved, world, routing, leg.tokens);
        for (std::size_t r = 0; r < inputs.size(); ++r)
          inputs[r].x = exact_rows(routing.seed + 101 * r, inputs[r].x.size());
        ref::RankInput const& in = inputs[static_cast<std::size_t>(rank)];
        std::vector<int64_t> ids = in.topk_idx;
        DispatchArgs args;
        args.x = in.x.data();
        args.num_tokens = in.num_tokens;
        args.topk_idx = ids.data();
        args.topk_weights = in.topk_weights.data();
        args.expand = leg.expand;
        args.return_recv_hook = leg.hook;
        bool const my_fault = leg.dispatch_fault_rank == rank || leg.second_dispatch_fault_rank == rank;
        if (my_fault) {
          switch (leg.dispatch_fault) {
            case Fault::bad_id:
              ids.back() = 1234;
              break;
            case Fault::duplicate_id:
              ids[0] = ids[1] = 0;
              break;
            case Fault::too_many_tokens:
              args.num_tokens = config.max_tokens_per_rank + 1;
              break;
            case Fault::null_x:
              args.num_tokens = std::max(in.num_tokens, 1);
              args.x = nullptr;
              break;
            case Fault::bad_index_type:
              args.topk_idx_type = static_cast<IndexType>(7);
              break;
            default:
              break;
          }
        }
        // 1. dispatch (with the hook, completed at once)
        CallRecord dispatch_record;
        std::vector<ref::RankDispatch> received;
        bool dispatched = false;
        try {
          DispatchResult got;
          if (my_fault && leg.dispatch_fault == Fault::binding_refusal)
            buffer.refuse_dispatch(concat("binding: rank ", rank, " refused x of schedule ", seed));
          got = buffer.dispatch(args);
          if (leg.hook) got = buffer.complete_dispatch();
          for (int r = 0; r < world; ++r) received.push_back(ref::dispatch(resolved, world, r, inputs));
          std::string const problem =
              compare_dispatch(resolved, world, got, received[static_cast<std::size_t>(rank)], leg.expand);
          if (!problem.empty()) note(concat("schedule ", seed, " leg ", l, " dispatch: ", problem));
          dispatched = true;
          ++tally.compared;
        } catch (InputError const& error) {
          dispatch_record = {Outcome::refused, error.what()};
          ++tally.refused;
        }
        // 2. combine (always called: after a refused dispatch it must be refused on every rank too)
        CallRecord combine_record;
        std::vector<std::vector<uint16_t>> outs;
        for (int r = 0; r < world; ++r) {
          std::size_t const n =
              leg.expert_major ? expert_elems
                               : at(dispatched ? received[static_cast<std::size_t>(r)].num_recv : 0, resolved.hidden);
          outs.push_back(exact_rows(routing.seed * 3 + static_cast<uint64_t>(r), std::max<std::size_t>(n, 8)));
        }
        std::vector<uint16_t> y(at(in.num_tokens, resolved.hidden) + 8, 0xffff);
        CombineArgs cargs{leg.expert_major ? CombineLayout::expert_major : CombineLayout::rank_major,
                          outs[static_cast<std::size_t>(rank)].data(), y.data()};
        cargs.return_recv_hook = leg.hook;
        bool const my_combine_fault = leg.combine_fault_rank == rank;
        if (my_combine_fault && leg.combine_fault == Fault::combine_null_x) cargs.x = nullptr;
        if (my_combine_fault && leg.combine_fault == Fault::combine_misaligned_y)
          cargs.y = reinterpret_cast<char*>(y.data()) + 2;
        try {
          if (my_combine_fault && leg.combine_fault == Fault::binding_refusal)
            buffer.refuse_combine(concat("binding: rank ", rank, " refused out of schedule ", seed));
          buffer.combine(cargs);
          if (leg.hook) buffer.complete_combine();
          // rank-major rows: exactly num_recv rows each (the buffers passed are padded so that none is empty)
          std::vector<std::vector<uint16_t>> rows = outs;
          if (!leg.expert_major)
            for (int r = 0; r < world; ++r)
              rows[static_cast<std::size_t>(r)].resize(
                  at(received[static_cast<std::size_t>(r)].num_recv, resolved.hidden));
          std::vector<uint16_t> want = leg.expert_major
                                           ? ref::combine_expert_major(resolved, world, rank, inputs, received, outs)
                                           : ref::combine_rank_major(resolved, world, rank, inputs, received, rows);
          if (!std::equal(want.begin(), want.end(), y.begin()))
            note(concat("schedule ", seed, " leg ", l, " combine: y differs"));
          ++tally.compared;
        } catch (InputError const& error) {
          combine_record = {Outcome::refused, error.what()};
          ++tally.refused;
        }
        record[2 * l][static_cast<std::size_t>(rank)] = dispatch_record;
        record[2 * l + 1][static_cast<std::size_t>(rank)] = combine_record;
      }
    }
  });
  for (int r = 0; r < world; ++r) {
    if (!failures[static_cast<std::size_t>(r)].empty()) problems.push_back(concat("rank ", r, ": ", failures[r]));
    for (auto const& p : rank_problems[static_cast<std::size_t>(r)]) problems.push_back(concat("rank ", r, ": ", p));
  }
  if (!problems.empty()) return;
  // 3. every call is refused on every rank or on none, and exactly when some rank's input was bad
  for (int i = 0; i < count; ++i) {
    uint64_t const seed = first_seed + static_cast<uint64_t>(i);
    Schedule const schedule = make_schedule(seed, world, low_latency, config.max_tokens_per_rank);
    for (std::size_t c = 0; c < calls[static_cast<std::size_t>(i)].size(); ++c) {
      Leg const& leg = schedule.legs[c / 2];
      auto const& per_rank = calls[static_cast<std::size_t>(i)][c];
      bool const is_dispatch = c % 2 == 0;
      bool const dispatch_refused = leg.dispatch_fault_rank >= 0;
      bool const expect_refused =
          is_dispatch ? dispatch_refused
                      : dispatch_refused || leg.combine_fault_rank >= 0 || (leg.expert_major && !leg.expand);
      // the one rank whose input was bad, when a single rank refused (a combine after a refused dispatch, or an
      // expert-major combine without expand, is refused by every rank on its own)
      bool const every_rank_refuses = !is_dispatch && (dispatch_refused || (leg.expert_major && !leg.expand));
      int const second = leg.second_dispatch_fault_rank;
      int const first = second >= 0 ? std::min(leg.dispatch_fault_rank, second) : leg.dispatch_fault_rank;
      int const refusing = every_rank_refuses ? -1 : is_dispatch ? first : leg.combine_fault_rank;
      for (int r = 0; r < world; ++r) {
        CallRecord const& rec = per_rank[static_cast<std::size_t>(r)];
        bool const refused_itself = is_dispatch && (r == leg.dispatch_fault_rank || r == second);
        if ((rec.outcome == Outcome::refused) != expect_refused)
          problems.push_back(concat("schedule ", seed, " call ", c, " rank ", r, ": ",
                                    rec.outcome == Outcome::refused ? "refused: " + rec.what : "returned",
                                    ", expected ", expect_refused ? "refused" : "a result"));
        if (refusing >= 0 && refusing != r && !refused_itself &&
            !contains(rec.what, concat("rank ", refusing, " refused this call")))
          problems.push_back(
              concat("schedule ", seed, " call ", c, " rank ", r, ": does not name rank ", refusing, ": ", rec.what));
      }
    }
  }
}

// 1,000 seeded schedules over worlds 2, 3 and 4, normal and low-latency mode (with and without the hook): faults on
// random ranks (sometimes two in one call) in random legs, caught, and the loop goes on. Every returned result is
// exact, and every refused call is refused on every rank (and names the refusing rank). This check fails on the code
// before collective refusals: the first fault put the ranks out of step (wrong results, then a timeout).
TEST(CollectiveErrors, RandomFaultSchedulesAreRefusedEverywhereAndResultsStayExact) {
  ScopedEnv const timeout("FERRY_TIMEOUT_S", "10");
  uint64_t const seed = test_seed();
  std::vector<std::string> problems;
  Tally tally;
  int schedules = 0;
  for (int world : {2, 3, 4}) {
    for (bool low_latency : {false, true}) {
      int const count = world == 4 ? 166 : 167;
      run_schedules(world, low_latency, seed + static_cast<uint64_t>(schedules), count, problems, tally);
      schedules += count;
    }
  }
  EXPECT_EQ(schedules, 1000);
  std::printf("%d schedules: %d results compared exactly, %d calls refused (over every rank)\n", schedules,
              tally.compared.load(), tally.refused.load());
  EXPECT_GT(tally.compared.load(), 5000);
  EXPECT_GT(tally.refused.load(), 2000);
  for (std::size_t i = 0; i < std::min<std::size_t>(problems.size(), 20); ++i) ADD_FAILURE() << problems[i];
  EXPECT_TRUE(problems.empty()) << problems.size() << " problems (seed " << seed << ")";
}

// --- calls out of step -------------------------------------------------------------------------------------------

// Rank 1 skips a combine and dispatches again: both ranks meet at the same barrier in different calls, and both
// raise an error naming both calls; the buffer refuses every later call on both, the communicator stays usable.
TEST(CollectiveErrors, CallsOutOfStepFailOnEveryRankNamingBothCalls) {
  ScopedEnv const timeout("FERRY_TIMEOUT_S", "5");
  EpConfig config;
  config.hidden = 32;
  config.num_experts = 4;
  config.topk = 2;
  config.max_tokens_per_rank = 4;
  std::vector<std::string> errors(2), later(2);
  expect_all_passed(run_ranks(2, [&](int rank, std::shared_ptr<Communicator> const& comm) {
    EpBuffer buffer(comm, config);
    std::vector<uint16_t> x(at(4, 32)), y(at(4, 32)), rows(at(8, 32));
    std::vector<int64_t> ids = {0, 1, 2, 3, 1, 2, 0, 3};
    std::vector<float> w(8, 0.5f);
    DispatchArgs args;
    args.x = x.data();
    args.num_tokens = 4;
    args.topk_idx = ids.data();
    args.topk_weights = w.data();
    buffer.dispatch(args);
    try {
      if (rank == 0)
        buffer.combine({CombineLayout::rank_major, rows.data(), y.data()});
      else
        buffer.dispatch(args);
      errors[rank] = "no error";
    } catch (Error const& error) {
      errors[rank] = error.what();
    }
    try {
      buffer.dispatch(args);
    } catch (Error const& error) {
      later[rank] = error.what();
    }
    comm->barrier();  // the communicator is still in step
  }));
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(contains(errors[r], "calls out of step")) << errors[r];
    EXPECT_TRUE(contains(errors[r], r == 0 ? "rank 0 is in combine #1" : "rank 1 is in dispatch #2")) << errors[r];
    EXPECT_TRUE(contains(errors[r], r == 0 ? "rank 1 was in dispatch #2" : "rank 0 was in combine #1")) << errors[r];
    EXPECT_EQ(later[r], errors[r]) << "a buffer out of step must refuse every later call";
  }
}

// --- configs are compared at construction --------------------------------------------------------------------------

// Each rank creates a buffer of hidden_of(rank); returns what each rank's constructor said ("created" or its error).
std::vector<std::string> create_on_two_ranks(std::function<int(int)> const& hidden_of) {
  std::vector<std::string> said(2);
  expect_all_passed(run_ranks(2, [&](int rank, std::shared_ptr<Communicator> const& comm) {
    EpConfig config;
    config.hidden = hidden_of(rank);
    config.max_tokens_per_rank = 8;
    try {
      EpBuffer buffer(comm, config);
      said[rank] = "created";
    } catch (ConfigError const& error) {
      said[rank] = error.what();
    }
  }));
  return said;
}

TEST(CollectiveErrors, ConfigsThatDifferBetweenRanksAreNamedOnEveryRank) {
  std::vector<std::string> errors = create_on_two_ranks([](int rank) { return rank == 0 ? 7168 : 4096; });
  EXPECT_TRUE(contains(errors[0], "hidden=7168 on rank 0 but hidden=4096 on rank 1")) << errors[0];
  EXPECT_TRUE(contains(errors[1], "hidden=4096 on rank 1 but hidden=7168 on rank 0")) << errors[1];

  // an invalid config on one rank: that rank's own ConfigError, the other's names it (and neither waits)
  errors = create_on_two_ranks([](int rank) { return rank == 1 ? 7004 : 7168; });
  EXPECT_TRUE(contains(errors[1], "hidden=7004 is not a multiple of 8")) << errors[1];
  EXPECT_TRUE(contains(errors[0], "rank 1's EpConfig is invalid")) << errors[0];
}

// --- memory: buffers and communicators give it back ---------------------------------------------------------------

// Virtual memory of this process (MiB), /proc/self/statm's first field.
double vm_size_mib() {
  std::ifstream statm("/proc/self/statm");
  double pages = 0;
  statm >> pages;
  return pages * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1 << 20);
}

// Shared memory this process maps (MiB): the /dev/shm segments in /proc/self/maps. Process-local, so tests running
// beside this one (ctest -j) do not move it; a segment stays mapped (and counted) while any of its ranks maps it.
double shm_mapped_mib() {
  std::ifstream maps("/proc/self/maps");
  double bytes = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/dev/shm/ferry-") == std::string::npos) continue;
    unsigned long long begin = 0, end = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx", &begin, &end) == 2) bytes += static_cast<double>(end - begin);
  }
  return bytes / (1 << 20);
}

// 20 create / destroy cycles of one buffer (hidden 7168, 1024 tokens, world 2: about 112 MiB of symmetric memory per
// buffer on each rank), then 10 of a communicator with a buffer. Before release_symmetric the 20 cycles held 2,251
// MiB (VmSize 332 -> 2,461 MiB) until the communicator went. The bound: the first cycle's growth (one buffer) plus
// 64 MiB for the allocator's slack.
TEST(Lifecycle, BuffersAndCommunicatorsComeAndGoWithFlatMemory) {
  EpConfig config;
  config.hidden = 7168;
  config.max_tokens_per_rank = 1024;
  std::vector<double> vm, shm;
  double live_shm = 0;  // while a buffer exists: the measure must see it, or a flat reading proves nothing
  std::vector<std::string> const failures = run_ranks(2, [&](int rank, std::shared_ptr<Communicator> const& comm) {
    for (int cycle = 0; cycle < 20; ++cycle) {
      {
        EpBuffer buffer(comm, config);
        comm->barrier();
        if (rank == 0 && cycle == 0) live_shm = shm_mapped_mib();
      }
      comm->barrier();
      if (rank == 0) {
        vm.push_back(vm_size_mib());
        shm.push_back(shm_mapped_mib());
      }
      comm->barrier();
    }
  });
  expect_all_passed(failures);
  ASSERT_EQ(vm.size(), 20u);
  double const buffer_mib = 2 * 2 * (2048.0 * 7168 * 2 * 2) / (1 << 20);  // 2 ranks' copies x (rows + combine rows)
  EXPECT_LT(vm.back() - vm.front(), 64.0) << "VmSize " << vm.front() << " -> " << vm.back() << " MiB over 19 cycles";
  EXPECT_LT(shm.back() - shm.front(), 64.0) << "/dev/shm " << shm.front() << " -> " << shm.back() << " MiB";
  EXPECT_GT(buffer_mib, 64.0) << "the bound must be smaller than one buffer, or a leak of one per cycle would pass";
  EXPECT_GT(live_shm - shm.front(), 100.0) << "a live buffer's shared memory (" << live_shm << " MiB mapped) is not "
                                           << "seen by the measure";

  // communicators with a buffer each (NOTE: VmSize may also grow by a malloc arena of 64 MiB per new thread; shared
  // memory may not grow at all)
  double const vm_before = vm_size_mib();
  double const shm_before = shm_mapped_mib();
  for (int cycle = 0; cycle < 10; ++cycle) {
    expect_all_passed(
        run_ranks(2, [&](int, std::shared_ptr<Communicator> const& comm) { EpBuffer buffer(comm, config); }));
  }
  EXPECT_LT(shm_mapped_mib() - shm_before, 16.0) << "/dev/shm " << shm_before << " -> " << shm_mapped_mib() << " MiB";
  EXPECT_LT(vm_size_mib() - vm_before, 192.0) << "VmSize " << vm_before << " -> " << vm_size_mib() << " MiB over 10 "
                                              << "communicators";
}

// A segment left by a rank 0 that was killed between creating it and the unlink that follows every rank's mapping
// (SIGKILL cannot be caught): the next cpu communicator removes it, with a log line. The dead creator is a child
// process that creates a segment with the communicator's naming and kills itself.
TEST(Lifecycle, StaleSegmentsOfDeadProcessesAreSweptAtTheNextStart) {
  pid_t const child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::string const name = concat("/ferry-", getpid(), "-00000000deadbeef-0");
    int const fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd >= 0 && ftruncate(fd, 1 << 20) == 0) raise(SIGKILL);
    _exit(3);
  }
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "the child did not create its segment";
  std::string const path = concat("/dev/shm/ferry-", child, "-00000000deadbeef-0");
  ASSERT_TRUE(std::ifstream(path).good()) << path;
  // older than any creation window (the sweep leaves younger names alone)
  struct timespec const old_times[2] = {{time(nullptr) - 3600, 0}, {time(nullptr) - 3600, 0}};
  ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), old_times, 0), 0);
  testing::internal::CaptureStderr();
  expect_all_passed(run_ranks(1, [](int, std::shared_ptr<Communicator> const&) {}));
  std::string const log = testing::internal::GetCapturedStderr();
  EXPECT_FALSE(std::ifstream(path).good()) << path << " is still there";
  // NOTE: a cpu communicator of another test process (ctest -j) may have swept it in the moment between the age
  // change and this start; then this process logs nothing, and only the file's absence is this test's to check
  if (!contains(log, concat("left by process ", child)))
    std::printf("note: the segment was swept by another process before this one's communicator started\n");
}

// A refusal the refusing rank's host did not post (a low-latency combine refused on the device after its dispatch
// dropped entries past expert_capacity) says what it may be, naming that rank; a posted reason is quoted as is.
TEST(RefusalMessages, AnUnpostedCombineRefusalPointsAtTheDrop) {
  std::string const unposted = detail::describe_refusal(5, WaitPhase::ll_combine, "");
  EXPECT_NE(unposted.find("rank 5 refused this call on input"), std::string::npos) << unposted;
  EXPECT_NE(unposted.find("rank 5's dispatch may have dropped entries past expert_capacity"), std::string::npos)
      << unposted;
  std::string const posted = detail::describe_refusal(5, WaitPhase::ll_combine, "x is null");
  EXPECT_NE(posted.find("x is null"), std::string::npos) << posted;
  EXPECT_EQ(posted.find("expert_capacity"), std::string::npos) << posted;
  std::string const dispatch = detail::describe_refusal(5, WaitPhase::ll_dispatch, "");
  EXPECT_NE(dispatch.find("(no reason posted)"), std::string::npos) << dispatch;
}

}  // namespace
}  // namespace ferry
