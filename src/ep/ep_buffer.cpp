#include "ep_impl.hpp"
#include "ferry/error.hpp"

namespace ferry {
namespace detail {

DispatchResult EpBackendImpl::complete_dispatch(cudaStream_t) {
  FERRY_THROW(Error, "ferry", "this backend has no split dispatch (return_recv_hook); use mode=ll");
}

void EpBackendImpl::complete_combine(cudaStream_t) {
  FERRY_THROW(Error, "ferry", "this backend has no split combine (return_recv_hook); use mode=ll");
}

void validate_dispatch_args(EpConfig const& config, DispatchArgs const& args) {
  FERRY_CHECK_INPUT(args.num_tokens >= 0 && args.num_tokens <= config.max_tokens_per_rank,
                    "num_tokens=", args.num_tokens, " is outside [0, max_tokens_per_rank=", config.max_tokens_per_rank,
                    "]; split the batch or raise max_tokens_per_rank");
  FERRY_CHECK_INPUT(!args.expand || config.expert_slots() > 0, "expand=true needs EpConfig::expert_capacity (rows per ",
                    "local expert of the expert-major layout); set it when creating the EpBuffer");
  bool const prequantized = args.x_scales != nullptr;
  FERRY_CHECK_INPUT(!prequantized || config.dispatch_format != WireFormat::bf16,
                    "x_scales is set (pre-quantized input) but dispatch_format=bf16 has no scales; pass bf16 x without "
                    "x_scales, or create the EpBuffer with the format x is quantized in");
  bool const token_scales = config.dispatch_format == WireFormat::nvfp4;
  FERRY_CHECK_INPUT(args.x_token_scales == nullptr || (prequantized && token_scales),
                    "x_token_scales is set, but it belongs only to pre-quantized nvfp4 input (x_scales set, "
                    "dispatch_format=nvfp4; here dispatch_format=",
                    wire_format_name(config.dispatch_format), prequantized ? "" : ", x_scales null", ")");
  if (args.num_tokens == 0) return;
  FERRY_CHECK_INPUT(
      !prequantized || !token_scales || args.x_token_scales != nullptr,
      "pre-quantized nvfp4 input needs x_token_scales (the per-token fp32 scales) for num_tokens=", args.num_tokens);
  // NOTE: scale rows are read as 4-byte words (fp32 scales) or bytes; payload rows as 16-byte vectors.
  FERRY_CHECK_INPUT(!prequantized || reinterpret_cast<uintptr_t>(args.x_scales) % 4 == 0, "x_scales=", args.x_scales,
                    " is not 4-byte aligned");
  FERRY_CHECK_INPUT(args.x_token_scales == nullptr || reinterpret_cast<uintptr_t>(args.x_token_scales) % 4 == 0,
                    "x_token_scales=", static_cast<void const*>(args.x_token_scales), " is not 4-byte aligned");
  FERRY_CHECK_INPUT(args.x != nullptr, "x is null for num_tokens=", args.num_tokens);
  FERRY_CHECK_INPUT(args.topk_idx != nullptr, "topk_idx is null for num_tokens=", args.num_tokens);
  FERRY_CHECK_INPUT(args.topk_weights != nullptr, "topk_weights is null for num_tokens=", args.num_tokens);
  // NOTE: rows are read as 16-byte vectors.
  FERRY_CHECK_INPUT(reinterpret_cast<uintptr_t>(args.x) % 16 == 0, "x=", args.x, " is not 16-byte aligned");
}

void validate_combine_args(EpConfig const&, CombineArgs const& args, bool have_dispatch) {
  FERRY_CHECK_INPUT(have_dispatch,
                    "combine called before any dispatch on this EpBuffer; combine returns the rows of "
                    "the most recent dispatch");
  FERRY_CHECK_INPUT(args.x != nullptr, "combine x is null");
  FERRY_CHECK_INPUT(reinterpret_cast<uintptr_t>(args.x) % 16 == 0, "combine x=", args.x, " is not 16-byte aligned");
  FERRY_CHECK_INPUT(reinterpret_cast<uintptr_t>(args.y) % 16 == 0, "combine y=", args.y, " is not 16-byte aligned");
}

}  // namespace detail

EpBuffer::EpBuffer(std::shared_ptr<Communicator> comm, EpConfig const& config)
    : comm_(std::move(comm)), config_(config) {
  FERRY_CHECK_CONFIG(comm_ != nullptr, "EpBuffer needs a communicator");
  config_.validate(comm_->world());
  config_ = config_.resolved(comm_->world());
  comm_->ensure_usable();
  switch (comm_->backend()) {
    case Backend::cpu:
      impl_ = detail::make_cpu_ep(*comm_, config_);
      break;
    case Backend::cuda:
#if FERRY_HAVE_CUDA
      impl_ = config_.mode == Mode::low_latency ? detail::make_cuda_ll_ep(*comm_, config_)
                                                : detail::make_cuda_ep(*comm_, config_);
      break;
#else
      FERRY_THROW(ConfigError, "config",
                  "backend cuda is not compiled into this build; rebuild with FERRY_ENABLE_CUDA=ON");
#endif
  }
}

EpBuffer::~EpBuffer() = default;

namespace {
// NOTE: a leg whose receive half is pending still owns the buffers (the send half's rows are landing in them), so
// nothing else may start until the hook is completed.
void check_no_pending(char const* call, char const* pending) {
  FERRY_CHECK_INPUT(*pending == '\0', call, " called while the receive half of a ", pending,
                    " (return_recv_hook=true) is pending; call complete_", pending, " first");
}
void check_hook_mode(EpConfig const& config, bool hook, char const* leg) {
  FERRY_CHECK_INPUT(!hook || config.mode == Mode::low_latency, leg, " return_recv_hook=true needs mode=ll (this ",
                    "EpBuffer is mode=", mode_name(config.mode), ")");
}
}  // namespace

DispatchResult EpBuffer::dispatch(DispatchArgs const& args, cudaStream_t stream) {
  comm_->ensure_usable();
  check_no_pending("dispatch", pending_hook());
  check_hook_mode(config_, args.return_recv_hook, "dispatch");
  detail::validate_dispatch_args(config_, args);
  DispatchResult result = impl_->dispatch(args, stream);
  if (args.return_recv_hook) pending_ = Pending::dispatch;
  return result;
}

void EpBuffer::combine(CombineArgs const& args, cudaStream_t stream) {
  comm_->ensure_usable();
  check_no_pending("combine", pending_hook());
  check_hook_mode(config_, args.return_recv_hook, "combine");
  impl_->combine(args, stream);
  if (args.return_recv_hook) pending_ = Pending::combine;
}

DispatchResult EpBuffer::complete_dispatch(cudaStream_t stream) {
  comm_->ensure_usable();
  FERRY_CHECK_INPUT(
      pending_ == Pending::dispatch, "complete_dispatch called without a pending dispatch (",
      *pending_hook() ? detail::concat("the pending hook is of ", pending_hook()) : std::string("none is pending"),
      "); call it once after each dispatch with return_recv_hook=true");
  pending_ = Pending::none;
  return impl_->complete_dispatch(stream);
}

void EpBuffer::complete_combine(cudaStream_t stream) {
  comm_->ensure_usable();
  FERRY_CHECK_INPUT(
      pending_ == Pending::combine, "complete_combine called without a pending combine (",
      *pending_hook() ? detail::concat("the pending hook is of ", pending_hook()) : std::string("none is pending"),
      "); call it once after each combine with return_recv_hook=true");
  pending_ = Pending::none;
  impl_->complete_combine(stream);
}

char const* EpBuffer::pending_hook() const {
  switch (pending_) {
    case Pending::dispatch:
      return "dispatch";
    case Pending::combine:
      return "combine";
    default:
      return "";
  }
}

std::string EpBuffer::explain() const {
  return impl_->explain();
}

}  // namespace ferry
