// The Params of the hierarchical normal-mode kernels (hier/dispatch.cuh, hier/combine.cuh): the one-node kernels'
// Params plus the network transport to the ranks of other nodes (a template argument: Emulated in the tests, GIN on a
// cluster) and the topology. Ranks of this rank's node are reached through KernelParams::net (NVLink), ranks of other
// nodes only through `network`.
#pragma once

#include <cstdint>

#include "comm/transport/group.cuh"
#include "comm/device/arrivals.cuh"
#include "ep/cuda/normal/params.cuh"

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

// Where a thread of a hierarchical kernel stands: thread_ids' six numbers, the node layout (this rank's node, and its
// index there, which is also the rail it uses on every other node) and the grid's warps.
struct HierIds {
  int world, rank, tid, lane, warp, cta;
  int nodes;
  int local;  // ranks per node
  int own_node;
  int local_rank;
  int global_warp;
  int num_warps;
};

template <class Params>
__device__ __forceinline__ HierIds hier_ids(Params const& p) {
  auto const t = thread_ids(p.view);
  int const own_node = t.rank / p.local;
  int const local_rank = t.rank % p.local;
  int const global_warp = t.cta * kWarps + t.warp;
  int const num_warps = p.num_ctas * kWarps;
  return HierIds{t.world, t.rank,  t.tid,    t.lane,     t.warp,      t.cta,
                 p.nodes, p.local, own_node, local_rank, global_warp, num_warps};
}

// The two kernels of a hierarchical call read the same sequence number, the state's counter + 1 (the second kernel's
// last CTA advances the counter), and its parity: the half of the double-buffered areas and counters this call uses.
struct HierCall {
  uint64_t seq;
  int parity;
};

__device__ __forceinline__ HierCall hier_call(uint64_t counter) {
  return HierCall{counter + 1, static_cast<int>((counter + 1) & 1)};
}

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

// Item `item` of the forward records this rank received as a rail, over the source nodes (first[n] is node n's first
// item, ascending; first[nodes] = the total): the node it came from, its slot in the forward areas (node * max_tokens
// + index, the slot of its row in hier_fwd_rows too) and its record. The dispatch's forward reads the records, and the
// combine reads them again to send each row's sum back: one addressing for both.
struct HierRailItem {
  int node;
  std::size_t at;
  HierRecord record;
};

template <class Params>
__device__ __forceinline__ HierRailItem hier_rail_item(Params const& p, char* own, int32_t const* first, int item) {
  int node = 0;
  while (node + 1 < p.nodes && item >= first[node + 1]) ++node;
  std::size_t const at = static_cast<std::size_t>(node) * p.max_tokens + (item - first[node]);
  char* const meta = own + p.layout.hier.fwd_meta + at * p.layout.hier.meta_bytes;
  return HierRailItem{node, at, hier_record(meta, p.local, p.topk)};
}

}  // namespace ferry::cuda_ep
