#include "workloads/routing.hpp"

#include "ep/reference.hpp"

#include <algorithm>
#include <array>
#include <bit>

#include "ferry/ep.hpp"
#include "ferry/error.hpp"

namespace ferry {
namespace {

// NOTE: every random draw comes from this generator and integer/binary arithmetic only (no <random> distributions,
// whose output is implementation-defined, and no libm transcendental, which may differ in the last ulp between
// libm versions), so every machine produces the same routing and tokens for a seed.
uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// xoshiro256** seeded through splitmix64 from (seed, stream, rank, item): one independent stream per token, so a
// token's routing does not depend on how many tokens come after it.
class Rng {
 public:
  Rng(uint64_t seed, uint64_t stream, int rank, int64_t item) {
    uint64_t mix = seed;
    mix = splitmix64(mix) ^ stream;
    mix = splitmix64(mix) ^ static_cast<uint64_t>(rank);
    mix = splitmix64(mix) ^ static_cast<uint64_t>(item);
    for (auto& word : state_) word = splitmix64(mix);
  }

  uint64_t next() {
    uint64_t const result = std::rotl(state_[1] * 5, 7) * 9;
    uint64_t const t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = std::rotl(state_[3], 45);
    return result;
  }

  // Uniform in [0, bound), bound >= 1 (Lemire's multiply-shift with rejection: unbiased).
  uint32_t below(uint32_t bound) {
    uint64_t product = static_cast<uint64_t>(static_cast<uint32_t>(next() >> 32)) * bound;
    auto low = static_cast<uint32_t>(product);
    if (low < bound) {
      uint32_t const threshold = static_cast<uint32_t>(-bound) % bound;
      while (low < threshold) {
        product = static_cast<uint64_t>(static_cast<uint32_t>(next() >> 32)) * bound;
        low = static_cast<uint32_t>(product);
      }
    }
    return static_cast<uint32_t>(product >> 32);
  }

  // Uniform in [0, 1) with 53 random bits.
  double unit() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

 private:
  std::array<uint64_t, 4> state_{};
};

// Salts that separate the streams drawn from one seed.
constexpr uint64_t kRoutingStream = 0x726f7574696e6731ULL;  // "routing1"
constexpr uint64_t kTokenStream = 0x746f6b656e730031ULL;    // "tokens\01"

constexpr uint32_t kWeightFloor = 1U << 16;
constexpr uint32_t kWeightSpan = 1U << 19;
static_assert(static_cast<uint64_t>(kMaxTopk) * (kWeightFloor + kWeightSpan) < (1U << 24),
              "weight draws must sum exactly in float");

using Row = std::array<int64_t, kMaxTopk>;

bool contains(Row const& row, int count, int64_t value) {
  return std::find(row.begin(), row.begin() + count, value) != row.begin() + count;
}

// Floyd's algorithm: count distinct values of [0, n) uniformly, then a Fisher-Yates shuffle so every order is
// equally likely too. Writes them to out[0, count).
void sample_distinct(Rng& rng, int n, int count, int64_t* out) {
  int filled = 0;
  for (int j = n - count; j < n; ++j) {
    auto const pick = static_cast<int64_t>(rng.below(static_cast<uint32_t>(j + 1)));
    bool const seen = std::find(out, out + filled, pick) != out + filled;
    out[filled++] = seen ? j : pick;
  }
  for (int i = count - 1; i > 0; --i) std::swap(out[i], out[rng.below(static_cast<uint32_t>(i + 1))]);
}

// Routed experts that can land on the token's own rank in the worst case (bounds the room left for shared ones).
int worst_local_routed(RoutingOptions const& options, int num_experts, int world, int routed_topk) {
  int const local_experts = num_experts / world;
  if (options.kind == RoutingKind::ring) return routed_topk / world;  // columns j with (1 + j) % world == 0
  return std::min(routed_topk, local_experts);
}

void route_token(RoutingOptions const& options, int num_experts, int world, int rank, int64_t token, int routed_topk,
                 Rng& rng, Row& row) {
  int const local_experts = num_experts / world;
  switch (options.kind) {
    case RoutingKind::random:
      sample_distinct(rng, num_experts, routed_topk, row.data());
      break;
    case RoutingKind::ring:
      // Column j goes to rank (rank + 1 + j) % world; the m-th column on the same rank takes the next expert there,
      // so the experts stay distinct (at most ceil(topk / world) <= local_experts columns share a rank).
      for (int j = 0; j < routed_topk; ++j) {
        int const dest = (rank + 1 + j) % world;
        int const round = j / world;
        row[j] = static_cast<int64_t>(dest) * local_experts + (token + round) % local_experts;
      }
      break;
    case RoutingKind::grouped: {
      int const group_size = num_experts / options.expert_groups;
      std::vector<int64_t> chosen_groups(static_cast<std::size_t>(options.topk_groups));
      sample_distinct(rng, options.expert_groups, options.topk_groups, chosen_groups.data());
      // Experts of the union of the chosen groups, numbered 0 .. topk_groups * group_size - 1.
      sample_distinct(rng, options.topk_groups * group_size, routed_topk, row.data());
      for (int j = 0; j < routed_topk; ++j)
        row[j] = chosen_groups[static_cast<std::size_t>(row[j] / group_size)] * group_size + row[j] % group_size;
      break;
    }
    case RoutingKind::hot:
      if (rng.unit() < options.hot_fraction) {
        // The hot expert plus topk - 1 others, at a random column.
        sample_distinct(rng, num_experts - 1, routed_topk - 1, row.data());
        for (int j = 0; j < routed_topk - 1; ++j)
          if (row[j] >= options.hot_expert) ++row[j];
        row[routed_topk - 1] = options.hot_expert;
        std::swap(row[routed_topk - 1], row[rng.below(static_cast<uint32_t>(routed_topk))]);
      } else {
        // Not a hot token: its experts avoid the hot one, so the share of tokens using it is hot_fraction.
        sample_distinct(rng, num_experts - 1, routed_topk, row.data());
        for (int j = 0; j < routed_topk; ++j)
          if (row[j] >= options.hot_expert) ++row[j];
      }
      break;
  }
}

}  // namespace

char const* routing_name(RoutingKind kind) {
  switch (kind) {
    case RoutingKind::random:
      return "random";
    case RoutingKind::ring:
      return "ring";
    case RoutingKind::grouped:
      return "grouped";
    case RoutingKind::hot:
      return "hot";
  }
  return "unknown";
}

RoutingKind parse_routing(std::string const& name) {
  for (RoutingKind kind : {RoutingKind::random, RoutingKind::ring, RoutingKind::grouped, RoutingKind::hot})
    if (name == routing_name(kind)) return kind;
  FERRY_THROW(ConfigError, "config", "routing '", name, "' is unknown; use random, ring, grouped or hot");
}

int routing_columns(RoutingOptions const& options, int routed_topk) {
  return routed_topk + options.shared_experts;
}

void validate_routing(RoutingOptions const& options, int num_experts, int world, int routed_topk) {
  FERRY_CHECK_CONFIG(world >= 1, "world=", world, " must be at least 1");
  FERRY_CHECK_CONFIG(num_experts >= 1 && num_experts % world == 0, "num_experts=", num_experts,
                     " must be a positive multiple of world=", world, " (experts are split evenly over ranks)");
  FERRY_CHECK_CONFIG(routed_topk >= 1 && routed_topk <= num_experts, "topk=", routed_topk, " is outside [1, ",
                     num_experts, "]; a token picks distinct experts among num_experts=", num_experts);
  FERRY_CHECK_CONFIG(options.shared_experts >= 0, "shared_experts=", options.shared_experts, " must be >= 0");
  int const columns = routing_columns(options, routed_topk);
  FERRY_CHECK_CONFIG(columns <= kMaxTopk, "topk=", routed_topk, " + shared_experts=", options.shared_experts, " = ",
                     columns, " columns exceeds the supported ", kMaxTopk);
  FERRY_CHECK_CONFIG(options.mask_rate >= 0.0 && options.mask_rate <= 1.0, "mask_rate=", options.mask_rate,
                     " is outside [0, 1] (a probability)");
  int const local_experts = num_experts / world;
  switch (options.kind) {
    case RoutingKind::random:
    case RoutingKind::ring:
      break;
    case RoutingKind::grouped: {
      FERRY_CHECK_CONFIG(options.expert_groups >= 1 && num_experts % options.expert_groups == 0,
                         "expert_groups=", options.expert_groups, " must divide num_experts=", num_experts,
                         " (groups are equal)");
      FERRY_CHECK_CONFIG(options.topk_groups >= 1 && options.topk_groups <= options.expert_groups,
                         "topk_groups=", options.topk_groups, " is outside [1, expert_groups=", options.expert_groups,
                         "]");
      int const group_size = num_experts / options.expert_groups;
      FERRY_CHECK_CONFIG(routed_topk <= options.topk_groups * group_size, "topk=", routed_topk, " is larger than the ",
                         options.topk_groups * group_size, " experts that topk_groups=", options.topk_groups,
                         " groups of ", group_size, " hold; raise topk_groups or lower topk");
      break;
    }
    case RoutingKind::hot:
      FERRY_CHECK_CONFIG(options.hot_fraction >= 0.0 && options.hot_fraction <= 1.0,
                         "hot_fraction=", options.hot_fraction, " is outside [0, 1] (a share of tokens)");
      FERRY_CHECK_CONFIG(options.hot_expert >= 0 && options.hot_expert < num_experts, "hot_expert=", options.hot_expert,
                         " is outside [0, num_experts=", num_experts, ")");
      // NOTE: tokens that are not hot avoid the hot expert, so they need topk experts among the other ones.
      FERRY_CHECK_CONFIG(routed_topk < num_experts, "topk=", routed_topk, " must be below num_experts=", num_experts,
                         " for hot routing (the tokens that are not hot avoid the hot expert)");
      break;
  }
  // NOTE: shared columns are experts of the token's own rank, distinct from each other and from every routed expert
  // of the token; that needs room on the rank even when the routed experts that can be local all are.
  int const worst = worst_local_routed(options, num_experts, world, routed_topk);
  FERRY_CHECK_CONFIG(options.shared_experts + worst <= local_experts, "shared_experts=", options.shared_experts,
                     " needs that many experts of the token's own rank besides its routed ones, but a rank holds ",
                     local_experts, " experts and up to ", worst, " routed experts (", routing_name(options.kind),
                     ", topk=", routed_topk, ") can be local; use shared_experts <= ", local_experts - worst,
                     " or more experts per rank");
}

void generate_routing(RoutingOptions const& options, int num_experts, int world, int rank, int num_tokens,
                      int routed_topk, std::span<int64_t> topk_idx, std::span<float> topk_weights) {
  validate_routing(options, num_experts, world, routed_topk);
  FERRY_CHECK_CONFIG(rank >= 0 && rank < world, "rank=", rank, " is outside [0, world=", world, ")");
  FERRY_CHECK_CONFIG(num_tokens >= 0, "num_tokens=", num_tokens, " must be >= 0");
  int const columns = routing_columns(options, routed_topk);
  std::size_t const needed = static_cast<std::size_t>(num_tokens) * columns;
  FERRY_CHECK_CONFIG(topk_idx.size() >= needed && topk_weights.size() >= needed, "topk_idx holds ", topk_idx.size(),
                     " and topk_weights ", topk_weights.size(), " entries; num_tokens=", num_tokens,
                     " x columns=", columns, " needs ", needed);
  int const local_experts = num_experts / world;
  for (int t = 0; t < num_tokens; ++t) {
    Rng rng(options.seed, kRoutingStream, rank, t);
    Row row{};
    route_token(options, num_experts, world, rank, t, routed_topk, rng, row);

    // Masking draws one number per routed column whatever the rate, so the rate does not shift the other draws.
    for (int j = 0; j < routed_topk; ++j)
      if (rng.unit() < options.mask_rate) row[j] = -1;

    // Shared columns: distinct experts of this rank that no routed column of the token uses (validate_routing
    // guarantees there are enough).
    if (options.shared_experts > 0) {
      std::vector<int64_t> candidates;
      candidates.reserve(static_cast<std::size_t>(local_experts));
      for (int e = 0; e < local_experts; ++e) {
        int64_t const expert = static_cast<int64_t>(rank) * local_experts + e;
        if (!contains(row, routed_topk, expert)) candidates.push_back(expert);
      }
      std::vector<int64_t> picks(static_cast<std::size_t>(options.shared_experts));
      sample_distinct(rng, static_cast<int>(candidates.size()), options.shared_experts, picks.data());
      for (int s = 0; s < options.shared_experts; ++s)
        row[routed_topk + s] = candidates[static_cast<std::size_t>(picks[static_cast<std::size_t>(s)])];
    }

    // Weights: positive, within a factor 9 of each other, normalised over the valid columns. The draws are integers
    // below 2^20 and their sum stays below 2^24, so every float here is exact and the one division is correctly
    // rounded: no contraction or evaluation order can change the result.
    std::array<float, kMaxTopk> weights{};
    float sum = 0.0f;
    for (int j = 0; j < columns; ++j) {
      auto const draw = static_cast<float>(kWeightFloor + rng.below(kWeightSpan));
      weights[j] = row[j] >= 0 ? draw : 0.0f;
      sum += weights[j];
    }
    for (int j = 0; j < columns; ++j) {
      std::size_t const at = static_cast<std::size_t>(t) * columns + j;
      topk_idx[at] = row[j];
      topk_weights[at] = row[j] >= 0 ? weights[j] / sum : 0.0f;
    }
  }
}

std::vector<uint16_t> generate_tokens(uint64_t seed, int rank, int num_tokens, int hidden) {
  FERRY_CHECK_CONFIG(num_tokens >= 0 && hidden >= 0, "num_tokens=", num_tokens, " and hidden=", hidden,
                     " must be >= 0");
  std::vector<uint16_t> tokens(static_cast<std::size_t>(num_tokens) * hidden);
  // Irwin-Hall: the sum of four 16-bit uniforms, centred and scaled to unit variance. Exact integer and binary
  // arithmetic, so the same on every machine; values lie within +-3.47, always finite.
  constexpr double kScale = 1.7320508075688772 / 65536.0;  // sqrt(12 / 4) per 2^16 step
  for (int t = 0; t < num_tokens; ++t) {
    Rng rng(seed, kTokenStream, rank, t);
    for (int h = 0; h < hidden; ++h) {
      uint64_t const bits = rng.next();
      int64_t const sum = static_cast<int64_t>(bits & 0xffff) + static_cast<int64_t>((bits >> 16) & 0xffff) +
                          static_cast<int64_t>((bits >> 32) & 0xffff) + static_cast<int64_t>(bits >> 48);
      auto const value = static_cast<float>(static_cast<double>(sum - 2 * 65535) * kScale);
      tokens[static_cast<std::size_t>(t) * hidden + h] = ref::float_to_bf16(value);
    }
  }
  return tokens;
}

}  // namespace ferry
