// How a world is laid out over nodes: N nodes x M local ranks, world rank r = node * M + local (torchrun's order).
// A world of any size is representable (256 ranks = 32 nodes x 8); which peers a rank reaches by load/store is the
// communicator's to say (Communicator::load_store_reachable).
#pragma once

#include <string>

namespace ferry {

struct Topology {
  int nodes = 1;
  int local = 1;  // ranks per node
  int world() const { return nodes * local; }
  int node_of(int rank) const { return rank / local; }
  int local_of(int rank) const { return rank % local; }
  bool same_node(int a, int b) const { return node_of(a) == node_of(b); }
};

// "NxM" (e.g. "2x8"): N nodes of M ranks, both at least 1. Throws ConfigError naming the text and the form.
Topology parse_topology(std::string const& text);

// "2x8"
std::string topology_name(Topology const& topology);

// The topology of a world of `world` ranks of which `local_world` share this rank's host: `forced` when not empty
// (FERRY_TOPOLOGY: emulated nodes on one host; N x M must equal world), else world / local_world nodes of
// local_world ranks. Throws ConfigError when local_world does not divide world or `forced` does not match it.
Topology topology_of(int world, int local_world, std::string const& forced);

}  // namespace ferry
