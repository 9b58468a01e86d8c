// The reference semantics of dispatch and combine (DESIGN.md "Semantics") as pure host functions over every rank's
// inputs. The cpu backend produces exactly these results through shared memory; every GPU test compares with them
// bit for bit (bf16 transport).
//
// Canonical arithmetic (the cuda kernels follow the same order so results are bit-identical):
// - Expert-major combine, receiver side, per rank-major row i: acc = 0.0f; for k = 0..topk-1 ascending, where the
//   entry is a local expert: acc = fmaf(w[i,k], float(expert_out[e, slot(i,k)]), acc). The row sent back is
//   bf16_rne(acc).
// - Source side, per token t: y = 0.0f; for destination rank d = 0..world-1 ascending that received t:
//   y += float(row_d(t)). y[t] = bf16_rne(y). A token with no valid expert gets 0.
// - Rank-major combine: row_d(t) is the caller's row; the source sum is the same.
// Expert-major slots: each valid (row, k) entry of a local expert takes one slot; slots of an expert are in
// rank-major row order (then k ascending), so the layout is deterministic.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "ferry/ep.hpp"

namespace ferry::ref {

struct RankInput {
  int num_tokens = 0;
  std::vector<uint16_t> x;             // [num_tokens * hidden] bf16 bits
  std::vector<int64_t> topk_idx;       // [num_tokens * topk]
  std::vector<float> topk_weights;     // [num_tokens * topk]
};

struct RankDispatch {
  int num_recv = 0;
  std::vector<uint16_t> recv_x;            // [num_recv * hidden]
  std::vector<int32_t> recv_topk_idx;      // [num_recv * topk] local expert or -1
  std::vector<float> recv_topk_weights;    // [num_recv * topk] (0 where recv_topk_idx is -1)
  std::vector<int32_t> recv_src;           // [num_recv * 2] (source rank, source token)
  std::vector<int32_t> expert_counts;      // [num_local_experts] valid (row, k) entries per local expert
  std::vector<int32_t> recv_slot;          // [num_recv * topk] slot within its expert, -1 where not local
  std::vector<int32_t> expert_src_row;     // [num_local_experts * expert_slots] rank-major row, -1 if unused
  int expert_slots = 0;
};

// bf16 <-> float, round to nearest even (as CUDA's __float2bfloat16_rn; NaN becomes a quiet NaN).
uint16_t float_to_bf16(float value);
float bf16_to_float(uint16_t bits);

// Throws InputError for ids outside [-1, num_experts) or more tokens than max_tokens_per_rank, naming rank,
// token, column and value.
void validate_input(EpConfig const& config, int world, int rank, RankInput const& input);

// What rank `rank` receives. inputs[r] is rank r's input.
RankDispatch dispatch(EpConfig const& config, int world, int rank, std::span<RankInput const> inputs);

// Fills the expert-major layout [num_local_experts * expert_slots * hidden] from a rank-major dispatch.
std::vector<uint16_t> expand(EpConfig const& config, int world, RankDispatch const& received);

// y[num_tokens * hidden] of rank `rank` from every rank's expert outputs ([num_local_experts * expert_slots *
// hidden] bf16 each).
std::vector<uint16_t> combine_expert_major(EpConfig const& config, int world, int rank, std::span<RankInput const> inputs,
                                           std::span<RankDispatch const> received,
                                           std::span<std::vector<uint16_t> const> expert_out);

// y of rank `rank` from every rank's rank-major rows ([num_recv * hidden] bf16 each, already reduced).
std::vector<uint16_t> combine_rank_major(EpConfig const& config, int world, int rank, std::span<RankInput const> inputs,
                                         std::span<RankDispatch const> received,
                                         std::span<std::vector<uint16_t> const> rows);

// The receiver side of an expert-major combine alone: the bf16 row each received row sends back.
std::vector<uint16_t> reduce_local_experts(EpConfig const& config, int world, RankDispatch const& received,
                                           std::vector<uint16_t> const& expert_out);

}  // namespace ferry::ref
