// The expert-major layout (ref::expert_layout), one algorithm for every kernel that builds it: the low-latency
// dispatch (ll/dispatch.cuh: the landed records in its receive half, this rank's own tokens in its send half) and
// normal mode's expand (normal/expand.cuh: the rank-major rows the dispatch received). The caller says where the records
// come from (load(r) -> HitRecord, r in the scan's order, which must be the layout's order: each expert's slots follow
// its hits in that order) and what to do with each slot and each window of hits; this file holds the rest.
//
//  1. ordered scan (scan_records): every CTA scans the records kThreads at a time with a CTA scan (landing.cuh): a
//     record is present when one of its ids is local; its hits (its entries (record, k) of a local expert, k
//     ascending) are numbered consecutively in the scan's order;
//  2. share (cta_share): CTA c of C takes the hits [c H / C, (c + 1) H / C) of the H hits (spread evenly over the
//     grid: with one CTA per expert, the CTA of the busiest expert, about twice the mean rows with random routing,
//     set the leg's length; docs/design-notes.md);
//  3. windows of at most kThreads hits of the share (run_windows): the caller's fill puts the window's hits into
//     shared memory, and at the first fill counts each expert's hits before the share (s_before: the share's first
//     slot of each expert);
//  4. slots (assign_slots): one warp gives each hit of the window, in order, the next slot of its expert: exactly
//     ref::expert_layout, no global atomics, no grid-wide step;
//  5. copy (copy_window_bf16 for bf16 rows): each row loaded once per window and stored to each of its hits' slots
//     (a row's hits are consecutive), split over the warps when the window has fewer rows than warps.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/device/arch_sm90.cuh"
#include "comm/device/memory.cuh"
#include "ep/cuda/landing.cuh"
#include "ep/cuda/params.cuh"
#include "ferry/ep.hpp"

namespace ferry::cuda_ep {

// A row with its local expert ids as a thread holds it during a step of an ordered scan: an LL landed record
// (receive half), one of this rank's tokens (LL send half) or a received row (normal mode's expand).
struct HitRecord {
  int r = 0;                        // its index in the scan's order
  int landing = 0;                  // where its row is: LL landed: landing row (source * max_tokens + token); LL own:
                                    // the token; normal: the rank-major row
  int32_t const* record = nullptr;  // LL landed: the record (its weights follow the ids)
  int32_t ids[kMaxTopk];            // local expert ids, -1 for another rank's expert and past topk
  bool present = false;             // one of its ids is local
  int hits = 0;                     // its local ids (entries of this rank's experts)
};

__device__ __forceinline__ void count_hits(HitRecord& rec) {
#pragma unroll
  for (int k = 0; k < kMaxTopk; ++k) {
    rec.present |= rec.ids[k] >= 0;
    rec.hits += rec.ids[k] >= 0;
  }
}

// A hit of a CTA's current window: entry (row, k) of local expert `expert`, its row at `landing` (HitRecord); `row`:
// its rank-major row where the caller needs it.
struct WindowHit {
  int32_t expert;
  int32_t landing;
  int32_t row;
  int32_t k;
};

// Shared memory of an expansion (the two halves of the LL one-kernel leg use it in turn).
struct ExpandShared {
  landing::ScanShared<kWarps> scan;
  WindowHit hit[kThreads];
  int32_t slot[kThreads];
  int32_t group[kThreads];  // first window entry of each row the window touches
  int32_t groups;
  int32_t marks[2];  // LL receive half: the hits of the sources below this rank, and up to the end of its own
};

// Bytes of dynamic shared memory of a kernel that builds the layout (LL dispatch, normal-mode expand): per local
// expert, its hits before the CTA's window and all its hits.
__host__ __device__ constexpr std::size_t expand_smem_bytes(int num_local_experts) {
  return static_cast<std::size_t>(num_local_experts) * 2 * sizeof(int32_t);
}

// The ordered scan over `count` records, kThreads per step: visit(record, its index among the present records (LL:
// its rank-major row), index of its first hit)
// for each thread's record of each step (meaningful when it is present; the first hit also when it is not). Returns
// the totals. Every thread of the CTA calls it.
struct ScanTotals {
  int rows;
  int hits;
};

template <typename Load, typename Visit>
__device__ __forceinline__ ScanTotals scan_records(ExpandShared& s, int count, Load load, Visit visit) {
  int const tid = static_cast<int>(threadIdx.x);
  ScanTotals totals{0, 0};
  for (int base = 0; base < count; base += kThreads) {
    HitRecord const rec = load(base + tid);
    landing::ScanOffsets const step = landing::scan_step<true>(rec.present, rec.hits, s.scan, tid >> 5, tid & 31);
    visit(rec, totals.rows + step.row, totals.hits + step.first_hit);
    totals.rows += step.rows;
    totals.hits += step.hits;
    __syncthreads();  // the scan words are reused by the next step
  }
  return totals;
}

// Slots of the window's n hits, in window order, by the last warp (an expert's next slot follows its previous hit;
// the count of its hits before the window is s_before[e], which this advances), and the window's groups (runs of hits
// of one row). on_slot(hit, slot) for each hit. The caller's barriers come before and after.
template <typename OnSlot>
__device__ __forceinline__ void assign_slots(ExpandShared& s, int32_t* s_before, int n, OnSlot on_slot) {
  int const lane = static_cast<int>(threadIdx.x) & 31;
  if ((static_cast<int>(threadIdx.x) >> 5) != kWarps - 1) return;
  int groups = 0;
  uint32_t const lower = (1u << lane) - 1u;
  for (int base = 0; base < n; base += 32) {
    int const j = base + lane;
    bool const valid = j < n;
    WindowHit const hit = valid ? s.hit[j] : WindowHit{-1, -1, 0, 0};
    uint32_t const same = __match_any_sync(0xffffffffu, hit.expert);
    int const slot = valid ? s_before[hit.expert] + __popc(same & lower) : 0;
    __syncwarp();
    if (valid && (same >> lane) == 1u) s_before[hit.expert] += __popc(same);  // the expert's last lane here
    bool const starts = valid && (j == 0 || s.hit[j - 1].landing != hit.landing);
    uint32_t const starts_mask = __ballot_sync(0xffffffffu, starts);
    if (starts) s.group[groups + __popc(starts_mask & lower)] = j;
    groups += __popc(starts_mask);
    if (valid) {
      s.slot[j] = slot;
      on_slot(hit, slot);
    }
    __syncwarp();
  }
  if (lane == 0) s.groups = groups;
}

// The window's bf16 rows into their slots as items (group, chunk) over the CTA's warps: each row loaded once (from
// src_of(landing): kNc for rows no thread writes during this kernel, coherent for rows landed during it) and stored
// to each of its hits' slots below the capacity; a row split over the warps when the window has fewer rows than
// warps. Params: any with expert_x, expert_slots and hidden (LlDispatchParams, ExpandParams).
template <bool kNc, typename Params, typename SrcOf>
__device__ __forceinline__ void copy_window_bf16(Params const& p, ExpandShared const& s, int n, SrcOf src_of) {
  int const lane = static_cast<int>(threadIdx.x) & 31;
  int const warp = static_cast<int>(threadIdx.x) >> 5;
  int const slots = p.expert_slots;
  int const row_vecs = p.hidden / 8;
  int const groups = s.groups;
  int const chunks = device::chunks_per_row(groups, kWarps, row_vecs);
  for (int item = warp; item < groups * chunks; item += kWarps) {
    int const g = item / chunks;
    int const j0 = s.group[g];
    int const j1 = g + 1 < groups ? s.group[g + 1] : n;
    int4 const* const src = src_of(s.hit[j0].landing);
    auto const [v_begin, v_end] = device::chunk_range(row_vecs, item % chunks, chunks);
    for (int i = v_begin + lane; i < v_end; i += 32 * landing::kCopyUnroll) {
      int4 v[landing::kCopyUnroll];
#pragma unroll
      for (int u = 0; u < landing::kCopyUnroll; ++u)
        if (i + u * 32 < v_end)
          v[u] = kNc ? device::arch::load_nc_v4(src + i + u * 32) : device::arch::load_v4(src + i + u * 32);
      for (int j = j0; j < j1; ++j) {
        if (s.slot[j] >= slots) continue;  // past expert_capacity (dropped; the caller counts it in on_slot)
        auto* const d =
            static_cast<int4*>(p.expert_x) + (static_cast<std::size_t>(s.hit[j].expert) * slots + s.slot[j]) * row_vecs;
#pragma unroll
        for (int u = 0; u < landing::kCopyUnroll; ++u)
          if (i + u * 32 < v_end) device::arch::store_na_v4(d + i + u * 32, v[u]);
      }
    }
  }
}

// Runs the windows of at most kThreads hits of [s0, s1) (a CTA's share; one window when the grid is the default
// one): fill(w0, w1, first) puts the hits [w0, w1) into s.hit (and, first, counts each expert's hits before w0 into
// s_before), then the slots, then copy(n). The first fill is peeled so that registers it reads can die after it.
template <typename Fill, typename OnSlot, typename Copy>
__device__ __forceinline__ void run_windows(ExpandShared& s, int32_t* s_before, int s0, int s1, Fill fill,
                                            OnSlot on_slot, Copy copy) {
  int w0 = s0;
  int w1 = min(s0 + kThreads, s1);
  fill(w0, w1, true);
  for (;;) {
    __syncthreads();
    assign_slots(s, s_before, w1 - w0, on_slot);
    __syncthreads();
    copy(w1 - w0);
    w0 += kThreads;
    if (w0 >= s1) break;
    __syncthreads();  // the window's shared words are reused by the next window
    w1 = min(w0 + kThreads, s1);
    fill(w0, w1, false);
  }
}

// The part [c * total / C, (c + 1) * total / C) of `total` hits that CTA c of C takes, from `begin`.
struct Share {
  int begin;
  int end;
};
__device__ __forceinline__ Share cta_share(int begin, int total, int cta, int ctas) {
  return {begin + static_cast<int>(static_cast<int64_t>(total) * cta / ctas),
          begin + static_cast<int>(static_cast<int64_t>(total) * (cta + 1) / ctas)};
}

// The whole layout for records whose scan order is the layout's order (hit j of the scan is hit j of
// ref::expert_layout): the hits in all (one scan; a single step keeps its records in registers for the first fill),
// this CTA's share of them (CTA cta of ctas), its windows. load(r): record r (HitRecord, r up to count rounded up to
// kThreads: past count, no hits); on_record(rec): each record of the scan once, at the first fill (also past count
// and not present: the caller filters); on_slot(hit, slot) and copy(n) as run_windows. s_before: zeroed by the
// caller before a barrier (the scan's own barriers come before the first count). Every thread of the CTA calls it.
template <typename Load, typename OnRecord, typename OnSlot, typename Copy>
__device__ __forceinline__ void expand_records(ExpandShared& s, int32_t* s_before, int count, int cta, int ctas,
                                               Load load, OnRecord on_record, OnSlot on_slot, Copy copy) {
  int const tid = static_cast<int>(threadIdx.x);
  bool const one_step = count <= kThreads;
  HitRecord const mine = one_step ? load(tid) : HitRecord{};
  int hits = 0;
  landing::ScanOffsets first_step{0, 0, 0, 0};
  if (one_step) {
    first_step = landing::scan_step<true>(mine.present, mine.hits, s.scan, tid >> 5, tid & 31);
    hits = first_step.hits;
  } else {
    hits = scan_records(s, count, load, [](HitRecord const&, int, int) {}).hits;
  }
  Share const share = cta_share(0, hits, cta, ctas);
  bool first_fill = true;
  auto const fill = [&](int w0, int w1, bool first) {
    auto const visit = [&](HitRecord const& rec, int, int first_hit) {
      if (first_fill) on_record(rec);
      if (!rec.present) return;
      int j = first_hit;
#pragma unroll
      for (int k = 0; k < kMaxTopk; ++k) {
        int const e = rec.ids[k];
        if (e < 0) continue;
        if (first && j < w0) atomicAdd(&s_before[e], 1);
        if (j >= w0 && j < w1) s.hit[j - w0] = WindowHit{e, rec.landing, 0, k};
        ++j;
      }
    };
    if (first && one_step)
      visit(mine, 0, first_step.first_hit);
    else
      scan_records(s, count, load, visit);
    first_fill = false;
  };
  run_windows(s, s_before, share.begin, share.end, fill, on_slot, copy);
}

}  // namespace ferry::cuda_ep
