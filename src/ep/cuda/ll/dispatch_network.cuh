// The low-latency dispatch's steps across nodes (ll/dispatch.cuh runs them with a network transport; one node compiles
// them away): the direct route's puts to the ranks of other nodes, the forward route's puts to each node's rail and
// the rail's placement of what it received, and the receive half's waits for the sources of other nodes. Each reaches
// the other nodes only through the transport seam (Net: Emulated on one host, Gin on a cluster).
#pragma once

#include "ep/cuda/ll/dispatch_common.cuh"

namespace ferry::cuda_ll {

// Across nodes, after the send loop (every thread of the CTA, past the barrier that ends it): what this CTA has for
// the ranks of other nodes, staged in this rank's window by the loop, put from there, then its arrival there. Warp w
// takes the ranks j = w, w + kWarps, ... of the other nodes, each over every item of the CTA (the loop's items, in
// its order): a record per token (every rank gets every record), the row whole with its chunk 0 when the rank holds
// one of the token's experts (across nodes a row's chunks are in one CTA, in every format), the token count (CTA 0)
// and the abort word (a refusing CTA). One endpoint carries all of it to that rank, so its signal (+1 per CTA and
// call, as over NVLink) covers it. The staging areas alternate by parity, and a source reuses one at call n + 2 only
// after its receive of n + 1, which waited for every rank's send of n + 1, each after that rank's receive of n, which
// waited for this rank's puts of n: so no put of n still reads the area then. kMasking: a masked rank gets nothing
// (no record, row, count, abort word or arrival), as on this node.
template <typename IdxT, WireFormat kFormat, bool kMasking, class Net>
__device__ __forceinline__ void ll_dispatch_send_network(LlDispatchParams const& p, Net const& network, int parity,
                                                         uint64_t seq, bool refused, int chunks, int items) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const total_warps = p.num_ctas * kWarps;
  std::size_t const wire = p.layout.ll.dispatch_row_bytes;
  std::size_t const record = p.layout.ll.meta_bytes;
  std::size_t const max_tokens = static_cast<std::size_t>(p.max_tokens);
  auto const* topk_idx = static_cast<IdxT const*>(p.topk_idx);
  LiveRanks<kMasking> const live = live_ranks<kMasking>(p);
  auto ep = network.open(transport::Warp{}, cta * kWarps + warp);
  for (int j = warp; j < world - p.local; j += kWarps) {
    int const d = remote_rank(p, j);
    if (!live.has(d)) continue;
    int64_t const lo = static_cast<int64_t>(d) * p.num_local_experts;
    for (int base = cta * kWarps; base < items; base += total_warps) {
      for (int w = 0; w < kWarps && base + w < items; ++w) {
        int const item = base + w;
        int const t = item / chunks;
        int const chunk = item % chunks;
        std::size_t const slot = landing::slot_index(parity, world, rank, p.max_tokens, t);
        int64_t const e =
            lane < p.topk ? static_cast<int64_t>(__ldg(topk_idx + static_cast<std::size_t>(t) * p.topk + lane)) : -1;
        if (__any_sync(0xffffffffu, e >= lo && e < lo + p.num_local_experts)) {
          std::size_t const from = p.layout.ll.send_rows + (parity * max_tokens + t) * wire;
          std::size_t const to = p.layout.ll.dispatch_rows + slot * wire;
          if (chunk == 0) ep.put(d, to, from, wire);
        }
        if (chunk == 0)
          ep.put(d, p.layout.ll.dispatch_meta + slot * record,
                 p.layout.ll.send_meta + ((parity * static_cast<std::size_t>(world) + d) * max_tokens + t) * record,
                 record);
      }
    }
    std::size_t const word = (static_cast<std::size_t>(parity) * world + rank) * sizeof(uint64_t);
    if (cta == 0) ep.put_value(d, p.layout.ll.dispatch_tokens + word, static_cast<uint64_t>(p.num_tokens));
    if (refused) ep.put_value(d, p.layout.ll.dispatch_abort + word, seq);
    ep.signal(d, p.layout.ll.dispatch_arrivals + static_cast<std::size_t>(rank) * sizeof(uint64_t), 1);
  }
  ep.close();
}

// A token's record with its global expert ids (-1: masked or bad) and weights, for the rails of the forward route
// (warp-wide; e and w as token_destination left them, lane k < topk holding entry k).
__device__ __forceinline__ void write_global_record(char* at, int topk, int64_t e, float w, int lane) {
  int const k = (lane < topk ? lane : lane - topk) & 31;
  int const e_k = static_cast<int>(__shfl_sync(0xffffffffu, static_cast<long long>(e), k));
  float const w_k = __shfl_sync(0xffffffffu, w, k);
  if (lane < topk)
    reinterpret_cast<int32_t*>(at)[lane] = e_k;
  else if (lane < 2 * topk)
    reinterpret_cast<float*>(at)[lane] = w_k;
}

// The forward route's network leg of a send half (ll_dispatch_send_network's scheme, per node instead of per rank):
// warp w takes the nodes j = w, w + kWarps, ... other than this rank's; to that node's rail (the rank of this rank's
// local index there) it puts the CTA's records of global ids (every token: the rail places a record on every rank of
// its node) and the rows of the tokens that node holds (once per node), into the rail's forward area at this node's
// place, then the token count and the abort word, then +1 on the rail's counter of this node.
template <typename IdxT, WireFormat kFormat, class Net>
__device__ __forceinline__ void ll_dispatch_send_forward(LlDispatchParams const& p, Net const& network, int parity,
                                                         uint64_t seq, bool refused, int chunks, int items) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const total_warps = p.num_ctas * kWarps;
  int const own_node = rank / p.local;
  std::size_t const wire = p.layout.ll.dispatch_row_bytes;
  std::size_t const record = p.layout.ll.meta_bytes;
  std::size_t const max_tokens = static_cast<std::size_t>(p.max_tokens);
  std::size_t const place = (static_cast<std::size_t>(parity) * p.nodes + own_node) * max_tokens;  // at the rail
  auto const* topk_idx = static_cast<IdxT const*>(p.topk_idx);
  auto ep = network.open(transport::Warp{}, cta * kWarps + warp);
  for (int j = warp; j < p.nodes - 1; j += kWarps) {
    int const n = j < own_node ? j : j + 1;
    int const rail = n * p.local + rank % p.local;
    int64_t const lo = static_cast<int64_t>(n) * p.local * p.num_local_experts;
    int64_t const hi = lo + static_cast<int64_t>(p.local) * p.num_local_experts;
    for (int base = cta * kWarps; base < items; base += total_warps) {
      for (int w = 0; w < kWarps && base + w < items; ++w) {
        int const item = base + w;
        int const t = item / chunks;
        int const chunk = item % chunks;
        int64_t const e =
            lane < p.topk ? static_cast<int64_t>(__ldg(topk_idx + static_cast<std::size_t>(t) * p.topk + lane)) : -1;
        if (__any_sync(0xffffffffu, e >= lo && e < hi)) {
          std::size_t const from = p.layout.ll.send_rows + (parity * max_tokens + t) * wire;
          std::size_t const to = p.layout.ll.fwd_rows + (place + t) * wire;
          if (chunk == 0) ep.put(rail, to, from, wire);
        }
        if (chunk == 0)
          ep.put(rail, p.layout.ll.fwd_meta + (place + t) * record,
                 p.layout.ll.send_meta + ((parity * static_cast<std::size_t>(world) + rank) * max_tokens + t) * record,
                 record);
      }
    }
    std::size_t const word = (static_cast<std::size_t>(parity) * p.nodes + own_node) * sizeof(uint64_t);
    if (cta == 0) ep.put_value(rail, p.layout.ll.fwd_tokens + word, static_cast<uint64_t>(p.num_tokens));
    if (refused) ep.put_value(rail, p.layout.ll.fwd_abort + word, seq);
    ep.signal(rail, p.layout.ll.fwd_arrivals + static_cast<std::size_t>(own_node) * sizeof(uint64_t), 1);
  }
  ep.close();
}

// The rail's part of the forward route, at the start of a receive half (every thread of the CTA): for every other
// node m, once its source (the rank of this rank's local index there) has arrived through the network, the CTA's
// share of that source's tokens (token t: global warp t % (num_ctas * kWarps)) placed on every rank of this node as
// the source would have stored them on one node: its record (local ids) into each rank's landing slot (source, t),
// its row into the slots of the ranks holding it; then (CTA 0) the source's token count and abort word on every rank
// of the node, and +1 on each rank's arrival counter of that source (release, after the barrier): num_ctas per call,
// as a source of the node adds. Which ranks hold each token is kept for the combine (fwd_mask, fwd_num). Returns false
// (for the whole CTA) when a source did not arrive (the timeout is recorded).
template <class Net>
__device__ __forceinline__ bool ll_dispatch_forward(LlDispatchParams const& p, Net const& network, int parity,
                                                    uint64_t seq) {
  __shared__ int s_fwd_ok;
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const own_node = rank / p.local;
  int const first = own_node * p.local;  // this node's first rank
  int const topk = p.topk;
  std::size_t const wire = p.layout.ll.dispatch_row_bytes;
  std::size_t const record = p.layout.ll.meta_bytes;
  std::size_t const max_tokens = static_cast<std::size_t>(p.max_tokens);
  if (tid == 0) s_fwd_ok = 1;
  __syncthreads();
  if (tid < p.nodes && tid != own_node &&
      !wait_network(p, network, p.layout.ll.fwd_arrivals, tid, seq * static_cast<uint64_t>(p.num_ctas),
                    WaitPhase::ll_dispatch))
    s_fwd_ok = 0;
  __syncthreads();
  if (!s_fwd_ok) return false;
  int const total_warps = p.num_ctas * kWarps;
  for (int m = 0; m < p.nodes; ++m) {
    if (m == own_node) continue;
    int const source = m * p.local + rank % p.local;
    std::size_t const place = (static_cast<std::size_t>(parity) * p.nodes + m) * max_tokens;
    int const n = static_cast<int>(reinterpret_cast<uint64_t const volatile*>(
        p.net.local() + p.layout.ll.fwd_tokens)[static_cast<std::size_t>(parity) * p.nodes + m]);
    for (int t = cta * kWarps + warp; t < n; t += total_warps) {
      // the record: lane k < topk its global id k, lane topk + k its weight k
      char const* const rec = p.net.local() + p.layout.ll.fwd_meta + (place + t) * record;
      int const k = (lane < topk ? lane : lane - topk) & 31;
      int64_t const e = lane < 2 * topk ? static_cast<int64_t>(reinterpret_cast<int32_t const volatile*>(rec)[k]) : -1;
      float const w = lane < 2 * topk ? reinterpret_cast<float const volatile*>(rec)[topk + k] : 0.0f;
      bool const valid = lane < topk && e >= 0 && e < p.num_experts;
      int const dest = valid ? static_cast<int>(e / p.num_local_experts) : -1;
      uint32_t const here = __reduce_or_sync(
          0xffffffffu, dest >= first && dest < first + p.local ? 1u << (dest - first) : 0u);  // local ranks holding t
      std::size_t const slot = landing::slot_index(parity, world, source, p.max_tokens, t);
      // records on every rank of the node
      landing::write_records_where(
          first, first + p.local, topk, p.num_local_experts, dest, e, w, lane, [](int) { return true; },
          [&](int d) { return p.net.window(d - first) + p.layout.ll.dispatch_meta + slot * record; });
      // the row into each holding rank's slot: loaded once, stored to each
      // (wire rows are 16-byte multiples; coherent loads: the network wrote the row during this kernel)
      auto const* src = reinterpret_cast<int4 const*>(p.net.local() + p.layout.ll.fwd_rows + (place + t) * wire);
      for (std::size_t i = lane; i < wire / 16; i += 32) {
        int4 const v = device::arch::load_v4(src + i);
        for (uint32_t h = here; h != 0; h &= h - 1)
          device::arch::store_na_v4(
              reinterpret_cast<int4*>(p.net.window(__ffs(h) - 1) + p.layout.ll.dispatch_rows + slot * wire) + i, v);
      }
      if (lane == 0) p.fwd_mask[static_cast<std::size_t>(m) * max_tokens + t] = here;
    }
    if (cta == 0 && tid < p.local) {  // thread l: this node's l-th rank
      std::size_t const word = static_cast<std::size_t>(parity) * world + source;
      reinterpret_cast<uint64_t volatile*>(p.net.window(tid) + p.layout.ll.dispatch_tokens)[word] =
          static_cast<uint64_t>(n);
      if (reinterpret_cast<uint64_t const volatile*>(
              p.net.local() + p.layout.ll.fwd_abort)[static_cast<std::size_t>(parity) * p.nodes + m] == seq)
        reinterpret_cast<uint64_t volatile*>(p.net.window(tid) + p.layout.ll.dispatch_abort)[word] = seq;
    }
    if (cta == 0 && tid == 0) p.fwd_num[m] = n;
  }
  // the arrivals: the barrier orders every thread's stores before the release adds (cumulative over them)
  __syncthreads();
  if (tid < p.local)
    for (int m = 0; m < p.nodes; ++m)
      if (m != own_node)
        p.net.add_signal(tid,
                         p.layout.ll.dispatch_arrivals + static_cast<std::size_t>(m * p.local + rank % p.local) * 8, 1);
  return true;
}

// The sources of other nodes of a receive half: their arrivals are waited for through the network. kMasking: a
// masked source (of any node) is not waited for and lands nothing.
template <class Net, bool kMasking = false>
struct NetworkSources {
  LlParams const& p;
  Net const& network;
  std::size_t counters;
  WaitPhase phase;
  LiveRanks<kMasking> live;
  __device__ __forceinline__ bool of(int s) const { return !same_node(p, s); }
  __device__ __forceinline__ bool wait(int s, uint64_t least) const {
    return wait_network(p, network, counters, s, least, phase);
  }
  __device__ __forceinline__ bool skip(int s) const { return !live.has(s); }
};

}  // namespace ferry::cuda_ll
