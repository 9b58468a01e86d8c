#include "comm/network.hpp"

#include <algorithm>

#include "ferry/error.hpp"

namespace ferry::detail {

Network parse_network(std::string const& value) {
  if (value == "auto") return Network::automatic;
  if (value == "emulated") return Network::emulated;
  if (value == "gin") return Network::gin;
  FERRY_THROW(ConfigError, "config", "FERRY_NETWORK=", value, " is not one of auto, emulated, gin");
}

char const* network_name(Network network) {
  switch (network) {
    case Network::automatic:
      return "auto";
    case Network::emulated:
      return "emulated";
    case Network::gin:
      return "gin";
  }
  return "unknown";
}

bool wants_gin(Network network, int world, int lsa_size) {
  switch (network) {
    case Network::automatic:
      return world > lsa_size;
    case Network::emulated:
      return false;
    case Network::gin:
      return true;
  }
  return false;
}

std::string nccl_version_name(int code) {
  return concat(code / 10000, ".", (code / 100) % 100, ".", code % 100);
}

std::string gin_missing_message(int loaded_version, std::string const& reason) {
  std::string const version = loaded_version < kGinMinNcclVersion
                                  ? concat("the loaded NCCL ", nccl_version_name(loaded_version), " is older than ",
                                           nccl_version_name(kGinMinNcclVersion), ", the first with GIN: load NCCL ",
                                           nccl_version_name(kGinClusterNcclVersion), " or newer")
                                  : concat("the loaded NCCL is ", nccl_version_name(loaded_version), " (clusters run ",
                                           nccl_version_name(kGinClusterNcclVersion), " or newer)");
  return concat(
      "GIN (NCCL's GPU-initiated networking) is needed but missing: ", reason, "; ", version,
      ". GIN needs a backend on every rank: GDAKI (NCCL_GIN_TYPE=3: a ConnectX NIC with GPUDirect RDMA) or the host "
      "proxy (NCCL_GIN_TYPE=2) over IB verbs (an RDMA NIC, InfiniBand or RoCE); NCCL 2.32.3 and newer also has a GIN "
      "over TCP sockets, which needs GDRCopy. Leave NCCL_GIN_ENABLE unset (0 disables GIN), unset NCCL_GIN_TYPE or set "
      "it to a backend this host has, and run with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET to see why NCCL found "
      "none. On one NVLink host no GIN is needed: FERRY_NETWORK=auto (the default) or emulated");
}

void check_node_in_team(Topology const& topology, int rank, int lsa_first, int lsa_size) {
  int const first = topology.node_of(rank) * topology.local;
  int const last = first + topology.local - 1;
  FERRY_CHECK_CONFIG(first >= lsa_first && last < lsa_first + lsa_size, "topology ", topology_name(topology),
                     " puts ranks ", first, "..", last, " on the node of rank ", rank, ", but only ranks ", lsa_first,
                     "..", lsa_first + lsa_size - 1,
                     " share load/store access (NVLink) with it: a node's ranks must be one NVLink domain. Use a "
                     "topology with at most ",
                     lsa_size, " ranks per node (FERRY_TOPOLOGY, CommunicatorOptions::topology), or unset it");
}

uint32_t SignalRanges::take(uint64_t owner, uint32_t count) {
  if (count == 0) return 0;
  uint32_t at = 0;
  auto it = taken_.begin();
  for (; it != taken_.end(); ++it) {
    if (it->first - at >= count) break;
    at = it->first + it->count;
  }
  FERRY_CHECK_CONFIG(it != taken_.end() || capacity_ - at >= count, "no ", count,
                     " free GIN signals in a row: ", in_use(), " of the device communicator's ", capacity_,
                     " are held by live buffers; destroy the buffers you no longer use");
  taken_.insert(it, Range{at, count, owner});
  return at;
}

void SignalRanges::give_back(uint64_t owner) {
  std::erase_if(taken_, [owner](Range const& r) { return r.owner == owner; });
}

uint32_t SignalRanges::in_use() const {
  uint32_t used = 0;
  for (Range const& r : taken_) used += r.count;
  return used;
}

}  // namespace ferry::detail
