// Quantizing push of one chunk of a row: the pieces of a quantized wire row (payload units, block scales, nvfp4's
// token scale) stored straight into their places on every destination of a mask, from one load of the caller's row.
// Normal dispatch (normal/dispatch.cuh: the pieces into the delivered buffers) and LL dispatch (ll/dispatch.cuh: into a wire
// row of the landing zone) both push this way; they differ in the places (a callback) and in how they split a row
// into chunks. Bytes and values are UnitCodec's, hence quantize_row_warp's and the host codec's. CtaRowMax meets a
// row's nvfp4 amax over the CTA's warps that hold its chunks (LL dispatch and LL combine).
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/device/bits.cuh"
#include "comm/device/work_items.hpp"
#include "wire/device_unit_codec.cuh"

namespace ferry::device {

// The caller's row as the push reads it: bf16 elements to quantize, or pre-quantized pieces to forward.
struct QuantRowInput {
  int4 const* x_row = nullptr;    // bf16 row (null: pre-quantized); read-only for the kernel's lifetime
  char const* payload = nullptr;  // pre-quantized: the row's payload
  char const* scales = nullptr;   // pre-quantized: the row's scale elements, row-major
};

// Row t of the caller's input: x holds bf16 rows, or (x_scales non-null) pre-quantized payload rows of the format with
// their row-major scale elements in x_scales.
template <WireFormat kFormat, int kUnitElems>
__device__ __forceinline__ QuantRowInput quant_row_input(void const* x, void const* x_scales, int hidden, int t) {
  using Codec = UnitCodec<kFormat, kUnitElems>;
  QuantRowInput in;
  if (x_scales != nullptr) {
    std::size_t const payload_bytes = static_cast<std::size_t>(hidden / kUnitElems) * Codec::kPieceBytes;
    std::size_t const scale_bytes =
        static_cast<std::size_t>(hidden / Codec::kTraits.block_elems) * Codec::kTraits.scale_bytes;
    in.payload = static_cast<char const*>(x) + static_cast<std::size_t>(t) * payload_bytes;
    in.scales = static_cast<char const*>(x_scales) + static_cast<std::size_t>(t) * scale_bytes;
  } else {
    in.x_row = static_cast<int4 const*>(x) + static_cast<std::size_t>(t) * (hidden / 8);
  }
  return in;
}

// Where a destination's copy of the row goes (any of them may be a peer's memory).
struct QuantRowPlaces {
  char* payload;  // the row's payload (unit u at u * kPieceBytes)
  char* scales;   // its scale elements, row-major
  float* token;   // nvfp4: its token scale
};

// Scale groups of a row: the unit runs that a chunk boundary may not split (a scale block's lanes stay in one warp).
template <WireFormat kFormat, int kUnitElems>
__host__ __device__ constexpr int scale_groups(int hidden) {
  return hidden / kUnitElems / UnitCodec<kFormat, kUnitElems>::kLanesPerBlock;
}

// nvfp4: the largest |x| over the finite elements of chunk `chunk` of `chunks` of a bf16 row (the chunking of
// push_quantized_chunk), reduced over the warp. A row's token scale comes from the max over its chunks.
template <int kUnitElems>
__device__ __forceinline__ float chunk_finite_amax(int4 const* x_row, int hidden, int chunk, int chunks, int lane) {
  constexpr int kVecs = kUnitElems / 8;
  ChunkRange const groups = chunk_range(scale_groups<WireFormat::nvfp4, kUnitElems>(hidden), chunk, chunks);
  // 8 loads per lane in flight: one at a time, a 7168-wide row took 28 dependent round trips
  return wire_detail::row_finite_amax_warp<__nv_bfloat16, true, 8>(x_row + groups.begin * kVecs,
                                                                    (groups.end - groups.begin) * kVecs, lane);
}

// A row's value met over the warps of one CTA that hold its chunks (nvfp4: the max of the chunks' amaxes, which
// gives the token scale every block scale needs). Used inside a loop whose steps every warp of the CTA runs: per step
// each warp posts its value (already reduced over its lanes) and, after one barrier, reads the max over its row's
// warps [first_warp, first_warp + num_warps). The words alternate by step, so one barrier a step suffices: a warp
// writes a step's words only after every warp has passed the previous step's barrier, past its reads of them.
template <int kCtaWarps>
struct CtaRowMax {
  float words[2][kCtaWarps];

  // Every thread of the CTA calls it once per step (a barrier).
  __device__ __forceinline__ float meet(int step, float warp_value, int first_warp, int num_warps) {
    int const warp = static_cast<int>(threadIdx.x) >> 5;
    if ((threadIdx.x & 31) == 0) words[step & 1][warp] = warp_value;
    __syncthreads();
    float m = 0.0f;
    for (int w = first_warp; w < first_warp + num_warps; ++w) m = fmaxf(m, words[step & 1][w]);
    return m;
  }
};

// nvfp4: the token scale of the row (row `row` of x) whose chunk `chunk` of `chunks` this warp holds, in a send loop
// whose row chunks all sit in one CTA (cta_chunks_per_row): given (x_token_scales non-null: pre-quantized input), or
// the max of the row's chunks' amaxes, met over the CTA's warps that hold them (s_amax). Every thread of the CTA calls
// it once per step of the loop (a barrier when quantized here); valid: this warp has an item this step.
template <int kUnitElems, int kCtaWarps>
__device__ __forceinline__ float cta_chunk_token_scale(void const* x, float const* x_token_scales, int hidden, int row,
                                                       CtaRowMax<kCtaWarps>& s_amax, int step, int chunk, int chunks,
                                                       bool valid) {
  if (x_token_scales != nullptr) return valid ? __ldg(x_token_scales + row) : 0.0f;
  int const lane = static_cast<int>(threadIdx.x) & 31;
  int const warp = static_cast<int>(threadIdx.x) >> 5;
  float const amax =
      valid ? chunk_finite_amax<kUnitElems>(static_cast<int4 const*>(x) + static_cast<std::size_t>(row) * (hidden / 8),
                                            hidden, chunk, chunks, lane)
            : 0.0f;
  return wire::nvfp4_token_scale(s_amax.meet(step, amax, warp - chunk, chunks));
}

// Pushes chunk `chunk` of `chunks` of a row (the scale groups chunk_range gives it) to every destination d of `send`
// (a 32- or 64-bit set, device/bits.cuh),
// at places_of(d) (QuantRowPlaces): quantized unit by unit (kInFlight units per lane loaded before the conversions),
// or forwarded piece by piece when pre-quantized; chunk 0 also stores nvfp4's token_scale. Every lane of the warp
// calls it.
template <WireFormat kFormat, int kUnitElems, int kInFlight, typename PlacesOf, typename Set>
__device__ __forceinline__ void push_quantized_chunk(QuantRowInput const& in, int hidden, int chunk, int chunks,
                                                     Set send, float token_scale, PlacesOf places_of, int lane) {
  using Codec = UnitCodec<kFormat, kUnitElems>;
  constexpr int kScaleBytes = Codec::kTraits.scale_bytes;
  static_assert(kInFlight >= 1, "at least one unit per lane in flight");
  ChunkRange const groups = chunk_range(scale_groups<kFormat, kUnitElems>(hidden), chunk, chunks);
  int const u_begin = groups.begin * Codec::kLanesPerBlock;
  int const u_end = groups.end * Codec::kLanesPerBlock;
  bool const prequantized = in.x_row == nullptr;

  if constexpr (kFormat == WireFormat::nvfp4)
    if (chunk == 0 && lane == 0)
      for (Set m = send; m != 0; m &= m - 1) *places_of(lowest(m)).token = token_scale;

  // Scales of blocks that span several lanes are gathered over the steps and stored 32 at a time (ScaleWindow).
  constexpr bool kWindowed = Codec::kLanesPerBlock > 1;
  auto store_scales_everywhere = [&](std::size_t block, uint32_t scales) {
    for (Set m = send; m != 0; m &= m - 1)
      Codec::store_scales(places_of(lowest(m)).scales + block * kScaleBytes, scales);
  };
  std::size_t const end_block = Codec::block_of(static_cast<std::size_t>(u_end));
  ScaleWindowFor<Codec, kInFlight> window(Codec::block_of(static_cast<std::size_t>(u_begin)));

  // Software pipeline: the next step's loads are issued before this step's conversions and stores, so the memory
  // round trip overlaps the arithmetic (one step at a time, each step waited for its loads with nothing to do).
  int4 raw[kInFlight][Codec::kVecs];
  if (!prequantized) Codec::template load_units<kInFlight>(in.x_row, u_begin, u_end, lane, raw);
  for (int base = u_begin; base < u_end; base += 32 * kInFlight) {
    uint32_t payload[kInFlight][4];
    uint32_t scales[kInFlight];
    if (prequantized) {  // forwarded as is: the same pieces the quantizer would have produced
#pragma unroll
      for (int f = 0; f < kInFlight; ++f) {
        int const u = base + f * 32 + lane;
        scales[f] = 0;
        if (u < u_end) {
          Codec::template load_piece<true>(in.payload + static_cast<std::size_t>(u) * Codec::kPieceBytes, payload[f]);
          if (Codec::leader(lane)) scales[f] = Codec::load_scales(in.scales + Codec::block_of(u) * kScaleBytes);
        }
      }
    } else {
      int4 next[kInFlight][Codec::kVecs];
      Codec::template load_units<kInFlight>(in.x_row, base + 32 * kInFlight, u_end, lane, next);  // none past it
#pragma unroll
      for (int f = 0; f < kInFlight; ++f) {
        // every lane converts (the block reductions are shuffles); lanes past the chunk hold zeros and store nothing
        float x[kUnitElems];
        Codec::unpack_bf16(raw[f], x);
        Codec::quantize(x, token_scale, payload[f], scales[f]);
      }
#pragma unroll
      for (int f = 0; f < kInFlight; ++f)
#pragma unroll
        for (int i = 0; i < Codec::kVecs; ++i) raw[f][i] = next[f][i];
    }
#pragma unroll
    for (int f = 0; f < kInFlight; ++f) {
      int const u = base + f * 32 + lane;
      if (u >= u_end) continue;
      for (Set m = send; m != 0; m &= m - 1) {
        QuantRowPlaces const at = places_of(lowest(m));
        Codec::store_piece(at.payload + static_cast<std::size_t>(u) * Codec::kPieceBytes, payload[f]);
        if (!kWindowed && Codec::leader(lane))
          Codec::store_scales(at.scales + Codec::block_of(u) * kScaleBytes, scales[f]);
      }
    }
    if constexpr (kWindowed) {
      if (window.take(base, scales, lane)) {
        window.flush(end_block, lane, store_scales_everywhere);
        window.next();
      }
    }
  }
  if constexpr (kWindowed) window.flush(end_block, lane, store_scales_everywhere);
}

}  // namespace ferry::device
