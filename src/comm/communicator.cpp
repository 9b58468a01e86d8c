#include "comm/comm_impl.hpp"

#include <atomic>

#include "ferry/env.hpp"
#include "ferry/error.hpp"

namespace ferry {

char const* wait_phase_name(WaitPhase phase) {
  switch (phase) {
    case WaitPhase::none:
      return "none";
    case WaitPhase::barrier:
      return "barrier";
    case WaitPhase::count_exchange:
      return "count exchange";
    case WaitPhase::dispatch_data:
      return "dispatch data";
    case WaitPhase::combine_data:
      return "combine data";
    case WaitPhase::ll_dispatch:
      return "low-latency dispatch";
    case WaitPhase::ll_combine:
      return "low-latency combine";
    case WaitPhase::test:
      return "test";
    case WaitPhase::weight_gradients:
      return "weight gradients";
    case WaitPhase::clear_mask:
      return "clear_mask";
  }
  return "unknown";
}

char const* backend_name(Backend backend) {
  return backend == Backend::cpu ? "cpu" : "cuda";
}

Backend parse_backend(std::string const& name) {
  if (name == "cpu") return Backend::cpu;
  if (name == "cuda") return Backend::cuda;
  FERRY_THROW(ConfigError, "config", "backend '", name, "' is unknown; use cpu or cuda");
}

int cuda_device_count() {
#if FERRY_HAVE_CUDA
  return detail::cuda_visible_devices();
#else
  return 0;
#endif
}

bool cuda_available() {
  return cuda_device_count() > 0;
}

std::unique_ptr<Communicator> Communicator::create(std::unique_ptr<Bootstrap> bootstrap,
                                                   CommunicatorOptions const& options) {
  FERRY_CHECK_CONFIG(bootstrap != nullptr, "Communicator::create needs a bootstrap");
  check_env();  // a bad FERRY_* value is refused where the job starts, not when (or if) its reader runs
  switch (options.backend) {
    case Backend::cpu:
      return detail::make_cpu_communicator(std::move(bootstrap), options);
    case Backend::cuda:
#if FERRY_HAVE_CUDA
      // NOTE: said here, in words: the runtime's own answer on a machine without a driver is
      // cudaErrorInsufficientDriver ("CUDA driver version is insufficient"), which reads as a version problem.
      FERRY_CHECK_AS(CudaError, "cuda", cuda_device_count() > 0,
                     "backend cuda needs a GPU, and this process sees none (no NVIDIA driver loaded, no device, or "
                     "CUDA_VISIBLE_DEVICES hides them; nvidia-smi lists the GPUs); run on a machine with GPUs, or "
                     "use backend cpu");
      return detail::make_cuda_communicator(std::move(bootstrap), options);
#else
      FERRY_THROW(ConfigError, "config",
                  "backend cuda is not compiled into this build (no nvcc at configure time); "
                  "rebuild with FERRY_ENABLE_CUDA=ON or use backend cpu");
#endif
  }
  FERRY_THROW(ConfigError, "config", "unknown backend ", static_cast<int>(options.backend));
}

namespace detail {

std::string describe_device_error(DeviceErrorBlock const& block, double timeout_s) {
  if (block.status == 0) return {};
  if (block.status == kErrorOutOfStep)
    return concat("calls out of step: rank ", block.rank, " is in its call ", block.expected,
                  " of this kind in phase '", wait_phase_name(static_cast<WaitPhase>(block.phase)), "' but rank ",
                  block.peer, "'s signal there is of its call ", block.observed,
                  ": the ranks made different numbers of these calls on the buffer; every rank must make the same "
                  "dispatch / combine calls in the same order");
  return concat("rank ", block.rank, " timed out after ", timeout_s, " s in phase '",
                wait_phase_name(static_cast<WaitPhase>(block.phase)), "' waiting for rank ", block.peer,
                " (expected signal >= ", block.expected, ", observed ", block.observed, "); rank ", block.peer,
                " did not arrive: it is stuck, crashed, or skipped a collective call");
}

std::string describe_device_error(DeviceErrorBlock const& block, double timeout_s, Topology const& topology) {
  std::string text = describe_device_error(block, timeout_s);
  if (topology.nodes > 1 && block.status != 0 && block.peer >= 0 && block.peer < topology.world())
    text += concat(" (rank ", block.peer, " is local rank ", topology.local_of(block.peer), " of node ",
                   topology.node_of(block.peer), " of ", topology_name(topology), ")");
  if (block.status != kErrorTimeout) return text;
  // every rank the waits gave up on: more than the first one, or a node (a one-rank node included)
  std::vector<int> absent;
  for (int r = 0; r < 32 * kAbsentWords; ++r)
    if ((block.absent[r / 32] >> (r % 32)) & 1u) absent.push_back(r);
  if (absent.size() > 1 || (topology.nodes > 1 && !absent.empty()))
    text += concat("; absent from this rank's waits: ", describe_absent(absent, topology));
  return text;
}

std::string describe_absent(std::vector<int> const& missing, Topology const& topology) {
  std::string ranks;
  for (int r : missing) ranks += concat(ranks.empty() ? "" : ", ", r);
  std::string text = concat("rank(s) ", ranks);
  if (topology.nodes <= 1 || missing.empty()) return text;
  // whole nodes first: every rank of node n missing
  std::vector<int> absent(static_cast<std::size_t>(topology.nodes), 0);
  for (int r : missing)
    if (r >= 0 && r < topology.world()) ++absent[static_cast<std::size_t>(topology.node_of(r))];
  std::string whole, parts;
  for (int n = 0; n < topology.nodes; ++n) {
    int const count = absent[static_cast<std::size_t>(n)];
    if (count == 0) continue;
    if (count == topology.local)
      whole += concat(whole.empty() ? "" : ", ", n);
    else
      parts += concat(parts.empty() ? "" : "; ", count, " of node ", n);
  }
  if (!whole.empty())
    text += concat(" (every rank of node ", whole, " of ", topology_name(topology),
                   ": that node is absent as a whole: down, or its network unreachable from here",
                   parts.empty() ? "" : concat("; and ", parts), ")");
  else
    text += concat(" (", parts, ", topology ", topology_name(topology), ")");
  return text;
}

std::string describe_drops(DeviceErrorBlock const& block, int self) {
  std::string message;
  if (block.input_errors != 0)
    message += concat(block.input_errors, " id(s) outside the allowed range, or repeated within a token (or within ",
                      "an x_repeat group of entries), were refused (first bad value ", block.first_bad_value,
                      "); check topk_idx against [-1, num_experts), each token's experts distinct");
  if (block.overflow_rows != 0)
    message += concat(message.empty() ? "" : "; ", block.overflow_rows, " row(s) were not delivered because rank ",
                      block.overflow_rank != 0 ? static_cast<int>(block.overflow_rank) - 1 : self,
                      "'s capacity was exceeded (max_recv_tokens, or expert_capacity for expert-major rows); every ",
                      "rank of the dispatch reports it, and no combine over its layout returns numbers: raise the "
                      "capacity or send fewer tokens per call");
  return message;
}

std::string describe_refusal(int refusing_rank, WaitPhase phase, std::string const& reason) {
  // NOTE: a low-latency combine is also refused on the device, with no reason posted, by a rank whose dispatch dropped
  // entries past expert_capacity (its receive half alone saw it); that rank reports the drop itself
  std::string const unposted = phase == WaitPhase::ll_combine ? concat("(no reason posted: rank ", refusing_rank,
                                                                       "'s dispatch may have dropped entries past ",
                                                                       "expert_capacity, which that rank reports)")
                                                              : std::string("(no reason posted)");
  return concat(
      "rank ", refusing_rank, " refused this call on input",
      phase == WaitPhase::none ? std::string() : concat(" (seen in the '", wait_phase_name(phase), "' exchange)"),
      ", so every rank refuses it and returns nothing of it: ", reason.empty() ? unposted : reason,
      "; fix that rank's input. This rank's buffer and communicator stay usable");
}

void fail_interrupted(Communicator& comm, WaitPhase phase) {
  DeviceErrorBlock& block = *comm.device_view().error;
  std::atomic_ref<uint32_t> status(block.status);
  uint32_t idle = 0;
  if (status.compare_exchange_strong(idle, 1U, std::memory_order_acq_rel)) {  // the first failure wins
    block.rank = comm.rank();
    block.peer = -1;
    block.phase = static_cast<int32_t>(phase);
    status.store(kErrorInterrupted, std::memory_order_release);
  }
  comm.check_errors(nullptr);  // raises it (or the failure recorded first) and marks the communicator failed
  FERRY_THROW(Interrupted, "interrupted", "rank ", comm.rank(), "'s wait in phase '", wait_phase_name(phase),
              "' was interrupted; create a new communicator");
}

}  // namespace detail
}  // namespace ferry
