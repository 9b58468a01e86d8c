// What every kernel of the cuda backend shares, whatever its protocol: the grid's shape, the device state word block,
// the layout of the symmetric region (each protocol's areas, from its folder's layout.hpp) and the part every
// kernel's Params starts with (KernelParams, filled by one prologue, common_params in buffers.cu). Each protocol's
// Params derive from it in its folder (normal/params.cuh, hier/params.cuh, ll/params.cuh), built and validated on the
// host by the launchers' to_params().
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/transport/lsa.cuh"
#include "ep/combine_tiles.hpp"
#include "ep/cuda/layout.hpp"
#include "ferry/device_view.hpp"
#include "ferry/wire_format.hpp"
#include "trace/trace_format.hpp"

namespace ferry::cuda_ep {

// Threads per CTA of every kernel: 16 warps, enough 16-byte accesses in flight per SM for NVLink and HBM.
inline constexpr int kThreads = 512;
inline constexpr int kWarps = kThreads / 32;
// Device words of one EpBuffer (local memory, zeroed at construction): the last dispatch's layout words, which every
// protocol writes, and each protocol's own words (its folder's layout.hpp). Sequence numbers live here, not on the
// host, so a captured graph replays with increasing sequence numbers and no reset kernel.
struct DeviceState {
  int32_t num_recv;                   // rows received by the last dispatch (clipped to recv_capacity)
  int32_t num_tokens;                 // this rank's tokens in the last dispatch
  int32_t src_offset[kMaxCudaWorld];  // first row of source s in the receive buffers
  int32_t src_count[kMaxCudaWorld];   // rows of source s that were delivered
  int32_t src_tokens[kMaxCudaWorld];  // tokens source s passed to the last dispatch
  NormalState normal;                 // normal mode (the hierarchical protocol's one-node part too)
  HierState hier;                     // normal mode across nodes
  LlState ll;                         // low-latency mode
};

// The words of DeviceState a normal-mode combine (and expand) reads of its dispatch, in their order there: what a
// dispatch handle keeps of them (normal/handle.cu). num_recv, num_tokens, src_offset, src_count, src_tokens.
inline constexpr int kHandleStateWords = 2 + 3 * kMaxCudaWorld;
static_assert(offsetof(DeviceState, num_tokens) == offsetof(DeviceState, num_recv) + 4 &&
                  offsetof(DeviceState, src_offset) == offsetof(DeviceState, num_recv) + 8 &&
                  offsetof(DeviceState, src_count) == offsetof(DeviceState, src_offset) + 4 * kMaxCudaWorld &&
                  offsetof(DeviceState, src_tokens) == offsetof(DeviceState, src_count) + 4 * kMaxCudaWorld,
              "a handle copies the layout words of DeviceState as one run of kHandleStateWords int32 words");


// Who a thread of an EP kernel is: its rank's place in the world, and its own in the grid (every kernel starts with
// these six numbers; `auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);`).
struct ThreadIds {
  int world;
  int rank;
  int tid;
  int lane;
  int warp;
  int cta;
};

__device__ __forceinline__ ThreadIds thread_ids(DeviceView const& view) {
  int const tid = static_cast<int>(threadIdx.x);
  return ThreadIds{view.world, view.rank, tid, tid & 31, tid >> 5, static_cast<int>(blockIdx.x)};
}

// What every kernel's Params holds (one prologue fills it: common_params in buffers.cu).
struct KernelParams {
  DeviceView view;     // rank, world, the wait bound, the error block
  transport::Lsa net;  // every rank's symmetric region, reached through the transport seam
  SymLayout layout;
  DeviceState* state;
  // This rank refuses the call (EpBackendImpl::refuse_dispatch / refuse_combine): it joins the exchange with its
  // abort flag and moves no rows of its own (a refused dispatch has num_tokens 0; a refused combine reads no x or y).
  bool abort;
  int hidden;
  int topk;
  int max_tokens;          // max_tokens_per_rank
  int num_ctas;            // the launch's grid
  trace::TraceView trace;  // in-kernel trace of this launch (empty unless a FERRY_TRACE build has tracing enabled)
};

}  // namespace ferry::cuda_ep
