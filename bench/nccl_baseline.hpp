// The all-to-all dispatcher that inference and training engines build from NCCL, as the baseline `ferry bench
// --baseline nccl` times next to Ferry (docs/design.md, "Metrics"): count all-to-all, host sync, permute (rows gathered
// per destination rank, one copy per rank), grouped ncclSend/ncclRecv all-to-allv, rows land rank-major; combine:
// all-to-allv back, summed per token over ranks in fp32, rounded once.
//
// Results are bit-identical to ref::dispatch and ref::combine_rank_major (same row order, same fp32 order), so the
// bench can check both sides with one reference. Eager only: the host sync of the counts is inherent to the design.
#pragma once

#include <cstdint>

#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"

namespace ferry {

class NcclBaseline {
 public:
  // Collective: creates its own ncclComm (the unique id goes through comm.bootstrap()) and buffers sized for
  // config (world * max_tokens_per_rank rows). Throws NcclError / CudaError / ConfigError.
  NcclBaseline(Communicator& comm, EpConfig const& config);
  ~NcclBaseline();
  NcclBaseline(NcclBaseline const&) = delete;
  NcclBaseline& operator=(NcclBaseline const&) = delete;

  // Collective, on `stream`; returns after the all-to-allv is enqueued (the count exchange syncs the host midway).
  // Fills recv_x, recv_topk_idx (local expert or -1), recv_topk_weights, recv_src, num_recv (device and host) and
  // expert_counts, rank-major like EpBuffer. expand is not supported (InputError). Outputs stay valid until the
  // next dispatch.
  DispatchResult dispatch(DispatchArgs const& args, cudaStream_t stream);

  // Collective, on `stream`: rows [num_recv, hidden] bf16, rank-major and already reduced over this rank's experts
  // (the rows of the last dispatch); y [num_tokens of that dispatch, hidden] bf16.
  void combine(void const* rows, void* y, cudaStream_t stream);

 private:
  struct State;
  State* state_;
};

}  // namespace ferry
