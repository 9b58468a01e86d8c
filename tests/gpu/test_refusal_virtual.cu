// Collective refusals on virtual ranks (tests/support/virtual_ranks.hpp; DESIGN "Collective consistency"): a call that
// one rank refuses on input is refused on EVERY rank, the refusing rank still joins the call's exchange with its abort
// flag, nothing waits past its bound, and the NEXT call on every rank is exact. For the normal dispatch over the count
// exchange and over the landing zone, and the low-latency legs (whole, and as hook halves), at worlds 2, 4 and 8, each
// with one rank whose call is refused by:
//  - bad_id: an expert id of 1234 in one token's row (seen on the device: every id check is there);
//  - repeat: a valid id twice in one token's row;
//  - refuse_dispatch / refuse_combine: its host (EpBackendImpl::refuse_*: the launchers' `refuse`, no rows);
//  - drop (mode=ll): no host refuses, but the rank's dispatch drops an entry past expert_capacity, which its receive
//    half alone sees; its combine refuses on the device (as EpBuffer's buffers do: refuse_combine_after_drop), so no
//    rank sums without the entry.
// After the refused leg every other rank must have recorded exactly one refusal naming that rank and nothing else; the
// refusing rank its own input error (bad_id, repeat: the value) or nothing (its host raises the InputError); no rank
// a timeout. A refused dispatch delivers no row anywhere (num_recv 0) and leaves no token for the combine that
// follows on every rank (its y stays poisoned). Then one more iteration on every rank with fresh inputs, checked bit
// for bit against the reference (the protocol's sequence numbers, parities and buffers stayed in step).
// A check that fails: with the abort word's publish taken out of the LL send half (ll/dispatch.cuh), the bad_id rows
// of mode=ll fail at the refusal check: the peers record no refusal and deliver the other ranks' rows (num_recv > 0).
// With combine_refused (ll/params.cuh) ignoring the drop, the drop rows fail there: the peers record no refusal.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "ep/cuda/buffers.hpp"
#include "ep/ep_impl.hpp"
#include "ep/landing_policy.hpp"
#include "ep/reference.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "support/gpu_case.hpp"
#include "support/ll_check.hpp"
#include "support/normal_check.hpp"
#include "support/virtual_ranks.hpp"
#include "workloads/routing.hpp"

namespace ferry::test {
namespace test_refusal_virtual {  // named, not anonymous: FERRY_CI_BUILD compiles several files as one

using cuda_ep::Buffers;
using cuda_ep::Half;

using VirtualNormalRanks = VirtualRanks<Buffers, cuda_ep::allocate_buffers, cuda_ep::free_buffers>;
using VirtualLlRanks = VirtualRanks<Buffers, cuda_ep::allocate_buffers, cuda_ep::free_buffers>;

struct Spec : VirtualSpec {
  std::string mode = "counts";   // counts | landing (normal mode's dispatch protocols) | ll
  bool hook = false;             // ll: each leg as every rank's send half, then every receive half
  std::string fault = "bad_id";  // bad_id | repeat | refuse_dispatch | refuse_combine | drop (mode=ll)
  int faulty = 1;                // the rank whose call is refused
};

Spec parse_spec(std::vector<std::string> const& words) {
  CaseArgs const args(words);
  Spec s;
  s.read_virtual(args);
  s.mode = args.text("mode", s.mode);
  s.hook = args.flag("hook", s.hook);
  s.fault = args.text("fault", s.fault);
  s.faulty = args.integer("faulty", s.faulty);
  FERRY_CHECK(s.faulty >= 0 && s.faulty < s.world, "faulty=", s.faulty, " is not a rank of world ", s.world);
  FERRY_CHECK(s.fault != "drop" || s.mode == "ll", "fault=drop is a low-latency fault, not mode=", s.mode);
  return s;
}

bool dispatch_fault(Spec const& spec) {
  return spec.fault != "refuse_combine";
}

// The faulty rank's ids for bad_id / repeat (one token's row of the reference inputs, changed and uploaded); the value
// its error block must name (-1: none).
int64_t break_ids(Spec const& spec, EpConfig const& config, VirtualIteration& it, VirtualRankIo const& io) {
  if (spec.fault != "bad_id" && spec.fault != "repeat") return -1;
  std::vector<int64_t>& idx = it.inputs[spec.faulty].topk_idx;
  int const topk = config.topk;
  int const t = static_cast<int>(idx.size() / topk) / 2;
  FERRY_CHECK(!idx.empty() && topk >= 2, "the faulty rank needs tokens and topk >= 2");
  int64_t* row = idx.data() + static_cast<std::size_t>(t) * topk;
  int64_t value = 1234;
  if (spec.fault == "bad_id") {
    row[topk - 1] = value;
  } else {
    // a valid id of the row (or expert 3 when all of it is masked) in a second place
    value = row[0] >= 0 ? row[0] : 3;
    row[0] = row[topk - 1] = value;
  }
  upload(io.idx, idx);
  return value;
}

// "" when every rank but `faulty` recorded exactly one refusal naming it and nothing else, `faulty` recorded its input
// error of `bad_value` (or nothing for bad_value -1) and no refusal, and no rank timed out.
std::string check_refusal(std::vector<DeviceErrorBlock> const& blocks, int faulty, int64_t bad_value,
                          double timeout_s) {
  std::string out;
  for (int r = 0; r < static_cast<int>(blocks.size()); ++r) {
    DeviceErrorBlock const& b = blocks[r];
    std::string const who = "rank " + std::to_string(r) + ": ";
    if (b.status != 0)
      out += who + "status " + std::to_string(b.status) + ": " + detail::describe_device_error(b, timeout_s) + "\n";
    if (r == faulty) {
      uint32_t const errors = bad_value >= 0 ? 1u : 0u;
      if (b.input_errors != errors || (errors != 0 && b.first_bad_value != bad_value))
        out += who + "input_errors " + std::to_string(b.input_errors) + " first bad value " +
               std::to_string(b.first_bad_value) + ", expected " + std::to_string(errors) + " naming " +
               std::to_string(bad_value) + "\n";
      if (b.refusals != 0) out += who + "the refusing rank recorded " + std::to_string(b.refusals) + " refusals\n";
    } else {
      if (b.refusals != 1 || b.refusing_rank != faulty)
        out += who + "refusals " + std::to_string(b.refusals) + " naming rank " + std::to_string(b.refusing_rank) +
               ", expected 1 naming rank " + std::to_string(faulty) + "\n";
      if (b.input_errors != 0 || b.overflow_rows != 0)
        out += who + "input_errors " + std::to_string(b.input_errors) + " overflow_rows " +
               std::to_string(b.overflow_rows) + "\n";
    }
  }
  return out;
}

// "" when rank r's rank-major y is still all poison, else that `what` wrote it.
std::string check_y_poisoned(VirtualRankIo const& io, int r, char const* what) {
  std::vector<uint8_t> const y = to_host<uint8_t>(io.y_rm.ptr, io.y_rm.bytes);
  auto const written = std::find_if(y.begin(), y.end(), [](uint8_t v) { return v != 0xEE; });
  if (written == y.end()) return "";
  return "rank " + std::to_string(r) + ": " + what + " wrote y at byte " + std::to_string(written - y.begin()) + "\n";
}

// "" when every rank delivered no row (num_recv 0 on the device) and its y is still all poison.
template <typename State>
std::string check_nothing_moved(std::vector<State*> const& states, std::vector<VirtualRankIo> const& io) {
  std::string out;
  for (std::size_t r = 0; r < states.size(); ++r) {
    int32_t const num_recv = to_host<State>(states[r], 1)[0].num_recv;
    if (num_recv != 0) out += "rank " + std::to_string(r) + ": num_recv " + std::to_string(num_recv) + "\n";
    out += check_y_poisoned(io[r], static_cast<int>(r), "the combine after the refused dispatch");
  }
  return out;
}

// The refused call on every rank (the faulty rank's ids already broken for bad_id / repeat: bad_value), then the
// checks: the refusal recorded as check_refusal wants it; after a refused dispatch, followed by a rank-major combine
// on every rank, no row delivered and no y written anywhere. dispatch_leg(refuse) / combine_leg(refuse) launch the
// leg on every rank (the faulty one refusing when refuse is set); `clean`: the overflow each rank's clean dispatch
// counts (VirtualRanks::synchronize).
template <typename Ranks, typename DispatchLeg, typename CombineLeg>
void refused_call(Spec const& spec, Ranks const& ranks, std::vector<VirtualRankIo> const& io, int64_t bad_value,
                  std::vector<int> const& clean, DispatchLeg const& dispatch_leg, CombineLeg const& combine_leg) {
  CK(cudaDeviceSynchronize());
  if (dispatch_fault(spec)) {
    dispatch_leg(spec.fault == "refuse_dispatch");
    combine_leg(false);
  } else {
    dispatch_leg(false);
    std::string const failure = ranks.synchronize(clean);
    ASSERT_TRUE(failure.empty()) << "the dispatch before the refused combine:\n" << failure;
    combine_leg(true);
  }
  std::string const refusal = check_refusal(ranks.take_errors(), spec.faulty, bad_value, ranks.timeout_s());
  ASSERT_TRUE(refusal.empty()) << "the refused " << (dispatch_fault(spec) ? "dispatch" : "combine") << ":\n" << refusal;
  if (dispatch_fault(spec)) {
    std::vector<std::remove_pointer_t<decltype(ranks[0].state)>*> states;
    for (int r = 0; r < ranks.world(); ++r) states.push_back(ranks[r].state);
    std::string const moved = check_nothing_moved(states, io);
    ASSERT_TRUE(moved.empty()) << moved;
  }
}

std::vector<DispatchArgs> dispatch_args(std::vector<VirtualRankIo> const& io, std::vector<int> const& tokens,
                                        bool expand, bool hook) {
  std::vector<DispatchArgs> args(io.size());
  for (std::size_t r = 0; r < io.size(); ++r) {
    args[r].x = io[r].x.ptr;
    args[r].num_tokens = tokens[r];
    args[r].topk_idx = io[r].idx.ptr;
    args[r].topk_idx_type = IndexType::int64;
    args[r].topk_weights = static_cast<float const*>(io[r].w.ptr);
    args[r].expand = expand;
    args[r].return_recv_hook = hook;
  }
  return args;
}

void print_case(Spec const& spec, EpConfig const& config, int num_ctas) {
  std::printf("world %d x %d CTAs: seed %llu mode %s%s fault %s on rank %d: hidden %d topk %d experts %d\n", spec.world,
              num_ctas, static_cast<unsigned long long>(spec.seed), spec.mode.c_str(),
              spec.hook ? " (hook halves)" : "", spec.fault.c_str(), spec.faulty, config.hidden, config.topk,
              config.num_experts);
  std::fflush(stdout);
}

// The config a user would pass for `spec` (backend_config validates and resolves it): mode=ll low-latency mode, the
// others normal mode with an expert capacity.
// fault=drop: one slot fewer than the tokens of the world, so that only an expert every token names drops (one entry).
EpConfig user_config(Spec const& spec) {
  EpConfig user = spec.config();
  if (spec.mode == "ll")
    user.mode = Mode::low_latency;
  else
    user.expert_capacity = user.recv_capacity(spec.world);
  if (spec.fault == "drop") {
    std::vector<int> const tokens = per_rank(spec.tokens, spec.world);
    user.expert_capacity = std::accumulate(tokens.begin(), tokens.end(), 0) - 1;
  }
  return user;
}

// fault=drop, the first call: every token of every rank names the faulty rank's first expert (in place of its first
// id where it does not), one entry more than its slots, so the faulty rank's receive half drops one entry, which no
// other rank sees. Every rank then combines, no host refusing: the faulty rank refuses on the device, so every other
// rank records one refusal naming it, the faulty rank records the dropped entry and no refusal, and its y stays
// poisoned. (Without the device's refusal the other ranks would sum their tokens without the dropped entry.)
template <typename Ranks, typename DispatchLeg, typename CombineLeg>
void dropped_call(Spec const& spec, EpConfig const& config, Ranks const& ranks, VirtualIteration& it,
                  std::vector<VirtualRankIo> const& io, DispatchLeg const& dispatch_leg,
                  CombineLeg const& combine_leg) {
  int const expert = spec.faulty * config.num_local_experts(spec.world);
  int const topk = config.topk;
  for (int r = 0; r < spec.world; ++r) {
    std::vector<int64_t>& idx = it.inputs[r].topk_idx;
    for (std::size_t t = 0; t + topk <= idx.size(); t += topk)
      if (std::find(idx.begin() + t, idx.begin() + t + topk, expert) == idx.begin() + t + topk) idx[t] = expert;
    upload(io[r].idx, idx);
  }
  CK(cudaDeviceSynchronize());
  dispatch_leg(false);
  combine_leg(false);
  std::vector<DeviceErrorBlock> const blocks = ranks.take_errors();
  std::string failure = check_refusal(blocks, spec.faulty, -1, ranks.timeout_s());
  if (blocks[spec.faulty].overflow_rows != 1)
    failure += "rank " + std::to_string(spec.faulty) + ": overflow_rows " +
               std::to_string(blocks[spec.faulty].overflow_rows) + ", expected 1 (the entry past expert_capacity)\n";
  failure += check_y_poisoned(io[spec.faulty], spec.faulty, "its refused combine");
  ASSERT_TRUE(failure.empty()) << "the combine after the dropped entry:\n" << failure;
}

// ---- normal mode ----

void run_normal(Spec const& spec, int num_ctas) {
  int const world = spec.world;
  std::vector<int> const tokens = per_rank(spec.tokens, world);
  EpConfig const config = backend_config(user_config(spec), world);
  detail::LandingChoice const landing =
      detail::choose_normal_landing(config, world, spec.mode == "landing" ? "on" : "off");
  ASSERT_EQ(landing.use, spec.mode == "landing") << landing.why;
  cuda_ep::Protocol const protocol = landing.use ? cuda_ep::Protocol::landing : cuda_ep::Protocol::push;
  cuda_ep::SymLayout const layout = cuda_ep::make_sym_layout(config, world, protocol);
  VirtualNormalRanks ranks(
      world, layout.total,
      [&](Buffers& b, int r) {
        cuda_ep::configure_buffers(b, config, world, r, protocol, num_ctas);
        b.layout = layout;
      },
      spec.timeout_s());
  print_case(spec, config, num_ctas);
  std::vector<VirtualRankIo> io;
  io.reserve(world);
  for (int r = 0; r < world; ++r) io.emplace_back(config, world, tokens[r]);
  std::vector<DispatchArgs> const dargs = dispatch_args(io, tokens, /*expand=*/true, false);
  std::vector<CombineArgs> em(world), rm(world);
  for (int r = 0; r < world; ++r) {
    em[r] = CombineArgs{CombineLayout::expert_major, io[r].eout.ptr, io[r].y_em.ptr, true};
    rm[r] = CombineArgs{CombineLayout::rank_major, io[r].rows.ptr, io[r].y_rm.ptr, true};
  }
  int const faulty = spec.faulty;
  // each leg on every rank before the next leg (lazy module loading: test_normal_virtual.cu says why)
  auto dispatch_leg = [&](bool refuse) {
    for (int r = 0; r < world; ++r) {
      bool const refused = refuse && r == faulty;
      cuda_ep::launch_dispatch(ranks[r], refused ? DispatchArgs{} : dargs[r],
                               cuda_ep::plan_dispatch(ranks[r], refused ? 0 : tokens[r]), ranks.stream(r), refused);
    }
    for (int r = 0; r < world; ++r) cuda_ep::launch_expand(ranks[r], /*copy_rows=*/true, ranks.stream(r));
  };
  auto combine_leg = [&](std::vector<CombineArgs> const& args, bool refuse) {
    for (int r = 0; r < world; ++r) {
      bool const refused = refuse && r == faulty;
      cuda_ep::launch_combine(ranks[r], refused ? CombineArgs{CombineLayout::rank_major} : args[r],
                              cuda_ep::plan_combine(ranks[r], tokens[r]), tokens[r], ranks.stream(r), refused);
    }
  };

  for (int iter = 0; iter < spec.iters; ++iter) {
    VirtualIteration it(config, world, spec.routing_options(iter), tokens, io);
    for (int r = 0; r < world; ++r) poison_normal_dispatch(config, world, cuda_ep::dispatch_result(ranks[r], true));
    CK(cudaDeviceSynchronize());
    if (iter == 0) {
      // 1. the refused call (and, after a refused dispatch, the combine every rank runs next: it has no tokens)
      refused_call(spec, ranks, io, break_ids(spec, config, it, io[faulty]), std::vector<int>(world, 0), dispatch_leg,
                   [&](bool refuse) { combine_leg(rm, refuse); });
      if (::testing::Test::HasFatalFailure()) return;
      continue;
    }
    // 2. the next calls on every rank: exact
    dispatch_leg(false);
    combine_leg(rm, false);
    combine_leg(em, false);
    std::string const failure = ranks.synchronize(std::vector<int>(world, 0));
    ASSERT_TRUE(failure.empty()) << "iter " << iter << " after the refusal:\n" << failure;
    for (int r = 0; r < world; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r) + " iter " + std::to_string(iter));
      ASSERT_EQ(check_normal_dispatch(config, world, r, iter, it.expected[r], cuda_ep::dispatch_result(ranks[r], true),
                                      /*poisoned=*/true, /*expand=*/true),
                0);
      ASSERT_EQ(it.check_combines(config, world, r, iter, io[r]), 0);
    }
  }
  std::printf("world %d: refused on every rank, then %d iterations exact on every rank\n", world, spec.iters - 1);
}

// ---- low-latency mode ----

void run_ll(Spec const& spec, int num_ctas) {
  int const world = spec.world;
  std::vector<int> const tokens = per_rank(spec.tokens, world);
  EpConfig const config = backend_config(user_config(spec), world);
  cuda_ep::SymLayout const layout = cuda_ep::make_sym_layout(config, world, cuda_ep::Protocol::ll);
  VirtualLlRanks ranks(
      world, layout.total,
      [&](Buffers& b, int r) {
        cuda_ep::configure_buffers(b, config, world, r, cuda_ep::Protocol::ll, num_ctas);
        b.num_ctas = num_ctas;
        b.layout = layout;
        b.refuse_combine_after_drop = true;  // as EpBuffer's (no other fault drops)
      },
      spec.timeout_s());
  print_case(spec, config, num_ctas);
  std::vector<VirtualRankIo> io;
  io.reserve(world);
  for (int r = 0; r < world; ++r) io.emplace_back(config, world, tokens[r]);
  std::vector<DispatchArgs> const dargs = dispatch_args(io, tokens, false, spec.hook);
  std::vector<CombineArgs> em(world), rm(world);
  for (int r = 0; r < world; ++r) {
    em[r] = CombineArgs{CombineLayout::expert_major, io[r].eout.ptr, io[r].y_em.ptr, true, spec.hook};
    rm[r] = CombineArgs{CombineLayout::rank_major, io[r].rows.ptr, io[r].y_rm.ptr, true, spec.hook};
  }
  int const faulty = spec.faulty;
  // one leg on every rank: whole, or every send half then every receive half; a refusing rank runs both halves in one
  // kernel (as CudaEp::refuse_* does in low-latency mode: no hook left pending), however its peers split theirs. It is
  // launched after its peers' send halves: its kernel is another instance than theirs, and a first launch may load its
  // module, which waits for the running kernels (test_normal_virtual.cu), so nothing may wait for a kernel launched
  // after it.
  auto leg = [&](bool refuse, auto const& launch) {
    for (int r = 0; r < world; ++r)
      if (!(refuse && r == faulty)) launch(r, spec.hook ? Half::send : Half::both);
    if (refuse) launch(faulty, Half::both);
    if (spec.hook)
      for (int r = 0; r < world; ++r)
        if (!(refuse && r == faulty)) launch(r, Half::recv);
  };
  auto dispatch_leg = [&](bool refuse) {
    leg(refuse, [&](int r, Half half) {
      bool const refused = refuse && r == faulty;
      cuda_ep::launch_ll_dispatch(ranks[r], refused ? DispatchArgs{} : dargs[r], half, ranks.stream(r), refused);
    });
  };
  auto combine_leg = [&](std::vector<CombineArgs> const& args, bool refuse) {
    leg(refuse, [&](int r, Half half) {
      bool const refused = refuse && r == faulty;
      cuda_ep::launch_ll_combine(ranks[r], refused ? CombineArgs{CombineLayout::rank_major} : args[r], tokens[r], half,
                                 ranks.stream(r), refused);
    });
  };

  for (int iter = 0; iter < spec.iters; ++iter) {
    VirtualIteration it(config, world, spec.routing_options(iter), tokens, io);
    std::vector<int> dropped(world);
    for (int r = 0; r < world; ++r) {
      dropped[r] = it.expected[r].dropped_slots;
      poison_ll_dispatch(config, world, cuda_ep::dispatch_result(ranks[r], true), ranks[r].recv_slot);
    }
    CK(cudaDeviceSynchronize());
    if (iter == 0 && spec.fault == "drop") {
      dropped_call(spec, config, ranks, it, io, dispatch_leg, [&](bool refuse) { combine_leg(rm, refuse); });
      if (::testing::Test::HasFatalFailure()) return;
      continue;
    }
    if (iter == 0) {
      refused_call(spec, ranks, io, break_ids(spec, config, it, io[faulty]), dropped, dispatch_leg,
                   [&](bool refuse) { combine_leg(rm, refuse); });
      if (::testing::Test::HasFatalFailure()) return;
      continue;
    }
    dispatch_leg(false);
    combine_leg(em, false);
    combine_leg(rm, false);
    std::string const failure = ranks.synchronize(dropped);
    ASSERT_TRUE(failure.empty()) << "iter " << iter << " after the refusal:\n" << failure;
    for (int r = 0; r < world; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r) + " iter " + std::to_string(iter));
      ASSERT_EQ(check_ll_dispatch(config, world, r, iter, it.expected[r], cuda_ep::dispatch_result(ranks[r], true),
                                  ranks[r].recv_slot),
                0);
      ASSERT_EQ(it.check_combines(config, world, r, iter, io[r]), 0);
    }
  }
  std::printf("world %d: refused on every rank, then %d iterations exact on every rank\n", world, spec.iters - 1);
}

void run_case(Spec const& spec, int num_ctas) {
  if (spec.mode == "ll")
    run_ll(spec, num_ctas);
  else
    run_normal(spec, num_ctas);
}

// Every fault on a rank that moves with it (the last, then 0, ...), for one mode at worlds 2, 4 and 8: small batches
// whose tokens differ per rank, the count exchange at a larger one.
std::vector<std::vector<std::string>> rows_of(std::vector<std::string> const& mode) {
  std::vector<std::vector<std::string>> table;
  int i = 0;
  bool const ll = std::find(mode.begin(), mode.end(), "mode=ll") != mode.end();
  for (int world : {2, 4, 8})
    for (char const* fault : {"bad_id", "repeat", "refuse_dispatch", "refuse_combine", "drop"}) {
      if (!ll && std::string(fault) == "drop") continue;
      std::vector<std::string> row = mode;
      row.push_back("world=" + std::to_string(world));
      row.push_back(std::string("fault=") + fault);
      row.push_back("faulty=" + std::to_string(i++ % 2 == 0 ? world - 1 : 0));
      row.insert(row.end(), {"hidden=2048", "topk=8", "experts=64", "iters=3"});
      table.push_back(std::move(row));
    }
  return table;
}

void run_rows(std::vector<std::vector<std::string>> const& table, int max_ctas) {
  run_virtual_rows(table, max_ctas, parse_spec, user_config, run_case);
}

TEST(RefusalVirtualRanks, NormalCountExchange) {
  run_rows(rows_of({"mode=counts", "tokens=300,37"}), cuda_ep::kMaxLandCtas);
}

TEST(RefusalVirtualRanks, NormalLanding) {
  run_rows(rows_of({"mode=landing", "tokens=64,17"}), cuda_ep::kMaxLandCtas);
}

TEST(RefusalVirtualRanks, LowLatency) {
  run_rows(rows_of({"mode=ll", "tokens=64,17"}), cuda_ep::kMaxLlCtas);
}

TEST(RefusalVirtualRanks, LowLatencyHookHalves) {
  run_rows(rows_of({"mode=ll", "hook=1", "tokens=48,5"}), cuda_ep::kMaxLlCtas);
}

}  // namespace test_refusal_virtual
}  // namespace ferry::test
