#include <algorithm>
#include <cstring>
#include <vector>

#include "ep/buffer_memory.hpp"
#include "ep/capacity.hpp"
#include "ep/reference.hpp"
#include "ep_impl.hpp"
#include "ferry/error.hpp"
#include "wire/layout.hpp"

namespace ferry {
namespace detail {

DispatchResult EpBackendImpl::complete_dispatch(cudaStream_t) {
  FERRY_THROW(Error, "ferry", "this backend has no split dispatch (return_recv_hook); use mode=ll");
}

void EpBackendImpl::complete_combine(cudaStream_t) {
  FERRY_THROW(Error, "ferry", "this backend has no split combine (return_recv_hook); use mode=ll");
}

std::unique_ptr<HandleStorage> EpBackendImpl::make_handle_storage(void*) const {
  FERRY_THROW(ConfigError, "config", "this backend has no dispatch handles (use mode=normal)");
}
void EpBackendImpl::save_handle(HandleState&, DispatchArgs const&, cudaStream_t) {
  FERRY_THROW(ConfigError, "config", "this backend has no dispatch handles (use mode=normal)");
}
DispatchArgs EpBackendImpl::cached_args(HandleState const&, DispatchArgs) const {
  FERRY_THROW(ConfigError, "config", "this backend has no cached dispatch (use mode=normal)");
}
void EpBackendImpl::restore_handle(HandleState const&, cudaStream_t) {
  FERRY_THROW(ConfigError, "config", "this backend has no dispatch handles (use mode=normal)");
}
void EpBackendImpl::copy_rank_counts(HandleState const&, int32_t*, cudaStream_t) const {
  FERRY_THROW(ConfigError, "config", "this backend's dispatch handles do not keep the count matrix in this version ",
              "(copy_rank_counts: the cpu backend has it)");
}
void EpBackendImpl::combine_unweighted(CombineArgs const&, bool, cudaStream_t) {
  FERRY_THROW(ConfigError, "config", "this backend has no backward passes (train with mode=normal)");
}
void EpBackendImpl::combine_backward_weights(HandleState const&, void const*, float*, bool, cudaStream_t) {
  FERRY_THROW(ConfigError, "config", "this backend has no backward passes (train with mode=normal)");
}
void EpBackendImpl::refuse_combine_backward_weights(cudaStream_t) {
  FERRY_THROW(ConfigError, "config", "this backend has no backward passes (train with mode=normal)");
}
void EpBackendImpl::copy(CopyPlan const& plan, cudaStream_t) {
  for (int a = 0; a < plan.num_areas; ++a)
    if (plan.areas[a].bytes > 0) std::memcpy(plan.areas[a].dst, plan.areas[a].src, plan.areas[a].bytes);
  for (std::size_t i = 0; i < plan.num_ids; ++i) {
    if (plan.ids_64)
      static_cast<int64_t*>(plan.ids_dst)[i] = plan.ids[i];
    else
      static_cast<int32_t*>(plan.ids_dst)[i] = plan.ids[i];
  }
}
void EpBackendImpl::mask_ranks(std::vector<int> const&) {
  FERRY_THROW(ConfigError, "config", "this backend has no rank masking");
}
void EpBackendImpl::clear_mask() {
  FERRY_THROW(ConfigError, "config", "this backend has no rank masking");
}
WaitStats EpBackendImpl::wait_stats(cudaStream_t) const {
  FERRY_THROW(ConfigError, "config", "this backend records no wait statistics");
}
void EpBackendImpl::reset_wait_stats(cudaStream_t) {
  FERRY_THROW(ConfigError, "config", "this backend records no wait statistics");
}

void validate_dispatch_args(EpConfig const& config, DispatchArgs const& args) {
  FERRY_CHECK_INPUT(args.num_tokens >= 0 && args.num_tokens <= config.max_tokens_per_rank,
                    "num_tokens=", args.num_tokens, " is outside [0, max_tokens_per_rank=", config.max_tokens_per_rank,
                    "]; split the batch or raise max_tokens_per_rank");
  FERRY_CHECK_INPUT(args.topk_idx_type == IndexType::int32 || args.topk_idx_type == IndexType::int64,
                    "topk_idx_type=", static_cast<int>(args.topk_idx_type), " is not int32 or int64");
  FERRY_CHECK_INPUT(!args.expand || config.expert_slots() > 0, "expand=true needs EpConfig::expert_capacity (rows per ",
                    "local expert of the expert-major layout); set it when creating the EpBuffer");
  FERRY_CHECK_INPUT(args.x_repeat == 1 || config.mode == Mode::low_latency, "x_repeat=", args.x_repeat,
                    " belongs to low-latency mode (mode=normal here); pass x_repeat=1");
  FERRY_CHECK_INPUT(args.x_repeat >= 1 && args.num_tokens % args.x_repeat == 0, "x_repeat=", args.x_repeat,
                    " must be >= 1 and divide num_tokens=", args.num_tokens);
  FERRY_CHECK_INPUT(args.expert_counts_host == nullptr || args.eager,
                    "expert_counts_host is set on a lazy call (eager=false), which never synchronises; read "
                    "DispatchResult::expert_counts on the device, or call eagerly");
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
  if (args.group == 1 && args.group_weights == nullptr) return;
  FERRY_CHECK_INPUT(config.mode == Mode::low_latency && config.topk == 1, "combine group=", args.group,
                    " / group_weights belong to low-latency mode with topk 1 (an entry-per-token dispatch; here mode=",
                    mode_name(config.mode), ", topk=", config.topk, "); pass group=1 and no group_weights");
  FERRY_CHECK_INPUT(args.group >= 1 && last_num_tokens % args.group == 0, "combine group=", args.group,
                    " must be >= 1 and divide the ", last_num_tokens, " tokens of the last dispatch");
  FERRY_CHECK_INPUT(last_num_tokens == 0 || args.group_weights != nullptr, "combine group=", args.group,
                    " needs group_weights (one fp32 weight per token of the last dispatch)");
  FERRY_CHECK_INPUT(reinterpret_cast<uintptr_t>(args.group_weights) % 4 == 0,
                    "combine group_weights=", static_cast<void const*>(args.group_weights), " is not 4-byte aligned");
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
  std::vector<int64_t> const ids = host_topk_ids(config, args);
  ref::validate_topk_idx(config, rank, args.num_tokens, ids);
  int const group = entry_group(config, args.x_repeat);
  // entries of one token sent as tokens of their own (x_repeat): distinct ids within a group, as within a token
  for (int t = 0; group > 1 && t < args.num_tokens; ++t) {
    int64_t const id = ids[static_cast<std::size_t>(t)];
    for (int j = t - t % group; j < t && id >= 0; ++j)
      FERRY_CHECK_INPUT(ids[static_cast<std::size_t>(j)] != id, "rank ", rank, ": topk_idx[", t, "]=", id,
                        " repeats topk_idx[", j, "] of its x_repeat=", args.x_repeat,
                        " group (the entries of one token); a token picks distinct experts (use -1 for an unused "
                        "entry)");
  }
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
    {"internode_route", [](EpConfig const& c) -> int64_t { return static_cast<int64_t>(c.internode_route); },
     [](int64_t v) { return std::string(internode_route_name(static_cast<InternodeRoute>(v))); }},
    {"expert_capacity", [](EpConfig const& c) { return optional_value(c.expert_capacity); }, optional_text},
    {"rank_masking", [](EpConfig const& c) -> int64_t { return c.rank_masking; }, number_text},
    {"wait_stats", [](EpConfig const& c) -> int64_t { return c.wait_stats; }, number_text},
    {"dispatch_geometry.blocks",
     [](EpConfig const& c) -> int64_t { return c.dispatch_geometry ? c.dispatch_geometry->blocks : -1; },
     optional_text},
    {"combine_geometry.blocks",
     [](EpConfig const& c) -> int64_t { return c.combine_geometry ? c.combine_geometry->blocks : -1; }, optional_text},
};
constexpr std::size_t kNumConfigFields = sizeof(kConfigFields) / sizeof(kConfigFields[0]);

// Collective, before anything is allocated: every rank's buffers must fit in what its host or GPU has free
// (buffer_memory's formula), else every rank raises ConfigError naming the ranks that lack memory, with the bytes the
// config needs and the bytes free. A size far past the machine (expert_capacity=2**28) otherwise mapped tens of GiB,
// or got the process killed by the kernel's OOM killer.
void check_memory(Communicator& comm, EpConfig const& config) {
  detail::BufferMemory const need = detail::buffer_memory(config, comm.topology(), comm.backend());
  detail::FreeMemory const free = detail::free_memory(comm);
  // NOTE: the cpu backend's ranks share one host (CpuCommunicator refuses others); each cuda rank has its own GPU
  int const ranks_on_host = comm.backend() == Backend::cpu ? comm.world() : 1;
  detail::FreeMemory mine = free;
  std::vector<detail::FreeMemory> all(static_cast<std::size_t>(comm.world()));
  comm.bootstrap().allgather(&mine, all.data(), sizeof(mine));
  std::string lacking;
  for (int r = 0; r < comm.world(); ++r)
    if (std::string const short_of =
            detail::memory_shortfall(need, all[static_cast<std::size_t>(r)], comm.backend(), ranks_on_host);
        !short_of.empty())
      lacking += detail::concat(lacking.empty() ? "" : "; ", "rank ", r, " ", short_of);
  if (lacking.empty()) return;
  int64_t const most_rows = static_cast<int64_t>(comm.world()) * config.max_tokens_per_rank;
  std::string const hint =
      config.expert_capacity && *config.expert_capacity > most_rows
          ? detail::concat("no expert receives more than world x max_tokens_per_rank = ", most_rows,
                           " rows, so expert_capacity=", *config.expert_capacity,
                           " holds slots that never fill: use at most ", most_rows)
          : std::string(
                "lower expert_capacity, max_tokens_per_rank, max_recv_tokens or hidden, or use a quantized "
                "dispatch_format");
  FERRY_THROW(ConfigError, "config", "this EpBuffer needs ", need.describe(), " per rank (", need.symmetric,
              " bytes symmetric, ", need.local, " bytes local, backend ", backend_name(comm.backend()),
              "), more than is free: ", lacking, "; nothing was allocated on any rank: ", hint);
}

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
  } catch (ConfigError const& error) {
    invalid = error.what();
  }
  agree_on_config(config, invalid);
  config_ = config_.resolved(comm_->world());
  check_memory(*comm_, config_);
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
// NOTE: the rows a dispatch did not deliver are missing from every sum over its layout, so nothing over it runs; every
// rank of that dispatch knows it dropped (DispatchResult::dropped_rows is the same on every rank), so every rank
// refuses the same call. The drop report still pending in the error block (a lazy dispatch) is consumed here and
// quoted: it is this same drop, and it would otherwise be raised again by the next call.
void check_not_dropped(Communicator& comm, int64_t dropped, char const* call, cudaStream_t stream) {
  if (dropped <= 0) return;
  std::string cause = "a capacity was exceeded (max_recv_tokens, or expert_capacity for expert-major rows)";
  try {
    comm.check_errors(stream);
  } catch (InputError const& report) {
    // the report names the rank: "... because rank R's capacity was exceeded (...); every rank ..."
    std::string const text = report.what();
    std::size_t const from = text.find("rank ");
    std::size_t const to = text.find(')', from);
    if (from != std::string::npos && to != std::string::npos) cause = text.substr(from, to + 1 - from);
  }
  FERRY_THROW(InputError, "input", call, " refers to a dispatch that did not deliver ", dropped, " row(s) because ",
              cause, "; a sum over its layout would miss them, so every rank refuses it: raise the capacity or send ",
              "fewer tokens per call, and dispatch again");
}
}  // namespace

// NOTE: a call made while this rank's hook is pending, or on a failed communicator, is refused here alone: the
// buffers still belong to the pending call (or a peer may be gone), so this rank cannot join the exchange. Its peers'
// next call then ends in TimeoutError naming this rank, within FERRY_TIMEOUT_S (docs/errors.md).
DispatchResult EpBuffer::dispatch(DispatchArgs const& args, cudaStream_t stream) {
  comm_->ensure_usable();
  check_no_pending("dispatch", pending_hook());
  have_dispatch_ = false;
  current_handle_.reset();
  DispatchArgs run = args;
  try {
    check_stream(*comm_, stream);
    check_hook_mode(config_, args.return_recv_hook, "dispatch");
    FERRY_CHECK_INPUT(args.save_handle == nullptr || args.handle == nullptr,
                      "dispatch save_handle and handle are both set; a cached dispatch (handle) keeps its layout in "
                      "that handle already");
    if (args.save_handle != nullptr) check_handle(*args.save_handle, "dispatch save_handle", false);
    if (args.handle != nullptr) {
      detail::HandleState const& handle = check_handle(*args.handle, "dispatch handle", true);
      FERRY_CHECK_INPUT(args.topk_idx == nullptr && args.topk_weights == nullptr,
                        "a cached dispatch (handle set) routes by the handle's saved ids and weights; pass topk_idx "
                        "and topk_weights as null");
      FERRY_CHECK_INPUT(args.num_tokens == handle.num_tokens,
                        "a cached dispatch has the handle's num_tokens=", handle.num_tokens,
                        ", got num_tokens=", args.num_tokens);
      check_not_dropped(*comm_, handle.dropped, "a cached dispatch (handle)", stream);
      run = impl_->cached_args(handle, args);
    }
    detail::validate_dispatch_args(config_, run);
    // ids on the host are checked here; the cuda backend checks them on the device and refuses the call there
    if (comm_->backend() == Backend::cpu) detail::validate_host_topk_idx(config_, comm_->rank(), run);
    // NOTE: backend cuda's low-latency kernels find an entry past expert_capacity on its receiver alone: an eager
    // call raises there, and that rank refuses its combine, so every rank's combine raises; a lazy call could let the
    // other ranks' combine sum without the dropped entries before anyone checks (docs/errors.md, "Capacities"). A
    // lazy call is taken where this rank's call cannot send an expert more than its share of the slots
    // (expert_capacity / world; with x_repeat one entry per group, a repeat in a group is refused by the kernels): a
    // rank past its share refuses the call, so every rank does.
    FERRY_CHECK_INPUT(
        comm_->backend() != Backend::cuda || config_.mode != Mode::low_latency || run.eager ||
            !detail::call_slot_drops_possible(config_, comm_->world(), run.num_tokens, run.x_repeat),
        "dispatch eager=false with expert_capacity=", config_.expert_slots(), " below world * ",
        detail::entries_per_expert_from_rank(config_, run.num_tokens, run.x_repeat),
        " (the entries this rank's call can send one expert: num_tokens=", run.num_tokens,
        detail::entry_group(config_, run.x_repeat) > 1 ? detail::concat(" / x_repeat=", run.x_repeat) : "",
        ") in mode=ll on backend cuda: an entry past the capacity is found by its receiver alone, and a "
        "lazy call (a captured graph) could not stop the other ranks from summing without it; dispatch "
        "with eager=true, send fewer tokens, or raise expert_capacity (unset: the worst case) to "
        "capture the call");
  } catch (InputError const& error) {
    join_refused(Leg::dispatch, error.what(), stream);
    throw;
  }
  DispatchResult result = impl_->dispatch(run, stream);
  have_dispatch_ = true;
  last_dropped_ = result.dropped_rows;
  last_result_ = result;
  last_expand_ = args.expand || config_.mode == Mode::low_latency;
  last_num_tokens_ = args.num_tokens;
  if (args.return_recv_hook) pending_ = Pending::dispatch;
  if (args.save_handle != nullptr) {
    detail::HandleState& handle = *args.save_handle->state_;
    impl_->save_handle(handle, run, stream);
    handle.saved = true;
    handle.num_tokens = args.num_tokens;
    handle.expanded = args.expand;
    handle.dropped = result.dropped_rows;
    ++handle.version;
    make_current(args.save_handle->state_);
  } else if (args.handle != nullptr) {
    make_current(args.handle->state_);  // the same ids gave the same layout
  }
  return result;
}

void EpBuffer::combine(CombineArgs const& args, cudaStream_t stream) {
  comm_->ensure_usable();
  check_no_pending("combine", pending_hook());
  try {
    check_stream(*comm_, stream);
    check_hook_mode(config_, args.return_recv_hook, "combine");
    if (args.handle != nullptr) {
      detail::HandleState const& handle = check_handle(*args.handle, "combine handle", true);
      detail::validate_combine_args(config_, args, true, handle.expanded, handle.num_tokens);
      check_not_dropped(*comm_, handle.dropped, "combine (handle)", stream);
    } else {
      detail::validate_combine_args(config_, args, have_dispatch_, last_expand_, last_num_tokens_);
      check_not_dropped(*comm_, last_dropped_, "combine", stream);
    }
  } catch (InputError const& error) {
    join_refused(Leg::combine, error.what(), stream);
    throw;
  }
  if (args.handle != nullptr) use_handle(args.handle->state_, stream);
  impl_->combine(args, stream);
  if (args.return_recv_hook) pending_ = Pending::combine;
}

void EpBuffer::copy_received(ReceivedCopy const& to, cudaStream_t stream) {
  comm_->ensure_usable();
  check_stream(*comm_, stream);
  FERRY_CHECK_CONFIG(config_.mode == Mode::normal,
                     "copy_received copies the rank-major outputs of normal mode; "
                     "mode=ll delivers the expert-major layout only (DispatchResult::expert_x)");
  FERRY_CHECK_INPUT(have_dispatch_,
                    "copy_received without a successful dispatch on this EpBuffer (none yet, or the "
                    "last one was refused)");
  DispatchResult const& from = last_result_;
  FERRY_CHECK_INPUT(to.rows >= 0 && to.rows <= from.recv_capacity, "copy_received rows=", to.rows,
                    " is outside [0, recv_capacity=", from.recv_capacity, "]");
  bool const quantized = config_.delivers_quantized();
  FERRY_CHECK_INPUT(to.recv_scales == nullptr || (quantized && config_.recv_scale_layout == ScaleLayout::row_major),
                    "copy_received recv_scales is set, but this buffer delivers ",
                    quantized
                        ? detail::concat("scales in recv_scale_layout=", scale_layout_name(config_.recv_scale_layout),
                                         " (row_major only)")
                        : std::string("bf16 rows without scales"));
  FERRY_CHECK_INPUT(to.recv_token_scales == nullptr || from.recv_token_scales != nullptr,
                    "copy_received recv_token_scales is set, but only a delivered nvfp4 payload has token scales");
  FERRY_CHECK_INPUT(to.recv_topk_idx_type == IndexType::int32 || to.recv_topk_idx_type == IndexType::int64,
                    "copy_received recv_topk_idx_type=", static_cast<int>(to.recv_topk_idx_type),
                    " is not int32 or int64");
  FERRY_CHECK_INPUT(reinterpret_cast<uintptr_t>(to.recv_x) % 16 == 0, "copy_received recv_x=", to.recv_x,
                    " is not 16-byte aligned");
  std::size_t const rows = static_cast<std::size_t>(to.rows);
  std::size_t const topk = static_cast<std::size_t>(config_.topk);
  detail::EpBackendImpl::CopyPlan plan;
  auto const area = [&](void const* src, void* dst, std::size_t bytes) {
    if (dst != nullptr && bytes > 0) plan.areas[plan.num_areas++] = {src, dst, bytes};
  };
  area(from.recv_x, to.recv_x, rows * from.recv_row_bytes);
  if (to.recv_scales != nullptr) {
    WireRowLayout const wire = wire::make_row_layout(config_.dispatch_format, config_.hidden);
    area(from.recv_scales, to.recv_scales, rows * static_cast<std::size_t>(wire.num_scales) * wire.scale_bytes);
  }
  area(from.recv_token_scales, to.recv_token_scales, rows * sizeof(float));
  area(from.recv_topk_weights, to.recv_topk_weights, rows * topk * sizeof(float));
  area(from.recv_src, to.recv_src, rows * 2 * sizeof(int32_t));
  if (to.recv_topk_idx != nullptr && rows > 0) {
    plan.ids = from.recv_topk_idx;
    plan.ids_dst = to.recv_topk_idx;
    plan.ids_64 = to.recv_topk_idx_type == IndexType::int64;
    plan.num_ids = rows * topk;
  }
  impl_->copy(plan, stream);
}

DispatchHandle EpBuffer::make_handle(void* storage, std::size_t storage_bytes) const {
  FERRY_CHECK_CONFIG(config_.mode == Mode::normal, "mode=ll has no dispatch handles or backward passes; train ",
                     "with mode=normal (docs/training.md)");
  std::size_t const bytes = impl_->handle_bytes();
  if (storage != nullptr) {
    FERRY_CHECK_INPUT(comm_->backend() == Backend::cuda, "make_handle storage is set, but the cpu backend keeps ",
                      "handles in host memory; pass null");
    FERRY_CHECK_INPUT(storage_bytes >= bytes, "make_handle storage_bytes=", storage_bytes,
                      " is smaller than handle_bytes()=", bytes);
    FERRY_CHECK_INPUT(reinterpret_cast<uintptr_t>(storage) % 16 == 0, "make_handle storage=", storage,
                      " is not 16-byte aligned");
  }
  auto state = std::make_shared<detail::HandleState>();
  state->comm = comm_.get();
  state->backend = comm_->backend();
  state->world = comm_->world();
  state->num_experts = config_.num_experts;
  state->topk = config_.topk;
  state->max_tokens = config_.max_tokens_per_rank;
  state->recv_capacity = config_.recv_capacity(comm_->world());
  state->expert_slots = config_.expert_slots();
  state->bytes = bytes;
  state->storage = impl_->make_handle_storage(storage);
  DispatchHandle handle;
  handle.state_ = std::move(state);
  return handle;
}

void EpBuffer::copy_rank_counts(DispatchHandle const& handle, int32_t* out, cudaStream_t stream) const {
  comm_->ensure_usable();
  check_stream(*comm_, stream);
  detail::HandleState const& h = check_handle(handle, "copy_rank_counts handle", true);
  FERRY_CHECK_INPUT(out != nullptr, "copy_rank_counts out is null");
  FERRY_CHECK_INPUT(reinterpret_cast<uintptr_t>(out) % 4 == 0, "copy_rank_counts out=", static_cast<void*>(out),
                    " is not 4-byte aligned");
  impl_->copy_rank_counts(h, out, stream);
}

std::size_t EpBuffer::handle_bytes() const {
  return config_.mode == Mode::normal ? impl_->handle_bytes() : 0;
}

void EpBuffer::dispatch_backward(DispatchBackwardArgs const& args, cudaStream_t stream) {
  comm_->ensure_usable();
  FERRY_CHECK_CONFIG(config_.mode == Mode::normal, "dispatch_backward: mode=ll has no backward passes; train with ",
                     "mode=normal (docs/training.md)");
  check_no_pending("dispatch_backward", pending_hook());
  CombineArgs combine;
  combine.layout = args.layout;
  combine.x = args.grad;
  combine.y = args.grad_x;
  combine.eager = args.eager;
  try {
    check_stream(*comm_, stream);
    FERRY_CHECK_INPUT(args.handle != nullptr, "dispatch_backward needs the forward dispatch's handle (saved with ",
                      "DispatchArgs::save_handle)");
    detail::HandleState const& handle = check_handle(*args.handle, "dispatch_backward handle", true);
    FERRY_CHECK_INPUT(args.layout != CombineLayout::expert_major || handle.expanded,
                      "dispatch_backward layout=expert_major needs a handle saved by a dispatch with expand=true");
    check_not_dropped(*comm_, handle.dropped, "dispatch_backward", stream);
    FERRY_CHECK_INPUT(args.grad != nullptr, "dispatch_backward grad is null");
    FERRY_CHECK_INPUT(reinterpret_cast<uintptr_t>(args.grad) % 16 == 0, "dispatch_backward grad=", args.grad,
                      " is not 16-byte aligned");
    FERRY_CHECK_INPUT(handle.num_tokens == 0 || args.grad_x != nullptr, "dispatch_backward grad_x is null for the ",
                      handle.num_tokens, " tokens of the handle's dispatch");
    FERRY_CHECK_INPUT(reinterpret_cast<uintptr_t>(args.grad_x) % 16 == 0, "dispatch_backward grad_x=", args.grad_x,
                      " is not 16-byte aligned");
  } catch (InputError const& error) {
    join_refused(Leg::combine, error.what(), stream);
    throw;
  }
  use_handle(args.handle->state_, stream);
  impl_->combine_unweighted(combine, args.grad_x_fp32, stream);
}

DispatchResult EpBuffer::combine_backward(CombineBackwardArgs const& args, cudaStream_t stream) {
  comm_->ensure_usable();
  FERRY_CHECK_CONFIG(config_.mode == Mode::normal, "combine_backward: mode=ll has no backward passes; train with ",
                     "mode=normal (docs/training.md)");
  check_no_pending("combine_backward", pending_hook());
  bool const expert_major = args.layout == CombineLayout::expert_major;
  have_dispatch_ = false;
  current_handle_.reset();
  DispatchArgs run;
  try {
    check_stream(*comm_, stream);
    FERRY_CHECK_INPUT(args.handle != nullptr, "combine_backward needs the forward dispatch's handle (saved with ",
                      "DispatchArgs::save_handle)");
    detail::HandleState const& handle = check_handle(*args.handle, "combine_backward handle", true);
    check_not_dropped(*comm_, handle.dropped, "combine_backward", stream);
    FERRY_CHECK_INPUT(!config_.delivers_quantized(),
                      "combine_backward dispatches grad_y and needs bf16 rows "
                      "delivered; this EpBuffer has dispatch_format=",
                      wire_format_name(config_.dispatch_format),
                      " without dispatch_dequantize (use a bf16 buffer for the backward pass: the handle fits it)");
    FERRY_CHECK_INPUT(!expert_major || config_.expert_slots() > 0, "combine_backward layout=expert_major needs ",
                      "EpConfig::expert_capacity on this EpBuffer");
    FERRY_CHECK_INPUT(handle.num_tokens == 0 || args.grad_y != nullptr, "combine_backward grad_y is null for the ",
                      handle.num_tokens, " tokens of the handle's dispatch");
    FERRY_CHECK_INPUT(expert_major || (args.x == nullptr && args.grad_topk_weights == nullptr),
                      "combine_backward layout=rank_major has no weights to differentiate (the caller applied them); "
                      "pass x and grad_topk_weights as null");
    FERRY_CHECK_INPUT(args.grad_topk_weights == nullptr || args.x != nullptr,
                      "combine_backward grad_topk_weights needs x, the forward combine's expert outputs");
    FERRY_CHECK_INPUT(reinterpret_cast<uintptr_t>(args.x) % 16 == 0, "combine_backward x=", args.x,
                      " is not 16-byte aligned");
    FERRY_CHECK_INPUT(reinterpret_cast<uintptr_t>(args.grad_topk_weights) % 4 == 0,
                      "combine_backward grad_topk_weights=", static_cast<void const*>(args.grad_topk_weights),
                      " is not 4-byte aligned");
    DispatchArgs cached;
    cached.x = args.grad_y;
    cached.num_tokens = handle.num_tokens;
    cached.expand = expert_major;
    cached.handle = args.handle;                 // a cached dispatch (the backend knows it by this)
    cached.eager = args.eager && !expert_major;  // expert-major: the weight step synchronises
    run = impl_->cached_args(handle, cached);
    detail::validate_dispatch_args(config_, run);
  } catch (InputError const& error) {
    join_refused(Leg::dispatch, error.what(), stream);
    if (expert_major) impl_->refuse_combine_backward_weights(stream);
    throw;
  }
  DispatchResult result;
  try {
    result = expert_major ? impl_->dispatch_gradients(run, stream) : impl_->dispatch(run, stream);
  } catch (InputError const&) {
    // a peer refused (the cpu backend raises it from the dispatch): the weight step's exchange is joined all the same
    if (expert_major) impl_->refuse_combine_backward_weights(stream);
    throw;
  }
  have_dispatch_ = true;
  last_dropped_ = result.dropped_rows;
  last_expand_ = expert_major;
  last_num_tokens_ = run.num_tokens;
  make_current(args.handle->state_);
  if (expert_major)
    impl_->combine_backward_weights(*args.handle->state_, args.x, args.grad_topk_weights, args.eager, stream);
  return result;
}

detail::HandleState const& EpBuffer::check_handle(DispatchHandle const& handle, char const* what,
                                                  bool need_saved) const {
  FERRY_CHECK_INPUT(config_.mode == Mode::normal, what,
                    " is set, but mode=ll has no dispatch handles; use mode=normal");
  FERRY_CHECK_INPUT(!handle.empty(), what, " is an empty DispatchHandle; make it with EpBuffer::make_handle");
  detail::HandleState const& h = *handle.state_;
  FERRY_CHECK_INPUT(h.comm == comm_.get(), what, " was made by an EpBuffer of another communicator");
  auto const field = [&](char const* name, int mine, int theirs) {
    FERRY_CHECK_INPUT(mine == theirs, what, " does not fit this EpBuffer: its ", name, "=", theirs,
                      " but this "
                      "buffer's is ",
                      mine, " (a handle fits buffers of the same layout shape)");
  };
  field("world", comm_->world(), h.world);
  field("num_experts", config_.num_experts, h.num_experts);
  field("topk", config_.topk, h.topk);
  field("max_tokens_per_rank", config_.max_tokens_per_rank, h.max_tokens);
  field("recv_capacity", config_.recv_capacity(comm_->world()), h.recv_capacity);
  field("expert_capacity", config_.expert_slots(), h.expert_slots);
  FERRY_CHECK_INPUT(!need_saved || h.saved, what, " holds no layout yet; fill it with a dispatch whose ",
                    "save_handle is this handle");
  return h;
}

void EpBuffer::make_current(std::shared_ptr<detail::HandleState> const& handle) {
  current_handle_ = handle;
  current_version_ = handle->version;
}

void EpBuffer::use_handle(std::shared_ptr<detail::HandleState> const& handle, cudaStream_t stream) {
  if (current_handle_.lock() != handle || current_version_ != handle->version) {
    impl_->restore_handle(*handle, stream);
    make_current(handle);
  }
  have_dispatch_ = true;
  last_dropped_ = handle->dropped;
  last_expand_ = handle->expanded;
  last_num_tokens_ = handle->num_tokens;
}

void EpBuffer::refuse_dispatch(std::string const& reason, cudaStream_t stream) {
  comm_->ensure_usable();
  check_no_pending("dispatch", pending_hook());
  join_refused(Leg::dispatch, reason, stream);
  throw InputError(reason);
}

void EpBuffer::refuse_combine_backward(CombineLayout layout, std::string const& reason, cudaStream_t stream) {
  comm_->ensure_usable();
  FERRY_CHECK_CONFIG(config_.mode == Mode::normal, "combine_backward: mode=ll has no backward passes; train with ",
                     "mode=normal (docs/training.md)");
  check_no_pending("combine_backward", pending_hook());
  current_handle_.reset();
  join_refused(Leg::dispatch, reason, stream);
  if (layout == CombineLayout::expert_major) impl_->refuse_combine_backward_weights(stream);
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
  DispatchResult result;
  try {
    result = impl_->complete_dispatch(stream);
  } catch (...) {
    have_dispatch_ = false;  // raised after the send half (a drop in eager mode, a peer lost): nothing to combine
    throw;
  }
  last_dropped_ = result.dropped_rows;
  return result;
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

DispatchHandle::DispatchHandle() = default;
DispatchHandle::~DispatchHandle() = default;
DispatchHandle::DispatchHandle(DispatchHandle const&) = default;
DispatchHandle& DispatchHandle::operator=(DispatchHandle const&) = default;
DispatchHandle::DispatchHandle(DispatchHandle&&) noexcept = default;
DispatchHandle& DispatchHandle::operator=(DispatchHandle&&) noexcept = default;
bool DispatchHandle::empty() const {
  return state_ == nullptr;
}
bool DispatchHandle::saved() const {
  return state_ != nullptr && state_->saved;
}
int DispatchHandle::num_tokens() const {
  return state_ != nullptr ? state_->num_tokens : 0;
}
bool DispatchHandle::expanded() const {
  return state_ != nullptr && state_->expanded;
}
std::size_t DispatchHandle::bytes() const {
  return state_ != nullptr ? state_->bytes : 0;
}

MaskStatus EpBuffer::mask_status() const {
  return config_.rank_masking ? impl_->mask_status() : MaskStatus{};
}

std::vector<int> EpBuffer::masked_ranks() const {
  return mask_status().ranks;
}

namespace {
void check_masking(EpConfig const& config, char const* call) {
  FERRY_CHECK_CONFIG(config.rank_masking, call, ": rank masking is off on this EpBuffer; create it with ",
                     "EpConfig::rank_masking=true (mode=ll) on every rank");
}
}  // namespace

void EpBuffer::mask_ranks(std::vector<int> const& ranks) {
  check_masking(config_, "mask_ranks");
  for (int r : ranks)
    FERRY_CHECK_INPUT(r >= 0 && r < comm_->world(), "mask_ranks: rank ", r, " is outside [0, world=", comm_->world(),
                      ")");
  impl_->mask_ranks(ranks);
}

void EpBuffer::clear_mask() {
  check_masking(config_, "clear_mask");
  comm_->ensure_usable();
  check_no_pending("clear_mask", pending_hook());
  // NOTE: the dispatch before the clear may have left out ranks that are back now; a combine refers to a dispatch
  // that every rank of the next call took part in.
  have_dispatch_ = false;
  current_handle_.reset();
  impl_->clear_mask();
}

WaitStats EpBuffer::wait_stats(cudaStream_t stream) const {
  FERRY_CHECK_CONFIG(config_.wait_stats, "wait_stats: this EpBuffer records none; create it with ",
                     "EpConfig::wait_stats=true (mode=ll)");
  check_stream(*comm_, stream);
  return impl_->wait_stats(stream);
}

void EpBuffer::reset_wait_stats(cudaStream_t stream) {
  FERRY_CHECK_CONFIG(config_.wait_stats, "reset_wait_stats: this EpBuffer records none; create it with ",
                     "EpConfig::wait_stats=true (mode=ll)");
  check_stream(*comm_, stream);
  impl_->reset_wait_stats(stream);
}

CallLinkBytes EpBuffer::link_bytes(cudaStream_t stream) const {
  return impl_->link_bytes(stream);
}

std::string EpBuffer::explain() const {
  return impl_->explain();
}

}  // namespace ferry
