// Eight bf16 values in one 16-byte vector, to and from fp32: the unit every row reduction works in.
#pragma once

#include <cuda_bf16.h>

namespace ferry::device {

__device__ __forceinline__ void bf16x8_to_float(int4 v, float* out) {
  auto const* h = reinterpret_cast<__nv_bfloat162 const*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 const f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// Round to nearest even, as the reference (ref::float_to_bf16) does.
__device__ __forceinline__ int4 float_to_bf16x8(float const* in) {
  int4 v;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  return v;
}

}  // namespace ferry::device
