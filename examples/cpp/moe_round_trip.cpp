// One MoE layer's round trip through Ferry, built against the installed package (find_package(Ferry)): every rank
// dispatches its tokens to the ranks of their top-k experts, the experts return their input (identity), and combine
// sums the weighted outputs back into each token's row. The weights of a token sum to 1, so y must equal x up to
// the bf16 rounding of the partial sums (bound below); the program checks every element and exits non-zero otherwise.
//
//   ./moe_round_trip          two ranks as threads of this process on the cpu backend: runs on any machine
//   ./moe_round_trip --cuda   one rank per process on the cuda backend (a build of Ferry with it): alone it is a
//                             world of one GPU; for more, start it with a launcher that sets the torchrun variables:
//                             ferry launch --nproc 2 ./moe_round_trip --cuda (or torchrun ... --no-python)
#include <ferry/ep.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if FERRY_EXAMPLE_CUDA
#include <cuda_runtime.h>
#endif

namespace {

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

ferry::EpConfig layer_config(int world) {
  ferry::EpConfig config;
  config.hidden = 2048;
  config.num_experts = 16 * world;
  config.topk = 4;
  config.max_tokens_per_rank = 64;
  config.expert_capacity = world * config.max_tokens_per_rank;  // the worst case: no slot can be dropped
  return config;
}

// A rank's inputs: random rows, topk distinct experts per token, weights that sum to 1.
struct Inputs {
  std::vector<uint16_t> x;  // [tokens, hidden] bf16 bits
  std::vector<int64_t> topk_idx;
  std::vector<float> topk_weights;
};

Inputs make_inputs(ferry::EpConfig const& config, int rank, int num_tokens, uint64_t seed) {
  std::mt19937_64 rng(seed + static_cast<uint64_t>(rank));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.1f, 1.0f);
  std::size_t const topk = static_cast<std::size_t>(config.topk);
  Inputs in;
  in.x.resize(static_cast<std::size_t>(num_tokens) * config.hidden);
  for (auto& element : in.x) element = bf16_bits(normal(rng));
  in.topk_idx.resize(static_cast<std::size_t>(num_tokens) * topk);
  in.topk_weights.resize(in.topk_idx.size());
  std::vector<int> experts(static_cast<std::size_t>(config.num_experts));
  for (int e = 0; e < config.num_experts; ++e) experts[static_cast<std::size_t>(e)] = e;
  for (std::size_t t = 0; t < static_cast<std::size_t>(num_tokens); ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    float sum = 0.0f;
    for (std::size_t k = 0; k < topk; ++k) sum += in.topk_weights[t * topk + k] = uniform(rng);
    for (std::size_t k = 0; k < topk; ++k) {
      in.topk_idx[t * topk + k] = experts[k];
      in.topk_weights[t * topk + k] /= sum;
    }
  }
  return in;
}

// "" when every element of y is x within the bound, else the first that is not.
std::string check(int rank, std::vector<uint16_t> const& x, std::vector<uint16_t> const& y, int hidden) {
  for (std::size_t i = 0; i < y.size(); ++i) {
    float const want = bf16_value(x[i]);
    float const have = bf16_value(y[i]);
    // Each rank rounds its partial sum (w of its experts times x) to bf16 for the way back (unit roundoff u = 2^-8,
    // errors at most u |x| in all since the partials' weights sum to 1), and y is rounded once more: |y - x| <= 2u |x|.
    if (!(std::fabs(have - want) <= std::ldexp(std::fabs(want), -7)))
      return "rank " + std::to_string(rank) + ": token " + std::to_string(i / hidden) + " element " +
             std::to_string(i % hidden) + ": y " + std::to_string(have) + ", x " + std::to_string(want);
  }
  return "";
}

// cpu backend: host pointers, every call synchronous.
std::string round_trip_cpu(std::unique_ptr<ferry::Bootstrap> bootstrap, int num_tokens, uint64_t seed) {
  std::shared_ptr<ferry::Communicator> comm =
      ferry::Communicator::create(std::move(bootstrap), {.backend = ferry::Backend::cpu});
  ferry::EpConfig const config = layer_config(comm->world());
  ferry::EpBuffer buffer(comm, config);  // collective: every rank constructs its buffer
  Inputs const in = make_inputs(config, comm->rank(), num_tokens, seed);

  ferry::DispatchArgs args;
  args.x = in.x.data();
  args.num_tokens = num_tokens;
  args.topk_idx = in.topk_idx.data();
  args.topk_weights = in.topk_weights.data();
  args.expand = true;  // expert-major rows: expert_x[local expert, slot, hidden]
  ferry::DispatchResult const got = buffer.dispatch(args);

  // the experts: identity, so their outputs are expert_x itself
  std::vector<uint16_t> y(in.x.size(), 0xFFFFu);  // NaN until combine writes it
  buffer.combine({.layout = ferry::CombineLayout::expert_major, .x = got.expert_x, .y = y.data()});
  std::printf("rank %d: %d tokens out, %lld rows in\n", comm->rank(), num_tokens,
              static_cast<long long>(got.num_recv_host));
  return check(comm->rank(), in.x, y, config.hidden);
}

#if FERRY_EXAMPLE_CUDA
#define CUDA_OK(expr)                                                                                         \
  do {                                                                                                        \
    cudaError_t const e_ = (expr);                                                                            \
    if (e_ != cudaSuccess) throw std::runtime_error(std::string(#expr " failed: ") + cudaGetErrorString(e_)); \
  } while (0)

// cuda backend, this process's GPU: device buffers and a stream. Eager calls (the default) synchronise and raise a
// device-side error at once; a captured graph would pass eager = false and call comm->check_errors() later.
std::string round_trip_cuda(uint64_t seed) {
  ferry::SocketBootstrapOptions options;  // a world of one unless a launcher set the torchrun variables
  if (std::getenv("WORLD_SIZE") != nullptr) options = ferry::socket_bootstrap_options_from_env();
  std::shared_ptr<ferry::Communicator> comm =
      ferry::Communicator::create(ferry::make_socket_bootstrap(options), {.backend = ferry::Backend::cuda});
  CUDA_OK(cudaSetDevice(comm->device()));
  ferry::EpConfig const config = layer_config(comm->world());
  ferry::EpBuffer buffer(comm, config);
  int const num_tokens = comm->rank() % 2 == 0 ? 48 : 29;
  Inputs const in = make_inputs(config, comm->rank(), num_tokens, seed);

  std::size_t const x_bytes = in.x.size() * 2;
  void *x = nullptr, *idx = nullptr, *w = nullptr, *y = nullptr;
  CUDA_OK(cudaMalloc(&x, x_bytes));
  CUDA_OK(cudaMalloc(&idx, in.topk_idx.size() * 8));
  CUDA_OK(cudaMalloc(&w, in.topk_weights.size() * 4));
  CUDA_OK(cudaMalloc(&y, x_bytes));
  CUDA_OK(cudaMemcpy(x, in.x.data(), x_bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(idx, in.topk_idx.data(), in.topk_idx.size() * 8, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(w, in.topk_weights.data(), in.topk_weights.size() * 4, cudaMemcpyHostToDevice));
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  ferry::DispatchArgs args;
  args.x = x;
  args.num_tokens = num_tokens;
  args.topk_idx = idx;
  args.topk_weights = static_cast<float const*>(w);
  args.expand = true;
  ferry::DispatchResult const got = buffer.dispatch(args, stream);
  CUDA_OK(cudaMemsetAsync(y, 0xFF, x_bytes, stream));  // NaN until combine writes it
  buffer.combine({.layout = ferry::CombineLayout::expert_major, .x = got.expert_x, .y = y}, stream);

  std::vector<uint16_t> y_host(in.x.size());
  CUDA_OK(cudaMemcpy(y_host.data(), y, x_bytes, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaStreamDestroy(stream));
  for (void* ptr : {x, idx, w, y}) CUDA_OK(cudaFree(ptr));
  std::printf("rank %d (GPU %d): %d tokens out, %lld rows in\n", comm->rank(), comm->device(), num_tokens,
              static_cast<long long>(got.num_recv_host));
  return check(comm->rank(), in.x, y_host, config.hidden);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  bool const cuda = argc > 1 && std::string(argv[1]) == "--cuda";
  uint64_t const seed = std::random_device{}();
  std::vector<std::string> failures;
  if (cuda) {
#if FERRY_EXAMPLE_CUDA
    std::printf("Ferry %s, cuda backend, seed %llu\n", FERRY_VERSION, static_cast<unsigned long long>(seed));
    try {
      failures.push_back(round_trip_cuda(seed));
    } catch (std::exception const& error) {  // ferry::Error (ConfigError, InputError, TimeoutError, ...) or CUDA
      failures.push_back(error.what());
    }
#else
    std::fprintf(stderr, "--cuda: this Ferry was built without the cuda backend\n");
    return 2;
#endif
  } else {
    int const world = 2;
    std::printf("Ferry %s, %d ranks (threads, cpu backend), seed %llu\n", FERRY_VERSION, world,
                static_cast<unsigned long long>(seed));
    auto bootstraps = ferry::make_local_bootstraps(world);
    failures.resize(world);
    std::vector<std::thread> ranks;
    for (int r = 0; r < world; ++r)
      ranks.emplace_back([&, r] {
        try {
          failures[static_cast<std::size_t>(r)] =
              round_trip_cpu(std::move(bootstraps[static_cast<std::size_t>(r)]), r == 0 ? 48 : 29, seed);
        } catch (std::exception const& error) {
          failures[static_cast<std::size_t>(r)] = std::string("rank ") + std::to_string(r) + ": " + error.what();
        }
      });
    for (auto& rank : ranks) rank.join();
  }
  int code = 0;
  for (auto const& failure : failures)
    if (!failure.empty()) {
      std::fprintf(stderr, "%s\n", failure.c_str());
      code = 1;
    }
  if (code == 0) std::printf("y == x on every rank\n");
  return code;
}
