// Normal-mode dispatch over several nodes (hierarchical; docs/internode.md): the same outputs as the one-node dispatch
// of the whole world (normal/dispatch.cuh), rows ordered by (source rank, source token), but a token crosses the
// network once per destination node other than its own, to that node's rail for it (rank node * local +
// local_of(source)), which forwards it over NVLink into its final rows there. Two kernels per call:
//  1. hier_layout_kernel (one CTA, in token order, so no atomics decide an order): per token the mask of destination
//     ranks and its position among this rank's tokens for every destination rank and every other node; the entries
//     per expert; a bad or repeated id refuses the call (as normal/dispatch.cuh). Then this rank's row of the count
//     matrix (tokens + abort flag, rows per destination rank, entries per expert of that destination, tokens per node),
//     staged in its window and put to every rank: over NVLink inside the node, over the network to the others, each
//     with a signal (+1 per call on the destination's counter of this source).
//  2. hier_dispatch_kernel (the grid; an instance per wire codec of dispatch_format):
//     a. every source's count row (bounded waits: NVLink's for the node, the network's for the others); a refusal in
//        any row refuses the call on every rank (every rank reads the same words);
//     b. this rank's base on every destination (rows of lower sources there): every final row is known here;
//     c. push, warp per token: the destinations of its own node get the row and metadata straight into their final
//        rows (NVLink stores); for every other node that holds it, the row once into this rank's window (the network
//        reads registered memory) and a record (token, its final row on each rank of that node, global ids,
//        weights), both put to that node's rail, compact per node (node_pos). Every warp then signals every rail
//        (device::kArrivalsPerCall per call from the grid). A quantized dispatch_format quantizes the row once in
//        registers (or forwards pre-quantized pieces: device_push.cuh) and stores the pieces into the own node's
//        destinations and into the staged wire row in one pass: a token crosses the network as its wire row;
//     d. rail: waits for the signal of each of its sources on other nodes, then forwards each record's row to the
//        ranks of its node named in it (NVLink stores of the row and its metadata into their final rows; a wire row
//        split into the delivered payload, scales and token scale, bytes unchanged);
//     e. the last CTA signals (release) every rank of its node: data_signal[rank] for its own rows and
//        data_signal[s] for every source s it forwarded (one writer per word), waits for every source's word on its
//        own rows (as normal/dispatch.cuh) and writes the outputs (num_recv, per-source offsets, expert counts), then
//        advances the sequence. With a receiver pass (dispatch_dequantize, or scales in another recv_scale_layout)
//        every CTA waits for every source's rows and takes its share of the pass (dispatch_recv_pass, as one node).
// Sequence numbers (DeviceState::dispatch_seq) grow per call on the device (graph replays need no reset); count rows
// alternate by parity (a fast peer may write call n+1's row while this rank reads call n's); a rail's forward area is
// reused only after every rank's count row of the next call came, which follows that rank's forward of this call.
#pragma once

#include <cstdint>

#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "ep/cuda/hier/params.cuh"
#include "ep/cuda/landing.cuh"          // send_row_chunk
#include "ep/cuda/normal/dispatch.cuh"  // count_offset, count_word, count_value, token_destinations

namespace ferry::cuda_ep {

// A warp's copy of one piece of a forwarded wire row into its delivered place (coherent loads: the network wrote it
// during this kernel): 16-byte vectors while both ends are aligned to them, then bytes.
__device__ __forceinline__ void copy_piece_warp(char* dst, char const* src, std::size_t bytes, int lane) {
  std::size_t head = 0;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15u) == 0) {
    head = bytes / 16 * 16;
    device::copy_16B<false>(dst, src, head, lane, 32);
  }
  for (std::size_t i = head + lane; i < bytes; i += 32) dst[i] = *reinterpret_cast<char const volatile*>(src + i);
}

template <typename IdxT, class Net>
__global__ void __launch_bounds__(kThreads, 1) hier_layout_kernel(HierDispatchParams<Net> const p) {
  extern __shared__ int32_t s_cnt[];  // [world + nodes] running positions, then [num_experts] entries per expert
  __shared__ int32_t s_warp_cnt[kWarps][kMaxHierColumns];
  __shared__ int32_t s_warp_off[kWarps][kMaxHierColumns];
  __shared__ int s_bad;

  auto const [world, rank, tid, lane, warp, cta, nodes, local, own_node, local_rank, global_warp, num_warps] =
      hier_ids(p);
  auto const [seq, parity] = hier_call(p.state->normal.dispatch_seq);
  int const topk = p.topk;
  int const num_experts = p.num_experts;
  int const num_local = p.num_local_experts;
  int const columns = world + nodes;  // destination ranks, then the other nodes
  auto const* topk_idx = static_cast<IdxT const*>(p.topk_idx);
  if (tid == 0) s_bad = 0;
  for (int i = tid; i < columns + num_experts; i += kThreads) s_cnt[i] = 0;
  __syncthreads();

  // 1. layout, kThreads tokens a step in token order: a token's position for destination column c (a rank, or a node
  //    other than this one) is the number of lower tokens with that column
  for (int base = 0; base < p.num_tokens; base += kThreads) {
    int const t = base + tid;
    bool const valid = t < p.num_tokens;
    // a bad or repeated id refuses the call on every rank (step 2)
    uint32_t const mask = token_destinations(p, topk_idx, t, valid, s_cnt + columns, s_bad);
    uint32_t node_mask = 0;
    for (int n = 0; n < nodes; ++n)
      if (n != own_node && (mask & node_bits(n, local)) != 0) node_mask |= 1u << n;
    auto has = [&](int c) { return ((c < world ? mask >> c : node_mask >> (c - world)) & 1u) != 0; };
    for (int c = 0; c < columns; ++c) {
      uint32_t const bits = __ballot_sync(0xffffffffu, has(c));
      if (lane == 0) s_warp_cnt[warp][c] = __popc(bits);
    }
    __syncthreads();
    if (tid < columns) {  // scan over warps, one thread per column
      int running = s_cnt[tid];
      for (int w = 0; w < kWarps; ++w) {
        s_warp_off[w][tid] = running;
        running += s_warp_cnt[w][tid];
      }
      s_cnt[tid] = running;
    }
    __syncthreads();
    uint32_t const lower = (1u << lane) - 1u;
    for (int c = 0; c < columns; ++c) {
      uint32_t const bits = __ballot_sync(0xffffffffu, has(c));
      if (valid && has(c)) {
        int32_t const pos = s_warp_off[warp][c] + __popc(bits & lower);
        if (c < world)
          p.token_pos[static_cast<std::size_t>(t) * world + c] = pos;
        else
          p.node_pos[static_cast<std::size_t>(t) * nodes + (c - world)] = pos;
      }
    }
    if (valid) p.token_mask[t] = mask;
    __syncthreads();  // the next step rewrites s_warp_cnt
  }

  // 2. this rank's count row for every destination, staged in its window (the puts' source)
  bool const refuse = p.abort || s_bad != 0;
  int const words = p.layout.normal.count_words;
  int const expert_words = p.layout.normal.expert_words;  // the destination's experts, or every expert (every_expert)
  uint64_t const tag = seq << 32;
  auto* const staged = reinterpret_cast<uint64_t*>(p.net.local() + p.layout.hier.count_send);
  for (int i = tid; i < world * words; i += kThreads) {
    int const d = i / words;
    int const w = i % words;
    int32_t value = 0;
    if (w == 0)
      value = p.num_tokens;
    else if (w <= world)
      value = s_cnt[w - 1];
    else if (w <= world + expert_words)
      value = s_cnt[columns + (p.layout.normal.every_expert ? 0 : d * num_local) + (w - 1 - world)];
    else if (w <= world + expert_words + nodes)
      value = s_cnt[world + (w - 1 - world - expert_words)];
    staged[i] = tag | (w == 0 && refuse ? kCountAbort : 0ull) | static_cast<uint32_t>(value);
  }
  __syncthreads();

  // 3. one put and one signal per destination: NVLink inside the node, the network to the other nodes
  auto lsa = p.net.open(transport::Cta{});
  auto net = p.network.open(transport::Cta{}, 0);
  std::size_t const row_bytes = static_cast<std::size_t>(words) * sizeof(uint64_t);
  std::size_t const dst = count_offset(p.layout, parity, world, rank, 0);
  std::size_t const signal = p.layout.hier.count_signal + static_cast<std::size_t>(rank) * sizeof(uint64_t);
  for (int d = 0; d < world; ++d) {
    std::size_t const src = p.layout.hier.count_send + static_cast<std::size_t>(d) * row_bytes;
    if (d / local == own_node)
      lsa.put_signal(d, dst, src, row_bytes, signal, 1);
    else
      net.put_signal(d, dst, src, row_bytes, signal, 1);
  }
  net.flush();
  net.close();
}

// A quantized token's push (as push_quantized_row, one node): the row quantized once in registers, or its pre-quantized
// pieces forwarded, into every destination d of `send` at its final row rows[d] of the own node, and into `staged`
// (this rank's window: the wire row the network carries) for the one bit of `send` outside the own node. nvfp4's
// token scale is the row's (the whole row is one chunk here), given or computed from the row.
template <WireFormat kFormat, int kUnitElems, class Net>
__device__ __forceinline__ void push_hier_quantized_row(HierDispatchParams<Net> const& p, int t, uint32_t send,
                                                        int32_t const* rows, char* staged, WireRowLayout const& wire,
                                                        int lane) {
  using Codec = device::UnitCodec<kFormat, kUnitElems>;
  device::QuantRowInput const in = device::quant_row_input<kFormat, kUnitElems>(p.x, p.x_scales, p.hidden, t);
  float token_scale = 0.0f;
  if constexpr (kFormat == WireFormat::nvfp4)
    token_scale = p.x_scales != nullptr
                      ? p.x_token_scales[t]
                      : wire::nvfp4_token_scale(device::chunk_finite_amax<kUnitElems>(in.x_row, p.hidden, 0, 1, lane));
  int const own_node = p.view.rank / p.local;
  device::push_quantized_chunk<kFormat, kUnitElems, kDispatchUnroll / Codec::kVecs>(
      in, p.hidden, 0, 1, send, token_scale,
      [&](int d) {
        if (d / p.local != own_node)
          return device::QuantRowPlaces{staged, staged + wire.scales_offset,
                                        reinterpret_cast<float*>(staged + wire.token_scale_offset)};
        return delivered_places(p, d, rows[d]);
      },
      lane);
}

// What one CTA of hier_dispatch_kernel keeps in shared memory.
struct HierShared {
  int32_t dest_base[kMaxCudaWorld];
  int32_t row[kWarps][kMaxCudaWorld];
  int32_t fwd_first[kMaxCudaWorld + 1];  // this rail's first record of each source node (fwd_first[nodes]: all)
  int ok;
  uint32_t aborted;
  int last;
  int total;
  int num_recv;
};

// What a warp sent to other ranks, by link (warp-uniform; EpBuffer::link_bytes).
struct LinkCount {
  unsigned long long network_bytes = 0;
  unsigned long long nvlink_bytes = 0;
  unsigned long long network_messages = 0;
};

// a. every source's count row (warp 0; acquire): NVLink's wait for this node's sources, the network's for the rest;
//    s.aborted collects the sources that refuse the call. False (the whole CTA) when a source did not arrive or is
//    out of step (recorded).
template <class Net>
__device__ __forceinline__ bool wait_hier_count_rows(HierDispatchParams<Net> const& p, HierShared& s, uint64_t seq,
                                                     int parity) {
  auto const [world, rank, tid, lane, warp, cta, nodes, local, own_node, local_rank, global_warp, num_warps] =
      hier_ids(p);
  char* const own = p.net.local();
  if (warp == 0) {
    auto lsa = p.net.open(transport::Warp{});
    auto net = p.network.open(transport::Warp{}, global_warp);
    bool ok = true;
    // NOTE: past a failed wait the loop goes on: the later waits stop at once (device_failed), each recording its
    // source if absent, so the error names every missing rank (a whole node), not only the first
    for (int src = 0; src < world; ++src) {
      std::size_t const counter = p.layout.hier.count_signal + static_cast<std::size_t>(src) * sizeof(uint64_t);
      bool const arrived = src / local == own_node ? lsa.wait(p.view, counter, seq, src, WaitPhase::count_exchange)
                                                   : net.wait(p.view, counter, seq, src, WaitPhase::count_exchange);
      ok = ok && arrived;
      if (ok && lane == 0) {
        uint64_t const word0 = device::arch::load_relaxed_sys_u64(count_word(own, p.layout, parity, world, src, 0));
        if ((word0 >> 32) != (seq & 0xffffffffull)) {
          // the row in this parity's slot is another call's: that source ran more (or fewer) dispatches
          device::record_out_of_step(p.view, src, WaitPhase::count_exchange, seq & 0xffffffffull, word0 >> 32);
          s.ok = 0;
        } else if ((word0 & kCountAbort) != 0) {
          s.aborted |= 1u << src;
        }
      }
      ok = __shfl_sync(0xffffffffu, ok && s.ok, 0);
    }
    net.close();
    if (lane == 0 && !ok) s.ok = 0;
  }
  __syncthreads();
  return s.ok != 0;
}

// b. the refusals recorded (as one node's), this rank's base on every destination (rows of lower sources there), and
//    the records per source node of the rail (s.fwd_first; CTA 0 keeps the counts for the combine).
template <class Net>
__device__ __forceinline__ void hier_bases(HierDispatchParams<Net> const& p, HierShared& s, int parity, bool aborted) {
  auto const [world, rank, tid, lane, warp, cta, nodes, local, own_node, local_rank, global_warp, num_warps] =
      hier_ids(p);
  char* const own = p.net.local();
  if (cta == 0 && tid < world && tid != rank && ((s.aborted >> tid) & 1u) != 0 && ((s.aborted >> rank) & 1u) == 0)
    device::record_refusal(p.view, tid, WaitPhase::count_exchange);
  if (tid < world) {
    int32_t base = 0;
    for (int src = 0; src < rank; ++src)
      base += count_value(device::arch::load_relaxed_sys_u64(count_word(own, p.layout, parity, world, src, 1 + tid)));
    s.dest_base[tid] = base;
  }
  if (tid == 0) {
    int32_t total = 0;
    for (int n = 0; n < nodes; ++n) {
      s.fwd_first[n] = total;
      int32_t const count = n == own_node || aborted ? 0
                                                     : count_value(device::arch::load_relaxed_sys_u64(count_word(
                                                           own, p.layout, parity, world, n * local + local_rank,
                                                           1 + world + p.layout.normal.expert_words + own_node)));
      if (cta == 0) p.state->hier.fwd_count[n] = count;
      total += count;
    }
    s.fwd_first[nodes] = total;
  }
  __syncthreads();
}

// c. one token's push (a warp): the node's destinations get the row and metadata in their final rows; every other
//    node that holds the token gets it once, through the network, at its rail: the row once into this rank's window,
//    a record per node, both put to the node's rail at the token's place among its records.
template <typename IdxT, WireFormat kFormat, int kUnitElems, class Net, class Endpoint>
__device__ __forceinline__ void hier_push_token(HierDispatchParams<Net> const& p, HierShared& s, Endpoint& net, int t,
                                                LinkCount& link) {
  auto const [world, rank, tid, lane, warp, cta, nodes, local, own_node, local_rank, global_warp, num_warps] =
      hier_ids(p);
  char* const own = p.net.local();
  int const topk = p.topk;
  std::size_t const row_bytes = static_cast<std::size_t>(p.hidden) * 2;  // a bf16 row of x
  // what crosses the network per token and node: the bf16 row, or the wire row (payload, scales, token scale)
  WireRowLayout const wire = wire::make_row_layout(kFormat, p.hidden);
  std::size_t const wire_bytes = kFormat == WireFormat::bf16 ? row_bytes : wire.row_bytes;
  std::size_t const meta_bytes = p.layout.hier.meta_bytes;
  std::size_t const max_tokens = static_cast<std::size_t>(p.max_tokens);
  uint32_t const own_bits = node_bits(own_node, local);
  std::size_t const meta_row = static_cast<std::size_t>(topk) * 8 + sizeof(int2);  // recv_idx, recv_w, recv_src

  uint32_t const mask = p.token_mask[t];
  int row = -1;
  if (lane < world && ((mask >> lane) & 1u)) {
    row = s.dest_base[lane] + p.token_pos[static_cast<std::size_t>(t) * world + lane];
    if (row >= p.recv_capacity) row = -1;  // past the receiver's capacity: dropped (as on one node)
  }
  uint32_t const send = __ballot_sync(0xffffffffu, row >= 0);
  if (lane < world) s.row[warp][lane] = row;
  __syncwarp();
  if (lane == 0) {
    // the combine's senders of t: the ranks of this node that hold it, and the rail of every other node that does
    uint32_t senders = send & own_bits;
    for (int n = 0; n < nodes; ++n)
      if (n != own_node && (send & node_bits(n, local)) != 0) senders |= 1u << (n * local + local_rank);
    p.hier_mask[t] = senders;
    if (send != mask) p.token_mask[t] = send;
  }
  TokenEntry const entry = token_entry<IdxT>(p, t, lane);
  // c1. this node: metadata (as one node's push) and the row, straight into the final rows
  uint32_t const near = send & own_bits;
  push_metadata(p, t, near, s.row[warp], entry, lane);
  // c2. other nodes (those the layout counted, dropped rows included: the record says -1 there)
  uint32_t far = 0;
  for (int n = 0; n < nodes; ++n)
    if (n != own_node && (mask & node_bits(n, local)) != 0) far |= 1u << n;
  std::size_t const send_row = p.layout.hier.send_rows + static_cast<std::size_t>(t) * wire_bytes;
  auto const* const x_row =
      reinterpret_cast<int4 const*>(static_cast<char const*>(p.x) + static_cast<std::size_t>(t) * row_bytes);
  if constexpr (kFormat == WireFormat::bf16) {
    if (near != 0)
      landing::send_row_chunk<kDispatchUnroll>(
          x_row, 0, p.hidden / 8, near,
          [&](int d) {
            return reinterpret_cast<int4*>(p.net.window(d) + p.layout.normal.recv_x +
                                           static_cast<std::size_t>(s.row[warp][d]) * row_bytes);
          },
          lane);
    if (far != 0) device::copy_16B<true>(own + send_row, x_row, row_bytes, lane, 32);
  } else {
    // one quantization for the own node's destinations and the staged wire row: the staged row stands in the push as
    // the rail of the first other node (a rank outside this node, so never one of `near`)
    uint32_t const stage = far != 0 ? 1u << ((__ffs(far) - 1) * local + local_rank) : 0u;
    if ((near | stage) != 0)
      push_hier_quantized_row<kFormat, kUnitElems>(p, t, near | stage, s.row[warp], own + send_row, wire, lane);
  }
  link.nvlink_bytes += static_cast<unsigned long long>(__popc(near & ~(1u << rank))) * (wire_bytes + meta_row);
  // a row to a rail counts as a row to a rank (its record's rows are control words)
  link.network_bytes += static_cast<unsigned long long>(__popc(far)) * (wire_bytes + meta_row);
  link.network_messages += static_cast<unsigned long long>(__popc(far));
  for (uint32_t m = far; m != 0; m &= m - 1) {
    int const n = __ffs(m) - 1;
    std::size_t const send_meta = p.layout.hier.send_meta + (static_cast<std::size_t>(n) * max_tokens + t) * meta_bytes;
    HierRecord const record = hier_record(own + send_meta, local, topk);
    if (lane == 0) *record.token = t;
    if (lane < local) record.rows[lane] = s.row[warp][n * local + lane];
    if (lane < topk) {
      record.ids[lane] = entry.valid ? static_cast<int32_t>(entry.e) : -1;
      record.weights[lane] = entry.valid ? entry.w : 0.0f;
    }
    __syncwarp();
    int const rail = n * local + local_rank;
    std::size_t const j = static_cast<std::size_t>(p.node_pos[static_cast<std::size_t>(t) * nodes + n]);
    std::size_t const at = static_cast<std::size_t>(own_node) * max_tokens + j;
    net.put(rail, p.layout.hier.fwd_rows + at * wire_bytes, send_row, wire_bytes);
    net.put(rail, p.layout.hier.fwd_meta + at * meta_bytes, send_meta, meta_bytes);
  }
}

// d. rail: the records of this rank's peers on other nodes, once their signals say every put arrived (a CTA-wide
//    bounded wait; false for the whole CTA when one did not), each record's row forwarded to the ranks of its node
//    named in it (NVLink stores of the row and its metadata into their final rows; a wire row split into the
//    delivered payload, scales and token scale, bytes unchanged).
template <WireFormat kFormat, class Net>
__device__ __forceinline__ bool hier_forward(HierDispatchParams<Net> const& p, HierShared const& s, uint64_t seq,
                                             bool aborted, LinkCount& link) {
  auto const [world, rank, tid, lane, warp, cta, nodes, local, own_node, local_rank, global_warp, num_warps] =
      hier_ids(p);
  char* const own = p.net.local();
  int const topk = p.topk;
  int const num_local = p.num_local_experts;
  std::size_t const row_bytes = static_cast<std::size_t>(p.hidden) * 2;
  WireRowLayout const wire = wire::make_row_layout(kFormat, p.hidden);
  std::size_t const wire_bytes = kFormat == WireFormat::bf16 ? row_bytes : wire.row_bytes;
  std::size_t const meta_row = static_cast<std::size_t>(topk) * 8 + sizeof(int2);
  {
    auto rail = p.network.open(transport::Cta{}, cta * kWarps);
    bool ok = true;
    for (int n = 0; n < nodes && ok; ++n) {
      if (n == own_node || p.skip_rail_wait) continue;
      ok = rail.wait(p.view, p.layout.hier.fwd_signal + static_cast<std::size_t>(n) * sizeof(uint64_t),
                     device::arrivals_for(seq), n * local + local_rank, WaitPhase::dispatch_data);
    }
    rail.close();
    if (!ok) return false;
  }
  for (int item = global_warp; !aborted && item < s.fwd_first[nodes]; item += num_warps) {
    auto const [n, at, record] = hier_rail_item(p, own, s.fwd_first, item);
    int const source = n * local + local_rank;
    char const* const fwd_row = own + p.layout.hier.fwd_rows + at * wire_bytes;
    int const t = *record.token;
    int row = -1;
    if (lane < local) {
      row = record.rows[lane];
      if (row >= p.recv_capacity) row = -1;  // never past the buffer (the source already dropped those)
    }
    int32_t const id = lane < topk ? record.ids[lane] : -1;
    float const weight = lane < topk ? record.weights[lane] : 0.0f;
    for (int l = 0; l < local; ++l) {
      int const r = __shfl_sync(0xffffffffu, row, l);
      if (r < 0) continue;
      int const d = own_node * local + l;
      if (d != rank) link.nvlink_bytes += wire_bytes + meta_row;
      char* const dst = p.net.window(d);
      std::size_t const rr = static_cast<std::size_t>(r);
      if (lane < topk) {
        bool const mine = id >= 0 && id / num_local == d;
        reinterpret_cast<int32_t*>(dst + p.layout.normal.recv_idx)[rr * topk + lane] = mine ? id - d * num_local : -1;
        reinterpret_cast<float*>(dst + p.layout.normal.recv_w)[rr * topk + lane] = mine ? weight : 0.0f;
      }
      if (lane == 0) reinterpret_cast<int2*>(dst + p.layout.normal.recv_src)[r] = make_int2(source, t);
      // coherent loads: the network wrote the row during this kernel
      if constexpr (kFormat == WireFormat::bf16) {
        device::copy_16B<false>(dst + p.layout.normal.recv_x + rr * row_bytes, fwd_row, row_bytes, lane, 32);
      } else {
        copy_piece_warp(dst + p.qdst.payload + rr * p.qdst.payload_stride, fwd_row, wire.payload_bytes, lane);
        copy_piece_warp(dst + p.qdst.scales + rr * p.qdst.scales_stride, fwd_row + wire.scales_offset,
                        static_cast<std::size_t>(wire.num_scales) * wire.scale_bytes, lane);
        if (wire.has_token_scale && lane == 0)
          *reinterpret_cast<float*>(dst + p.qdst.token + rr * p.qdst.token_stride) =
              *reinterpret_cast<float const volatile*>(fwd_row + wire.token_scale_offset);
      }
    }
  }
  return true;
}

// e. arrival; the last CTA (s.last) signals every rank of this node, for its own rows and every source it forwarded.
// NOTE: one fence per CTA, as normal/dispatch.cuh: the barrier orders every thread's stores before thread 0's fence.
template <class Net>
__device__ __forceinline__ void hier_signal_rows(HierDispatchParams<Net> const& p, HierShared& s, uint64_t seq) {
  auto const [world, rank, tid, lane, warp, cta, nodes, local, own_node, local_rank, global_warp, num_warps] =
      hier_ids(p);
  __syncthreads();
  if (tid == 0) {
    device::arch::fence_acq_rel_sys();
    unsigned long long const old =
        atomicAdd(reinterpret_cast<unsigned long long*>(&p.state->normal.dispatch_done), 1ull);
    s.last = old == static_cast<unsigned long long>(p.num_ctas - 1);
    if (s.last) {
      device::arch::fence_acq_rel_sys();  // every CTA's rows before the signals
      for (int l = 0; l < local; ++l) {
        int const d = own_node * local + l;
        p.net.store_signal(d, p.layout.normal.data_signal + static_cast<std::size_t>(rank) * sizeof(uint64_t), seq);
        for (int n = 0; n < nodes; ++n)
          if (n != own_node)
            p.net.store_signal(
                d, p.layout.normal.data_signal + static_cast<std::size_t>(n * local + local_rank) * sizeof(uint64_t),
                seq);
      }
    }
  }
  __syncthreads();
}

template <typename IdxT, WireFormat kFormat, int kUnitElems, class Net>
__global__ void __launch_bounds__(kThreads, 1) hier_dispatch_kernel(HierDispatchParams<Net> const p) {
  static_assert((kFormat == WireFormat::bf16) == (kUnitElems == 0), "bf16 rows are copied; quantized rows need a unit");
  __shared__ HierShared s;
  auto const [world, rank, tid, lane, warp, cta, nodes, local, own_node, local_rank, global_warp, num_warps] =
      hier_ids(p);
  auto const [seq, parity] = hier_call(p.state->normal.dispatch_seq);
  if (tid == 0) {
    s.ok = 1;
    s.aborted = 0;
  }
  __syncthreads();

  if (!wait_hier_count_rows(p, s, seq, parity)) return;  // a.
  bool const aborted = s.aborted != 0;                   // the same on every CTA of every rank
  hier_bases(p, s, parity, aborted);                     // b.

  // c. push: warp per token; then every warp's arrival at every other node's rail (the signal covers this warp's
  //    puts to it)
  LinkCount link;
  auto net = p.network.open(transport::Warp{}, global_warp);
  for (int t = global_warp; !aborted && t < p.num_tokens; t += num_warps)
    hier_push_token<IdxT, kFormat, kUnitElems>(p, s, net, t, link);
  for (int n = 0; n < nodes; ++n)
    if (n != own_node)
      net.signal(n * local + local_rank,
                 p.layout.hier.fwd_signal + static_cast<std::size_t>(own_node) * sizeof(uint64_t),
                 device::arrival_share(global_warp, num_warps));
  net.flush();
  net.close();

  if (!hier_forward<kFormat>(p, s, seq, aborted, link)) return;  // d.
  if (lane == 0) {
    atomicAdd(&p.state->hier.bytes_running[0][0], link.network_bytes);
    atomicAdd(&p.state->hier.bytes_running[0][1], link.nvlink_bytes);
    atomicAdd(&p.state->hier.bytes_running[0][2], link.network_messages);
  }

  hier_signal_rows(p, s, seq);  // e.
  // without a receiver pass only the last CTA waits; with one, every CTA waits for every source's rows
  bool const recv_pass = kFormat != WireFormat::bf16 && p.recv_pass != RecvPass::none && !aborted;
  if (!s.last && !recv_pass) return;
  if (!wait_rows(p, s, seq)) return;
  if (recv_pass) {
    if constexpr (kFormat != WireFormat::bf16) run_recv_pass<kFormat>(p, s, parity);
    if (!s.last) return;
    __syncthreads();
  }

  // outputs (normal/dispatch.cuh's step 8; the expert counts, where rows were dropped, counted in place)
  write_dispatch_outputs(p, p.net.local(), parity, aborted, p.expert_counts, s.total);
  __syncthreads();
  if (tid == 0) {
    // every CTA added its bytes before its arrival (fenced): the call's totals
    for (int i = 0; i < 3; ++i) p.state->hier.bytes[0][i] = atomicExch(&p.state->hier.bytes_running[0][i], 0ull);
    p.state->normal.dispatch_done = 0;  // every CTA has arrived
    p.state->normal.dispatch_seq = seq;
  }
}

}  // namespace ferry::cuda_ep
