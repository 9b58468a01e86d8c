// The cuda backend of EpBuffer, every mode: owns the symmetric region and the local buffers (buffers.cu), chooses the
// protocol at construction (normal mode's count exchange or landing zone, low-latency mode's one kernel per leg),
// sequences its kernels (normal/dispatch.cu, normal/expand.cu, normal/combine.cu; ll/dispatch.cu, ll/combine.cu, or
// their halves with return_recv_hook), records what each call ran (run_record.hpp: a POD, explain()'s text is built
// when asked) and, in eager mode, synchronises and raises device-side errors. No host synchronisation, memset or string
// per lazy call.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "comm/cuda/cuda_communicator.hpp"
#include "core/cuda_check.hpp"
#include "ep/capacity.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/device_memory.hpp"
#include "ep/cuda/ll/params.cuh"
#include "ep/ep_impl.hpp"
#include "ep/landing_policy.hpp"
#include "ep/ll_mask_words.hpp"
#include "ep/run_record.hpp"
#include "ep/tuning_key.hpp"
#include "ferry/env.hpp"
#include "ferry/error.hpp"

namespace ferry::cuda_ep {

GridChoice ll_grid(int asked, std::string source, int agreed) {
  GridChoice grid{agreed, detail::kNoFallback, std::move(source)};
  if (detail::fallback_forced_for_test()) {
    grid.ctas = std::max(1, agreed / 2);
    grid.why += detail::concat("; a test forced the fallback (force_fallback_for_test): half of ", agreed, " CTAs");
  }
  if (grid.ctas != asked)
    grid.why += detail::concat("; ran ", grid.ctas, " CTAs (at most one per SM, the same on every rank)");
  if (grid.ctas < asked) grid.fallbacks |= detail::kFallbackGridClamped;
  return grid;
}

namespace {

// NOTE: across nodes both protocols (hierarchical normal mode, low-latency mode) reach the ranks of other nodes over
// GIN when the communicator set GIN up, else through the emulated network, which needs their windows mapped
// (emulated nodes on one host, FERRY_TOPOLOGY); the ranks of the own node by load/store.
void check_reachable_across_nodes(Communicator const& comm, Topology const& topology, bool gin) {
  for (int peer = 0; peer < comm.world(); ++peer) {
    if (comm.load_store_reachable(peer)) continue;
    // the communicator keeps a node inside its NVLink team (check_node_in_team), and sets GIN up for the others
    FERRY_CHECK_CONFIG(!topology.same_node(peer, comm.rank()), "rank ", comm.rank(), " cannot reach rank ", peer,
                       " of its own node by load/store (topology ", topology_name(topology), ")");
    FERRY_CHECK_CONFIG(gin, "rank ", comm.rank(), " reaches rank ", peer,
                       " neither by load/store nor over GIN: create the communicator with FERRY_NETWORK=auto or gin");
  }
}

// A normal-mode plan for one token count, with the env pins it was made under (the plan functions read them at every
// call, so `ferry tune` can change them between calls: a changed pin makes a new plan).
struct PlanMemo {
  bool valid = false;
  tuning::EnvPin env;
  LaunchPlan plan;
};

bool same_pin(tuning::EnvPin const& a, tuning::EnvPin const& b) {
  return a.blocks == b.blocks;
}

// A handle's device storage (HandleLayout): its own allocation, freed with it, or the caller's.
struct CudaHandleStorage final : detail::HandleStorage {
  int device = 0;
  char* ptr = nullptr;
  bool owned = false;
  ~CudaHandleStorage() override {
    if (!owned || ptr == nullptr) return;
    // NOTE: never throws; the handle may go on another thread or device than the one that made it, so the free runs
    // on the allocation's device and the caller's current device is put back
    int current = -1;
    bool const have_current = cudaGetDevice(&current) == cudaSuccess;
    if (cudaSetDevice(device) == cudaSuccess) cudaFree(ptr);
    if (have_current) cudaSetDevice(current);
  }
};

class CudaEp final : public detail::EpBackendImpl {
 public:
  CudaEp(Communicator& comm, EpConfig const& user_config) : comm_(comm), masking_(user_config.rank_masking) {
    EpConfig const config = detail::cuda_route_for_masking(user_config, comm.topology());
    Buffers& b = buffers_;
    int const world = comm.world();
    bool const ll = config.mode == Mode::low_latency;
    // 1. the protocol (the same on every rank: the config, the topology and FERRY_NORMAL_LANDING must agree)
    Topology const topology = comm.topology();
    detail::check_cuda_world(config, topology);  // the one place a world too large for the kernels is refused
    bool const across = topology.nodes > 1;
    bool const hierarchical = !ll && across;
    transport::Kind const network = detail::network_transport(comm);
    FERRY_CHECK_CONFIG(!hierarchical || topology.world() + topology.nodes <= kMaxHierColumns, "topology ",
                       topology_name(topology), " has more ranks and nodes than the hierarchical layout's ",
                       kMaxHierColumns, " columns");
    if (across) check_reachable_across_nodes(comm, topology, network == transport::Kind::gin);
    if (ll && across) {
      // a quantized combine row crosses the network whole, from the CTA that holds all of its 1024-element chunks
      FERRY_CHECK_CONFIG(config.combine_format == WireFormat::bf16 || config.hidden <= kWarps * cuda_ll::kChunkVecs * 8,
                         "combine_format=", wire_format_name(config.combine_format), " with hidden=", config.hidden,
                         " across nodes: mode=ll supports hidden <= ", kWarps * cuda_ll::kChunkVecs * 8,
                         " for a quantized combine there; use combine_format=bf16");
    }
    detail::ProtocolChoice const protocol = detail::choose_protocol(
        config, world, ll ? std::string() : env_string("FERRY_NORMAL_LANDING"), ll ? 1 : topology.nodes);
    // the emulated network's settings (FERRY_EMULATED_*), read once: explain() prints what the kernels run with
    transport::EmulatedOptions const emulated =
        across ? transport::emulated_options_from_env() : transport::EmulatedOptions{};
    protocol_why_ = protocol.why;
    if (across) {
      protocol_why_ = detail::concat(
          ll ? (config.route() == InternodeRoute::forward ? "low-latency, rows forwarded once per node by its rail ("
                : user_config.route() == InternodeRoute::forward
                    ? "low-latency, rows direct to every rank (rank masking runs the direct route; "
                    : "low-latency, rows direct to every rank (")
             : "hierarchical (",
          topology_name(topology), ", network: ", transport::kind_name(network));
      if (network == transport::Kind::emulated)
        protocol_why_ += detail::concat(" (FERRY_EMULATED_SEED=", emulated.seed, ", delays < ", emulated.max_delay_ns,
                                        " ns, ", emulated.reorder ? "reordered" : "in order", ")");
      protocol_why_ += ")";
    }
    protocol_fallbacks_ = protocol.fallback ? detail::kFallbackCountExchange : detail::kNoFallback;
    if (ll) {
      FERRY_CHECK_CONFIG(config.expert_slots() > 0,
                         "mode=ll needs a resolved config (EpConfig::resolved) with expert slots");
      // env_string applies the env table's rule (landing or direct) and refuses anything else
      b.own_direct = env_string("FERRY_LL_OWN_ROWS") == "direct";  // a rank's own rows only: the ranks need not agree
    } else {
      // NOTE: the dispatch layout keeps one counter per global expert in shared memory.
      FERRY_CHECK_CONFIG(dispatch_smem_bytes(world, config.num_experts) <= kMaxDispatchSmem,
                         "num_experts=", config.num_experts, " needs ", dispatch_smem_bytes(world, config.num_experts),
                         " bytes of shared memory for the dispatch layout, more than ", kMaxDispatchSmem,
                         "; use at most ", kMaxDispatchSmem / 4 - world, " experts");
    }
    // NOTE: the kernels that build the expert-major layout keep two counters per local expert in shared memory.
    FERRY_CHECK_CONFIG(config.expert_slots() == 0 || config.num_local_experts(world) <= kMaxLayoutLocalExperts,
                       "num_experts=", config.num_experts, " gives ", config.num_local_experts(world),
                       " local experts per rank at world=", world,
                       "; the expert-major layout (mode=ll, or expert_capacity in mode=normal) supports at most ",
                       kMaxLayoutLocalExperts, " (use more ranks, or mode=normal without expert_capacity)");
    FERRY_CHECK_CUDA(cudaSetDevice(comm.device()));
    int num_sms = 0;
    FERRY_CHECK_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, comm.device()));
    configure_buffers(b, config, world, comm.rank(), protocol.protocol, num_sms);
    b.topology = topology;
    b.refuse_combine_after_drop = true;  // a drop is an error on every rank (docs/errors.md, "Capacities")
    cudaDeviceProp prop{};
    FERRY_CHECK_CUDA(cudaGetDeviceProperties(&prop, comm.device()));
    tuning::TuningKey const key = detail::tuning_key(prop.name, world, config);
    auto const tables = tuning::active_tables();
    b.dispatch_tuning = tuning::resolve_leg(tuning::Leg::dispatch, key, config.dispatch_geometry, *tables);
    b.combine_tuning = tuning::resolve_leg(tuning::Leg::combine, key, config.combine_geometry, *tables);
    if (ll) {
      // 2. the low-latency grid, fixed for the EpBuffer (receivers count arrivals as seq * num_ctas) and shared by
      //    both legs: the EpConfig pin, FERRY_DISPATCH_BLOCKS, the tuning table's dispatch row for the bucket of
      //    max_tokens_per_rank (a mode ll entry has no combine rows), or one CTA per SM; at most one per SM
      //    (co-resident for the cooperative launch). Every rank must use the same count: agree on the smallest.
      int const limit = std::min(num_sms, cuda_ll::kMaxCtas);
      tuning::Choice const choice = tuning::choose(b.dispatch_tuning, tuning::read_env_pin(tuning::Leg::dispatch),
                                                   config.max_tokens_per_rank, Geometry{limit}, "one CTA per SM");
      int32_t const mine = std::clamp(choice.geometry.blocks, 1, limit);
      std::vector<int32_t> all(static_cast<std::size_t>(world));
      comm.bootstrap().allgather(&mine, all.data(), sizeof(mine));
      GridChoice const grid = ll_grid(choice.geometry.blocks, choice.source, *std::min_element(all.begin(), all.end()));
      b.num_ctas = grid.ctas;
      grid_why_ = grid.why;
      grid_fallbacks_ = grid.fallbacks;
    } else {
      plans_[0].resize(static_cast<std::size_t>(config.max_tokens_per_rank) + 1);
      plans_[1].resize(static_cast<std::size_t>(config.max_tokens_per_rank) + 1);
    }
    context_.config = &b.config;
    context_.protocol_why = protocol_why_.c_str();
    context_.warps = kWarps;
    context_.ll_chunk_elems = cuda_ll::kChunkVecs * 8;
    context_.own_direct = b.own_direct;

    // 3. symmetric region (zeroed by the communicator: counters and sequence numbers start at 0) and local buffers
    b.view = comm.device_view();
    b.layout = hierarchical ? make_hier_sym_layout(config, topology)
                            : make_sym_layout(config, world, b.protocol, ll ? topology.nodes : 1);
    region_ = comm.alloc_symmetric(b.layout.total);
    b.sym = region_.view;
    if (!ll) handle_layout_ = make_handle_layout(config, world, b.layout);
    try {
      b.network_kind = network;
      if (across && network == transport::Kind::gin) {
        // the network between the nodes: GIN over this region's window, the layout's counters as GIN signals
        b.gin = ll ? detail::gin_transport(comm, region_, b.layout.ll.signals, b.layout.ll.num_signals)
                   : detail::gin_transport(comm, region_, b.layout.hier.signals, b.layout.hier.num_signals);
        if (ll && config.rank_masking) {
          // rank masking's agreement counts its words from other nodes in signals of its own (LlMaskArea)
          LlMaskArea const area = ll_mask_area(b.layout.total, world);
          b.mask_gin = detail::gin_transport(comm, region_, area.signals, area.num_signals);
        }
      } else if (across) {
        // the network between the nodes: emulated over the peers' windows (check_reachable_across_nodes: every peer is
        // load/store reachable), with the seeded delays and reordering of FERRY_EMULATED_*
        for (int r = 0; r < world; ++r) b.network.windows[r] = b.sym.peer(r);
        b.network.rank = comm.rank();
        b.network.world = world;
        b.network.seed = emulated.seed ^ static_cast<uint64_t>(comm.rank());
        b.network.max_delay_ns = emulated.max_delay_ns;
        b.network.reorder = emulated.reorder ? 1u : 0u;
      }
      allocate_buffers(b);
      b.trace = &trace_;
      if (int const events = trace::env_events_per_warp(); events > 0) trace_.enable(b.rank, trace_warps(), events);
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
    return run_dispatch(args, stream, false);
  }

  // combine_backward's cached dispatch: the expand fills the slots' layout but not their rows, which the weight step
  // writes scaled from recv_x (normal/weight_grad.cuh): one pass over the slots instead of a copy and a pass in place.
  DispatchResult dispatch_gradients(DispatchArgs const& args, cudaStream_t stream) override {
    return run_dispatch(args, stream, args.expand);
  }

  DispatchResult run_dispatch(DispatchArgs const& args, cudaStream_t stream, bool skip_slot_rows) {
    Buffers const& b = buffers_;
    detail::LegRecord& leg = start(record_.dispatch);
    leg.ids = args.topk_idx_type;
    leg.expand = args.expand;
    last_num_tokens_ = args.num_tokens;
    if (b.protocol == Protocol::ll) {
      check_not_masked(stream);
      leg.split = args.return_recv_hook;
      leg.prequantized = args.x_scales != nullptr;
      launch_ll_dispatch(b, args, leg.split ? Half::send : Half::both, stream, false, &leg);
      finish_ll(leg);
      pending_dispatch_ = args;
      if (leg.split) {
        DispatchResult result = dispatch_result(b, true);
        if (masking_) result.masked_entries = -1;  // on the device (finish_dispatch)
        return result;
      }
      return finish_dispatch(true, args.eager, args.expert_counts_host, stream);
    }
    leg.prequantized = args.num_tokens > 0 && args.x_scales != nullptr;
    LaunchPlan const& plan = plan_of(0, args.num_tokens);
    launch_dispatch(b, args, plan, stream, false, &leg);
    bool const cached = args.handle != nullptr;  // cached_args' ids (EpBuffer keeps the handle in the args)
    if (args.expand) {
      launch_expand(b, /*copy_rows=*/true, stream, skip_slot_rows);
    } else if (cached && b.expert_slots > 0) {
      // NOTE: a cached dispatch makes its handle's layout the current one (EpBuffer::make_current), and an
      // expert-major combine of that handle reads recv_slot, which only expand writes: without expand, an older
      // dispatch's slots would stay there. The slots alone (no row copies) are the handle's again.
      launch_expand(b, /*copy_rows=*/false, stream);
    }
    finish_normal(leg, plan);
    return finish_dispatch(args.expand, args.eager, args.expert_counts_host, stream);
  }

  DispatchResult complete_dispatch(cudaStream_t stream) override {
    FERRY_CHECK(buffers_.protocol == Protocol::ll, "complete_dispatch on a normal-mode backend");
    launch_ll_dispatch(buffers_, pending_dispatch_, Half::recv, stream);
    return finish_dispatch(true, pending_dispatch_.eager, pending_dispatch_.expert_counts_host, stream);
  }

  // A refused call joins the exchange with no tokens (no rows) and this rank's abort flag (low-latency mode: both
  // halves in one kernel, so no hook is left pending): the peers' same call moves nothing and records the refusal,
  // and the sequence numbers and parities stay in step on every rank.
  void refuse_dispatch(cudaStream_t stream) override {
    Buffers const& b = buffers_;
    check_not_masked(stream);
    if (b.protocol == Protocol::ll)
      launch_ll_dispatch(b, DispatchArgs{}, Half::both, stream, /*refuse=*/true);
    else
      launch_dispatch(b, DispatchArgs{}, plan_of(0, 0), stream, /*refuse=*/true);
    last_num_tokens_ = 0;  // the kernel left no tokens for a combine (EpBuffer refuses one until a dispatch succeeds)
    start(record_.dispatch).refused = true;
  }

  void refuse_combine(cudaStream_t stream) override {
    Buffers const& b = buffers_;
    CombineArgs none;
    none.layout = CombineLayout::rank_major;  // reads no x
    check_not_masked(stream);
    if (b.protocol == Protocol::ll)
      launch_ll_combine(b, none, last_num_tokens_, Half::both, stream, /*refuse=*/true);
    else
      launch_combine(b, none, plan_of(1, last_num_tokens_), last_num_tokens_, stream, /*refuse=*/true);
    start(record_.combine).refused = true;
  }

  void copy(CopyPlan const& plan, cudaStream_t stream) override { launch_received_copy(buffers_, plan, stream); }

  void combine(CombineArgs const& args, cudaStream_t stream) override {
    Buffers const& b = buffers_;
    // NOTE: EpBuffer validated the call (validate_combine_args, refused on every rank): it follows a dispatch that
    // succeeded, and an expert-major one follows an expanded dispatch (or a low-latency one), so recv_slot holds that
    // dispatch's slots; its hook rules keep a combine from starting while a dispatch's receive half is pending.
    detail::LegRecord& leg = start(record_.combine);
    leg.expert_major = args.layout == CombineLayout::expert_major;
    if (b.protocol == Protocol::ll) {
      check_not_masked(stream);
      leg.split = args.return_recv_hook;
      launch_ll_combine(b, args, last_num_tokens_, leg.split ? Half::send : Half::both, stream, false, &leg);
      finish_ll(leg);
      pending_combine_ = args;
      if (!leg.split && args.eager) sync_and_check(stream);
      return;
    }
    LaunchPlan const& plan = plan_of(1, last_num_tokens_);
    launch_combine(b, args, plan, last_num_tokens_, stream, false, &leg);
    finish_normal(leg, plan);
    if (args.eager) sync_and_check(stream);
  }

  void complete_combine(cudaStream_t stream) override {
    FERRY_CHECK(buffers_.protocol == Protocol::ll, "complete_combine on a normal-mode backend");
    launch_ll_combine(buffers_, pending_combine_, last_num_tokens_, Half::recv, stream);
    if (pending_combine_.eager) sync_and_check(stream);
  }

  void enable_trace(EpConfig const&, int max_events_per_warp) override {
    FERRY_CHECK_CUDA(cudaSetDevice(comm_.device()));
    trace_.enable(buffers_.rank, trace_warps(), max_events_per_warp);
  }

  // NOTE: with the receive hook a leg is two launches of the same family; the trace holds the last (receive) half.
  TraceBuffer read_trace(EpConfig const&, TraceKernel kernel, cudaStream_t stream) override {
    return trace_.read(kernel, stream);
  }

  std::string explain() const override { return detail::explain_text(record_, context_); }

  // Handles and the backward passes (normal mode: EpBuffer refuses them in low-latency mode before any runs).
  std::size_t handle_bytes() const override { return handle_layout_.total; }

  std::unique_ptr<detail::HandleStorage> make_handle_storage(void* external) const override {
    auto storage = std::make_unique<CudaHandleStorage>();
    storage->device = comm_.device();
    if (external != nullptr) {
      storage->ptr = static_cast<char*>(external);
      return storage;
    }
    FERRY_CHECK_CUDA(cudaSetDevice(comm_.device()));
    storage->ptr = detail::device_alloc<char>(handle_layout_.total);
    storage->owned = true;
    return storage;
  }

  void save_handle(detail::HandleState& handle, DispatchArgs const& args, cudaStream_t stream) override {
    // NOTE: the handle keeps the hierarchical layout too (normal/handle.cu), and InternodeVirtual.HandlesAcrossNodes (a
    // handle restored after a second dispatch, its combine and dispatch_backward, on virtual ranks) passed on the H200;
    // the cached dispatch across nodes and this path through EpBuffer have not run on a GPU, so handles stay refused
    // across nodes until they have.
    FERRY_CHECK_CONFIG(buffers_.protocol != Protocol::hierarchical,
                       "dispatch handles (combine by handle, the cached dispatch, the backward passes) are not "
                       "available for normal mode over several nodes on the cuda backend in this version; combine "
                       "right after each dispatch, or use the cpu backend");
    launch_save_handle(buffers_, storage_of(handle), args, args.expand, stream);
  }

  DispatchArgs cached_args(detail::HandleState const& handle, DispatchArgs args) const override {
    char* const base = storage_of(handle);
    args.topk_idx = base + handle_layout_.topk_idx;
    args.topk_idx_type = IndexType::int32;
    args.topk_weights = reinterpret_cast<float const*>(base + handle_layout_.topk_weights);
    return args;
  }

  void copy_rank_counts(detail::HandleState const& handle, int32_t* out, cudaStream_t stream) const override {
    FERRY_CHECK_CONFIG(buffers_.protocol != Protocol::landing,
                       "copy_rank_counts: this EpBuffer dispatches through the landing zone (", protocol_why_,
                       "), which exchanges no count matrix: each rank learns only the rows sent to it; create the "
                       "EpBuffer with FERRY_NORMAL_LANDING=off to keep the matrix");
    std::size_t const bytes = static_cast<std::size_t>(buffers_.world) * buffers_.world * sizeof(int32_t);
    FERRY_CHECK_CUDA(
        cudaMemcpyAsync(out, storage_of(handle) + handle_layout_.rank_counts, bytes, cudaMemcpyDeviceToDevice, stream));
  }

  void restore_handle(detail::HandleState const& handle, cudaStream_t stream) override {
    launch_restore_handle(buffers_, storage_of(handle), handle.num_tokens, handle.expanded, stream);
    last_num_tokens_ = handle.num_tokens;  // the rows a combine now returns
  }

  void combine_unweighted(CombineArgs const& args, bool y_fp32, cudaStream_t stream) override {
    Buffers const& b = buffers_;
    FERRY_CHECK(b.protocol != Protocol::ll, "combine_unweighted on a low-latency backend");
    detail::LegRecord& leg = start(record_.combine);
    leg.expert_major = args.layout == CombineLayout::expert_major;
    LaunchPlan const& plan = plan_of(1, last_num_tokens_);
    launch_combine(b, args, plan, last_num_tokens_, stream, false, &leg, CombineVariant{true, y_fp32});
    finish_normal(leg, plan);
    if (args.eager) sync_and_check(stream);
  }

  void combine_backward_weights(detail::HandleState const& handle, void const* x, float* grad_w, bool eager,
                                cudaStream_t stream) override {
    FERRY_CHECK_CONFIG(buffers_.protocol != Protocol::hierarchical,
                       "combine_backward is not built for normal mode over several nodes yet");
    launch_weight_grad(buffers_, x, grad_w, handle.num_tokens, /*refuse=*/false, stream);
    if (eager) sync_and_check(stream);
  }

  void refuse_combine_backward_weights(cudaStream_t stream) override {
    launch_weight_grad(buffers_, nullptr, nullptr, 0, /*refuse=*/true, stream);
  }

  detail::RunRecord const* run_record() const override { return &record_; }

  // EpConfig::wait_stats: the device array as is (Slot mirrors PeerWaitStats), after the stream's kernels.
  WaitStats wait_stats(cudaStream_t stream) const override {
    static_assert(sizeof(wait_stats::Slot) == sizeof(PeerWaitStats), "the device slots are copied as is");
    Buffers const& b = buffers_;
    std::vector<PeerWaitStats> all(static_cast<std::size_t>(wait_stats::kLegs) * b.world);
    FERRY_CHECK_CUDA(cudaSetDevice(comm_.device()));
    FERRY_CHECK_CUDA(cudaStreamSynchronize(stream));
    FERRY_CHECK_CUDA(cudaMemcpy(all.data(), b.wait_stats, all.size() * sizeof(PeerWaitStats), cudaMemcpyDeviceToHost));
    auto const world = static_cast<std::ptrdiff_t>(b.world);
    return WaitStats{{all.begin(), all.begin() + world}, {all.begin() + world, all.end()}};
  }

  void reset_wait_stats(cudaStream_t stream) override {
    FERRY_CHECK_CUDA(cudaSetDevice(comm_.device()));
    FERRY_CHECK_CUDA(
        cudaMemsetAsync(buffers_.wait_stats, 0, sizeof(wait_stats::Slot) * wait_stats::kLegs * buffers_.world, stream));
  }

  // The hierarchical protocol counts what its legs send on the device (hier_link_bytes); one node counts nothing.
  CallLinkBytes link_bytes(cudaStream_t stream) const override {
    if (buffers_.protocol != Protocol::hierarchical) return {};
    return CallLinkBytes{hier_link_bytes(buffers_, LinkLeg::dispatch, stream),
                         hier_link_bytes(buffers_, LinkLeg::combine, stream)};
  }

  // Rank masking (low-latency mode; ll/mask.cuh): the words the agreements and the kernels keep, after the
  // last call's stream (synchronised).
  MaskStatus mask_status() const override {
    if (mask_stream_ == nullptr) return detail::mask_status_of(detail::LlMaskWords{}, buffers_.world);
    FERRY_CHECK_CUDA(cudaSetDevice(comm_.device()));
    detail::LlMaskWords const words = read_ll_mask(buffers_, mask_stream_);
    note_self_masked(words);
    return detail::mask_status_of(words, buffers_.world);
  }

  void mask_ranks(std::vector<int> const& ranks) override {
    request_ll_mask(buffers_, ranks);  // EpBuffer checked the range
  }

  // Collective over the whole world through the bootstrap (the masked ranks' calls are out of step with the others'):
  // every rank's counters, the largest of each; across nodes the network's counters put in step through it (every
  // rank's reading of them, then what each source adds); the reset of this rank's (and of its region's arrival
  // counters of its node), then a barrier, so that no rank's next call reaches a peer that has not reset yet.
  void clear_mask() override {
    FERRY_CHECK_CUDA(cudaSetDevice(comm_.device()));
    cudaStream_t const stream = mask_stream_ != nullptr ? mask_stream_ : cudaStreamPerThread;
    FERRY_CHECK_CUDA(cudaStreamSynchronize(stream));
    int const world = buffers_.world;
    detail::LlCallCounters const mine = ll_call_counters(buffers_, stream);
    std::vector<detail::LlCallCounters> all(static_cast<std::size_t>(world));
    comm_.bootstrap().allgather(&mine, all.data(), sizeof(mine));
    detail::LlCallCounters const to = detail::merge_call_counters(all);
    if (buffers_.layout.nodes > 1) {
      std::vector<uint64_t> const reads = read_network_counters(buffers_, stream);
      std::vector<uint64_t> gathered(reads.size() * static_cast<std::size_t>(world));
      comm_.bootstrap().allgather(reads.data(), gathered.data(), reads.size() * sizeof(uint64_t));
      std::vector<std::vector<uint64_t>> counters;
      for (int r = 0; r < world; ++r)
        counters.emplace_back(gathered.begin() + static_cast<std::ptrdiff_t>(r * reads.size()),
                              gathered.begin() + static_cast<std::ptrdiff_t>((r + 1) * reads.size()));
      realign_network_counters(buffers_, to, counters, stream);
    }
    reset_ll_mask(buffers_, to, stream);
    FERRY_CHECK_CUDA(cudaStreamSynchronize(stream));
    // across nodes a rank that did not add its part: the realignment's bounded wait, a TimeoutError naming it
    if (buffers_.layout.nodes > 1) comm_.check_errors(nullptr);
    comm_.bootstrap().barrier();
    self_masked_.clear();
    last_num_tokens_ = 0;  // the dispatch before the clear is forgotten
  }

 private:
  // A fresh record of a leg that ran on this backend's protocol.
  detail::LegRecord& start(detail::LegRecord& leg) const {
    leg = detail::LegRecord{};
    leg.ran = true;
    leg.protocol = buffers_.protocol;
    return leg;
  }
  void finish_ll(detail::LegRecord& leg) const {
    leg.ctas = buffers_.num_ctas;
    leg.plan_why = grid_why_.c_str();
    leg.fallbacks |= grid_fallbacks_;
  }
  void finish_normal(detail::LegRecord& leg, LaunchPlan const& plan) const {
    leg.ctas = plan.ctas;
    leg.push_ctas = plan.push_ctas;
    leg.plan_why = plan.why.c_str();
    leg.fallbacks |= plan.fallbacks;
    if (&leg == &record_.dispatch) leg.fallbacks |= protocol_fallbacks_;
  }

  // The plan of a normal-mode leg (0 dispatch, 1 combine) for num_tokens tokens: made once per token count and env
  // pins, so a call allocates nothing and its record points at text that outlives it.
  LaunchPlan const& plan_of(int leg, int num_tokens) {
    PlanMemo& memo = plans_[leg][static_cast<std::size_t>(num_tokens)];
    tuning::EnvPin const env = tuning::read_env_pin(leg == 0 ? tuning::Leg::dispatch : tuning::Leg::combine);
    if (!memo.valid || !same_pin(memo.env, env)) {
      memo.plan = leg == 0 ? plan_dispatch(buffers_, num_tokens) : plan_combine(buffers_, num_tokens);
      memo.env = env;
      memo.valid = true;
    }
    return memo.plan;
  }

  // counts_host: DispatchArgs::expert_counts_host (eager only)
  DispatchResult finish_dispatch(bool expand, bool eager, int32_t* counts_host, cudaStream_t stream) {
    DispatchResult result = dispatch_result(buffers_, expand);
    // rank masking: the entries left out are known on the host after a sync (eager), else in mask_status()
    if (masking_) result.masked_entries = -1;
    // a drop is recorded on every rank's device (an eager call raises it below); a lazy one is known there only
    EpConfig const& config = buffers_.config;
    if (detail::row_drops_possible(config, buffers_.world) ||
        (expand && detail::slot_drops_possible(config, buffers_.world)))
      result.dropped_rows = -1;
    if (eager) {
      int32_t* const words = buffers_.host_words;
      std::size_t const counts_bytes = static_cast<std::size_t>(buffers_.num_local_experts) * sizeof(int32_t);
      FERRY_CHECK_CUDA(
          cudaMemcpyAsync(words, &buffers_.state->num_recv, sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
      if (counts_host != nullptr)
        FERRY_CHECK_CUDA(
            cudaMemcpyAsync(words + 1, buffers_.expert_counts, counts_bytes, cudaMemcpyDeviceToHost, stream));
      sync_and_check(stream);
      result.dropped_rows = 0;
      result.num_recv_host = words[0];
      if (counts_host != nullptr) std::memcpy(counts_host, words + 1, counts_bytes);
      if (masking_) result.masked_entries = static_cast<int64_t>(read_ll_mask(buffers_, stream).last_dispatch_entries);
    }
    return result;
  }

  // Rank masking: a rank that learned that it is masked (its agreement wrote the host's word, no sync needed to see
  // it) refuses every later call at once with the Error that names the call it was masked at. Remembers the stream
  // of the call (mask_status and clear_mask synchronise it).
  void check_not_masked(cudaStream_t stream) {
    if (!masking_) return;
    if (self_masked_.empty() && *reinterpret_cast<uint32_t const volatile*>(&buffers_.mask_host->self) != 0)
      note_self_masked(read_ll_mask(buffers_, mask_stream_ != nullptr ? mask_stream_ : stream));
    if (!self_masked_.empty()) throw Error(self_masked_);
    mask_stream_ = stream;
  }
  void note_self_masked(detail::LlMaskWords const& words) const {
    if (words.self != 0 && self_masked_.empty())
      self_masked_ = detail::self_masked_message(words, buffers_.rank, buffers_.view.timeout_ns / 1e9);
  }

  // Warps a trace buffer is sized for: the largest grid any kernel of this protocol launches.
  int trace_warps() const {
    return (buffers_.protocol == Protocol::ll ? buffers_.num_ctas : buffers_.num_sms) * kWarps;
  }

  void sync_and_check(cudaStream_t stream) {
    detail::synchronize_stream(stream);  // a late peer: interruptible (include/ferry/interrupt.hpp)
    comm_.check_errors(stream);
    if (masking_ && *reinterpret_cast<uint32_t const volatile*>(&buffers_.mask_host->self) != 0) {
      // eager: the call that met the mask throws at once (its kernels moved nothing)
      note_self_masked(read_ll_mask(buffers_, stream));
      throw Error(self_masked_);
    }
  }

  // The device storage of a handle this backend's kind made (EpBuffer checked that it fits this buffer).
  static char* storage_of(detail::HandleState const& handle) {
    auto const* storage = dynamic_cast<CudaHandleStorage const*>(handle.storage.get());
    FERRY_CHECK(storage != nullptr && storage->ptr != nullptr, "a dispatch handle without cuda storage");
    return storage->ptr;
  }

  void release() noexcept {
    detail::release_backend_memory(comm_, region_, "EpBuffer", [&] { free_buffers(buffers_); });
  }

  Communicator& comm_;
  trace::DeviceRecorder trace_;  // Buffers::trace points here
  SymmetricRegion region_;       // the symmetric region of buffers_.sym
  Buffers buffers_;
  HandleLayout handle_layout_;      // normal mode: the storage of this buffer's dispatch handles
  int last_num_tokens_ = 0;         // of the last dispatch: the rows combine returns
  DispatchArgs pending_dispatch_;   // low-latency: the send half's arguments, for its receive half
  CombineArgs pending_combine_;     // same for combine
  std::vector<PlanMemo> plans_[2];  // normal mode: [leg][num_tokens]
  std::string protocol_why_;        // choose_protocol's reason
  std::string grid_why_;            // low-latency: where the CTA count came from
  uint8_t protocol_fallbacks_ = detail::kNoFallback;
  uint8_t grid_fallbacks_ = detail::kNoFallback;
  detail::RunRecord record_;
  detail::ExplainContext context_;
  bool masking_ = false;                // EpConfig::rank_masking (low-latency mode)
  cudaStream_t mask_stream_ = nullptr;  // masking: the stream of the last call (mask_status, clear_mask sync it)
  mutable std::string self_masked_;     // masking: set once this rank learned that it is masked
};

}  // namespace
}  // namespace ferry::cuda_ep

namespace ferry::detail {

std::unique_ptr<EpBackendImpl> make_cuda_ep(Communicator& comm, EpConfig const& config) {
  return std::make_unique<cuda_ep::CudaEp>(comm, config);
}

}  // namespace ferry::detail
