// How the normal-mode GPU tests compare one rank's dispatch outputs with the reference (src/ep/reference.hpp), bit
// for bit, bf16 and quantized delivery. Shared by the multi-process tests (test_normal_mode.cpp, test_normal_quant.cpp:
// an EpBuffer's DispatchResult) and the virtual-rank tests (test_normal_virtual.cu, test_internode_virtual.cu: the
// backend's Buffers). Returns 0, or prints the first mismatch (fail()) and returns
// the failing exit code.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
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

// The dispatch protocol an EpBuffer's explain() names against the one a case pinned (protocol: "landing", "counts" or
// "any"): 0, or 1 after printing what explain() said.
inline int check_protocol(EpBuffer const& buffer, std::string const& protocol, int rank) {
  if (protocol == "any") return 0;
  std::string const why = buffer.explain();
  bool const landing = why.find("nvlink-landing") != std::string::npos;
  if (landing == (protocol == "landing")) return 0;
  std::fprintf(stderr, "rank %d: protocol=%s expected, explain: %s\n", rank, protocol.c_str(), why.c_str());
  return 1;
}

// Poisons (0xEE) what a bf16 dispatch writes: recv_x, the metadata and expert_counts, and expert_x when the result
// has it (an expanding dispatch).
inline void poison_normal_dispatch(EpConfig const& config, int world, DispatchResult const& out) {
  std::size_t const cap = static_cast<std::size_t>(config.recv_capacity(world));
  CK(cudaMemset(out.recv_x, 0xEE, cap * config.hidden * 2));
  if (out.expert_x && config.expert_slots() > 0)
    CK(cudaMemset(
        out.expert_x, 0xEE,
        static_cast<std::size_t>(config.num_local_experts(world)) * config.expert_slots() * config.hidden * 2));
  CK(cudaMemset(out.recv_topk_idx, 0xEE, cap * config.topk * 4));
  CK(cudaMemset(out.recv_topk_weights, 0xEE, cap * config.topk * 4));
  CK(cudaMemset(out.recv_src, 0xEE, cap * 8));
  CK(cudaMemset(out.expert_counts, 0xEE, static_cast<std::size_t>(config.num_local_experts(world)) * 4));
}

// recv_topk_idx, recv_topk_weights and recv_src of num_recv rows, and expert_counts, against `mine`.
inline int check_normal_metadata(EpConfig const& config, int world, int rank, int iter, ref::RankDispatch const& mine,
                                 DispatchResult const& result, int num_recv) {
  int const topk = config.topk;
  int const num_local = config.num_local_experts(world);
  long d;
  auto const ri = to_host<int32_t>(result.recv_topk_idx, static_cast<std::size_t>(num_recv) * topk);
  if ((d = first_diff(ri.data(), mine.recv_topk_idx.data(), ri.size())) >= 0)
    return fail("recv_topk_idx", rank, iter, d);
  auto const rw = to_host<float>(result.recv_topk_weights, static_cast<std::size_t>(num_recv) * topk);
  if ((d = first_diff(rw.data(), mine.recv_topk_weights.data(), rw.size())) >= 0)
    return fail("recv_topk_weights", rank, iter, d);
  auto const rs = to_host<int32_t>(result.recv_src, static_cast<std::size_t>(num_recv) * 2);
  if ((d = first_diff(rs.data(), mine.recv_src.data(), rs.size())) >= 0) return fail("recv_src", rank, iter, d);
  auto const ec = to_host<int32_t>(result.expert_counts, num_local);
  if ((d = first_diff(ec.data(), mine.expert_counts.data(), ec.size())) >= 0)
    return fail("expert_counts", rank, iter, d);
  return 0;
}

// The filled slots of each local expert's bf16 rows in expert_x (device) against ref::expand of `mine`.
inline int check_expert_x_bf16(char const* what, EpConfig const& config, int world, int rank, int iter,
                               ref::RankDispatch const& mine, void const* expert_x) {
  int const hidden = config.hidden;
  int const slots = config.expert_slots();
  auto const ex_ref = ref::expand(config, world, mine);
  auto const ex = to_host<uint16_t>(expert_x, ex_ref.size());
  for (int e = 0; e < config.num_local_experts(world); ++e) {
    std::size_t const filled = static_cast<std::size_t>(std::min(mine.expert_counts[e], slots)) * hidden;
    std::size_t const at = static_cast<std::size_t>(e) * slots * hidden;
    if (long const d = first_diff(ex.data() + at, ex_ref.data() + at, filled); d >= 0)
      return fail(what, rank, iter, static_cast<long>(at) + d);
  }
  return 0;
}

// num_recv, recv_x (bf16 rows), recv_topk_idx / weights, recv_src and expert_counts against `mine`; with `poisoned`
// (poison_normal_dispatch ran before the call) the row past the last received one must still hold the poison; with
// `expand`, expert_src_row and the filled slots of expert_x.
inline int check_normal_dispatch(EpConfig const& config, int world, int rank, int iter, ref::RankDispatch const& mine,
                                 DispatchResult const& result, bool poisoned, bool expand) {
  int const hidden = config.hidden;
  int const num_local = config.num_local_experts(world);
  int const cap = config.recv_capacity(world);
  int32_t const num_recv = to_host<int32_t>(result.num_recv, 1)[0];
  if (num_recv != mine.num_recv) return fail("num_recv", rank, iter, num_recv);
  long d;
  auto const rx = to_host<uint16_t>(result.recv_x, static_cast<std::size_t>(num_recv) * hidden);
  if ((d = first_diff(rx.data(), mine.recv_x.data(), rx.size())) >= 0) return fail("recv_x", rank, iter, d);
  if (int const code = check_normal_metadata(config, world, rank, iter, mine, result, num_recv)) return code;
  if (poisoned && num_recv < cap) {  // the row past the last received one was poisoned and must stay so
    auto const past =
        to_host<uint16_t>(static_cast<char*>(result.recv_x) + static_cast<std::size_t>(num_recv) * hidden * 2, hidden);
    for (auto v : past)
      if (v != 0xEEEE) return fail("row past num_recv written", rank, iter, num_recv);
  }
  if (!expand) return 0;
  int const slots = config.expert_slots();
  auto const esr = to_host<int32_t>(result.expert_src_row, static_cast<std::size_t>(num_local) * slots);
  if ((d = first_diff(esr.data(), mine.expert_src_row.data(), esr.size())) >= 0)
    return fail("expert_src_row", rank, iter, d);
  return check_expert_x_bf16("expert_x", config, world, rank, iter, mine, result.expert_x);
}

// ---- quantized delivery (EpConfig::delivers_quantized)
// ----------------------------------------------------------------

// The first (row, block) entry of rows [0, num_rows) where two scale tensors of `tensor_rows` rows in the config's
// recv_scale_layout differ (as row * num_scales + block), or -1.
inline long quant_scale_diff(EpConfig const& config, int tensor_rows, int num_rows, std::vector<uint8_t> const& got,
                             std::vector<uint8_t> const& want) {
  WireRowLayout const wire = wire_row_layout(config.dispatch_format, config.hidden);
  for (int r = 0; r < num_rows; ++r)
    for (int j = 0; j < wire.num_scales; ++j) {
      std::size_t const at =
          scale_byte_offset(config.dispatch_format, config.recv_scale_layout, tensor_rows, config.hidden, r, j);
      if (std::memcmp(got.data() + at, want.data() + at, static_cast<std::size_t>(wire.scale_bytes)) != 0)
        return static_cast<long>(r) * wire.num_scales + j;
    }
  return -1;
}

// Poisons (0xEE) what a quantized-delivery dispatch (and its expand) writes: the payload rows, the scale tensors and
// nvfp4's token scales of recv_* and expert_*, the metadata and expert_counts.
inline void poison_quantized_dispatch(EpConfig const& config, int world, DispatchResult const& out) {
  int const cap = config.recv_capacity(world);
  int const slots = config.expert_slots();
  std::size_t const num_local = static_cast<std::size_t>(config.num_local_experts(world));
  std::size_t const row = config.recv_row_bytes();
  CK(cudaMemset(out.recv_x, 0xEE, static_cast<std::size_t>(cap) * row));
  CK(cudaMemset(out.recv_topk_idx, 0xEE, static_cast<std::size_t>(cap) * config.topk * 4));
  CK(cudaMemset(out.recv_topk_weights, 0xEE, static_cast<std::size_t>(cap) * config.topk * 4));
  CK(cudaMemset(out.recv_src, 0xEE, static_cast<std::size_t>(cap) * 8));
  CK(cudaMemset(out.expert_counts, 0xEE, num_local * 4));
  if (out.recv_scales)
    CK(cudaMemset(out.recv_scales, 0xEE,
                  scale_tensor_bytes(config.dispatch_format, config.recv_scale_layout, cap, config.hidden)));
  if (out.recv_token_scales) CK(cudaMemset(out.recv_token_scales, 0xEE, static_cast<std::size_t>(cap) * 4));
  if (out.expert_x && slots > 0) {
    CK(cudaMemset(out.expert_x, 0xEE, num_local * slots * row));
    if (out.expert_scales)
      CK(cudaMemset(
          out.expert_scales, 0xEE,
          scale_tensor_bytes(config.dispatch_format, config.recv_scale_layout, slots, config.hidden) * num_local));
    if (out.expert_token_scales) CK(cudaMemset(out.expert_token_scales, 0xEE, num_local * slots * 4));
  }
}

// The quantized rows of a dispatch: num_recv rows of payload, scale entries (at their offsets in recv_scale_layout)
// and nvfp4 token scales against ref::deliver of the reference's wire rows; with `poisoned`, the payload row past the
// last received one must still hold the poison; with `expand`, expert_src_row and each expert's filled slots
// (payload, scale tensor entries, token scales) against ref::deliver of ref::expand_wire.
inline int check_quantized_rows(EpConfig const& config, int world, int rank, int iter, ref::RankDispatch const& mine,
                                DispatchResult const& result, int num_recv, bool poisoned, bool expand) {
  int const cap = config.recv_capacity(world);
  int const slots = config.expert_slots();
  int const num_local = config.num_local_experts(world);
  WireRowLayout const wire = wire_row_layout(config.dispatch_format, config.hidden);
  std::size_t const row = config.recv_row_bytes();
  long d;
  ref::DeliveredRows const want = ref::deliver(config, mine.recv_wire, num_recv, cap);
  auto const payload = to_host<uint8_t>(result.recv_x, static_cast<std::size_t>(num_recv) * row);
  if ((d = first_diff(payload.data(), want.payload.data(), payload.size())) >= 0)
    return fail("recv_x payload", rank, iter, d);
  if (!result.recv_scales) return fail("recv_scales null", rank, iter, -1);
  auto const scales = to_host<uint8_t>(
      result.recv_scales, scale_tensor_bytes(config.dispatch_format, config.recv_scale_layout, cap, config.hidden));
  if ((d = quant_scale_diff(config, cap, num_recv, scales, want.scales)) >= 0)
    return fail("recv_scales", rank, iter, d);
  if (wire.has_token_scale) {
    if (!result.recv_token_scales) return fail("recv_token_scales null", rank, iter, -1);
    auto const ts = to_host<float>(result.recv_token_scales, num_recv);
    if ((d = first_diff(ts.data(), want.token_scales.data(), ts.size())) >= 0)
      return fail("recv_token_scales", rank, iter, d);
  }
  if (poisoned && num_recv < cap) {
    auto const past = to_host<uint8_t>(static_cast<char*>(result.recv_x) + num_recv * row, row);
    for (auto v : past)
      if (v != 0xEE) return fail("row past num_recv written", rank, iter, num_recv);
  }
  if (!expand) return 0;
  auto const esr = to_host<int32_t>(result.expert_src_row, static_cast<std::size_t>(num_local) * slots);
  if ((d = first_diff(esr.data(), mine.expert_src_row.data(), esr.size())) >= 0)
    return fail("expert_src_row", rank, iter, d);
  std::size_t const expert_scale_bytes =
      scale_tensor_bytes(config.dispatch_format, config.recv_scale_layout, slots, config.hidden);
  std::vector<uint8_t> const ex_wire = ref::expand_wire(config, world, mine);
  auto const ex = to_host<uint8_t>(result.expert_x, static_cast<std::size_t>(num_local) * slots * row);
  auto const es = to_host<uint8_t>(result.expert_scales, expert_scale_bytes * num_local);
  std::vector<float> ets;
  if (wire.has_token_scale)
    ets = to_host<float>(result.expert_token_scales, static_cast<std::size_t>(num_local) * slots);
  for (int e = 0; e < num_local; ++e) {
    int const filled = std::min(mine.expert_counts[e], slots);
    std::span<uint8_t const> const rows_of_e(ex_wire.data() + static_cast<std::size_t>(e) * slots * wire.row_bytes,
                                             static_cast<std::size_t>(filled) * wire.row_bytes);
    ref::DeliveredRows const slot_want = ref::deliver(config, rows_of_e, filled, slots);
    std::size_t const at = static_cast<std::size_t>(e) * slots * row;
    if ((d = first_diff(ex.data() + at, slot_want.payload.data(), slot_want.payload.size())) >= 0)
      return fail("expert_x payload", rank, iter, static_cast<long>(at) + d);
    std::vector<uint8_t> const got(es.begin() + static_cast<std::ptrdiff_t>(e * expert_scale_bytes),
                                   es.begin() + static_cast<std::ptrdiff_t>((e + 1) * expert_scale_bytes));
    if ((d = quant_scale_diff(config, slots, filled, got, slot_want.scales)) >= 0)
      return fail("expert_scales", rank, iter, static_cast<long>(e) * 1000000 + d);
    if (wire.has_token_scale && (d = first_diff(ets.data() + static_cast<std::size_t>(e) * slots,
                                                slot_want.token_scales.data(), static_cast<std::size_t>(filled))) >= 0)
      return fail("expert_token_scales", rank, iter, static_cast<long>(e) * slots + d);
  }
  return 0;
}

// check_normal_dispatch for any dispatch_format: quantized delivery's rows (check_quantized_rows) and metadata, or
// the bf16 rows (bf16, or dispatch_dequantize) with check_normal_dispatch; the matching poison first.
inline void poison_any_dispatch(EpConfig const& config, int world, DispatchResult const& out) {
  if (config.delivers_quantized())
    poison_quantized_dispatch(config, world, out);
  else
    poison_normal_dispatch(config, world, out);
}
inline int check_any_dispatch(EpConfig const& config, int world, int rank, int iter, ref::RankDispatch const& mine,
                              DispatchResult const& result, bool poisoned, bool expand) {
  if (!config.delivers_quantized())
    return check_normal_dispatch(config, world, rank, iter, mine, result, poisoned, expand);
  int32_t const num_recv = to_host<int32_t>(result.num_recv, 1)[0];
  if (num_recv != mine.num_recv) return fail("num_recv", rank, iter, num_recv);
  if (int const code = check_normal_metadata(config, world, rank, iter, mine, result, num_recv)) return code;
  return check_quantized_rows(config, world, rank, iter, mine, result, num_recv, poisoned, expand);
}

}  // namespace ferry::test

#endif  // FERRY_HAVE_CUDA
