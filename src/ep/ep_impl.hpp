// The seam between EpBuffer (host orchestration shared by both backends) and a backend's implementation.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ferry/ep.hpp"

namespace ferry::detail {

struct RunRecord;

// A backend's part of a handle: what it keeps of a dispatch's layout (device memory on cuda, host vectors on cpu).
struct HandleStorage {
  virtual ~HandleStorage() = default;
};

// What a DispatchHandle holds (include/ferry/ep.hpp). The shape fields say which buffers it fits (EpBuffer checks
// them); the saved fields describe the last dispatch saved into it.
struct HandleState {
  Communicator const* comm = nullptr;
  Backend backend = Backend::cpu;
  int world = 0;
  int num_experts = 0;
  int topk = 0;
  int max_tokens = 0;  // max_tokens_per_rank
  int recv_capacity = 0;
  int expert_slots = 0;
  std::size_t bytes = 0;  // device storage (cuda)
  bool saved = false;
  int num_tokens = 0;
  bool expanded = false;
  int64_t dropped = 0;   // DispatchResult::dropped_rows of the saved dispatch (> 0: every call that reads it refuses)
  uint64_t version = 0;  // bumps at every save: EpBuffer knows whether its current layout is this save
  std::unique_ptr<HandleStorage> storage;
};

class EpBackendImpl {
 public:
  virtual ~EpBackendImpl() = default;
  // Arguments were validated by EpBuffer (shapes, counts, pointers, and on cpu the ids); the cuda backend checks the
  // ids on the device, where a bad one refuses the call on every rank (its abort flag in the exchange).
  // With args.return_recv_hook the backend runs the send half only; EpBuffer then guarantees exactly one matching
  // complete_* call before anything else.
  virtual DispatchResult dispatch(DispatchArgs const& args, cudaStream_t stream) = 0;
  virtual void combine(CombineArgs const& args, cudaStream_t stream) = 0;
  virtual std::string explain() const = 0;
  // A call this rank refuses on input still joins the call's exchange (DESIGN "Collective consistency"): EpBuffer
  // posts the reason (Communicator::post_refusal), then calls these, then throws the InputError itself. The backend
  // runs the whole call (both halves in low-latency mode: no hook is left pending) with no rows of its own and its
  // abort flag set in the exchange, so every peer's same call fails with InputError naming this rank (at once on
  // cpu, at the next check on cuda) and the buffer's protocol state (sequence numbers, parities) stays in step on
  // every rank. They throw only for transport failures (TimeoutError, CudaError), never for input.
  virtual void refuse_dispatch(cudaStream_t stream) = 0;
  virtual void refuse_combine(cudaStream_t stream) = 0;
  // The receive halves (low-latency mode). EpBuffer refuses hooks in modes whose backend does not override these.
  virtual DispatchResult complete_dispatch(cudaStream_t stream);
  virtual void complete_combine(cudaStream_t stream);
  // In-kernel tracing (src/trace/): backends whose kernels record override these; the defaults throw ConfigError.
  virtual void enable_trace(EpConfig const& config, int max_events_per_warp);
  virtual TraceBuffer read_trace(EpConfig const& config, TraceKernel kernel, cudaStream_t stream);
  // What the last calls ran (run_record.hpp), for explain() and the fast-path test; null where none is kept (cpu).
  virtual RunRecord const* run_record() const { return nullptr; }
  // What the last dispatch and combine sent, by link (EpBuffer::link_bytes); the default counts nothing.
  virtual CallLinkBytes link_bytes(cudaStream_t /*stream*/) const { return {}; }

  // Rank masking (EpConfig::rank_masking, include/ferry/ep.hpp). EpBuffer calls the last three only when masking is
  // on (ConfigError otherwise), with the ranks checked. Defaults: nothing masked; the others throw ConfigError.
  virtual MaskStatus mask_status() const { return {}; }
  virtual void mask_ranks(std::vector<int> const& ranks);
  virtual void clear_mask();
  // Wait statistics (EpConfig::wait_stats); EpBuffer calls these only when it is on. Defaults throw ConfigError.
  virtual WaitStats wait_stats(cudaStream_t stream) const;
  virtual void reset_wait_stats(cudaStream_t stream);

  // Handles and the backward passes (normal mode; EpBuffer refuses them in low-latency mode and checks that a handle
  // fits this backend's shape before any of these runs). The defaults throw ConfigError.
  // Device bytes of one handle's storage (0: host memory).
  virtual std::size_t handle_bytes() const { return 0; }
  // A handle's storage: external (non-null, at least handle_bytes(), checked by EpBuffer) or the backend's own.
  virtual std::unique_ptr<HandleStorage> make_handle_storage(void* external) const;
  // After a dispatch that succeeded (enqueued after it on `stream`): copy its layout into `handle`, with the ids
  // and weights of `args` (the dispatch's arguments). EpBuffer sets handle's saved fields afterwards.
  virtual void save_handle(HandleState& handle, DispatchArgs const& args, cudaStream_t stream);
  // A cached dispatch: `args` with topk_idx, topk_idx_type and topk_weights pointing at the handle's saved ids and
  // weights (storage the backend reads on its own side: device on cuda, host on cpu). EpBuffer passes the result to
  // dispatch / dispatch_gradients with args.handle still set: that is how a backend knows the dispatch is cached.
  virtual DispatchArgs cached_args(HandleState const& handle, DispatchArgs args) const;
  // combine_backward's cached dispatch of grad_y (expert-major: args.expand). The backend may leave the slots' rows
  // unwritten when its combine_backward_weights writes them (scaled) from the rank-major rows; the default is
  // dispatch.
  virtual DispatchResult dispatch_gradients(DispatchArgs const& args, cudaStream_t stream) {
    return dispatch(args, stream);
  }
  // Make the handle's layout the current one (what combine reads), replacing the last dispatch's.
  virtual void restore_handle(HandleState const& handle, cudaStream_t stream);
  // The count matrix of the dispatch the handle saved (EpBuffer::copy_rank_counts), enqueued on the stream. The
  // default throws ConfigError: a backend whose handles do not keep it yet.
  virtual void copy_rank_counts(HandleState const& handle, int32_t* out, cudaStream_t stream) const;
  // dispatch_backward's combine: as combine, but expert-major entries take the weight 1 (not recv_topk_weights) and,
  // with y_fp32, y is fp32 (the source's sum, not rounded). A refused one is refuse_combine.
  virtual void combine_unweighted(CombineArgs const& args, bool y_fp32, cudaStream_t stream);
  // combine_backward's weight step, after dispatch_gradients (the grad_y rows delivered rank-major): per filled slot
  // (e, j) of entry (row i, k): the fp32 dot of grad_y's row i with x(e, j) (skipped where x is null) goes back to the
  // source as grad_topk_weights[t, k], and expert_x(e, j) becomes bf16(w[t,k] * grad_y row i).
  // The exchange of the dots always runs (collective); grad_w null: this rank writes none. num_tokens: the handle's.
  virtual void combine_backward_weights(HandleState const& handle, void const* x, float* grad_w, bool eager,
                                        cudaStream_t stream);
  // A refused combine_backward (expert-major) joins the exchange of the dots with none of its own.
  virtual void refuse_combine_backward_weights(cudaStream_t stream);
  // EpBuffer::copy_received's copies, enqueued on the stream: the byte areas, then num_ids int32 ids, sign-extended
  // to int64 with ids_64. The default copies on the host (the cpu backend's memory).
  struct CopyPlan {
    struct Area {
      void const* src = nullptr;
      void* dst = nullptr;
      std::size_t bytes = 0;
    };
    Area areas[6];
    int num_areas = 0;
    int32_t const* ids = nullptr;
    void* ids_dst = nullptr;
    bool ids_64 = false;
    std::size_t num_ids = 0;
  };
  virtual void copy(CopyPlan const& plan, cudaStream_t stream);
};

// The backend behind an EpBuffer (EpBuffer befriends this; tests reach it through run_record_of).
struct EpBufferAccess {
  static EpBackendImpl const& impl(EpBuffer const& buffer) { return *buffer.impl_; }
};

std::unique_ptr<EpBackendImpl> make_cpu_ep(Communicator& comm, EpConfig const& config);
// The cuda backend's EpBuffer (make_cuda_ep calls it first): throws ConfigError for a world its kernels cannot
// address, naming the world, the bound and why: past kMaxCudaWorld ranks only low-latency mode across nodes runs (up
// to kMaxWorld), without rank masking. Host code, so that builds without cuda test it.
void check_cuda_world(EpConfig const& config, Topology const& topology);
#if FERRY_HAVE_CUDA
// Every mode and protocol (src/ep/cuda/cuda_ep.cu chooses); config is resolved (EpConfig::resolved).
std::unique_ptr<EpBackendImpl> make_cuda_ep(Communicator& comm, EpConfig const& config);
#endif

// Host checks of a dispatch call that need no device data. Throws InputError naming the argument.
void validate_dispatch_args(EpConfig const& config, DispatchArgs const& args);
// have_dispatch, last_expand, last_num_tokens: the last dispatch on this rank (EpBuffer keeps them).
void validate_combine_args(EpConfig const& config, CombineArgs const& args, bool have_dispatch, bool last_expand,
                           int last_num_tokens);
// The cpu backend's ids (host memory), widened to int64: [num_tokens * topk] (empty for no tokens).
std::vector<int64_t> host_topk_ids(EpConfig const& config, DispatchArgs const& args);
// ...checked: every id in [-1, num_experts), no id twice in a token's row.
void validate_host_topk_idx(EpConfig const& config, int rank, DispatchArgs const& args);

}  // namespace ferry::detail
