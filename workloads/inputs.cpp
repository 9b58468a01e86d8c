#include "workloads/inputs.hpp"

#include <cstddef>
#include <cstdint>

#include "ferry/error.hpp"

namespace ferry::ref {
namespace {

std::size_t at(int64_t row, int64_t width) {
  return static_cast<std::size_t>(row * width);
}

}  // namespace

std::vector<RankInput> generate_inputs(EpConfig const& config, int world, RoutingOptions const& routing,
                                       std::span<int const> num_tokens) {
  FERRY_CHECK_CONFIG(num_tokens.size() == static_cast<std::size_t>(world), "got ", num_tokens.size(),
                     " token counts for world=", world, "; pass one per rank");
  int const routed_topk = config.topk - routing.shared_experts;
  FERRY_CHECK_CONFIG(routed_topk >= 1, "topk=", config.topk,
                     " leaves no routed column beside shared_experts=", routing.shared_experts);
  std::vector<RankInput> inputs(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    RankInput& input = inputs[static_cast<std::size_t>(r)];
    input.num_tokens = num_tokens[static_cast<std::size_t>(r)];
    input.x = generate_tokens(routing.seed, r, input.num_tokens, config.hidden);
    input.topk_idx.resize(at(input.num_tokens, config.topk));
    input.topk_weights.resize(input.topk_idx.size());
    generate_routing(routing, config.num_experts, world, r, input.num_tokens, routed_topk, input.topk_idx,
                     input.topk_weights);
  }
  return inputs;
}

}  // namespace ferry::ref
