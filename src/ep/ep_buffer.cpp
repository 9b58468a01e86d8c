#include <algorithm>
#include <cstring>
#include <vector>

#include "ep/reference.hpp"
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
  FERRY_CHECK_INPUT(args.topk_idx_type == IndexType::int32 || args.topk_idx_type == IndexType::int64,
                    "topk_idx_type=", static_cast<int>(args.topk_idx_type), " is not int32 or int64");
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

void validate_combine_args(EpConfig const& config, CombineArgs const& args, bool have_dispatch, bool last_expand,
                           int last_num_tokens) {
  FERRY_CHECK_INPUT(have_dispatch,
                    "combine called without a successful dispatch on this EpBuffer (none yet, or the last one was "
                    "refused); combine returns the rows of the most recent dispatch");
  FERRY_CHECK_INPUT(args.x != nullptr, "combine x is null");
  FERRY_CHECK_INPUT(reinterpret_cast<uintptr_t>(args.x) % 16 == 0, "combine x=", args.x, " is not 16-byte aligned");
  FERRY_CHECK_INPUT(last_num_tokens == 0 || args.y != nullptr, "combine y is null for the ", last_num_tokens,
                    " tokens of the last dispatch");
  FERRY_CHECK_INPUT(reinterpret_cast<uintptr_t>(args.y) % 16 == 0, "combine y=", args.y, " is not 16-byte aligned");
  // NOTE: expert outputs are laid out by the slots of the last dispatch's expert-major layout (low-latency mode always
  // fills it).
  FERRY_CHECK_INPUT(args.layout != CombineLayout::expert_major || last_expand || config.mode == Mode::low_latency,
                    "combine layout=expert_major needs the last dispatch to have expand=true (its expert-major "
                    "layout gives each row's slots); dispatch with expand=true or combine with layout=rank_major");
}

std::vector<int64_t> host_topk_ids(EpConfig const& config, DispatchArgs const& args) {
  std::vector<int64_t> ids(static_cast<std::size_t>(args.num_tokens) * static_cast<std::size_t>(config.topk));
  if (ids.empty()) return ids;  // topk_idx may be null for num_tokens=0
  if (args.topk_idx_type == IndexType::int64) {
    std::memcpy(ids.data(), args.topk_idx, ids.size() * sizeof(int64_t));
  } else {
    auto const* narrow = static_cast<int32_t const*>(args.topk_idx);
    std::copy(narrow, narrow + ids.size(), ids.begin());
  }
  return ids;
}

void validate_host_topk_idx(EpConfig const& config, int rank, DispatchArgs const& args) {
  ref::validate_topk_idx(config, rank, args.num_tokens, host_topk_ids(config, args));
}

}  // namespace detail

namespace {

// What the ranks compare at construction (EpBuffer::agree_on_config): every field of the requested EpConfig, as
// integers, and whether it passed validate() on that rank.
struct ConfigField {
  char const* name;
  int64_t (*get)(EpConfig const&);
  std::string (*text)(int64_t);  // the value as the user wrote it
};

int64_t optional_value(std::optional<int> const& value) {
  return value ? *value : -1;
}

std::string number_text(int64_t value) {
  return std::to_string(value);
}
std::string optional_text(int64_t value) {
  return value == -1 ? std::string("unset") : std::to_string(value);
}
std::string format_text(int64_t value) {
  return wire_format_name(static_cast<WireFormat>(value));
}

constexpr ConfigField kConfigFields[] = {
    {"hidden", [](EpConfig const& c) -> int64_t { return c.hidden; }, number_text},
    {"num_experts", [](EpConfig const& c) -> int64_t { return c.num_experts; }, number_text},
    {"topk", [](EpConfig const& c) -> int64_t { return c.topk; }, number_text},
    {"max_tokens_per_rank", [](EpConfig const& c) -> int64_t { return c.max_tokens_per_rank; }, number_text},
    {"dispatch_format", [](EpConfig const& c) -> int64_t { return static_cast<int64_t>(c.dispatch_format); },
     format_text},
    {"combine_format", [](EpConfig const& c) -> int64_t { return static_cast<int64_t>(c.combine_format); },
     format_text},
    {"dispatch_dequantize", [](EpConfig const& c) -> int64_t { return c.dispatch_dequantize; }, number_text},
    {"recv_scale_layout", [](EpConfig const& c) -> int64_t { return static_cast<int64_t>(c.recv_scale_layout); },
     [](int64_t v) { return std::string(scale_layout_name(static_cast<ScaleLayout>(v))); }},
    {"mode", [](EpConfig const& c) -> int64_t { return static_cast<int64_t>(c.mode); },
     [](int64_t v) { return std::string(mode_name(static_cast<Mode>(v))); }},
    {"max_recv_tokens", [](EpConfig const& c) { return optional_value(c.max_recv_tokens); }, optional_text},
    {"expert_capacity", [](EpConfig const& c) { return optional_value(c.expert_capacity); }, optional_text},
    {"dispatch_geometry.blocks",
     [](EpConfig const& c) -> int64_t { return c.dispatch_geometry ? c.dispatch_geometry->blocks : -1; },
     optional_text},
    {"combine_geometry.blocks",
     [](EpConfig const& c) -> int64_t { return c.combine_geometry ? c.combine_geometry->blocks : -1; }, optional_text},
};
constexpr std::size_t kNumConfigFields = sizeof(kConfigFields) / sizeof(kConfigFields[0]);

}  // namespace

EpBuffer::EpBuffer(std::shared_ptr<Communicator> comm, EpConfig const& config)
    : comm_(std::move(comm)), config_(config) {
  FERRY_CHECK_CONFIG(comm_ != nullptr, "EpBuffer needs a communicator");
  comm_->ensure_usable();
  // Collective from here: a rank whose config is invalid still takes part in the comparison, so no peer waits for it
  // in the allocations that follow.
  std::string invalid;
  try {
    config_.validate(comm_->world());
    Topology const& topology = comm_->topology();
    FERRY_CHECK_CONFIG(topology.nodes == 1, "EpBuffer over ", topology.nodes, " nodes (topology ",
                       topology_name(topology),
                       ", from FERRY_TOPOLOGY or LOCAL_WORLD_SIZE) needs the inter-node "
                       "protocols, which this version does not have (docs/internode.md); run every rank on one node");
  } catch (ConfigError const& error) {
    invalid = error.what();
  }
  agree_on_config(config, invalid);
  config_ = config_.resolved(comm_->world());
  switch (comm_->backend()) {
    case Backend::cpu:
      impl_ = detail::make_cpu_ep(*comm_, config_);
      break;
    case Backend::cuda:
#if FERRY_HAVE_CUDA
      impl_ = detail::make_cuda_ep(*comm_, config_);  // the mode and protocol are the backend's choice
      break;
#else
      FERRY_THROW(ConfigError, "config",
                  "backend cuda is not compiled into this build; rebuild with FERRY_ENABLE_CUDA=ON");
#endif
  }
}

EpBuffer::~EpBuffer() = default;

void EpBuffer::agree_on_config(EpConfig const& requested, std::string const& invalid) const {
  int const world = comm_->world();
  int const rank = comm_->rank();
  // one row per rank: [valid, fields...]
  std::vector<int64_t> mine(kNumConfigFields + 1);
  mine[0] = invalid.empty() ? 1 : 0;
  for (std::size_t f = 0; f < kNumConfigFields; ++f) mine[f + 1] = kConfigFields[f].get(requested);
  std::vector<int64_t> all(mine.size() * static_cast<std::size_t>(world));
  comm_->bootstrap().allgather(mine.data(), all.data(), mine.size() * sizeof(int64_t));
  if (!invalid.empty()) throw ConfigError(invalid);
  for (int r = 0; r < world; ++r) {
    int64_t const* theirs = all.data() + mine.size() * static_cast<std::size_t>(r);
    FERRY_CHECK_CONFIG(theirs[0] == 1, "rank ", r, "'s EpConfig is invalid (its ConfigError says why), so no rank ",
                       "creates this EpBuffer; fix that rank's config");
    for (std::size_t f = 0; f < kNumConfigFields; ++f)
      FERRY_CHECK_CONFIG(theirs[f + 1] == mine[f + 1], "EpConfig differs between ranks: ", kConfigFields[f].name, "=",
                         kConfigFields[f].text(mine[f + 1]), " on rank ", rank, " but ", kConfigFields[f].name, "=",
                         kConfigFields[f].text(theirs[f + 1]), " on rank ", r,
                         "; every rank must create the EpBuffer with the same config");
  }
}

void EpBuffer::join_refused(Leg leg, std::string const& reason, cudaStream_t stream) {
  if (leg == Leg::dispatch) have_dispatch_ = false;  // combine refers to a dispatch that succeeded
  comm_->post_refusal(reason);
  if (leg == Leg::dispatch)
    impl_->refuse_dispatch(stream);
  else
    impl_->refuse_combine(stream);
}

namespace {
// NOTE: a leg whose receive half is pending still owns the buffers (the send half's rows are landing in them), so
// nothing else may start until the hook is completed.
void check_no_pending(char const* call, char const* pending) {
  FERRY_CHECK_INPUT(*pending == '\0', call, " called while the receive half of a ", pending,
                    " (return_recv_hook=true) is pending; call complete_", pending, " first");
}
void check_stream(Communicator const& comm, cudaStream_t stream) {
  FERRY_CHECK_INPUT(comm.backend() != Backend::cpu || stream == nullptr,
                    "the cpu backend runs on the host: stream must be null, got ", static_cast<void*>(stream));
}
void check_hook_mode(EpConfig const& config, bool hook, char const* leg) {
  FERRY_CHECK_INPUT(!hook || config.mode == Mode::low_latency, leg, " return_recv_hook=true needs mode=ll (this ",
                    "EpBuffer is mode=", mode_name(config.mode), ")");
}
}  // namespace

// NOTE: a call made while this rank's hook is pending, or on a failed communicator, is refused here alone: the
// buffers still belong to the pending call (or a peer may be gone), so this rank cannot join the exchange. Its peers'
// next call then ends in TimeoutError naming this rank, within FERRY_TIMEOUT_S (docs/errors.md).
DispatchResult EpBuffer::dispatch(DispatchArgs const& args, cudaStream_t stream) {
  comm_->ensure_usable();
  check_no_pending("dispatch", pending_hook());
  have_dispatch_ = false;
  try {
    check_stream(*comm_, stream);
    check_hook_mode(config_, args.return_recv_hook, "dispatch");
    detail::validate_dispatch_args(config_, args);
    // ids on the host are checked here; the cuda backend checks them on the device and refuses the call there
    if (comm_->backend() == Backend::cpu) detail::validate_host_topk_idx(config_, comm_->rank(), args);
  } catch (InputError const& error) {
    join_refused(Leg::dispatch, error.what(), stream);
    throw;
  }
  DispatchResult result = impl_->dispatch(args, stream);
  have_dispatch_ = true;
  last_expand_ = args.expand || config_.mode == Mode::low_latency;
  last_num_tokens_ = args.num_tokens;
  if (args.return_recv_hook) pending_ = Pending::dispatch;
  return result;
}

void EpBuffer::combine(CombineArgs const& args, cudaStream_t stream) {
  comm_->ensure_usable();
  check_no_pending("combine", pending_hook());
  try {
    check_stream(*comm_, stream);
    check_hook_mode(config_, args.return_recv_hook, "combine");
    detail::validate_combine_args(config_, args, have_dispatch_, last_expand_, last_num_tokens_);
  } catch (InputError const& error) {
    join_refused(Leg::combine, error.what(), stream);
    throw;
  }
  impl_->combine(args, stream);
  if (args.return_recv_hook) pending_ = Pending::combine;
}

void EpBuffer::refuse_dispatch(std::string const& reason, cudaStream_t stream) {
  comm_->ensure_usable();
  check_no_pending("dispatch", pending_hook());
  join_refused(Leg::dispatch, reason, stream);
  throw InputError(reason);
}

void EpBuffer::refuse_combine(std::string const& reason, cudaStream_t stream) {
  comm_->ensure_usable();
  check_no_pending("combine", pending_hook());
  join_refused(Leg::combine, reason, stream);
  throw InputError(reason);
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
