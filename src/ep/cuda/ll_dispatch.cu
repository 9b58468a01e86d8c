// Host launcher of the low-latency dispatch kernel (ll_dispatch.cuh): validation, template instance, launch.
#include "core/cuda_check.hpp"
#include "ep/cuda/launch_grid.cuh"
#include "ep/cuda/ll_buffers.hpp"
#include "ep/cuda/ll_dispatch.cuh"

namespace ferry::cuda_ll {

namespace {

// Kernel invariants only (FERRY_CHECK: a failure is a bug): the arguments were validated once by EpBuffer
// (validate_dispatch_args / validate_combine_args), which refuses a bad call on every rank. An InputError thrown here
// would be refused on this rank alone, the desync docs/errors.md rules out.
LlDispatchParams to_params(LlBuffers const& b, DispatchArgs const& args, bool refuse) {
  FERRY_CHECK(!refuse || args.num_tokens == 0, "a refused dispatch joins with no tokens, not ", args.num_tokens);
  FERRY_CHECK(args.num_tokens >= 0 && args.num_tokens <= b.config.max_tokens_per_rank, "num_tokens=", args.num_tokens,
              " is outside [0, max_tokens_per_rank=", b.config.max_tokens_per_rank, "]");
  FERRY_CHECK(args.num_tokens == 0 || (args.x && args.topk_idx && args.topk_weights),
              "x, topk_idx and topk_weights must be non-null for num_tokens=", args.num_tokens);
  FERRY_CHECK(b.num_ctas >= 1 && b.num_ctas <= kMaxCtas, "LL grid of ", b.num_ctas, " CTAs is outside [1, ", kMaxCtas,
              "]");
  FERRY_CHECK(b.num_local_experts >= 1 && b.num_local_experts <= kMaxLlLocalExperts,
              "num_local_experts=", b.num_local_experts, " is outside [1, ", kMaxLlLocalExperts, "]");
  WireFormat const format = b.config.dispatch_format;
  // Pre-quantized arguments were validated by EpBuffer (validate_dispatch_args); the kernel relies on these two.
  bool const prequantized = args.x_scales != nullptr;
  FERRY_CHECK(!prequantized || format != WireFormat::bf16, "x_scales is set but dispatch_format=bf16");
  FERRY_CHECK(!prequantized || format != WireFormat::nvfp4 || args.num_tokens == 0 || args.x_token_scales,
              "pre-quantized nvfp4 input needs x_token_scales");
  LlDispatchParams p{};
  p.view = b.view;
  p.net = transport::make_lsa(b.sym, b.rank, b.world);
  p.layout = b.layout;
  p.x = args.x;
  p.x_scales = args.x_scales;
  p.x_token_scales = args.x_token_scales;
  p.topk_idx = args.topk_idx;
  p.topk_weights = args.topk_weights;
  p.num_tokens = args.num_tokens;
  p.abort = refuse;
  p.hidden = b.config.hidden;
  p.topk = b.config.topk;
  p.num_experts = b.config.num_experts;
  p.num_local_experts = b.num_local_experts;
  p.max_tokens = b.config.max_tokens_per_rank;
  p.expert_slots = b.expert_slots;
  p.num_ctas = b.num_ctas;
  p.trace = b.trace ? b.trace->launch(TraceKernel::ll_dispatch, b.num_ctas, kWarps) : trace::TraceView{};
  p.state = b.state;
  p.token_mask = b.token_mask;
  p.recv_src = b.recv_src;
  p.recv_idx = b.recv_idx;
  p.recv_w = b.recv_w;
  p.recv_slot = b.recv_slot;
  p.expert_counts = b.expert_counts;
  p.expert_x = b.expert_x;
  p.expert_src_row = b.expert_src_row;
  p.own_slot = b.own_slot;
  p.own_direct = b.own_direct;
  p.expert_row_bytes = b.config.recv_row_bytes();
  p.dequantize = format != WireFormat::bf16 && b.config.dispatch_dequantize;
  p.scale_layout = b.config.recv_scale_layout;
  p.scale_tensor_bytes = b.scale_tensor_bytes;
  p.expert_scales = b.expert_scales;
  p.expert_token_scales = b.expert_token_scales;
  return p;
}

using DispatchKernel = void (*)(LlDispatchParams);

// The instances, in one place: (dispatch_format, codec unit) x (index type) x (halves). The receive half reads no
// ids and runs no codec, so it has one instance per format.
template <WireFormat kFormat, int kUnitElems, typename IdxT>
DispatchKernel pick_half(Half half) {
  constexpr int kRecvUnit = device::unit_elems_for(kFormat, 0);
  switch (half) {
    case Half::both:
      return ll_dispatch_kernel<IdxT, kFormat, kUnitElems, true, true>;
    case Half::send:
      return ll_dispatch_kernel<IdxT, kFormat, kUnitElems, true, false>;
    case Half::recv:
      return ll_dispatch_kernel<int64_t, kFormat, kRecvUnit, false, true>;
  }
  FERRY_THROW(Error, "ferry", "unknown LL dispatch half ", static_cast<int>(half));
}

template <WireFormat kFormat, int kUnitElems>
DispatchKernel pick_index(IndexType type, Half half) {
  switch (type) {
    case IndexType::int64:
      return pick_half<kFormat, kUnitElems, int64_t>(half);
    case IndexType::int32:
      return pick_half<kFormat, kUnitElems, int32_t>(half);
  }
  FERRY_THROW(Error, "ferry", "topk_idx_type=", static_cast<int>(type), " is not int32 or int64");
}

DispatchKernel pick(WireFormat format, int hidden, IndexType type, Half half) {
  switch (format) {
    case WireFormat::bf16:
      return pick_index<WireFormat::bf16, 0>(type, half);
    case WireFormat::fp8_e4m3:
      return pick_index<WireFormat::fp8_e4m3, 16>(type, half);
    case WireFormat::fp8_e4m3_ue8m0:
      return pick_index<WireFormat::fp8_e4m3_ue8m0, 16>(type, half);
    case WireFormat::nvfp4:  // 8-byte payload pieces only where hidden % 32 == 16 (device::unit_elems_for)
      return device::unit_elems_for(format, hidden) == 32 ? pick_index<WireFormat::nvfp4, 32>(type, half)
                                                          : pick_index<WireFormat::nvfp4, 16>(type, half);
    case WireFormat::mxfp4:
      return pick_index<WireFormat::mxfp4, 32>(type, half);
  }
  FERRY_THROW(ConfigError, "config", "dispatch_format=", static_cast<int>(format), " has no LL dispatch kernel");
}

}  // namespace

void launch_ll_dispatch(LlBuffers const& buffers, DispatchArgs const& args, Half half, cudaStream_t stream,
                        bool refuse) {
  LlDispatchParams const p = to_params(buffers, args, refuse);
  DispatchKernel const kernel = pick(buffers.config.dispatch_format, buffers.config.hidden, args.topk_idx_type, half);
  // both halves expand (the send half a bf16 dispatch's own rows): per-expert counters in shared memory
  std::size_t const smem = expand_smem_bytes(p.num_local_experts);
  cuda_grid::launch_grid<kThreads>(kernel, p, p.num_ctas, smem, buffers.cooperative, stream);
}

}  // namespace ferry::cuda_ll
