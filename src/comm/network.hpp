// The network between nodes: which transport reaches the peers NVLink does not (FERRY_NETWORK), and the words of the
// refusal where GIN is needed and missing. Host only, no CUDA or NCCL header: the rules are unit-tested everywhere.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ferry/communicator.hpp"

namespace ferry::detail {

enum class Network : uint8_t {
  automatic,  // "auto": GIN only when some peer is not load/store reachable (a world larger than the NVLink team)
  emulated,   // never GIN: every peer must share memory (the emulated transport stands in for the network)
  gin,        // GIN set up at construction whatever the world, so a missing GIN shows at once, even at world 1
};

// FERRY_NETWORK's value ("auto", "emulated", "gin"); ConfigError naming the allowed values for another.
Network parse_network(std::string const& value);
char const* network_name(Network network);

// Whether a cuda communicator of `world` ranks whose NVLink team has `lsa_size` of them sets up GIN.
bool wants_gin(Network network, int world, int lsa_size);

// NCCL's version code (major * 10000 + minor * 100 + patch) as "2.28.9".
std::string nccl_version_name(int code);

inline constexpr int kGinMinNcclVersion = 22807;      // the first NCCL with GIN in its device API
inline constexpr int kGinClusterNcclVersion = 23004;  // what clusters run (DeepEP V2 needs it)

// The message of the ConfigError a communicator raises when it needs GIN and cannot have it: `reason` (what is
// missing, in NCCL's words where it gave some), the loaded NCCL `loaded_version`, and how to get GIN (the version, a
// backend and its NIC, NCCL_GIN_TYPE, where NCCL says why, and FERRY_NETWORK).
std::string gin_missing_message(int loaded_version, std::string const& reason);

// A rank's node (of `topology`) must lie inside its NVLink team, world ranks [lsa_first, lsa_first + lsa_size): the
// protocols reach the ranks of their own node by load/store and only the others through the network. ConfigError
// naming both ranges otherwise (a topology forced wider than the hardware's NVLink domain).
void check_node_in_team(Topology const& topology, int rank, int lsa_first, int lsa_size);

// The GIN signals of a device communicator, ids [0, capacity), handed out as ranges to the owners that count through
// them (a symmetric region's protocol, named by the region's id). First fit, so every rank hands out the same ids when
// it makes the same calls in the same order, which the communicator's collective, ordered region allocations ensure:
// a signal id names the same counter on every rank. A range given back is reused; its new owner resets it first.
class SignalRanges {
 public:
  explicit SignalRanges(uint32_t capacity) : capacity_(capacity) {}

  // The first id of `count` free signals (count 0: no signals, returns 0), owned by `owner`. ConfigError when no
  // free run is long enough, saying how many are in use.
  uint32_t take(uint64_t owner, uint32_t count);
  // Every range of `owner` is free again (none: nothing happens).
  void give_back(uint64_t owner);
  uint32_t in_use() const;

 private:
  struct Range {
    uint32_t first;
    uint32_t count;
    uint64_t owner;
  };
  uint32_t capacity_;
  std::vector<Range> taken_;  // ascending by first, disjoint
};

}  // namespace ferry::detail
