// Training on the cpu backend (docs/training.md): handles, cached dispatch, combine with a handle, and the backward
// passes, with ranks as threads, compared bit for bit with ref::; and ref::'s backward arithmetic itself checked
// against an independent dense computation on inputs whose sums are exact.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

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

using test::test_seed;

std::size_t at(int64_t row, int64_t width) {
  return static_cast<std::size_t>(row * width);
}

constexpr uint16_t kPoison = 0xffff;  // a bf16 NaN no result can be

// bf16 values that are small integers times 2^-4 (|v| <= 4): sums of a few hundred of them, and products of two,
// are exact in fp32, so any order of arithmetic gives the same result.
std::vector<uint16_t> exact_bf16(std::size_t n, std::mt19937_64& rng) {
  std::vector<uint16_t> out(n);
  for (auto& v : out) v = ref::float_to_bf16(static_cast<float>(static_cast<int>(rng() % 129) - 64) / 16.0f);
  return out;
}

// Arbitrary bf16 values in [-2, 2) (sums round: only the canonical order reproduces them).
std::vector<uint16_t> random_bf16(std::size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<uint16_t> out(n);
  for (auto& v : out) v = ref::float_to_bf16(dist(rng));
  return out;
}

EpConfig small_config(int world) {
  EpConfig config;
  config.hidden = 256;  // a multiple of 256: the warp dot's 32 lanes each take whole vectors
  config.num_experts = 8 * world;
  config.topk = 4;
  config.max_tokens_per_rank = 24;
  config.expert_capacity = world * 24;
  return config;
}

// Every rank's forward inputs and, for each, what ref:: says the calls give.
struct World {
  EpConfig config;
  int world = 0;
  std::vector<ref::RankInput> inputs;
  std::vector<ref::RankDispatch> received;          // per receiving rank
  std::vector<std::vector<uint16_t>> grads;         // per rank: gradient of recv_x (rank-major)
  std::vector<std::vector<uint16_t>> expert_grads;  // per rank: gradient of expert_x (expert-major)
  std::vector<std::vector<uint16_t>> grad_y;        // per rank: [num_tokens * hidden]
  std::vector<std::vector<uint16_t>> expert_out;    // per rank: the forward combine's x
};

World make_world(EpConfig const& config, int world, uint64_t seed, bool exact) {
  World w;
  w.config = config;
  w.world = world;
  std::mt19937_64 rng(seed);
  RoutingOptions routing;
  routing.seed = rng();
  routing.mask_rate = 0.15;
  std::vector<int> tokens;
  for (int r = 0; r < world; ++r) tokens.push_back(static_cast<int>(rng() % (config.max_tokens_per_rank + 1)));
  if (world > 1) tokens[0] = 0;  // a rank without tokens
  tokens[static_cast<std::size_t>(world - 1)] = config.max_tokens_per_rank;
  w.inputs = ref::generate_inputs(config, world, routing, tokens);
  auto values = [&](std::size_t n) { return exact ? exact_bf16(n, rng) : random_bf16(n, rng); };
  for (int r = 0; r < world; ++r) {
    ref::RankInput& in = w.inputs[static_cast<std::size_t>(r)];
    if (exact)
      for (float& weight : in.topk_weights) weight = static_cast<float>(rng() % 8 + 1) / 8.0f;
    w.grad_y.push_back(values(at(in.num_tokens, config.hidden)));
  }
  std::size_t const expert_elems =
      at(static_cast<int64_t>(config.num_local_experts(world)) * config.expert_slots(), config.hidden);
  for (int d = 0; d < world; ++d) {
    w.received.push_back(ref::dispatch(config, world, d, w.inputs));
    w.grads.push_back(values(at(w.received.back().num_recv, config.hidden)));
    w.expert_grads.push_back(values(expert_elems));
    w.expert_out.push_back(values(expert_elems));
  }
  return w;
}

// "" when got equals want bit for bit, else the first difference.
template <typename T>
std::string differs(char const* what, T const* got, std::vector<T> const& want) {
  for (std::size_t i = 0; i < want.size(); ++i)
    if (std::memcmp(got + i, want.data() + i, sizeof(T)) != 0)
      return detail::concat(what, " differs at element ", i, " of ", want.size());
  return "";
}

// The same for an expert-major tensor, over the filled slots only (the others are unspecified).
std::string differs_slots(char const* what, uint16_t const* got, std::vector<uint16_t> const& want,
                          ref::RankDispatch const& received, int hidden) {
  for (std::size_t e = 0; e < received.expert_counts.size(); ++e) {
    int const filled = std::min(received.expert_counts[e], received.expert_slots);
    std::size_t const first = at(static_cast<int64_t>(e) * received.expert_slots, hidden);
    for (std::size_t i = first; i < first + at(filled, hidden); ++i)
      if (got[i] != want[i]) return detail::concat(what, " differs at expert ", e, " element ", i - first);
  }
  return "";
}

void require_same(std::string const& difference) {
  FERRY_CHECK(difference.empty(), difference);
}

std::vector<uint16_t> to_bf16(std::vector<float> const& values) {
  std::vector<uint16_t> out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) out[i] = ref::float_to_bf16(values[i]);
  return out;
}

// Ranks as threads; every rank's failure is reported.
void run_world(int world, std::function<void(int, std::shared_ptr<Communicator> const&)> const& fn) {
  std::vector<std::string> const failures = test::run_cpu_ranks(world, fn);
  for (std::size_t r = 0; r < failures.size(); ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

class BackwardCpu : public testing::TestWithParam<int> {};

// Two forward dispatches saved into two handles; then, out of order and after the buffer moved on, every backward
// call and every layout, checked against ref:: row by row.
TEST_P(BackwardCpu, BackwardPassesMatchTheReference) {
  int const world = GetParam();
  uint64_t const seed = test_seed();
  EpConfig const config = small_config(world);
  World const a = make_world(config, world, seed, false);
  World const b = make_world(config, world, seed + 1, false);
  run_world(world, [&](int r, std::shared_ptr<Communicator> const& comm) {
    EpBuffer buffer(comm, config);
    DispatchHandle ha = buffer.make_handle();
    DispatchHandle hb = buffer.make_handle();
    FERRY_CHECK(!ha.empty() && !ha.saved(), "a new handle is empty of layout");
    std::size_t const R = static_cast<std::size_t>(r);
    DispatchArgs args = test::host_dispatch_args(a.inputs[R], true);
    args.save_handle = &ha;
    buffer.dispatch(args);
    DispatchArgs args_b = test::host_dispatch_args(b.inputs[R], true);
    args_b.save_handle = &hb;
    buffer.dispatch(args_b);
    FERRY_CHECK(ha.saved() && ha.num_tokens() == a.inputs[R].num_tokens && ha.expanded(), "handle a saved");
    int const hidden = config.hidden;
    std::size_t const tokens = at(a.inputs[R].num_tokens, hidden);

    for (World const* w : {&a, &b}) {
      DispatchHandle const& h = w == &a ? ha : hb;
      // combine_backward, expert-major: w * grad_y per slot, and the weight gradients
      std::vector<float> grad_w(at(w->inputs[R].num_tokens, config.topk) + 4, std::nanf(""));
      CombineBackwardArgs cb;
      cb.handle = &h;
      cb.layout = CombineLayout::expert_major;
      cb.grad_y = w->grad_y[R].data();
      cb.x = w->expert_out[R].data();
      cb.grad_topk_weights = grad_w.data();
      DispatchResult const moved = buffer.combine_backward(cb);
      require_same(differs_slots(
          "combine_backward expert_x", static_cast<uint16_t const*>(moved.expert_x),
          ref::combine_backward_rows(config, world, r, w->inputs, w->received, w->grad_y, CombineLayout::expert_major),
          w->received[R], hidden));
      std::vector<float> const want_w =
          ref::combine_backward_weights(config, world, r, w->inputs, w->received, w->grad_y, w->expert_out);
      require_same(differs("grad_topk_weights", grad_w.data(), want_w));
      FERRY_CHECK(std::isnan(grad_w[want_w.size()]), "wrote past grad_topk_weights");

      // combine_backward, rank-major: grad_y of each row's source
      CombineBackwardArgs cr;
      cr.handle = &h;
      cr.layout = CombineLayout::rank_major;
      cr.grad_y = w->grad_y[R].data();
      DispatchResult const rows = buffer.combine_backward(cr);
      require_same(differs(
          "combine_backward recv_x", static_cast<uint16_t const*>(rows.recv_x),
          ref::combine_backward_rows(config, world, r, w->inputs, w->received, w->grad_y, CombineLayout::rank_major)));

      // dispatch_backward, both layouts, bf16 and fp32 output
      for (CombineLayout layout : {CombineLayout::rank_major, CombineLayout::expert_major}) {
        std::vector<float> const want =
            ref::dispatch_backward(config, world, r, w->inputs, w->received,
                                   layout == CombineLayout::rank_major ? w->grads : w->expert_grads, layout);
        DispatchBackwardArgs db;
        db.handle = &h;
        db.layout = layout;
        db.grad = layout == CombineLayout::rank_major ? w->grads[R].data() : w->expert_grads[R].data();
        std::vector<uint16_t> gx(at(w->inputs[R].num_tokens, hidden), kPoison);
        db.grad_x = gx.data();
        buffer.dispatch_backward(db);
        require_same(differs("dispatch_backward grad_x (bf16)", gx.data(), to_bf16(want)));
        std::vector<float> gx32(want.size(), std::nanf(""));
        db.grad_x = gx32.data();
        db.grad_x_fp32 = true;
        buffer.dispatch_backward(db);
        require_same(differs("dispatch_backward grad_x (fp32)", gx32.data(), want));
      }
    }

    // a combine with handle a, after dispatches of b: a's forward result
    std::vector<uint16_t> y(tokens, kPoison);
    CombineArgs c;
    c.handle = &ha;
    c.x = a.expert_out[R].data();
    c.y = y.data();
    buffer.combine(c);
    require_same(differs("combine with a handle", y.data(),
                         ref::combine_expert_major(config, world, r, a.inputs, a.received, a.expert_out)));

    // a cached dispatch of a's rows by the handle equals a's dispatch
    DispatchArgs cached;
    cached.x = a.inputs[R].x.data();
    cached.num_tokens = a.inputs[R].num_tokens;
    cached.handle = &ha;
    cached.expand = true;
    DispatchResult const again = buffer.dispatch(cached);
    ref::RankDispatch const& want = a.received[R];
    FERRY_CHECK(*again.num_recv == want.num_recv, "cached num_recv");
    require_same(differs("cached recv_x", static_cast<uint16_t const*>(again.recv_x), want.recv_x));
    require_same(differs("cached recv_src", again.recv_src, want.recv_src));
    require_same(differs("cached recv_topk_weights", again.recv_topk_weights, want.recv_topk_weights));
    require_same(differs_slots("cached expert_x", static_cast<uint16_t const*>(again.expert_x),
                               ref::expand(config, world, want), want, hidden));

    // another buffer (another hidden, same layout shape) takes the handle
    EpConfig wide = config;
    wide.hidden = 2 * config.hidden;
    EpBuffer other(comm, wide);
    std::mt19937_64 rng(seed + 7);
    std::vector<std::vector<uint16_t>> wide_grads;
    for (int d = 0; d < world; ++d)
      wide_grads.push_back(random_bf16(at(a.received[static_cast<std::size_t>(d)].num_recv, wide.hidden), rng));
    std::vector<uint16_t> gx(at(a.inputs[R].num_tokens, wide.hidden), kPoison);
    DispatchBackwardArgs db;
    db.handle = &ha;
    db.grad = wide_grads[R].data();
    db.grad_x = gx.data();
    other.dispatch_backward(db);
    require_same(differs(
        "dispatch_backward on another buffer", gx.data(),
        to_bf16(ref::dispatch_backward(wide, world, r, a.inputs, a.received, wide_grads, CombineLayout::rank_major))));
  });
}

// Slots past the expert capacity are dropped: their rows get no gradient and their weights' gradient is 0.
// A dispatch that dropped slots (expert_capacity) leaves a layout no backward pass may run over: its drop is reported
// on every rank, and combine_backward / dispatch_backward of its handle are refused on every rank (docs/errors.md,
// "Capacities"), not run with the dropped entries' gradients missing.
TEST_P(BackwardCpu, BackwardPassesOverALayoutThatDroppedAreRefused) {
  int const world = GetParam();
  EpConfig config = small_config(world);
  config.expert_capacity = 3;
  World const w = make_world(config, world, test_seed(), false);
  std::vector<bool> const expanded(static_cast<std::size_t>(world), true);
  ref::CallDrops const drops = ref::call_drops(w.received, expanded);
  ASSERT_GT(drops.rows, 0) << "the capacity dropped no slot";
  run_world(world, [&](int r, std::shared_ptr<Communicator> const& comm) {
    EpBuffer buffer(comm, config);
    DispatchHandle h = buffer.make_handle();
    std::size_t const R = static_cast<std::size_t>(r);
    DispatchArgs args = test::host_dispatch_args(w.inputs[R], true);
    args.save_handle = &h;
    args.eager = false;  // the drop is reported by the next check, on every rank
    DispatchResult const got = buffer.dispatch(args);
    FERRY_CHECK(got.dropped_rows == drops.rows, "rank ", r, ": dropped_rows ", got.dropped_rows, ", want ", drops.rows);
    std::string problem = test::expect_input_error(
        [&] { comm->check_errors(); },
        {detail::concat(drops.rows, " row(s) were not delivered because rank ", drops.first_rank, "'s capacity")});
    FERRY_CHECK(problem.empty(), "rank ", r, ": ", problem);
    std::vector<float> grad_w(at(w.inputs[R].num_tokens, config.topk), std::nanf(""));
    CombineBackwardArgs cb;
    cb.handle = &h;
    cb.grad_y = w.grad_y[R].data();
    cb.x = w.expert_out[R].data();
    cb.grad_topk_weights = grad_w.data();
    cb.eager = false;
    problem = test::expect_input_error([&] { buffer.combine_backward(cb); },
                                       {"combine_backward refers to a dispatch that did not deliver"});
    FERRY_CHECK(problem.empty(), "rank ", r, ": ", problem);
    FERRY_CHECK(std::all_of(grad_w.begin(), grad_w.end(), [](float v) { return std::isnan(v); }), "rank ", r,
                ": a refused combine_backward wrote grad_topk_weights");
    std::vector<uint16_t> grad_x(at(w.inputs[R].num_tokens, config.hidden));
    DispatchBackwardArgs db;
    db.handle = &h;
    db.layout = CombineLayout::expert_major;
    db.grad = w.expert_out[R].data();
    db.grad_x = grad_x.data();
    problem = test::expect_input_error([&] { buffer.dispatch_backward(db); },
                                       {"dispatch_backward refers to a dispatch that did not deliver"});
    FERRY_CHECK(problem.empty(), "rank ", r, ": ", problem);
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, BackwardCpu, testing::Values(1, 2, 4, 8));

// A handle that does not fit is refused on every rank, naming the field, and the buffer stays usable.
TEST(BackwardCpuErrors, AHandleOfAnotherShapeIsRefusedOnEveryRank) {
  int const world = 2;
  EpConfig const config = small_config(world);
  World const w = make_world(config, world, test_seed(), false);
  run_world(world, [&](int r, std::shared_ptr<Communicator> const& comm) {
    EpBuffer buffer(comm, config);
    EpConfig other_shape = config;
    other_shape.topk = 2;
    EpBuffer other(comm, other_shape);
    DispatchHandle foreign = other.make_handle();
    DispatchHandle mine = buffer.make_handle();
    std::size_t const R = static_cast<std::size_t>(r);
    std::vector<uint16_t> gx(at(w.inputs[R].num_tokens, config.hidden));
    DispatchArgs args = test::host_dispatch_args(w.inputs[R], true);
    args.save_handle = r == 0 ? &foreign : &mine;  // rank 0 passes a handle of the other shape
    try {
      buffer.dispatch(args);
      FERRY_CHECK(false, "a foreign handle was accepted");
    } catch (InputError const& error) {
      std::string const what = error.what();
      FERRY_CHECK(what.find("topk=2") != std::string::npos, "the error names the field: ", what);
    }
    // a combine_backward that the last rank refuses (x missing for its weight gradients): every rank raises, and the
    // weight step's exchange is joined on every rank (the next calls stay in step)
    args.save_handle = &mine;
    buffer.dispatch(args);
    std::vector<float> grad_w(at(w.inputs[R].num_tokens, config.topk));
    CombineBackwardArgs cb;
    cb.handle = &mine;
    cb.grad_y = w.grad_y[R].data();
    cb.x = r == world - 1 ? nullptr : w.expert_out[R].data();  // rank world - 1 has tokens
    cb.grad_topk_weights = grad_w.data();
    std::string const refused = test::expect_input_error([&] { buffer.combine_backward(cb); }, {"needs x"});
    FERRY_CHECK(refused.empty(), refused);
    cb.x = w.expert_out[R].data();
    buffer.combine_backward(cb);
    require_same(
        differs("grad_topk_weights after a refusal", grad_w.data(),
                ref::combine_backward_weights(config, world, r, w.inputs, w.received, w.grad_y, w.expert_out)));
    DispatchHandle empty_layout = buffer.make_handle();
    // a backward call without a saved layout, then a good call: the buffer is still in step
    DispatchBackwardArgs db;
    db.handle = r == world - 1 ? &empty_layout : &mine;
    db.grad = w.grads[R].data();
    db.grad_x = gx.data();
    EXPECT_THROW(buffer.dispatch_backward(db), InputError);
    db.handle = &mine;
    buffer.dispatch_backward(db);
    require_same(differs(
        "grad_x after refusals", gx.data(),
        to_bf16(ref::dispatch_backward(config, world, r, w.inputs, w.received, w.grads, CombineLayout::rank_major))));
  });
}

TEST(BackwardCpuErrors, LowLatencyModeHasNoBackward) {
  EpConfig config = small_config(1);
  config.mode = Mode::low_latency;
  run_world(1, [&](int, std::shared_ptr<Communicator> const& comm) {
    EpBuffer buffer(comm, config);
    FERRY_CHECK(test::expect_error<ConfigError>([&] { buffer.make_handle(); }, {"train with mode=normal"}).empty(),
                "make_handle in mode=ll");
    FERRY_CHECK(
        test::expect_error<ConfigError>([&] { buffer.dispatch_backward(DispatchBackwardArgs{}); }, {"mode=normal"})
            .empty(),
        "dispatch_backward in mode=ll");
  });
}

// ref::'s backward arithmetic against a dense computation in double, on inputs whose sums are exact (so the order of
// the canonical arithmetic cannot matter): grad_x[t] = sum of the gradients of t's copies; grad_w[t,k] = <grad_y[t],
// out(t,k)>; the expert-major gradient rows w * grad_y[t] (exact in double, then rounded once to bf16: the
// product of a 3-bit weight and an 8-bit value needs more than bf16's 8 bits).
TEST(BackwardReference, MatchesADenseComputationOnExactInputs) {
  for (int world : {1, 3}) {
    EpConfig const config = small_config(world);
    World const w = make_world(config, world, test_seed(), true);
    int const hidden = config.hidden;
    int const topk = config.topk;
    for (int r = 0; r < world; ++r) {
      ref::RankInput const& in = w.inputs[static_cast<std::size_t>(r)];
      std::vector<double> dense_gx(at(in.num_tokens, hidden), 0.0);
      std::vector<double> dense_gx_expert(dense_gx.size(), 0.0);
      std::vector<double> dense_gw(at(in.num_tokens, topk), 0.0);
      for (int d = 0; d < world; ++d) {
        ref::RankDispatch const& rd = w.received[static_cast<std::size_t>(d)];
        for (int i = 0; i < rd.num_recv; ++i) {
          if (rd.recv_src[at(i, 2)] != r) continue;
          int const t = rd.recv_src[at(i, 2) + 1];
          for (int h = 0; h < hidden; ++h)
            dense_gx[at(t, hidden) + h] += ref::bf16_to_float(w.grads[static_cast<std::size_t>(d)][at(i, hidden) + h]);
          for (int k = 0; k < topk; ++k) {
            int32_t const e = rd.recv_topk_idx[at(i, topk) + k];
            int32_t const slot = rd.recv_slot[at(i, topk) + k];
            if (e < 0 || slot < 0) continue;
            std::size_t const row = at(static_cast<int64_t>(e) * rd.expert_slots + slot, hidden);
            for (int h = 0; h < hidden; ++h) {
              dense_gx_expert[at(t, hidden) + h] +=
                  ref::bf16_to_float(w.expert_grads[static_cast<std::size_t>(d)][row + h]);
              dense_gw[at(t, topk) + k] +=
                  static_cast<double>(ref::bf16_to_float(w.grad_y[static_cast<std::size_t>(r)][at(t, hidden) + h])) *
                  ref::bf16_to_float(w.expert_out[static_cast<std::size_t>(d)][row + h]);
            }
          }
        }
      }
      std::vector<float> const gx =
          ref::dispatch_backward(config, world, r, w.inputs, w.received, w.grads, CombineLayout::rank_major);
      std::vector<float> const gx_expert =
          ref::dispatch_backward(config, world, r, w.inputs, w.received, w.expert_grads, CombineLayout::expert_major);
      std::vector<float> const gw =
          ref::combine_backward_weights(config, world, r, w.inputs, w.received, w.grad_y, w.expert_out);
      for (std::size_t i = 0; i < dense_gx.size(); ++i) {
        ASSERT_EQ(static_cast<double>(gx[i]), dense_gx[i]) << "rank " << r << " element " << i;
        ASSERT_EQ(static_cast<double>(gx_expert[i]), dense_gx_expert[i]) << "rank " << r << " element " << i;
      }
      for (std::size_t i = 0; i < dense_gw.size(); ++i)
        ASSERT_EQ(static_cast<double>(gw[i]), dense_gw[i]) << "rank " << r << " entry " << i;
    }
    // the expert-major gradient rows: w * grad_y[t] in each slot of (t, k)
    for (int d = 0; d < world; ++d) {
      ref::RankDispatch const& rd = w.received[static_cast<std::size_t>(d)];
      std::vector<uint16_t> const rows =
          ref::combine_backward_rows(config, world, d, w.inputs, w.received, w.grad_y, CombineLayout::expert_major);
      for (int i = 0; i < rd.num_recv; ++i)
        for (int k = 0; k < topk; ++k) {
          int32_t const e = rd.recv_topk_idx[at(i, topk) + k];
          int32_t const slot = rd.recv_slot[at(i, topk) + k];
          if (e < 0 || slot < 0) continue;
          int const s = rd.recv_src[at(i, 2)];
          int const t = rd.recv_src[at(i, 2) + 1];
          float const weight = w.inputs[static_cast<std::size_t>(s)].topk_weights[at(t, topk) + k];
          for (int h = 0; h < hidden; ++h)
            ASSERT_EQ(rows[at(static_cast<int64_t>(e) * rd.expert_slots + slot, hidden) + h],
                      ref::float_to_bf16(static_cast<float>(
                          static_cast<double>(weight) *
                          ref::bf16_to_float(w.grad_y[static_cast<std::size_t>(s)][at(t, hidden) + h]))))
                << "rank " << d << " row " << i << " k " << k;
        }
    }
  }
}

// The checks above can fail: a gradient computed with one weight changed differs from the reference, and the
// comparison says where.
TEST(BackwardReference, APerturbedWeightIsDetected) {
  int const world = 2;
  EpConfig const config = small_config(world);
  World w = make_world(config, world, test_seed(), false);
  std::vector<uint16_t> const want =
      ref::combine_backward_rows(config, world, 1, w.inputs, w.received, w.grad_y, CombineLayout::expert_major);
  // perturb the first weight that reaches rank 1 with a slot
  bool perturbed = false;
  for (int s = 0; s < world && !perturbed; ++s) {
    ref::RankInput& in = w.inputs[static_cast<std::size_t>(s)];
    for (std::size_t i = 0; i < in.topk_idx.size() && !perturbed; ++i)
      if (in.topk_idx[i] >= config.num_local_experts(world) && w.grad_y[static_cast<std::size_t>(s)].size() > 0) {
        in.topk_weights[i] *= 1.5f;
        perturbed = true;
      }
  }
  ASSERT_TRUE(perturbed);
  for (int d = 0; d < world; ++d) w.received[static_cast<std::size_t>(d)] = ref::dispatch(config, world, d, w.inputs);
  std::vector<uint16_t> const got =
      ref::combine_backward_rows(config, world, 1, w.inputs, w.received, w.grad_y, CombineLayout::expert_major);
  EXPECT_NE(differs("perturbed", got.data(), want), "");
}

}  // namespace
}  // namespace ferry
