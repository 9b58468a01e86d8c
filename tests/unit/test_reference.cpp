// Invariants of the pure reference (src/ep/reference.hpp), each checked against an independent computation here.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ep/reference.hpp"
#include "ferry/error.hpp"
#include "support/rank_case.hpp"
#include "workloads/inputs.hpp"
#include "workloads/routing.hpp"

namespace ferry {
namespace {

using test::test_seed;  // fresh per run and printed; FERRY_TEST_SEED replays one

class Reference : public testing::Test {
 protected:
  void SetUp() override { test_seed(); }  // the seed is printed before the test's output
};

std::size_t at(int64_t row, int64_t width) {
  return static_cast<std::size_t>(row * width);
}

uint16_t bf16(float value) {
  return ref::float_to_bf16(value);
}
float f32(uint16_t bits) {
  return ref::bf16_to_float(bits);
}

// --- bf16 conversion --------------------------------------------------------------------------------------------

uint16_t convert_bits(uint32_t bits) {
  return ref::float_to_bf16(std::bit_cast<float>(bits));
}

TEST(Bf16, RoundsToNearestEvenLikeCuda) {
  EXPECT_EQ(convert_bits(0x3f800000), 0x3f80);  // 1
  EXPECT_EQ(convert_bits(0x3f808000), 0x3f80);  // tie, even below
  EXPECT_EQ(convert_bits(0x3f818000), 0x3f82);  // tie, even above
  EXPECT_EQ(convert_bits(0x3f808001), 0x3f81);  // just above the tie
  EXPECT_EQ(convert_bits(0x3f807fff), 0x3f80);  // just below the tie
  EXPECT_EQ(convert_bits(0xbf818000), 0xbf82);  // negative tie
  EXPECT_EQ(convert_bits(0x80000000), 0x8000);  // -0
  EXPECT_EQ(convert_bits(0x7f800000), 0x7f80);  // inf
  EXPECT_EQ(convert_bits(0xff800000), 0xff80);  // -inf
  EXPECT_EQ(convert_bits(0x7f7fffff), 0x7f80);  // FLT_MAX rounds up to inf
  EXPECT_EQ(convert_bits(0x7f7f7fff), 0x7f7f);
  EXPECT_EQ(convert_bits(0x00010000), 0x0001);  // subnormals are kept
  EXPECT_EQ(convert_bits(0x00008000), 0x0000);  // subnormal tie to even
  EXPECT_EQ(convert_bits(0x00018000), 0x0002);
  // cuda_bf16.hpp: any NaN becomes 0x7fff, whatever its sign and payload.
  for (uint32_t nan : {0x7fc00000U, 0xffc00000U, 0x7f800001U, 0xff800001U, 0x7fffffffU, 0xffffffffU})
    EXPECT_EQ(convert_bits(nan), 0x7fff) << std::hex << nan;
  // Every bf16 value survives the round trip.
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    float const value = f32(static_cast<uint16_t>(bits));
    if (std::isnan(value)) continue;
    ASSERT_EQ(bf16(value), bits) << std::hex << bits;
  }
}

// --- inputs -----------------------------------------------------------------------------------------------------

EpConfig small_config(int world, int topk, int hidden = 64, int num_experts = 32, int max_tokens = 96) {
  EpConfig config;
  config.hidden = hidden;
  config.num_experts = num_experts;
  config.topk = topk;
  config.max_tokens_per_rank = max_tokens;
  config.expert_capacity = world * max_tokens;
  config.validate(world);
  return config;
}

struct Case {
  char const* name;
  int world;
  int topk;
  RoutingKind kind;
  int shared;
  double mask;
  int num_experts;
};

std::vector<Case> cases() {
  return {
      {"w1 random", 1, 4, RoutingKind::random, 0, 0.0, 8},
      {"w2 random masked", 2, 4, RoutingKind::random, 0, 0.3, 16},
      {"w2 topk1", 2, 1, RoutingKind::random, 0, 0.0, 16},
      {"w4 ring", 4, 6, RoutingKind::ring, 0, 0.0, 32},
      {"w4 grouped shared", 4, 9, RoutingKind::grouped, 1, 0.1, 64},
      {"w4 hot", 4, 8, RoutingKind::hot, 0, 0.2, 32},
      {"w8 random topk9", 8, 9, RoutingKind::random, 0, 0.05, 64},
      {"w8 ring shared", 8, 3, RoutingKind::ring, 1, 0.0, 32},
  };
}

// Rank 1 (when there is one) gets no tokens; the others get between 1 and max_tokens.
std::vector<int> token_counts(int world, int max_tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int> counts(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) counts[static_cast<std::size_t>(r)] = 1 + static_cast<int>(rng() % max_tokens);
  if (world > 1) counts[1] = 0;
  return counts;
}

RoutingOptions routing_for(Case const& c, uint64_t seed) {
  RoutingOptions routing;
  routing.kind = c.kind;
  routing.shared_experts = c.shared;
  routing.mask_rate = c.mask;
  routing.expert_groups = 8;
  routing.topk_groups = 4;
  routing.hot_expert = c.num_experts / 2;
  routing.seed = seed;
  return routing;
}

struct World {
  EpConfig config;
  int world = 0;
  std::vector<ref::RankInput> inputs;
  std::vector<ref::RankDispatch> received;
};

World make_world(Case const& c, uint64_t seed, EpConfig config, bool full = false) {
  World w;
  w.config = config;
  w.world = c.world;
  std::vector<int> const counts = full ? std::vector<int>(c.world, config.max_tokens_per_rank)
                                       : token_counts(c.world, config.max_tokens_per_rank, seed);
  w.inputs = ref::generate_inputs(config, c.world, routing_for(c, seed), counts);
  for (int d = 0; d < c.world; ++d) w.received.push_back(ref::dispatch(config, c.world, d, w.inputs));
  return w;
}

World make_world(Case const& c, uint64_t seed) {
  return make_world(c, seed, small_config(c.world, c.topk, 64, c.num_experts));
}

// --- dispatch ---------------------------------------------------------------------------------------------------

// Checks rank d's dispatch against a direct reading of the semantics: every (token, d) pair with an expert on d
// delivered exactly once, in (source rank, token) order, up to the capacity; nothing else; metadata and slots.
void expect_dispatch_matches_semantics(World const& w, int d) {
  EpConfig const& config = w.config;
  int const topk = config.topk;
  int const hidden = config.hidden;
  int const local = config.num_local_experts(w.world);
  ref::RankDispatch const& got = w.received[static_cast<std::size_t>(d)];

  std::vector<std::pair<int, int>> expected;
  for (int s = 0; s < w.world; ++s) {
    ref::RankInput const& in = w.inputs[static_cast<std::size_t>(s)];
    for (int t = 0; t < in.num_tokens; ++t) {
      bool hit = false;
      for (int k = 0; k < topk; ++k)
        hit |= in.topk_idx[at(t, topk) + k] >= 0 && in.topk_idx[at(t, topk) + k] / local == d;
      if (hit) expected.emplace_back(s, t);
    }
  }
  int const capacity = config.recv_capacity(w.world);
  int const delivered = std::min<int>(static_cast<int>(expected.size()), capacity);
  ASSERT_EQ(got.num_recv, delivered) << "rank " << d;
  ASSERT_EQ(got.dropped_rows, static_cast<int>(expected.size()) - delivered) << "rank " << d;
  ASSERT_EQ(got.recv_x.size(), at(delivered, hidden));
  ASSERT_EQ(got.recv_src.size(), at(delivered, 2));

  std::vector<std::vector<int>> row_entries(static_cast<std::size_t>(delivered));  // local (k) of each row
  for (int i = 0; i < delivered; ++i) {
    auto const [s, t] = expected[static_cast<std::size_t>(i)];
    ASSERT_EQ(got.recv_src[at(i, 2)], s) << "rank " << d << " row " << i;
    ASSERT_EQ(got.recv_src[at(i, 2) + 1], t) << "rank " << d << " row " << i;
    ref::RankInput const& in = w.inputs[static_cast<std::size_t>(s)];
    ASSERT_EQ(std::memcmp(got.recv_x.data() + at(i, hidden), in.x.data() + at(t, hidden), at(hidden, 2)), 0)
        << "rank " << d << " row " << i;
    for (int k = 0; k < topk; ++k) {
      int64_t const id = in.topk_idx[at(t, topk) + k];
      bool const here = id >= 0 && id / local == d;
      ASSERT_EQ(got.recv_topk_idx[at(i, topk) + k], here ? static_cast<int32_t>(id % local) : -1);
      ASSERT_EQ(got.recv_topk_weights[at(i, topk) + k], here ? in.topk_weights[at(t, topk) + k] : 0.0f);
      if (here) row_entries[static_cast<std::size_t>(i)].push_back(k);
    }
  }

  // Slots: per expert in (row, k) order, the rows taken from rank d's own first row on and the rows of lower
  // sources after them; up to expert_slots, the rest dropped.
  int own_first = 0;
  while (own_first < delivered && expected[static_cast<std::size_t>(own_first)].first < d) ++own_first;
  std::vector<std::vector<std::pair<int, int>>> entries(static_cast<std::size_t>(local));  // (row, k) per expert
  for (int q = 0; q < delivered; ++q) {
    int const i = (own_first + q) % delivered;
    auto const [s, t] = expected[static_cast<std::size_t>(i)];
    for (int k : row_entries[static_cast<std::size_t>(i)])
      entries[static_cast<std::size_t>(w.inputs[static_cast<std::size_t>(s)].topk_idx[at(t, topk) + k] % local)]
          .emplace_back(i, k);
  }
  int const slots = config.expert_slots();
  ASSERT_EQ(got.expert_slots, slots);
  int dropped = 0;
  std::vector<int32_t> expected_slot(at(delivered, topk), -1);
  for (int e = 0; e < local; ++e) {
    auto const& list = entries[static_cast<std::size_t>(e)];
    ASSERT_EQ(got.expert_counts[static_cast<std::size_t>(e)], static_cast<int>(list.size())) << "expert " << e;
    for (int j = 0; j < slots; ++j) {
      int32_t const row = j < static_cast<int>(list.size()) ? list[static_cast<std::size_t>(j)].first : -1;
      ASSERT_EQ(got.expert_src_row[at(e, slots) + j], row) << "expert " << e << " slot " << j;
    }
    for (int j = 0; j < static_cast<int>(list.size()); ++j) {
      auto const [row, k] = list[static_cast<std::size_t>(j)];
      if (j < slots)
        expected_slot[at(row, topk) + k] = j;
      else if (slots > 0)  // without an expert capacity there is no layout to drop from
        ++dropped;
    }
  }
  ASSERT_EQ(got.recv_slot, expected_slot);
  ASSERT_EQ(got.dropped_slots, dropped);
}

TEST_F(Reference, DispatchDeliversEachTokenOncePerDestination) {
  for (Case const& c : cases()) {
    SCOPED_TRACE(c.name);
    World const w = make_world(c, test_seed());
    for (int d = 0; d < c.world; ++d) expect_dispatch_matches_semantics(w, d);
  }
}

TEST_F(Reference, DispatchIsDeterministic) {
  Case const c = cases()[4];
  World const a = make_world(c, test_seed());
  World const b = make_world(c, test_seed());
  for (int d = 0; d < c.world; ++d) {
    EXPECT_EQ(a.received[static_cast<std::size_t>(d)].recv_x, b.received[static_cast<std::size_t>(d)].recv_x);
    EXPECT_EQ(a.received[static_cast<std::size_t>(d)].recv_src, b.received[static_cast<std::size_t>(d)].recv_src);
    EXPECT_EQ(a.received[static_cast<std::size_t>(d)].expert_src_row,
              b.received[static_cast<std::size_t>(d)].expert_src_row);
  }
}

TEST_F(Reference, ExpandCopiesRowsIntoTheirSlots) {
  for (Case const& c : cases()) {
    SCOPED_TRACE(c.name);
    World const w = make_world(c, test_seed());
    int const hidden = w.config.hidden;
    for (int d = 0; d < c.world; ++d) {
      ref::RankDispatch const& got = w.received[static_cast<std::size_t>(d)];
      std::vector<uint16_t> const expert_x = ref::expand(w.config, c.world, got);
      int const slots = got.expert_slots;
      for (int e = 0; e < w.config.num_local_experts(c.world); ++e) {
        for (int j = 0; j < slots; ++j) {
          uint16_t const* slot = expert_x.data() + at(static_cast<int64_t>(e) * slots + j, hidden);
          int32_t const row = got.expert_src_row[at(e, slots) + j];
          if (row < 0) {
            ASSERT_TRUE(std::all_of(slot, slot + hidden, [](uint16_t v) { return v == 0; }));
          } else {
            ASSERT_EQ(std::memcmp(slot, got.recv_x.data() + at(row, hidden), at(hidden, 2)), 0);
          }
        }
      }
    }
  }
}

// --- combine ----------------------------------------------------------------------------------------------------

// y of token t of rank r when every expert returns its input (identity experts), straight from the inputs: per
// destination rank d ascending that the token reaches, the fmaf chain over its experts on d rounded to bf16, then
// the fp32 sum of those rows rounded to bf16.
std::vector<uint16_t> identity_combine(World const& w, int r) {
  EpConfig const& config = w.config;
  int const topk = config.topk;
  int const hidden = config.hidden;
  int const local = config.num_local_experts(w.world);
  ref::RankInput const& in = w.inputs[static_cast<std::size_t>(r)];
  std::vector<uint16_t> y(at(in.num_tokens, hidden));
  for (int t = 0; t < in.num_tokens; ++t) {
    for (int h = 0; h < hidden; ++h) {
      float const x = f32(in.x[at(t, hidden) + h]);
      float sum = 0.0f;
      for (int d = 0; d < w.world; ++d) {
        bool reaches = false;
        float acc = 0.0f;
        for (int k = 0; k < topk; ++k) {
          int64_t const id = in.topk_idx[at(t, topk) + k];
          if (id < 0 || id / local != d) continue;
          reaches = true;
          acc = std::fmaf(in.topk_weights[at(t, topk) + k], x, acc);
        }
        if (reaches) sum += f32(bf16(acc));
      }
      y[at(t, hidden) + h] = bf16(sum);
    }
  }
  return y;
}

std::vector<std::vector<uint16_t>> identity_experts(World const& w) {
  std::vector<std::vector<uint16_t>> out;
  for (int d = 0; d < w.world; ++d)
    out.push_back(ref::expand(w.config, w.world, w.received[static_cast<std::size_t>(d)]));
  return out;
}

TEST_F(Reference, CombineOfIdentityExpertsIsTheWeightedSum) {
  for (Case const& c : cases()) {
    SCOPED_TRACE(c.name);
    World const w = make_world(c, test_seed());
    auto const experts = identity_experts(w);
    int const hidden = w.config.hidden;
    int const topk = w.config.topk;
    for (int r = 0; r < c.world; ++r) {
      std::vector<uint16_t> const y = ref::combine_expert_major(w.config, c.world, r, w.inputs, w.received, experts);
      ASSERT_EQ(y, identity_combine(w, r)) << "rank " << r;
      // And close to the exact sum_k w * x (two bf16 roundings: relative 2^-8 each).
      ref::RankInput const& in = w.inputs[static_cast<std::size_t>(r)];
      for (int t = 0; t < in.num_tokens; ++t) {
        for (int h = 0; h < hidden; ++h) {
          double exact = 0.0;
          double const x = f32(in.x[at(t, hidden) + h]);
          for (int k = 0; k < topk; ++k)
            if (in.topk_idx[at(t, topk) + k] >= 0) exact += in.topk_weights[at(t, topk) + k] * x;
          ASSERT_NEAR(f32(y[at(t, hidden) + h]), exact, std::fabs(x) * 0.012 + 1e-30)
              << "rank " << r << " token " << t << " h " << h;
        }
      }
    }
  }
}

TEST_F(Reference, SingleRankCombineRoundsOnce) {
  // With one rank there is one row per token and y = bf16(fma chain over k), exactly.
  Case const c{"w1", 1, 8, RoutingKind::random, 0, 0.2, 16};
  World const w = make_world(c, test_seed());
  std::vector<uint16_t> const y = ref::combine_expert_major(w.config, 1, 0, w.inputs, w.received, identity_experts(w));
  ref::RankInput const& in = w.inputs[0];
  for (int t = 0; t < in.num_tokens; ++t) {
    for (int h = 0; h < w.config.hidden; ++h) {
      float acc = 0.0f;
      for (int k = 0; k < 8; ++k)
        if (in.topk_idx[at(t, 8) + k] >= 0)
          acc = std::fmaf(in.topk_weights[at(t, 8) + k], f32(in.x[at(t, w.config.hidden) + h]), acc);
      ASSERT_EQ(y[at(t, w.config.hidden) + h], bf16(acc));
    }
  }
}

TEST_F(Reference, RankMajorCombineSumsTheRanksRows) {
  for (Case const& c : cases()) {
    SCOPED_TRACE(c.name);
    World const w = make_world(c, test_seed());
    int const hidden = w.config.hidden;
    // Arbitrary rows from every receiver.
    std::vector<std::vector<uint16_t>> rows;
    for (int d = 0; d < c.world; ++d)
      rows.push_back(generate_tokens(test_seed() + 17, d, w.received[static_cast<std::size_t>(d)].num_recv, hidden));
    for (int r = 0; r < c.world; ++r) {
      std::vector<uint16_t> const y = ref::combine_rank_major(w.config, c.world, r, w.inputs, w.received, rows);
      int const num_tokens = w.inputs[static_cast<std::size_t>(r)].num_tokens;
      ASSERT_EQ(y.size(), at(num_tokens, hidden));
      std::map<std::pair<int, int>, int> row_of;  // (destination, token) -> row
      for (int d = 0; d < c.world; ++d) {
        ref::RankDispatch const& got = w.received[static_cast<std::size_t>(d)];
        for (int i = 0; i < got.num_recv; ++i)
          if (got.recv_src[at(i, 2)] == r) row_of[{d, got.recv_src[at(i, 2) + 1]}] = i;
      }
      for (int t = 0; t < num_tokens; ++t) {
        for (int h = 0; h < hidden; ++h) {
          float sum = 0.0f;
          for (int d = 0; d < c.world; ++d)
            if (auto found = row_of.find({d, t}); found != row_of.end())
              sum += f32(rows[static_cast<std::size_t>(d)][at(found->second, hidden) + h]);
          ASSERT_EQ(y[at(t, hidden) + h], bf16(sum)) << "rank " << r << " token " << t;
        }
      }
    }
    // Rank-major rows that are the receivers' own reductions give the expert-major result.
    auto const experts = identity_experts(w);
    std::vector<std::vector<uint16_t>> reduced;
    for (int d = 0; d < c.world; ++d)
      reduced.push_back(ref::reduce_local_experts(w.config, c.world, w.received[static_cast<std::size_t>(d)],
                                                  experts[static_cast<std::size_t>(d)]));
    for (int r = 0; r < c.world; ++r)
      ASSERT_EQ(ref::combine_rank_major(w.config, c.world, r, w.inputs, w.received, reduced),
                ref::combine_expert_major(w.config, c.world, r, w.inputs, w.received, experts));
  }
}

TEST_F(Reference, MaskedTokenAndEmptyRank) {
  Case const c{"w4", 4, 4, RoutingKind::random, 0, 0.0, 16};
  EpConfig const config = small_config(4, 4, 32, 16, 8);
  World w;
  w.config = config;
  w.world = 4;
  std::vector<int> const counts = {5, 0, 3, 8};
  w.inputs = ref::generate_inputs(config, 4, routing_for(c, test_seed()), counts);
  // Token 2 of rank 0 and every token of rank 2 go nowhere.
  std::fill_n(w.inputs[0].topk_idx.begin() + 8, 4, -1);
  std::fill_n(w.inputs[0].topk_weights.begin() + 8, 4, 0.0f);
  std::fill(w.inputs[2].topk_idx.begin(), w.inputs[2].topk_idx.end(), -1);
  for (int d = 0; d < 4; ++d) w.received.push_back(ref::dispatch(config, 4, d, w.inputs));
  for (int d = 0; d < 4; ++d) {
    expect_dispatch_matches_semantics(w, d);
    for (int i = 0; i < w.received[static_cast<std::size_t>(d)].num_recv; ++i) {
      auto const& src = w.received[static_cast<std::size_t>(d)].recv_src;
      EXPECT_FALSE(src[at(i, 2)] == 0 && src[at(i, 2) + 1] == 2) << "masked token delivered to " << d;
      EXPECT_NE(src[at(i, 2)], 2) << "rank 2 routes nothing";
      EXPECT_NE(src[at(i, 2)], 1) << "rank 1 has no tokens";
    }
  }
  auto const experts = identity_experts(w);
  std::vector<uint16_t> const y0 = ref::combine_expert_major(config, 4, 0, w.inputs, w.received, experts);
  EXPECT_TRUE(std::all_of(y0.begin() + 2 * 32, y0.begin() + 3 * 32, [](uint16_t v) { return v == 0; }));
  EXPECT_EQ(y0, identity_combine(w, 0));
  EXPECT_TRUE(ref::combine_expert_major(config, 4, 1, w.inputs, w.received, experts).empty());
  std::vector<uint16_t> const y2 = ref::combine_expert_major(config, 4, 2, w.inputs, w.received, experts);
  ASSERT_EQ(y2.size(), 3u * 32u);
  EXPECT_TRUE(std::all_of(y2.begin(), y2.end(), [](uint16_t v) { return v == 0; }));
}

TEST_F(Reference, RowsPastTheReceiveCapacityAreDroppedAndCounted) {
  Case const c{"w4 capped", 4, 4, RoutingKind::random, 0, 0.0, 16};
  EpConfig config = small_config(4, 4, 32, 16, 64);
  config.max_recv_tokens = 40;  // well under the ~4 * 64 * 0.73 rows a rank gets
  World const w = make_world(c, test_seed(), config, /*full=*/true);
  int total_dropped = 0;
  for (int d = 0; d < 4; ++d) {
    expect_dispatch_matches_semantics(w, d);
    EXPECT_LE(w.received[static_cast<std::size_t>(d)].num_recv, 40);
    total_dropped += w.received[static_cast<std::size_t>(d)].dropped_rows;
  }
  EXPECT_GT(total_dropped, 0);
  // A dropped row contributes nothing: the source sums only what arrived.
  std::vector<std::vector<uint16_t>> rows;
  for (int d = 0; d < 4; ++d) {
    rows.emplace_back(at(w.received[static_cast<std::size_t>(d)].num_recv, 32), bf16(1.0f));
  }
  for (int r = 0; r < 4; ++r) {
    std::vector<uint16_t> const y = ref::combine_rank_major(config, 4, r, w.inputs, w.received, rows);
    for (int t = 0; t < w.inputs[static_cast<std::size_t>(r)].num_tokens; ++t) {
      int arrived = 0;
      for (int d = 0; d < 4; ++d) {
        auto const& got = w.received[static_cast<std::size_t>(d)];
        for (int i = 0; i < got.num_recv; ++i)
          arrived += got.recv_src[at(i, 2)] == r && got.recv_src[at(i, 2) + 1] == t;
      }
      ASSERT_EQ(f32(y[at(t, 32)]), static_cast<float>(arrived)) << "rank " << r << " token " << t;
    }
  }
}

TEST_F(Reference, EntriesPastTheExpertCapacityGetNoSlot) {
  Case const c{"w2 slots", 2, 4, RoutingKind::hot, 0, 0.0, 8};
  EpConfig config = small_config(2, 4, 32, 8, 64);
  config.expert_capacity = 5;  // the hot expert alone gets about 64 entries
  World const w = make_world(c, test_seed(), config, /*full=*/true);
  int dropped = 0;
  for (int d = 0; d < 2; ++d) {
    expect_dispatch_matches_semantics(w, d);
    dropped += w.received[static_cast<std::size_t>(d)].dropped_slots;
  }
  EXPECT_GT(dropped, 0);
  // Identity experts: the combine sums only entries that have a slot.
  auto const experts = identity_experts(w);
  for (int r = 0; r < 2; ++r) {
    std::vector<uint16_t> const y = ref::combine_expert_major(config, 2, r, w.inputs, w.received, experts);
    ref::RankInput const& in = w.inputs[static_cast<std::size_t>(r)];
    for (int t = 0; t < in.num_tokens; ++t) {
      for (int h = 0; h < 32; ++h) {
        float sum = 0.0f;
        for (int d = 0; d < 2; ++d) {
          auto const& got = w.received[static_cast<std::size_t>(d)];
          for (int i = 0; i < got.num_recv; ++i) {
            if (got.recv_src[at(i, 2)] != r || got.recv_src[at(i, 2) + 1] != t) continue;
            float acc = 0.0f;
            for (int k = 0; k < 4; ++k)
              if (got.recv_slot[at(i, 4) + k] >= 0)
                acc = std::fmaf(got.recv_topk_weights[at(i, 4) + k], f32(in.x[at(t, 32) + h]), acc);
            sum += f32(bf16(acc));
          }
        }
        ASSERT_EQ(y[at(t, 32) + h], bf16(sum)) << "rank " << r << " token " << t;
      }
    }
  }
}

TEST_F(Reference, NoExpertCapacityMeansNoSlots) {
  Case const c{"w2 no slots", 2, 4, RoutingKind::random, 0, 0.0, 8};
  EpConfig config = small_config(2, 4, 32, 8, 16);
  config.expert_capacity.reset();
  World const w = make_world(c, test_seed(), config);
  for (int d = 0; d < 2; ++d) {
    expect_dispatch_matches_semantics(w, d);
    EXPECT_EQ(w.received[static_cast<std::size_t>(d)].dropped_slots, 0);
  }
}

// --- bad input --------------------------------------------------------------------------------------------------

void expect_input_error(EpConfig const& config, ref::RankInput const& input, std::vector<std::string> const& parts) {
  try {
    ref::validate_input(config, 2, 1, input);
    ADD_FAILURE() << "no InputError";
  } catch (InputError const& error) {
    std::string const message = error.what();
    for (auto const& part : parts)
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' missing from: " << message;
  }
}

TEST_F(Reference, BadInputIsRefusedNamingTheValue) {
  Case const c{"w2", 2, 4, RoutingKind::random, 0, 0.0, 16};
  EpConfig const config = small_config(2, 4, 32, 16, 8);
  std::vector<ref::RankInput> inputs =
      ref::generate_inputs(config, 2, routing_for(c, test_seed()), std::vector<int>{8, 8});
  ref::RankInput input = inputs[1];
  input.topk_idx[at(3, 4) + 2] = 16;
  expect_input_error(config, input, {"rank 1", "topk_idx[3, 2]=16", "[-1, num_experts=16)"});
  input.topk_idx[at(3, 4) + 2] = -2;
  expect_input_error(config, input, {"topk_idx[3, 2]=-2"});
  inputs[1] = input;
  EXPECT_THROW(ref::dispatch(config, 2, 0, inputs), InputError);

  ref::RankInput big = ref::generate_inputs(config, 2, routing_for(c, 1), std::vector<int>{9, 0})[0];
  expect_input_error(config, big, {"num_tokens=9", "max_tokens_per_rank=8"});
  ref::RankInput short_x = inputs[0];
  short_x.x.pop_back();
  expect_input_error(config, short_x, {"x holds"});
}

// --- scale ------------------------------------------------------------------------------------------------------

// 4 ranks x 4096 tokens x hidden 7168 x topk 8: the whole reference pipeline for every rank. Not part of the CI
// run (about 3 GB of memory); run with --gtest_also_run_disabled_tests --gtest_filter='*LargeShape*'.
TEST_F(Reference, DISABLED_LargeShapeTakesSeconds) {
  int const world = 4;
  EpConfig config;
  config.hidden = 7168;
  config.num_experts = 256;
  config.topk = 8;
  config.max_tokens_per_rank = 4096;
  config.expert_capacity = 1024;  // 512 entries per expert on average
  config.validate(world);
  RoutingOptions routing;
  routing.seed = test_seed();
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); };

  auto start = Clock::now();
  std::vector<ref::RankInput> const inputs = ref::generate_inputs(config, world, routing, std::vector<int>(4, 4096));
  std::printf("generate_inputs: %.2f s\n", seconds(start));
  start = Clock::now();
  std::vector<ref::RankDispatch> received;
  for (int d = 0; d < world; ++d) received.push_back(ref::dispatch(config, world, d, inputs));
  std::printf("dispatch (4 ranks): %.2f s\n", seconds(start));
  start = Clock::now();
  std::vector<std::vector<uint16_t>> experts;
  for (int d = 0; d < world; ++d) experts.push_back(ref::expand(config, world, received[static_cast<std::size_t>(d)]));
  std::printf("expand (4 ranks): %.2f s\n", seconds(start));
  start = Clock::now();
  for (int r = 0; r < world; ++r) {
    std::vector<uint16_t> const y = ref::combine_expert_major(config, world, r, inputs, received, experts);
    ASSERT_EQ(y.size(), at(4096, 7168));
  }
  std::printf("combine_expert_major (4 ranks): %.2f s\n", seconds(start));
}

}  // namespace
}  // namespace ferry
