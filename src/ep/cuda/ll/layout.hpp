// Low-latency mode's memory (ll/dispatch.cuh, ll/combine.cuh, ll/mask.cuh): its areas of the symmetric region, byte
// offsets that are the same on every rank (ll/layout.cpp lays them out), and its words of the EpBuffer's device state.
// "Source" is the sending rank. Host and device includable.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ep/ll_mask_words.hpp"
#include "ferry/ep.hpp"

namespace ferry::cuda_ep {

// Most CTAs of a low-latency grid (its per-CTA sequence words are sized for it).
inline constexpr int kMaxLlCtas = 256;

struct LlLayout {
  std::size_t dispatch_arrivals = 0;   // [world sources] u64: send CTAs of that source finished, over all calls
  std::size_t combine_arrivals = 0;    // [world sources] u64
  std::size_t dispatch_tokens = 0;     // [2 parities][world sources] u64: tokens of the source's call
  std::size_t dispatch_abort = 0;      // [2 parities][world sources] u64: seq of the source's last refused dispatch
  std::size_t combine_abort = 0;       // [2 parities][world senders] u64: seq of the sender's last refused combine
  std::size_t dispatch_meta = 0;       // [2][world][max_tokens] records: topk int32 local ids, topk float weights
  std::size_t dispatch_rows = 0;       // [2][world][max_tokens] dispatch wire rows, row t of source s at (s, t)
  std::size_t combine_rows = 0;        // [2][world][max_tokens] combine wire rows, the row rank d sends back at (d, t)
  std::size_t meta_bytes = 0;          // bytes of one record (topk * 8, 16-byte aligned)
  std::size_t dispatch_row_bytes = 0;  // wire_row_bytes(dispatch_format, hidden) (bf16: hidden * 2)
  std::size_t combine_row_bytes = 0;   // wire_row_bytes(combine_format, hidden)
  // Across nodes only (nodes > 1; empty otherwise): what the ranks of other nodes get is written here first and put
  // from here (the network reads its sources from the window), by parity as the landing zones.
  std::size_t send_rows = 0;     // [2][max_tokens] dispatch wire rows of this rank's tokens bound for other nodes
  std::size_t send_meta = 0;     // [2][world destinations][max_tokens] records for the ranks of other nodes
  std::size_t combine_send = 0;  // [2][world * max_tokens] combine wire rows, by rank-major row, for other nodes
  // The forward route (EpConfig::route() == forward): a row crosses the network once per node, to the rank of the
  // source's local index there (its rail), which places it over NVLink; the combine reduces per node at the rail.
  std::size_t fwd_rows = 0;          // [2][nodes sources][max_tokens] dispatch wire rows the rail received
  std::size_t fwd_meta = 0;          // [2][nodes][max_tokens] their records: topk global ids, topk weights
  std::size_t fwd_tokens = 0;        // [2][nodes] u64: tokens of that node's source of the call
  std::size_t fwd_abort = 0;         // [2][nodes] u64: seq of that source's last refused dispatch
  std::size_t fwd_arrivals = 0;      // [nodes] u64 counter: num_ctas per call from that node's source
  std::size_t partials = 0;          // [2][nodes][local senders][max_tokens] bf16 combine rows to this rail
  std::size_t partial_arrivals = 0;  // [world senders] u64 counter: num_ctas per combine from each node-mate
  std::size_t rail_send = 0;         // [2][nodes][max_tokens] the rail's reduced combine wire rows (put sources)
  // dispatch_arrivals, combine_arrivals, fwd_arrivals, adjacent (the GIN transport's signal range); the words the own
  // node signals by NVLink stores are window words there.
  std::size_t signals = 0;
  uint32_t num_signals = 0;
};

// Low-latency mode's device words, per CTA: calls whose send / receive half this CTA ran (the EpBuffer's num_tokens
// is written by the send half's CTA 0, num_recv by the receive half's CTA of expert 0).
struct LlState {
  uint64_t dispatch_send_seq[kMaxLlCtas];
  uint64_t dispatch_recv_seq[kMaxLlCtas];
  uint64_t combine_send_seq[kMaxLlCtas];
  uint64_t combine_recv_seq[kMaxLlCtas];
  // The last dispatch (its receive half's seq) whose receive half dropped an entry past expert_capacity (0: none):
  // the combine that follows it refuses (LlCombineParams::refuse_after_drop).
  uint64_t dropped_seq;
  // Rank masking (EpConfig::rank_masking; ll/mask.cuh): the mask and its counts (the kernels without masking never
  // read it).
  detail::LlMaskWords mask;
};

class AreaPacker;

// The low-latency areas of a world of `world` ranks on `nodes` nodes, appended to `areas`.
void lay_out_ll(LlLayout& layout, AreaPacker& areas, EpConfig const& config, int world, int nodes);

// Rank masking (EpConfig::rank_masking, low-latency mode): where the agreement's words are in a layout that
// lay_out_ll made with masking on (the region's last area, so that the layout is the same with masking off).
// A source's set of ranks is rank_words(world) u64 words, word i = tag << 32 | ranks 32 i .. 32 i + 31 (each word
// carries the tag, so a reader takes a set whose words all carry the one it waits for, never half of two), stored
// ll_mask_set_stride(world) words apart (a whole number of 16 bytes: one put carries a set).
// arrive: [world sources][stride] (tag: the epoch; the ranks: the source's request); estimates: [kMaskEstimateSlots
// rounds][2 parities][world sources][stride] (tag: epoch << 1 | decided; the ranks the source holds for the call);
// outbox: [2 parities][1 + kMaskEstimateSlots][stride] this rank's own sets (its arrival, then each round's
// estimate), the source of the puts to the ranks of other nodes.
// Across nodes a source of another node puts its set through the network with a signal that counts it, in
// arrive_signals ([world sources]: one per agreement it took part in) and estimate_signals ([kMaskEstimateSlots][world
// sources]: the agreement of the round's last set), adjacent: one signal range, `signals` .. + num_signals words.
struct LlMaskArea {
  std::size_t arrive;
  std::size_t estimates;
  std::size_t outbox;
  std::size_t arrive_signals;
  std::size_t estimate_signals;
  std::size_t signals;
  uint32_t num_signals;
};
// The counters of a world that clear_mask puts back in step through the network (ll/mask.cuh): the legs' dispatch and
// combine arrivals, the agreement's arrivals and its estimates of each round.
inline constexpr int kLlMaskNetworkCounters = 3 + detail::kMaskEstimateSlots;
constexpr int ll_mask_set_stride(int world) {
  return (world + 63) / 64 * 2;  // rank_words(world), rounded up to an even count
}
std::size_t ll_mask_area_bytes(int world);
// region_total: the symmetric region's size (SymLayout::total).
LlMaskArea ll_mask_area(std::size_t region_total, int world);

}  // namespace ferry::cuda_ep
