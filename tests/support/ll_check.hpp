// How the low-latency GPU tests compare one rank's outputs with the reference (src/ep/reference.hpp), bit for bit:
// the dispatch's rank-major metadata and expert-major layout (bf16 rows, dequantized rows, or quantized payload +
// scale tensors + nvfp4 token scales), and a combine's y with the poisoned guard behind it. Shared by the
// multi-process tests (test_ll.cpp, test_ll_quant.cpp: an EpBuffer's DispatchResult) and the virtual-rank test
// (test_ll_virtual.cu: the backend's Buffers). Each check returns 0, or prints the first mismatch (fail()) and
// returns the failing exit code.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "ep/reference.hpp"
#include "ferry/ep.hpp"
#include "ferry/wire_format.hpp"
#include "support/gpu_case.hpp"

#if FERRY_HAVE_CUDA

namespace ferry::test {

// Bytes of one row's scales in a pre-quantized input or a scale tensor entry: fp32 for fp8_e4m3, one byte otherwise.
inline int scale_entry_bytes(WireFormat format) {
  return format == WireFormat::fp8_e4m3 ? 4 : 1;
}

// Poisons (0xEE) what a dispatch writes: the metadata, expert_x, the scale entries of every slot (not the padding,
// which the kernels never write and must stay zero) and the token scales.
// recv_slot: [recv_capacity, topk] (not in a DispatchResult; the virtual-rank test has it), or null.
inline void poison_ll_dispatch(EpConfig const& config, int world, DispatchResult const& out,
                               int32_t* recv_slot = nullptr) {
  int const num_local = config.num_local_experts(world);
  int const slots = config.expert_slots();
  std::size_t const rows = static_cast<std::size_t>(num_local) * slots;
  std::size_t const entries = static_cast<std::size_t>(config.recv_capacity(world)) * config.topk;
  CK(cudaMemset(out.num_recv, 0xEE, 4));
  CK(cudaMemset(out.recv_topk_idx, 0xEE, entries * 4));
  CK(cudaMemset(out.recv_topk_weights, 0xEE, entries * 4));
  CK(cudaMemset(out.recv_src, 0xEE, static_cast<std::size_t>(config.recv_capacity(world)) * 8));
  if (recv_slot) CK(cudaMemset(recv_slot, 0xEE, entries * 4));
  CK(cudaMemset(out.expert_x, 0xEE, rows * config.recv_row_bytes()));
  CK(cudaMemset(out.expert_src_row, 0xEE, rows * 4));
  CK(cudaMemset(out.expert_counts, 0xEE, static_cast<std::size_t>(num_local) * 4));
  if (!config.delivers_quantized()) return;
  WireFormat const format = config.dispatch_format;
  std::size_t const tensor = scale_tensor_bytes(format, config.recv_scale_layout, slots, config.hidden);
  auto scales = to_host<uint8_t>(out.expert_scales, static_cast<std::size_t>(num_local) * tensor);
  int const num_scales = config.hidden / wire_block_elems(format);
  for (int e = 0; e < num_local; ++e)
    for (int s = 0; s < slots; ++s)
      for (int j = 0; j < num_scales; ++j) {
        std::size_t const at = scale_byte_offset(format, config.recv_scale_layout, slots, config.hidden, s, j);
        std::memset(scales.data() + static_cast<std::size_t>(e) * tensor + at, 0xEE, scale_entry_bytes(format));
      }
  CK(cudaMemcpy(out.expert_scales, scales.data(), scales.size(), cudaMemcpyHostToDevice));
  if (out.expert_token_scales) CK(cudaMemset(out.expert_token_scales, 0xEE, rows * 4));
}

// The quantized expert-major delivery against the reference: per local expert, ref::deliver of its expanded wire
// rows (payload of the filled slots; every byte of the scale tensor but the entries of unfilled slots, which are
// unspecified, so the zero padding is compared too; nvfp4's token scales of the filled slots).
inline int check_ll_quantized_delivery(EpConfig const& config, int world, int rank, int iter,
                                       ref::RankDispatch const& mine, DispatchResult const& got) {
  int const hidden = config.hidden;
  int const num_local = config.num_local_experts(world);
  int const slots = config.expert_slots();
  WireFormat const format = config.dispatch_format;
  std::size_t const wire_bytes = wire_row_bytes(format, hidden);
  std::size_t const payload = wire_payload_bytes(format, hidden);
  std::size_t const tensor = scale_tensor_bytes(format, config.recv_scale_layout, slots, hidden);
  int const num_scales = hidden / wire_block_elems(format);
  bool const nvfp4 = format == WireFormat::nvfp4;
  if (got.expert_scales == nullptr) return fail("expert_scales null", rank, iter, 0);
  if (nvfp4 != (got.expert_token_scales != nullptr)) return fail("expert_token_scales presence", rank, iter, 0);
  auto const wire = ref::expand_wire(config, world, mine);
  auto const ex = to_host<uint8_t>(got.expert_x, static_cast<std::size_t>(num_local) * slots * payload);
  auto const sc = to_host<uint8_t>(got.expert_scales, static_cast<std::size_t>(num_local) * tensor);
  std::vector<float> ts;
  if (nvfp4) ts = to_host<float>(got.expert_token_scales, static_cast<std::size_t>(num_local) * slots);
  std::vector<uint8_t> unfilled(tensor);
  long d;
  for (int e = 0; e < num_local; ++e) {
    int const filled = std::min(mine.expert_counts[e], slots);
    ref::DeliveredRows const want =
        ref::deliver(config,
                     std::span<uint8_t const>(wire.data() + static_cast<std::size_t>(e) * slots * wire_bytes,
                                              static_cast<std::size_t>(slots) * wire_bytes),
                     filled, slots);
    std::size_t const x0 = static_cast<std::size_t>(e) * slots * payload;
    if ((d = first_diff(ex.data() + x0, want.payload.data(), static_cast<std::size_t>(filled) * payload)) >= 0)
      return fail("expert_x payload", rank, iter, static_cast<long>(x0) + d);
    std::fill(unfilled.begin(), unfilled.end(), 0);
    for (int s = filled; s < slots; ++s)
      for (int j = 0; j < num_scales; ++j) {
        std::size_t const at = scale_byte_offset(format, config.recv_scale_layout, slots, hidden, s, j);
        std::fill_n(unfilled.begin() + static_cast<long>(at), scale_entry_bytes(format), 1);
      }
    uint8_t const* scales = sc.data() + static_cast<std::size_t>(e) * tensor;
    for (std::size_t i = 0; i < tensor; ++i)
      if (!unfilled[i] && scales[i] != want.scales[i])
        return fail("expert_scales", rank, iter, static_cast<long>(static_cast<std::size_t>(e) * tensor + i));
    if (nvfp4 && (d = first_diff(ts.data() + static_cast<std::size_t>(e) * slots, want.token_scales.data(),
                                 static_cast<std::size_t>(filled))) >= 0)
      return fail("expert_token_scales", rank, iter, static_cast<long>(e) * slots + d);
  }
  return 0;
}

// Everything one rank's LL dispatch delivered against the reference's `mine`: num_recv, the rank-major metadata of
// the num_recv rows (and recv_slot where given: not in a DispatchResult), expert_counts, expert_src_row, and the filled
// slots of expert_x (bf16 rows, the dequantized rows, or the quantized delivery).
inline int check_ll_dispatch(EpConfig const& config, int world, int rank, int iter, ref::RankDispatch const& mine,
                             DispatchResult const& got, int32_t const* recv_slot = nullptr) {
  int const hidden = config.hidden;
  int const topk = config.topk;
  int const num_local = config.num_local_experts(world);
  int const slots = config.expert_slots();
  int32_t const num_recv = to_host<int32_t>(got.num_recv, 1)[0];
  if (num_recv != mine.num_recv) return fail("num_recv", rank, iter, num_recv);
  std::size_t const entries = static_cast<std::size_t>(num_recv) * topk;
  long d;
  auto const ri = to_host<int32_t>(got.recv_topk_idx, entries);
  if ((d = first_diff(ri.data(), mine.recv_topk_idx.data(), ri.size())) >= 0)
    return fail("recv_topk_idx", rank, iter, d);
  auto const rw = to_host<float>(got.recv_topk_weights, entries);
  if ((d = first_diff(rw.data(), mine.recv_topk_weights.data(), rw.size())) >= 0)
    return fail("recv_topk_weights", rank, iter, d);
  auto const rs = to_host<int32_t>(got.recv_src, static_cast<std::size_t>(num_recv) * 2);
  if ((d = first_diff(rs.data(), mine.recv_src.data(), rs.size())) >= 0) return fail("recv_src", rank, iter, d);
  if (recv_slot) {
    auto const slot = to_host<int32_t>(recv_slot, entries);
    if ((d = first_diff(slot.data(), mine.recv_slot.data(), slot.size())) >= 0) return fail("recv_slot", rank, iter, d);
  }
  auto const ec = to_host<int32_t>(got.expert_counts, num_local);
  if ((d = first_diff(ec.data(), mine.expert_counts.data(), ec.size())) >= 0)
    return fail("expert_counts", rank, iter, d);
  auto const esr = to_host<int32_t>(got.expert_src_row, static_cast<std::size_t>(num_local) * slots);
  if ((d = first_diff(esr.data(), mine.expert_src_row.data(), esr.size())) >= 0)
    return fail("expert_src_row", rank, iter, d);

  if (config.delivers_quantized()) return check_ll_quantized_delivery(config, world, rank, iter, mine, got);
  // bf16 rows: the bf16 input, or the dequantized wire rows (the reference's recv_x)
  auto const ex_ref = ref::expand(config, world, mine);
  auto const ex = to_host<uint16_t>(got.expert_x, ex_ref.size());
  for (int e = 0; e < num_local; ++e) {
    std::size_t const filled = static_cast<std::size_t>(std::min(mine.expert_counts[e], slots)) * hidden;
    std::size_t const first = static_cast<std::size_t>(e) * slots * hidden;
    if ((d = first_diff(ex.data() + first, ex_ref.data() + first, filled)) >= 0)
      return fail(config.dispatch_dequantize ? "expert_x (dequantized)" : "expert_x", rank, iter,
                  static_cast<long>(first) + d);
  }
  if (got.expert_scales != nullptr) return fail("expert_scales set without quantized delivery", rank, iter, 0);
  return 0;
}

// A combine's y (device, [want.size()] bf16) against the reference, and the `guard` elements behind it, which must
// still hold the poison (0xEEEE). what: "y expert-major", "y rank-major".
inline int check_combined(char const* what, void const* y, std::vector<uint16_t> const& want, std::size_t guard,
                          int rank, int iter) {
  auto const got = to_host<uint16_t>(y, want.size() + guard);
  long d;
  if ((d = first_diff(got.data(), want.data(), want.size())) >= 0) return fail(what, rank, iter, d);
  for (std::size_t i = want.size(); i < got.size(); ++i)
    if (got[i] != 0xEEEE)
      return fail((std::string(what) + " written past num_tokens").c_str(), rank, iter, static_cast<long>(i));
  return 0;
}

}  // namespace ferry::test

#endif  // FERRY_HAVE_CUDA
