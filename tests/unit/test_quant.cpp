// Host codecs of the wire formats (src/wire/codec.hpp, docs/quant.md): element conversions (bit-exact with CUDA's
// host-callable ones over every bf16 input where the CUDA headers exist), row layouts and receiver scale layouts,
// round trips within the derived error bounds on fresh random data, zeros, denormals, NaN and Inf, and the combine
// bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "ferry/error.hpp"
#include "ferry/wire_format.hpp"
#include "wire/codec.hpp"
#include "wire/rules.hpp"
#include "support/rank_case.hpp"

#if FERRY_HAVE_CUDA
#include <cuda_bf16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#endif

namespace ferry::wire {
namespace {

constexpr WireFormat kAllFormats[] = {WireFormat::bf16, WireFormat::fp8_e4m3, WireFormat::fp8_e4m3_ue8m0,
                                      WireFormat::nvfp4, WireFormat::mxfp4};
constexpr WireFormat kScaledFormats[] = {WireFormat::fp8_e4m3, WireFormat::fp8_e4m3_ue8m0, WireFormat::nvfp4,
                                         WireFormat::mxfp4};
constexpr ScaleLayout kAllLayouts[] = {ScaleLayout::row_major, ScaleLayout::mn_major_tma,
                                       ScaleLayout::mn_major_tma_packed_ue8m0, ScaleLayout::blocked_128x4};

float from_bits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

uint32_t to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

float load_float(uint8_t const* ptr) {
  float value;
  std::memcpy(&value, ptr, sizeof value);
  return value;
}

// Rows whose blocks have magnitudes spread over many binades (2^-30 .. 2^30), some all-zero blocks, a few outliers
// and a few tiny elements next to large ones. Values are bf16-representable when `bf16_values` is set.
std::vector<float> random_rows(std::mt19937_64& rng, int rows, int hidden, int block, bool bf16_values) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::uniform_int_distribution<int> binade(-30, 30);
  std::vector<float> x(static_cast<std::size_t>(rows) * hidden);
  for (int r = 0; r < rows; ++r) {
    float const row_scale = std::ldexp(1.0f, binade(rng) / 3);
    for (int j = 0; j < hidden / block; ++j) {
      float const block_scale = unit(rng) < 0.05f ? 0.0f : row_scale * std::ldexp(1.0f, binade(rng) / 2);
      for (int i = 0; i < block; ++i) {
        float value = block_scale * normal(rng);
        float const pick = unit(rng);
        if (pick < 0.01f) value *= 64.0f;                  // outlier
        if (pick > 0.99f) value *= std::ldexp(1.0f, -20);  // tiny next to large
        if (bf16_values) value = bf16_to_float(bf16_from_float(value));
        x[static_cast<std::size_t>(r) * hidden + j * block + i] = value;
      }
    }
  }
  return x;
}

struct Amaxes {
  std::vector<double> block;  // per element: amax of its block (finite elements)
  double row = 0;
};

Amaxes amaxes(float const* x, int hidden, int block) {
  Amaxes result;
  result.block.resize(static_cast<std::size_t>(hidden));
  for (int j = 0; j < hidden / block; ++j) {
    double amax = 0;
    for (int i = 0; i < block; ++i)
      if (std::isfinite(x[j * block + i])) amax = std::max(amax, std::fabs(static_cast<double>(x[j * block + i])));
    for (int i = 0; i < block; ++i) result.block[static_cast<std::size_t>(j * block + i)] = amax;
    result.row = std::max(result.row, amax);
  }
  return result;
}

// The bound is evaluated in double; allow for its own rounding (a few ulps), nothing more.
constexpr double kBoundEvalSlack = 1.0 + 0x1p-40;

// ---- layouts
// -----------------------------------------------------------------------------------------------------------

TEST(QuantLayout, RowPiecesAreAlignedAndInOrder) {
  for (WireFormat format : kAllFormats) {
    int const block = wire_block_elems(format);
    for (int multiple : {1, 2, 3, 5, 56}) {
      int const hidden = std::max(block, 8) * multiple;
      WireRowLayout const layout = wire_row_layout(format, hidden);
      SCOPED_TRACE(std::string(wire_format_name(format)) + " hidden=" + std::to_string(hidden));
      EXPECT_EQ(layout.hidden, hidden);
      EXPECT_EQ(layout.block_elems, block);
      EXPECT_EQ(layout.row_bytes, wire_row_bytes(format, hidden));
      EXPECT_EQ(layout.payload_bytes, wire_payload_bytes(format, hidden));
      EXPECT_EQ(layout.row_bytes % 16, 0u);
      EXPECT_EQ(layout.scales_offset % 16, 0u);
      EXPECT_GE(layout.scales_offset, layout.payload_bytes);
      EXPECT_LT(layout.scales_offset - layout.payload_bytes, 16u);
      std::size_t const scales_end = layout.scales_offset + static_cast<std::size_t>(layout.num_scales) *
                                                                static_cast<std::size_t>(layout.scale_bytes);
      if (format == WireFormat::bf16) {
        EXPECT_EQ(layout.num_scales, 0);
        EXPECT_EQ(layout.row_bytes, static_cast<std::size_t>(2 * hidden));
      } else {
        EXPECT_EQ(layout.num_scales, hidden / block);
      }
      EXPECT_EQ(layout.has_token_scale, format == WireFormat::nvfp4);
      if (layout.has_token_scale) {
        EXPECT_EQ(layout.token_scale_offset % 16, 0u);
        EXPECT_GE(layout.token_scale_offset, scales_end);
        EXPECT_EQ(layout.row_bytes, layout.token_scale_offset + 16);
      } else {
        EXPECT_GE(layout.row_bytes, scales_end);
        EXPECT_LT(layout.row_bytes - scales_end, 16u);
      }
    }
  }
  // DeepSeek-V3's hidden: 14336 bf16; 7168 fp8 + 56 fp32; 7168 + 56 UE8M0 padded to 64; 3584 e2m1 + 448 e4m3 + one
  // fp32 in a 16-byte slot; 3584 + 224 UE8M0.
  EXPECT_EQ(wire_row_bytes(WireFormat::bf16, 7168), 14336u);
  EXPECT_EQ(wire_row_bytes(WireFormat::fp8_e4m3, 7168), 7168u + 224u);
  EXPECT_EQ(wire_row_bytes(WireFormat::fp8_e4m3_ue8m0, 7168), 7168u + 64u);
  EXPECT_EQ(wire_row_bytes(WireFormat::nvfp4, 7168), 3584u + 448u + 16u);
  EXPECT_EQ(wire_row_layout(WireFormat::nvfp4, 7168).token_scale_offset, 3584u + 448u);
  EXPECT_EQ(wire_row_bytes(WireFormat::mxfp4, 7168), 3584u + 224u);
  // A payload that is not a multiple of 16 bytes: 48 e2m1 = 24 bytes, scales at 32.
  EXPECT_EQ(wire_row_layout(WireFormat::nvfp4, 48).scales_offset, 32u);
  EXPECT_EQ(wire_row_bytes(WireFormat::nvfp4, 48), 32u + 16u + 16u);
}

TEST(QuantLayout, RejectsHiddenThatIsNotWholeVectorsAndBlocks) {
  struct Case {
    WireFormat format;
    int hidden;
    char const* suggestion;
  };
  for (Case const& c : {Case{WireFormat::bf16, 0, "hidden=8"}, Case{WireFormat::bf16, 100, "hidden=104"},
                        Case{WireFormat::fp8_e4m3, 7000, "hidden=7040"}, Case{WireFormat::nvfp4, 8, "hidden=16"},
                        Case{WireFormat::mxfp4, -32, "hidden=32"}}) {
    try {
      wire_row_bytes(c.format, c.hidden);
      ADD_FAILURE() << wire_format_name(c.format) << " hidden=" << c.hidden << " was accepted";
    } catch (ConfigError const& error) {
      std::string const message = error.what();
      EXPECT_NE(message.find("hidden=" + std::to_string(c.hidden)), std::string::npos) << message;
      EXPECT_NE(message.find(c.suggestion), std::string::npos) << message;
    }
  }
  std::vector<uint8_t> wire(64);
  std::vector<float> x(100);
  EXPECT_THROW(quantize_row(WireFormat::fp8_e4m3, x.data(), 100, wire.data()), ConfigError);
}

TEST(QuantLayout, ScaleTensorOffsetsFollowTheConsumersConventions) {
  int const hidden = 7168;
  // row_major: [rows][56] fp32
  EXPECT_EQ(scale_tensor_bytes(WireFormat::fp8_e4m3, ScaleLayout::row_major, 10, hidden), 10u * 56u * 4u);
  EXPECT_EQ(scale_byte_offset(WireFormat::fp8_e4m3, ScaleLayout::row_major, 10, hidden, 3, 5), (3u * 56u + 5u) * 4u);
  // DeepGEMM sm90: fp32 [56][align(rows, 4)]
  EXPECT_EQ(scale_tensor_bytes(WireFormat::fp8_e4m3, ScaleLayout::mn_major_tma, 10, hidden), 56u * 12u * 4u);
  EXPECT_EQ(scale_byte_offset(WireFormat::fp8_e4m3, ScaleLayout::mn_major_tma, 10, hidden, 3, 5), (5u * 12u + 3u) * 4u);
  // one-byte scales: columns of align(rows, 16) bytes
  EXPECT_EQ(scale_tensor_bytes(WireFormat::mxfp4, ScaleLayout::mn_major_tma, 10, hidden), 224u * 16u);
  EXPECT_EQ(scale_byte_offset(WireFormat::mxfp4, ScaleLayout::mn_major_tma, 10, hidden, 9, 2), 2u * 16u + 9u);
  // DeepGEMM sm100 packed UE8M0: uint32 [ceil(56 / 4)][align(rows, 4)], block 4p + b in byte b of word (p, row)
  EXPECT_EQ(scale_tensor_bytes(WireFormat::fp8_e4m3_ue8m0, ScaleLayout::mn_major_tma_packed_ue8m0, 10, hidden),
            14u * 12u * 4u);
  EXPECT_EQ(scale_byte_offset(WireFormat::fp8_e4m3_ue8m0, ScaleLayout::mn_major_tma_packed_ue8m0, 10, hidden, 3, 9),
            (2u * 12u + 3u) * 4u + 1u);
  // 6 blocks (hidden 768): the last word of a row holds 2 blocks and 2 zero bytes
  EXPECT_EQ(scale_tensor_bytes(WireFormat::fp8_e4m3_ue8m0, ScaleLayout::mn_major_tma_packed_ue8m0, 1, 768),
            2u * 4u * 4u);
  // cuBLASLt blocked 128x4: row r of a tile at (r % 32) * 16 + (r / 32) * 4, tiles K-inner
  WireFormat const nv = WireFormat::nvfp4;  // 448 scales per row, 112 tiles of 4 columns
  EXPECT_EQ(scale_tensor_bytes(nv, ScaleLayout::blocked_128x4, 130, hidden), 256u * 448u);
  EXPECT_EQ(scale_byte_offset(nv, ScaleLayout::blocked_128x4, 130, hidden, 0, 0), 0u);
  EXPECT_EQ(scale_byte_offset(nv, ScaleLayout::blocked_128x4, 130, hidden, 1, 0), 16u);
  EXPECT_EQ(scale_byte_offset(nv, ScaleLayout::blocked_128x4, 130, hidden, 32, 0), 4u);
  EXPECT_EQ(scale_byte_offset(nv, ScaleLayout::blocked_128x4, 130, hidden, 33, 3), 23u);
  EXPECT_EQ(scale_byte_offset(nv, ScaleLayout::blocked_128x4, 130, hidden, 127, 0), 508u);
  EXPECT_EQ(scale_byte_offset(nv, ScaleLayout::blocked_128x4, 130, hidden, 0, 4), 512u);
  EXPECT_EQ(scale_byte_offset(nv, ScaleLayout::blocked_128x4, 130, hidden, 128, 0), 112u * 512u);

  // Every supported (format, layout): offsets are distinct, inside the tensor, and aligned to the scale element.
  for (WireFormat format : kScaledFormats) {
    for (ScaleLayout layout : kAllLayouts) {
      if (!scale_layout_supported(format, layout)) continue;
      for (int rows : {1, 5, 130}) {
        int const h = wire_block_elems(format) * 6;
        std::size_t const bytes = scale_tensor_bytes(format, layout, rows, h);
        std::size_t const elem = format == WireFormat::fp8_e4m3 ? 4 : 1;
        std::set<std::size_t> seen;
        for (int r = 0; r < rows; ++r)
          for (int j = 0; j < 6; ++j) {
            std::size_t const offset = scale_byte_offset(format, layout, rows, h, r, j);
            EXPECT_LE(offset + elem, bytes);
            EXPECT_EQ(offset % elem, 0u);
            EXPECT_TRUE(seen.insert(offset).second) << scale_layout_name(layout) << " row " << r << " block " << j;
          }
      }
    }
  }
}

TEST(QuantLayout, UnsupportedScaleLayoutsAndBadIndicesAreRefused) {
  EXPECT_FALSE(scale_layout_supported(WireFormat::bf16, ScaleLayout::row_major));
  EXPECT_FALSE(scale_layout_supported(WireFormat::fp8_e4m3, ScaleLayout::mn_major_tma_packed_ue8m0));
  EXPECT_FALSE(scale_layout_supported(WireFormat::nvfp4, ScaleLayout::mn_major_tma_packed_ue8m0));
  EXPECT_FALSE(scale_layout_supported(WireFormat::fp8_e4m3_ue8m0, ScaleLayout::blocked_128x4));
  EXPECT_TRUE(scale_layout_supported(WireFormat::mxfp4, ScaleLayout::blocked_128x4));
  try {
    scale_tensor_bytes(WireFormat::fp8_e4m3, ScaleLayout::blocked_128x4, 4, 7168);
    ADD_FAILURE() << "fp8 scales in blocked_128x4 were accepted";
  } catch (ConfigError const& error) {
    EXPECT_NE(std::string(error.what()).find("blocked_128x4"), std::string::npos) << error.what();
  }
  EXPECT_THROW(scale_tensor_bytes(WireFormat::bf16, ScaleLayout::row_major, 4, 7168), ConfigError);
  EXPECT_THROW(scale_tensor_bytes(WireFormat::mxfp4, ScaleLayout::row_major, -1, 7168), InputError);
  EXPECT_THROW(scale_byte_offset(WireFormat::mxfp4, ScaleLayout::row_major, 4, 7168, 4, 0), InputError);
  EXPECT_THROW(scale_byte_offset(WireFormat::mxfp4, ScaleLayout::row_major, 4, 7168, 0, 224), InputError);
  std::vector<uint8_t> wire(wire_row_bytes(WireFormat::mxfp4, 32));
  float out = 0;
  EXPECT_THROW(write_token_scales(WireFormat::mxfp4, wire.data(), wire.size(), 1, 32, &out), ConfigError);
}

TEST(QuantLayout, ScaleTensorsGatherTheWireScales) {
  std::mt19937_64 rng(test::test_seed() ^ 0x5ca1e);
  for (WireFormat format : kScaledFormats) {
    int const hidden = wire_block_elems(format) * 7;
    std::size_t const row_bytes = wire_row_bytes(format, hidden);
    for (int rows : {1, 3, 133}) {
      std::vector<float> const x = random_rows(rng, rows, hidden, wire_block_elems(format), false);
      std::vector<uint8_t> wire(row_bytes * rows);
      for (int r = 0; r < rows; ++r)
        quantize_row(format, x.data() + static_cast<std::size_t>(r) * hidden, hidden, wire.data() + r * row_bytes);
      WireRowLayout const layout = wire_row_layout(format, hidden);
      for (ScaleLayout scale_layout : kAllLayouts) {
        if (!scale_layout_supported(format, scale_layout)) continue;
        SCOPED_TRACE(std::string(wire_format_name(format)) + " " + scale_layout_name(scale_layout) +
                     " rows=" + std::to_string(rows));
        std::size_t const bytes = scale_tensor_bytes(format, scale_layout, rows, hidden);
        std::vector<uint8_t> tensor(bytes, 0xCD);
        write_scale_tensor(format, scale_layout, wire.data(), row_bytes, rows, hidden, tensor.data());
        std::vector<bool> covered(bytes, false);
        for (int r = 0; r < rows; ++r)
          for (int j = 0; j < layout.num_scales; ++j) {
            std::size_t const offset = scale_byte_offset(format, scale_layout, rows, hidden, r, j);
            uint8_t const* expected = wire.data() + r * row_bytes + layout.scales_offset + j * layout.scale_bytes;
            ASSERT_EQ(std::memcmp(tensor.data() + offset, expected, static_cast<std::size_t>(layout.scale_bytes)), 0)
                << "row " << r << " block " << j;
            for (int b = 0; b < layout.scale_bytes; ++b) covered[offset + b] = true;
          }
        for (std::size_t i = 0; i < bytes; ++i)
          if (!covered[i]) ASSERT_EQ(tensor[i], 0) << "padding byte " << i << " not zeroed";
      }
      if (format == WireFormat::nvfp4) {
        std::vector<float> token(static_cast<std::size_t>(rows), -1.0f);
        write_token_scales(format, wire.data(), row_bytes, rows, hidden, token.data());
        for (int r = 0; r < rows; ++r)
          EXPECT_EQ(to_bits(token[r]), to_bits(load_float(wire.data() + r * row_bytes + layout.token_scale_offset)));
      }
    }
  }
}

// ---- element conversions -------------------------------------------------------------------------------------------

TEST(QuantElement, E4m3RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(e4m3_from_float(1.0f), 0x38);
  EXPECT_EQ(e4m3_from_float(1.0625f), 0x38);  // tie 1 | 1.125 -> even (1)
  EXPECT_EQ(e4m3_from_float(1.1875f), 0x3A);  // tie 1.125 | 1.25 -> even (1.25)
  EXPECT_EQ(e4m3_from_float(1.07f), 0x39);
  EXPECT_EQ(e4m3_from_float(448.0f), 0x7E);
  EXPECT_EQ(e4m3_from_float(464.0f), 0x7E);  // the midpoint above 448 would be 480, which does not exist
  EXPECT_EQ(e4m3_from_float(1e30f), 0x7E);
  EXPECT_EQ(e4m3_from_float(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(e4m3_from_float(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(e4m3_from_float(-std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(e4m3_from_float(0x1p-9f), 0x01);   // smallest denormal
  EXPECT_EQ(e4m3_from_float(0x1p-10f), 0x00);  // tie 0 | 2^-9 -> even (0)
  EXPECT_EQ(e4m3_from_float(0x1.8p-10f), 0x01);
  EXPECT_EQ(e4m3_from_float(0x1.4p-8f), 0x02);  // 2.5 * 2^-9: tie 2 | 3 -> 2
  EXPECT_EQ(e4m3_from_float(0x1.ep-8f), 0x04);  // 3.75 * 2^-9 -> 4
  EXPECT_EQ(e4m3_from_float(0x1.ep-7f), 0x08);  // 7.5 * 2^-9: tie 7 | 8 -> 8
  EXPECT_EQ(e4m3_from_float(0x1.fp-7f), 0x08);  // 7.75 * 2^-9 -> 8 = 2^-6, the smallest normal
  EXPECT_EQ(e4m3_from_float(-0.0f), 0x80);
  EXPECT_EQ(e4m3_from_float(-1e-30f), 0x80);
  EXPECT_EQ(e4m3_from_float(from_bits(1)), 0x00);  // fp32 denormal
  for (int code = 0; code < 256; ++code) {
    float const value = e4m3_to_float(static_cast<uint8_t>(code));
    if ((code & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(value)) << code;
      continue;
    }
    EXPECT_EQ(e4m3_from_float(value), code) << "code " << code << " value " << value;
  }
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), 0x1p-9f);
  EXPECT_EQ(e4m3_to_float(0xB8), -1.0f);
}

TEST(QuantElement, E2m1RoundsToNearestEvenAndSaturates) {
  float const values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int code = 0; code < 16; ++code) {
    float const value = (code & 8 ? -1.0f : 1.0f) * values[code & 7];
    EXPECT_EQ(e2m1_to_float(static_cast<uint8_t>(code)), value) << code;
    EXPECT_EQ(e2m1_from_float(value), code) << code;
  }
  // Midpoints go to the even code.
  EXPECT_EQ(e2m1_from_float(0.25f), 0x0);
  EXPECT_EQ(e2m1_from_float(0.75f), 0x2);
  EXPECT_EQ(e2m1_from_float(1.25f), 0x2);
  EXPECT_EQ(e2m1_from_float(1.75f), 0x4);
  EXPECT_EQ(e2m1_from_float(2.5f), 0x4);
  EXPECT_EQ(e2m1_from_float(3.5f), 0x6);
  EXPECT_EQ(e2m1_from_float(5.0f), 0x6);
  EXPECT_EQ(e2m1_from_float(std::nextafter(5.0f, 6.0f)), 0x7);
  EXPECT_EQ(e2m1_from_float(-std::nextafter(0.25f, 1.0f)), 0x9);
  EXPECT_EQ(e2m1_from_float(7.0f), 0x7);
  EXPECT_EQ(e2m1_from_float(-std::numeric_limits<float>::infinity()), 0xF);
  EXPECT_EQ(e2m1_from_float(std::numeric_limits<float>::quiet_NaN()), 0x7);  // no NaN in e2m1: +6, as CUDA
  EXPECT_EQ(e2m1_from_float(-0.1f), 0x8);
}

TEST(QuantElement, Ue8m0IsTheCeilingPowerOfTwo) {
  EXPECT_EQ(ue8m0_from_float_ceil(1.0f), 127);
  EXPECT_EQ(ue8m0_from_float_ceil(1.5f), 128);
  EXPECT_EQ(ue8m0_from_float_ceil(std::nextafter(2.0f, 0.0f)), 128);
  EXPECT_EQ(ue8m0_from_float_ceil(2.0f), 128);
  EXPECT_EQ(ue8m0_from_float_ceil(-3.0f), 129);  // the magnitude
  EXPECT_EQ(ue8m0_from_float_ceil(0x1p-126f), 1);
  EXPECT_EQ(ue8m0_from_float_ceil(0x1p-127f), 0);
  EXPECT_EQ(ue8m0_from_float_ceil(from_bits(0x00400001u)), 1);
  EXPECT_EQ(ue8m0_from_float_ceil(0.0f), 0);
  EXPECT_EQ(ue8m0_from_float_ceil(std::numeric_limits<float>::max()), 0xFE);
  EXPECT_EQ(ue8m0_from_float_ceil(std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(ue8m0_from_float_ceil(std::numeric_limits<float>::quiet_NaN()), 0xFF);
  for (int byte = 1; byte <= 254; ++byte) {
    float const value = ue8m0_to_float(static_cast<uint8_t>(byte));
    EXPECT_EQ(value, std::ldexp(1.0f, byte - 127)) << byte;
    EXPECT_EQ(ue8m0_from_float_ceil(value), byte);
    EXPECT_EQ(value * ue8m0_inverse(static_cast<uint8_t>(byte)), 1.0f) << byte;
  }
  EXPECT_EQ(ue8m0_to_float(0), 0x1p-127f);
  EXPECT_TRUE(std::isnan(ue8m0_to_float(0xFF)));
}

TEST(QuantElement, Bf16RoundsToNearestEven) {
  EXPECT_EQ(bf16_from_float(1.0f), 0x3F80);
  EXPECT_EQ(bf16_from_float(from_bits(0x3F808000u)), 0x3F80);  // tie -> even
  EXPECT_EQ(bf16_from_float(from_bits(0x3F818000u)), 0x3F82);  // tie -> even
  EXPECT_EQ(bf16_from_float(from_bits(0x3F808001u)), 0x3F81);
  EXPECT_EQ(bf16_from_float(std::numeric_limits<float>::max()), 0x7F80);  // overflows to Inf
  EXPECT_EQ(bf16_from_float(-std::numeric_limits<float>::quiet_NaN()), 0x7FFF);
  EXPECT_EQ(bf16_from_float(from_bits(0x00018000u)), 0x0002);  // denormal tie -> even
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    auto const b = static_cast<uint16_t>(bits);
    float const value = bf16_to_float(b);
    if (!std::isnan(value)) EXPECT_EQ(bf16_from_float(value), b) << bits;
  }
}

// The device's e2m1 conversion on sm_90 (one rounding fp32 addition) against the host codec's midpoint compares, on
// every fp32 bit pattern but the NaNs (the quantizers never convert one: a block holding an Inf or a NaN gets a NaN
// scale and zero codes): infinities, subnormals, every tie.
TEST(QuantElement, E2m1ByRoundingMatchesTheCodecOnEveryFloat) {
  uint64_t mismatches = 0;
  uint64_t checked = 0;
  uint32_t first_bad = 0;
  for (uint64_t bits = 0; bits <= 0xFFFFFFFFull; ++bits) {
    float const x = from_bits(static_cast<uint32_t>(bits));
    if (std::isnan(x)) continue;
    ++checked;
    if (e2m1_code_not_nan(x) != e2m1_from_float(x) && mismatches++ == 0) first_bad = static_cast<uint32_t>(bits);
  }
  EXPECT_EQ(checked, 0x100000000ull - 2 * 0x7FFFFFull);  // every pattern but the 2 (2^23 - 1) NaNs
  EXPECT_EQ(mismatches, 0u) << "first mismatch at bits 0x" << std::hex << first_bad << ": "
                            << e2m1_code_not_nan(from_bits(first_bad)) << " vs "
                            << int(e2m1_from_float(from_bits(first_bad)));
}

#if FERRY_HAVE_CUDA
// Every bf16 value (as fp32), then random fp32 bit patterns (the codecs convert x * 1/scale, which is no bf16).
std::vector<float> cuda_comparison_inputs(std::mt19937_64& rng) {
  std::vector<float> inputs;
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) inputs.push_back(from_bits(bits << 16));
  std::uniform_int_distribution<uint32_t> any;
  std::uniform_int_distribution<int> binade(-20, 12);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  for (int i = 0; i < 1 << 20; ++i) inputs.push_back(from_bits(any(rng)));
  // Dense where e4m3 and e2m1 live, where most of the random bit patterns are not.
  for (int i = 0; i < 1 << 20; ++i) inputs.push_back((i % 2 ? -1.0f : 1.0f) * std::ldexp(mantissa(rng), binade(rng)));
  return inputs;
}
#endif

TEST(QuantElement, MatchCudaConversionsOnEveryBf16Input) {
#if !FERRY_HAVE_CUDA
  GTEST_SKIP() << "needs the CUDA headers (cuda_fp8.h, cuda_fp4.h): built with FERRY_ENABLE_CUDA=OFF";
#else
  std::mt19937_64 rng(test::test_seed() ^ 0xc0da);
  int mismatches = 0;
  for (float const x : cuda_comparison_inputs(rng)) {
    uint8_t const e4m3 = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    uint8_t const e2m1 = __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest);
    uint8_t const ue8m0 = __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundPosInf);
    uint16_t const bf16 = __nv_bfloat16_raw(__float2bfloat16_rn(x)).x;
    bool const ok = e4m3_from_float(x) == e4m3 && e2m1_from_float(x) == e2m1 && ue8m0_from_float_ceil(x) == ue8m0 &&
                    bf16_from_float(x) == bf16;
    if (!ok && ++mismatches <= 10)
      ADD_FAILURE() << "x bits 0x" << std::hex << to_bits(x) << ": e4m3 " << int(e4m3_from_float(x)) << " vs cuda "
                    << int(e4m3) << ", e2m1 " << int(e2m1_from_float(x)) << " vs " << int(e2m1) << ", ue8m0 "
                    << int(ue8m0_from_float_ceil(x)) << " vs " << int(ue8m0) << ", bf16 " << bf16_from_float(x)
                    << " vs " << bf16;
  }
  EXPECT_EQ(mismatches, 0);
  // Decoding: every code.
  for (int code = 0; code < 256; ++code) {
    float const cuda = __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<uint8_t>(code), __NV_E4M3)));
    float const host = e4m3_to_float(static_cast<uint8_t>(code));
    if (std::isnan(cuda))
      EXPECT_TRUE(std::isnan(host)) << code;
    else
      EXPECT_EQ(to_bits(host), to_bits(cuda)) << code;
    float const cuda_ue8m0 = __bfloat162float(__nv_bfloat16(__nv_cvt_e8m0_to_bf16raw(static_cast<uint8_t>(code))));
    if (std::isnan(cuda_ue8m0))
      EXPECT_TRUE(std::isnan(ue8m0_to_float(static_cast<uint8_t>(code)))) << code;
    else
      EXPECT_EQ(to_bits(ue8m0_to_float(static_cast<uint8_t>(code))), to_bits(cuda_ue8m0)) << code;
  }
  for (int code = 0; code < 16; ++code) {
    float const cuda = __half2float(__half(__nv_cvt_fp4_to_halfraw(static_cast<uint8_t>(code), __NV_E2M1)));
    EXPECT_EQ(to_bits(e2m1_to_float(static_cast<uint8_t>(code))), to_bits(cuda)) << code;
  }
#endif
}

// ---- rows ----------------------------------------------------------------------------------------------------------

struct RoundTrip {
  std::vector<uint8_t> wire;
  std::vector<float> y;       // dequantized to fp32
  std::vector<uint16_t> y16;  // dequantized to bf16
};

RoundTrip round_trip(WireFormat format, float const* x, int hidden) {
  RoundTrip result;
  result.wire.assign(wire_row_bytes(format, hidden), 0xCD);
  quantize_row(format, x, hidden, result.wire.data());
  result.y.resize(static_cast<std::size_t>(hidden));
  result.y16.resize(static_cast<std::size_t>(hidden));
  dequantize_row(format, result.wire.data(), hidden, result.y.data());
  dequantize_row(format, result.wire.data(), hidden, result.y16.data());
  return result;
}

TEST(QuantRow, RoundTripStaysWithinTheDerivedBound) {
  std::mt19937_64 rng(test::test_seed() ^ 0xb0);
  for (WireFormat format : kAllFormats) {
    int const block = wire_block_elems(format);
    int const hidden = 7168;
    int const rows = 48;
    ErrorBound const to_f32 = quant_error_bound(format, DequantTo::f32);
    ErrorBound const to_bf16 = quant_error_bound(format, DequantTo::bf16);
    // The bound must be tight enough to mean something: the worst element comes close to it.
    double worst_f32 = 0, worst_bf16 = 0;
    for (bool bf16_values : {false, true}) {
      std::vector<float> const x = random_rows(rng, rows, hidden, std::max(block, 16), bf16_values);
      for (int r = 0; r < rows; ++r) {
        float const* xr = x.data() + static_cast<std::size_t>(r) * hidden;
        RoundTrip const rt = round_trip(format, xr, hidden);
        Amaxes const a = amaxes(xr, hidden, block);
        for (int i = 0; i < hidden; ++i) {
          double const xi = xr[i];
          double const b32 = to_f32.at(std::fabs(xi), a.block[i], a.row);
          double const b16 = to_bf16.at(std::fabs(xi), a.block[i], a.row);
          double const e32 = std::fabs(static_cast<double>(rt.y[i]) - xi);
          double const e16 = std::fabs(static_cast<double>(bf16_to_float(rt.y16[i])) - xi);
          ASSERT_LE(e32, b32 * kBoundEvalSlack)
              << wire_format_name(format) << " row " << r << " element " << i << " x=" << xi << " y=" << rt.y[i];
          ASSERT_LE(e16, b16 * kBoundEvalSlack)
              << wire_format_name(format) << " row " << r << " element " << i << " x=" << xi;
          worst_f32 = std::max(worst_f32, e32 / b32);
          worst_bf16 = std::max(worst_bf16, e16 / b16);
        }
      }
    }
    std::printf("%-9s worst error / bound: %.3f (fp32 out), %.3f (bf16 out)\n", wire_format_name(format), worst_f32,
                worst_bf16);
    EXPECT_GT(worst_f32, 0.5) << wire_format_name(format) << ": the fp32 bound is loose on random data";
    EXPECT_GT(worst_bf16, 0.5) << wire_format_name(format) << ": the bf16 bound is loose on random data";
  }
}

// The worst cases of the derivation are reached: the relative bounds 1/17 (e4m3) and 1/5 (e2m1) are attained at the
// midpoints just above a power of two and below the largest value.
TEST(QuantRow, BoundsAreAttained) {
  // fp8, amax 448: scale 1; 1.0625 is the midpoint 1 | 1.125 and rounds to 1: error 1.0625 / 17.
  std::vector<float> x(128, 0.0f);
  x[0] = 448.0f;
  x[1] = 1.0625f;
  for (WireFormat format : {WireFormat::fp8_e4m3, WireFormat::fp8_e4m3_ue8m0}) {
    RoundTrip const rt = round_trip(format, x.data(), 128);
    EXPECT_EQ(rt.y[0], 448.0f);
    EXPECT_EQ(rt.y[1], 1.0f);
    EXPECT_DOUBLE_EQ(1.0625 - rt.y[1], 1.0625 / 17.0);
    EXPECT_LE(1.0625 - rt.y[1], quant_error_bound(format, DequantTo::f32).at(1.0625, 448, 448));
  }
  // mxfp4, amax 6: scale 1; 5 is the midpoint 4 | 6 and rounds to 4: error 5 / 5. 0.25 rounds to 0: error s / 4.
  std::vector<float> m(32, 0.0f);
  m[0] = 6.0f;
  m[1] = 5.0f;
  m[2] = 0.25f;
  RoundTrip const rt = round_trip(WireFormat::mxfp4, m.data(), 32);
  EXPECT_EQ(rt.wire[wire_row_layout(WireFormat::mxfp4, 32).scales_offset], 127);  // 2^0
  EXPECT_EQ(rt.y[0], 6.0f);
  EXPECT_EQ(rt.y[1], 4.0f);
  EXPECT_EQ(rt.y[2], 0.0f);
  // nvfp4, row amax 2688 (token scale 1); block 0 with amax 24: block scale 4 (effective 4, a power of two, so
  // 20 / 4 = 5 exactly), 20 is the midpoint 4 | 6 times 4 and rounds to 16.
  std::vector<float> n(32, 0.0f);
  n[0] = 24.0f;
  n[1] = 20.0f;
  n[16] = 2688.0f;
  RoundTrip const nv = round_trip(WireFormat::nvfp4, n.data(), 32);
  WireRowLayout const layout = wire_row_layout(WireFormat::nvfp4, 32);
  EXPECT_EQ(load_float(nv.wire.data() + layout.token_scale_offset), 1.0f);
  EXPECT_EQ(nv.wire[layout.scales_offset], 0x48);      // e4m3 4.0
  EXPECT_EQ(nv.wire[layout.scales_offset + 1], 0x7E);  // e4m3 448
  EXPECT_EQ(nv.y[0], 24.0f);
  EXPECT_EQ(nv.y[1], 16.0f);
  EXPECT_EQ(nv.y[16], 2688.0f);
}

TEST(QuantRow, ScalesFollowTheDocumentedRules) {
  std::vector<float> x(128, 0.0f);
  x[7] = -3.0f;  // amax 3
  // fp8: fp32 scale = amax / 448
  RoundTrip rt = round_trip(WireFormat::fp8_e4m3, x.data(), 128);
  EXPECT_EQ(load_float(rt.wire.data() + 128), 3.0f / 448.0f);
  EXPECT_EQ(rt.y[7], -3.0f);  // amax maps to 448 and back
  // fp8 UE8M0: 2^ceil(log2(3 / 448)) = 2^-7
  rt = round_trip(WireFormat::fp8_e4m3_ue8m0, x.data(), 128);
  EXPECT_EQ(rt.wire[128], 127 - 7);
  EXPECT_EQ(rt.y[7], -3.0f);  // 3 * 2^7 = 384 is an e4m3 value
  // mxfp4: 2^ceil(log2(3 / 6)) = 2^-1
  rt = round_trip(WireFormat::mxfp4, x.data(), 32);
  EXPECT_EQ(rt.wire[16], 127 - 1);
  EXPECT_EQ(rt.y[7], -3.0f);
  // nvfp4: token scale = row amax / 2688; block scale e4m3(block amax / (6 * token scale))
  std::vector<float> n(32, 0.0f);
  n[0] = 2688.0f;  // block 0: amax 2688 -> block scale 448
  n[20] = 30.0f;   // block 1: amax 30 -> 30 / 6 = 5 -> e4m3 5.0 (0x4A)
  rt = round_trip(WireFormat::nvfp4, n.data(), 32);
  WireRowLayout const layout = wire_row_layout(WireFormat::nvfp4, 32);
  EXPECT_EQ(load_float(rt.wire.data() + layout.token_scale_offset), 1.0f);
  EXPECT_EQ(rt.wire[layout.scales_offset + 0], 0x7E);
  EXPECT_EQ(rt.wire[layout.scales_offset + 1], 0x4A);
  EXPECT_EQ(rt.y[20], 30.0f);
}

TEST(QuantRow, Bf16InputGivesTheBytesOfTheSameFloats) {
  std::mt19937_64 rng(test::test_seed() ^ 0xbf);
  for (WireFormat format : kAllFormats) {
    int const hidden = 2048;
    std::vector<float> const x = random_rows(rng, 1, hidden, 128, true);
    std::vector<uint16_t> x16(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) x16[i] = bf16_from_float(x[i]);
    std::vector<uint8_t> a(wire_row_bytes(format, hidden), 0x11), b(a.size(), 0x22);
    quantize_row(format, x.data(), hidden, a.data());
    quantize_row(format, x16.data(), hidden, b.data());
    EXPECT_EQ(a, b) << wire_format_name(format);
  }
  // bf16 in, bf16 wire, bf16 out: exact.
  std::vector<uint16_t> in(64), out(64);
  for (int i = 0; i < 64; ++i) in[i] = static_cast<uint16_t>(0x3F80 + 37 * i);
  std::vector<uint8_t> wire(wire_row_bytes(WireFormat::bf16, 64));
  quantize_row(WireFormat::bf16, in.data(), 64, wire.data());
  dequantize_row(WireFormat::bf16, wire.data(), 64, out.data());
  EXPECT_EQ(in, out);
}

TEST(QuantRow, PaddingBytesAreZero) {
  std::mt19937_64 rng(test::test_seed() ^ 0x9ad);
  for (WireFormat format : kAllFormats) {
    for (int hidden : {std::max(wire_block_elems(format), 8) * 3, 7168}) {
      std::vector<float> const x = random_rows(rng, 1, hidden, wire_block_elems(format), false);
      RoundTrip const rt = round_trip(format, x.data(), hidden);
      WireRowLayout const layout = wire_row_layout(format, hidden);
      std::size_t const scales_end = layout.scales_offset + static_cast<std::size_t>(layout.num_scales) *
                                                                static_cast<std::size_t>(layout.scale_bytes);
      for (std::size_t i = 0; i < layout.row_bytes; ++i) {
        bool const data =
            i < layout.payload_bytes || (i >= layout.scales_offset && i < scales_end) ||
            (layout.has_token_scale && i >= layout.token_scale_offset && i < layout.token_scale_offset + 4);
        if (!data) ASSERT_EQ(rt.wire[i], 0) << wire_format_name(format) << " hidden " << hidden << " byte " << i;
      }
    }
  }
}

TEST(QuantRow, ZerosComeBackExactlyWithTheirSign) {
  for (WireFormat format : kAllFormats) {
    int const hidden = 256;
    std::vector<float> x(hidden);
    for (int i = 0; i < hidden; ++i) x[i] = i % 2 ? -0.0f : 0.0f;
    RoundTrip const rt = round_trip(format, x.data(), hidden);
    for (int i = 0; i < hidden; ++i) {
      ASSERT_EQ(to_bits(rt.y[i]), to_bits(x[i])) << wire_format_name(format) << " element " << i;
      ASSERT_EQ(rt.y16[i], bf16_from_float(x[i])) << wire_format_name(format) << " element " << i;
    }
    WireRowLayout const layout = wire_row_layout(format, hidden);
    uint8_t const* scales = rt.wire.data() + layout.scales_offset;
    switch (format) {
      case WireFormat::fp8_e4m3:
        EXPECT_EQ(load_float(scales), 0x1p-126f);  // the smallest scale, never 0
        break;
      case WireFormat::fp8_e4m3_ue8m0:
      case WireFormat::mxfp4:
        EXPECT_EQ(scales[0], 1);  // 2^-126
        break;
      case WireFormat::nvfp4:
        EXPECT_EQ(load_float(rt.wire.data() + layout.token_scale_offset), 0x1p-117f);
        EXPECT_EQ(scales[0], 0);
        break;
      case WireFormat::bf16:
        break;
    }
  }
}

TEST(QuantRow, DenormalsStayWithinTheBoundAndScalesStayNormal) {
  // bf16 denormals (2^-133 .. 2^-127) alone in a row, next to normals in a block, and fp32 denormals.
  std::vector<float> x(256);
  for (int i = 0; i < 256; ++i) {
    float const sign = i % 3 ? 1.0f : -1.0f;
    if (i < 128)
      x[i] = sign * bf16_to_float(static_cast<uint16_t>(1 + (i * 37) % 127));  // bf16 denormals
    else if (i < 192)
      x[i] = sign * from_bits(static_cast<uint32_t>(1 + i * 9973));  // fp32 denormals
    else
      x[i] = sign * (i == 200 ? 3.0f : from_bits(static_cast<uint32_t>(i * 1234567)));
  }
  for (WireFormat format : kAllFormats) {
    RoundTrip const rt = round_trip(format, x.data(), 256);
    Amaxes const a = amaxes(x.data(), 256, wire_block_elems(format));
    ErrorBound const bound = quant_error_bound(format, DequantTo::f32);
    ErrorBound const bound16 = quant_error_bound(format, DequantTo::bf16);
    for (int i = 0; i < 256; ++i) {
      EXPECT_LE(std::fabs(static_cast<double>(rt.y[i]) - x[i]), bound.at(std::fabs(x[i]), a.block[i], a.row))
          << wire_format_name(format) << " element " << i;
      EXPECT_LE(std::fabs(static_cast<double>(bf16_to_float(rt.y16[i])) - x[i]),
                bound16.at(std::fabs(x[i]), a.block[i], a.row))
          << wire_format_name(format) << " element " << i;
    }
    WireRowLayout const layout = wire_row_layout(format, 256);
    for (int j = 0; j < layout.num_scales; ++j) {
      uint8_t const* s = rt.wire.data() + layout.scales_offset + j * layout.scale_bytes;
      if (format == WireFormat::fp8_e4m3) EXPECT_TRUE(std::isnormal(load_float(s))) << j;
      if (format == WireFormat::fp8_e4m3_ue8m0 || format == WireFormat::mxfp4) EXPECT_GE(*s, 1) << j;
    }
  }
  // A block of bf16 denormals gets the UE8M0 scale 2^-126; 2^-133 and -2^-130 are e4m3 values times it.
  std::vector<float> d(128, 0.0f);
  d[0] = 0x1p-133f;
  d[1] = -0x1p-130f;
  RoundTrip const rt = round_trip(WireFormat::fp8_e4m3_ue8m0, d.data(), 128);
  EXPECT_EQ(rt.y[0], 0x1p-133f);
  EXPECT_EQ(rt.y[1], -0x1p-130f);
}

// The bounds hold up to |x| < 2^127 (half of fp32's and bf16's range): the largest bf16 below it, 0x7EFF, stays
// finite through every format and both outputs.
TEST(QuantRow, LargeValuesUpTo2Pow127StayFiniteAndBounded) {
  float const big = bf16_to_float(0x7EFF);
  ASSERT_LT(big, 0x1p127f);
  std::vector<float> x(256);
  for (int i = 0; i < 256; ++i) x[i] = (i % 2 ? -big : big) / static_cast<float>(1 + i % 5);
  for (WireFormat format : kAllFormats) {
    RoundTrip const rt = round_trip(format, x.data(), 256);
    Amaxes const a = amaxes(x.data(), 256, wire_block_elems(format));
    ErrorBound const bound = quant_error_bound(format, DequantTo::bf16);
    for (int i = 0; i < 256; ++i) {
      float const y = bf16_to_float(rt.y16[i]);
      ASSERT_TRUE(std::isfinite(y) && std::isfinite(rt.y[i])) << wire_format_name(format) << " element " << i;
      EXPECT_LE(std::fabs(static_cast<double>(y) - x[i]), bound.at(std::fabs(x[i]), a.block[i], a.row))
          << wire_format_name(format) << " element " << i;
    }
  }
}

// NaN and Inf: fp8 formats turn that element into e4m3's NaN and quantize the rest as if it were 0; e2m1 has no NaN, so
// fp4 formats give the whole block a NaN scale (and zero codes); every other block, and nvfp4's token scale, are
// those of the row with the element set to 0.
TEST(QuantRow, NonFiniteInputsBecomeNaNWithoutTouchingOtherBlocks) {
  std::mt19937_64 rng(test::test_seed() ^ 0x4a4);
  float const specials[] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
  for (WireFormat format : kAllFormats) {
    int const hidden = 512;
    int const block = wire_block_elems(format);
    for (float special : specials) {
      std::vector<float> x = random_rows(rng, 1, hidden, std::max(block, 16), false);
      int const idx = 37;
      x[idx] = 0.0f;
      RoundTrip const clean = round_trip(format, x.data(), hidden);
      x[idx] = special;
      RoundTrip const dirty = round_trip(format, x.data(), hidden);
      WireRowLayout const layout = wire_row_layout(format, hidden);
      SCOPED_TRACE(std::string(wire_format_name(format)) + " special " + std::to_string(special));
      for (int i = 0; i < hidden; ++i) {
        bool const poisoned =
            format == WireFormat::nvfp4 || format == WireFormat::mxfp4 ? i / block == idx / block : i == idx;
        if (poisoned) {
          if (format == WireFormat::bf16 && std::isinf(special)) {
            EXPECT_EQ(dirty.y[i], special);  // bf16 carries Inf
            continue;
          }
          EXPECT_TRUE(std::isnan(dirty.y[i])) << "element " << i;
          EXPECT_EQ(dirty.y16[i], kBf16Nan) << "element " << i;
        } else {
          ASSERT_EQ(to_bits(dirty.y[i]), to_bits(clean.y[i])) << "element " << i;
        }
      }
      if (format == WireFormat::fp8_e4m3 || format == WireFormat::fp8_e4m3_ue8m0) {
        EXPECT_EQ(dirty.wire[idx], kE4m3Nan);
        for (std::size_t b = 0; b < dirty.wire.size(); ++b)
          if (b != static_cast<std::size_t>(idx)) ASSERT_EQ(dirty.wire[b], clean.wire[b]) << "byte " << b;
      }
      if (format == WireFormat::nvfp4 || format == WireFormat::mxfp4) {
        int const j = idx / block;
        EXPECT_EQ(dirty.wire[layout.scales_offset + j], format == WireFormat::nvfp4 ? kE4m3Nan : kUe8m0Nan);
        for (int i = j * block; i < (j + 1) * block; i += 2)
          EXPECT_EQ(dirty.wire[i / 2], 0) << "payload byte " << i / 2;
        if (layout.has_token_scale)
          EXPECT_EQ(load_float(dirty.wire.data() + layout.token_scale_offset),
                    load_float(clean.wire.data() + layout.token_scale_offset));
      }
    }
  }
}

// ---- combine -------------------------------------------------------------------------------------------------------

TEST(QuantCombine, SumOfQuantizedTermsStaysWithinTheDerivedBound) {
  std::mt19937_64 rng(test::test_seed() ^ 0xc0b);
  int const hidden = 1024;
  for (WireFormat format : kAllFormats) {
    int const block = wire_block_elems(format);
    for (int terms : {1, 2, 3, 8, 16}) {
      ErrorBound const bound = combine_error_bound(format, terms);
      for (int trial = 0; trial < 4; ++trial) {
        // Terms of different magnitudes (ranks with few or many experts of the token), some cancelling.
        std::vector<float> const x = random_rows(rng, terms, hidden, std::max(block, 16), false);
        std::vector<float> sum_forward(hidden, 0.0f), sum_backward(hidden, 0.0f);
        std::vector<double> exact(hidden, 0.0), sum_abs(hidden, 0.0), sum_block(hidden, 0.0);
        double sum_row = 0;
        std::vector<std::vector<float>> deq(static_cast<std::size_t>(terms));
        for (int t = 0; t < terms; ++t) {
          float const* xt = x.data() + static_cast<std::size_t>(t) * hidden;
          deq[t] = round_trip(format, xt, hidden).y;
          Amaxes const a = amaxes(xt, hidden, block);
          sum_row += a.row;
          for (int i = 0; i < hidden; ++i) {
            exact[i] += xt[i];
            sum_abs[i] += std::fabs(static_cast<double>(xt[i]));
            sum_block[i] += a.block[i];
          }
        }
        for (int t = 0; t < terms; ++t)
          for (int i = 0; i < hidden; ++i) {
            sum_forward[i] += deq[t][i];
            sum_backward[i] += deq[terms - 1 - t][i];
          }
        for (int i = 0; i < hidden; ++i) {
          double const limit = bound.at(sum_abs[i], sum_block[i], sum_row) * kBoundEvalSlack;
          for (float s : {sum_forward[i], sum_backward[i]}) {
            double const y = bf16_to_float(bf16_from_float(s));
            ASSERT_LE(std::fabs(y - exact[i]), limit)
                << wire_format_name(format) << " terms " << terms << " element " << i;
          }
        }
      }
    }
  }
  EXPECT_THROW(combine_error_bound(WireFormat::fp8_e4m3, 0), InputError);
}

TEST(QuantCombine, BoundsGrowWithTermsAndOutputRounding) {
  for (WireFormat format : kAllFormats) {
    ErrorBound const f32 = quant_error_bound(format, DequantTo::f32);
    ErrorBound const b16 = quant_error_bound(format, DequantTo::bf16);
    EXPECT_GE(b16.rel, f32.rel);
    ErrorBound const one = combine_error_bound(format, 1);
    ErrorBound const many = combine_error_bound(format, 64);
    EXPECT_GE(one.rel, f32.rel + 1.0 / 257.0);  // at least the final bf16 rounding
    EXPECT_GT(many.rel, one.rel);
    EXPECT_GE(many.floor, one.floor);
  }
  // The per-element relative terms are the formats' rounding errors: 1/17 for e4m3, 1/5 for e2m1, 1/257 for bf16.
  EXPECT_NEAR(quant_error_bound(WireFormat::fp8_e4m3, DequantTo::f32).rel, 1.0 / 17.0, 1e-6);
  EXPECT_DOUBLE_EQ(quant_error_bound(WireFormat::fp8_e4m3_ue8m0, DequantTo::f32).rel, 1.0 / 17.0);
  EXPECT_NEAR(quant_error_bound(WireFormat::nvfp4, DequantTo::f32).rel, 0.2, 1e-6);
  EXPECT_DOUBLE_EQ(quant_error_bound(WireFormat::mxfp4, DequantTo::f32).rel, 0.2);
  EXPECT_DOUBLE_EQ(quant_error_bound(WireFormat::bf16, DequantTo::f32).rel, 1.0 / 257.0);
}

}  // namespace
}  // namespace ferry::wire
