// The cuda backend of EpBuffer, normal mode: owns the symmetric region and the local scratch, sequences the kernels
// (dispatch.cu, expand.cu, combine.cu) and, in eager mode, synchronises and raises device-side errors.
#include <cuda_runtime.h>

#include <algorithm>
#include <sstream>

#include "core/cuda_check.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/device_memory.hpp"
#include "ep/cuda/landing.cuh"
#include "ep/ep_impl.hpp"
#include "ep/landing_policy.hpp"
#include "ferry/env.hpp"
#include "ferry/error.hpp"
#include "quant/device_unit_codec.cuh"
#include "quant/layout.hpp"

namespace ferry::cuda_ep {

using detail::device_alloc;
using detail::device_free;
using detail::device_zeroed;

SymLayout make_sym_layout(EpConfig const& config, int world, bool landing) {
  // NOTE: 256-byte alignment keeps every row and word area on its own cache lines and 16-byte vectors aligned.
  constexpr std::size_t kAlign = 256;
  std::size_t const cap = static_cast<std::size_t>(config.recv_capacity(world));
  std::size_t const topk = static_cast<std::size_t>(config.topk);
  // The areas a format needs (docs/quant.md "Row layout on the wire"): a quantized delivery lands the payload in
  // recv_x and the scales row-major in recv_scales (+ the nvfp4 token scales); dispatch_dequantize lands whole wire
  // rows in recv_wire and delivers bf16 in recv_x; combine rows come back as wire rows of combine_format.
  WireRowLayout const dispatch_wire = wire_row_layout(config.dispatch_format, config.hidden);
  bool const quantized_delivery = config.delivers_quantized();
  bool const dequantize = config.dispatch_format != WireFormat::bf16 && config.dispatch_dequantize;
  std::size_t const combine_row = wire_row_bytes(config.combine_format, config.hidden);
  SymLayout layout;
  layout.count_words = 1 + world + config.num_local_experts(world);
  std::size_t offset = 0;
  auto take = [&](std::size_t bytes) {
    std::size_t const at = offset;
    offset = quant::align_up(offset + bytes, kAlign);
    return at;
  };
  layout.recv_x = take(cap * config.recv_row_bytes());
  if (quantized_delivery) {
    layout.recv_scales = take(cap * static_cast<std::size_t>(dispatch_wire.num_scales) *
                              static_cast<std::size_t>(dispatch_wire.scale_bytes));
    if (dispatch_wire.has_token_scale) layout.recv_token_scales = take(cap * sizeof(float));
  }
  if (dequantize) layout.recv_wire = take(cap * dispatch_wire.row_bytes);
  layout.recv_idx = take(cap * topk * sizeof(int32_t));
  layout.recv_w = take(cap * topk * sizeof(float));
  layout.recv_src = take(cap * 2 * sizeof(int32_t));
  layout.counts = take(2ull * world * layout.count_words * sizeof(uint64_t));
  layout.data_signal = take(static_cast<std::size_t>(world) * sizeof(uint64_t));
  layout.combine_abort = take(2ull * world * sizeof(uint64_t));
  layout.tile_flags = take(static_cast<std::size_t>(world) * kMaxCombineTiles * sizeof(uint64_t));
  layout.landing = take(2ull * world * static_cast<std::size_t>(config.max_tokens_per_rank) * combine_row);
  if (landing) {
    std::size_t const slots = 2ull * world * static_cast<std::size_t>(config.max_tokens_per_rank);
    layout.land_arrivals = take(static_cast<std::size_t>(world) * sizeof(uint64_t));
    layout.land_tokens = take(2ull * world * sizeof(uint64_t));
    layout.land_abort = take(2ull * world * sizeof(uint64_t));
    layout.land_meta = take(slots * landing::record_bytes(config.topk));
    layout.land_rows = take(slots * static_cast<std::size_t>(config.hidden) * 2);
  }
  layout.total = offset;
  return layout;
}

void allocate_buffers(Buffers& b) {
  EpConfig const& config = b.config;
  try {
    std::size_t const max_tokens = static_cast<std::size_t>(config.max_tokens_per_rank);
    b.max_dispatch_ctas = b.num_sms;
    b.state = device_zeroed<DeviceState>(1);
    b.token_mask = device_alloc<uint32_t>(max_tokens);
    b.token_pos = device_alloc<int32_t>(max_tokens * b.world);
    b.block_counts = device_alloc<int32_t>(static_cast<std::size_t>(b.max_dispatch_ctas) * b.world);
    b.count_totals = device_zeroed<int32_t>(static_cast<std::size_t>(b.world + config.num_experts + 1));
    b.expert_counts = device_zeroed<int32_t>(b.num_local_experts);
    if (config.dispatch_format == WireFormat::nvfp4) b.token_scales = device_alloc<float>(max_tokens);
    b.recv_slot = device_alloc<int32_t>(static_cast<std::size_t>(b.recv_capacity) * config.topk);
    b.recv_row_bytes = config.recv_row_bytes();
    bool const quantized_delivery = config.delivers_quantized();
    // NOTE: scale tensors are zeroed once: calls write every (row, block) entry of the rows they deliver and never the
    // padding entries (rows or blocks past the end), which the layouts define as zero.
    if (quantized_delivery && config.recv_scale_layout != ScaleLayout::row_major)
      b.recv_scales_final = device_zeroed<uint8_t>(
          scale_tensor_bytes(config.dispatch_format, config.recv_scale_layout, b.recv_capacity, config.hidden));
    if (b.expert_slots > 0) {
      std::size_t const slots = static_cast<std::size_t>(b.num_local_experts) * b.expert_slots;
      b.expert_x = device_alloc<uint8_t>(slots * b.recv_row_bytes);
      b.expert_src_row = device_alloc<int32_t>(slots);
      if (quantized_delivery) {
        b.expert_scale_bytes =
            scale_tensor_bytes(config.dispatch_format, config.recv_scale_layout, b.expert_slots, config.hidden);
        b.expert_scales = device_zeroed<uint8_t>(b.expert_scale_bytes * b.num_local_experts);
        if (config.dispatch_format == WireFormat::nvfp4) b.expert_token_scales = device_alloc<float>(slots);
      }
    }
  } catch (...) {
    free_buffers(b);
    throw;
  }
}

void free_buffers(Buffers& b) noexcept {
  device_free(b.state);
  device_free(b.token_mask);
  device_free(b.token_pos);
  device_free(b.block_counts);
  device_free(b.count_totals);
  device_free(b.token_scales);
  device_free(b.expert_counts);
  device_free(b.recv_slot);
  device_free(b.recv_scales_final);
  device_free(b.expert_x);
  device_free(b.expert_src_row);
  device_free(b.expert_scales);
  device_free(b.expert_token_scales);
}

DispatchResult dispatch_result(Buffers const& b, bool expand) {
  DispatchResult result;
  char* const sym = b.sym.ptr[b.rank];
  result.recv_x = sym + b.layout.recv_x;
  result.recv_row_bytes = b.recv_row_bytes;
  if (b.config.delivers_quantized()) {
    result.recv_scales = b.recv_scales_final ? b.recv_scales_final : sym + b.layout.recv_scales;
    if (b.config.dispatch_format == WireFormat::nvfp4)
      result.recv_token_scales = reinterpret_cast<float*>(sym + b.layout.recv_token_scales);
  }
  result.recv_topk_idx = reinterpret_cast<int32_t*>(sym + b.layout.recv_idx);
  result.recv_topk_weights = reinterpret_cast<float*>(sym + b.layout.recv_w);
  result.recv_src = reinterpret_cast<int32_t*>(sym + b.layout.recv_src);
  result.num_recv = &b.state->num_recv;
  result.expert_counts = b.expert_counts;
  result.recv_capacity = b.recv_capacity;
  if (expand) {
    result.expert_x = b.expert_x;
    result.expert_src_row = b.expert_src_row;
    result.expert_slots = b.expert_slots;
    result.expert_scales = b.expert_scales;
    result.expert_token_scales = b.expert_token_scales;
  }
  return result;
}

namespace {

class CudaEp final : public detail::EpBackendImpl {
 public:
  CudaEp(Communicator& comm, EpConfig const& config) : comm_(comm) {
    Buffers& b = buffers_;
    b.config = config;
    b.world = comm.world();
    b.rank = comm.rank();
    b.num_local_experts = config.num_local_experts(b.world);
    b.recv_capacity = config.recv_capacity(b.world);
    b.expert_slots = config.expert_slots();
    // NOTE: the token mask of a destination set is one 32-bit word, and kernels index peers by LSA pointer.
    FERRY_CHECK_CONFIG(b.world <= kMaxLocalPeers, "world=", b.world, " exceeds ", kMaxLocalPeers,
                       " ranks of one NVLink domain, the most normal mode supports in this version");
    // NOTE: the dispatch layout keeps one counter per global expert in shared memory.
    FERRY_CHECK_CONFIG(dispatch_smem_bytes(b.world, config.num_experts) <= kMaxDispatchSmem,
                       "num_experts=", config.num_experts, " needs ", dispatch_smem_bytes(b.world, config.num_experts),
                       " bytes of shared memory for the dispatch layout, more than ", kMaxDispatchSmem,
                       "; use at most ", kMaxDispatchSmem / 4 - b.world, " experts");
    FERRY_CHECK_CUDA(cudaSetDevice(comm.device()));
    FERRY_CHECK_CUDA(cudaDeviceGetAttribute(&b.num_sms, cudaDevAttrMultiProcessorCount, comm.device()));
    cudaDeviceProp prop{};
    FERRY_CHECK_CUDA(cudaGetDeviceProperties(&prop, comm.device()));
    tuning::TuningKey const key = tuning::make_key(prop.name, b.world, config);
    auto const tables = tuning::active_tables();
    b.dispatch_tuning = tuning::resolve_leg(tuning::Leg::dispatch, key, config.dispatch_geometry, *tables);
    b.combine_tuning = tuning::resolve_leg(tuning::Leg::combine, key, config.combine_geometry, *tables);
    b.view = comm.device_view();
    detail::LandingChoice const landing =
        detail::choose_normal_landing(config, b.world, env_string("FERRY_NORMAL_LANDING"));
    b.landing = landing.use;
    b.landing_why = landing.why;
    b.land_ctas = std::min(b.num_sms, kMaxLandCtas);
    b.layout = make_sym_layout(config, b.world, b.landing);
    region_ = comm.alloc_symmetric(b.layout.total);
    b.sym = region_.view;

    try {
      allocate_buffers(b);
      b.trace = &trace_;
      if (int const events = trace::env_events_per_warp(); events > 0)
        trace_.enable(b.rank, b.num_sms * kWarps, events);
      FERRY_CHECK_CUDA(cudaDeviceSynchronize());
      // every rank's buffers exist before any peer can push into them
      comm.bootstrap().barrier();
    } catch (...) {
      release();  // the destructor does not run for a constructor that throws
      throw;
    }
  }

  ~CudaEp() override { release(); }

  DispatchResult dispatch(DispatchArgs const& args, cudaStream_t stream) override {
    Buffers const& b = buffers_;
    LaunchPlan const plan = plan_dispatch(b, args.num_tokens);
    launch_dispatch(b, args, plan, stream);
    if (args.expand) launch_expand(b, /*copy_rows=*/true, stream);
    last_num_tokens_ = args.num_tokens;
    std::ostringstream why;
    if (b.landing)
      why << "dispatch: normal/nvlink-landing (rows land in per-source slots, the receiver compacts them: no count "
             "exchange; "
          << b.landing_why << "), ";
    else
      why << "dispatch: normal/nvlink-push fused (layout + count exchange + push in one kernel; " << b.landing_why
          << "), ";
    why << plan.ctas << " CTAs x " << kWarps << " warps (" << plan.why << "), ids "
        << (args.topk_idx_type == IndexType::int64 ? "int64" : "int32") << ", " << dispatch_format_explain(args)
        << (args.expand ? ", then expand (one CTA per local expert)" : "") << "; fast path";
    dispatch_explain_ = why.str();

    DispatchResult result = dispatch_result(b, args.expand);
    if (args.eager) {
      int32_t num_recv = 0;
      FERRY_CHECK_CUDA(
          cudaMemcpyAsync(&num_recv, &b.state->num_recv, sizeof(num_recv), cudaMemcpyDeviceToHost, stream));
      sync_and_check(stream);
      result.num_recv_host = num_recv;
    }
    return result;
  }

  // A refused call joins the exchange with no tokens (no rows) and this rank's abort flag: the peers' same call moves
  // nothing and records the refusal, and the sequence numbers and parities stay in step on every rank.
  void refuse_dispatch(cudaStream_t stream) override {
    Buffers const& b = buffers_;
    launch_dispatch(b, DispatchArgs{}, plan_dispatch(b, 0), stream, /*refuse=*/true);
    last_num_tokens_ = 0;  // the kernel left no tokens for a combine (EpBuffer refuses one until a dispatch succeeds)
    dispatch_explain_ = "dispatch: refused on input (joined the count exchange with no tokens and the abort flag)";
  }

  void refuse_combine(cudaStream_t stream) override {
    Buffers const& b = buffers_;
    CombineArgs none;
    none.layout = CombineLayout::rank_major;  // reads no x
    launch_combine(b, none, plan_combine(b, last_num_tokens_), last_num_tokens_, stream, /*refuse=*/true);
    combine_explain_ = "combine: refused on input (every tile its sources wait for flagged with the abort flag)";
  }

  void combine(CombineArgs const& args, cudaStream_t stream) override {
    Buffers const& b = buffers_;
    // NOTE: EpBuffer validated the call (validate_combine_args, refused on every rank): it follows a dispatch that
    // succeeded, and an expert-major one follows an expanded dispatch, so recv_slot holds that dispatch's slots.
    bool const expert_major = args.layout == CombineLayout::expert_major;
    LaunchPlan const plan = plan_combine(b, last_num_tokens_);
    launch_combine(b, args, plan, last_num_tokens_, stream);
    std::ostringstream why;
    why << "combine: normal/nvlink-push pipelined (" << plan.push_ctas << " push + " << (plan.ctas - plan.push_ctas)
        << " sum CTAs x " << kWarps << " warps, " << plan.why << "), "
        << (expert_major ? "expert-major (receiver reduces its experts, fmaf k-ascending)" : "rank-major") << ", "
        << combine_format_explain()
        << "; push chosen: the receiver reduces and stores in one pass, pull would add a write + read of every row"
        << "; fast path";
    combine_explain_ = why.str();
    if (args.eager) sync_and_check(stream);
  }

  void enable_trace(EpConfig const&, int max_events_per_warp) override {
    FERRY_CHECK_CUDA(cudaSetDevice(comm_.device()));
    trace_.enable(buffers_.rank, buffers_.num_sms * kWarps, max_events_per_warp);
  }

  TraceBuffer read_trace(EpConfig const&, TraceKernel kernel, cudaStream_t stream) override {
    return trace_.read(kernel, stream);
  }

  std::string explain() const override {
    std::string out = dispatch_explain_.empty() ? std::string("dispatch: not run") : dispatch_explain_;
    out += "\n";
    out += combine_explain_.empty() ? std::string("combine: not run") : combine_explain_;
    return out;
  }

 private:
  // The wire format part of explain().
  std::string dispatch_format_explain(DispatchArgs const& args) const {
    EpConfig const& config = buffers_.config;
    WireFormat const format = config.dispatch_format;
    if (format == WireFormat::bf16) return "format bf16 (rows copied)";
    std::ostringstream out;
    out << "format " << wire_format_name(format) << " ("
        << (args.num_tokens > 0 && args.x_scales ? "pre-quantized input forwarded"
                                                 : "quantized once per token in the push, no extra pass")
        << ", " << device::unit_elems_for(format, config.hidden) << "-element units), ";
    if (config.dispatch_dequantize)
      out << "delivered as bf16 (wire rows land, then the receiver dequantizes them: a local pass over the rows)";
    else if (config.recv_scale_layout == ScaleLayout::row_major)
      out << "delivered quantized: payload + row_major scales written by the senders in place (no receiver pass)";
    else
      out << "delivered quantized: payload in place; scales land row-major and a receiver pass writes them in "
          << scale_layout_name(config.recv_scale_layout)
          << " (direct stores to that layout would scatter small NVLink writes)";
    return out.str();
  }

  std::string combine_format_explain() const {
    EpConfig const& config = buffers_.config;
    WireFormat const format = config.combine_format;
    if (format == WireFormat::bf16) return "format bf16";
    std::ostringstream out;
    out << "format " << wire_format_name(format) << " (partial rows quantized in the push, "
        << device::unit_elems_for(format, config.hidden)
        << "-element units; the source dequantizes to fp32 and sums ranks ascending"
        << (format == WireFormat::nvfp4 ? "; nvfp4 produces each row twice: its token scale needs the row's amax" : "")
        << ")";
    return out.str();
  }

  void sync_and_check(cudaStream_t stream) {
    FERRY_CHECK_CUDA(cudaStreamSynchronize(stream));
    comm_.check_errors(stream);
  }

  void release() noexcept {
    detail::release_backend_memory(comm_, region_, "EpBuffer", [&] { free_buffers(buffers_); });
  }

  Communicator& comm_;
  SymmetricRegion region_;  // the symmetric region of buffers_.sym
  Buffers buffers_;
  trace::DeviceRecorder trace_;  // Buffers::trace points here
  int last_num_tokens_ = 0;      // of the last dispatch: the rows combine returns
  std::string dispatch_explain_;
  std::string combine_explain_;
};

}  // namespace
}  // namespace ferry::cuda_ep

namespace ferry::detail {

std::unique_ptr<EpBackendImpl> make_cuda_ep(Communicator& comm, EpConfig const& config) {
  return std::make_unique<cuda_ep::CudaEp>(comm, config);
}

}  // namespace ferry::detail
