// combine_backward's weight step (normal mode), after the cached expert-major dispatch of grad_y: recv_x holds
// grad_y[t] of source (s, t) in received row i (the expand filled the slots' layout but not their rows:
// CudaEp::dispatch_gradients), and x (the forward combine's expert outputs) the rows the slots held in the forward
// pass.
//
// Two kernels, so that no CTA waits while another rank still has work to do on the same SMs:
//  1. send (the grid; never waits): a warp per entry (i, k) of a local expert (received row i, column k).
//     A filled slot (e, j): dot = the canonical warp dot of row i and x(e, j) (ref::dot_warp: lane l takes
//     the 16-byte vectors l, l + 32, ... ascending and their 8 elements ascending, acc = fmaf(a, b, acc) from +0.0f,
//     then the xor butterfly m = 16, 8, 4, 2, 1), and expert_x(e, j) = bf16_rn(w[i, k] * g): one pass that reads the
//     row (once from memory, then from the L2) and x, and writes the slot. The dot goes back to the source
//     s = recv_src[i].rank as the word (seq << 32 | bits) at weight_grad[parity][t][k] of s: each entry has one rank
//     holding its expert, so that rank alone writes the word. An entry of a local expert without a slot (past
//     expert_capacity) sends a tagged 0. Then every CTA adds its share of device::kArrivalsPerCall to every rank's
//     arrival counter of this rank (release, after the CTA's barrier: cumulative over the CTA's word stores), so the
//     sum per call does not depend on the grid.
//  2. collect (kWeightGradWaitCtas CTAs): thread d waits until rank d's arrivals reach device::arrivals_for(seq)
//     (acquire, bounded, naming d on expiry; past (seq + 1) per call is an out-of-step error), then grad_w[t, k] =
//     the word's value when its tag is seq, else 0 (an id of -1, or a row dropped by the receive capacity: no rank
//     wrote it this call). The last CTA advances DeviceState::weight_grad_seq (both kernels read it at their start).
// Parity = seq & 1: a fast peer may write call n + 1's words while this rank still reads call n's; it cannot write
// n + 2's before this rank's arrival of n + 1, which follows this rank's reads of n (stream order).
// A refused combine_backward (WeightGradParams::abort) stores nothing of its own: its CTAs only arrive, and it collects
// nothing (the call is its host's InputError); its peers learn of the refusal from the cached dispatch's exchange.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "comm/device/arrivals.cuh"
#include "comm/device/bf16x8.cuh"
#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "ep/cuda/normal/params.cuh"

namespace ferry::cuda_ep {

// 16-byte vectors per lane loaded before the arithmetic of one step of a slot (of each of its two rows).
inline constexpr int kWeightGradUnroll = 4;

// Byte offset of word (parity, token, k) of the weight_grad area.
__device__ __forceinline__ std::size_t weight_grad_offset(KernelParams const& p, int parity, int token, int k) {
  return p.layout.normal.weight_grad +
         ((static_cast<std::size_t>(parity) * p.max_tokens + token) * p.topk + k) * sizeof(uint64_t);
}

// One filled slot, warp-wide: the canonical dot of g (grad_y's row) and x (null: none, 0), and out = bf16_rn(w * g).
// Every lane returns the same dot.
__device__ __forceinline__ float dot_and_scale(int4* out, int4 const* g, int4 const* x, float w, int num_vec,
                                               int lane) {
  float acc = 0.0f;
  for (int i0 = 0; i0 < num_vec; i0 += 32 * kWeightGradUnroll) {
    int const i = i0 + lane;
    int4 gv[kWeightGradUnroll];
    int4 xv[kWeightGradUnroll];
    // g (recv_x) and x are read-only here; a row's g is read once per entry, from the L2 after the first
#pragma unroll
    for (int u = 0; u < kWeightGradUnroll; ++u) {
      if (i + u * 32 >= num_vec) continue;
      gv[u] = device::arch::load_nc_v4(g + i + u * 32);
      if (x != nullptr) xv[u] = device::arch::load_nc_v4(x + i + u * 32);
    }
#pragma unroll
    for (int u = 0; u < kWeightGradUnroll; ++u) {
      if (i + u * 32 >= num_vec) continue;
      float gf[8];
      device::bf16x8_to_float(gv[u], gf);
      if (x != nullptr) {
        float xf[8];
        device::bf16x8_to_float(xv[u], xf);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc = __fmaf_rn(gf[j], xf[j], acc);
      }
      float scaled[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) scaled[j] = __fmul_rn(w, gf[j]);  // the product in fp32, then rounded to bf16
      out[i + u * 32] = device::float_to_bf16x8(scaled);
    }
  }
  // the butterfly of ref::dot_warp: every lane ends with the same sum (float addition is commutative)
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, m));
  return acc;
}

__global__ void __launch_bounds__(kThreads) weight_grad_send_kernel(WeightGradParams const p) {
  __shared__ uint64_t s_seq;
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  // 0. this call's sequence number (advanced by the previous call's collect kernel; stream order makes it visible)
  if (tid == 0) s_seq = p.state->normal.weight_grad_seq + 1;
  __syncthreads();
  uint64_t const seq = s_seq;
  int const parity = static_cast<int>(seq & 1);
  int const topk = p.topk;
  int const num_vec = p.hidden / 8;

  if (!p.abort) {
    // 1. a warp per entry of the cached dispatch's rows (its layout is the handle's)
    char const* const sym = p.net.local();
    auto const* recv_idx = reinterpret_cast<int32_t const*>(sym + p.layout.normal.recv_idx);
    auto const* recv_w = reinterpret_cast<float const*>(sym + p.layout.normal.recv_w);
    auto const* recv_src = reinterpret_cast<int2 const*>(sym + p.layout.normal.recv_src);
    int const num_recv = p.state->num_recv;
    int const total_warps = p.num_ctas * kWarps;
    // NOTE: a warp per entry (i, k), not per row: at 128 tokens a warp per row left 128 warps each walking its row's
    // 8 slots one after another (80 us against the forward dispatch's 20); entries of one row sit side by side, so
    // the row is read from memory once and from the L2 by its other entries.
    int const entries = num_recv * topk;
    for (int item = cta * kWarps + warp; item < entries; item += total_warps) {
      int const row = item / topk;
      int const k = item - row * topk;
      int2 const src = recv_src[row];
      // bounds are checked so a stale layout cannot write outside the areas
      int32_t const el = recv_idx[item];
      if (el < 0 || el >= p.num_local_experts) continue;  // not this rank's expert: its holder sends the word
      if (src.x < 0 || src.x >= world || src.y < 0 || src.y >= p.max_tokens) continue;
      int32_t const slot = p.recv_slot[item];
      uint64_t* const word = reinterpret_cast<uint64_t*>(p.net.window(src.x) + weight_grad_offset(p, parity, src.y, k));
      if (slot < 0 || slot >= p.expert_slots) {
        // an entry of a local expert without a slot: the source's word says 0 for this call
        if (lane == 0) *reinterpret_cast<uint64_t volatile*>(word) = seq << 32;
        continue;
      }
      std::size_t const at = (static_cast<std::size_t>(el) * p.expert_slots + slot) * num_vec;
      int4 const* const x = p.x != nullptr ? static_cast<int4 const*>(p.x) + at : nullptr;
      int4 const* const g =
          reinterpret_cast<int4 const*>(sym + p.layout.normal.recv_x) + static_cast<std::size_t>(row) * num_vec;
      float const dot = dot_and_scale(static_cast<int4*>(p.expert_x) + at, g, x, recv_w[item], num_vec, lane);
      if (lane == 0) *reinterpret_cast<uint64_t volatile*>(word) = (seq << 32) | __float_as_uint(dot);
    }
  }

  // 2. this CTA's arrival on every rank (release: the barrier orders every thread's word stores before it)
  __syncthreads();
  if (tid < world)
    p.net.add_signal(tid, p.layout.normal.weight_grad_arrivals + rank * sizeof(uint64_t),
                     device::arrival_share(cta, p.num_ctas));
}

__global__ void __launch_bounds__(kThreads) weight_grad_collect_kernel(WeightGradParams const p) {
  __shared__ uint64_t s_seq;
  __shared__ int s_ok;
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  if (tid == 0) {
    s_seq = p.state->normal.weight_grad_seq + 1;
    s_ok = 1;
  }
  __syncthreads();
  uint64_t const seq = s_seq;
  int const parity = static_cast<int>(seq & 1);

  // 1. every rank's send CTAs of this call (thread d waits for rank d; acquire, bounded)
  if (tid < world) {
    auto const* arrivals = reinterpret_cast<uint64_t const*>(p.net.local() + p.layout.normal.weight_grad_arrivals);
    uint64_t observed = 0;
    if (!device::wait_signal_geq_value(p.view, arrivals + tid, device::arrivals_for(seq), tid,
                                       WaitPhase::weight_gradients, &observed)) {
      s_ok = 0;
    } else if (observed > device::arrivals_for(seq + 1)) {
      // two calls ahead: that rank ran more weight steps on this buffer than this rank
      device::record_out_of_step(p.view, tid, WaitPhase::weight_gradients, seq, device::calls_of(observed));
      s_ok = 0;
    }
  }
  __syncthreads();

  // 2. grad_w of this rank's tokens: this call's words (coherent loads: peers wrote them, acquired above), else 0
  if (s_ok && p.grad_w != nullptr && !p.abort) {
    auto const* words = reinterpret_cast<uint64_t const volatile*>(p.net.local() + weight_grad_offset(p, parity, 0, 0));
    int const entries = p.num_tokens * p.topk;
    uint32_t const tag = static_cast<uint32_t>(seq);
    for (int i = cta * kThreads + tid; i < entries; i += p.num_ctas * kThreads) {
      uint64_t const word = words[i];
      p.grad_w[i] = static_cast<uint32_t>(word >> 32) == tag ? __uint_as_float(static_cast<uint32_t>(word)) : 0.0f;
    }
  }

  // 3. the last CTA advances the sequence (every CTA of both kernels read it at its start) and resets the counter
  __syncthreads();
  if (tid == 0) {
    unsigned long long const old = atomicAdd(reinterpret_cast<unsigned long long*>(&p.state->normal.weight_grad_done), 1ull);
    if (old == static_cast<unsigned long long>(p.num_ctas - 1)) {
      p.state->normal.weight_grad_done = 0;
      p.state->normal.weight_grad_seq = seq;
    }
  }
}

}  // namespace ferry::cuda_ep
