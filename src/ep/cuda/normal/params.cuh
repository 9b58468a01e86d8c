// Normal mode's kernel parameters (normal/dispatch.cuh, normal/land_dispatch.cuh, normal/expand.cuh,
// normal/combine.cuh, normal/handle.cuh, normal/weight_grad.cuh; the hierarchical protocol's derive from them,
// hier/params.cuh), built and validated on the host by the launchers' to_params().
#pragma once

#include <cstddef>
#include <cstdint>

#include "ep/cuda/params.cuh"
#include "ferry/wire_format.hpp"

namespace ferry::cuda_ep {

// 16-byte vectors per lane loaded before the stores of one dispatch step (loads in flight per warp).
inline constexpr int kDispatchUnroll = 4;

// Dynamic shared memory of the dispatch kernel: one counter per destination and per global expert.
inline constexpr std::size_t kMaxDispatchSmem = 200 * 1024;
__host__ __device__ inline std::size_t dispatch_smem_bytes(int world, int num_experts) {
  return static_cast<std::size_t>(world + num_experts) * sizeof(int32_t);
}

// Word 0 of a source's count row: its token count, and this bit when the source refuses the call (a bad or repeated
// id, or its host's refusal). A token count is below 2^31, so the bit never collides with one.
inline constexpr uint64_t kCountAbort = 1ull << 31;

// Byte offset in a window of word `word` of source `source`'s row of the count matrix (parity `parity`).
__device__ __forceinline__ std::size_t count_offset(SymLayout const& layout, int parity, int world, int source,
                                                    int word) {
  return layout.normal.counts +
         (static_cast<std::size_t>(parity * world + source) * layout.normal.count_words + word) * sizeof(uint64_t);
}

__device__ __forceinline__ uint64_t* count_word(char* window, SymLayout const& layout, int parity, int world,
                                                int source, int word) {
  return reinterpret_cast<uint64_t*>(window + count_offset(layout, parity, world, source, word));
}

// The word of a count row that holds the entries of local expert `el` of rank `rank`.
__device__ __forceinline__ int expert_word(NormalLayout const& layout, int world, int rank, int num_local, int el) {
  return 1 + world + (layout.every_expert ? rank * num_local : 0) + el;
}

// The count in a word of the count matrix (word 0 without its abort flag).
__device__ __forceinline__ int32_t count_value(uint64_t word) {
  return static_cast<int32_t>(static_cast<uint32_t>(word & (kCountAbort - 1)));
}

// Where the pieces of a quantized dispatch row land on its destination: byte offsets inside the symmetric region of
// row 0 and strides per row. Quantized delivery: the payload in recv_x, the scales in recv_scales (row-major), the
// token scale in recv_token_scales; dispatch_dequantize: all three inside the wire row of recv_wire.
struct QuantDst {
  std::size_t payload = 0;
  std::size_t payload_stride = 0;
  std::size_t scales = 0;
  std::size_t scales_stride = 0;
  std::size_t token = 0;
  std::size_t token_stride = 0;
};

// What the dispatch receiver does after every row has landed (a local pass, inside the dispatch kernel).
enum class RecvPass : int {
  none,        // bf16, or quantized delivery with row-major scales: the senders wrote the final places
  relayout,    // quantized delivery in another scale layout: row-major scales -> recv_scale_layout
  dequantize,  // dispatch_dequantize: wire rows -> bf16 recv_x
};

struct DispatchParams : KernelParams {
  void const* x;  // bf16 rows, or (pre-quantized) the payload rows [num_tokens, payload_bytes]
  // Quantized dispatch_format (the kernel's kFormat) only:
  void const* x_scales;         // pre-quantized: [num_tokens][num_scales] scale elements (null: quantize x)
  float const* x_token_scales;  // pre-quantized nvfp4: [num_tokens]
  float* token_scales;          // nvfp4 quantized here: [max_tokens] each token's scale (written and read by its CTA)
  QuantDst qdst;
  RecvPass recv_pass;
  ScaleLayout scale_layout;  // of recv_scales_final (relayout)
  void* recv_scales_final;   // relayout: the scale tensor of recv_capacity rows in scale_layout (local memory)
  void const* topk_idx;
  float const* topk_weights;
  int num_tokens;
  int num_experts;
  int num_local_experts;
  int recv_capacity;
  uint32_t* token_mask;    // [max_tokens] destinations of each token (kept for combine)
  int32_t* token_pos;      // [max_tokens, world] position of the token within this CTA's rows for a destination
  int32_t* block_counts;   // [num_ctas, world] per-CTA rows per destination
  int32_t* count_totals;   // [world + num_experts + 1] rows per destination, entries per expert, and CTAs whose layout
                           // found a bad or repeated id: the CTAs add theirs, the last to arrive reads and zeroes them
  int32_t* expert_counts;  // [num_local_experts] output
};

struct ExpandParams : KernelParams {
  char* sym_local;        // this rank's symmetric region (expand reads only local memory)
  std::size_t row_bytes;  // bytes of one row of recv_x / expert_x (EpConfig::recv_row_bytes)
  // Quantized delivery (format != bf16): the scales and nvfp4 token scales of each slot, from the row-major
  // recv_scales and recv_token_scales into one scale tensor of expert_slots rows per expert.
  WireFormat format;
  ScaleLayout scale_layout;
  std::size_t expert_scale_bytes;  // scale_tensor_bytes(format, scale_layout, expert_slots, hidden)
  void* expert_scales;             // [num_local_experts] tensors of expert_scale_bytes
  float* expert_token_scales;      // nvfp4: [num_local_experts, expert_slots]
  int num_local_experts;
  int expert_slots;
  int recv_capacity;
  int32_t* recv_slot;  // [recv_capacity, topk]
  void* expert_x;      // [num_local_experts, expert_slots, row_bytes] (copy only)
  // copy only: fill expert_src_row but leave the rows to combine_backward's weight step (normal/weight_grad.cuh), which
  // writes each slot scaled from its row in recv_x: one pass over the slots instead of a copy and a pass in place
  bool skip_rows;
  int32_t* expert_src_row;  // [num_local_experts, expert_slots] (copy only)
};

// A refused combine (abort) pushes no rows and fills every tile its sources wait for with its abort flag.
struct CombineParams : KernelParams {
  void const* x;  // expert-major [num_local_experts, expert_slots, hidden] or rank-major [num_recv, hidden]
  void* y;        // [num_tokens, hidden]
  std::size_t landing_row_bytes;  // wire_row_bytes(combine_format, hidden): one row of the landing zone (max_tokens
                                  // rows per sender)
  int expert_slots;
  int num_push_ctas;
  uint32_t const* token_mask;
  int32_t const* recv_slot;
  // dispatch_backward (combine_unweighted): expert-major entries take the weight 1 instead of recv_w
  // (fmaf(1, g, acc) == acc + g), and y is fp32 [num_tokens, hidden] (the source's sum, not rounded).
  bool unit_weights;
  bool y_fp32;
};

// The copy of a dispatch's layout into a handle's storage or back (normal/handle.cuh): areas of 4-byte words (7 of the
// one-node layout, the saved weights, 3 of the hierarchical protocol; room to spare).
inline constexpr int kMaxHandleAreas = 12;
struct HandleArea {
  void const* src;
  void* dst;
  int words_per_row;
  int rows;      // fixed rows, or (counted) at most this many
  bool counted;  // rows = min(*p.num_rows, rows): the received rows of the layout
};
struct HandleCopyParams {
  HandleArea areas[kMaxHandleAreas];
  int num_areas;
  int32_t const* num_rows;  // the layout's received rows: DeviceState::num_recv (save) or the handle's copy (restore)
  // save: the dispatch's ids [num_ids] (int32, or int64 with ids_64) into the handle as int32; widen (copy_received):
  // int32 ids into int64 ones
  void const* ids;
  bool ids_64;
  bool widen;
  void* ids_dst;
  int num_ids;
  // save, count exchange: the dispatch's count matrix, [world sources][world destinations] int32, from the count rows
  // of its parity (*seq: the dispatch's sequence number) in this rank's window (EpBuffer::copy_rank_counts)
  uint64_t const* counts;  // the count rows of parity 0; null: not kept
  uint64_t const* seq;
  int count_words;
  int world;
  int32_t* counts_dst;
};

// combine_backward's weight step (normal/weight_grad.cuh), after the cached expert-major dispatch of grad_y.
struct WeightGradParams : KernelParams {
  void const* x;             // the forward combine's expert outputs [num_local_experts, expert_slots, hidden] (null:
                             // no dots: every entry sends 0)
  void* expert_x;            // out: bf16_rn(w * grad_y) per filled slot (grad_y read from the row in recv_x)
  int32_t const* recv_slot;  // [recv_capacity, topk]
  int num_local_experts;
  int expert_slots;
  float* grad_w;   // [num_tokens, topk] this rank's weight gradients (null: none written)
  int num_tokens;  // this rank's tokens in the handle's dispatch
};

}  // namespace ferry::cuda_ep
