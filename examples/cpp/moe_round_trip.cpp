// One MoE layer's round trip through Ferry, built against the installed package (find_package(Ferry)): every rank
// dispatches its tokens to the ranks of their top-k experts, the experts return their input (identity), and combine
// sums the weighted outputs back into each token's row. The weights of a token sum to 1, so y must equal x up to
// the bf16 rounding of the partial sums (bound below); the program checks every element and exits non-zero otherwise.
//
// The ranks are threads on the cpu backend, so it runs on any machine. On GPUs the calls are the same, one process
// per GPU (torchrun or `ferry`'s launcher: make_socket_bootstrap(socket_bootstrap_options_from_env())), with
// Backend::cuda, device pointers and a stream (README, "Using it from C++").
#include <ferry/ep.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int kWorld = 2;

uint16_t bf16_bits(float value) {  // round to nearest even (the inputs are finite)
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

float bf16_value(uint16_t bits) {
  uint32_t const wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, 4);
  return value;
}

// Returns "" when every element of y matched x, else what did not.
std::string run_rank(std::unique_ptr<ferry::Bootstrap> bootstrap, ferry::EpConfig const& config, int num_tokens,
                     uint64_t seed) {
  std::shared_ptr<ferry::Communicator> comm =
      ferry::Communicator::create(std::move(bootstrap), {.backend = ferry::Backend::cpu});
  ferry::EpBuffer buffer(comm, config);  // collective: every rank constructs its buffer

  // inputs: random rows, topk distinct experts per token, weights that sum to 1
  std::mt19937_64 rng(seed + static_cast<uint64_t>(comm->rank()));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.1f, 1.0f);
  std::size_t const hidden = static_cast<std::size_t>(config.hidden);
  std::vector<uint16_t> x(static_cast<std::size_t>(num_tokens) * hidden);
  for (auto& element : x) element = bf16_bits(normal(rng));
  std::vector<int64_t> topk_idx(static_cast<std::size_t>(num_tokens) * config.topk);
  std::vector<float> topk_weights(topk_idx.size());
  std::vector<int> experts(static_cast<std::size_t>(config.num_experts));
  for (int e = 0; e < config.num_experts; ++e) experts[static_cast<std::size_t>(e)] = e;
  for (int t = 0; t < num_tokens; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    float sum = 0.0f;
    for (int k = 0; k < config.topk; ++k)
      sum += topk_weights[static_cast<std::size_t>(t) * config.topk + k] = uniform(rng);
    for (int k = 0; k < config.topk; ++k) {
      topk_idx[static_cast<std::size_t>(t) * config.topk + k] = experts[static_cast<std::size_t>(k)];
      topk_weights[static_cast<std::size_t>(t) * config.topk + k] /= sum;
    }
  }

  ferry::DispatchArgs args;
  args.x = x.data();
  args.num_tokens = num_tokens;
  args.topk_idx = topk_idx.data();
  args.topk_weights = topk_weights.data();
  args.expand = true;  // expert-major rows: expert_x[local expert, slot, hidden]
  ferry::DispatchResult const got = buffer.dispatch(args);

  // the experts: identity, so their outputs are expert_x itself
  std::vector<uint16_t> y(x.size(), 0xFFFFu);  // NaN until combine writes it
  buffer.combine({.layout = ferry::CombineLayout::expert_major, .x = got.expert_x, .y = y.data()});

  for (std::size_t i = 0; i < y.size(); ++i) {
    float const want = bf16_value(x[i]);
    float const have = bf16_value(y[i]);
    // Each rank rounds its partial sum (w of its experts times x) to bf16 for the way back (unit roundoff u = 2^-8,
    // errors at most u |x| in all since the partials' weights sum to 1), and y is rounded once more: |y - x| <= 2u |x|.
    if (!(std::fabs(have - want) <= std::ldexp(std::fabs(want), -7)))
      return "rank " + std::to_string(comm->rank()) + ": token " + std::to_string(i / hidden) + " element " +
             std::to_string(i % hidden) + ": y " + std::to_string(have) + ", x " + std::to_string(want);
  }
  std::printf("rank %d: %d tokens out, %lld rows in, %d tokens back: y == x\n", comm->rank(), num_tokens,
              static_cast<long long>(got.num_recv_host), num_tokens);
  return "";
}

}  // namespace

int main() {
  ferry::EpConfig config;
  config.hidden = 2048;
  config.num_experts = 16;
  config.topk = 4;
  config.max_tokens_per_rank = 64;
  config.expert_capacity = kWorld * config.max_tokens_per_rank;  // the worst case: no slot can be dropped
  uint64_t const seed = std::random_device{}();
  std::printf("Ferry %s, %d ranks (threads, cpu backend), seed %llu\n", FERRY_VERSION, kWorld,
              static_cast<unsigned long long>(seed));

  auto bootstraps = ferry::make_local_bootstraps(kWorld);
  std::vector<std::string> failures(kWorld);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r)
    ranks.emplace_back([&, r] {
      try {
        failures[static_cast<std::size_t>(r)] =
            run_rank(std::move(bootstraps[static_cast<std::size_t>(r)]), config, r == 0 ? 48 : 29, seed);
      } catch (std::exception const& error) {  // ferry::Error: ConfigError, InputError, TimeoutError, ...
        failures[static_cast<std::size_t>(r)] = std::string("rank ") + std::to_string(r) + ": " + error.what();
      }
    });
  for (auto& rank : ranks) rank.join();
  int code = 0;
  for (auto const& failure : failures)
    if (!failure.empty()) {
      std::fprintf(stderr, "%s\n", failure.c_str());
      code = 1;
    }
  return code;
}
