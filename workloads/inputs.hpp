// Every rank's inputs of a synthetic workload (tokens from generate_tokens, routing from generate_routing), as the
// tests, ferry bench and ferry tune build them. Not part of libferry: the library takes the caller's inputs.
#pragma once

#include <span>
#include <vector>

#include "ep/reference.hpp"
#include "workloads/routing.hpp"

namespace ferry::ref {

// Every rank's inputs, as a test or benchmark builds them from one shared seed: rank r gets num_tokens[r] tokens
// from generate_tokens(routing.seed, r, ...) and routing from generate_routing(routing, ..., r, ...) with
// config.topk - routing.shared_experts routed columns. Any process can rebuild any rank's input.
std::vector<RankInput> generate_inputs(EpConfig const& config, int world, RoutingOptions const& routing,
                                       std::span<int const> num_tokens);

}  // namespace ferry::ref
