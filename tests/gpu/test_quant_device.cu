// Device codecs (src/wire/device_codec.cuh) against the host codecs (src/wire/host_codec.cpp): one warp per row,
// fresh random rows (seed printed) plus zeros, denormals, NaN and Inf; device quantize == host quantize byte for
// byte (padding included, the output poisoned first), device dequantize == host dequantize (bf16 bit for bit, fp32 bit
// for bit except that NaN only has to be NaN). Skips below 1 GPU.
#include <gtest/gtest.h>

#include "ferry/communicator.hpp"

#if FERRY_HAVE_CUDA
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "core/cuda_check.hpp"
#include "ferry/wire_format.hpp"
#include "wire/codec.hpp"
#include "wire/device_codec.cuh"
#include "support/rank_case.hpp"
#endif

namespace ferry::test {
namespace test_quant_device {  // named, not anonymous: FERRY_CI_BUILD compiles several files as one

#if FERRY_HAVE_CUDA

constexpr int kWarpsPerBlock = 4;

template <typename T>
struct QuantizeParams {
  T const* x;
  uint8_t* wire;
  int rows;
  int hidden;
  std::size_t row_bytes;
};

template <typename T>
struct DequantizeParams {
  uint8_t const* wire;
  T* y;
  int rows;
  int hidden;
  std::size_t row_bytes;
};

// One warp per row; the row index is warp-uniform, so whole warps return together.
template <WireFormat kFormat, typename T, bool kNcSource, int kUnroll>
__global__ void quantize_kernel(QuantizeParams<T> const params) {
  int const row = static_cast<int>(blockIdx.x) * kWarpsPerBlock + static_cast<int>(threadIdx.x) / 32;
  if (row >= params.rows) return;
  device::quantize_row_warp<kFormat, T, kNcSource, kUnroll>(params.x + static_cast<std::size_t>(row) * params.hidden,
                                                            params.hidden, params.wire + row * params.row_bytes);
}

template <WireFormat kFormat, typename T>
__global__ void dequantize_kernel(DequantizeParams<T> const params) {
  int const row = static_cast<int>(blockIdx.x) * kWarpsPerBlock + static_cast<int>(threadIdx.x) / 32;
  if (row >= params.rows) return;
  device::dequantize_row_warp<kFormat, T>(params.wire + row * params.row_bytes, params.hidden,
                                          params.y + static_cast<std::size_t>(row) * params.hidden);
}

// One (format, layout, rows, hidden, row, block) query of the receiver scale layouts, answered on the device.
struct OffsetQuery {
  WireFormat format;
  ScaleLayout layout;
  int rows;
  int hidden;
  int row;
  int block;
};

__global__ void scale_offset_kernel(OffsetQuery const* queries, int count, std::size_t* offsets,
                                    std::size_t* tensor_bytes) {
  int const i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= count) return;
  OffsetQuery const q = queries[i];
  offsets[i] = wire::scale_offset(q.format, q.layout, static_cast<std::size_t>(q.rows), q.hidden,
                                   static_cast<std::size_t>(q.row), static_cast<std::size_t>(q.block));
  tensor_bytes[i] = wire::scale_tensor_size(q.format, q.layout, static_cast<std::size_t>(q.rows), q.hidden);
}

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  explicit DeviceBuffer(std::size_t count) { FERRY_CHECK_CUDA(cudaMalloc(&ptr, count * sizeof(T) + 16)); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(DeviceBuffer const&) = delete;
  DeviceBuffer& operator=(DeviceBuffer const&) = delete;
};

dim3 grid_for(int rows) {
  return dim3(static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock));
}

// Runs the device quantizer of `format` on rows of T; returns the wire bytes.
template <typename T, bool kNcSource = false, int kUnroll = 4>
std::vector<uint8_t> device_quantize(WireFormat format, std::vector<T> const& x, int rows, int hidden) {
  std::size_t const row_bytes = wire_row_bytes(format, hidden);
  DeviceBuffer<T> d_x(x.size());
  DeviceBuffer<uint8_t> d_wire(row_bytes * rows);
  FERRY_CHECK_CUDA(cudaMemcpy(d_x.ptr, x.data(), x.size() * sizeof(T), cudaMemcpyHostToDevice));
  FERRY_CHECK_CUDA(cudaMemset(d_wire.ptr, 0xCD, row_bytes * rows));  // poison: padding must be written too
  QuantizeParams<T> const params{d_x.ptr, d_wire.ptr, rows, hidden, row_bytes};
  dim3 const grid = grid_for(rows), block(32 * kWarpsPerBlock);
  switch (format) {
    case WireFormat::bf16:
      quantize_kernel<WireFormat::bf16, T, kNcSource, kUnroll><<<grid, block>>>(params);
      break;
    case WireFormat::fp8_e4m3:
      quantize_kernel<WireFormat::fp8_e4m3, T, kNcSource, kUnroll><<<grid, block>>>(params);
      break;
    case WireFormat::fp8_e4m3_ue8m0:
      quantize_kernel<WireFormat::fp8_e4m3_ue8m0, T, kNcSource, kUnroll><<<grid, block>>>(params);
      break;
    case WireFormat::nvfp4:
      quantize_kernel<WireFormat::nvfp4, T, kNcSource, kUnroll><<<grid, block>>>(params);
      break;
    case WireFormat::mxfp4:
      quantize_kernel<WireFormat::mxfp4, T, kNcSource, kUnroll><<<grid, block>>>(params);
      break;
  }
  FERRY_CHECK_CUDA(cudaGetLastError());
  FERRY_CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> wire(row_bytes * rows);
  FERRY_CHECK_CUDA(cudaMemcpy(wire.data(), d_wire.ptr, wire.size(), cudaMemcpyDeviceToHost));
  return wire;
}

// Runs the device dequantizer of `format` on wire rows; returns the values (bit patterns of T).
template <typename T>
std::vector<T> device_dequantize(WireFormat format, std::vector<uint8_t> const& wire, int rows, int hidden) {
  std::size_t const row_bytes = wire_row_bytes(format, hidden);
  DeviceBuffer<uint8_t> d_wire(wire.size());
  DeviceBuffer<T> d_y(static_cast<std::size_t>(rows) * hidden);
  FERRY_CHECK_CUDA(cudaMemcpy(d_wire.ptr, wire.data(), wire.size(), cudaMemcpyHostToDevice));
  FERRY_CHECK_CUDA(cudaMemset(d_y.ptr, 0xCD, static_cast<std::size_t>(rows) * hidden * sizeof(T)));
  DequantizeParams<T> const params{d_wire.ptr, d_y.ptr, rows, hidden, row_bytes};
  dim3 const grid = grid_for(rows), block(32 * kWarpsPerBlock);
  switch (format) {
    case WireFormat::bf16:
      dequantize_kernel<WireFormat::bf16, T><<<grid, block>>>(params);
      break;
    case WireFormat::fp8_e4m3:
      dequantize_kernel<WireFormat::fp8_e4m3, T><<<grid, block>>>(params);
      break;
    case WireFormat::fp8_e4m3_ue8m0:
      dequantize_kernel<WireFormat::fp8_e4m3_ue8m0, T><<<grid, block>>>(params);
      break;
    case WireFormat::nvfp4:
      dequantize_kernel<WireFormat::nvfp4, T><<<grid, block>>>(params);
      break;
    case WireFormat::mxfp4:
      dequantize_kernel<WireFormat::mxfp4, T><<<grid, block>>>(params);
      break;
  }
  FERRY_CHECK_CUDA(cudaGetLastError());
  FERRY_CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<T> y(static_cast<std::size_t>(rows) * hidden);
  FERRY_CHECK_CUDA(cudaMemcpy(y.data(), d_y.ptr, y.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return y;
}

// Random rows (block magnitudes over many binades, zero blocks, outliers), then special rows: all zeros, bf16
// denormals, large values, and NaN / +-Inf in a few places.
std::vector<float> test_rows(std::mt19937_64& rng, int rows, int hidden) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::uniform_int_distribution<int> binade(-30, 30);
  std::vector<float> x(static_cast<std::size_t>(rows) * hidden);
  for (int r = 0; r < rows; ++r) {
    float* row = x.data() + static_cast<std::size_t>(r) * hidden;
    float block_scale = 1.0f;
    for (int i = 0; i < hidden; ++i) {
      if (i % 16 == 0) block_scale = unit(rng) < 0.05f ? 0.0f : std::ldexp(1.0f, binade(rng));
      row[i] = block_scale * normal(rng) * (unit(rng) < 0.01f ? 64.0f : 1.0f);
    }
    switch (r % 8) {
      case 1:
        for (int i = 0; i < hidden; ++i) row[i] = i % 2 ? -0.0f : 0.0f;
        break;
      case 2:
        for (int i = 0; i < hidden; ++i) row[i] = std::ldexp(static_cast<float>(i % 7) - 3.0f, -133);
        break;
      case 3:
        for (int i = 0; i < hidden; ++i) row[i] = std::ldexp(row[i] == 0.0f ? 1.0f : row[i], 90);
        break;
      case 4:
        row[(r * 7) % hidden] = std::numeric_limits<float>::quiet_NaN();
        row[(r * 13 + 40) % hidden] = std::numeric_limits<float>::infinity();
        row[(r * 29 + 100) % hidden] = -std::numeric_limits<float>::infinity();
        break;
      default:
        break;
    }
  }
  return x;
}

std::vector<uint16_t> to_bf16(std::vector<float> const& x) {
  std::vector<uint16_t> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = wire::bf16_from_float(x[i]);
  return out;
}

std::vector<__nv_bfloat16> as_device_bf16(std::vector<uint16_t> const& bits) {
  std::vector<__nv_bfloat16> out(bits.size());
  std::memcpy(out.data(), bits.data(), bits.size() * sizeof(uint16_t));
  return out;
}

std::vector<int> hiddens_for(WireFormat format) {
  int const unit = std::max(wire_block_elems(format), 8);
  // one block, a row shorter than a warp step, a row ending mid-unroll, DeepSeek-V3's hidden
  return {unit, unit * 3, unit * 37, 7168};
}

constexpr WireFormat kFormats[] = {WireFormat::bf16, WireFormat::fp8_e4m3, WireFormat::fp8_e4m3_ue8m0,
                                   WireFormat::nvfp4, WireFormat::mxfp4};

// First differing byte of each mismatching row, at most a few reported.
void expect_same_bytes(std::vector<uint8_t> const& device, std::vector<uint8_t> const& host, std::size_t row_bytes,
                       std::string const& what) {
  ASSERT_EQ(device.size(), host.size()) << what;
  int reported = 0;
  for (std::size_t i = 0; i < host.size(); ++i) {
    if (device[i] != host[i]) {
      ADD_FAILURE() << what << ": row " << i / row_bytes << " byte " << i % row_bytes << " device 0x" << std::hex
                    << int(device[i]) << " host 0x" << int(host[i]);
      if (++reported == 5) return;
      i = (i / row_bytes + 1) * row_bytes - 1;  // next row
    }
  }
}

#define FERRY_REQUIRE_GPU()                                              \
  do {                                                                   \
    if (::ferry::cuda_device_count() < 1) GTEST_SKIP() << "needs 1 GPU"; \
    FERRY_CHECK_CUDA(cudaSetDevice(0));                                  \
  } while (0)

#endif  // FERRY_HAVE_CUDA

TEST(QuantDevice, QuantizeMatchesHostByteForByte) {
#if !FERRY_HAVE_CUDA
  GTEST_SKIP() << "needs the cuda backend (built with FERRY_ENABLE_CUDA=OFF)";
#else
  FERRY_REQUIRE_GPU();
  std::mt19937_64 rng(test_seed());
  int const rows = 40;
  for (WireFormat format : kFormats) {
    for (int hidden : hiddens_for(format)) {
      std::string const what = std::string(wire_format_name(format)) + " hidden=" + std::to_string(hidden);
      std::size_t const row_bytes = wire_row_bytes(format, hidden);
      std::vector<float> const x = test_rows(rng, rows, hidden);
      std::vector<uint16_t> const x16 = to_bf16(x);
      std::vector<uint8_t> host_f32(row_bytes * rows), host_bf16(row_bytes * rows);
      for (int r = 0; r < rows; ++r) {
        wire::quantize_row(format, x.data() + static_cast<std::size_t>(r) * hidden, hidden,
                            host_f32.data() + r * row_bytes);
        wire::quantize_row(format, x16.data() + static_cast<std::size_t>(r) * hidden, hidden,
                            host_bf16.data() + r * row_bytes);
      }
      expect_same_bytes(device_quantize<float>(format, x, rows, hidden), host_f32, row_bytes, what + " fp32 in");
      expect_same_bytes(device_quantize<__nv_bfloat16>(format, as_device_bf16(x16), rows, hidden), host_bf16, row_bytes,
                        what + " bf16 in");
      // The non-coherent load path and no unrolling give the same bytes.
      expect_same_bytes(device_quantize<__nv_bfloat16, true, 1>(format, as_device_bf16(x16), rows, hidden), host_bf16,
                        row_bytes, what + " bf16 in, nc loads, unroll 1");
    }
  }
#endif
}

TEST(QuantDevice, DequantizeMatchesHost) {
#if !FERRY_HAVE_CUDA
  GTEST_SKIP() << "needs the cuda backend (built with FERRY_ENABLE_CUDA=OFF)";
#else
  FERRY_REQUIRE_GPU();
  std::mt19937_64 rng(test_seed() ^ 0xde);
  int const rows = 40;
  for (WireFormat format : kFormats) {
    for (int hidden : hiddens_for(format)) {
      std::string const what = std::string(wire_format_name(format)) + " hidden=" + std::to_string(hidden);
      std::size_t const row_bytes = wire_row_bytes(format, hidden);
      std::vector<float> const x = test_rows(rng, rows, hidden);
      std::vector<uint8_t> wire(row_bytes * rows);
      for (int r = 0; r < rows; ++r)
        wire::quantize_row(format, x.data() + static_cast<std::size_t>(r) * hidden, hidden,
                            wire.data() + r * row_bytes);
      std::vector<float> host_f32(x.size());
      std::vector<uint16_t> host_bf16(x.size());
      for (int r = 0; r < rows; ++r) {
        wire::dequantize_row(format, wire.data() + r * row_bytes, hidden,
                              host_f32.data() + static_cast<std::size_t>(r) * hidden);
        wire::dequantize_row(format, wire.data() + r * row_bytes, hidden,
                              host_bf16.data() + static_cast<std::size_t>(r) * hidden);
      }
      std::vector<float> const dev_f32 = device_dequantize<float>(format, wire, rows, hidden);
      std::vector<__nv_bfloat16> const dev_bf16 = device_dequantize<__nv_bfloat16>(format, wire, rows, hidden);
      int reported = 0;
      for (std::size_t i = 0; i < x.size() && reported < 5; ++i) {
        uint32_t dev_bits, host_bits;
        std::memcpy(&dev_bits, &dev_f32[i], sizeof dev_bits);
        std::memcpy(&host_bits, &host_f32[i], sizeof host_bits);
        bool const same = std::isnan(host_f32[i]) ? std::isnan(dev_f32[i]) : dev_bits == host_bits;
        uint16_t dev16;
        std::memcpy(&dev16, &dev_bf16[i], sizeof dev16);
        if (!same || dev16 != host_bf16[i]) {
          ++reported;
          ADD_FAILURE() << what << ": element " << i << " fp32 device " << dev_f32[i] << " host " << host_f32[i]
                        << ", bf16 device 0x" << std::hex << dev16 << " host 0x" << host_bf16[i];
        }
      }
    }
  }
#endif
}

#if FERRY_HAVE_CUDA
__global__ void e2m1_pair_values_kernel(float2* out) {
  out[threadIdx.x] = device::wire_detail::e2m1_pair_values(threadIdx.x);
}
#endif

// The device's e2m1 decode of a byte (two codes through one fp16x2 product) against the host's, for all 256 bytes:
// both nibbles, both signs, zero and the denormal-like 0.5, bit for bit (-0 included).
TEST(QuantDevice, E2m1PairValuesOfEveryByte) {
#if !FERRY_HAVE_CUDA
  GTEST_SKIP() << "needs the cuda backend (built with FERRY_ENABLE_CUDA=OFF)";
#else
  FERRY_REQUIRE_GPU();
  DeviceBuffer<float2> d_out(256);
  FERRY_CHECK_CUDA(cudaMemset(d_out.ptr, 0xFF, 256 * sizeof(float2)));  // poisoned: NaN bits
  e2m1_pair_values_kernel<<<1, 256>>>(d_out.ptr);
  FERRY_CHECK_CUDA(cudaGetLastError());
  std::vector<float2> out(256);
  FERRY_CHECK_CUDA(cudaMemcpy(out.data(), d_out.ptr, 256 * sizeof(float2), cudaMemcpyDeviceToHost));
  for (int byte = 0; byte < 256; ++byte) {
    float const lo = wire::e2m1_to_float(static_cast<uint8_t>(byte & 0xF));
    float const hi = wire::e2m1_to_float(static_cast<uint8_t>(byte >> 4));
    uint32_t bits[4];
    std::memcpy(&bits[0], &out[byte].x, 4);
    std::memcpy(&bits[1], &lo, 4);
    std::memcpy(&bits[2], &out[byte].y, 4);
    std::memcpy(&bits[3], &hi, 4);
    EXPECT_EQ(bits[0], bits[1]) << "byte 0x" << std::hex << byte << ": low nibble " << out[byte].x << " vs " << lo;
    EXPECT_EQ(bits[2], bits[3]) << "byte 0x" << std::hex << byte << ": high nibble " << out[byte].y << " vs " << hi;
  }
#endif
}

// The scale-tensor offsets kernels use (wire::scale_offset on the device) equal the host's scale_byte_offset and
// scale_tensor_bytes for every supported (format, layout), odd and aligned row counts, every (row, block) corner and
// random ones.
TEST(QuantDevice, ScaleOffsetsMatchHost) {
#if !FERRY_HAVE_CUDA
  GTEST_SKIP() << "needs the cuda backend (built with FERRY_ENABLE_CUDA=OFF)";
#else
  FERRY_REQUIRE_GPU();
  std::mt19937_64 rng(test_seed() ^ 0x5ca1e);
  ScaleLayout const layouts[] = {ScaleLayout::row_major, ScaleLayout::mn_major_tma,
                                 ScaleLayout::mn_major_tma_packed_ue8m0, ScaleLayout::blocked_128x4};
  std::vector<OffsetQuery> queries;
  for (WireFormat format : kFormats) {
    for (ScaleLayout layout : layouts) {
      if (!scale_layout_supported(format, layout)) continue;
      int const block = wire_block_elems(format);
      for (int hidden : {block * 8 > 128 ? block * 8 : 128, block * 17, 7168, 2176}) {
        if (hidden % block != 0 || hidden % 8 != 0) continue;
        int const num_scales = hidden / block;
        for (int rows : {1, 5, 128, 131, 4096 + 3}) {
          for (int row : {0, rows / 2, rows - 1})
            for (int j : {0, num_scales / 2, num_scales - 1}) queries.push_back({format, layout, rows, hidden, row, j});
          for (int k = 0; k < 16; ++k)
            queries.push_back({format, layout, rows, hidden, static_cast<int>(rng() % static_cast<uint64_t>(rows)),
                               static_cast<int>(rng() % static_cast<uint64_t>(num_scales))});
        }
      }
    }
  }
  int const count = static_cast<int>(queries.size());
  DeviceBuffer<OffsetQuery> d_queries(queries.size());
  DeviceBuffer<std::size_t> d_offsets(queries.size()), d_bytes(queries.size());
  FERRY_CHECK_CUDA(
      cudaMemcpy(d_queries.ptr, queries.data(), queries.size() * sizeof(OffsetQuery), cudaMemcpyHostToDevice));
  scale_offset_kernel<<<(count + 127) / 128, 128>>>(d_queries.ptr, count, d_offsets.ptr, d_bytes.ptr);
  FERRY_CHECK_CUDA(cudaGetLastError());
  FERRY_CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<std::size_t> offsets(queries.size()), bytes(queries.size());
  FERRY_CHECK_CUDA(
      cudaMemcpy(offsets.data(), d_offsets.ptr, offsets.size() * sizeof(std::size_t), cudaMemcpyDeviceToHost));
  FERRY_CHECK_CUDA(cudaMemcpy(bytes.data(), d_bytes.ptr, bytes.size() * sizeof(std::size_t), cudaMemcpyDeviceToHost));
  int reported = 0;
  for (int i = 0; i < count && reported < 10; ++i) {
    OffsetQuery const& q = queries[static_cast<std::size_t>(i)];
    std::size_t const host = scale_byte_offset(q.format, q.layout, q.rows, q.hidden, q.row, q.block);
    std::size_t const host_bytes = scale_tensor_bytes(q.format, q.layout, q.rows, q.hidden);
    if (offsets[static_cast<std::size_t>(i)] != host || bytes[static_cast<std::size_t>(i)] != host_bytes) {
      ++reported;
      ADD_FAILURE() << wire_format_name(q.format) << " " << scale_layout_name(q.layout) << " rows " << q.rows
                    << " hidden " << q.hidden << " (row " << q.row << ", block " << q.block << "): device offset "
                    << offsets[static_cast<std::size_t>(i)] << " host " << host << ", tensor bytes device "
                    << bytes[static_cast<std::size_t>(i)] << " host " << host_bytes;
    }
  }
#endif
}

}  // namespace test_quant_device
}  // namespace ferry::test
