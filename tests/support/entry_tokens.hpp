// An entry-per-token low-latency call (DispatchArgs::x_repeat, CombineArgs::group; ferry.deep_ep's mapping of
// DeepEP's calls): T tokens of topk k sent as T * k tokens of topk 1, x unexpanded, and combined back into T rows with
// weights given at combine. What the checks compare with: the reference of the expanded input (every row of x k times,
// the ids one per entry token, weights 1) for the dispatch, and for the combine the grouped sum of the reference's
// entry-token rows (each entry token comes back from one rank, so its row is exact in bf16). Host code, shared by the
// cpu backend's test (tests/unit/test_ll_cpu.cpp) and the GPU test (tests/gpu/test_ll.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ep/reference.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "workloads/inputs.hpp"
#include "workloads/routing.hpp"

namespace ferry::test {

struct EntryTokens {
  int topk = 1;                             // k: entry tokens per token
  std::vector<int> tokens;                  // T of each rank
  std::vector<std::vector<uint16_t>> x;     // each rank's [T, hidden] bf16 (what the call is given)
  std::vector<ref::RankInput> expanded;     // each rank's T * k entry tokens, as the reference sees them
  std::vector<std::vector<float>> weights;  // each rank's [T, k] combine weights; NaN where the id is -1
};

// config: the entry-token buffer's (topk 1, max_tokens_per_rank >= T * k); routing by `routing` over topk k.
inline EntryTokens make_entry_tokens(EpConfig const& config, int world, int topk, std::vector<int> const& tokens,
                                     RoutingOptions const& routing) {
  EpConfig per_token = config;
  per_token.topk = topk;
  std::vector<ref::RankInput> const inputs = ref::generate_inputs(per_token, world, routing, tokens);
  EntryTokens out;
  out.topk = topk;
  out.tokens = tokens;
  std::mt19937 gen(static_cast<uint32_t>(routing.seed ^ 0x5eedu));
  std::uniform_real_distribution<float> weight(-1.0f, 1.0f);
  int const hidden = config.hidden;
  for (int r = 0; r < world; ++r) {
    ref::RankInput const& in = inputs[static_cast<std::size_t>(r)];
    int const t_count = tokens[static_cast<std::size_t>(r)];
    out.x.push_back(in.x);
    ref::RankInput e;
    e.num_tokens = t_count * topk;
    for (int i = 0; i < e.num_tokens; ++i)
      e.x.insert(e.x.end(), in.x.begin() + static_cast<std::ptrdiff_t>(i / topk) * hidden,
                 in.x.begin() + static_cast<std::ptrdiff_t>(i / topk + 1) * hidden);
    e.topk_idx = in.topk_idx;
    e.topk_weights.assign(static_cast<std::size_t>(e.num_tokens), 1.0f);
    std::vector<float> w(static_cast<std::size_t>(e.num_tokens));
    for (std::size_t i = 0; i < w.size(); ++i)
      w[i] = in.topk_idx[i] < 0 ? std::numeric_limits<float>::quiet_NaN() : weight(gen);
    out.expanded.push_back(std::move(e));
    out.weights.push_back(std::move(w));
  }
  return out;
}

// y [T, hidden] of a grouped combine: y[u] = bf16(sum over j ascending of w[u, j] * float(entry_rows[u * k + j])),
// each product rounded before its sum, over the entries with an id (the others went nowhere and add nothing).
// entry_rows: the reference's combine of the entry tokens [T * k, hidden] (one row each, exact in bf16).
inline std::vector<uint16_t> grouped_y(std::vector<uint16_t> const& entry_rows, std::vector<int64_t> const& ids,
                                       std::vector<float> const& w, int topk, int hidden) {
  std::size_t const outputs = ids.size() / static_cast<std::size_t>(topk);
  std::vector<uint16_t> y(outputs * static_cast<std::size_t>(hidden));
  std::vector<float> acc(static_cast<std::size_t>(hidden));
  for (std::size_t u = 0; u < outputs; ++u) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int j = 0; j < topk; ++j) {
      std::size_t const i = u * static_cast<std::size_t>(topk) + static_cast<std::size_t>(j);
      if (ids[i] < 0) continue;
      for (int h = 0; h < hidden; ++h) {
        float const product = w[i] * ref::bf16_to_float(entry_rows[i * static_cast<std::size_t>(hidden) + h]);
        acc[static_cast<std::size_t>(h)] += product;
      }
    }
    ref::round_row(hidden, acc.data(), y.data() + u * static_cast<std::size_t>(hidden));
  }
  return y;
}

// The first mismatch of one rank's expert-major layout against the reference (its counts, then the filled rows of
// each expert, bit for bit), prefixed by `where`; "" when they match. counts and expert_x: host copies of
// DispatchResult::expert_counts / expert_x. Shared by every low-latency host check (test_ll_cpu.cpp, test_ll.cpp).
inline std::string expert_layout_problem(EpConfig const& config, int world, ref::RankDispatch const& mine,
                                         int32_t const* counts, uint16_t const* expert_x, std::string const& where) {
  std::size_t const hidden = static_cast<std::size_t>(config.hidden);
  int const slots = config.expert_slots();
  std::vector<uint16_t> const want_x = ref::expand(config, world, mine);
  for (int e = 0; e < config.num_local_experts(world); ++e) {
    int const want = mine.expert_counts[static_cast<std::size_t>(e)];
    if (counts[e] != want) return detail::concat(where, "expert ", e, " count ", counts[e], ", want ", want);
    std::size_t const first = static_cast<std::size_t>(e) * static_cast<std::size_t>(slots) * hidden;
    std::size_t const filled = static_cast<std::size_t>(std::min(want, slots)) * hidden;
    if (std::memcmp(expert_x + first, want_x.data() + first, filled * 2) != 0)
      return detail::concat(where, "expert_x of expert ", e, " differs");
  }
  return "";
}

}  // namespace ferry::test
