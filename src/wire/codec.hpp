// Host reference codecs of the wire formats (rules, layouts and error bounds: docs/quant.md). Plain C++: they build
// and run without CUDA. Their element conversions are bit-exact with CUDA's own (cuda_fp8.h, cuda_fp4.h,
// cuda_bf16.h; tests/unit/test_quant.cpp checks every bf16 input where the headers exist), and the row codecs are
// bit-exact with the device codecs of device_codec.cuh (tests/gpu/test_quant_device.cu).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ferry/wire_format.hpp"

namespace ferry::wire {

// ---- element conversions
// --------------------------------------------------------------------------------------------- Bit patterns: e4m3 and
// UE8M0 are one byte, e2m1 is the low nibble of a byte, bf16 is its 16 bits.

// fp32 -> e4m3, round to nearest even, saturating: |x| >= 448 (and +-Inf) -> +-448; NaN -> 0x7F; a result that
// rounds to zero keeps the sign (0x80 for negative). As __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3).
uint8_t e4m3_from_float(float x);
// e4m3 -> fp32, exact; 0x7F and 0xFF are NaN.
float e4m3_to_float(uint8_t code);

// fp32 -> e2m1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign), round to nearest even, saturating: |x| > 6
// (and +-Inf) -> +-6; NaN -> +6 (0x7; e2m1 has no NaN); a zero result keeps the sign. As
// __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest).
uint8_t e2m1_from_float(float x);
// e2m1 (low nibble of code) -> fp32, exact.
float e2m1_to_float(uint8_t code);

// |x| -> UE8M0 byte of the smallest power of two >= |x| (2^-127 for |x| <= 2^-127), saturating at 0xFE (2^127) for
// larger values and +-Inf; NaN -> 0xFF. As __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundPosInf).
uint8_t ue8m0_from_float_ceil(float x);
// UE8M0 byte -> 2^(b - 127), exact; 0xFF is NaN.
float ue8m0_to_float(uint8_t byte);

// fp32 -> bf16, round to nearest even (overflow -> +-Inf); NaN -> 0x7FFF. As __float2bfloat16_rn.
uint16_t bf16_from_float(float x);
// bf16 -> fp32, exact.
float bf16_to_float(uint16_t bits);

// ---- rows
// ------------------------------------------------------------------------------------------------------------ One row
// of `hidden` elements into its wire layout (wire_row_layout(format, hidden).row_bytes bytes, padding written as zero).
// hidden is checked like wire_row_bytes (ConfigError). The bf16 overload takes bf16 bit patterns and gives the same
// bytes as the float overload on the same values.
void quantize_row(WireFormat format, float const* x, int hidden, uint8_t* wire);
void quantize_row(WireFormat format, uint16_t const* x_bf16, int hidden, uint8_t* wire);

// A wire row back into `hidden` values: fp32 (y = code * scale, one fp32 product; for nvfp4 code * (block scale *
// token scale)), or those values rounded once to bf16.
void dequantize_row(WireFormat format, uint8_t const* wire, int hidden, float* y);
void dequantize_row(WireFormat format, uint8_t const* wire, int hidden, uint16_t* y_bf16);

// ---- receiver scale tensors
// ------------------------------------------------------------------------------------------ Gathers the block scales
// of `rows` wire rows (row r at wire + r * wire_stride) into a tensor of `layout` (scale_tensor_bytes(format, layout,
// rows, hidden) bytes at out; padding written as zero). Throws like scale_tensor_bytes.
void write_scale_tensor(WireFormat format, ScaleLayout layout, uint8_t const* wire, std::size_t wire_stride, int rows,
                        int hidden, void* out);
// nvfp4: the per-token fp32 scales of `rows` wire rows into out[rows]. Throws ConfigError for another format.
void write_token_scales(WireFormat format, uint8_t const* wire, std::size_t wire_stride, int rows, int hidden,
                        float* out);

// ---- error bounds (derivations: docs/quant.md)
// ------------------------------------------------------------------------- A bound of the form  rel * |x| + block *
// block_amax + row * row_amax + floor,  where block_amax is the largest |x| over the finite elements of x's scale block
// and row_amax over the finite elements of x's row.
struct ErrorBound {
  double rel = 0;
  double block = 0;
  double row = 0;
  double floor = 0;

  double at(double abs_x, double block_amax, double row_amax) const {
    return rel * abs_x + block * block_amax + row * row_amax + floor;
  }
};

enum class DequantTo { f32, bf16 };

// |dequantize(quantize(x))_i - x_i| <= bound.at(|x_i|, block_amax, row_amax) for every finite x_i of a row whose
// finite elements are below 2^127 in magnitude, dequantized to `to`. (Larger values can round up past fp32's or bf16's
// largest value, about 2^128, and come back as +-Inf.) For bf16 input the bf16 wire format is exact; its bound is
// that of fp32 input.
ErrorBound quant_error_bound(WireFormat format, DequantTo to);

// Combine of num_terms rows x_1..x_N (the ranks' partial sums): each quantized with `format`, dequantized to fp32,
// summed in fp32 in any order, the sum rounded once to bf16. For each element e:
//   |y_e - sum_i x_i,e| <= rel * sum_i |x_i,e| + block * sum_i block_amax_i,e + row * sum_i row_amax_i + floor
// i.e. bound.at(sum of |terms|, sum of the terms' block amaxes, sum of the terms' row amaxes). num_terms >= 1
// (InputError otherwise). A bound relative to sum |x_i,e| alone does not exist for block formats: a small element
// next to a large one in its block is quantized with the large one's scale.
ErrorBound combine_error_bound(WireFormat format, int num_terms);

// One combined row y (bf16) against the exact sum of its terms (the bf16 rows the ranks sent back, combined in
// `format`), element by element under combine_error_bound(format, number of terms).
struct CombineRowError {
  double worst_ratio = 0;  // max of |y - exact| / bound over the elements whose bound is positive
  double error_sq = 0;     // sum of (y - exact)^2
  double exact_sq = 0;     // sum of exact^2
  int first_over = -1;     // the first element with |y - exact| > bound (-1: none); its figures follow
  double over_y = 0, over_exact = 0, over_error = 0, over_bound = 0;
};
// terms: num_terms pointers to rows of `hidden` bf16 values (num_terms >= 1, InputError otherwise).
CombineRowError measure_combine_row(WireFormat format, int hidden, uint16_t const* const* terms, int num_terms,
                                    uint16_t const* y);

}  // namespace ferry::wire
