#include "ferry/communicator.hpp"

#include <cstdint>
#include <cstdio>

#include "ferry/error.hpp"

namespace ferry {

Topology parse_topology(std::string const& text) {
  int nodes = 0, local = 0;
  char tail = 0;
  FERRY_CHECK_CONFIG(std::sscanf(text.c_str(), "%dx%d%c", &nodes, &local, &tail) == 2 && nodes >= 1 && local >= 1,
                     "topology '", text, "' is not of the form NxM (N nodes of M ranks, both at least 1, e.g. 2x8)");
  int64_t const world = int64_t{nodes} * local;
  FERRY_CHECK_CONFIG(world <= kMaxWorld, "topology '", text, "' has ", world, " ranks; a world has at most ", kMaxWorld,
                     " (kMaxWorld, e.g. 32x8)");
  return {nodes, local};
}

std::string topology_name(Topology const& topology) {
  return std::to_string(topology.nodes) + "x" + std::to_string(topology.local);
}

Topology topology_of(int world, int local_world, std::string const& forced) {
  if (!forced.empty()) {
    Topology const topology = parse_topology(forced);
    FERRY_CHECK_CONFIG(topology.world() == world, "FERRY_TOPOLOGY=", forced, " has ", topology.world(),
                       " ranks but the world has ", world, "; give N nodes x M ranks with N x M = ", world);
    return topology;
  }
  FERRY_CHECK_CONFIG(local_world >= 1 && world % local_world == 0, "a world of ", world, " ranks with ", local_world,
                     " on this host does not split into whole nodes; every node must run the same number of ranks "
                     "(LOCAL_WORLD_SIZE), or set FERRY_TOPOLOGY=NxM");
  return {world / local_world, local_world};
}

}  // namespace ferry
