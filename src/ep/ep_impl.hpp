// The seam between EpBuffer (host orchestration shared by both backends) and a backend's implementation.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ferry/ep.hpp"

namespace ferry::detail {

struct RunRecord;

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
};

// The backend behind an EpBuffer (EpBuffer befriends this; tests reach it through run_record_of).
struct EpBufferAccess {
  static EpBackendImpl const& impl(EpBuffer const& buffer) { return *buffer.impl_; }
};

std::unique_ptr<EpBackendImpl> make_cpu_ep(Communicator& comm, EpConfig const& config);
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
