// Host launcher of the low-latency combine kernel (ll_combine.cuh): validation, template instance, launch.
#include "core/cuda_check.hpp"
#include "ep/cuda/launch_grid.cuh"
#include "ep/cuda/ll_buffers.hpp"
#include "ep/cuda/ll_combine.cuh"

namespace ferry::cuda_ll {

namespace {

// Kernel invariants only (FERRY_CHECK: a failure is a bug): the arguments were validated once by EpBuffer
// (validate_dispatch_args / validate_combine_args), which refuses a bad call on every rank. An InputError thrown here
// would be refused on this rank alone, the desync docs/errors.md rules out.
LlCombineParams to_params(LlBuffers const& b, CombineArgs const& args, int num_tokens, bool refuse) {
  FERRY_CHECK(refuse || num_tokens == 0 || args.y != nullptr, "combine y is null for num_tokens=", num_tokens,
              " of the last dispatch");
  FERRY_CHECK(args.layout == CombineLayout::rank_major || b.expert_slots > 0,
              "expert-major combine needs expert slots; the LL config resolves them at construction");
  FERRY_CHECK(b.num_ctas >= 1 && b.num_ctas <= kMaxCtas, "LL grid of ", b.num_ctas, " CTAs is outside [1, ", kMaxCtas,
              "]");
  LlCombineParams p{};
  p.view = b.view;
  p.net = transport::make_lsa(b.sym, b.rank, b.world);
  p.layout = b.layout;
  p.x = args.x;
  p.y = args.y;
  p.abort = refuse;
  p.hidden = b.config.hidden;
  p.topk = b.config.topk;
  p.expert_slots = b.expert_slots;
  p.max_tokens = b.config.max_tokens_per_rank;
  p.num_ctas = b.num_ctas;
  p.trace = b.trace ? b.trace->launch(TraceKernel::ll_combine, b.num_ctas, kWarps) : trace::TraceView{};
  p.state = b.state;
  p.token_mask = b.token_mask;
  p.recv_src = b.recv_src;
  p.recv_idx = b.recv_idx;
  p.recv_w = b.recv_w;
  p.recv_slot = b.recv_slot;
  return p;
}

using CombineKernel = void (*)(LlCombineParams);

// The instances, in one place: (combine_format) x (layout) x (halves). The receive half reads no expert outputs: one
// instance per format.
template <WireFormat kFormat, bool kExpertMajor>
CombineKernel pick_half(Half half) {
  switch (half) {
    case Half::both:
      return ll_combine_kernel<kExpertMajor, kFormat, true, true>;
    case Half::send:
      return ll_combine_kernel<kExpertMajor, kFormat, true, false>;
    case Half::recv:
      return ll_combine_kernel<true, kFormat, false, true>;
  }
  FERRY_THROW(Error, "ferry", "unknown LL combine half ", static_cast<int>(half));
}

template <WireFormat kFormat>
CombineKernel pick_layout(CombineLayout layout, Half half) {
  return layout == CombineLayout::expert_major ? pick_half<kFormat, true>(half) : pick_half<kFormat, false>(half);
}

CombineKernel pick(WireFormat format, CombineLayout layout, Half half) {
  switch (format) {
    case WireFormat::bf16:
      return pick_layout<WireFormat::bf16>(layout, half);
    case WireFormat::fp8_e4m3:
      return pick_layout<WireFormat::fp8_e4m3>(layout, half);
    case WireFormat::fp8_e4m3_ue8m0:
      return pick_layout<WireFormat::fp8_e4m3_ue8m0>(layout, half);
    case WireFormat::nvfp4:
      return pick_layout<WireFormat::nvfp4>(layout, half);
    case WireFormat::mxfp4:
      return pick_layout<WireFormat::mxfp4>(layout, half);
  }
  FERRY_THROW(ConfigError, "config", "combine_format=", static_cast<int>(format), " has no LL combine kernel");
}

}  // namespace

void launch_ll_combine(LlBuffers const& buffers, CombineArgs const& args, int num_tokens, Half half,
                       cudaStream_t stream, bool refuse) {
  // num_tokens is only checked here; the kernel reads the device copy of the last dispatch's count
  LlCombineParams const p = to_params(buffers, args, num_tokens, refuse);
  CombineKernel const kernel = pick(buffers.config.combine_format, args.layout, half);
  cuda_grid::launch_grid<kThreads>(kernel, p, p.num_ctas, 0, buffers.cooperative, stream);
}

}  // namespace ferry::cuda_ll
