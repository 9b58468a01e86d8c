// The backward passes of normal mode (issue 29: dispatch handles, cached dispatch, dispatch_backward,
// combine_backward) on the cuda kernels, with several ranks on ONE GPU ("virtual ranks", tests/support/
// virtual_ranks.hpp, as test_normal_virtual.cu runs the forward legs): worlds 1, 2, 4 and 8, both dispatch protocols.
// The test drives the launchers CudaEp calls, in the order EpBuffer calls them (ep_buffer.cpp), leg by leg over the
// ranks (a kernel's first launch may wait for the context's running kernels, see test_normal_virtual.cu).
//
// Each row draws fresh inputs (seed printed), poisons every output before each call (bf16 0xFFFF and fp32 NaNs), and
// compares every row bit for bit with the reference (src/ep/reference.hpp):
//  - two forward dispatches, each saving its layout into a handle (launch_save_handle), checked against ref::dispatch;
//  - backward out of order: the first handle's layout restored (it was overwritten by the second dispatch), then
//    dispatch_backward in both layouts with bf16 and fp32 output (ref::dispatch_backward), a cached dispatch of the
//    original x (equal to the original dispatch's outputs), combine_backward in both layouts
//    (ref::combine_backward_rows) with the weight gradients (ref::combine_backward_weights), then the second handle
//    restored and used;
//  - a second buffer of another hidden size using the first buffer's handle (restore, dispatch_backward, cached
//    dispatch);
//  - the backward calls captured in one CUDA graph per rank and replayed twice, each replay checked;
//  - rows with a small expert_capacity, so that entries lose their slot: their weight gradients must be 0 (and such
//    entries must exist);
//  - one comparison against a reference with a perturbed weight, which must report a difference (a check that can
//    fail).
// Needs one GPU; skips without one, and skips a world the GPU cannot hold one CTA per rank of.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ep/cuda/buffers.hpp"
#include "ep/ep_impl.hpp"
#include "ep/landing_policy.hpp"
#include "ep/reference.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "support/gpu_case.hpp"
#include "support/normal_check.hpp"
#include "support/virtual_ranks.hpp"
#include "workloads/inputs.hpp"
#include "workloads/routing.hpp"

namespace ferry::test {
namespace test_backward_virtual {  // named, not anonymous: FERRY_CI_BUILD compiles several files as one

using cuda_ep::Buffers;

// The handle storage of a one-node layout (no hierarchical areas): every buffer of this test is on one node.
cuda_ep::SymLayout const kOneNode{};
using VirtualNormalRanks = VirtualRanks<Buffers, cuda_ep::allocate_buffers, cuda_ep::free_buffers>;

struct Spec : VirtualSpec {
  std::string protocol = "auto";  // protocol=landing|counts|auto (FERRY_NORMAL_LANDING's values)
  int capacity = 0;               // capacity=: expert_capacity (0: recv_capacity, every entry gets a slot)
};

Spec parse_spec(std::vector<std::string> const& words) {
  CaseArgs const args(words);
  Spec s;
  s.read_virtual(args);
  s.protocol = args.text("protocol", s.protocol);
  s.capacity = args.integer("capacity", s.capacity);
  return s;
}

// Elements (bf16) or words (fp32) behind each output that must stay poisoned.
constexpr std::size_t kGuard = 64;

void poison(DeviceBuffer const& buffer) {
  CK(cudaMemset(buffer.ptr, 0xFF, buffer.bytes));
}

// The first index where got and want differ bit for bit (n values of T), and the guard of kGuard values behind them
// still poisoned (0xFF bytes): 0, or fail()'s code.
template <typename T>
int check_bits(char const* what, void const* got_dev, std::vector<T> const& want, int rank, int step,
               std::size_t guard = kGuard) {
  auto const got = to_host<T>(got_dev, want.size() + guard);
  if (long const d = first_diff(got.data(), want.data(), want.size()); d >= 0) return fail(what, rank, step, d);
  for (std::size_t i = want.size(); i < got.size(); ++i) {
    T poisoned;
    std::memset(&poisoned, 0xFF, sizeof(T));
    if (std::memcmp(&got[i], &poisoned, sizeof(T)) != 0)
      return fail((std::string(what) + " written past its end").c_str(), rank, step, static_cast<long>(i));
  }
  return 0;
}

// The filled slots of each local expert in expert_x (device) against `want` [num_local * slots * hidden].
int check_slots(char const* what, EpConfig const& config, int world, ref::RankDispatch const& layout,
                void const* expert_x, std::vector<uint16_t> const& want, int rank, int step) {
  auto const got = to_host<uint16_t>(expert_x, want.size());
  int const slots = config.expert_slots();
  for (int e = 0; e < config.num_local_experts(world); ++e) {
    std::size_t const at = static_cast<std::size_t>(e) * slots * config.hidden;
    std::size_t const filled = static_cast<std::size_t>(std::min(layout.expert_counts[e], slots)) * config.hidden;
    if (long const d = first_diff(got.data() + at, want.data() + at, filled); d >= 0)
      return fail(what, rank, step, static_cast<long>(at) + d);
  }
  return 0;
}

std::vector<uint16_t> to_bf16(std::vector<float> const& values) {
  std::vector<uint16_t> out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) out[i] = ref::float_to_bf16(values[i]);
  return out;
}

// One buffer of `config` over `world` virtual ranks, with what its calls need per rank, and the launchers in
// EpBuffer's order (each leg on every rank before the next leg).
class BackwardRanks {
 public:
  BackwardRanks(EpConfig const& config, int world, int num_ctas, std::string const& protocol, double timeout_s,
                std::vector<int> const& tokens)
      : config_(config),
        world_(world),
        tokens_(tokens),
        landing_(detail::choose_normal_landing(config, world,
                                               protocol == "landing"  ? "on"
                                               : protocol == "counts" ? "off"
                                                                      : "auto")),
        layout_(cuda_ep::make_sym_layout(config, world, protocol_())),
        ranks_(
            world, layout_.total,
            [&](Buffers& b, int r) {
              cuda_ep::configure_buffers(b, config, world, r, protocol_(), num_ctas);
              b.layout = layout_;
            },
            timeout_s) {}

  Buffers const& operator[](int r) const { return ranks_[r]; }
  cudaStream_t stream(int r) const { return ranks_.stream(r); }
  bool landing() const { return landing_.use; }
  EpConfig const& config() const { return config_; }

  // A dispatch (+ expand) of rows[r] on every rank: by args' ids, or (handles non-null) by the handles' saved ids
  // (a cached dispatch); save: then each rank's layout into save[r]. `layouts`: what each rank's expand drops, counted.
  // gradients: combine_backward's cached dispatch (CudaEp::dispatch_gradients): the expand leaves the slots' rows to
  // the weight step.
  void dispatch(std::vector<void const*> const& rows, std::vector<DeviceBuffer> const* id_dev,
                std::vector<DeviceBuffer> const* w_dev, std::vector<DeviceBuffer> const* handles, bool expand,
                std::vector<DeviceBuffer> const* save, std::vector<ref::RankDispatch> const& layouts,
                bool gradients = false) {
    cuda_ep::HandleLayout const hl = cuda_ep::make_handle_layout(config_, world_, kOneNode);
    std::vector<DispatchArgs> args(world_);
    for (int r = 0; r < world_; ++r) {
      DispatchArgs& a = args[r];
      a.x = rows[r];
      a.num_tokens = tokens_[r];
      a.expand = expand;
      if (handles != nullptr) {  // EpBackendImpl::cached_args
        char* const base = static_cast<char*>((*handles)[r].ptr);
        a.topk_idx = base + hl.topk_idx;
        a.topk_idx_type = IndexType::int32;
        a.topk_weights = reinterpret_cast<float const*>(base + hl.topk_weights);
      } else {
        a.topk_idx = (*id_dev)[r].ptr;
        a.topk_idx_type = IndexType::int64;
        a.topk_weights = static_cast<float const*>((*w_dev)[r].ptr);
      }
      detail::validate_dispatch_args(config_, a);
    }
    for (int r = 0; r < world_; ++r)
      cuda_ep::launch_dispatch(ranks_[r], args[r], cuda_ep::plan_dispatch(ranks_[r], tokens_[r]), stream(r));
    if (expand) {
      for (int r = 0; r < world_; ++r) cuda_ep::launch_expand(ranks_[r], /*copy_rows=*/true, stream(r), gradients);
      expect_drops(layouts);
    } else if (handles != nullptr) {
      // a cached dispatch without expand recomputes the slots of its layout (CudaEp::dispatch)
      for (int r = 0; r < world_; ++r) cuda_ep::launch_expand(ranks_[r], /*copy_rows=*/false, stream(r));
    }
    if (save != nullptr)
      for (int r = 0; r < world_; ++r)
        cuda_ep::launch_save_handle(ranks_[r], (*save)[r].ptr, args[r], expand, stream(r));
  }
  void restore(std::vector<DeviceBuffer> const& handles) {
    for (int r = 0; r < world_; ++r)
      cuda_ep::launch_restore_handle(ranks_[r], handles[r].ptr, tokens_[r], /*expanded=*/true, stream(r));
  }
  // dispatch_backward's combine (EpBackendImpl::combine_unweighted): grads[r] in `layout`, into y[r]
  void combine_unweighted(CombineLayout layout, std::vector<DeviceBuffer> const& grads,
                          std::vector<DeviceBuffer> const& y, bool fp32) {
    for (int r = 0; r < world_; ++r) {
      CombineArgs const args{layout, grads[r].ptr, y[r].ptr, true};
      detail::validate_combine_args(config_, args, true, true, tokens_[r]);
      cuda_ep::launch_combine(ranks_[r], args, cuda_ep::plan_combine(ranks_[r], tokens_[r]), tokens_[r], stream(r),
                              false, nullptr, cuda_ep::CombineVariant{true, fp32});
    }
  }
  void weight_step(std::vector<DeviceBuffer> const& x, std::vector<DeviceBuffer> const& grad_w) {
    for (int r = 0; r < world_; ++r)
      cuda_ep::launch_weight_grad(ranks_[r], x[r].ptr, static_cast<float*>(grad_w[r].ptr), tokens_[r], false,
                                  stream(r));
  }
  // The entries an expand with copies of `layouts` drops past expert_capacity: every rank records them all, and the
  // lowest rank that dropped (ref::call_drops).
  void expect_drops(std::vector<ref::RankDispatch> const& layouts) {
    ref::CallDrops const call = ref::call_drops(layouts, std::vector<bool>(layouts.size(), true));
    drops_.rows += call.rows;
    if (call.first_rank >= 0 && (drops_.first_rank < 0 || call.first_rank < drops_.first_rank))
      drops_.first_rank = call.first_rank;
  }
  // Every rank's error block: clean, with exactly the entries the expands dropped.
  std::string synchronize() {
    std::string const failure = ranks_.synchronize(drops_);
    drops_ = ref::CallDrops{};
    return failure;
  }

 private:
  cuda_ep::Protocol protocol_() const { return landing_.use ? cuda_ep::Protocol::landing : cuda_ep::Protocol::push; }

  EpConfig config_;
  int world_;
  std::vector<int> tokens_;
  detail::LandingChoice landing_;
  cuda_ep::SymLayout layout_;
  VirtualNormalRanks ranks_;
  ref::CallDrops drops_;  // what the expands since the last synchronize dropped
};

template <typename Make>
std::vector<DeviceBuffer> per_rank_buffers(int world, Make const& bytes) {
  std::vector<DeviceBuffer> out;
  for (int r = 0; r < world; ++r) out.emplace_back(bytes(r));
  return out;
}

// A case's expert_capacity at most this is meant to drop slots (the test then requires that it did).
constexpr int kDropCapacity = 16;

// One forward pass's inputs and reference, uploaded.
struct Pass {
  std::vector<ref::RankInput> inputs;
  std::vector<ref::RankDispatch> received;
  std::vector<DeviceBuffer> x, idx, w;
};

Pass make_pass(EpConfig const& config, int world, RoutingOptions const& routing, std::vector<int> const& tokens) {
  Pass p;
  p.inputs = ref::generate_inputs(config, world, routing, tokens);
  for (int r = 0; r < world; ++r) {
    p.received.push_back(ref::dispatch(config, world, r, p.inputs));
    p.x.emplace_back(p.inputs[r].x.size() * 2);
    p.idx.emplace_back(p.inputs[r].topk_idx.size() * 8);
    p.w.emplace_back(p.inputs[r].topk_weights.size() * 4);
    upload(p.x[r], p.inputs[r].x);
    upload(p.idx[r], p.inputs[r].topk_idx);
    upload(p.w[r], p.inputs[r].topk_weights);
  }
  return p;
}

std::vector<void const*> pointers(std::vector<DeviceBuffer> const& buffers) {
  std::vector<void const*> out;
  for (auto const& b : buffers) out.push_back(b.ptr);
  return out;
}

// The config a user would pass for `spec` (backend_config validates and resolves it).
EpConfig user_config(Spec const& spec) {
  EpConfig user = spec.config();
  user.expert_capacity = spec.capacity > 0 ? spec.capacity : user.recv_capacity(spec.world);
  return user;
}

void run_backward(Spec const& spec, int num_ctas) {
  int const world = spec.world;
  std::vector<int> const tokens = per_rank(spec.tokens, world);
  EpConfig const user = user_config(spec);
  EpConfig const config = backend_config(user, world);
  int const hidden = config.hidden;
  int const topk = config.topk;
  int const num_local = config.num_local_experts(world);
  std::size_t const expert_rows = static_cast<std::size_t>(num_local) * config.expert_slots();
  BackwardRanks ranks(config, world, num_ctas, spec.protocol, spec.timeout_s(), tokens);
  std::printf("world %d x %d SMs: seed %llu hidden %d topk %d experts %d slots %d protocol %s\n", world, num_ctas,
              static_cast<unsigned long long>(spec.seed), hidden, topk, config.num_experts, config.expert_slots(),
              ranks.landing() ? "landing" : "count exchange");
  std::fflush(stdout);

  // per-rank device memory: two handles, gradients in both layouts, expert outputs, grad_y, outputs with guards
  std::size_t const handle_bytes = cuda_ep::make_handle_layout(config, world, kOneNode).total;
  auto handles1 = per_rank_buffers(world, [&](int) { return handle_bytes; });
  auto handles2 = per_rank_buffers(world, [&](int) { return handle_bytes; });
  auto grad_rm = per_rank_buffers(world, [&](int) { return config.recv_capacity(world) * std::size_t(hidden) * 2; });
  auto grad_em = per_rank_buffers(world, [&](int) { return expert_rows * hidden * 2; });
  auto eout = per_rank_buffers(world, [&](int) { return expert_rows * hidden * 2; });
  auto grad_y = per_rank_buffers(world, [&](int r) { return std::size_t(tokens[r]) * hidden * 2; });
  auto y = per_rank_buffers(world, [&](int r) { return (std::size_t(tokens[r]) * hidden + kGuard) * 4; });
  auto grad_w = per_rank_buffers(world, [&](int r) { return (std::size_t(tokens[r]) * topk + kGuard) * 4; });

  // 1. two forward passes, each saving its layout
  Pass const p1 = make_pass(config, world, spec.routing_options(0), tokens);
  Pass const p2 = make_pass(config, world, spec.routing_options(1), tokens);
  for (Pass const* pass : {&p1, &p2}) {
    CK(cudaDeviceSynchronize());
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(pass->received[r].dropped_rows, 0) << "rank " << r << ": the case must fit recv_capacity";
      poison_normal_dispatch(config, world, cuda_ep::dispatch_result(ranks[r], true));
    }
    CK(cudaDeviceSynchronize());
    ranks.dispatch(pointers(pass->x), &pass->idx, &pass->w, nullptr, true, pass == &p1 ? &handles1 : &handles2,
                   pass->received);
    std::string const failure = ranks.synchronize();
    ASSERT_TRUE(failure.empty()) << "forward dispatch:\n" << failure;
    for (int r = 0; r < world; ++r)
      ASSERT_EQ(check_normal_dispatch(config, world, r, pass == &p1 ? 1 : 2, pass->received[r],
                                      cuda_ep::dispatch_result(ranks[r], true), true, true),
                0);
  }

  // the gradients of pass `pass`'s outputs (fresh in (seed, rank)), uploaded
  struct Grads {
    std::vector<std::vector<uint16_t>> rm, em, eout, y;
  };
  auto const make_grads = [&](Pass const& pass, uint64_t salt) {
    Grads g;
    for (int r = 0; r < world; ++r) {
      g.rm.push_back(generate_tokens(spec.seed + salt + 1, r, pass.received[r].num_recv, hidden));
      g.em.push_back(generate_tokens(spec.seed + salt + 2, r, static_cast<int>(expert_rows), hidden));
      g.eout.push_back(generate_tokens(spec.seed + salt + 3, r, static_cast<int>(expert_rows), hidden));
      g.y.push_back(generate_tokens(spec.seed + salt + 4, r, tokens[r], hidden));
      upload(grad_rm[r], g.rm[r]);
      upload(grad_em[r], g.em[r]);
      upload(eout[r], g.eout[r]);
      upload(grad_y[r], g.y[r]);
    }
    return g;
  };
  // layout_too: also the rank-major metadata (recv_topk_idx, recv_topk_weights, recv_src, expert_counts), which a call
  // that rewrites them (a dispatch, or a graph that restores first) must fill again; a combine reads them instead
  auto const poison_outputs = [&](BackwardRanks const& on, bool layout_too = true) {
    CK(cudaDeviceSynchronize());
    for (int r = 0; r < world; ++r) {
      poison(y[r]);
      poison(grad_w[r]);
      DispatchResult const out = cuda_ep::dispatch_result(on[r], true);
      if (layout_too)
        poison_normal_dispatch(on.config(), world, out);
      else
        CK(cudaMemset(out.recv_x, 0xEE, std::size_t(on.config().recv_capacity(world)) * on.config().hidden * 2));
      CK(cudaMemset(on[r].expert_x, 0xFF, expert_rows * on.config().hidden * 2));
    }
    CK(cudaDeviceSynchronize());
  };
  // dispatch_backward of `pass` (its layout current) in `layout`, fp32 or bf16 output, checked on every rank
  auto const dispatch_backward = [&](BackwardRanks& on, Pass const& pass, Grads const& g, CombineLayout layout,
                                     bool fp32, int step) {
    poison_outputs(on, /*layout_too=*/false);
    on.combine_unweighted(layout, layout == CombineLayout::rank_major ? grad_rm : grad_em, y, fp32);
    std::string const failure = on.synchronize();
    ASSERT_TRUE(failure.empty()) << "dispatch_backward step " << step << ":\n" << failure;
    for (int r = 0; r < world; ++r) {
      std::vector<float> const want = ref::dispatch_backward(on.config(), world, r, pass.inputs, pass.received,
                                                             layout == CombineLayout::rank_major ? g.rm : g.em, layout);
      if (fp32)
        ASSERT_EQ(check_bits("dispatch_backward grad_x fp32", y[r].ptr, want, r, step), 0);
      else
        ASSERT_EQ(check_bits("dispatch_backward grad_x bf16", y[r].ptr, to_bf16(want), r, step), 0);
    }
  };
  // combine_backward of `pass` by its handles in `layout` (expert-major: with the weight step), checked
  auto const combine_backward = [&](Pass const& pass, std::vector<DeviceBuffer> const& handles, Grads const& g,
                                    CombineLayout layout, int step) {
    bool const expert = layout == CombineLayout::expert_major;
    poison_outputs(ranks);
    ranks.dispatch(pointers(grad_y), nullptr, nullptr, &handles, expert, nullptr, pass.received, expert);
    if (expert) ranks.weight_step(eout, grad_w);
    std::string const failure = ranks.synchronize();
    ASSERT_TRUE(failure.empty()) << "combine_backward step " << step << ":\n" << failure;
    for (int r = 0; r < world; ++r) {
      std::vector<uint16_t> const rows =
          ref::combine_backward_rows(config, world, r, pass.inputs, pass.received, g.y, layout);
      DispatchResult const out = cuda_ep::dispatch_result(ranks[r], expert);
      if (!expert) {
        // (the rows past num_recv hold poison_normal_dispatch's 0xEE, not compared here)
        ASSERT_EQ(check_bits("combine_backward recv_x", out.recv_x, rows, r, step, 0), 0);
        continue;
      }
      ASSERT_EQ(check_slots("combine_backward expert_x", config, world, pass.received[r], out.expert_x, rows, r, step),
                0);
      std::vector<float> const want_w =
          ref::combine_backward_weights(config, world, r, pass.inputs, pass.received, g.y, g.eout);
      ASSERT_EQ(check_bits("combine_backward grad_topk_weights", grad_w[r].ptr, want_w, r, step), 0);
    }
  };

  // 2. backward out of order: the first pass's layout back (the second dispatch overwrote it)
  Grads const g1 = make_grads(p1, 100);
  ranks.restore(handles1);
  dispatch_backward(ranks, p1, g1, CombineLayout::rank_major, false, 10);
  if (::testing::Test::HasFatalFailure()) return;
  dispatch_backward(ranks, p1, g1, CombineLayout::rank_major, true, 11);
  if (::testing::Test::HasFatalFailure()) return;
  dispatch_backward(ranks, p1, g1, CombineLayout::expert_major, false, 12);
  if (::testing::Test::HasFatalFailure()) return;
  dispatch_backward(ranks, p1, g1, CombineLayout::expert_major, true, 13);
  if (::testing::Test::HasFatalFailure()) return;

  // 3. a cached dispatch of the original x: the original dispatch's outputs exactly
  poison_outputs(ranks);
  ranks.dispatch(pointers(p1.x), nullptr, nullptr, &handles1, true, nullptr, p1.received);
  {
    std::string const failure = ranks.synchronize();
    ASSERT_TRUE(failure.empty()) << "cached dispatch:\n" << failure;
    for (int r = 0; r < world; ++r)
      ASSERT_EQ(check_normal_dispatch(config, world, r, 20, p1.received[r], cuda_ep::dispatch_result(ranks[r], true),
                                      true, true),
                0);
  }

  // 4. combine_backward in both layouts (expert-major with the weight gradients)
  combine_backward(p1, handles1, g1, CombineLayout::rank_major, 30);
  if (::testing::Test::HasFatalFailure()) return;
  combine_backward(p1, handles1, g1, CombineLayout::expert_major, 31);
  if (::testing::Test::HasFatalFailure()) return;

  // entries of a local expert without a slot (a small expert_capacity) got 0; such entries must exist in the rows
  // whose capacity is meant to drop slots (kDropCapacity; a larger one only sizes the layout)
  if (spec.capacity > 0 && spec.capacity <= kDropCapacity) {
    int dropped = 0;
    for (int r = 0; r < world; ++r) dropped += p1.received[r].dropped_slots;
    EXPECT_GT(dropped, 0) << "capacity=" << spec.capacity << " dropped no slot: the row tests nothing";
  }

  // 5. a check that can fail: the same expert-major rows against a reference where rank 0's weights are doubled (its
  //    rows take the first slots of its own experts, so some of them have a slot whatever the capacity)
  {
    std::vector<ref::RankInput> perturbed = p1.inputs;
    for (float& w : perturbed[0].topk_weights) w *= 2.0f;
    if (tokens[0] > 0) {
      int differs = 0;
      for (int r = 0; r < world; ++r) {
        std::vector<uint16_t> const rows =
            ref::combine_backward_rows(config, world, r, perturbed, p1.received, g1.y, CombineLayout::expert_major);
        differs += check_slots("(expected) perturbed-weight rows", config, world, p1.received[r],
                               cuda_ep::dispatch_result(ranks[r], true).expert_x, rows, r, 32) != 0;
      }
      EXPECT_GT(differs, 0) << "a doubled weight went unnoticed by the expert_x comparison";
      std::printf(
          "negative check: a doubled weight is reported by %d rank(s) (the mismatch lines above are expected)\n",
          differs);
    }
  }

  // 6. the second handle, after the first became current again: restored, then both backward legs
  Grads const g2 = make_grads(p2, 200);
  ranks.restore(handles2);
  dispatch_backward(ranks, p2, g2, CombineLayout::expert_major, false, 40);
  if (::testing::Test::HasFatalFailure()) return;
  combine_backward(p2, handles2, g2, CombineLayout::expert_major, 41);
  if (::testing::Test::HasFatalFailure()) return;

  // 7. the backward calls of the first handle captured in one graph per rank, replayed twice
  {
    std::vector<cudaGraphExec_t> execs(world, nullptr);
    Grads const g = make_grads(p1, 300);
    CK(cudaDeviceSynchronize());
    for (int r = 0; r < world; ++r) {
      Buffers const& b = ranks[r];
      cudaStream_t const s = ranks.stream(r);
      cuda_ep::HandleLayout const hl = cuda_ep::make_handle_layout(config, world, kOneNode);
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      cuda_ep::launch_restore_handle(b, handles1[r].ptr, tokens[r], true, s);
      CombineArgs const cargs{CombineLayout::expert_major, grad_em[r].ptr, y[r].ptr, false};
      cuda_ep::launch_combine(b, cargs, cuda_ep::plan_combine(b, tokens[r]), tokens[r], s, false, nullptr,
                              cuda_ep::CombineVariant{true, true});
      DispatchArgs cached;
      cached.x = grad_y[r].ptr;
      cached.num_tokens = tokens[r];
      cached.topk_idx = static_cast<char*>(handles1[r].ptr) + hl.topk_idx;
      cached.topk_idx_type = IndexType::int32;
      cached.topk_weights = reinterpret_cast<float const*>(static_cast<char*>(handles1[r].ptr) + hl.topk_weights);
      cached.expand = true;
      cuda_ep::launch_dispatch(b, cached, cuda_ep::plan_dispatch(b, tokens[r]), s);
      cuda_ep::launch_expand(b, true, s, /*skip_rows=*/true);
      cuda_ep::launch_weight_grad(b, eout[r].ptr, static_cast<float*>(grad_w[r].ptr), tokens[r], false, s);
      cudaGraph_t graph = nullptr;
      CK(cudaStreamEndCapture(s, &graph));
      CK(cudaGraphInstantiate(&execs[r], graph, 0));
      CK(cudaGraphDestroy(graph));
    }
    for (int replay = 0; replay < 2; ++replay) {
      poison_outputs(ranks);
      for (int r = 0; r < world; ++r) CK(cudaGraphLaunch(execs[r], ranks.stream(r)));
      ranks.expect_drops(p1.received);  // the replay's expand
      std::string const failure = ranks.synchronize();
      ASSERT_TRUE(failure.empty()) << "graph replay " << replay << ":\n" << failure;
      for (int r = 0; r < world; ++r) {
        std::vector<float> const want_x =
            ref::dispatch_backward(config, world, r, p1.inputs, p1.received, g.em, CombineLayout::expert_major);
        ASSERT_EQ(check_bits("graph dispatch_backward grad_x fp32", y[r].ptr, want_x, r, 50 + replay), 0);
        std::vector<uint16_t> const rows =
            ref::combine_backward_rows(config, world, r, p1.inputs, p1.received, g.y, CombineLayout::expert_major);
        ASSERT_EQ(check_slots("graph combine_backward expert_x", config, world, p1.received[r], ranks[r].expert_x, rows,
                              r, 50 + replay),
                  0);
        std::vector<float> const want_w =
            ref::combine_backward_weights(config, world, r, p1.inputs, p1.received, g.y, g.eout);
        ASSERT_EQ(check_bits("graph grad_topk_weights", grad_w[r].ptr, want_w, r, 50 + replay), 0);
      }
    }
    for (cudaGraphExec_t exec : execs) CK(cudaGraphExecDestroy(exec));
  }

  // 8. a second buffer of another hidden size on the first buffer's handle: restored, dispatch_backward, and a cached
  //    dispatch equal to a dispatch of the same routing at that hidden
  {
    EpConfig user2 = user;
    user2.hidden = hidden + 512;
    user2.validate(world);
    EpConfig const config2 = user2.resolved(world);
    ASSERT_EQ(cuda_ep::make_handle_layout(config2, world, kOneNode).total, handle_bytes)
        << "a handle fits every hidden size";
    BackwardRanks ranks2(config2, world, num_ctas, spec.protocol, spec.timeout_s(), tokens);
    Pass p1b;  // pass 1's routing, rows of the second hidden
    p1b.inputs = p1.inputs;
    for (int r = 0; r < world; ++r) p1b.inputs[r].x = generate_tokens(spec.seed + 400, r, tokens[r], config2.hidden);
    for (int r = 0; r < world; ++r) {
      p1b.received.push_back(ref::dispatch(config2, world, r, p1b.inputs));  // every rank's rows of the new hidden
      p1b.x.emplace_back(p1b.inputs[r].x.size() * 2);
      upload(p1b.x[r], p1b.inputs[r].x);
    }
    auto grad2 =
        per_rank_buffers(world, [&](int) { return config2.recv_capacity(world) * std::size_t(config2.hidden) * 2; });
    std::vector<std::vector<uint16_t>> g2rm;
    for (int r = 0; r < world; ++r) {
      g2rm.push_back(generate_tokens(spec.seed + 500, r, p1b.received[r].num_recv, config2.hidden));
      upload(grad2[r], g2rm[r]);
    }
    auto y2 = per_rank_buffers(world, [&](int r) { return (std::size_t(tokens[r]) * config2.hidden + kGuard) * 2; });
    CK(cudaDeviceSynchronize());
    for (int r = 0; r < world; ++r) poison(y2[r]);
    CK(cudaDeviceSynchronize());
    ranks2.restore(handles1);
    ranks2.combine_unweighted(CombineLayout::rank_major, grad2, y2, false);
    std::string failure = ranks2.synchronize();
    ASSERT_TRUE(failure.empty()) << "second buffer, dispatch_backward:\n" << failure;
    for (int r = 0; r < world; ++r) {
      std::vector<float> const want =
          ref::dispatch_backward(config2, world, r, p1b.inputs, p1b.received, g2rm, CombineLayout::rank_major);
      ASSERT_EQ(check_bits("second buffer grad_x", y2[r].ptr, to_bf16(want), r, 60), 0);
    }
    CK(cudaDeviceSynchronize());
    for (int r = 0; r < world; ++r) poison_normal_dispatch(config2, world, cuda_ep::dispatch_result(ranks2[r], true));
    CK(cudaDeviceSynchronize());
    ranks2.dispatch(pointers(p1b.x), nullptr, nullptr, &handles1, true, nullptr, p1b.received);
    failure = ranks2.synchronize();
    ASSERT_TRUE(failure.empty()) << "second buffer, cached dispatch:\n" << failure;
    for (int r = 0; r < world; ++r)
      ASSERT_EQ(check_normal_dispatch(config2, world, r, 61, p1b.received[r], cuda_ep::dispatch_result(ranks2[r], true),
                                      true, true),
                0);
  }
  std::printf("world %d: every backward output exact on every rank\n", world);
}

void run_rows(std::vector<std::vector<std::string>> const& table) {
  run_virtual_rows(table, cuda_ep::kMaxLandCtas, parse_spec, user_config, run_backward);
}

// The rows of one world: the count exchange with masked entries and uneven tokens (0 included), every entry with a
// slot, and a small batch (the landing zone where it applies) with an expert capacity small enough to drop slots.
std::vector<std::vector<std::string>> rows_of_world(int world) {
  std::string const w = "world=" + std::to_string(world);
  return {
      {w, "protocol=counts", "tokens=96,0,37,128", "hidden=4096", "topk=8", "experts=64", "mask=0.2", "capacity=256"},
      {w, "protocol=auto", "tokens=48,17", "hidden=2048", "topk=6", "experts=32", "capacity=4"},
  };
}

TEST(BackwardVirtualRanks, World1) {
  run_rows(rows_of_world(1));
}

TEST(BackwardVirtualRanks, World2) {
  run_rows(rows_of_world(2));
}

TEST(BackwardVirtualRanks, World4) {
  run_rows(rows_of_world(4));
}

TEST(BackwardVirtualRanks, World8) {
  run_rows(rows_of_world(8));
}

}  // namespace test_backward_virtual
}  // namespace ferry::test
