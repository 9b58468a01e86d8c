// How the normal-mode GPU tests compare one rank's dispatch outputs with the reference (src/ep/reference.hpp), bit
// for bit. Shared by the multi-process test (test_normal_mode.cpp: an EpBuffer's DispatchResult) and the virtual-rank
// test (test_normal_virtual.cu: the backend's Buffers). Returns 0, or prints the first mismatch (fail()) and returns
// the failing exit code.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ep/reference.hpp"
#include "ferry/ep.hpp"
#include "support/gpu_case.hpp"

#if FERRY_HAVE_CUDA

namespace ferry::test {

// Poisons (0xEE) what a bf16 dispatch writes: recv_x, the metadata and expert_counts.
inline void poison_normal_dispatch(EpConfig const& config, int world, DispatchResult const& out) {
  std::size_t const cap = static_cast<std::size_t>(config.recv_capacity(world));
  CK(cudaMemset(out.recv_x, 0xEE, cap * config.hidden * 2));
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

}  // namespace ferry::test

#endif  // FERRY_HAVE_CUDA
