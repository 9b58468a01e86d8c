// Expert-major layout of the rows the last dispatch received (local memory only: the wire carried one copy per rank).
//
// One CTA per local expert (looping when there are more experts than CTAs) walks the received (row, k) entries in
// rank-major row order starting at this rank's own first row (then wrapping around: ref::expert_layout's order), k
// ascending, and gives each entry of its expert the next slot: an ordered compaction (warp
// ballots + a scan over warps), so slots are deterministic and match the reference. kCopyRows: also copy the rows
// into expert_x and fill expert_src_row (DispatchArgs::expand); without it only recv_slot is written (what an
// expert-major combine needs after a dispatch that did not expand). With quantized delivery the rows are the
// payloads, and each slot's block scales (from the row-major recv_scales) and nvfp4 token scale go into the expert's
// scale tensor (recv_scale_layout, expert_slots rows) and token scales.
#pragma once

#include <cstdint>

#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "ep/cuda/params.cuh"
#include "quant/layout.hpp"

namespace ferry::cuda_ep {

// Warp copy of a row of `bytes` (a multiple of 8; both pointers 8-byte aligned): 16-byte vectors when the row and
// both pointers allow it (every format but nvfp4 payloads of hidden % 32 != 0).
__device__ __forceinline__ void copy_row_warp(char* dst, char const* src, std::size_t bytes, int lane) {
  if (bytes % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    device::copy_warp_16B<true>(dst, src, bytes);
    return;
  }
  for (std::size_t i = static_cast<std::size_t>(lane) * 8; i < bytes; i += 32 * 8)
    *reinterpret_cast<uint2*>(dst + i) = *reinterpret_cast<uint2 const*>(src + i);
}

// The block scales and token scale of received row `row` into slot `slot` of expert e's tensors.
__device__ __forceinline__ void copy_slot_scales(ExpandParams const& p, int e, int slot, int row, int lane) {
  quant::FormatTraits const traits = quant::format_traits(p.format);
  int const num_scales = p.hidden / traits.block_elems;
  std::size_t const elem = static_cast<std::size_t>(traits.scale_bytes);
  auto const* src = reinterpret_cast<uint8_t const*>(p.sym_local + p.layout.recv_scales) +
                    static_cast<std::size_t>(row) * num_scales * elem;
  auto* dst = static_cast<uint8_t*>(p.expert_scales) + static_cast<std::size_t>(e) * p.expert_scale_bytes;
  for (int j = lane; j < num_scales; j += 32) {
    std::size_t const to = quant::scale_offset(p.format, p.scale_layout, static_cast<std::size_t>(p.expert_slots),
                                               p.hidden, static_cast<std::size_t>(slot), static_cast<std::size_t>(j));
    if (elem == 4)
      *reinterpret_cast<uint32_t*>(dst + to) = *reinterpret_cast<uint32_t const*>(src + j * elem);
    else
      dst[to] = src[j];
  }
  if (traits.token_scale_bytes != 0 && lane == 0)
    p.expert_token_scales[static_cast<std::size_t>(e) * p.expert_slots + slot] =
        reinterpret_cast<float const*>(p.sym_local + p.layout.recv_token_scales)[row];
}

// kQuantized (with kCopyRows): the rows are payloads and their scales are copied too (an instance of its own, so the
// bf16 copy keeps its registers).
template <bool kCopyRows, bool kQuantized = false>
__global__ void __launch_bounds__(kThreads) expand_kernel(ExpandParams const p) {
  __shared__ int32_t s_warp_off[kWarps];
  __shared__ int32_t s_warp_cnt[kWarps];
  __shared__ int32_t s_total;
  __shared__ int32_t s_rows[kThreads];  // rows whose entries took the slots of this step, in slot order

  int const tid = static_cast<int>(threadIdx.x);
  int const lane = tid & 31;
  int const warp = tid >> 5;
  int const topk = p.topk;
  int const slots = p.expert_slots;
  int const num_recv = p.state->num_recv;
  int const entries = num_recv * topk;
  // the walk starts at this rank's own first row (its rows take the first slots of every expert)
  int const own_first = min(p.state->src_offset[p.view.rank], num_recv) * topk;
  auto const* recv_idx = reinterpret_cast<int32_t const*>(p.sym_local + p.layout.recv_idx);
  // bf16 rows: hidden * 2, the code of bf16 transport; quantized delivery: the payload (EpConfig::recv_row_bytes)
  std::size_t const row_bytes = kQuantized ? p.row_bytes : static_cast<std::size_t>(p.hidden) * 2;
  uint32_t const lower = (1u << lane) - 1u;

  for (int e = static_cast<int>(blockIdx.x); e < p.num_local_experts; e += static_cast<int>(gridDim.x)) {
    int running = 0;
    for (int base = 0; base < entries; base += kThreads) {
      int const q = base + tid;  // position in the walk
      int const f = q < entries ? (own_first + q) % entries : q;
      int32_t const v = q < entries ? recv_idx[f] : -2;
      bool const hit = v == e;
      // entries of no local expert get slot -1; CTA 0 writes them during its first expert
      if (e == 0 && q < entries && v < 0) p.recv_slot[f] = -1;
      uint32_t const bits = __ballot_sync(0xffffffffu, hit);
      if (lane == 0) s_warp_cnt[warp] = __popc(bits);
      __syncthreads();
      if (tid == 0) {
        int run = running;
        for (int w = 0; w < kWarps; ++w) {
          s_warp_off[w] = run;
          run += s_warp_cnt[w];
        }
        s_total = run;
      }
      __syncthreads();
      if (hit) {
        int const slot = s_warp_off[warp] + __popc(bits & lower);
        if (slot < slots) {
          p.recv_slot[f] = slot;
          if constexpr (kCopyRows) {
            p.expert_src_row[static_cast<std::size_t>(e) * slots + slot] = f / topk;
            s_rows[slot - running] = f / topk;
          }
        } else {
          p.recv_slot[f] = -1;
          if constexpr (kCopyRows) device::record_input_error(p.view, slot, true);  // counted once, by the expand
        }
      }
      __syncthreads();
      int const total = s_total;
      if constexpr (kCopyRows) {
        int const filled_end = p.skip_rows ? running : (total < slots ? total : slots);
        for (int j = warp; running + j < filled_end; j += kWarps) {
          char const* src = p.sym_local + p.layout.recv_x + static_cast<std::size_t>(s_rows[j]) * row_bytes;
          char* dst = static_cast<char*>(p.expert_x) + (static_cast<std::size_t>(e) * slots + running + j) * row_bytes;
          if constexpr (kQuantized) {
            copy_row_warp(dst, src, row_bytes, lane);
            copy_slot_scales(p, e, running + j, s_rows[j], lane);
          } else {
            device::copy_warp_16B<true>(dst, src, row_bytes);
          }
        }
      }
      running = total;
      __syncthreads();  // s_rows and the scan words are reused by the next step
    }
    if constexpr (kCopyRows) {
      for (int s = (running < slots ? running : slots) + tid; s < slots; s += kThreads)
        p.expert_src_row[static_cast<std::size_t>(e) * slots + s] = -1;
    }
  }
}

}  // namespace ferry::cuda_ep
