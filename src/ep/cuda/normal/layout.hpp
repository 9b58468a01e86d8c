// Normal mode's memory (the count exchange and push, the landing zone of small batches, the combine's landing zone and
// tiles, combine_backward's weight step): its areas of the symmetric region, byte offsets that are the same on every
// rank (normal/layout.cpp lays them out), and its words of the EpBuffer's device state. Host and device includable.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ferry/ep.hpp"
#include "ferry/limits.hpp"

namespace ferry::cuda_ep {

// Small-batch dispatch (normal/land_dispatch.cuh): most CTAs of its grid (per-CTA sequence words).
inline constexpr int kMaxLandCtas = 256;
// combine_backward's weight step (normal/weight_grad.cuh): the CTAs of its wait kernel (few: 8 virtual ranks' waits
// on one GPU must leave SMs to the ranks still sending).
inline constexpr int kWeightGradWaitCtas = 4;

struct NormalLayout {
  std::size_t recv_x = 0;             // [recv_capacity, recv_row_bytes]: bf16 rows, or the quantized payload
  std::size_t recv_scales = 0;        // quantized delivery: [recv_capacity][num_scales] scale elements, row-major
  std::size_t recv_token_scales = 0;  // quantized nvfp4 delivery: [recv_capacity] float
  std::size_t recv_wire = 0;          // dispatch_dequantize: [recv_capacity, wire_row_bytes] wire rows landing
  std::size_t recv_idx = 0;           // [recv_capacity, topk] int32
  std::size_t recv_w = 0;             // [recv_capacity, topk] float
  std::size_t recv_src = 0;           // [recv_capacity, 2] int32
  std::size_t counts = 0;             // [2 parities][world sources][count_words] uint64, (seq << 32 | value);
                                      // word 0 also carries the source's abort flag (kCountAbort)
  std::size_t data_signal = 0;        // [world sources] uint64 = seq of the dispatch whose rows from that source landed
  std::size_t landing = 0;        // [2 parities][world senders][max_tokens, combine wire row]: combine rows coming back
  std::size_t combine_abort = 0;  // [2 parities][world senders] u64: seq of the sender's last refused combine
  std::size_t tile_flags = 0;     // [world senders][kMaxCombineTiles] uint64 = 2 * seq of the combine that filled the
                                  // tile (+1: that sender refused the call and filled nothing)
  // Small-batch dispatch only (normal/land_dispatch.cuh; empty otherwise): every source's rows land in fixed slots
  // (parity, source, token) and the receiver compacts them into recv_x.
  std::size_t land_arrivals = 0;  // [world sources] u64 arrival counter (device::kArrivalsPerCall per call)
  std::size_t land_tokens = 0;    // [2 parities][world sources] u64: tokens of the source's call
  std::size_t land_abort = 0;     // [2 parities][world sources] u64: seq of the source's last refused call (abort)
  std::size_t land_meta = 0;      // [2][world][max_tokens] records (landing::record_bytes(topk) each)
  std::size_t land_rows = 0;      // [2][world][max_tokens] bf16 rows
  // combine_backward's weight step (normal/weight_grad.cuh): the dots of this rank's entries come back from the ranks
  // holding their experts (each entry has one such rank, so no sender dimension).
  std::size_t weight_grad = 0;           // [2 parities][max_tokens][topk] u64: (seq << 32 | fp32 bits)
  std::size_t weight_grad_arrivals = 0;  // [world senders] u64 arrival counter (device::kArrivalsPerCall per call)
  int count_words = 0;  // 1 (tokens) + world (rows per destination) + expert_words (entries per expert)
                        // (+ nodes: tokens per node, rounded up to an even count, in the hierarchical protocol)
  // Entries per expert in a count row: the destination's num_local_experts, or every expert's (num_experts, the same
  // row to every rank) where an expert can drop entries (expert_slots below the receive capacity): then every rank
  // finds every rank's slot drops in the matrix, and a drop is an error on every rank (expand.cuh).
  int expert_words = 0;
  bool every_expert = false;
};

// Normal mode's device words (the hierarchical protocol's too: it is normal mode across nodes).
struct NormalState {
  uint64_t dispatch_seq;            // sequence number of the last finished dispatch (the next one uses +1)
  uint64_t combine_seq;             // same for combine
  uint64_t dispatch_arrive;         // CTAs of the running dispatch that finished their layout (reset by the last CTA)
  uint64_t dispatch_done;           // CTAs of the running dispatch that finished pushing (reset by the last CTA)
  uint64_t combine_done;            // CTAs of the running combine that finished (reset by the last CTA)
  unsigned int combine_claim;       // the combine's sum pieces claimed so far (CombineSums; reset by the last CTA)
  uint64_t land_seq[kMaxLandCtas];  // small-batch dispatch: calls this CTA ran (each CTA only touches its own)
  // combine_backward's weight step: the last call whose weight gradients this rank collected (its wait kernel's last
  // CTA advances it), and the CTAs of the running wait kernel that finished.
  uint64_t weight_grad_seq;
  uint64_t weight_grad_done;
};

class AreaPacker;

// Normal mode's areas for `world` ranks, appended to `areas`; landing_zone: the small-batch dispatch's areas too.
void lay_out_normal(NormalLayout& layout, AreaPacker& areas, EpConfig const& config, int world, bool landing_zone);

}  // namespace ferry::cuda_ep
