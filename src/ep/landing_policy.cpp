#include "ep/landing_policy.hpp"

#include <cstdint>

#include "ep/capacity.hpp"
#include "ep/run_record.hpp"
#include "ferry/error.hpp"

namespace ferry::detail {

std::size_t landing_smem_bytes(EpConfig const& config, int world) {
  return (static_cast<std::size_t>(world) * static_cast<std::size_t>(config.max_tokens_per_rank) +
          static_cast<std::size_t>(config.num_local_experts(world))) *
         sizeof(int32_t);
}

namespace {

// Empty when the landing zone can serve the config, else the rule it breaks.
std::string landing_unsupported(EpConfig const& config, int world) {
  if (config.mode != Mode::normal) return "the landing zone is a normal-mode dispatch";
  int64_t const worst = static_cast<int64_t>(world) * config.max_tokens_per_rank;
  if (row_drops_possible(config, world))
    return concat("max_recv_tokens=", config.recv_capacity(world), " caps the receive buffers below world * ",
                  "max_tokens_per_rank=", worst, ": senders could not tell which rows the receiver drops");
  if (slot_drops_possible(config, world))
    return concat("expert_capacity=", config.expert_slots(), " is below the receive capacity ",
                  config.recv_capacity(world), ": an expert's entries past it would be known to its receiver alone, ",
                  "and the count exchange carries every expert's count to every rank");
  if (landing_smem_bytes(config, world) > kLandingMaxSmem)
    return concat("world * max_tokens_per_rank=", worst, " landing slots need ", landing_smem_bytes(config, world),
                  " bytes of shared memory in the receiver, more than ", kLandingMaxSmem);
  return {};
}

}  // namespace

LandingChoice choose_normal_landing(EpConfig const& config, int world, std::string const& pin) {
  bool const forced_on = pin == "on" || pin == "1";
  bool const forced_off = pin == "off" || pin == "0";
  FERRY_CHECK_CONFIG(forced_on || forced_off || pin.empty() || pin == "auto", "FERRY_NORMAL_LANDING=", pin,
                     " is not one of auto, on, off");
  std::string const unsupported = landing_unsupported(config, world);
  if (forced_on) {
    FERRY_CHECK_CONFIG(unsupported.empty(), "FERRY_NORMAL_LANDING=on, but ", unsupported);
    return {true, "landing zone (FERRY_NORMAL_LANDING=on)"};
  }
  if (forced_off) return {false, "count exchange (FERRY_NORMAL_LANDING=off)"};
  int64_t const slots = static_cast<int64_t>(world) * config.max_tokens_per_rank;
  bool const small = slots <= kLandingAutoMaxSlots;
  // NOTE: a small batch the landing zone cannot serve takes the count exchange, the slower protocol at that size: a
  // fallback (explain() and the fast-path test see it).
  if (!unsupported.empty())
    return {false, concat("count exchange (", unsupported, ")"), small && config.mode == Mode::normal};
  if (!small)
    return {false, concat("count exchange (world * max_tokens_per_rank=", slots, " > ", kLandingAutoMaxSlots,
                          " landing slots: a large batch)")};
  if (fallback_forced_for_test())
    return {false, "count exchange (a test forced the fallback: force_fallback_for_test)", true};
  return {true, concat("landing zone (world * max_tokens_per_rank=", slots, " <= ", kLandingAutoMaxSlots,
                       " landing slots: a small batch)")};
}

ProtocolChoice choose_protocol(EpConfig const& config, int world, std::string const& landing_pin, int nodes) {
  if (config.mode == Mode::low_latency) return {Protocol::ll, {}, false};
  if (nodes > 1)
    return {Protocol::hierarchical, "over nodes: a token crosses the network once per node, to its rail, then NVLink",
            false};
  LandingChoice landing = choose_normal_landing(config, world, landing_pin);
  return {landing.use ? Protocol::landing : Protocol::push, std::move(landing.why), landing.fallback};
}

EpConfig cuda_route_for_masking(EpConfig config, Topology const& topology) {
  if (!config.rank_masking || topology.nodes <= 1 || config.mode != Mode::low_latency) return config;
  FERRY_CHECK_CONFIG(config.internode_route != InternodeRoute::forward,
                     "rank_masking=true with internode_route=forward across nodes (topology ", topology_name(topology),
                     "): the cuda backend masks ranks across nodes on the direct route only (the forward route's rail "
                     "replacement is built on the cpu backend); use internode_route=direct or automatic");
  config.internode_route = InternodeRoute::direct;
  return config;
}

}  // namespace ferry::detail
