// Routing generators shared by the tests and `ferry bench`: topk_idx / topk_weights for one rank's tokens, a pure
// function of (options, shape, rank), so any process can regenerate any rank's routing (the GPU tests do).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace ferry {

enum class RoutingKind {
  random,   // k distinct experts per token, uniform
  ring,     // deterministic: token t of rank r goes to experts of the next ranks (r+1, r+2, ...)
  grouped,  // DeepSeek-V3 group-limited: experts in expert_groups groups, each token picks topk_groups groups first
  hot,      // a fraction hot_fraction of tokens pick hot_expert (the rest of their experts random)
};

char const* routing_name(RoutingKind kind);
RoutingKind parse_routing(std::string const& name);  // throws ConfigError naming the value and the choices

struct RoutingOptions {
  RoutingKind kind = RoutingKind::random;
  int expert_groups = 8;    // grouped: number of groups (must divide num_experts)
  int topk_groups = 4;      // grouped: groups each token may use (topk <= topk_groups * experts per group)
  int shared_experts = 0;   // extra columns after the routed ones, pinned to an expert on the token's own rank
  double hot_fraction = 0.5;  // hot: share of tokens that pick hot_expert
  int hot_expert = 0;
  double mask_rate = 0.0;   // probability that a routed entry is replaced by -1
  uint64_t seed = 1;
};

// Columns of topk_idx the options produce: routed topk + shared_experts.
int routing_columns(RoutingOptions const& options, int routed_topk);

// Throws ConfigError when the options cannot produce routing for this shape (e.g. groups not dividing experts,
// topk larger than the experts topk_groups groups hold), naming the option and the rule.
void validate_routing(RoutingOptions const& options, int num_experts, int world, int routed_topk);

// Fills topk_idx[num_tokens * columns] (row-major) and topk_weights (same shape; positive for valid entries,
// summing to 1 over a token's valid entries, 0 for -1 entries). Deterministic in (options.seed, rank).
void generate_routing(RoutingOptions const& options, int num_experts, int world, int rank, int num_tokens,
                      int routed_topk, std::span<int64_t> topk_idx, std::span<float> topk_weights);

// Random bf16 bit patterns (finite, roughly N(0,1)) for num_tokens x hidden, deterministic in (seed, rank).
std::vector<uint16_t> generate_tokens(uint64_t seed, int rank, int num_tokens, int hidden);

}  // namespace ferry
