// Host side of rank masking in low-latency mode (ll/mask.cuh): the agreement's launch, the mask words, clear_mask's
// steps.
#include <type_traits>

#include "core/cuda_check.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/device_memory.hpp"
#include "ep/cuda/ll/mask.cuh"

namespace ferry::cuda_ep {

void launch_ll_agreement(Buffers const& b, detail::LlMaskLeg leg, cudaStream_t stream) {
  FERRY_CHECK(b.mask_host_device != nullptr, "the agreement of rank masking on buffers allocated without it");
  cuda_ll::LlAgreementParams p{};
  p.view = b.view;
  // the ranks of this node by local index (across nodes a world is wider than an Lsa holds)
  p.net = transport::make_node_lsa(b.sym, b.rank, ll_ranks_per_node(b));
  LlMaskArea const area = ll_mask_area(b.layout.total, b.world);
  p.arrive = area.arrive;
  p.estimates = area.estimates;
  p.outbox = area.outbox;
  p.arrive_signals = area.arrive_signals;
  p.estimate_signals = area.estimate_signals;
  p.local = ll_ranks_per_node(b);
  p.words = detail::rank_words(b.world);
  p.stride = ll_mask_set_stride(b.world);
  p.state = b.state;
  p.host = b.mask_host_device;
  p.leg = leg;
  p.send_seq = leg == detail::LlMaskLeg::dispatch ? b.state->ll.dispatch_send_seq : b.state->ll.combine_send_seq;
  auto const launch = [&](auto const& network) {
    using Net = std::decay_t<decltype(network)>;
    cuda_ll::NetParams<cuda_ll::LlAgreementParams, Net> params{};
    static_cast<cuda_ll::LlAgreementParams&>(params) = p;
    if constexpr (cuda_ll::kAcrossNodes<Net>) params.network = network;
    cuda_ll::ll_agreement_kernel<Net><<<1, cuda_ll::agreement_threads(b.world), 0, stream>>>(params);
  };
  if (b.layout.nodes <= 1)
    launch(cuda_ll::OneNode{});
  else  // thread s opens endpoint s (the legs' endpoints, idle between kernels on the stream; each closes its own)
    with_mask_networks(b, "rank masking's agreement", [&](auto const&, auto const& agreement) { launch(agreement); });
  FERRY_CHECK_CUDA(cudaGetLastError());
}

detail::LlMaskWords read_ll_mask(Buffers const& b, cudaStream_t stream) {
  detail::LlMaskWords words{};
  FERRY_CHECK_CUDA(cudaMemcpyAsync(&words, &b.state->ll.mask, detail::kMaskWordsRead, cudaMemcpyDeviceToHost, stream));
  FERRY_CHECK_CUDA(cudaStreamSynchronize(stream));
  return words;
}

void request_ll_mask(Buffers const& b, std::vector<int> const& ranks) {
  FERRY_CHECK(b.mask_host != nullptr, "mask_ranks on buffers allocated without rank masking");
  auto* const request = reinterpret_cast<uint32_t volatile*>(b.mask_host->request);
  for (int r : ranks) {
    FERRY_CHECK(r >= 0 && r < b.world, "request_ll_mask: rank ", r, " is outside [0, ", b.world, ")");
    request[r / 32] = request[r / 32] | 1u << (r % 32);
  }
}

detail::LlCallCounters ll_call_counters(Buffers const& b, cudaStream_t stream) {
  uint64_t seq[4] = {0, 0, 0, 0};
  DeviceState* const s = b.state;
  for (auto [i, word] : {std::pair{0, s->ll.dispatch_send_seq}, std::pair{1, s->ll.dispatch_recv_seq},
                         std::pair{2, s->ll.combine_send_seq}, std::pair{3, s->ll.combine_recv_seq}})
    FERRY_CHECK_CUDA(cudaMemcpyAsync(&seq[i], word, sizeof(uint64_t), cudaMemcpyDeviceToHost, stream));
  detail::LlMaskWords const words = read_ll_mask(b, stream);
  return detail::LlCallCounters{std::max(seq[0], seq[1]), std::max(seq[2], seq[3]), words.epoch};
}

void reset_ll_mask(Buffers const& b, detail::LlCallCounters const& to, cudaStream_t stream) {
  cuda_ll::LlMaskResetParams p{};
  p.state = b.state;
  char* const region = b.sym.peer(b.rank);
  p.dispatch_arrivals = reinterpret_cast<uint64_t*>(region + b.layout.ll.dispatch_arrivals);
  p.combine_arrivals = reinterpret_cast<uint64_t*>(region + b.layout.ll.combine_arrivals);
  p.host = b.mask_host_device;
  p.world = b.world;
  p.rank = b.rank;
  p.local = ll_ranks_per_node(b);
  p.num_ctas = b.num_ctas;
  p.to = to;
  cuda_ll::ll_mask_reset_kernel<<<1, kMaxLlCtas, 0, stream>>>(p);
  FERRY_CHECK_CUDA(cudaGetLastError());
}

namespace {

// The Params of ll_counters_kernel for this rank, and the launch of one step over with_mask_networks' networks.
cuda_ll::LlCounterParams counter_params(Buffers const& b, detail::LlCallCounters const& to) {
  cuda_ll::LlCounterParams p{};
  p.view = b.view;
  p.local = b.layout.local;
  LlMaskArea const area = ll_mask_area(b.layout.total, b.world);
  uint64_t const per_call = static_cast<uint64_t>(b.num_ctas);
  p.counters[0] = b.layout.ll.dispatch_arrivals;
  p.target[0] = to.dispatch_seq * per_call;
  p.counters[1] = b.layout.ll.combine_arrivals;
  p.target[1] = to.combine_seq * per_call;
  // the agreement's: its arrivals count agreements, and each round's estimates hold the agreement of their last word
  for (int k = 2; k < cuda_ll::kNetworkCounters; ++k) {
    p.counters[k] = k == 2 ? area.arrive_signals
                           : area.estimate_signals + static_cast<std::size_t>(k - 3) * b.world * sizeof(uint64_t);
    p.target[k] = to.epoch;
  }
  return p;
}

template <cuda_ll::LlCounterStep kStep>
void launch_counters(Buffers const& b, cuda_ll::LlCounterParams const& base, cudaStream_t stream) {
  auto const launch = [&](auto const& legs, auto const& agreement) {
    using Net = std::decay_t<decltype(legs)>;
    cuda_ll::LlCounterNets<Net> p{};
    static_cast<cuda_ll::LlCounterParams&>(p) = base;
    p.legs = legs;
    p.agreement = agreement;
    cuda_ll::ll_counters_kernel<Net, kStep><<<1, cuda_ll::agreement_threads(b.world), 0, stream>>>(p);
  };
  with_mask_networks(b, "clear_mask", launch);
  FERRY_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

std::vector<uint64_t> read_network_counters(Buffers const& b, cudaStream_t stream) {
  std::size_t const n = static_cast<std::size_t>(cuda_ll::kNetworkCounters) * b.world;
  std::vector<uint64_t> out(n, 0);
  if (b.layout.nodes <= 1) return out;
  cuda_ll::LlCounterParams p = counter_params(b, detail::LlCallCounters{});
  p.read = detail::device_zeroed<uint64_t>(n);
  try {
    launch_counters<cuda_ll::LlCounterStep::read>(b, p, stream);
    FERRY_CHECK_CUDA(cudaMemcpyAsync(out.data(), p.read, n * sizeof(uint64_t), cudaMemcpyDeviceToHost, stream));
    FERRY_CHECK_CUDA(cudaStreamSynchronize(stream));
  } catch (...) {
    detail::device_free(p.read);
    throw;
  }
  detail::device_free(p.read);
  return out;
}

void realign_network_counters(Buffers const& b, detail::LlCallCounters const& to,
                              std::vector<std::vector<uint64_t>> const& counters, cudaStream_t stream) {
  if (b.layout.nodes <= 1) return;
  FERRY_CHECK(static_cast<int>(counters.size()) == b.world, "realign_network_counters needs every rank's counters");
  cuda_ll::LlCounterParams p = counter_params(b, to);
  std::size_t const world = static_cast<std::size_t>(b.world);
  std::vector<uint64_t> add(static_cast<std::size_t>(cuda_ll::kNetworkCounters) * world, 0);
  for (int d = 0; d < b.world; ++d) {
    if (d / b.layout.local == b.rank / b.layout.local) continue;
    for (int k = 0; k < cuda_ll::kNetworkCounters; ++k) {
      uint64_t const has = counters[static_cast<std::size_t>(d)][static_cast<std::size_t>(k) * world + b.rank];
      // NOTE: the targets are the largest counters of everyone, and a counter only ever holds what its source sent
      FERRY_CHECK(has <= p.target[k], "rank ", d, "'s counter ", k, " of rank ", b.rank, " holds ", has,
                  ", past the target ", p.target[k]);
      add[static_cast<std::size_t>(k) * world + d] = p.target[k] - has;
    }
  }
  // NOTE: no sync here: every rank's add must be launched before any rank's wait can end (the caller launches all)
  FERRY_CHECK(b.mask_counter_add != nullptr,
              "realign_network_counters on buffers allocated without masking across nodes");
  FERRY_CHECK_CUDA(
      cudaMemcpyAsync(b.mask_counter_add, add.data(), add.size() * sizeof(uint64_t), cudaMemcpyHostToDevice, stream));
  p.add = b.mask_counter_add;
  launch_counters<cuda_ll::LlCounterStep::add>(b, p, stream);
  launch_counters<cuda_ll::LlCounterStep::wait>(b, p, stream);
}

}  // namespace ferry::cuda_ep
