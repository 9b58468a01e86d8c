// The low-latency combine's steps across nodes (ll/combine.cuh runs them with a network transport; one node compiles
// them away): the direct route's puts of the staged rows to the sources of other nodes, and the forward route's rail,
// which reduces its node's rows per token and puts one row per (token, node) back. Each reaches the other nodes only
// through the transport seam (Net: Emulated on one host, Gin on a cluster).
#pragma once

#include "ep/cuda/ll/combine_common.cuh"

namespace ferry::cuda_ll {

// Across nodes, after the send (every thread of the CTA, past the barrier that ends it): the rows this CTA staged
// for the sources of other nodes, put from this rank's window into their landing zones, then its arrival there
// (ll_dispatch_send_network's scheme: warp w takes the ranks j = w, w + kWarps, ... of the other nodes over every
// row of the CTA, in the send's order; a row whole from its first chunk's item (combine_chunks keeps a row's chunks
// in one CTA), a bf16 row wider than 16 of its 1024-element chunks a chunk's bytes per item; CTA 0 of a refusing
// rank puts its abort word). The staged rows alternate by parity, as the landing zones. kMasking: a rank masked
// since the dispatch gets nothing (its rows were not staged either). refused: combine_refused(p), the send's.
template <WireFormat kFormat, bool kMasking, class Net>
__device__ __forceinline__ void ll_combine_send_network(LlCombineParams const& p, Net const& network, int parity,
                                                        uint64_t seq, bool refused) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const num_vec = p.hidden / 8;
  int const num_recv = refused ? 0 : p.state->num_recv;  // a refusing rank sends no rows
  std::size_t const wire = p.layout.ll.combine_row_bytes;
  std::size_t const staged = p.layout.ll.combine_send + static_cast<std::size_t>(parity) * world * p.max_tokens * wire;
  std::size_t const landed = p.layout.ll.combine_rows + static_cast<std::size_t>(parity) * world * p.max_tokens * wire;
  LiveRanks<kMasking> const live = live_ranks<kMasking>(p);
  auto ep = network.open(transport::Warp{}, (p.num_ctas + cta) * kWarps + warp);
  for (int j = warp; j < world - p.local; j += kWarps) {
    int const d = remote_rank(p, j);
    if (!live.has(d)) continue;
    auto const put_row = [&](int row, std::size_t begin, std::size_t bytes) {
      int const token = p.recv_src[2 * row + 1];
      ep.put(d, landed + (static_cast<std::size_t>(rank) * p.max_tokens + token) * wire + begin,
             staged + static_cast<std::size_t>(row) * wire + begin, bytes);
    };
    if constexpr (kFormat == WireFormat::nvfp4) {
      // ll_combine_send_rows_nvfp4's rows: rows_per_step a step of each CTA, lane i looking at the step's row i
      int const num_chunks = (num_vec + kChunkVecs - 1) / kChunkVecs;
      int const rows_per_step = max(1, kWarps / num_chunks);
      for (int r0 = cta * rows_per_step; r0 < num_recv; r0 += p.num_ctas * rows_per_step) {
        int const row = r0 + lane;
        bool const to_d = lane < rows_per_step && row < num_recv && p.recv_src[2 * row] == d;
        for (uint32_t m = __ballot_sync(0xffffffffu, to_d); m != 0; m &= m - 1) put_row(r0 + __ffs(m) - 1, 0, wire);
      }
    } else {
      // ll_combine_send_chunks's items: kWarps a step of each CTA, lane i looking at the step's item i
      int const chunks = combine_chunks<kFormat, true>(p, num_recv);
      int const items = num_recv * chunks;
      for (int base = cta * kWarps; base < items; base += p.num_ctas * kWarps) {
        int const item = base + lane;
        bool const to_d = lane < kWarps && item < items && p.recv_src[2 * (item / chunks)] == d;
        for (uint32_t m = __ballot_sync(0xffffffffu, to_d); m != 0; m &= m - 1) {
          int const it = base + __ffs(m) - 1;
          int const row = it / chunks;
          int const chunk = it % chunks;
          if (kFormat == WireFormat::bf16 && chunks > kWarps) {  // a row wider than a CTA's chunks: per chunk
            auto const [v_begin, v_end] = device::chunk_range(num_vec, chunk, chunks);
            if (v_end > v_begin)
              put_row(row, static_cast<std::size_t>(v_begin) * 16, static_cast<std::size_t>(v_end - v_begin) * 16);
          } else if (chunk == 0) {
            put_row(row, 0, wire);
          }
        }
      }
    }
    if (refused && cta == 0)
      ep.put_value(d, p.layout.ll.combine_abort + (static_cast<std::size_t>(parity) * world + rank) * sizeof(uint64_t),
                   seq);
    ep.signal(d, p.layout.ll.combine_arrivals + static_cast<std::size_t>(rank) * sizeof(uint64_t), 1);
  }
  ep.close();
}

// The forward route's rail, at the end of a send half (every thread of the CTA): once every rank of this node has
// sent its rows (their partial arrivals, bounded waits), the CTA's share of the tokens this rail placed in the last
// dispatch (token t of node m's source: global warp t % (num_ctas * kWarps)) reduced as the reference does it: the
// bf16 rows of the node's ranks holding it summed in fp32, local ranks ascending, rounded to bf16, then quantized to
// combine_format (nvfp4: the token scale from the rounded row's amax, a first pass) into this rail's staged row;
// after the barrier warp w takes the other nodes j = w, w + kWarps, ...: to that node's source it puts the CTA's
// staged rows into its landing zone at (this rail, token), relays (CTA 0) the abort word of every rank of this node
// that refused the call, and signals +1. Returns false when a rank of the node did not send (the timeout recorded):
// then nothing is signalled, and the sources time out on this rail. refused: combine_refused(p), the send's.
template <WireFormat kFormat, class Net>
__device__ __forceinline__ bool ll_combine_rail(LlCombineParams const& p, Net const& network, int parity, uint64_t seq,
                                                bool refused) {
  __shared__ int s_rail_ok;
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const own_node = rank / p.local;
  int const first = own_node * p.local;
  int const num_vec = p.hidden / 8;
  int const num_chunks = (num_vec + kChunkVecs - 1) / kChunkVecs;
  int const total_warps = p.num_ctas * kWarps;
  std::size_t const wire = p.layout.ll.combine_row_bytes;
  std::size_t const max_tokens = static_cast<std::size_t>(p.max_tokens);
  std::size_t const bf16_row = static_cast<std::size_t>(p.hidden) * 2;
  WireRowLayout const wl = wire::make_row_layout(kFormat, p.hidden);
  char* const own = p.net.local();
  if (tid == 0) s_rail_ok = 1;
  __syncthreads();
  if (tid < p.local && !device::wait_signal_geq(
                           p.view, reinterpret_cast<uint64_t const*>(own + p.layout.ll.partial_arrivals) + first + tid,
                           seq * static_cast<uint64_t>(p.num_ctas), first + tid, WaitPhase::ll_combine))
    s_rail_ok = 0;
  __syncthreads();
  if (!s_rail_ok) return false;

  // 1. the reduction of each placed token into the staged row
  for (int m = 0; m < p.nodes && !refused; ++m) {
    if (m == own_node) continue;
    int const n = p.fwd_num[m];
    for (int t = cta * kWarps + warp; t < n; t += total_warps) {
      uint32_t const here = p.fwd_mask[static_cast<std::size_t>(m) * max_tokens + t];
      if (here == 0) continue;
      std::size_t const at = (static_cast<std::size_t>(parity) * p.nodes + m) * max_tokens + t;
      auto* const out = reinterpret_cast<uint8_t*>(own + p.layout.ll.rail_send + at * wire);
      // chunk c of the node's sum, rounded to bf16, as fp32 values in x
      auto const node_sum = [&](int c, float(&x)[kUnroll][8]) {
        device::zero_acc(x);
        int const v0 = c * kChunkVecs + lane;
        int const v_end = min((c + 1) * kChunkVecs, num_vec);
        for (uint32_t h = here; h != 0; h &= h - 1) {
          int const l = __ffs(h) - 1;
          auto const* row = reinterpret_cast<int4 const*>(
              own + p.layout.ll.partials +
              (((static_cast<std::size_t>(parity) * p.nodes + m) * p.local + l) * max_tokens + t) * bf16_row);
          device::add_bf16_vectors(row, v0, v_end, x);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) bf16x8_to_float(float_to_bf16x8(x[u]), x[u]);
      };
      float token_scale = 0.0f;
      if constexpr (kFormat == WireFormat::nvfp4) {
        float amax = 0.0f;
        for (int c = 0; c < num_chunks; ++c) {
          float x[kUnroll][8];
          node_sum(c, x);
          int const v_end = min((c + 1) * kChunkVecs, num_vec);
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            bool all_finite;
            if (c * kChunkVecs + lane + u * 32 < v_end)
              amax = fmaxf(amax, device::wire_detail::finite_amax<8>(x[u], all_finite));
          }
        }
        token_scale = wire::nvfp4_token_scale(device::wire_detail::group_max<32>(amax));
        if (lane == 0) *reinterpret_cast<float*>(out + wl.token_scale_offset) = token_scale;
      }
      for (int c = 0; c < num_chunks; ++c) {
        float x[kUnroll][8];
        node_sum(c, x);
        int const v_end = min((c + 1) * kChunkVecs, num_vec);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          int const v = c * kChunkVecs + lane + u * 32;
          if constexpr (kFormat == WireFormat::bf16) {
            if (v < v_end) device::arch::store_na_v4(reinterpret_cast<int4*>(out) + v, float_to_bf16x8(x[u]));
          } else {
            device::quantize_vec<kFormat>(x[u], v < v_end, v, out, wl.scales_offset, token_scale);
          }
        }
      }
    }
  }

  // 2. the network leg: the CTA's rows to each other node's source, its node's refusals, then its arrival there
  __syncthreads();
  auto ep = network.open(transport::Warp{}, (p.num_ctas + cta) * kWarps + warp);
  for (int j = warp; j < p.nodes - 1; j += kWarps) {
    int const m = j < own_node ? j : j + 1;
    int const source = m * p.local + rank % p.local;
    int const n = refused ? 0 : p.fwd_num[m];
    std::size_t const landed =
        p.layout.ll.combine_rows + ((static_cast<std::size_t>(parity) * world + rank) * max_tokens) * wire;
    for (int base = cta * kWarps; base < n; base += total_warps) {
      int const t = base + lane;
      bool const placed = lane < kWarps && t < n && p.fwd_mask[static_cast<std::size_t>(m) * max_tokens + t] != 0;
      for (uint32_t b = __ballot_sync(0xffffffffu, placed); b != 0; b &= b - 1) {
        int const tt = base + __ffs(b) - 1;
        std::size_t const at = (static_cast<std::size_t>(parity) * p.nodes + m) * max_tokens + tt;
        ep.put(source, landed + static_cast<std::size_t>(tt) * wire, p.layout.ll.rail_send + at * wire, wire);
      }
    }
    if (cta == 0)
      for (int d = first; d < first + p.local; ++d) {
        std::size_t const word = (static_cast<std::size_t>(parity) * world + d) * sizeof(uint64_t);
        if (*reinterpret_cast<uint64_t const volatile*>(own + p.layout.ll.combine_abort + word) == seq)
          ep.put_value(source, p.layout.ll.combine_abort + word, seq);
      }
    ep.signal(source, p.layout.ll.combine_arrivals + static_cast<std::size_t>(rank) * sizeof(uint64_t), 1);
  }
  ep.close();
  return true;
}

}  // namespace ferry::cuda_ll
