// The cuda backend of EpBuffer, low-latency mode: owns the fixed symmetric region and the local buffers, launches one
// kernel per leg (ll_dispatch.cu, ll_combine.cu) or its two halves (return_recv_hook), and, in eager mode,
// synchronises and raises device-side errors. No host synchronisation, memset or reset launch per call: sequence
// numbers and arrival counters live on the device and only grow.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <vector>

#include "core/cuda_check.hpp"
#include "ep/cuda/device_memory.hpp"
#include "ep/cuda/landing.cuh"
#include "ep/cuda/ll_buffers.hpp"
#include "ep/ep_impl.hpp"
#include "ferry/env.hpp"
#include "ferry/error.hpp"
#include "quant/layout.hpp"
#include "tuning/choose.hpp"

namespace ferry::cuda_ll {

using detail::device_alloc;
using detail::device_free;
using detail::device_zeroed;

LlLayout make_ll_layout(EpConfig const& config, int world) {
  // NOTE: 256-byte alignment keeps each area on its own cache lines and 16-byte vectors aligned.
  constexpr std::size_t kAlign = 256;
  std::size_t const slots = 2ull * world * static_cast<std::size_t>(config.max_tokens_per_rank);
  LlLayout layout;
  layout.meta_bytes = landing::record_bytes(config.topk);
  // NOTE: landing rows are wire rows (multiples of 16 bytes): a quantized leg's zone shrinks with its format.
  layout.dispatch_row_bytes = wire_row_bytes(config.dispatch_format, config.hidden);
  layout.combine_row_bytes = wire_row_bytes(config.combine_format, config.hidden);
  std::size_t offset = 0;
  auto take = [&](std::size_t bytes) {
    std::size_t const at = offset;
    offset = quant::align_up(offset + bytes, kAlign);
    return at;
  };
  layout.dispatch_arrivals = take(static_cast<std::size_t>(world) * sizeof(uint64_t));
  layout.combine_arrivals = take(static_cast<std::size_t>(world) * sizeof(uint64_t));
  layout.dispatch_tokens = take(2ull * world * sizeof(uint64_t));
  layout.dispatch_abort = take(2ull * world * sizeof(uint64_t));
  layout.combine_abort = take(2ull * world * sizeof(uint64_t));
  layout.dispatch_meta = take(slots * layout.meta_bytes);
  layout.dispatch_rows = take(slots * layout.dispatch_row_bytes);
  layout.combine_rows = take(slots * layout.combine_row_bytes);
  layout.total = offset;
  return layout;
}

void allocate_ll_buffers(LlBuffers& b) {
  EpConfig const& config = b.config;
  std::size_t const max_tokens = static_cast<std::size_t>(config.max_tokens_per_rank);
  std::size_t const rows = static_cast<std::size_t>(b.world) * max_tokens;
  std::size_t const topk = static_cast<std::size_t>(config.topk);
  std::size_t const slots = static_cast<std::size_t>(b.num_local_experts) * b.expert_slots;
  try {
    b.state = device_zeroed<LlState>(1);
    b.token_mask = device_alloc<uint32_t>(max_tokens);
    b.recv_src = device_alloc<int32_t>(rows * 2);
    b.recv_idx = device_alloc<int32_t>(rows * topk);
    b.recv_w = device_alloc<float>(rows * topk);
    b.recv_slot = device_alloc<int32_t>(rows * topk);
    b.expert_counts = device_zeroed<int32_t>(static_cast<std::size_t>(b.num_local_experts));
    b.expert_x = device_alloc<uint8_t>(slots * config.recv_row_bytes());
    b.expert_src_row = device_alloc<int32_t>(slots);
    b.own_slot = device_alloc<int32_t>(max_tokens * topk);
    if (config.delivers_quantized()) {
      b.scale_tensor_bytes =
          scale_tensor_bytes(config.dispatch_format, config.recv_scale_layout, b.expert_slots, config.hidden);
      std::size_t const all = static_cast<std::size_t>(b.num_local_experts) * b.scale_tensor_bytes;
      // NOTE: zeroed once: the kernels write only the entries of (slot, block) pairs, so padding entries stay zero
      // for every later call without a per-call memset.
      b.expert_scales = device_zeroed<uint8_t>(all);
      if (config.dispatch_format == WireFormat::nvfp4) b.expert_token_scales = device_alloc<float>(slots);
    }
  } catch (...) {
    free_ll_buffers(b);
    throw;
  }
}

void free_ll_buffers(LlBuffers& b) noexcept {
  device_free(b.state);
  device_free(b.token_mask);
  device_free(b.recv_src);
  device_free(b.recv_idx);
  device_free(b.recv_w);
  device_free(b.recv_slot);
  device_free(b.expert_counts);
  device_free(b.expert_x);
  device_free(b.expert_src_row);
  device_free(b.own_slot);
  device_free(b.expert_scales);
  device_free(b.expert_token_scales);
  b.scale_tensor_bytes = 0;
}

DispatchResult ll_dispatch_result(LlBuffers const& b) {
  DispatchResult result;
  result.recv_x = nullptr;  // LL returns the expert-major layout (see DispatchResult)
  result.recv_topk_idx = b.recv_idx;
  result.recv_topk_weights = b.recv_w;
  result.recv_src = b.recv_src;
  result.num_recv = &b.state->num_recv;
  result.expert_counts = b.expert_counts;
  result.recv_capacity = b.world * b.config.max_tokens_per_rank;
  result.expert_x = b.expert_x;
  result.recv_row_bytes = b.config.recv_row_bytes();
  result.expert_src_row = b.expert_src_row;
  result.expert_slots = b.expert_slots;
  result.expert_scales = b.expert_scales;              // null unless quantized delivery
  result.expert_token_scales = b.expert_token_scales;  // null unless nvfp4 delivery
  return result;
}

namespace {

// How the dispatch rows travel, for explain().
std::string format_explain(EpConfig const& config, DispatchArgs const& args) {
  if (config.dispatch_format == WireFormat::bf16) return "bf16";
  std::string out = wire_format_name(config.dispatch_format);
  out += args.x_scales ? " (pre-quantized input forwarded" : " (quantized once per token in the send loop";
  out += config.dispatch_dequantize ? "; receiver dequantizes to bf16 in the copy)"
                                    : std::string("; payload + ") + scale_layout_name(config.recv_scale_layout) +
                                          " scales delivered in the copy)";
  return out;
}

class CudaLlEp final : public detail::EpBackendImpl {
 public:
  CudaLlEp(Communicator& comm, EpConfig const& config) : comm_(comm) {
    LlBuffers& b = buffers_;
    b.config = config;
    b.world = comm.world();
    b.rank = comm.rank();
    b.num_local_experts = config.num_local_experts(b.world);
    b.expert_slots = config.expert_slots();
    FERRY_CHECK_CONFIG(b.expert_slots > 0, "mode=ll needs a resolved config (EpConfig::resolved) with expert slots");
    FERRY_CHECK_CONFIG(b.world <= kMaxLocalPeers, "world=", b.world, " exceeds ", kMaxLocalPeers,
                       " ranks of one NVLink domain, the most mode=ll supports in this version");
    FERRY_CHECK_CONFIG(b.num_local_experts <= kMaxLlLocalExperts, "num_experts=", config.num_experts, " gives ",
                       b.num_local_experts, " local experts per rank at world=", b.world, "; mode=ll supports at most ",
                       kMaxLlLocalExperts, " (use mode=normal, or more ranks)");
    // env_string applies the env table's rule (landing or direct) and refuses anything else
    b.own_direct = env_string("FERRY_LL_OWN_ROWS") == "direct";  // a rank's own rows only: the ranks need not agree
    FERRY_CHECK_CUDA(cudaSetDevice(comm.device()));
    int num_sms = 0;
    FERRY_CHECK_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, comm.device()));

    // 1. the grid, fixed for the EpBuffer (receivers count arrivals as seq * num_ctas) and shared by both legs: the
    //    EpConfig pin, FERRY_DISPATCH_BLOCKS, the tuning table's dispatch row for the bucket of max_tokens_per_rank
    //    (a mode ll entry has no combine rows), or one CTA per SM; at most one per SM (co-resident
    //    for the cooperative launch). Every rank must use the same count: agree on the smallest.
    cudaDeviceProp prop{};
    FERRY_CHECK_CUDA(cudaGetDeviceProperties(&prop, comm.device()));
    auto const tables = tuning::active_tables();
    tuning::LegTuning const leg_tuning = tuning::resolve_leg(
        tuning::Leg::dispatch, tuning::make_key(prop.name, b.world, config), config.dispatch_geometry, *tables);
    tuning::Choice const choice =
        tuning::choose(leg_tuning, tuning::read_env_pin(tuning::Leg::dispatch), config.max_tokens_per_rank,
                       Geometry{std::min(num_sms, kMaxCtas)}, "one CTA per SM");
    int const wanted = std::clamp(choice.geometry.blocks, 1, std::min(num_sms, kMaxCtas));
    std::vector<int32_t> all(static_cast<std::size_t>(b.world));
    int32_t const mine = wanted;
    comm.bootstrap().allgather(&mine, all.data(), sizeof(mine));
    b.num_ctas = *std::min_element(all.begin(), all.end());
    grid_why_ = choice.source;
    if (b.num_ctas != choice.geometry.blocks)
      grid_why_ += detail::concat("; ran ", b.num_ctas, " CTAs (at most one per SM, the same on every rank)");

    // 2. symmetric region (zeroed by the communicator: counters and sequence numbers start at 0) and local buffers
    b.view = comm.device_view();
    b.layout = make_ll_layout(config, b.world);
    region_ = comm.alloc_symmetric(b.layout.total);
    b.sym = region_.view;
    try {
      allocate_ll_buffers(b);
      b.trace = &trace_;
      if (int const events = trace::env_events_per_warp(); events > 0)
        trace_.enable(b.rank, b.num_ctas * kWarps, events);
      FERRY_CHECK_CUDA(cudaDeviceSynchronize());
      // every rank's buffers exist before any peer can push into them
      comm.bootstrap().barrier();
    } catch (...) {
      release();  // the destructor does not run for a constructor that throws
      throw;
    }
  }

  ~CudaLlEp() override { release(); }

  DispatchResult dispatch(DispatchArgs const& args, cudaStream_t stream) override {
    LlBuffers const& b = buffers_;
    bool const split = args.return_recv_hook;
    launch_ll_dispatch(b, args, split ? Half::send : Half::both, stream);
    last_num_tokens_ = args.num_tokens;
    pending_args_ = args;
    std::ostringstream why;
    why << "dispatch: ll/nvlink-push "
        << (split ? "split (send kernel now, receive kernel in complete_dispatch)" : "one kernel (send + receive)")
        << ", " << b.num_ctas << " CTAs x " << kWarps << " warps (cooperative; grid: " << grid_why_
        << "), warp per token, own rows "
        << (b.own_direct && b.config.dispatch_format == WireFormat::bf16
                ? "copied from x into their slots by the send half (FERRY_LL_OWN_ROWS=direct)"
                : "staged in the landing zone")
        << ", receive: ordered scan in every CTA, the hits (row, expert) spread evenly over the CTAs, each landed row "
           "loaded once per CTA and copied to its slots in expert_x, ids "
        << (args.topk_idx_type == IndexType::int64 ? "int64" : "int32") << ", wire " << format_explain(b.config, args)
        << "; fast path";
    dispatch_explain_ = why.str();
    if (split) return ll_dispatch_result(buffers_);
    return finish_dispatch(args.eager, stream);
  }

  // A refused call still runs both halves in one kernel (no hook is left pending) with no tokens and this rank's abort
  // word, so the peers' same call lands nothing and records the refusal, and every sequence stays in step.
  void refuse_dispatch(cudaStream_t stream) override {
    launch_ll_dispatch(buffers_, DispatchArgs{}, Half::both, stream, /*refuse=*/true);
    last_num_tokens_ = 0;  // the kernel left no tokens for a combine (EpBuffer refuses one until a dispatch succeeds)
    dispatch_explain_ = "dispatch: refused on input (joined with no tokens and the abort flag)";
  }

  void refuse_combine(cudaStream_t stream) override {
    CombineArgs none;
    none.layout = CombineLayout::rank_major;  // reads no x
    launch_ll_combine(buffers_, none, last_num_tokens_, Half::both, stream, /*refuse=*/true);
    combine_explain_ = "combine: refused on input (joined with no rows and the abort flag)";
  }

  DispatchResult complete_dispatch(cudaStream_t stream) override {
    launch_ll_dispatch(buffers_, pending_args_, Half::recv, stream);
    return finish_dispatch(pending_args_.eager, stream);
  }

  void combine(CombineArgs const& args, cudaStream_t stream) override {
    LlBuffers const& b = buffers_;
    // NOTE: EpBuffer validated the call (validate_combine_args, refused on every rank); its hook rules keep a combine
    // from starting while a dispatch's receive half is pending
    bool const split = args.return_recv_hook;
    launch_ll_combine(b, args, last_num_tokens_, split ? Half::send : Half::both, stream);
    pending_combine_ = args;
    std::ostringstream why;
    why << "combine: ll/nvlink-push "
        << (split ? "split (send kernel now, receive kernel in complete_combine)" : "one kernel (send + receive)")
        << ", " << b.num_ctas << " CTAs x " << kWarps << " warps (grid: " << grid_why_ << "), warp per (row, "
        << kChunkVecs * 8 << "-element chunk), "
        << (args.layout == CombineLayout::expert_major ? "expert-major (receiver reduces its experts, fmaf k-ascending)"
                                                       : "rank-major")
        << ", wire " << wire_format_name(b.config.combine_format)
        << (b.config.combine_format == WireFormat::bf16 ? ""
            : b.config.combine_format == WireFormat::nvfp4
                ? " (a row's chunks on warps of one CTA, which meet the row's amax, its token scale, in shared "
                  "memory and quantize in registers; source dequantizes and sums in fp32)"
                : " (chunk quantized in registers; source dequantizes and sums in fp32)")
        << "; fast path";
    combine_explain_ = why.str();
    if (!split && args.eager) sync_and_check(stream);
  }

  void complete_combine(cudaStream_t stream) override {
    launch_ll_combine(buffers_, pending_combine_, last_num_tokens_, Half::recv, stream);
    if (pending_combine_.eager) sync_and_check(stream);
  }

  std::string explain() const override {
    std::string out = dispatch_explain_.empty() ? std::string("dispatch: not run") : dispatch_explain_;
    out += "\n";
    out += combine_explain_.empty() ? std::string("combine: not run") : combine_explain_;
    return out;
  }

 private:
  DispatchResult finish_dispatch(bool eager, cudaStream_t stream) {
    DispatchResult result = ll_dispatch_result(buffers_);
    if (eager) {
      int32_t num_recv = 0;
      FERRY_CHECK_CUDA(
          cudaMemcpyAsync(&num_recv, &buffers_.state->num_recv, sizeof(num_recv), cudaMemcpyDeviceToHost, stream));
      sync_and_check(stream);
      result.num_recv_host = num_recv;
    }
    return result;
  }

  void enable_trace(EpConfig const&, int max_events_per_warp) override {
    FERRY_CHECK_CUDA(cudaSetDevice(comm_.device()));
    trace_.enable(buffers_.rank, buffers_.num_ctas * kWarps, max_events_per_warp);
  }

  // NOTE: with the receive hook a leg is two launches of the same family; the trace holds the last (receive) half.
  TraceBuffer read_trace(EpConfig const&, TraceKernel kernel, cudaStream_t stream) override {
    return trace_.read(kernel, stream);
  }

  void sync_and_check(cudaStream_t stream) {
    FERRY_CHECK_CUDA(cudaStreamSynchronize(stream));
    comm_.check_errors(stream);
  }

  void release() noexcept {
    detail::release_backend_memory(comm_, region_, "low-latency EpBuffer", [&] { free_ll_buffers(buffers_); });
  }

  Communicator& comm_;
  trace::DeviceRecorder trace_;  // LlBuffers::trace points here
  SymmetricRegion region_;       // the symmetric region of buffers_.sym
  LlBuffers buffers_;
  int last_num_tokens_ = 0;
  DispatchArgs pending_args_;    // the send half's arguments, for its receive half
  CombineArgs pending_combine_;  // same for combine
  std::string dispatch_explain_;
  std::string combine_explain_;
  std::string grid_why_;  // where the CTA count came from
};

}  // namespace
}  // namespace ferry::cuda_ll

namespace ferry::detail {

std::unique_ptr<EpBackendImpl> make_cuda_ll_ep(Communicator& comm, EpConfig const& config) {
  return std::make_unique<cuda_ll::CudaLlEp>(comm, config);
}

}  // namespace ferry::detail
