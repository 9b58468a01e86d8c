// The reference semantics of dispatch and combine (docs/design.md, "Semantics") as pure host functions over every
// rank's inputs. The cpu backend produces exactly these results through shared memory; every GPU test compares with
// them bit for bit (bf16 transport).
//
// Canonical arithmetic (the cuda kernels follow the same order so results are bit-identical):
// - Expert-major combine, receiver side, per rank-major row i: acc = 0.0f; for k = 0..topk-1 ascending, where the
//   entry is a local expert with a slot: acc = fmaf(w[i,k], float(expert_out[e, slot(i,k)]), acc). The row sent
//   back is bf16_rne(acc).
// - Source side, per token t: y = 0.0f; for destination rank d = 0..world-1 ascending that received t:
//   y += float(row_d(t)). y[t] = bf16_rne(y). A token with no valid expert gets 0. (Start from +0.0f and add, even
//   for the first row: 0.0f + -0.0f is +0.0f, and the kernels must do the same to stay bit-identical.)
// - Rank-major combine: row_d(t) is the caller's row; the source sum is the same.
// - Across nodes (a Topology of N nodes x M ranks, hierarchical normal mode, docs/internode.md): dispatch delivers
//   exactly what one node of N x M ranks would (the rows cross the network as their wire rows, unchanged). The
//   source's sum runs over the nodes n = 0..N-1 ascending. Its own node adds float(row_d(t)) of its ranks d ascending
//   (in combine_format), as above. Every other node n that received t adds one row: its ranks' bf16 rows summed in
//   fp32, p = 0.0f; for d of node n ascending: p += float(row_d(t)); sent as quantize_row(combine_format,
//   bf16_rne(p)) and added dequantized. One node is the rule above; one rank per node too (bf16_rne(float(row)) ==
//   row).
// - fp32 arithmetic is IEEE binary32 with subnormals (no flush to zero), fmaf rounded once.
// - Wire formats (docs/quant.md): every row travels as its wire row (wire::quantize_row of the bf16 row;
//   bf16 is the row's own bytes). Dispatch: the source quantizes each token once (or forwards its pre-quantized wire
//   row); the receiver gets those bytes (recv_wire) and delivers either the payload + scales (ref::deliver) or the
//   dequantized bf16 rows (recv_x). Combine: the bf16 row a receiver sends back travels as
//   quantize_row(combine_format, row); the source adds its dequantized fp32 values (wire::dequantize_row) in the
//   order above. With bf16 on both legs this is exactly the bf16 arithmetic.
// Expert-major slots: each valid (row, k) entry of a local expert takes one slot; slots of an expert follow the
// rank-major rows starting at the receiving rank's own first row (own_first_row: its own tokens first, then the
// rows of sources rank + 1, ..., world - 1, 0, ..., rank - 1), then k ascending, so the layout is deterministic and a
// rank's own rows take the first slots of every expert: low-latency mode copies them into their slots without
// waiting for any peer's routing (docs/design-notes.md).
// own_first_row(recv_src, num_recv, rank) is the first rank-major row of `rank`'s own tokens (num_recv when none).
//
// Capacities (what the device does, so the reference does it too):
// - Rows past config.recv_capacity(world) in rank-major order are not delivered: num_recv stops at the capacity and
//   dropped_rows counts the rest. A token whose row to rank d was dropped gets nothing back from d in combine.
// - expert_counts[e] counts every valid (row, k) entry of local expert e among the delivered rows. Entries past
//   config.expert_slots() of an expert get no slot: recv_slot is -1 there (recv_topk_idx still names the local
//   expert), the filled slots of e are min(expert_counts[e], expert_slots), and dropped_slots counts the rest. The
//   expert-major combine skips entries without a slot. Without an expert capacity (expert_slots() == 0) there is no
//   expert-major layout: no slots and nothing counted as dropped.
// - A call that drops (rows or, where the receiver expands, slots: "rows not delivered") is an error on every rank,
//   not only on the ranks whose capacity was exceeded (call_drops: the total and the first rank that dropped, the same
//   on every rank): raised at the call when it is eager, else at the next check; and no combine, cached dispatch or
//   backward pass over its layout returns numbers (docs/errors.md). The reference still computes what was delivered,
//   so that a backend's rows can be compared up to the capacity.
#pragma once

#include <bit>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/rank_set.hpp"
#include "ferry/ep.hpp"

namespace ferry::ref {

struct RankInput {
  int num_tokens = 0;
  std::vector<uint16_t> x;  // [num_tokens * hidden] bf16 bits
  // Pre-quantized input (DispatchArgs::x_scales): the wire rows [num_tokens * wire_row_bytes(dispatch_format)] that
  // are sent instead of quantizing x. Empty: x is quantized (or sent as is for bf16).
  std::vector<uint8_t> x_wire;
  std::vector<int64_t> topk_idx;    // [num_tokens * topk]
  std::vector<float> topk_weights;  // [num_tokens * topk]
};

struct RankDispatch {
  int num_recv = 0;
  std::vector<uint16_t> recv_x;          // [num_recv * hidden] bf16: the rows, or the dequantized wire rows
  std::vector<uint8_t> recv_wire;        // [num_recv * wire_row_bytes(dispatch_format)] the wire rows received
  std::vector<int32_t> recv_topk_idx;    // [num_recv * topk] local expert or -1
  std::vector<float> recv_topk_weights;  // [num_recv * topk] (0 where recv_topk_idx is -1)
  std::vector<int32_t> recv_src;         // [num_recv * 2] (source rank, source token)
  std::vector<int32_t> expert_counts;    // [num_local_experts] valid (row, k) entries per local expert
  std::vector<int32_t> recv_slot;        // [num_recv * topk] slot within its expert, -1 where not local or dropped
  std::vector<int32_t> expert_src_row;   // [num_local_experts * expert_slots] rank-major row, -1 if unused
  int expert_slots = 0;                  // config.expert_slots()
  int dropped_rows = 0;                  // rows past recv_capacity, not delivered
  int dropped_slots = 0;                 // local (row, k) entries past expert_slots, without a slot
};

// bf16 <-> float, round to nearest even, exactly as CUDA's __float2bfloat16_rn (cuda_bf16.hpp): every NaN becomes
// 0x7fff (positive quiet NaN, sign dropped), infinities stay, subnormals are kept (no flush to zero).
inline uint16_t float_to_bf16(float value) {
  uint32_t const bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffU) > 0x7f800000U) return 0x7fff;
  uint32_t const rounded = bits + 0x7fffU + ((bits >> 16) & 1U);
  return static_cast<uint16_t>(rounded >> 16);
}
inline float bf16_to_float(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

// Rank masking (EpConfig::rank_masking): the inputs of the world without the ranks in `masked`.
// They send nothing (num_tokens 0, no rows), and every other rank's ids of their experts become -1. A masked call
// returns, on every rank that takes part, what the reference returns for these inputs (one node, the direct route,
// or the forward route: the rail of a masked rank's local index is then another rank of its node, which changes no
// sum). masked_entries[r]: the ids of rank r that became -1, the entries a masked dispatch reports for r.
struct MaskedWorld {
  std::vector<RankInput> inputs;
  std::vector<int64_t> masked_entries;
};
MaskedWorld without_ranks(EpConfig const& config, int world, std::span<RankInput const> inputs,
                          detail::RankSet const& masked);

// Throws InputError for an id outside [-1, num_experts), naming rank, token, column, value and the range.
// topk_idx holds num_tokens * config.topk entries.
void validate_topk_idx(EpConfig const& config, int rank, int num_tokens, std::span<int64_t const> topk_idx);

// Throws InputError for ids outside [-1, num_experts) or more tokens than max_tokens_per_rank, naming rank,
// token, column and value; also for vectors whose sizes do not match num_tokens.
void validate_input(EpConfig const& config, int world, int rank, RankInput const& input);

// What rank `rank` receives. inputs[r] is rank r's input (all are validated).
RankDispatch dispatch(EpConfig const& config, int world, int rank, std::span<RankInput const> inputs);

// The expert-major slots of num_recv received rows (recv_topk_idx: [num_recv * topk] local expert or -1), as
// documented above. Shared by the reference and the cpu backend, which builds its layout from the rows it received.
struct ExpertLayout {
  std::vector<int32_t> expert_counts;   // [num_local_experts]
  std::vector<int32_t> recv_slot;       // [num_recv * topk]
  std::vector<int32_t> expert_src_row;  // [num_local_experts * expert_slots]
  int expert_slots = 0;
  int dropped_slots = 0;
};
ExpertLayout expert_layout(EpConfig const& config, int world, int num_recv, std::span<int32_t const> recv_topk_idx,
                           int own_first_row);

// What one call dropped over all its ranks: received[r] is what rank r received, expanded[r] whether r filled the
// expert-major layout (its dropped_slots count then). first_rank: the lowest rank that dropped (-1: none).
struct CallDrops {
  int64_t rows = 0;
  int first_rank = -1;
};
CallDrops call_drops(std::span<RankDispatch const> received, std::vector<bool> const& expanded);
// The first of num_recv rank-major rows (recv_src: [num_recv * 2] (source, token), sources ascending) whose source is
// `rank` or above: the receiving rank's own first row.
int own_first_row(std::span<int32_t const> recv_src, int num_recv, int rank);

// Fills the expert-major layout [num_local_experts * expert_slots * hidden] from a rank-major dispatch. Slots that
// are not filled (at or past min(expert_counts[e], expert_slots)) are zero.
std::vector<uint16_t> expand(EpConfig const& config, int world, RankDispatch const& received);
// The same for the wire rows: [num_local_experts * expert_slots * wire_row_bytes(dispatch_format)], zero where
// unfilled.
std::vector<uint8_t> expand_wire(EpConfig const& config, int world, RankDispatch const& received);

// The wire rows source `input` sends, [num_tokens * wire_row_bytes(dispatch_format)]: input.x_wire when set, else
// each row of x quantized with dispatch_format (bf16: x's bytes).
std::vector<uint8_t> source_wire_rows(EpConfig const& config, RankInput const& input);
// Pre-quantized input as DispatchArgs takes it, split from (or joined into) wire rows of dispatch_format.
struct QuantizedInput {
  std::vector<uint8_t> payload;     // [num_tokens * wire_payload_bytes]
  std::vector<uint8_t> scales;      // row-major [num_tokens * num_scales * scale_bytes]
  std::vector<float> token_scales;  // nvfp4: [num_tokens]; else empty
};
QuantizedInput split_wire_rows(EpConfig const& config, std::span<uint8_t const> wire, int num_rows);
// One pre-quantized row into its wire row (padding zero): payload (layout.payload_bytes), row-major scales
// (num_scales * scale_bytes), and nvfp4's token scale (read only when the layout has one).
void join_wire_row(WireRowLayout const& layout, uint8_t const* payload, uint8_t const* scales, float const* token_scale,
                   uint8_t* wire);
std::vector<uint8_t> join_wire_rows(EpConfig const& config, QuantizedInput const& input, int num_rows);

// What a quantized delivery (EpConfig::delivers_quantized) hands the receiver for `num_rows` wire rows of
// dispatch_format: the payload rows [num_rows * wire_payload_bytes], the scale tensor of `tensor_rows` rows
// (>= num_rows) in recv_scale_layout (scale_tensor_bytes; rows past num_rows and padding zero), and nvfp4's
// per-token scales [tensor_rows] (zero past num_rows; empty for other formats).
struct DeliveredRows {
  std::vector<uint8_t> payload;
  std::vector<uint8_t> scales;
  std::vector<float> token_scales;
};
DeliveredRows deliver(EpConfig const& config, std::span<uint8_t const> wire, int num_rows, int tensor_rows);
// Compares the scale entries of rows [0, num_rows) of a delivered scale tensor of tensor_rows rows (host memory, in
// recv_scale_layout) and nvfp4's token scales with `want`; padding and rows past num_rows are not compared (they are
// unspecified). "" when equal, else which entry differs.
std::string compare_delivered_scales(EpConfig const& config, DeliveredRows const& want, void const* scales,
                                     float const* token_scales, int num_rows, int tensor_rows);

// y[num_tokens * hidden] of rank `rank` from every rank's expert outputs ([num_local_experts * expert_slots *
// hidden] bf16 each).
std::vector<uint16_t> combine_expert_major(EpConfig const& config, int world, int rank,
                                           std::span<RankInput const> inputs, std::span<RankDispatch const> received,
                                           std::span<std::vector<uint16_t> const> expert_out);

// ...over a topology of several nodes (the order "Across nodes" above); the int-world form is one node.
std::vector<uint16_t> combine_expert_major(EpConfig const& config, Topology const& topology, int rank,
                                           std::span<RankInput const> inputs, std::span<RankDispatch const> received,
                                           std::span<std::vector<uint16_t> const> expert_out);

// y of rank `rank` from every rank's rank-major rows ([num_recv * hidden] bf16 each, already reduced).
std::vector<uint16_t> combine_rank_major(EpConfig const& config, int world, int rank, std::span<RankInput const> inputs,
                                         std::span<RankDispatch const> received,
                                         std::span<std::vector<uint16_t> const> rows);
std::vector<uint16_t> combine_rank_major(EpConfig const& config, Topology const& topology, int rank,
                                         std::span<RankInput const> inputs, std::span<RankDispatch const> received,
                                         std::span<std::vector<uint16_t> const> rows);

// The receiver side of an expert-major combine alone: the bf16 row each received row sends back.
std::vector<uint16_t> reduce_local_experts(EpConfig const& config, int world, RankDispatch const& received,
                                           std::vector<uint16_t> const& expert_out);

// Backward passes (docs/training.md), from every rank's forward dispatch (received[r]: what rank r received).
// dispatch_backward: grad_x of source `rank`, [num_tokens * hidden] fp32 (bf16 output: float_to_bf16 of each).
// grads[r] is rank r's gradient of what its dispatch delivered: rank_major [num_recv * hidden] (of recv_x),
// expert_major [num_local_experts * expert_slots * hidden] (of expert_x) bf16. The arithmetic is a combine's with
// every weight 1 (fmaf(1, g, acc) == acc + g): per received row, acc = 0.0f, k ascending over the entries with a
// slot, acc += float(g[e, slot]), row = bf16_rne(acc) (rank-major: the row itself); then the source's sum over d
// ascending in combine_format, y += float(row_d(t)), starting from +0.0f.
std::vector<float> dispatch_backward(EpConfig const& config, int world, int rank, std::span<RankInput const> inputs,
                                     std::span<RankDispatch const> received,
                                     std::span<std::vector<uint16_t> const> grads, CombineLayout layout);
std::vector<float> dispatch_backward(EpConfig const& config, Topology const& topology, int rank,
                                     std::span<RankInput const> inputs, std::span<RankDispatch const> received,
                                     std::span<std::vector<uint16_t> const> grads, CombineLayout layout);
// combine_backward, the gradient rows receiving rank `rank` gets (grad_y[r]: rank r's [num_tokens * hidden] bf16):
// rank_major [num_recv * hidden]: row i = grad_y[s][t] of its source (s, t); expert_major [num_local_experts *
// expert_slots * hidden]: slot (e, j) of entry (i, k) = bf16_rne(w[i,k] * float(grad_y[s][t][h])) (the product
// rounded to fp32, then to bf16), unfilled slots 0.
std::vector<uint16_t> combine_backward_rows(EpConfig const& config, int world, int rank,
                                            std::span<RankInput const> inputs, std::span<RankDispatch const> received,
                                            std::span<std::vector<uint16_t> const> grad_y, CombineLayout layout);
// combine_backward's grad_topk_weights of source `rank`, [num_tokens * topk] fp32: entry (t, k) whose row reached
// rank d and got slot j of local expert e there: dot_warp(grad_y[rank][t], expert_out[d][e, j]); 0 for an id of -1,
// a dropped row or an entry without a slot.
std::vector<float> combine_backward_weights(EpConfig const& config, int world, int rank,
                                            std::span<RankInput const> inputs, std::span<RankDispatch const> received,
                                            std::span<std::vector<uint16_t> const> grad_y,
                                            std::span<std::vector<uint16_t> const> expert_out);
// The canonical fp32 dot of two bf16 rows of `hidden` elements (hidden % 8 == 0), as one warp computes it: lane l
// (of 32) takes the 8-element vectors v = l, l + 32, ... ascending and, inside each, the elements ascending:
// acc_l = fmaf(float(a[h]), float(b[h]), acc_l) from +0.0f; then for m = 16, 8, 4, 2, 1: acc_l = acc_l + acc_(l^m)
// (every lane ends with the same value, float addition being commutative); the result is acc_0.
float dot_warp(int hidden, uint16_t const* a, uint16_t const* b);

// Per-row arithmetic of combine, the one implementation the reference and the cpu backend share.
// Receiver side for one rank-major row: the fmaf chain above over its topk entries (local_idx: local expert or -1,
// slot: slot or -1, weights), reading expert_out [num_local_experts * expert_slots * hidden]; writes bf16 to out.
// scratch holds hidden floats.
void reduce_row(int hidden, int topk, int expert_slots, int32_t const* local_idx, int32_t const* slot,
                float const* weights, uint16_t const* expert_out, float* scratch, uint16_t* out);
// Source side: acc[h] += float(row[h]).
void accumulate_row(int hidden, uint16_t const* row, float* acc);
// Source side of a combine in `format`: acc[h] += dequantize_row(format, quantize_row(format, row))[h] (bf16: the
// row's own values, as accumulate_row). scratch holds wire_row_bytes(format, hidden) bytes and hidden floats.
void accumulate_combined_row(WireFormat format, int hidden, uint16_t const* row, std::vector<uint8_t>& wire_scratch,
                             std::vector<float>& value_scratch, float* acc);
// out[h] = bf16_rne(acc[h]).
void round_row(int hidden, float const* acc, uint16_t* out);

}  // namespace ferry::ref
