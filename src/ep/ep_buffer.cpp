#include "ep_impl.hpp"
#include "ferry/error.hpp"

namespace ferry {
namespace detail {

void validate_dispatch_args(EpConfig const& config, DispatchArgs const& args) {
  FERRY_CHECK_INPUT(args.num_tokens >= 0 && args.num_tokens <= config.max_tokens_per_rank,
                    "num_tokens=", args.num_tokens, " is outside [0, max_tokens_per_rank=", config.max_tokens_per_rank,
                    "]; split the batch or raise max_tokens_per_rank");
  FERRY_CHECK_INPUT(!args.expand || config.expert_slots() > 0, "expand=true needs EpConfig::expert_capacity (rows per ",
                    "local expert of the expert-major layout); set it when creating the EpBuffer");
  if (args.num_tokens == 0) return;
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
  comm_->ensure_usable();
  switch (comm_->backend()) {
    case Backend::cpu:
      impl_ = detail::make_cpu_ep(*comm_, config_);
      break;
    case Backend::cuda:
#if FERRY_HAVE_CUDA
      impl_ = detail::make_cuda_ep(*comm_, config_);
      break;
#else
      FERRY_THROW(ConfigError, "config",
                  "backend cuda is not compiled into this build; rebuild with FERRY_ENABLE_CUDA=ON");
#endif
  }
}

EpBuffer::~EpBuffer() = default;

DispatchResult EpBuffer::dispatch(DispatchArgs const& args, cudaStream_t stream) {
  comm_->ensure_usable();
  detail::validate_dispatch_args(config_, args);
  return impl_->dispatch(args, stream);
}

void EpBuffer::combine(CombineArgs const& args, cudaStream_t stream) {
  comm_->ensure_usable();
  impl_->combine(args, stream);
}

std::string EpBuffer::explain() const {
  return impl_->explain();
}

}  // namespace ferry
