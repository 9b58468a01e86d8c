// The Params of the hierarchical normal-mode kernels (hier_dispatch.cuh, hier_combine.cuh): the one-node kernels'
// Params plus the network transport to the ranks of other nodes (a template argument: Emulated in the tests, GIN on a
// cluster) and the topology. Ranks of this rank's node are reached through KernelParams::net (NVLink), ranks of other
// nodes only through `network`.
#pragma once

#include <cstdint>

#include "comm/transport/group.cuh"
#include "ep/cuda/params.cuh"

namespace ferry::cuda_ep {

template <class Net>
struct HierDispatchParams : DispatchParams {
  Net network;
  int nodes;
  int local;            // ranks per node
  int32_t* node_pos;    // [max_tokens, nodes] position of the token among this rank's tokens bound for that node
  uint32_t* hier_mask;  // [max_tokens] out: who sends the token's combine row back (own-node ranks, other rails)
  bool skip_rail_wait;  // TEST ONLY: the rail forwards without waiting for the network's signal
};

template <class Net>
struct HierCombineParams : CombineParams {
  Net network;
  int nodes;
  int local;
  uint32_t const* hier_mask;  // [max_tokens] of the last dispatch
  int recv_capacity;          // rows of the receive buffers (a forward record's rows are below it)
  uint16_t* rail_partials;    // quantized combine_format: [nodes, max_tokens, hidden] the rail's bf16 sums
};

// The ranks of node `node` as a mask of the world (world <= 32).
__host__ __device__ inline uint32_t node_bits(int node, int local) {
  uint32_t const one_node = local >= 32 ? 0xffffffffu : (1u << local) - 1u;
  return one_node << (node * local);
}

// A forward record (hier_record_bytes): token, rows on the rail's node, global ids, weights.
struct HierRecord {
  int32_t* token;
  int32_t* rows;   // [local]
  int32_t* ids;    // [topk]
  float* weights;  // [topk]
};

__device__ __forceinline__ HierRecord hier_record(char* base, int local, int topk) {
  auto* const words = reinterpret_cast<int32_t*>(base);
  return HierRecord{words, words + 1, words + 1 + local, reinterpret_cast<float*>(words + 1 + local + topk)};
}

// The warp-uniform arrival a warp of the grid adds to a counter, so that the grid adds kHierArrivalsPerCall per call
// whatever its size (warp 0 adds the rest).
__device__ __forceinline__ uint64_t hier_arrival(int global_warp, int num_warps) {
  return global_warp == 0 ? kHierArrivalsPerCall - static_cast<uint64_t>(num_warps - 1) : 1ull;
}

// Item `item` of the records this rail received, over the source nodes: the node and the record's index there.
// first[n] is the first item of node n (ascending; first[nodes] = total).
__device__ __forceinline__ void hier_item(int32_t const* first, int nodes, int item, int& node, int& index) {
  node = 0;
  while (node + 1 < nodes && item >= first[node + 1]) ++node;
  index = item - first[node];
}

}  // namespace ferry::cuda_ep
