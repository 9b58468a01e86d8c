// Low-latency buffers of virtual ranks (tests/support/virtual_ranks.hpp) across emulated nodes: what CudaEp sets up
// per rank when the topology spans nodes on one host, for the GPU tests of low-latency mode (test_ll_virtual.cu) and
// of rank masking (test_wait_stats_virtual.cu).
#pragma once

#include <cstdint>

#include "ep/cuda/buffers.hpp"
#include "ferry/communicator.hpp"

namespace ferry::test {

// The emulated network of rank r of `topology` (configure step, before allocation): seeded per rank, deliveries
// delayed by up to delay_ns and reordered. Nothing on one node.
inline void set_emulated_nodes(cuda_ep::Buffers& b, Topology const& topology, uint64_t seed, int r, uint32_t delay_ns) {
  if (topology.nodes <= 1) return;
  b.topology = topology;
  b.network_kind = transport::Kind::emulated;
  b.network.seed = seed ^ static_cast<uint64_t>(r);
  b.network.max_delay_ns = delay_ns;
  b.network.reorder = 1;
}

// A rank's buffers (cuda_ep::allocate_buffers); across nodes also the emulated network over every rank's region,
// after which the rank loses the load/store windows of the other nodes' ranks: a kernel that stores into one faults.
inline void allocate_ll(cuda_ep::Buffers& b) {
  bool const across = b.layout.nodes > 1;
  if (across) {
    for (int r = 0; r < b.world; ++r) b.network.windows[r] = b.sym.peer(r);
    b.network.rank = b.rank;
    b.network.world = b.world;
  }
  cuda_ep::allocate_buffers(b);
  if (across)
    for (int r = 0; r < b.world; ++r)
      if (r / b.layout.local != b.rank / b.layout.local) b.sym.ptr[r] = nullptr;  // team slot r: lsa_first is 0
}

}  // namespace ferry::test
