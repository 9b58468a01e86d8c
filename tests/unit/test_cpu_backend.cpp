// The cpu backend: the communicator (POSIX shared memory, bounded barrier, failure state) with ranks as threads
// (LocalBootstrap), and EpBuffer dispatch / combine with ranks as processes (SocketBootstrap through ferry's
// launcher) compared bit for bit with ref::.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

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

using Clock = std::chrono::steady_clock;
using detail::concat;

using test::contains;
using test::expect_input_error;
using test::ScopedEnv;
using test::test_seed;  // fresh per run and printed; FERRY_TEST_SEED replays one

std::size_t at(int64_t row, int64_t width) {
  return static_cast<std::size_t>(row * width);
}

// Ranks as threads (test::run_cpu_ranks), fn taking the communicator by reference.
std::vector<std::string> run_threads(int world, std::function<void(int, Communicator&)> const& fn) {
  return test::run_cpu_ranks(world, [&fn](int rank, std::shared_ptr<Communicator> const& comm) { fn(rank, *comm); });
}

void expect_all_passed(std::vector<std::string> const& failures) {
  for (std::size_t r = 0; r < failures.size(); ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

// --- the communicator, ranks as threads -------------------------------------------------------------------------

TEST(CpuCommunicator, SymmetricMemoryIsZeroedSharedAndOrderedByTheBarrier) {
  for (int world : {1, 3, 4}) {
    expect_all_passed(run_threads(world, [world](int rank, Communicator& comm) {
      FERRY_CHECK(comm.backend() == Backend::cpu && comm.device() == -1, "backend/device");
      FERRY_CHECK(comm.rank() == rank && comm.world() == world, "rank/world");
      SymmetricRegion const region = comm.alloc_symmetric(10000);
      FERRY_CHECK(region.view.bytes == 12288, "rounded to pages: ", region.view.bytes);
      FERRY_CHECK(region.local == region.of(rank) && region.local == region.view.peer(rank),
                  "local is this rank's copy");
      auto const* mine = static_cast<unsigned char const*>(region.local);
      FERRY_CHECK(std::all_of(mine, mine + region.view.bytes, [](unsigned char b) { return b == 0; }), "zeroed");
      comm.barrier();  // everyone has checked before anyone writes
      // Each rank writes a word into every peer's copy, then reads what every peer wrote into its own.
      for (int round = 1; round <= 20; ++round) {
        for (int p = 0; p < world; ++p) reinterpret_cast<int64_t*>(region.of(p))[rank] = int64_t{round} * 1000 + rank;
        comm.barrier();
        for (int p = 0; p < world; ++p) {
          int64_t const seen = reinterpret_cast<int64_t const*>(region.local)[p];
          FERRY_CHECK(seen == int64_t{round} * 1000 + p, "round ", round, ": slot ", p, " holds ", seen);
        }
        comm.barrier();
      }
      DeviceView const& view = comm.device_view();
      FERRY_CHECK(view.rank == rank && view.world == world && view.error != nullptr && view.barrier_epoch &&
                      *view.barrier_epoch == 41 && view.timeout_ns > 0,
                  "device view");
      comm.check_errors();
      FERRY_CHECK(!comm.failed(), "not failed");
    }));
  }
}

TEST(CpuCommunicator, RefusesMismatchedSizesZeroBytesAndStreams) {
  std::vector<std::string> const failures = run_threads(2, [](int rank, Communicator& comm) {
    try {
      comm.alloc_symmetric(rank == 0 ? 4096 : 8192);
      FERRY_THROW(Error, "test", "mismatched sizes accepted");
    } catch (ConfigError const& error) {
      FERRY_CHECK(contains(error.what(), "4096") && contains(error.what(), "8192"), error.what());
    }
    try {
      comm.alloc_symmetric(0);
      FERRY_THROW(Error, "test", "0 bytes accepted");
    } catch (ConfigError const&) {
    }
    try {
      comm.barrier(reinterpret_cast<cudaStream_t>(0x10));
      FERRY_THROW(Error, "test", "stream accepted");
    } catch (InputError const& error) {
      FERRY_CHECK(contains(error.what(), "stream must be null"), error.what());
    }
    comm.alloc_symmetric(100);  // still usable
    comm.barrier();
  });
  expect_all_passed(failures);
}

TEST(CpuCommunicator, BarrierTimeoutNamesTheMissingRankAndFailsTheCommunicator) {
  ScopedEnv const timeout("FERRY_TIMEOUT_S", "1");
  std::vector<std::string> const failures = run_threads(3, [](int rank, Communicator& comm) {
    if (rank == 2) return;  // never arrives
    auto const start = Clock::now();
    try {
      comm.barrier();
      FERRY_THROW(Error, "test", "barrier passed without rank 2");
    } catch (TimeoutError const& error) {
      double const waited = std::chrono::duration<double>(Clock::now() - start).count();
      FERRY_CHECK(waited >= 0.9 && waited < 10.0, "waited ", waited, " s for a 1 s timeout");
      FERRY_CHECK(contains(error.what(), "waiting for rank(s) 2") && contains(error.what(), "barrier"), error.what());
    }
    FERRY_CHECK(comm.failed(), "not marked failed");
    DeviceErrorBlock const& block = *comm.device_view().error;
    FERRY_CHECK(block.status == 2 && block.rank == rank && block.peer == 2 &&
                    block.phase == static_cast<int32_t>(WaitPhase::barrier),
                "error block");
    for (auto const& call :
         std::vector<std::function<void()>>{[&] { comm.barrier(); }, [&] { comm.alloc_symmetric(64); },
                                            [&] { comm.check_errors(); }, [&] { comm.ensure_usable(); }}) {
      try {
        call();
        FERRY_THROW(InputError, "test", "a call on a failed communicator passed");
      } catch (InputError const&) {
        throw;
      } catch (Error const& error) {
        FERRY_CHECK(contains(error.what(), "failed earlier") && contains(error.what(), "waiting for rank(s) 2"),
                    error.what());
      }
    }
  });
  expect_all_passed(failures);
}

TEST(CpuCommunicator, DroppedRowsAreReportedOnceAsInputError) {
  expect_all_passed(run_threads(1, [](int, Communicator& comm) {
    comm.device_view().error->overflow_rows = 3;
    try {
      comm.check_errors();
      FERRY_THROW(Error, "test", "no InputError");
    } catch (InputError const& error) {
      FERRY_CHECK(contains(error.what(), "3 row(s)") && contains(error.what(), "max_recv_tokens"), error.what());
    }
    comm.check_errors();  // reported once; the communicator stays usable
    comm.barrier();
  }));
}

// The cpu backend with ranks as threads: a quick end-to-end check that needs no process launch.
TEST(CpuEpThreads, DispatchAndCombineMatchTheReference) {
  int const world = 3;
  EpConfig const config{.hidden = 32, .num_experts = 12, .topk = 3, .max_tokens_per_rank = 20, .expert_capacity = 60};
  RoutingOptions routing;
  routing.seed = test_seed();
  routing.mask_rate = 0.2;
  std::vector<int> const tokens = {20, 0, 7};
  std::vector<ref::RankInput> const inputs = ref::generate_inputs(config, world, routing, tokens);
  std::vector<ref::RankDispatch> want;
  for (int d = 0; d < world; ++d) want.push_back(ref::dispatch(config, world, d, inputs));
  std::vector<std::vector<uint16_t>> identity;
  for (int d = 0; d < world; ++d) identity.push_back(ref::expand(config, world, want[static_cast<std::size_t>(d)]));

  expect_all_passed(test::run_cpu_ranks(world, [&](int r, std::shared_ptr<Communicator> const& comm) {
    EpBuffer buffer(comm, config);
    ref::RankInput const& in = inputs[static_cast<std::size_t>(r)];
    DispatchResult const result = buffer.dispatch(test::host_dispatch_args(in, /*expand=*/true));
    ref::RankDispatch const& w = want[static_cast<std::size_t>(r)];
    FERRY_CHECK(*result.num_recv == w.num_recv, "num_recv");
    FERRY_CHECK(std::memcmp(result.recv_x, w.recv_x.data(), at(w.num_recv, config.hidden) * 2) == 0, "recv_x");
    FERRY_CHECK(std::memcmp(result.recv_src, w.recv_src.data(), at(w.num_recv, 2) * 4) == 0, "recv_src");
    std::vector<uint16_t> y(at(in.num_tokens, config.hidden) + 8, 0xdead);
    CombineArgs combine;
    combine.x = result.expert_x;
    combine.y = y.data();
    buffer.combine(combine);
    std::vector<uint16_t> const want_y = ref::combine_expert_major(config, world, r, inputs, want, identity);
    FERRY_CHECK(std::equal(want_y.begin(), want_y.end(), y.begin()), "y differs");
    FERRY_CHECK(std::all_of(y.begin() + static_cast<std::ptrdiff_t>(want_y.size()), y.end(),
                            [](uint16_t v) { return v == 0xdead; }),
                "wrote past y");
  }));
}

// explain() describes the last dispatch and combine as they ran (built when asked, from what the calls recorded): each
// kind of leg, both modes, the hook's split halves and the backward legs.
TEST(CpuEpThreads, ExplainDescribesTheLastLegsAsTheyRan) {
  EpConfig config{.hidden = 32, .num_experts = 4, .topk = 2, .max_tokens_per_rank = 4, .expert_capacity = 8};
  RoutingOptions routing;
  routing.seed = test_seed();
  std::vector<int> const tokens = {4};
  std::vector<ref::RankInput> const inputs = ref::generate_inputs(config, 1, routing, tokens);
  expect_all_passed(test::run_cpu_ranks(1, [&](int, std::shared_ptr<Communicator> const& comm) {
    ref::RankInput const& in = inputs[0];
    DispatchArgs args = test::host_dispatch_args(in);
    std::vector<uint16_t> y(at(in.num_tokens, config.hidden));
    auto const expect_explain = [](EpBuffer const& buffer, std::string const& want, char const* after) {
      FERRY_CHECK(buffer.explain() == want, "after ", after, ": explain() is\n", buffer.explain(), "\nnot\n", want);
    };
    std::string const push = "dispatch: cpu reference (host push through shared memory, rank-major";
    std::string const pull = "cpu reference (host pull-reduce through shared memory, ";

    EpBuffer normal(comm, config);
    expect_explain(normal, "dispatch: not called yet\ncombine: not called yet", "construction");
    DispatchResult const result = normal.dispatch(args);
    expect_explain(normal, push + ")\ncombine: not called yet", "a rank-major dispatch");
    CombineArgs combine;
    combine.x = result.recv_x;
    combine.layout = CombineLayout::rank_major;
    combine.y = y.data();
    normal.combine(combine);
    expect_explain(normal, push + ")\ncombine: " + pull + "rank_major)", "its combine");
    DispatchHandle handle = normal.make_handle();
    args.save_handle = &handle;
    args.expand = true;
    DispatchResult const expanded = normal.dispatch(args);
    args.save_handle = nullptr;
    expect_explain(normal, push + " + expand)\ncombine: " + pull + "rank_major)", "an expanding dispatch");
    // the expert outputs, kept apart from the buffer (the backward legs deliver into it)
    std::vector<uint16_t> const outputs(static_cast<uint16_t const*>(expanded.expert_x),
                                        static_cast<uint16_t const*>(expanded.expert_x) +
                                            at(config.num_local_experts(1) * expanded.expert_slots, config.hidden));
    std::vector<uint16_t> const grad(at(*expanded.num_recv, config.hidden), 0x3f80);
    combine.x = outputs.data();
    combine.layout = CombineLayout::expert_major;
    normal.combine(combine);
    expect_explain(normal, push + " + expand)\ncombine: " + pull + "expert_major)", "an expert-major combine");
    DispatchBackwardArgs backward;
    backward.handle = &handle;
    backward.grad = grad.data();
    backward.grad_x = y.data();
    normal.dispatch_backward(backward);
    std::string const grads = "dispatch_backward (combine of gradients): " + pull + "rank_major)";
    expect_explain(normal, push + " + expand)\n" + grads, "dispatch_backward");
    // rank-major, combine_backward is a cached dispatch of grad_y (and says so); expert-major it adds the weight step
    CombineBackwardArgs combine_backward;
    combine_backward.handle = &handle;
    combine_backward.layout = CombineLayout::rank_major;
    combine_backward.grad_y = y.data();
    normal.combine_backward(combine_backward);
    expect_explain(normal, push + ")\n" + grads, "a rank-major combine_backward");
    std::vector<float> grad_w(at(in.num_tokens, config.topk));
    combine_backward.layout = CombineLayout::expert_major;
    combine_backward.x = outputs.data();
    combine_backward.grad_topk_weights = grad_w.data();
    normal.combine_backward(combine_backward);
    expect_explain(normal, "combine_backward (cached dispatch of grad_y + weight step): cpu reference\n" + grads,
                   "an expert-major combine_backward");

    config.mode = Mode::low_latency;
    EpBuffer ll(comm, config);
    args.expand = false;
    args.return_recv_hook = true;
    ll.dispatch(args);
    DispatchResult const landed = ll.complete_dispatch();
    std::string const ll_push = "dispatch: cpu reference, ll (host push through shared memory + expert-major";
    expect_explain(ll, ll_push + ", split: receive half in complete_dispatch)\ncombine: not called yet",
                   "a low-latency dispatch with the hook");
    combine.x = landed.expert_x;
    combine.return_recv_hook = true;
    ll.combine(combine);
    ll.complete_combine();
    expect_explain(ll,
                   ll_push +
                       ", split: receive half in complete_dispatch)\ncombine: cpu reference, ll (host "
                       "pull-reduce through shared memory, expert_major, split: sum in complete_combine)",
                   "its combine with the hook");
  }));
}

// --- EpBuffer, ranks as processes ---------------------------------------------------------------------------------

// One configuration the rank processes run; every process builds the same list from (world, seed).
struct SubCase {
  std::string name;
  EpConfig config;
  RoutingOptions routing;
  std::vector<int> tokens;  // per rank
  IndexType index_type = IndexType::int64;
  bool eager = true;
};

std::vector<SubCase> sub_cases(int world, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<SubCase> list;
  auto add = [&](std::string name, int hidden, int num_experts, int topk, int max_tokens, RoutingKind kind, double mask,
                 int shared, IndexType index_type) -> SubCase& {
    SubCase c;
    c.name = std::move(name);
    c.config.hidden = hidden;
    c.config.num_experts = num_experts;
    c.config.topk = topk;
    c.config.max_tokens_per_rank = max_tokens;
    c.config.expert_capacity = world * max_tokens;
    c.routing.kind = kind;
    c.routing.mask_rate = mask;
    c.routing.shared_experts = shared;
    c.routing.expert_groups = 8;
    c.routing.topk_groups = 4;
    c.routing.hot_expert = num_experts - 1;
    c.routing.seed = rng();
    c.index_type = index_type;
    for (int r = 0; r < world; ++r) c.tokens.push_back(static_cast<int>(rng() % (max_tokens + 1)));
    // one rank without tokens (rotating), another with the maximum
    if (world > 1) c.tokens[list.size() % world] = 0;
    c.tokens[(list.size() + 1) % world] = max_tokens;
    list.push_back(c);
    return list.back();
  };
  int const experts = std::max(32, 8 * world);
  add("random topk4", 64, experts, 4, 40, RoutingKind::random, 0.0, 0, IndexType::int64);
  add("ring topk3 int32", 128, experts, 3, 24, RoutingKind::ring, 0.0, 0, IndexType::int32);
  add("grouped topk9 masked", 64, experts, 9, 32, RoutingKind::grouped, 0.15, 0, IndexType::int64);
  add("hot topk1 + shared", 32, experts, 2, 30, RoutingKind::hot, 0.3, 1, IndexType::int32);
  add("random topk1", 256, experts, 1, 16, RoutingKind::random, 0.0, 0, IndexType::int64);
  add("random topk9 heavy mask", 48, experts, 9, 20, RoutingKind::random, 0.6, 0, IndexType::int64);
  SubCase& capped = add("capacity drops", 64, experts, 6, 40, RoutingKind::hot, 0.0, 0, IndexType::int64);
  capped.config.max_recv_tokens = 30;
  capped.config.expert_capacity = 7;
  capped.eager = false;  // the result is kept; check_errors reports the drops
  SubCase& empty = add("no tokens anywhere", 64, experts, 4, 8, RoutingKind::random, 0.0, 0, IndexType::int64);
  std::fill(empty.tokens.begin(), empty.tokens.end(), 0);
  return list;
}

// First difference of two byte ranges, "" when equal.
std::string compare(char const* what, void const* got, void const* want, std::size_t bytes, std::size_t elem) {
  if (bytes == 0 || std::memcmp(got, want, bytes) == 0) return "";
  auto const* g = static_cast<unsigned char const*>(got);
  auto const* w = static_cast<unsigned char const*>(want);
  std::size_t i = 0;
  while (g[i] == w[i]) ++i;
  return concat(what, " differs first at element ", i / elem);
}

constexpr uint16_t kPoison16 = 0xa5a5;

std::string check_poison(char const* what, void const* data, std::size_t bytes) {
  auto const* p = static_cast<unsigned char const*>(data);
  for (std::size_t i = 0; i < bytes; ++i)
    if (p[i] != 0xa5) return concat(what, ": byte ", i, " past the written rows was overwritten");
  return "";
}

// Runs one sub-case on this rank; returns what differed (empty when all matched). Every rank makes every collective
// call whatever it finds, so a mismatch on one rank never leaves the others waiting.
std::vector<std::string> run_sub_case(std::shared_ptr<Communicator> const& comm, SubCase const& c, uint64_t seed) {
  int const world = comm->world();
  int const rank = comm->rank();
  EpConfig const& config = c.config;
  int const hidden = config.hidden;
  int const topk = config.topk;
  int const num_local = config.num_local_experts(world);
  int const slots = config.expert_slots();
  std::vector<std::string> problems;
  auto note = [&](std::string const& problem) {
    if (!problem.empty()) problems.push_back(problem);
  };
  std::vector<ref::RankInput> inputs = ref::generate_inputs(config, world, c.routing, c.tokens);
  // The last token of every rank goes nowhere: its y must be 0.
  for (auto& in : inputs) {
    if (in.num_tokens == 0) continue;
    std::fill_n(in.topk_idx.end() - topk, topk, -1);
    std::fill_n(in.topk_weights.end() - topk, topk, 0.0f);
  }
  std::vector<ref::RankDispatch> want;
  for (int d = 0; d < world; ++d) want.push_back(ref::dispatch(config, world, d, inputs));
  ref::RankInput const& in = inputs[static_cast<std::size_t>(rank)];
  ref::RankDispatch const& mine = want[static_cast<std::size_t>(rank)];
  // a drop anywhere is reported on every rank, with the total over the ranks and the first rank that dropped
  ref::CallDrops const drops = ref::call_drops(want, std::vector<bool>(static_cast<std::size_t>(world), true));
  auto expect_drop_report = [&] {
    try {
      comm->check_errors();
      if (drops.rows > 0) note("the dropped rows were not reported on this rank");
    } catch (InputError const& error) {
      if (drops.rows == 0) note(concat("InputError without drops: ", error.what()));
      if (!contains(error.what(), concat(drops.rows, " row(s) were not delivered because rank ", drops.first_rank)))
        note(concat("drop report does not give the count ", drops.rows, " and rank ", drops.first_rank, ": ",
                    error.what()));
    }
  };

  EpBuffer buffer(comm, config);
  std::vector<int32_t> narrow(in.topk_idx.begin(), in.topk_idx.end());
  DispatchArgs args;
  args.x = in.x.data();
  args.num_tokens = in.num_tokens;
  args.topk_idx = c.index_type == IndexType::int64 ? static_cast<void const*>(in.topk_idx.data()) : narrow.data();
  args.topk_idx_type = c.index_type;
  args.topk_weights = in.topk_weights.data();
  args.expand = true;
  args.eager = c.eager;

  // 1. a first dispatch shows where the outputs live; poison all of them, then the dispatch under test
  DispatchResult result = buffer.dispatch(args);
  expect_drop_report();
  int const capacity = result.recv_capacity;
  std::memset(result.recv_x, 0xa5, at(capacity, hidden) * 2);
  std::memset(result.recv_topk_idx, 0xa5, at(capacity, topk) * 4);
  std::memset(result.recv_topk_weights, 0xa5, at(capacity, topk) * 4);
  std::memset(result.recv_src, 0xa5, at(capacity, 2) * 4);
  std::memset(result.expert_x, 0xa5, at(static_cast<int64_t>(num_local) * slots, hidden) * 2);
  result = buffer.dispatch(args);
  expect_drop_report();

  // 2. rank-major rows, their metadata, and nothing past them
  if (capacity != config.recv_capacity(world)) note("recv_capacity");
  if (*result.num_recv != mine.num_recv || result.num_recv_host != mine.num_recv)
    note(concat("num_recv ", *result.num_recv, " (host ", result.num_recv_host, "), want ", mine.num_recv));
  int const n = mine.num_recv;
  note(compare("recv_x", result.recv_x, mine.recv_x.data(), at(n, hidden) * 2, 2));
  note(compare("recv_topk_idx", result.recv_topk_idx, mine.recv_topk_idx.data(), at(n, topk) * 4, 4));
  note(compare("recv_topk_weights", result.recv_topk_weights, mine.recv_topk_weights.data(), at(n, topk) * 4, 4));
  note(compare("recv_src", result.recv_src, mine.recv_src.data(), at(n, 2) * 4, 4));
  note(compare("expert_counts", result.expert_counts, mine.expert_counts.data(), at(num_local, 4), 4));
  note(compare("expert_src_row", result.expert_src_row, mine.expert_src_row.data(), at(num_local, slots) * 4, 4));
  note(check_poison("recv_x", static_cast<char*>(result.recv_x) + at(n, hidden) * 2, at(capacity - n, hidden) * 2));
  note(check_poison("recv_topk_idx", result.recv_topk_idx + at(n, topk), at(capacity - n, topk) * 4));
  note(check_poison("recv_topk_weights", result.recv_topk_weights + at(n, topk), at(capacity - n, topk) * 4));
  note(check_poison("recv_src", result.recv_src + at(n, 2), at(capacity - n, 2) * 4));
  if (result.expert_slots != slots) note("expert_slots");

  // 3. expert-major slots: filled ones hold their row, the others keep the poison
  std::vector<uint16_t> const expanded = ref::expand(config, world, mine);
  for (int e = 0; e < num_local; ++e) {
    int const filled = std::min(mine.expert_counts[static_cast<std::size_t>(e)], slots);
    std::size_t const base = at(static_cast<int64_t>(e) * slots, hidden);
    auto const* got = static_cast<uint16_t const*>(result.expert_x) + base;
    if (auto problem = compare("expert_x", got, expanded.data() + base, at(filled, hidden) * 2, 2); !problem.empty())
      note(concat(problem, " (expert ", e, ")"));
    if (auto problem = check_poison("expert_x", got + at(filled, hidden), at(slots - filled, hidden) * 2);
        !problem.empty())
      note(concat(problem, " (expert ", e, ")"));
  }

  // 4. no combine over a layout that dropped rows: refused on every rank (the lazy dispatch's report was consumed
  //    above), and the refusal is all a combine of it returns
  std::vector<uint16_t> y(at(in.num_tokens + 1, hidden), kPoison16);
  CombineArgs combine;
  if (drops.rows > 0) {
    std::vector<uint16_t> const dummy_rows(at(static_cast<int64_t>(num_local) * slots + 1, hidden));
    combine.layout = CombineLayout::expert_major;
    combine.x = dummy_rows.data();
    combine.y = y.data();
    note(expect_input_error([&] { buffer.combine(combine); },
                            {"combine refers to a dispatch that did not deliver ", concat(drops.rows, " row(s)")}));
    if (std::any_of(y.begin(), y.end(), [](uint16_t v) { return v != kPoison16; })) note("a refused combine wrote y");
    return problems;
  }

  // 5. expert-major combine of arbitrary expert outputs (every rank can build every rank's)
  std::vector<std::vector<uint16_t>> expert_out;
  for (int d = 0; d < world; ++d) expert_out.push_back(generate_tokens(seed ^ 0xe0e0, d, num_local * slots, hidden));
  combine.layout = CombineLayout::expert_major;
  combine.x = expert_out[static_cast<std::size_t>(rank)].data();
  combine.y = y.data();
  buffer.combine(combine);
  std::vector<uint16_t> want_y = ref::combine_expert_major(config, world, rank, inputs, want, expert_out);
  note(compare("y (expert_major)", y.data(), want_y.data(), want_y.size() * 2, 2));
  note(check_poison("y", y.data() + want_y.size(), at(hidden, 2)));
  if (in.num_tokens > 0 && !std::all_of(want_y.end() - hidden, want_y.end(), [](uint16_t v) { return v == 0; }))
    note("a token without experts did not get 0");

  // 6. rank-major combine of arbitrary rows
  std::vector<std::vector<uint16_t>> rows;
  for (int d = 0; d < world; ++d)
    rows.push_back(generate_tokens(seed ^ 0x7070, d, want[static_cast<std::size_t>(d)].num_recv, hidden));
  std::vector<uint16_t> const dummy(8);  // x must be non-null even with no rows
  std::fill(y.begin(), y.end(), kPoison16);
  combine.layout = CombineLayout::rank_major;
  combine.x = rows[static_cast<std::size_t>(rank)].empty() ? dummy.data() : rows[static_cast<std::size_t>(rank)].data();
  buffer.combine(combine);
  want_y = ref::combine_rank_major(config, world, rank, inputs, want, rows);
  note(compare("y (rank_major)", y.data(), want_y.data(), want_y.size() * 2, 2));
  note(check_poison("y", y.data() + want_y.size(), at(hidden, 2)));
  return problems;
}

// copy_received and expert_counts_host (what ferry.deep_ep's fresh outputs are made of): after an eager dispatch the
// counts are on the host, and the first n rows of the rank-major outputs land in the caller's memory (ids widened
// to int64), against the reference row by row, nothing written past n rows; misuse is an InputError naming it.
TEST(CpuEpThreads, CopyReceivedAndHostCountsMatchTheReference) {
  int const world = 2;
  EpConfig config;
  config.hidden = 64;
  config.num_experts = 8;
  config.topk = 3;
  config.max_tokens_per_rank = 16;
  RoutingOptions routing;
  routing.seed = test_seed();
  routing.mask_rate = 0.2;
  std::vector<int> const tokens = {16, 9};
  std::vector<ref::RankInput> const inputs = ref::generate_inputs(config, world, routing, tokens);
  std::vector<ref::RankDispatch> want;
  for (int d = 0; d < world; ++d) want.push_back(ref::dispatch(config, world, d, inputs));
  expect_all_passed(test::run_cpu_ranks(world, [&](int r, std::shared_ptr<Communicator> const& comm) {
    auto fail = [](std::string const& what) { throw std::runtime_error(what); };
    EpBuffer buffer(comm, config);
    ref::RankInput const& in = inputs[static_cast<std::size_t>(r)];
    ref::RankDispatch const& mine = want[static_cast<std::size_t>(r)];
    int const topk = config.topk;
    int const local = config.num_local_experts(world);
    std::vector<int32_t> counts(static_cast<std::size_t>(local), -7);
    DispatchArgs args = test::host_dispatch_args(in);
    args.expert_counts_host = counts.data();
    DispatchResult const result = buffer.dispatch(args);
    if (!std::equal(counts.begin(), counts.end(), mine.expert_counts.begin())) fail("expert_counts_host differ");
    int const n = mine.num_recv;
    std::size_t const hidden = static_cast<std::size_t>(config.hidden);
    std::vector<uint16_t> x(static_cast<std::size_t>(n + 1) * hidden, 0xeeee);
    std::vector<float> w(static_cast<std::size_t>(n + 1) * topk, -3.0f);
    std::vector<int64_t> ids(static_cast<std::size_t>(n + 1) * topk, -9);
    std::vector<int32_t> src(static_cast<std::size_t>(n + 1) * 2, -5);
    ReceivedCopy to;
    to.rows = n;
    to.recv_x = x.data();
    to.recv_topk_weights = w.data();
    to.recv_topk_idx = ids.data();
    to.recv_topk_idx_type = IndexType::int64;
    to.recv_src = src.data();
    buffer.copy_received(to);
    if (!std::equal(mine.recv_src.begin(), mine.recv_src.end(), src.begin())) fail("recv_src differs");
    if (src[static_cast<std::size_t>(n) * 2] != -5) fail("recv_src written past the rows asked for");
    if (std::memcmp(x.data(), mine.recv_x.data(), static_cast<std::size_t>(n) * hidden * 2) != 0)
      fail("recv_x rows differ");
    for (std::size_t i = 0; i < static_cast<std::size_t>(n) * topk; ++i) {
      if (ids[i] != mine.recv_topk_idx[i]) fail(concat("id ", i, " is ", ids[i]));
      if (w[i] != result.recv_topk_weights[i]) fail(concat("weight ", i));
    }
    if (x[static_cast<std::size_t>(n) * hidden] != 0xeeee || ids[static_cast<std::size_t>(n) * topk] != -9 ||
        w[static_cast<std::size_t>(n) * topk] != -3.0f)
      fail("written past the rows asked for");
    // misuse (local: no peer waits)
    ReceivedCopy bad = to;
    bad.rows = result.recv_capacity + 1;
    std::string problem =
        expect_input_error([&] { buffer.copy_received(bad); }, {"copy_received rows=", "recv_capacity="});
    if (!problem.empty()) fail(problem);
    bad = to;
    bad.recv_scales = x.data();
    problem = expect_input_error([&] { buffer.copy_received(bad); }, {"recv_scales is set", "bf16 rows"});
    if (!problem.empty()) fail(problem);
    DispatchArgs lazy = args;
    lazy.eager = false;
    problem = expect_input_error([&] { buffer.dispatch(lazy); }, {"expert_counts_host is set on a lazy call"});
    if (!problem.empty()) fail(problem);
  }));
}

// copy_rank_counts: the count matrix of the dispatch a handle saved, [s * world + d] = rows s sent to d, against the
// reference's rows per (source, destination), and still the handle's after a later dispatch of other tokens.
TEST(CpuEpThreads, HandlesKeepTheCountMatrixOfTheirDispatch) {
  int const world = 3;
  EpConfig config;
  config.hidden = 32;
  config.num_experts = 6;
  config.topk = 2;
  config.max_tokens_per_rank = 12;
  RoutingOptions routing;
  routing.seed = test_seed();
  routing.mask_rate = 0.1;
  std::vector<int> const tokens = {12, 5, 0};
  std::vector<int> const later_tokens = {3, 12, 7};
  std::vector<ref::RankInput> const inputs = ref::generate_inputs(config, world, routing, tokens);
  std::vector<ref::RankInput> const later = ref::generate_inputs(config, world, routing, later_tokens);
  std::vector<int32_t> want(static_cast<std::size_t>(world * world), 0);
  for (int d = 0; d < world; ++d) {
    ref::RankDispatch const got = ref::dispatch(config, world, d, inputs);
    for (int i = 0; i < got.num_recv; ++i)
      ++want[static_cast<std::size_t>(got.recv_src[static_cast<std::size_t>(i * 2)] * world + d)];
  }
  expect_all_passed(test::run_cpu_ranks(world, [&](int r, std::shared_ptr<Communicator> const& comm) {
    EpBuffer buffer(comm, config);
    DispatchHandle h = buffer.make_handle();
    DispatchArgs args = test::host_dispatch_args(inputs[static_cast<std::size_t>(r)]);
    args.save_handle = &h;
    buffer.dispatch(args);
    buffer.dispatch(test::host_dispatch_args(later[static_cast<std::size_t>(r)]));
    std::vector<int32_t> got(static_cast<std::size_t>(world * world), -1);
    buffer.copy_rank_counts(h, got.data());
    FERRY_CHECK(got == want, "rank ", r, ": the handle's count matrix differs from the reference's");
    DispatchHandle empty = buffer.make_handle();
    std::string const problem =
        expect_input_error([&] { buffer.copy_rank_counts(empty, got.data()); }, {"holds no layout yet"});
    FERRY_CHECK(problem.empty(), problem);
  }));
}

FERRY_RANK_CASE(cpu_ep_matches_reference) {
  uint64_t const seed = test::seed_arg();
  std::shared_ptr<Communicator> const comm = test::connect_rank(Backend::cpu);
  int failures = 0;
  for (SubCase const& c : sub_cases(comm->world(), seed)) {
    for (std::string const& problem : run_sub_case(comm, c, seed)) {
      std::fprintf(stderr, "rank %d, world %d, sub-case '%s': %s\n", comm->rank(), comm->world(), c.name.c_str(),
                   problem.c_str());
      ++failures;
    }
  }
  return failures == 0 ? 0 : 1;
}

test::RankCaseOptions case_options(uint64_t seed, char const* timeout_s = "10") {
  test::RankCaseOptions options;
  options.args = {concat("--seed=", seed)};
  options.env = {{"FERRY_TIMEOUT_S", timeout_s}};
  options.timeout = std::chrono::seconds(120);
  return options;
}

class CpuEpWorld : public testing::TestWithParam<int> {};

TEST_P(CpuEpWorld, EveryRoutingMatchesTheReferenceBitForBit) {
  int const world = GetParam();
  LaunchResult const result = test::run_rank_case("cpu_ep_matches_reference", world, case_options(test_seed()));
  EXPECT_TRUE(result.ok()) << result.describe() << " (seed " << test_seed() << ")";
}

INSTANTIATE_TEST_SUITE_P(Worlds, CpuEpWorld, testing::Values(1, 2, 4, 8));

FERRY_RANK_CASE(cpu_ep_bad_input) {
  std::shared_ptr<Communicator> const comm = test::connect_rank(Backend::cpu);
  int const rank = comm->rank();
  int const world = comm->world();
  EpConfig config;
  config.hidden = 32;
  config.num_experts = 16;
  config.topk = 4;
  config.max_tokens_per_rank = 8;
  config.expert_capacity = 32;
  RoutingOptions routing;
  routing.seed = test::seed_arg();
  std::vector<ref::RankInput> const inputs = ref::generate_inputs(config, world, routing, std::vector<int>(world, 8));
  ref::RankInput const& in = inputs[static_cast<std::size_t>(rank)];
  EpBuffer buffer(comm, config);
  std::vector<int64_t> ids = in.topk_idx;
  DispatchArgs args;
  args.x = in.x.data();
  args.num_tokens = 8;
  args.topk_idx = ids.data();
  args.topk_weights = in.topk_weights.data();
  std::vector<std::string> problems;
  auto note = [&](std::string const& problem) {
    if (!problem.empty()) problems.push_back(problem);
  };
  std::vector<uint16_t> y(at(8, 32));

  // 1. refused on the host before anything is written (every rank passes a bad argument, so none waits)
  note(expect_input_error(
      [&] {
        buffer.combine({CombineLayout::rank_major, y.data(), y.data()});
      },
      {"without a successful dispatch"}));
  args.num_tokens = 9;
  note(expect_input_error([&] { buffer.dispatch(args); }, {"num_tokens=9", "max_tokens_per_rank=8"}));
  args.num_tokens = 8;
  ids[at(5, 4) + 1] = 16;
  note(expect_input_error([&] { buffer.dispatch(args); },
                          {concat("rank ", rank), "topk_idx[5, 1]=16", "[-1, num_experts=16)"}));
  ids[at(5, 4) + 1] = -2;
  note(expect_input_error([&] { buffer.dispatch(args); }, {"topk_idx[5, 1]=-2"}));
  std::vector<int32_t> narrow(in.topk_idx.begin(), in.topk_idx.end());
  narrow[at(7, 4) + 3] = 1 << 30;
  args.topk_idx = narrow.data();
  args.topk_idx_type = IndexType::int32;
  note(expect_input_error([&] { buffer.dispatch(args); }, {"topk_idx[7, 3]=1073741824"}));
  args.expand = true;
  note(expect_input_error([&] { buffer.dispatch(args); }, {"topk_idx[7, 3]"}));

  // 2. the buffer still works, and expert-major combine needs an expanded dispatch
  args.topk_idx = in.topk_idx.data();
  args.topk_idx_type = IndexType::int64;
  args.expand = false;
  DispatchResult const result = buffer.dispatch(args);
  note(expect_input_error(
      [&] {
        buffer.combine({CombineLayout::expert_major, result.recv_x, y.data()});
      },
      {"expand=true"}));
  std::vector<uint16_t> rows(at(std::max<int64_t>(*result.num_recv, 1), 32));
  buffer.combine({CombineLayout::rank_major, rows.data(), y.data()});

  // 3. only rank 1 passes a bad id: the call is refused on every rank (rank 1 its own InputError, the others one
  //    naming rank 1 and its reason), nobody waits, and the buffer goes on in step on every rank
  if (world > 1) {
    ids = in.topk_idx;
    if (rank == 1) ids[0] = 99;
    args.topk_idx = ids.data();
    if (rank == 1)
      note(expect_input_error([&] { buffer.dispatch(args); }, {"topk_idx[0, 0]=99"}));
    else
      note(expect_input_error([&] { buffer.dispatch(args); }, {"rank 1 refused this call", "topk_idx[0, 0]=99"}));
    note(expect_input_error(
        [&] {
          buffer.combine({CombineLayout::rank_major, rows.data(), y.data()});
        },
        {"without a successful dispatch"}));
    args.topk_idx = in.topk_idx.data();
    DispatchResult const again = buffer.dispatch(args);
    if (again.num_recv_host < 0) note("the dispatch after a refused one returned no count");
    buffer.combine({CombineLayout::rank_major, rows.data(), y.data()});
  }

  // 4. rank 1 skips a call: the others wait for it and time out naming it; their communicators are then failed and
  //    say so
  if (world > 1) {
    if (rank != 1) {
      try {
        buffer.dispatch(args);
        note("dispatch passed without rank 1");
      } catch (TimeoutError const& error) {
        if (!contains(error.what(), "waiting for rank(s) 1")) note(concat("timeout message: ", error.what()));
      }
      try {
        buffer.dispatch(args);
        note("a failed communicator accepted a dispatch");
      } catch (TimeoutError const&) {
        note("a failed communicator waited again");
      } catch (Error const& error) {
        if (!contains(error.what(), "failed earlier") || !contains(error.what(), "waiting for rank(s) 1"))
          note(concat("failed-communicator message: ", error.what()));
      }
    }
  }
  for (auto const& problem : problems) std::fprintf(stderr, "rank %d: %s\n", rank, problem.c_str());
  return problems.empty() ? 0 : 1;
}

TEST(CpuEp, BadInputIsRefusedAndAMissingRankIsNamed) {
  LaunchResult const result = test::run_rank_case("cpu_ep_bad_input", 4, case_options(test_seed(), "2"));
  EXPECT_TRUE(result.ok()) << result.describe();
}

}  // namespace
}  // namespace ferry
