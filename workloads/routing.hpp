// Routing generators shared by the tests and `ferry bench`: topk_idx / topk_weights for one rank's tokens, a pure
// function of (options, shape, rank), so any process can regenerate any rank's routing (the GPU tests do).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace ferry {

// Every kind gives each token distinct experts (ignoring -1 entries). Each token draws from its own stream of a
// self-contained generator seeded from (seed, rank, token), using exact integer and binary arithmetic only: the output
// is the same on every machine, and a token's routing does not depend on how many tokens follow it.
enum class RoutingKind {
  random,   // k distinct experts per token, uniform
  ring,     // deterministic: column j of token t of rank r goes to rank (r+1+j) % world; the m-th column that lands
            // on a rank takes its local expert (t + m) % experts_per_rank
  grouped,  // DeepSeek-V3 group-limited: experts in expert_groups groups, each token picks topk_groups groups first,
            // then topk distinct experts uniformly within them
  hot,      // a fraction hot_fraction of tokens pick hot_expert (the rest of their experts random); the other tokens
            // avoid it, so the share of tokens using it is hot_fraction (before masking)
};

char const* routing_name(RoutingKind kind);
RoutingKind parse_routing(std::string const& name);  // throws ConfigError naming the value and the choices

struct RoutingOptions {
  RoutingKind kind = RoutingKind::random;
  int expert_groups = 8;  // grouped: number of groups (must divide num_experts)
  int topk_groups = 4;    // grouped: groups each token may use (topk <= topk_groups * experts per group)
  // Extra columns after the routed ones: random distinct experts of the token's own rank that none of its routed
  // columns uses; never masked.
  int shared_experts = 0;
  double hot_fraction = 0.5;  // hot: share of tokens that pick hot_expert
  int hot_expert = 0;
  double mask_rate = 0.0;  // probability that a routed entry is replaced by -1
  uint64_t seed = 1;
};

// Columns of topk_idx the options produce: routed topk + shared_experts.
int routing_columns(RoutingOptions const& options, int routed_topk);

// Throws ConfigError when the options cannot produce routing for this shape (e.g. groups not dividing experts,
// topk larger than the experts topk_groups groups hold, shared_experts more than the rank's experts left beside the
// routed columns that can be local), naming the option, the value and the rule.
void validate_routing(RoutingOptions const& options, int num_experts, int world, int routed_topk);

// Fills topk_idx[num_tokens * columns] (row-major) and topk_weights (same shape; positive for valid entries,
// summing to 1 over a token's valid entries, 0 for -1 entries). Deterministic in (options.seed, rank).
void generate_routing(RoutingOptions const& options, int num_experts, int world, int rank, int num_tokens,
                      int routed_topk, std::span<int64_t> topk_idx, std::span<float> topk_weights);

// Random bf16 bit patterns (finite, roughly N(0,1): a scaled sum of four uniforms, within +-3.47) for
// num_tokens x hidden, deterministic in (seed, rank); row t does not depend on num_tokens.
std::vector<uint16_t> generate_tokens(uint64_t seed, int rank, int num_tokens, int hidden);

}  // namespace ferry
