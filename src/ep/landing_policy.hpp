// Which protocol an EpBuffer of the cuda backend runs, decided once at construction (host code, so CI tests it):
// low-latency mode's (ll/dispatch.cuh / ll/combine.cuh), or in normal mode the count exchange (normal/dispatch.cuh:
// rows pushed straight into their final rank-major row), or, for small batches, the landing zone
// (normal/land_dispatch.cuh: rows land in fixed per-source slots, no count exchange, and the receiver compacts them).
// Both deliver the same outputs. Every rank must decide the same: the inputs are the config and FERRY_NORMAL_LANDING,
// which must be the same on every rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"

namespace ferry::detail {

// Most landing slots per receiver (world * max_tokens_per_rank) that take the landing zone when FERRY_NORMAL_LANDING is
// auto. The landing zone trades the count exchange's serial chain (a fixed cost) for a local copy of every received
// row (which grows with world * tokens). The bound is where the two crossed at EP2 (docs/design-notes.md, "Normal-mode
// dispatch of small batches", has the figures); the same slot bound gives EP4 / EP8 256 / 128 tokens per rank.
inline constexpr int kLandingAutoMaxSlots = 1024;
// Shared memory the landing receiver may use: one int per landing slot of every source plus one per local expert.
inline constexpr std::size_t kLandingMaxSmem = 200 * 1024;

struct LandingChoice {
  bool use = false;
  std::string why;  // for explain(): which protocol and the rule that chose it
  // The batch is small enough for the landing zone (the auto rule would take it) but the config rules it out, or a
  // test forced the count exchange (run_record.hpp force_fallback_for_test): the slower protocol for this size runs.
  bool fallback = false;
};

// pin: the text of FERRY_NORMAL_LANDING: "auto" (or empty), "on" / "1", "off" / "0"; anything else is a ConfigError.
// "on" for a config the landing zone cannot serve is a ConfigError naming the rule.
LandingChoice choose_normal_landing(EpConfig const& config, int world, std::string const& pin);

// The protocols of the cuda backend: normal mode's count exchange + push (normal/dispatch.cuh), normal mode's landing
// zone (normal/land_dispatch.cuh; combine is the push's), low-latency mode (ll/dispatch.cuh, ll/combine.cuh), and
// normal mode over several nodes (hier/dispatch.cuh, hier/combine.cuh: a token crosses the network once per node, to
// its rail).
enum class Protocol : uint8_t { push, landing, ll, hierarchical };

struct ProtocolChoice {
  Protocol protocol = Protocol::push;
  std::string why;        // empty for low-latency mode (one protocol)
  bool fallback = false;  // LandingChoice::fallback
};

// The protocol of an EpBuffer: low-latency mode's, or choose_normal_landing's for normal mode (landing_pin: the text
// of FERRY_NORMAL_LANDING).
// nodes > 1 (normal mode): the hierarchical protocol, whatever the pin.
ProtocolChoice choose_protocol(EpConfig const& config, int world, std::string const& landing_pin, int nodes = 1);

// Rank masking across nodes on the cuda backend runs low-latency mode's direct route: the forward route's rail
// replacement (a masked rail's node reached through another rank of it, docs/internode.md) is built on the cpu
// backend only. Returns `config` with an automatic route resolved to direct when rank_masking is on across nodes
// (topology.nodes > 1); an explicit forward route there is a ConfigError. Anything else comes back unchanged. The same
// on every rank (the config and the topology agree).
EpConfig cuda_route_for_masking(EpConfig config, Topology const& topology);

// Dynamic shared memory of the landing receiver for a config.
std::size_t landing_smem_bytes(EpConfig const& config, int world);

}  // namespace ferry::detail
