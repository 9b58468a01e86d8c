// Normal-mode combine over several nodes (hierarchical; the reverse of hier/dispatch.cuh), in the reference's order
// (src/ep/reference.hpp, "Across nodes"). Two kernels per call:
//  1. hier_combine_push_kernel (the grid), warp per received row: the bf16 row it sends back is computed as on one node
//     (expert-major: the fmaf chain over its local entries, k ascending, rounded once; rank-major: the caller's row).
//     A row of a source on this node goes to the source's landing zone in combine_format (normal/combine.cuh's push); a row
//     of a source on another node goes, bf16, to the rail of this node for it (rank node * local + local_of(source)),
//     at [source node][this rank's local index][token]. Then the last CTA puts this rank's abort word (seq when it
//     refuses the call) and its arrival (+1 per call) on every rank: NVLink inside the node, the network elsewhere.
//  2. hier_combine_sum_kernel (the grid): every rank's arrival (bounded waits; a refusal seen by every rank), then
//     a. rail: per record the rail forwarded in the dispatch (token t of a source s on node n), the partial
//        p = 0.0f; p += float(row_d) over the ranks d of this node that hold t, ascending; rounded to bf16, quantized
//        to combine_format into this rank's window and put to s's landing zone at [this rank][t]: one row per
//        (token, node) crosses the network. Every warp then signals every source it serves (device::kArrivalsPerCall per call);
//     b. sums: once every other node's rail signalled, y[t] = sum over the senders of t ascending (hier_mask: the
//        ranks of the own node that hold t, and the rail of every other node that does) of the dequantized landing
//        rows, in fp32 from +0.0f, rounded once (or fp32 for dispatch_backward): the nodes ascending, and inside the
//        own node its ranks ascending, as the reference sums (normal/combine.cuh's sum_tokens over that mask).
// Sequence numbers (DeviceState::combine_seq) per call; the landing zone, the partials and the abort words alternate
// by parity (a peer may run the push of call n+1 while this rank still sums call n; call n+2 needs this rank's
// arrival of n+1).
#pragma once

#include <cstdint>

#include "comm/device/bf16x8.cuh"
#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "ep/cuda/normal/combine.cuh"
#include "ep/cuda/hier/params.cuh"

namespace ferry::cuda_ep {

template <bool kExpertMajor, WireFormat kFormat, int kUnitElems, class Net>
__global__ void __launch_bounds__(kThreads, 1) hier_combine_push_kernel(HierCombineParams<Net> const p) {
  __shared__ int s_last;
  auto const [world, rank, tid, lane, warp, cta, nodes, local, own_node, local_rank, global_warp, num_warps] =
      hier_ids(p);
  auto const [seq, parity] = hier_call(p.state->normal.combine_seq);
  int const num_vec = p.hidden / 8;
  std::size_t const max_tokens = static_cast<std::size_t>(p.max_tokens);
  std::size_t const bf16_row = static_cast<std::size_t>(p.hidden) * 2;

  // 1. warp per received row: to the source's landing zone (this node) or to this node's rail for it (bf16)
  int const num_recv = p.abort ? 0 : p.state->num_recv;
  unsigned long long nvlink_bytes = 0;  // what this warp sent to other ranks (warp-uniform)
  auto const* recv_src = reinterpret_cast<int2 const*>(p.net.local() + p.layout.normal.recv_src);
  for (int row = global_warp; row < num_recv; row += num_warps) {
    int2 const from = recv_src[row];
    int const s = from.x;
    std::size_t const t = static_cast<std::size_t>(from.y);
    char* dst = nullptr;
    bool const near = s / local == own_node;
    if (near) {
      dst = p.net.window(s) + p.layout.normal.landing +
            ((static_cast<std::size_t>(parity) * world + rank) * max_tokens + t) * p.landing_row_bytes;
      if (s != rank) nvlink_bytes += p.landing_row_bytes;
    } else {
      int const rail = own_node * local + s % local;
      if (rail != rank) nvlink_bytes += bf16_row;
      std::size_t const at =
          ((static_cast<std::size_t>(parity) * nodes + s / local) * local + local_rank) * max_tokens + t;
      dst = p.net.window(rail) + p.layout.hier.partials + at * bf16_row;
    }
    if constexpr (kFormat != WireFormat::bf16) {
      if (near) {
        push_quantized_partial<kExpertMajor, kFormat, kUnitElems>(p, row, reinterpret_cast<uint8_t*>(dst), lane);
        continue;
      }
    }
    if constexpr (kExpertMajor) {
      reduce_expert_row(p, row, reinterpret_cast<int4*>(dst), lane, 0, num_vec);
    } else {
      device::copy_16B<true, kCombineUnroll>(
          dst, static_cast<int4 const*>(p.x) + static_cast<std::size_t>(row) * num_vec, bf16_row, lane, 32);
    }
  }

  if (lane == 0) atomicAdd(&p.state->hier.bytes_running[1][1], nvlink_bytes);

  // 2. arrival; the last CTA publishes this rank's abort word and arrival on every rank
  __syncthreads();
  if (tid == 0) {
    device::arch::fence_acq_rel_sys();  // this CTA's rows before the arrival (the barrier ordered every thread's)
    unsigned long long const old = atomicAdd(reinterpret_cast<unsigned long long*>(&p.state->normal.combine_done), 1ull);
    s_last = old == static_cast<unsigned long long>(p.num_ctas - 1);
    if (s_last) device::arch::fence_acq_rel_sys();  // every CTA's rows before the signals below
  }
  __syncthreads();
  if (!s_last) return;
  auto lsa = p.net.open(transport::Cta{});
  auto net = p.network.open(transport::Cta{}, 0);
  uint64_t const abort_word = p.abort ? seq : 0;
  std::size_t const abort_at =
      p.layout.hier.abort + (static_cast<std::size_t>(parity) * world + rank) * sizeof(uint64_t);
  std::size_t const arrive_at = p.layout.hier.arrive + static_cast<std::size_t>(rank) * sizeof(uint64_t);
  for (int d = 0; d < world; ++d) {
    if (d / local == own_node) {
      lsa.put_value(d, abort_at, abort_word);
      lsa.signal(d, arrive_at, 1);
    } else {
      net.put_value(d, abort_at, abort_word);
      net.signal(d, arrive_at, 1);
    }
  }
  net.flush();
  net.close();
  if (tid == 0) p.state->normal.combine_done = 0;  // every CTA has arrived
}

// The rail's partial of one record: p = 0.0f; p += float(row_l[t]) for the ranks l of this node in `holders`,
// ascending; rounded to bf16 into `out` (bf16 row). Warp-wide.
__device__ __forceinline__ void rail_partial(char const* partials, std::size_t rank_stride, uint32_t holders,
                                             int num_vec, int4* out, int lane) {
  for (int v = lane; v < num_vec; v += 32) {
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
    for (uint32_t m = holders; m != 0; m &= m - 1) {
      int const l = __ffs(m) - 1;
      // coherent loads: peers wrote the rows during this call
      int4 const raw = device::arch::load_v4(reinterpret_cast<int4 const*>(partials + l * rank_stride) + v);
      float values[8];
      device::bf16x8_to_float(raw, values);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], values[i]);
    }
    out[v] = device::float_to_bf16x8(acc);
  }
}

template <WireFormat kFormat, int kUnitElems, class Net>
__global__ void __launch_bounds__(kThreads, 1) hier_combine_sum_kernel(HierCombineParams<Net> const p) {
  __shared__ int s_ok;
  __shared__ uint32_t s_refused;
  __shared__ int32_t s_fwd_first[kMaxCudaWorld + 1];
  auto const [world, rank, tid, lane, warp, cta, nodes, local, own_node, local_rank, global_warp, num_warps] =
      hier_ids(p);
  auto const [seq, parity] = hier_call(p.state->normal.combine_seq);
  int const num_vec = p.hidden / 8;
  std::size_t const max_tokens = static_cast<std::size_t>(p.max_tokens);
  std::size_t const bf16_row = static_cast<std::size_t>(p.hidden) * 2;
  std::size_t const landing_bytes = p.landing_row_bytes;
  char* const own = p.net.local();

  // 1. every rank's arrival (warp 0; acquire): its rows to this rank and its abort word are in
  if (warp == 0) {
    auto lsa = p.net.open(transport::Warp{});
    auto net = p.network.open(transport::Warp{}, global_warp);
    bool ok = true;
    uint32_t refused = 0;
    // NOTE: past a failed wait the loop goes on: the later waits stop at once (device_failed), each recording its
    // sender if absent, so the error names every missing rank (a whole node), not only the first
    for (int d = 0; d < world; ++d) {
      std::size_t const counter = p.layout.hier.arrive + static_cast<std::size_t>(d) * sizeof(uint64_t);
      bool const arrived = d / local == own_node ? lsa.wait(p.view, counter, seq, d, WaitPhase::combine_data)
                                                 : net.wait(p.view, counter, seq, d, WaitPhase::combine_data);
      ok = ok && arrived;
      uint64_t const* const abort_word = reinterpret_cast<uint64_t const*>(
          own + p.layout.hier.abort + (static_cast<std::size_t>(parity) * world + d) * sizeof(uint64_t));
      if (ok && device::arch::load_relaxed_sys_u64(abort_word) == seq) refused |= 1u << d;
    }
    net.close();
    if (lane == 0) {
      s_ok = ok;
      s_refused = refused;
    }
  }
  if (tid == 0) {
    int32_t total = 0;
    for (int n = 0; n < nodes; ++n) {
      s_fwd_first[n] = total;
      total += p.state->hier.fwd_count[n];
    }
    s_fwd_first[nodes] = total;
  }
  __syncthreads();
  if (!s_ok) return;
  bool const aborted = s_refused != 0;  // the same on every rank: every rank read every abort word

  // 2a. rail: one row per record back to its source over the network
  auto net = p.network.open(transport::Warp{}, global_warp);
  std::size_t const rank_stride = max_tokens * bf16_row;  // between the partials of two ranks of this node
  CombineParams rail_params = p;                          // the quantizer reads the rail's bf16 sums as its rows
  unsigned long long network_bytes = 0;                   // what this warp put (warp-uniform)
  unsigned long long network_messages = 0;
  rail_params.x = p.rail_partials;
  for (int item = global_warp; !aborted && item < s_fwd_first[nodes]; item += num_warps) {
    auto const [n, at, record] = hier_rail_item(p, own, s_fwd_first, item);
    int const source = n * local + local_rank;
    std::size_t const t = static_cast<std::size_t>(*record.token);
    int const row = lane < local ? record.rows[lane] : -1;
    uint32_t const holders = __ballot_sync(0xffffffffu, row >= 0 && row < p.recv_capacity);
    char const* const partials = own + p.layout.hier.partials +
                                 ((static_cast<std::size_t>(parity) * nodes + n) * local * max_tokens + t) * bf16_row;
    std::size_t const send = p.layout.hier.combine_send + at * landing_bytes;
    if constexpr (kFormat == WireFormat::bf16) {
      rail_partial(partials, rank_stride, holders, num_vec, reinterpret_cast<int4*>(own + send), lane);
    } else {
      rail_partial(partials, rank_stride, holders, num_vec,
                   reinterpret_cast<int4*>(p.rail_partials + at * static_cast<std::size_t>(p.hidden)), lane);
      __syncwarp();
      push_quantized_partial<false, kFormat, kUnitElems>(rail_params, static_cast<int>(at),
                                                         reinterpret_cast<uint8_t*>(own + send), lane);
    }
    __syncwarp();
    network_bytes += landing_bytes;
    ++network_messages;
    net.put(source,
            p.layout.normal.landing + ((static_cast<std::size_t>(parity) * world + rank) * max_tokens + t) * landing_bytes,
            send, landing_bytes);
  }
  for (int n = 0; n < nodes; ++n)
    if (n != own_node)
      net.signal(n * local + local_rank, p.layout.hier.rail_signal + static_cast<std::size_t>(rank) * sizeof(uint64_t),
                 device::arrival_share(global_warp, num_warps));
  net.flush();
  if (lane == 0) {
    atomicAdd(&p.state->hier.bytes_running[1][0], network_bytes);
    atomicAdd(&p.state->hier.bytes_running[1][2], network_messages);
  }
  // 2b. every other node's rail (warp 0; the network's wait), then the sums of this CTA's share of the tokens
  bool ok = true;
  if (warp == 0) {
    for (int n = 0; n < nodes; ++n) {  // past a failure as above: every absent rail is recorded
      if (n == own_node) continue;
      int const rail = n * local + local_rank;
      bool const arrived =
          net.wait(p.view, p.layout.hier.rail_signal + static_cast<std::size_t>(rail) * sizeof(uint64_t),
                   device::arrivals_for(seq), rail, WaitPhase::combine_data);
      ok = ok && arrived;
    }
    if (lane == 0 && !ok) s_ok = 0;
  }
  net.close();
  __syncthreads();
  if (!s_ok) return;
  int const num_tokens = p.state->num_tokens;
  int const t0 = static_cast<int>(static_cast<int64_t>(num_tokens) * cta / p.num_ctas);
  int const t1 = static_cast<int>(static_cast<int64_t>(num_tokens) * (cta + 1) / p.num_ctas);
  if (!aborted && t1 > t0) {
    CombineParams sums = p;
    sums.token_mask = p.hier_mask;  // the senders of each token, in the reference's order when taken ascending
    if (p.y_fp32)
      sum_tokens<kFormat, kUnitElems, true>(sums, t0, t1 - t0, parity, warp, lane);
    else
      sum_tokens<kFormat, kUnitElems, false>(sums, t0, t1 - t0, parity, warp, lane);
  }

  // 3. the refusals of this call (unless this rank refused it too), then the last CTA advances the sequence
  if (cta == 0 && tid < world && tid != rank && ((s_refused >> tid) & 1u) != 0 && !p.abort)
    device::record_refusal(p.view, tid, WaitPhase::combine_data);
  __syncthreads();
  if (tid == 0) {
    __threadfence();  // this CTA's byte counts before its arrival
    unsigned long long const old = atomicAdd(reinterpret_cast<unsigned long long*>(&p.state->normal.combine_done), 1ull);
    if (old == static_cast<unsigned long long>(p.num_ctas - 1)) {
      __threadfence();
      for (int i = 0; i < 3; ++i) p.state->hier.bytes[1][i] = atomicExch(&p.state->hier.bytes_running[1][i], 0ull);
      p.state->normal.combine_done = 0;
      p.state->normal.combine_seq = seq;
    }
  }
}

}  // namespace ferry::cuda_ep
