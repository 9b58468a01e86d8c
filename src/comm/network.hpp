// The network between nodes: which transport reaches the peers NVLink does not (FERRY_NETWORK), and the words of the
// refusal where GIN is needed and missing. Host only, no CUDA or NCCL header: the rules are unit-tested everywhere.
#pragma once

#include <cstdint>
#include <string>

namespace ferry::detail {

enum class Network : uint8_t {
  automatic,  // "auto": GIN only when some peer is not load/store reachable (a world larger than the NVLink team)
  emulated,   // never GIN: every peer must share memory (the emulated transport stands in for the network)
  gin,        // GIN set up at construction whatever the world, so a missing GIN shows at once, even at world 1
};

// FERRY_NETWORK's value ("auto", "emulated", "gin"); ConfigError naming the allowed values for another.
Network network_of(std::string const& value);
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

}  // namespace ferry::detail
